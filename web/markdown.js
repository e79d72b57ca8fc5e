// Model replies as HTML: marked (CommonMark + GFM) parses, highlight.js colours code
// blocks, DOMPurify sanitizes the result. All three are vendored (web/vendor/, see its
// README): the page has no build step and never loads anything from another origin.
// Safety: a reply is untrusted text. Whatever HTML it holds passes through DOMPurify;
// nothing that loads a resource (img, media, forms, styles) survives, because the page
// must not make requests on a model's behalf; links open in a new tab without an opener.

import { Marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.js";
import hljs from "./vendor/highlight.core.min.js";
import bash from "./vendor/highlight.bash.min.js";
import c from "./vendor/highlight.c.min.js";
import cpp from "./vendor/highlight.cpp.min.js";
import css from "./vendor/highlight.css.min.js";
import diff from "./vendor/highlight.diff.min.js";
import go from "./vendor/highlight.go.min.js";
import java from "./vendor/highlight.java.min.js";
import javascript from "./vendor/highlight.javascript.min.js";
import json from "./vendor/highlight.json.min.js";
import markdown from "./vendor/highlight.markdown.min.js";
import plaintext from "./vendor/highlight.plaintext.min.js";
import python from "./vendor/highlight.python.min.js";
import rust from "./vendor/highlight.rust.min.js";
import shell from "./vendor/highlight.shell.min.js";
import sql from "./vendor/highlight.sql.min.js";
import typescript from "./vendor/highlight.typescript.min.js";
import xml from "./vendor/highlight.xml.min.js";
import yaml from "./vendor/highlight.yaml.min.js";

const LANGUAGES = { bash, c, cpp, css, diff, go, java, javascript, json, markdown, plaintext, python, rust,
  shell, sql, typescript, xml, yaml };
for (const [name, grammar] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, grammar);

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHTML(text) {
  return String(text).replace(/[&<>"']/g, (ch) => ESCAPES[ch]);
}

const marked = new Marked({
  gfm: true,
  breaks: true,   // models write single newlines as line breaks
  renderer: {
    // Fenced code: highlighted when the language is one we ship (no auto-detection: it would
    // run on every repaint of a streaming reply), escaped otherwise.
    code({ text, lang }) {
      const name = (lang || "").trim().split(/\s+/, 1)[0].toLowerCase();
      const known = name && hljs.getLanguage(name);
      const html = known ? hljs.highlight(text, { language: name, ignoreIllegals: true }).value : escapeHTML(text);
      const attrs = name ? ` class="hljs language-${escapeHTML(name)}" data-lang="${escapeHTML(name)}"` : ' class="hljs"';
      return `<pre><code${attrs}>${html}</code></pre>\n`;
    },
    // An image would be a request to wherever the model points: show it as a link instead.
    image({ href, text }) {
      return `<a href="${escapeHTML(href || "")}">${escapeHTML(text || href || "image")}</a>`;
    },
  },
});

const PURIFY = {
  FORBID_TAGS: ["img", "picture", "source", "video", "audio", "track", "svg", "math", "style", "form",
    "input", "button", "textarea", "select", "iframe", "object", "embed", "link", "meta"],
  FORBID_ATTR: ["style", "srcset", "action", "formaction", "background", "poster"],
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** Markdown source -> sanitized HTML string (safe to assign to innerHTML). */
export function renderMarkdown(source) {
  const html = marked.parse(String(source ?? "").replace(/\u0000/g, ""), { async: false });
  return DOMPurify.sanitize(html, PURIFY);
}

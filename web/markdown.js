// A small, safe markdown renderer for model replies.
// Safety: the source is HTML-escaped first; the only tags in the output are the
// ones built here, and links keep only http(s) and mailto targets.
// Supports: fenced code, headings, lists (nested by indentation), blockquotes,
// rules, paragraphs; inline code, bold, italic, strikethrough, links, bare URLs.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHTML(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const SAFE_URL = /^(https?:\/\/|mailto:)[^\s]+$/i;
// A bare URL ends at whitespace, a held span, or an escaped quote or angle bracket.
const BARE_URL = /\bhttps?:\/\/(?:(?!&quot;|&#39;|&lt;|&gt;)[^\s\u0000])+/g;

/** Markdown source -> HTML string (safe to assign to innerHTML). */
export function renderMarkdown(source) {
  const text = escapeHTML(String(source ?? "").replace(/\u0000/g, "").replace(/\r\n?/g, "\n"));
  return blocks(text.split("\n"));
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}&gt;\s?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = FENCE.exec(line))) {
      const close = new RegExp(`^ {0,3}${m[1][0]}{${m[1].length},}\\s*$`);
      const code = [];
      for (i++; i < lines.length && !close.test(lines[i]); i++) code.push(lines[i]);
      i++;   // the closing fence (absent while a reply is still streaming)
      const lang = m[2] ? ` class="language-${m[2]}" data-lang="${m[2]}"` : "";
      out.push(`<pre><code${lang}>${code.join("\n")}</code></pre>`);
    } else if ((m = HEADING.exec(line))) {
      const level = m[1].length;
      out.push(`<h${level}>${inline(m[2])}</h${level}>`);
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && (m = QUOTE.exec(lines[i])); i++) quoted.push(m[1]);
      out.push(`<blockquote>${blocks(quoted)}</blockquote>`);
    } else if (ITEM.test(line)) {
      i = list(lines, i, out);
    } else {
      const para = [];
      for (; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) para.push(lines[i].trim());
      out.push(`<p>${para.map(inline).join("<br>")}</p>`);
    }
  }
  return out.join("");
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

// One list starting at lines[start]; items are lines at its indentation, deeper lines belong to the item.
function list(lines, start, out) {
  const first = ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  let i = start;
  while (i < lines.length) {
    const m = ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const body = [m[3]];
    for (i++; i < lines.length; i++) {
      const l = lines[i];
      const deeper = l.length - l.trimStart().length > indent;
      if (l.trim() && !deeper) break;
      if (!l.trim() && !(i + 1 < lines.length && lines[i + 1].length - lines[i + 1].trimStart().length > indent)) break;
      body.push(l.slice(Math.min(indent + 2, l.length - l.trimStart().length)));
    }
    items.push(body.length === 1 ? inline(body[0]) : blocks(body).replace(/^<p>(.*?)<\/p>/, "$1"));
    const next = i + 1 < lines.length ? ITEM.exec(lines[i + 1]) : null;
    if (i < lines.length && !lines[i].trim() && next && next[1].length === indent) i++;   // loose list
  }
  const tag = ordered ? "ol" : "ul";
  const startAt = ordered && parseInt(first[2], 10) !== 1 ? ` start="${parseInt(first[2], 10)}"` : "";
  out.push(`<${tag}${startAt}>${items.map((x) => `<li>${x}</li>`).join("")}</${tag}>`);
  return i;
}

// Inline spans of escaped text. Finished HTML is parked in `held` so later rules cannot touch it.
function inline(text) {
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = text.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, __, code) => hold(`<code>${code.trim() || code}</code>`));
  s = s.replace(/\[([^\]\n]+)\]\(\s*([^)\s]+)\s*\)/g, (whole, label, url) =>
    SAFE_URL.test(url) ? hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`) : whole);
  s = s.replace(BARE_URL, (found) => {
    const url = found.replace(/[.,;:!?)]+$/, "");
    return hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${url}</a>`) + found.slice(url.length);
  });
  s = emphasis(s);
  for (let pass = 0; pass < 8 && s.includes("\u0000"); pass++) s = s.replace(/\u0000(\d+)\u0000/g, (_, n) => held[Number(n)]);
  return s;
}

function emphasis(s) {
  return s
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>")
    .replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>");
}

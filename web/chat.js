// The message list and what fills it: streamed replies (POST /v1/chat/completions with
// X-Session-Id, so only the new message is sent) and documents read into the session
// (POST /v1/sessions/{id}/documents, SSE progress). At most one of each per conversation.

import { ApiError, events, postJSON, request } from "./api.js";
import { el, int, rate } from "./format.js";
import { renderMarkdown } from "./markdown.js";

const STOP_WAIT_MS = 10000;
const NAME_CHARS = 200;       // the server's longest title (a file's name titles its conversation)

// A name cut to the server's title length, by characters (a cut pair of UTF-16 halves is refused).
function titled(name) {
  const chars = Array.from(name);
  return chars.length > NAME_CHARS ? chars.slice(0, NAME_CHARS - 1).join("") + "…" : name;
}   // a reply its session's stop has not ended by then: its request is left

export class Chat {
  constructor({ box, convs, heapView, ensureSession, settings, onBusy, onUnauthorized }) {
    this.box = box;
    this.convs = convs;
    this.heapView = heapView;
    this.ensureSession = ensureSession;   // () => Promise<session id>
    this.settings = settings;             // () => {model, max_tokens, temperature}
    this.onBusy = onBusy;                 // in-flight work changed
    this.onUnauthorized = onUnauthorized; // the server refused the key (401): ask for another
    this.inflight = new Map();            // session id -> {controller, kind}
    this.nodes = new WeakMap();           // message -> its element (current conversation only)
    this.pending = new Set();
    this.frame = 0;
  }

  busy(id) {
    return id ? this.inflight.get(id)?.kind ?? null : null;
  }

  /** Stop a conversation's work. A reply is stopped through its session: the server ends it at its
   *  next token and its stream is read to the end, so the reply shown is what the session keeps (a
   *  request just left would miss the tokens decoded before the server noticed); one that has ended
   *  and is being saved is read to its end too. A document, a reply still queued (nothing runs on the
   *  session yet), a stop that fails or is not answered in time, or `leave` (the conversation is being
   *  deleted): the request is left. */
  stop(id, { leave = false } = {}) {
    const work = this.inflight.get(id);
    if (!work) return;
    const abort = () => work.controller.abort();
    if (leave || work.kind !== "chat" || work.stopping) return abort();
    work.stopping = true;
    work.timer = setTimeout(abort, STOP_WAIT_MS);
    postJSON(`/v1/sessions/${encodeURIComponent(id)}/stop`, {})
      .then((r) => {
        if (r.stopped) clearTimeout(work.timer);   // it ends at its next token: read it to the end, however long its save
        else if (!r.busy) abort();                 // nothing runs on the session: the request is still queued
        // (busy, nothing stopped: its reply is ending, its turn being saved; or another runs first: the timer)
      })
      .catch(abort);
  }

  /** Show a conversation's messages (id null: a new, empty one). */
  show(id) {
    const messages = id ? this.convs.get(id).messages : [];
    this.box.replaceChildren(...messages.map((m) => this.node(m)));
    this.box.scrollTop = this.box.scrollHeight;
    return messages.length;
  }

  async send(text) {
    const id = await this.ensureSession();
    const { model, max_tokens, temperature } = this.settings();
    this.append(id, { role: "user", content: text });
    const reply = this.append(id, { role: "assistant", content: "", status: "streaming", model });
    const started = performance.now();
    let firstToken = null;
    await this.run(id, "chat", reply, async (signal) => {
      const response = await request("POST", "/v1/chat/completions", {
        sessionId: id, signal,
        body: { model, messages: [{ role: "user", content: text }], max_tokens, temperature,
                stream: true, stream_options: { include_usage: true } },
      });
      for await (const { data } of events(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(0, chunk.error.message, chunk.error.code);
        const choice = chunk.choices?.[0];
        if (choice?.delta?.content || choice?.delta?.reasoning_content) {
          firstToken ??= performance.now();
          reply.content += choice.delta.content || "";
          if (choice.delta.reasoning_content) reply.reasoning = (reply.reasoning || "") + choice.delta.reasoning_content;
          reply.tokens = (reply.tokens || 0) + 1;
          this.paint(reply);
        }
        if (choice?.finish_reason) reply.finish = choice.finish_reason;
        if (chunk.usage) reply.tokens = chunk.usage.completion_tokens;
        if (chunk.localheap?.heap) this.heapView.heap(id, chunk.localheap.heap);
        if (chunk.localheap?.speed) reply.rate = chunk.localheap.speed.decode_tokens_per_s;
        if (chunk.localheap) keepFate(reply, chunk.localheap);
      }
    });
    reply.seconds = ((performance.now() - (firstToken ?? started)) / 1000);
    this.convs.touch(id);   // saved with its speed: the footer survives a reload
    this.paint(reply);
  }

  async upload(name, text) {
    const id = await this.ensureSession();
    const doc = this.append(id, { role: "document", name, chars: text.length, status: "reading", done: 0, total: 0 });
    await this.run(id, "document", doc, async (signal) => {
      const response = await request("POST", `/v1/sessions/${encodeURIComponent(id)}/documents`,
        { signal, body: { text, name: titled(name) } });
      for await (const { event, data } of events(response)) {
        const body = JSON.parse(data);
        if (event === "progress") {
          Object.assign(doc, { done: body.done, total: body.total });
          this.paint(doc);
        } else if (event === "done") {
          const heap = body.session?.heap;
          Object.assign(doc, { tokens: body.tokens_added, done: body.tokens_added,
                               total: body.tokens_total ?? (doc.total || body.tokens_added),
                               resident: heap?.resident, capacity: heap?.capacity });
          keepFate(doc, body);
          if (heap) this.heapView.heap(id, heap);
          if (body.session) this.convs.upsert(body.session);
        } else if (event === "error") {
          throw new ApiError(0, body.error?.message || "the document could not be read");
        }
      }
    });
  }

  // Run one request for a conversation: track it, mark the message stopped or failed when it ends early.
  async run(id, kind, message, work) {
    const controller = new AbortController();
    const entry = { controller, kind };
    this.inflight.set(id, entry);
    this.convs.busy.add(id);
    this.onBusy();
    try {
      await work(controller.signal);
      message.status = message.interrupted === "stopped" ? "stopped" : "done";   // (stop: the server's word)
    } catch (e) {
      if (e.name === "AbortError") {
        message.status = "stopped";
      } else {
        message.status = "error";
        message.error = e.message || String(e);
        if (e instanceof ApiError && e.status === 401) this.onUnauthorized?.();
      }
    } finally {
      clearTimeout(entry.timer);
      this.inflight.delete(id);
      this.convs.busy.delete(id);
      this.convs.touch(id);
      this.paint(message);
      this.onBusy();
    }
  }

  append(id, message) {
    this.convs.add(id, message);
    if (id === this.convs.current) {
      const stick = this.nearBottom();
      this.box.append(this.node(message));
      if (stick || message.role !== "assistant") this.box.scrollTop = this.box.scrollHeight;
    }
    return message;
  }

  // Repaint changed messages at most once a frame (replies stream token by token).
  paint(message) {
    this.pending.add(message);
    if (!this.frame) {
      this.frame = requestAnimationFrame(() => {
        this.frame = 0;
        const stick = this.nearBottom();
        for (const m of this.pending) {
          const node = this.nodes.get(m);
          if (node?.isConnected) node.replaceWith(this.node(m));
        }
        this.pending.clear();
        if (stick) this.box.scrollTop = this.box.scrollHeight;
      });
    }
  }

  nearBottom() {
    return this.box.scrollHeight - this.box.scrollTop - this.box.clientHeight < 80;
  }

  node(m) {
    const node = m.role === "document" ? documentNode(m) : m.role === "user" ? userNode(m) : replyNode(m);
    this.nodes.set(m, node);
    return node;
  }
}

// What the server says about a finished turn: not on disk (saved: false, and why), or cut short
// by a server shutdown (interrupted). Absent on a server that keeps nothing on disk.
function keepFate(m, fields) {
  if ("saved" in fields) Object.assign(m, { saved: fields.saved, saveError: fields.save_error });
  if (fields.interrupted) m.interrupted = fields.interrupted;
}

function notSaved(m) {
  return m.saved === false
    ? el("p", { class: "msg-error", role: "status",
                text: `Not saved to disk (${m.saveError || "the disk refused it"}); kept in memory and saved when the disk takes writes again.` })
    : null;
}

function userNode(m) {
  return el("article", { class: "msg msg-user", "aria-label": "You" },
    el("div", { class: "msg-body", text: m.content }));
}

function replyNode(m) {
  const body = el("div", { class: "msg-body md" });
  body.innerHTML = renderMarkdown(m.content);   // escaped first: see markdown.js
  if (m.status === "streaming") body.append(el("span", { class: m.content ? "caret" : "typing", "aria-hidden": "true" }));
  const foot = [];
  if (m.tokens) foot.push(`${int(m.tokens)} tokens`);
  // This reply's decode speed, timed by the server from its first token to its last (the
  // browser's own timing, the fallback, sees a fast reply arrive in one burst); the heap
  // panel's figure is the engine's, over all requests and the last 5 s.
  const speed = m.rate ?? (m.seconds && m.tokens > 1 ? (m.tokens - 1) / m.seconds : null);
  if (speed) foot.push(`this reply: ${rate(speed)} tok/s`);
  if (m.status === "stopped") foot.push("stopped");
  else if (m.interrupted === "shutdown") foot.push("stopped by the server shutting down");
  else if (m.finish === "length") foot.push("hit the max-tokens limit");
  // a reasoning model's thinking (reasoning_content): shown folded, open while it is all there is
  const reasoning = m.reasoning ? el("details", { class: "msg-reasoning", open: m.status === "streaming" && !m.content ? "" : null },
    el("summary", { text: "Reasoning" }), el("div", { class: "msg-reasoning-body", text: m.reasoning })) : null;
  return el("article", { class: `msg msg-assistant ${m.status}`, "aria-label": "Model", "aria-busy": m.status === "streaming" ? "true" : null },
    el("div", { class: "msg-role", text: m.model || "model" }),
    reasoning,
    body,
    m.status === "error" ? el("p", { class: "msg-error", role: "alert", text: m.error }) : null,
    notSaved(m),
    foot.length ? el("div", { class: "msg-foot", text: foot.join(" · ") }) : null);
}

function documentNode(m) {
  const share = m.total ? Math.min(100, (m.done / m.total) * 100) : 0;
  const status = {
    reading: m.total ? `Reading… ${int(m.done)} of ${int(m.total)} tokens` : "Tokenizing…",
    done: m.interrupted ? `The server stopped after ${int(m.tokens)} of ${int(m.total)} tokens (those are kept)` :
      `Read ${int(m.tokens ?? m.total)} tokens` +
      (m.capacity ? ` · the heap holds ${int(m.resident)} of its ${int(m.capacity)} slots` : ""),
    stopped: `Stopped after ${int(m.done)} of ${int(m.total)} tokens`,
    error: `Not read: ${m.error}`,
  }[m.status];
  const bar = el("div", {
    class: "progress", role: "progressbar", "aria-label": `Reading ${m.name}`,
    "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": share.toFixed(0),
  }, el("div", { class: "progress-fill", style: `width: ${share}%` }));
  return el("article", { class: `msg msg-document ${m.status}`, "aria-label": `Document ${m.name}` },
    el("div", { class: "doc-icon", "aria-hidden": "true" }),
    el("div", { class: "doc-main" },
      el("div", { class: "doc-name", text: m.name }),
      el("div", { class: "doc-size muted small", text: `${int(m.chars)} characters` }),
      bar,
      el("div", { class: "doc-status small", role: m.status === "error" ? "alert" : null, text: status }),
      notSaved(m)));
}

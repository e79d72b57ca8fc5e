// Conversations = server sessions (the truth: tokens, heap, origin and title) + what this
// browser remembers about them (messages, in localStorage; documents by name only).
// The web UI's own sessions are listed as conversations; sessions API clients opened
// (SDKs, curl) go in a collapsed group of their own.

import { el, int, shortId } from "./format.js";

const STORE = "localheap.conversations.v1";
const GONE = "localheap.conversations.gone.v1";   // id -> when a tab forgot it: other tabs forget it too
const GONE_KEEP_MS = 7 * 24 * 3600 * 1000;
const TITLE_CHARS = 48;

export class Conversations {
  constructor(list, apiList, { onSelect, onDelete, onGone }) {
    this.list = list;
    this.apiList = apiList;
    this.onSelect = onSelect;
    this.onDelete = onDelete;
    this.onGone = onGone;       // sessions the server no longer has (deleted elsewhere, restarted)
    this.local = load();
    this.dropped = new Set();  // ids this page forgot: gone from the store at its next save
    // another tab of this browser saved: take its newer conversations (each tab saves only its own changes)
    window.addEventListener("storage", (e) => {
      if (e.key !== STORE && e.key !== GONE) return;
      this.merge(load(), load(GONE));
      this.render();
    });
    this.server = new Map();   // id -> session info
    this.current = null;
    this.busy = new Set();     // ids with a reply or a document in flight
    this.born = new Map();     // id -> when this page created it (a snapshot may predate it)
  }

  get(id) {
    if (!this.local[id]) this.local[id] = { title: null, messages: [], updated: Date.now() };
    return this.local[id];
  }

  title(id) {
    return this.server.get(id)?.title || this.local[id]?.title || (id ? `Session ${shortId(id)}` : "New conversation");
  }

  /** A web UI conversation (its own, or one this browser holds messages of), not an API session. */
  isConversation(id) {
    return this.server.get(id)?.origin === "web" || this.local[id]?.messages.length > 0;
  }

  /** Record a message; until the server's title arrives, the first user message or document names it. */
  add(id, message) {
    const conv = this.get(id);
    conv.messages.push(message);
    if (!conv.title && (message.role === "user" || message.role === "document")) {
      const text = (message.role === "document" ? message.name : message.content).replace(/\s+/g, " ").trim();
      conv.title = text.length > TITLE_CHARS ? `${text.slice(0, TITLE_CHARS - 1)}…` : text;
      this.render();
    }
    this.touch(id);
    return message;
  }

  touch(id) {
    this.get(id).updated = Date.now();
    this.save();
  }

  /** Write this page's conversations into the store, over what other tabs wrote there: per
   *  conversation the one updated last wins (a whole copy written back lost another tab's). */
  save() {
    try {
      const stored = load();
      const gone = load(GONE);
      const now = Date.now();
      for (const id of this.dropped) gone[id] = now;
      this.dropped.clear();
      for (const [id, when] of Object.entries(gone)) if (now - when > GONE_KEEP_MS) delete gone[id];
      for (const [id, conv] of Object.entries(this.local)) {
        if ((stored[id]?.updated || 0) <= conv.updated) stored[id] = conv;
      }
      this.merge(stored, gone);
      for (const id of Object.keys(stored)) if (!this.local[id]) delete stored[id];   // forgotten here or elsewhere
      localStorage.setItem(GONE, JSON.stringify(gone));
      localStorage.setItem(STORE, JSON.stringify(stored));
    } catch { /* storage full or disabled: history lives for this page only */ }
  }

  /** Take the stored conversations that are newer than this page's copies, or that it lacks; let
   *  go of those some tab forgot (deleted) after they were last updated. */
  merge(stored, gone = {}) {
    for (const [id, conv] of Object.entries(stored)) {
      if (!this.dropped.has(id) && (this.local[id]?.updated || 0) < (conv?.updated || 0)) this.local[id] = conv;
    }
    for (const [id, when] of Object.entries(gone)) {
      if (this.local[id] && (this.local[id].updated || 0) <= when) delete this.local[id];
    }
  }

  forget(id) {
    delete this.local[id];
    this.dropped.add(id);
  }

  /** The server's session list; forget local history of sessions the server no longer has. */
  setSessions(infos) {
    this.server = new Map(infos.map((s) => [s.id, s]));
    for (const id of Object.keys(this.local)) if (!this.server.has(id)) this.forget(id);
    this.save();
    this.render();
  }

  /** Live session infos from a heap snapshot: new sessions appear, counts update. */
  update(infos) {
    const same = (s) => this.server.has(s.id) && this.server.get(s.id).title === s.title;
    const known = infos.every(same) && infos.length === this.server.size;
    for (const s of infos) this.server.set(s.id, s);
    if (!known) {
      const live = new Set(infos.map((s) => s.id));
      const fresh = (id) => this.busy.has(id) || Date.now() - (this.born.get(id) || 0) < 2000;
      const gone = [...this.server.keys()].filter((id) => !live.has(id) && !fresh(id));
      for (const id of gone) {
        this.server.delete(id);
        this.forget(id);
      }
      if (gone.length) this.save();
      this.render();
      if (gone.length) this.onGone(gone);
    } else {
      for (const s of infos) this.renderCount(s);
    }
  }

  upsert(info) {
    if (!this.server.has(info.id)) this.born.set(info.id, Date.now());
    this.server.set(info.id, info);
    this.render();
  }

  remove(id) {
    this.server.delete(id);
    this.forget(id);
    this.save();
    this.render();
  }

  ordered() {
    const when = (id) => Math.max(this.local[id]?.updated || 0, (this.server.get(id)?.last_used || 0) * 1000);
    return [...this.server.keys()].sort((a, b) => when(b) - when(a));
  }

  render() {
    const ids = this.ordered();
    const mine = ids.filter((id) => this.isConversation(id));
    const api = ids.filter((id) => !this.isConversation(id));
    this.list.replaceChildren(...mine.map((id) => this.item(id)));
    this.apiList.replaceChildren(...api.map((id) => this.item(id)));
    document.getElementById("no-conversations").hidden = mine.length > 0;
    document.getElementById("api-group").hidden = api.length === 0;
    document.getElementById("api-count").textContent = api.length ? `(${int(api.length)})` : "";
  }

  item(id) {
    const info = this.server.get(id);
    const current = id === this.current;
    const select = el("button", {
      class: "conv-open", type: "button", "aria-current": current ? "page" : null,
      onclick: () => this.onSelect(id),
    },
    el("span", { class: "conv-title", text: this.title(id) }),
    el("span", { class: "conv-meta", "data-id": id, text: meta(info) }));
    const remove = el("button", {
      class: "conv-delete", type: "button", "aria-label": `Delete “${this.title(id)}”`, title: "Delete",
      onclick: (e) => this.confirmDelete(e.currentTarget, id),
    }, "×");
    return el("li", { class: current ? "conv current" : "conv", "data-id": id }, select, remove);
  }

  renderCount(info) {
    const node = this.list.parentNode.querySelector(`.conv-meta[data-id="${CSS.escape(info.id)}"]`);
    if (node) node.textContent = meta(info);
  }

  // First click arms the button, a second click within 3 s deletes (no modal dialog).
  confirmDelete(button, id) {
    if (button.dataset.armed) {
      this.onDelete(id);
      return;
    }
    button.dataset.armed = "1";
    button.textContent = "Delete?";
    button.setAttribute("aria-label", `Confirm: delete “${this.title(id)}”`);
    setTimeout(() => {
      if (!button.isConnected) return;
      delete button.dataset.armed;
      button.textContent = "×";
      button.setAttribute("aria-label", `Delete “${this.title(id)}”`);
    }, 3000);
  }
}

function meta(info) {
  if (!info) return "";
  const parts = [`${int(tokens(info))} tokens`];
  if (info.state === "spilled") parts.push("on disk");
  if (info.busy) parts.push("busy");
  return parts.join(" · ");
}

/** Tokens in a session: the heap's count runs ahead of the history while a request is running. */
export function tokens(info) {
  return Math.max(info?.tokens || 0, info?.heap?.tokens_seen || 0);
}

function load(key = STORE) {
  try {
    return JSON.parse(localStorage.getItem(key)) || {};
  } catch {
    return {};
  }
}

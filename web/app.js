// The page: wires the conversation list, the chat, the document dialog and the live
// heap view to the server. Talks only HTTP/SSE to the origin that served it.

import { ApiError, apiKey, events, getJSON, postJSON, request, setApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { Conversations, tokens } from "./conversations.js";
import { el, int } from "./format.js";
import { DocumentDialog } from "./documents.js";
import { HeapView } from "./heapview.js";
import { enableNarrowLayout, showPanel } from "./layout.js";
import { enableRename } from "./rename.js";
import { applyTheme, toggleTheme } from "./theme.js";

const $ = (id) => document.getElementById(id);
const CURRENT_STORE = "localheap.current";
const PARAMS_STORE = "localheap.params";

const state = { model: null };
const heapView = new HeapView();
const convs = new Conversations($("conversations"), $("api-sessions"), { onSelect: select, onDelete: remove, onGone: gone });
const chat = new Chat({
  box: $("messages"), convs, heapView, ensureSession, onBusy: updateComposer, onUnauthorized: () => askForKey(),
  settings: () => ({ model: state.model, max_tokens: numberInput("max-tokens", 512), temperature: numberInput("temperature", 0.7) }),
});

// ---- conversations ---------------------------------------------------------------

function select(id) {
  convs.current = id;
  if (id) localStorage.setItem(CURRENT_STORE, id);
  else localStorage.removeItem(CURRENT_STORE);
  convs.render();
  chat.show(id);
  heapView.show(id);
  updateComposer();
  renderChatMeta();
  showPanel("");
}

async function ensureSession() {
  if (convs.current) return convs.current;
  const info = await postJSON("/v1/sessions", {});
  heapView.track(info.id);
  convs.get(info.id);
  convs.upsert(info);
  select(info.id);
  return info.id;
}

async function remove(id) {
  try {
    chat.stop(id, { leave: true });
    await request("DELETE", `/v1/sessions/${encodeURIComponent(id)}`);
  } catch (e) {
    if (!(e instanceof ApiError && e.status === 404)) return notify(e);
  }
  convs.remove(id);
  heapView.forget(id);
  if (convs.current === id) select(null);
}

function gone(ids) {
  for (const id of ids) heapView.forget(id);
  if (ids.includes(convs.current)) {
    select(null);
    notify(new Error("This conversation's session no longer exists on the server (deleted elsewhere, or the server restarted)."));
  }
}

// ---- composer --------------------------------------------------------------------

function updateComposer() {
  const kind = chat.busy(convs.current);
  $("send").hidden = !!kind;
  $("stop").hidden = !kind;
  $("stop").textContent = kind === "document" ? "Stop reading" : "Stop";
  $("send").disabled = !!kind || !state.model;
  $("add-document").disabled = !!kind || !state.model;
  renderChatMeta();
}

// The chat head's token count, and what an empty message list says.
function renderChatMeta() {
  const info = convs.server.get(convs.current);
  $("chat-title").textContent = convs.title(convs.current);
  $("rename").hidden = !convs.current || !$("title-input").hidden;
  $("chat-meta").textContent = info ? `${int(tokens(info))} tokens in this session` : "";
  $("empty").hidden = !!convs.current && convs.get(convs.current).messages.length > 0;
  $("empty-new").hidden = tokens(info) > 0;
  $("empty-elsewhere").hidden = !$("empty-new").hidden;
  $("elsewhere-tokens").textContent = int(tokens(info));
}

async function submit() {
  const box = $("prompt");
  const text = box.value.trim();
  if (!text || chat.busy(convs.current) || !state.model) return;
  box.value = "";
  autosize(box);
  $("notice").hidden = true;
  try {
    await chat.send(text);
  } catch (e) {
    box.value ||= text;   // nothing was sent: give the text back
    notify(e);
  }
}

function autosize(box) {
  box.style.height = "auto";
  box.style.height = `${Math.min(box.scrollHeight, 220)}px`;
}

function numberInput(id, fallback) {
  const v = Number($(id).value);
  return Number.isFinite(v) && $(id).value !== "" ? v : fallback;
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  submit();
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    submit();
  }
});
$("prompt").addEventListener("input", (e) => autosize(e.target));
document.addEventListener("keydown", (e) => {
  if (e.key !== "Escape" || documents.open) return;
  if (document.body.dataset.panel) showPanel("");
  else if (chat.busy(convs.current)) chat.stop(convs.current);
});
$("stop").addEventListener("click", () => {
  chat.stop(convs.current);
  $("prompt").focus();
});
$("new-chat").addEventListener("click", () => {
  select(null);
  $("prompt").focus();
});
for (const id of ["max-tokens", "temperature"]) {
  $(id).addEventListener("change", () => localStorage.setItem(PARAMS_STORE, JSON.stringify({
    max_tokens: $("max-tokens").value, temperature: $("temperature").value })));
}

enableRename({ convs, onChange: renderChatMeta, onError: notify });

// ---- notices and the API key -----------------------------------------------------

let noticeTimer = 0;

function notify(error) {
  if (error instanceof ApiError && error.status === 401) return askForKey();
  const box = $("notice");
  $("notice-text").textContent = error.message || String(error);
  box.hidden = false;
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => { box.hidden = true; }, 8000);
}

$("notice-close").addEventListener("click", () => {
  $("notice").hidden = true;
  $("prompt").focus();
});

function askForKey() {
  $("key-banner").hidden = false;
  $("key-refused").hidden = !apiKey();   // a key was sent, and refused (a typo, or changed on the server)
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  setApiKey($("key-input").value.trim());
  $("key-banner").hidden = true;
  boot();
});

$("theme-toggle").addEventListener("click", toggleTheme);

// ---- documents -------------------------------------------------------------------

const documents = new DocumentDialog((name, text) => {
  $("prompt").focus();
  if (chat.busy(convs.current)) return notify(new Error("Wait until the current reply or document is done."));
  chat.upload(name, text).catch(notify);
});

// ---- server ----------------------------------------------------------------------

function showModel(card) {
  state.model = card.id;
  $("model-name").textContent = card.id;
  $("model-name").title = `Model: ${card.id}`;
  const h = card.localheap?.heap || {};
  const chips = [
    ["budget", h.budget, "Scored tokens kept per layer, beyond the sinks"],
    ["sinks", h.sinks, "First tokens of the stream, never evicted"],
    ["recent", h.recent, "Most recent tokens, never evicted"],
    ["slack", h.slack, "Append room; also the prefill chunk and the decode eviction interval"],
    ["policy", h.policy, "How the rest is ranked"],
    ["positions", h.positions, "compact: RoPE positions follow slot order; absolute: original positions"],
  ];
  if (h.profile && h.profile !== "uniform") chips.push(["profile", h.profile, "Per-layer budget profile"]);
  if (card.localheap?.backend) chips.push(["backend", card.localheap.backend, "Inference engine"]);
  $("model-settings").replaceChildren(...chips.filter(([, v]) => v !== undefined).map(([k, v, help]) =>
    el("li", { class: "chip", "data-key": k, title: help }, el("span", { class: "chip-key", text: k }), ` ${typeof v === "number" ? int(v) : v}`)));
  heapView.setModel(card);
  updateComposer();
}

function setLive(mode) {
  const node = $("live");
  node.dataset.state = mode;
  node.textContent = mode === "offline" ? "reconnecting" : mode;
}

// One event stream per visible tab: browsers allow ~6 connections per host, so hidden tabs let theirs go.
let heapStream = null;
let heapLimitSaid = false;

async function followHeap() {
  if (heapStream || document.hidden) return;
  const stream = new AbortController();
  heapStream = stream;
  for (let delay = 500; !stream.signal.aborted; delay = Math.min(delay * 2, 8000)) {
    try {
      const response = await request("GET", "/v1/heap/events", { signal: stream.signal });
      for await (const { event, data } of events(response)) {
        if (event !== "heap") continue;
        setLive("live");
        delay = 500;
        const snap = JSON.parse(data);
        convs.update(snap.sessions || []);
        heapView.snapshot(snap);
        renderChatMeta();
      }
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) {
        heapStream = null;
        setLive("offline");
        return askForKey();
      }
      if (e instanceof ApiError && e.status === 503 && !heapLimitSaid) {   // --max-observers: said once, retried
        heapLimitSaid = true;
        notify(new Error(`Live heap view unavailable: ${e.message} It reconnects when another tab closes.`));
      }
    }
    if (stream.signal.aborted) return;
    setLive("offline");
    await new Promise((resolve) => setTimeout(resolve, delay));
  }
}

function pauseHeap() {
  heapStream?.abort();
  heapStream = null;
  setLive("paused");
}

document.addEventListener("visibilitychange", () => (document.hidden ? pauseHeap() : followHeap()));

async function boot() {
  try {
    const [models, sessions] = await Promise.all([getJSON("/v1/models"), getJSON("/v1/sessions")]);
    showModel(models.data[0]);
    convs.setSessions(sessions.data);
    for (const s of sessions.data) heapView.heap(s.id, s.heap);
    const saved = localStorage.getItem(CURRENT_STORE);
    select(saved && convs.server.has(saved) ? saved : null);
    followHeap();
  } catch (e) {
    $("model-name").textContent = e instanceof ApiError && e.status === 401 ? "API key needed" : "server unavailable";
    notify(e);
    if (!(e instanceof ApiError && e.status === 401)) setTimeout(boot, 3000);
  }
}

function restoreParams() {
  try {
    const params = JSON.parse(localStorage.getItem(PARAMS_STORE) || "{}");
    if (params.max_tokens) $("max-tokens").value = params.max_tokens;
    if (params.temperature) $("temperature").value = params.temperature;
  } catch { /* unreadable: keep the defaults */ }
}

enableNarrowLayout();
restoreParams();
applyTheme();
updateComposer();
boot();
$("prompt").focus();

// The live heap panel: tokens seen against the fixed heap, per-layer occupancy,
// process memory against the RAM budget, thermal state, throughput.
// Fed by /v1/heap/events snapshots and by the heap stats that replies carry.

import { bytes, el, int, rate, shortId, times } from "./format.js";

const $ = (id) => document.getElementById(id);
const HISTORY_POINTS = 240;

const SEGMENTS = ["sinks", "recalled", "heavy", "recent", "fresh", "free"];
const MIN_PX = { sinks: 4, recalled: 3 };   // 4 sinks in 4,356 slots must still show (2 px vanished under the rounded end)

/** Per-layer slots split for drawing: sinks | recalled (paged back in from disk, when the
 *  server reports them) | heavy hitters | recent | new (in the slack) | free. */
export function segments(layer) {
  const sinks = layer.sinks;
  const recent = layer.recent;
  const recalled = layer.recalled ?? 0;
  const scored = layer.heavy_hitters ?? Math.max(0, layer.resident - sinks - recent - recalled);
  const heavy = Math.min(scored, Math.max(0, layer.budget - recent - recalled));
  const free = layer.free ?? layer.capacity - layer.resident;
  return { sinks, recalled, heavy, recent, fresh: scored - heavy, free };
}

const COMPACT = new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 1 });

export class HeapView {
  constructor() {
    this.history = new Map();   // session id -> [{seen, resident}]
    this.heaps = new Map();     // session id -> latest heap stats
    this.infos = new Map();     // session id -> latest session info
    this.config = null;         // the model card's heap settings
    this.heapBytes = null;
    this.current = null;
    this.layerRows = [];
    this.lastRates = null;      // the latest non-zero engine rates: shown while the engine is idle
  }

  setModel(card) {
    this.config = card?.localheap?.heap ?? null;
    this.heapBytes = card?.localheap?.heap_bytes_per_session ?? null;
    this.render();
  }

  /** A session this page created: its sparkline starts from zero. */
  track(id) {
    if (!this.history.has(id)) this.history.set(id, [{ seen: 0, resident: 0 }]);
  }

  forget(id) {
    this.history.delete(id);
    this.heaps.delete(id);
    this.infos.delete(id);
  }

  show(id) {
    this.current = id;
    this.render();
  }

  /** One /v1/heap/events message (the first of a stream carries the server's history). */
  snapshot(snap) {
    if (snap.history) this.restore(snap.history);
    for (const info of snap.sessions || []) {
      this.infos.set(info.id, info);
      if (info.heap) this.record(info.id, info.heap);
    }
    this.renderSession();
    this.renderServer(snap);
  }

  /** The sparklines and throughput a reloaded page has not seen, from the server. */
  restore(history) {
    for (const [id, points] of Object.entries(history.sessions || {})) {
      if (points.length) this.history.set(id, points.map(([seen, resident]) => ({ seen, resident })));
    }
    const last = (history.throughput || []).at(-1);
    if (last) this.lastRates = { time: last[0], decode: last[1], prefill: last[2] };
  }

  /** Heap stats from a reply or a finished document (fresher than the last snapshot). */
  heap(id, heap) {
    if (!heap) return;
    this.record(id, heap);
    if (id === this.current) this.renderSession();
  }

  record(id, heap) {
    this.heaps.set(id, heap);
    const points = this.history.get(id) || [];
    const last = points[points.length - 1];
    if (!last || last.seen !== heap.tokens_seen || last.resident !== heap.resident) {
      points.push({ seen: heap.tokens_seen, resident: heap.resident });
      // Keep the whole story in bounded space: halve the resolution when full.
      if (points.length > HISTORY_POINTS) points.splice(1, points.length - 2, ...thin(points.slice(1, -1)));
    }
    this.history.set(id, points);
  }

  render() {
    this.renderSession();
  }

  renderSession() {
    const id = this.current;
    const heap = id ? this.heaps.get(id) : null;
    const info = id ? this.infos.get(id) : null;
    const cfg = this.config;
    const capacity = heap?.capacity || (cfg ? cfg.sinks + cfg.budget + cfg.slack : 0);
    const seen = heap?.tokens_seen ?? 0;

    $("heap-session").textContent = id ? `session ${shortId(id)}` : "new conversation";
    const state = $("heap-state");
    state.hidden = !info || info.state === "resident";
    state.textContent = info?.state === "spilled" ? "spilled to disk" : info?.state === "empty" ? "empty" : "";

    setNumber($("seen"), seen);
    $("heap-mini").textContent = heap ? `${COMPACT.format(seen)} seen` : "";
    setNumber($("capacity"), capacity, capacity ? `${int(capacity)} slots` : "–");
    const kv = heap?.kv_bytes ?? this.heapBytes;
    $("kv-bytes").textContent = kv ? `${bytes(kv)} of KV` : "";
    $("kv-bytes").title = "Allocated once when the session starts; it never grows";

    const x = times(seen, capacity);
    $("hero-note").textContent = !capacity ? "" : x
      ? `${x}× the heap's size went through it; it never grew.`
      : heap?.evictions ? `Repacked ${int(heap.evictions)}× so far: ${int(heap.evicted)} tokens evicted by score; it never grew.`
      : seen ? `Room for ${int(capacity - heap.resident)} more tokens before the first repack.`
      : "Nothing read yet: send a message or add a document.";
    const perToken = kv && heap?.layers?.length ? kv / sumCapacity(heap.layers) * heap.layers.length : null;
    const stock = $("stock");
    stock.hidden = !(perToken && seen > capacity);
    stock.textContent = stock.hidden ? "" : `A stock KV cache would need ≈ ${bytes(seen * perToken)}; this heap: ${bytes(kv)}.`;

    this.renderSpark(id ? this.history.get(id) || [] : []);
    this.renderLayers(heap);
    $("stat-resident").textContent = heap ? `${int(heap.resident)} of ${int(heap.capacity)}` : "–";
    setNumber($("stat-evicted"), heap?.evicted ?? 0, heap ? int(heap.evicted) : "–");
    $("stat-repacks").textContent = heap ? int(heap.evictions) : "–";
    const pages = heap?.pages;   // the recall tier's page store, when on
    $("stat-disk-row").hidden = !pages;
    $("stat-disk").textContent = pages
      ? `${int(pages.tokens_on_disk)} tokens · ${bytes(pages.disk_bytes)}` +
        (pages.last_recall ? ` · last recall ${int(pages.last_recall.tokens)} in ${millis(pages.last_recall.ms)} ms` : "")
      : "–";
  }

  renderSpark(points) {
    const w = 300, h = 64, pad = 3;
    const top = Math.max(1, ...points.map((p) => p.seen));
    const n = Math.max(1, points.length - 1);
    const line = (key) => points.length < 2 ? "" : points
      .map((p, i) => `${(i / n * w).toFixed(1)},${(h - pad - p[key] / top * (h - 2 * pad)).toFixed(1)}`).join(" ");
    const seenLine = line("seen");
    $("spark-seen").setAttribute("points", seenLine);
    $("spark-seen-area").setAttribute("points", seenLine ? `0,${h} ${seenLine} ${w},${h}` : "");
    $("spark-resident").setAttribute("points", line("resident"));
    const last = points[points.length - 1];
    $("spark").setAttribute("aria-label", last
      ? `Tokens seen ${int(last.seen)}, resident ${int(last.resident)}` : "No tokens yet");
  }

  renderLayers(heap) {
    const box = $("layers");
    const layers = heap?.layers?.length ? heap.layers : this.emptyLayers();
    if (this.layerRows.length !== layers.length) this.buildLayerRows(box, layers.length);
    const widest = Math.max(...layers.map((l) => l.capacity), 1);
    layers.forEach((layer, i) => {
      const row = this.layerRows[i];
      const seg = segments(layer);
      row.bar.style.width = `${(layer.capacity / widest) * 100}%`;
      for (const key of SEGMENTS) {
        row[key].style.flexGrow = String(seg[key]);
        row[key].style.minWidth = seg[key] > 0 && key !== "free" ? `${MIN_PX[key] ?? 2}px` : "0";
      }
      row.line.style.left = `${((layer.sinks + layer.budget) / widest) * 100}%`;
      row.bar.title = `layer ${layer.layer}: ${seg.sinks} sinks, ${seg.recalled ? `${seg.recalled} recalled, ` : ""}` +
        `${seg.heavy} heavy hitters, ${seg.recent} recent, ` +
        `${seg.fresh} new, ${seg.free} free of ${layer.capacity}; ${int(layer.evicted)} evicted`;
    });
    $("legend-recalled").hidden = !layers.some((l) => l.recalled > 0);
    $("layer-count").textContent = heap?.layers?.length ? `${heap.layers.length} layers × ${int(widest)} slots` : "";
    const first = layers[0] && segments(layers[0]);
    box.setAttribute("aria-label", heap && first
      ? `Layer 0 holds ${first.sinks} sinks, ${first.heavy} heavy hitters, ${first.recent} recent and ${first.fresh} new tokens; ${first.free} of ${layers[0].capacity} slots free.`
      : "Empty heap");
    box.dataset.empty = heap ? "false" : "true";
  }

  emptyLayers() {
    const c = this.config;
    if (!c) return [];
    return [{ layer: 0, capacity: c.sinks + c.budget + c.slack, budget: c.budget, resident: 0, sinks: 0, recent: 0, evicted: 0 }];
  }

  buildLayerRows(box, count) {
    box.replaceChildren();
    const gap = count <= 12 ? 4 : 1;
    box.style.setProperty("--bar-gap", `${gap}px`);
    box.style.setProperty("--bar-height", `${Math.max(2, Math.min(18, Math.floor(128 / Math.max(count, 1)) - gap))}px`);
    const labelEvery = count <= 12 ? 1 : Math.ceil(count / 8);
    this.layerRows = Array.from({ length: count }, (_, i) => {
      const parts = Object.fromEntries(SEGMENTS
        .map((k) => [k, el("span", { class: `seg seg-${k}` })]));
      const line = el("span", { class: "repack-line" });
      const bar = el("span", { class: "bar" }, ...Object.values(parts));
      const label = el("span", { class: "layer-label", text: i % labelEvery === 0 ? `L${i}` : "" });
      box.append(el("div", { class: "layer-row" }, label, el("span", { class: "bar-track" }, bar, line)));
      return { bar, line, ...parts };
    });
  }

  renderServer(snap) {
    const mem = snap.memory || {};
    const budget = mem.ram_budget_bytes;
    const used = mem.rss_bytes;
    const share = budget ? Math.min(100, (used / budget) * 100) : 0;
    const meter = $("ram-meter");
    meter.setAttribute("aria-valuenow", share.toFixed(0));
    meter.dataset.level = share >= 90 ? "high" : share >= 70 ? "mid" : "low";
    $("ram-fill").style.width = `${budget ? Math.max(share, 0.5) : 0}%`;
    $("ram-text").textContent = budget
      ? `${bytes(used)} of ${bytes(budget)} budget (${share < 1 ? share.toFixed(1) : share.toFixed(0)}%)`
      : `${bytes(used)} resident · no RAM budget set`;
    const detail = [`weights ${bytes(mem.weights_bytes)}`, `KV ${bytes(mem.kv_bytes)}`];
    if (mem.max_resident_heaps) detail.push(`${int(mem.max_resident_heaps)} heaps fit`);
    if (mem.swap_used_bytes) detail.push(`swap ${bytes(mem.swap_used_bytes)}`);
    $("ram-detail").textContent = detail.join(" · ");
    const thermal = $("thermal");
    thermal.dataset.state = snap.thermal || "unknown";
    thermal.textContent = snap.thermal || "unknown";
    const t = snap.throughput || {};
    if (t.decode_tokens_per_s || t.prefill_tokens_per_s) {
      this.lastRates = { time: snap.time, decode: t.decode_tokens_per_s, prefill: t.prefill_tokens_per_s };
    }
    const idle = !t.decode_tokens_per_s && !t.prefill_tokens_per_s && this.lastRates;
    const shown = idle ? this.lastRates : { decode: t.decode_tokens_per_s, prefill: t.prefill_tokens_per_s };
    for (const [id, value] of [["decode-rate", shown.decode], ["prefill-rate", shown.prefill]]) {
      const node = $(id);
      node.textContent = rate(value);
      node.dataset.value = String(value ?? "");
      node.classList.toggle("stale", !!idle);
      node.title = idle ? `last measured at ${new Date(this.lastRates.time * 1000).toLocaleTimeString()} (idle now)` : "";
    }
    const e = snap.engine || {};
    const n = (snap.sessions || []).length;
    $("engine").textContent = `${int(e.active ?? 0)} running · ${int(e.waiting ?? 0)} waiting · ` +
      `${int(n)} session${n === 1 ? "" : "s"}`;
  }
}

function setNumber(node, value, text = int(value)) {
  node.dataset.value = String(value);
  node.textContent = text;
}

function sumCapacity(layers) {
  return layers.reduce((s, l) => s + l.capacity, 0) || 1;
}

function thin(points) {
  return points.filter((_, i) => i % 2 === 0);
}


/** A duration in ms as people read it: one decimal under 10 ms, whole ms above. */
function millis(ms) {
  return ms < 10 ? ms.toFixed(1) : int(Math.round(ms));
}

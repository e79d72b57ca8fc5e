"""The recall tier's backend-neutral half: page store wiring, page-out bookkeeping, recall per question.

Knows nothing about tensors: each backend gathers the evicted K/V on its device and brings
them to the host in one transfer per eviction event (torch/recall.py, mlx/recall.py), and
feeds a question once as a probe for its queries. Everything else is here, on numpy arrays,
so both backends page out, score, select and merge alike.

A cache with recall on provides: `cfg`, `heap_layers` (each with `heap`,
`repack(plan, evicting)` and `merge(plan, keys, values)`), `pages` / `writer` / `pages_owned` /
`recall_log` (set by `attach_pages`), `make_room(n)`, `evict(layers)`, `to_device(host)` (a
float16 or float32 numpy array onto the device as float32) and `settle()` (wait for queued device work).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from ..heap import LayerHeap, PageGeometry, PageStore, PageWriter, select_pages
from ..heap.pagecodec import dequantize
from ..heap.pages import LATEST, PageCorrupt, copy_tree
from ..heap.recall import WINDOW, page_builders, take_windows, vote, vote_order
from ..heap.scoring import lanes_exact, native_exact, score_pages_by_dim

log = logging.getLogger("localheap.pages")
PICK_TRIES = 8   # a recall picks again this often when what it read failed its check
# where a decode row's recall picks its pages (engine batch, both backends): "thread", on a thread of
# its own while the other rows step; "step", inside the step that feeds the row's prompt (every other
# row waits)
RECALL_PICKER = os.environ.get("LOCALHEAP_RECALL_PICKER", "thread")


@dataclass
class RecallFaults:
    """Process-wide counts for /metrics: page records that failed their check (tombstoned), and
    questions whose recall failed inside (answered without recall)."""
    pages_corrupt: int = 0
    recall_failed: int = 0


FAULTS = RecallFaults()


def attach_pages(cache, n_kv_heads: int, head_dim: int, root: Optional[Path] = None,
                 state: Union[int, str, None] = None) -> None:
    """Give `cache` a page store (in `root`, or a temp dir removed with the cache) and a writer.
    `state`: the saved state to open it at (None: a new store; raises CorruptPageState)."""
    cfg = cache.cfg
    cache.pages_owned = root is None   # a temp dir: a save moves it beside the heap file
    if root is None:
        root = Path(tempfile.mkdtemp(prefix="localheap-pages-"))
        weakref.finalize(cache, shutil.rmtree, str(root), True)   # a moved store is gone from here: no-op
    geometry = PageGeometry(len(cache.heap_layers), n_kv_heads, head_dim, cfg.page_size, cfg.page_format)
    max_pages = -(-cfg.recall_ram_tokens // cfg.page_size) * geometry.n_layers
    cache.pages = PageStore(root, geometry, cfg.disk_budget, cfg.recall_summary, max_pages, state=state)
    FAULTS.pages_corrupt += cache.pages.corrupt
    cache.writer = PageWriter()
    lanes_exact(head_dim)   # the page scorer's one check per process, here rather than inside a question
    native_exact(head_dim)  # a compiled scorer's too where it is built (this starts its build where it is not)


def policy_keep(heap: LayerHeap) -> int:
    """Slots an eviction event keeps: LayerHeap.plan's rule (the recall region holds only recalled
    pages; a staggered event `early` steps ahead of its due step keeps that many fewer)."""
    return heap.keep - heap.recall_slots + heap.n_recalled - heap.early


# -- page-out -----------------------------------------------------------------------------
def gather_evicted(plan, take: Callable) -> list[tuple]:
    """Device half of a page-out, before the repack overwrites the slots: per evicting layer
    (layer, slots [H_kv, n], *take(layer, slots, scores)). The backend's `take` gathers from its
    buffers: (pre-RoPE keys, values [H_kv, n, D] in the pages' wire dtype, value [H_kv, n]),
    `scores` [H_kv, resident] being what the event's selection ranked."""
    out = []
    for group in plan.groups:
        if group.layers[0].heap.resident == group.keep_indices.shape[-1]:
            continue
        slots = group.evicted_slots()                                       # [B, H_kv, n]
        for b, layer in enumerate(group.layers):
            out.append((layer, slots[b], *take(layer, slots[b], group.scores[b])))
    return out


def split_blob(blob: np.ndarray, parts: Sequence[tuple[np.dtype, int]]) -> list[np.ndarray]:
    """One transfer's bytes (uint8) back into its flat arrays, given (dtype, count) of each in order."""
    out, at = [], 0
    for dtype, count in parts:
        size = count * np.dtype(dtype).itemsize
        out.append(blob[at: at + size].view(dtype))
        at += size
    assert at == blob.size, (at, blob.size)
    return out


def queue_page_out(cache, layers: list, host: list[np.ndarray]) -> None:
    """Hand one event's evicted tokens to the page writer. `host`: per layer of `layers`, four
    flat arrays from the event's transfer: slots [H_kv, n] (ascending), pre-RoPE keys and values
    [H_kv, n, D], value [H_kv, n]. Call before the heap's bookkeeping forgets the slots' positions."""
    jobs = []
    D = cache.pages.g.head_dim
    for i, layer in enumerate(layers):
        heap = layer.heap
        slots, keys, values, value = host[4 * i: 4 * i + 4]
        H = heap.n_kv_heads
        slots = slots.reshape(H, -1).astype(np.int64, copy=False)
        positions = np.take_along_axis(heap.positions[:, : heap.resident], slots, axis=1)
        jobs.append((heap.layer, positions, keys.reshape(H, -1, D), values.reshape(H, -1, D), value.reshape(H, -1)))
    store = cache.pages

    def write() -> None:
        store.append_many(jobs, page_builders())

    if not jobs:
        return
    if cache.writer.between_steps:   # the engine runs them between its decode steps, a layer at a time
        cache.writer.submit_parts([lambda job=job: store.append_many([job]) for job in jobs])
    else:
        cache.writer.submit(write)


# -- recall -------------------------------------------------------------------------------
class OneProcess:
    """What the ranks of a sharded model agree on (backends/mlx/distributed.Ranks), for a cache
    that is the whole model: every value is already everyone's."""

    def any(self, flag: bool) -> bool:
        return flag

    def max(self, n: int) -> int:
        return n

    def layer_min(self, n: int) -> int:
        return n

    def sum(self, x: np.ndarray) -> np.ndarray:
        return x


def ranks(cache):
    """The cache's Ranks (a shard of a model) or OneProcess."""
    return getattr(cache, "ranks", None) or OneProcess()


def needs_recall(cache, chunks: Sequence[int]) -> bool:
    """Recall only where something was or will be evicted by feeding `chunks` (token counts, in
    order): otherwise the heap is the stock cache. A shard recalls when any rank's layers do."""
    if cache.pages is None:
        return False
    return ranks(cache).any(_evicts(cache, chunks))


def _evicts(cache, chunks: Sequence[int]) -> bool:
    for layer in cache.heap_layers:
        heap = layer.heap
        if heap.evicted > 0:
            return True
        resident = heap.resident
        for c in chunks:   # does one of the forwards make room?
            if resident + c > heap.keep + max(heap.cfg.slack, c):
                return True
            resident += c
    return False


def prefill_chunks(n: int, chunk: int) -> list[int]:
    """Token counts of the forwards that prefill `n` tokens by `chunk`."""
    return [min(chunk, n - done) for done in range(0, n, chunk)]


def split_question(cache, tokens: Sequence[int]) -> tuple[list, list]:
    """(body, question): the question is the turn's last `obs_window` tokens (at most the slack)."""
    w = question_length(cache, len(tokens))
    return list(tokens[: len(tokens) - w]), list(tokens[len(tokens) - w:])


def question_length(cache, n: int) -> int:
    """How many of a turn's `n` new prompt tokens a recall probes with: its question, the last
    `obs_window` (at most the slack). 1 where the heap has no page store (recall off)."""
    if getattr(cache, "pages", None) is None:
        return min(n, 1)
    return min(n, max(1, cache.cfg.obs_window), cache.cfg.slack)


def progress_from(progress, offset: int, total: int):
    """A part's progress callback (done, part's total) -> the whole's: offset + done of `total`."""
    return None if progress is None else (lambda done, _: progress(offset + done, total))


def recall_room(heap: LayerHeap, store) -> int:
    """Slots a recall loads into this layer at most: its recall region in whole pages."""
    return heap.recall_slots // store.g.page_size * store.g.page_size


def pick_pages(cache, store, queries: dict) -> dict:
    """--recall-select pages: each layer and KV head loads its own best-scored pages.
    Returns {layer: (positions [H, r], keys, values [H, r, D])}."""
    picked = {}
    widen = not native_exact(store.g.head_dim)   # the compiled scorer reads the store's float16 itself
    for layer in cache.heap_layers:
        i = layer.heap.layer
        slots, *summary = store.summaries_by_dim(i, widen=widen)
        n_pages = recall_room(layer.heap, store) // store.g.page_size
        if len(slots) == 0 or n_pages == 0:
            continue
        scores = score_pages_by_dim(queries[i], tuple(summary), cache.cfg.recall_score)
        best = select_pages(scores, n_pages)                                              # [H_kv, k]
        picked[i] = store.load(i, slots[best])
    return picked


def pick_spans(cache, store, queries: dict) -> dict:
    """--recall-select spans: every layer's and KV head's best pages vote for where in the document
    the question points (heap/recall.vote); then every layer and head recalls the evicted tokens of
    the same windows, best first, as many as its region holds (heap/recall.take_windows). A fact
    comes back whole in every head, not the pieces of it that one head's pages happen to hold.
    Returns {layer: (positions [H, r], keys, values [H, r, D])}, r the same for every head."""
    scores, live, spans, rooms, read = {}, {}, {}, {}, {}
    top = 0
    widen = not native_exact(store.g.head_dim)   # the compiled scorer reads the store's float16 itself
    for layer in cache.heap_layers:
        i = layer.heap.layer
        slots, *summary = store.summaries_by_dim(i, widen=widen)
        room = recall_room(layer.heap, store)
        tail_pos = store.tail(i)[0]
        if room == 0 or (len(slots) == 0 and tail_pos.size == 0):
            continue
        live[i], rooms[i], spans[i], read[i] = slots, room, store.spans(i, slots), positions_reader(store, i, slots)
        if len(slots):
            scores[i] = score_pages_by_dim(queries[i], tuple(summary), cache.cfg.recall_score)
            top = max(top, int(spans[i][..., 1].max()))
        if tail_pos.size:
            top = max(top, int(tail_pos.max()))
    agree = ranks(cache)   # a shard: every rank's layers and heads vote, and take the same windows
    top = agree.max(top if live else -1)
    if top < 0:
        return {}
    votes = agree.sum(vote(scores, lambda i, idx: read[i](idx), top // WINDOW + 2))
    order = vote_order(votes)
    jobs = []
    for layer in cache.heap_layers:
        i = layer.heap.layer
        taken = take_windows(order, rooms[i], spans[i], read[i], store.tail(i)[0]) if i in live else []
        r = agree.layer_min(min((len(s) for s, _ in taken), default=0))   # all of a layer's heads, on every rank, take as many
        if r:
            jobs.append((i, live[i], taken, r))
    return read_taken(store, jobs)


def read_taken(store, jobs: list) -> dict:
    """{layer: gather_taken(store, *job)} for jobs (layer, slots, taken, r), the layers read at
    once on the recall's readers (reads, checksums and gathers let go of the GIL). Records that
    fail their check raise one PageCorrupt for all the layers, after every layer is read (each
    tombstoned what it found)."""
    def attempt(job):
        try:
            return gather_taken(store, *job)
        except PageCorrupt as e:
            return e

    pool = recall_readers()
    if pool is None or len(jobs) < 2:
        got = [attempt(job) for job in jobs]
    else:
        futures = [pool.submit(attempt, job) for job in jobs]
        wait(futures)
        got = [f.result() for f in futures]
    corrupt = sum(g.n for g in got if isinstance(g, PageCorrupt))
    if corrupt:
        raise PageCorrupt(corrupt)
    return {job[0]: g for job, g in zip(jobs, got)}


# threads reading a recall's pages (as many as cores, at most 8; LOCALHEAP_RECALL_READERS=1: none,
# the caller reads them); at the caller's priority: the question's turn waits for them
RECALL_READERS = int(os.environ.get("LOCALHEAP_RECALL_READERS", "0")) or min(8, os.cpu_count() or 1)
_readers: Optional[ThreadPoolExecutor] = None
_readers_lock = threading.Lock()


def recall_readers() -> Optional[ThreadPoolExecutor]:
    global _readers
    if RECALL_READERS <= 1:
        return None
    with _readers_lock:
        if _readers is None:
            _readers = ThreadPoolExecutor(RECALL_READERS, thread_name_prefix="localheap-recall-read")
        return _readers


def gather_taken(store, layer: int, slots: np.ndarray, taken: list, r: int) -> tuple:
    """The first `r` tokens each head took (take_windows' (page indices into `slots`, -1 for the
    tail; offsets)) -> (positions [H, r], keys, values [H, r, D]), each head's in position order.
    Only the taken tokens are read out of the records, once each; keys and values in the pages'
    own float type (float16 pages stay float16: the device widens them, exactly), float32 where
    the tail (kept float32) or int8 pages are among them."""
    tail_pos, tail_k, tail_v = store.tail(layer)
    src = np.stack([s[:r] for s, _ in taken])                              # [H, r]: page index, -1 = tail
    off = np.stack([o[:r] for _, o in taken])
    heads = np.broadcast_to(np.arange(len(taken))[:, None], src.shape)
    tail = src < 0
    pos = np.zeros(src.shape, np.int64)
    if tail.any():
        pos[tail] = tail_pos[heads[tail], off[tail]]
    recs, u = None, None
    if (~tail).any():
        pages = np.unique(src[~tail])
        recs = store.read(layer, slots[pages], strict=True)
        u = np.zeros(src.shape, np.int64)
        u[~tail] = np.searchsorted(pages, src[~tail])
        pos[~tail] = store.map_positions(recs["positions"][u[~tail], heads[~tail], off[~tail]],
                                         recs["seq"][u[~tail]])
    order_h = np.argsort(pos, axis=1, kind="stable")                      # each head's in position order
    rows = np.arange(len(taken))[:, None]
    tail, off = tail[rows, order_h], off[rows, order_h]
    heads = np.broadcast_to(rows, src.shape)
    fmt, some = store.g.fmt, tail.any()
    dtype = np.float16 if fmt == "f16" and not some else np.float32
    if recs is not None:
        u = u[rows, order_h]
        at = (u[~tail], heads[~tail], off[~tail]) if some else (u, heads, off)   # no tail: one gather, no mask
    out = []
    for name, tail_x in (("keys", tail_k), ("values", tail_v)):
        x = None
        if recs is not None:
            x = (dequantize(recs[name][at], recs[name[0] + "scale"][at]) if fmt == "int8" else recs[name][at])
        if some:
            whole = np.empty((*src.shape, store.g.head_dim), dtype)
            whole[tail] = tail_x[heads[tail], off[tail]]
            if x is not None:
                whole[~tail] = x
            x = whole
        out.append(x.astype(dtype, copy=False))
    return (pos[rows, order_h], *out)


def positions_reader(store, layer: int, slots: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """idx (into `slots`) -> [n, H, P] token positions, each page's header read from disk once
    (the vote and the window walk ask for many of the same pages)."""
    known: dict[int, np.ndarray] = {}

    def read(idx: np.ndarray) -> np.ndarray:
        missing = [int(u) for u in idx if int(u) not in known]
        if missing:
            known.update(zip(missing, store.positions(layer, slots[missing])))
        g = store.g
        return np.stack([known[int(u)] for u in idx]) if len(idx) else np.zeros((0, g.n_kv_heads, g.page_size), np.int64)

    return read


def recall(cache, n_question: int, probe: Callable[[], dict]) -> dict:
    """Before a question of `n_question` tokens (<= slack) is fed: release the last recall, probe
    the question for its queries (`probe()` -> {layer: [H_kv, Q, D] pre-RoPE float32}, the heap
    rolled back after), load what `cfg.recall_select` picks (pick_spans or pick_pages) in one
    transfer. Returns the stats entry. The three phases, for a caller that picks on another
    thread meanwhile (the decode batch): recall_begin, recall_pick, recall_end."""
    recalling = recall_begin(cache, n_question, probe)
    recall_pick(cache, recalling)
    return recall_end(cache, recalling)


@dataclass
class Recalling:
    """A recall between its phases. `queries` None: the probe failed, the question goes on
    without recall. `parts`: seconds by phase (evict, probe, drain, pick, load)."""
    began: float
    parts: dict
    queries: Optional[dict]
    picked: Optional[dict] = None


def release_recalled(cache) -> None:
    """The tokens the latest recall brought back leave every heap layer (their pages stay in the
    store): before a new recall picks, and before a cut."""
    for layer in cache.heap_layers:
        release = layer.heap.release_plan()
        if release is not None:
            layer.repack(release, evicting=False)


def recall_begin(cache, n_question: int, probe: Callable[[], dict]) -> Recalling:
    """The heap's part before the pick, on the thread that steps the heap: the last recall
    released, room made for the question and a full recall region, the question probed."""
    t0 = time.perf_counter()
    parts: dict[str, float] = {}
    release_recalled(cache)
    # Room for the question and a full recall region is made BEFORE scoring: tokens evicted now go
    # to the store and compete with the older pages (evicting after scoring would page out tokens
    # that no question ever scores, the fact among them).
    store = cache.pages
    full = [layer for layer in cache.heap_layers
            if layer.heap.resident + recall_room(layer.heap, store) + n_question > layer.heap.capacity]
    if full:
        cache.evict(full)   # down to the policy's share: the recall region is free again
    cache.make_room(n_question)
    parts["evict"] = time.perf_counter() - t0
    t = time.perf_counter()
    try:   # probe() rolls the heap back whatever happens: nothing to undo
        queries = probe()
    except Exception:   # noqa: BLE001 - a question answered without recall, not a failed request
        FAULTS.recall_failed += 1
        log.exception("recall: the question's probe failed; this question goes on without recall")
        queries = None
    parts["probe"] = time.perf_counter() - t
    cache.settle()   # nothing of the heap is left to resolve while another thread picks
    return Recalling(t0, parts, queries)


@dataclass
class Question:
    """A turn's question between the phases of its recall (a backend's prefill_turn, split for the
    decode batch): its tokens, how many of the turn's `total` were fed before it (`fed`, for
    progress), and the recall begun for it."""
    tokens: list
    fed: int
    total: int
    recalling: Recalling


def new_picker(initializer: Optional[Callable[[], None]] = None) -> Optional[ThreadPoolExecutor]:
    """The thread a decode row's recall picks on while the batch steps (RECALL_PICKER "thread", the
    default); None ("step"): the pick runs inside the step, as alone. The pick (recall_pick) is
    host work on the page store: it touches no framework array."""
    if RECALL_PICKER != "thread":
        return None
    return ThreadPoolExecutor(1, thread_name_prefix="localheap-recall-pick", initializer=initializer)


def pick_beside(picker: Executor, cache, question: Question) -> Future:
    """The question's pick (recall_pick) on `picker`; the future gives the question back."""
    return picker.submit(lambda: (recall_pick(cache, question.recalling), question)[1])


def recall_pick(cache, recalling: Recalling) -> Recalling:
    """The pick: the session's page writes drained, the pages scored, voted and read back. Host
    work on the page store that reads nothing of the heap but its layer numbers and recall
    room, so it may run on another thread while the heap waits (not stepped, not saved)."""
    if recalling.queries is not None:
        recalling.picked = pick_checked(cache, cache.pages, recalling.queries, recalling.parts)
    return recalling


def recall_end(cache, recalling: Recalling) -> dict:
    """The pick merged into the heap (one transfer to the device), on the thread that steps the
    heap. Returns the stats entry; its ms run from recall_begin (the question waited that long)."""
    t1 = time.perf_counter()
    picked, store = mergeable_only(cache, recalling.picked or {}), cache.pages
    if picked:
        host = [a.reshape(-1) for _, k, v in picked.values() for a in (k, v)]   # float16 when every part is
        flat = cache.to_device(np.concatenate(host, dtype=np.result_type(*host)))
        at = 0
        for layer in cache.heap_layers:
            if layer.heap.layer not in picked:
                continue
            pos, k, _ = picked[layer.heap.layer]
            keys = flat[at: at + k.size].reshape(k.shape)                     # [H_kv, r, D] pre-RoPE
            values = flat[at + k.size: at + 2 * k.size].reshape(k.shape)
            at += 2 * k.size
            layer.merge(layer.heap.merge(pos), keys, values)
    cache.settle()
    parts = recalling.parts
    parts["load"] = time.perf_counter() - t1
    tokens = sum(p[0].shape[1] for p in picked.values()) // max(1, len(cache.heap_layers))
    event = {"tokens": tokens, "pages": -(-tokens // store.g.page_size),
             "ms": round(1000 * (time.perf_counter() - recalling.began), 2),
             "parts": {k: round(1000 * v, 2) for k, v in parts.items()}}
    cache.recall_log.append(event)
    return event


def pick_checked(cache, store, queries: dict, times: Optional[dict] = None) -> dict:
    """What `cfg.recall_select` picks for the probe's {layer: queries}, read back whole, after the
    session's queued page writes are drained: a page that fails its check is tombstoned and the
    pick made again without it; any other failure inside (the drain included) leaves the question
    without recall: logged and counted, never raised. `times` gets the seconds of the drain and
    the pick. (Whether a layer's pick can be merged is recall_end's check, on the heap's thread.)"""
    pick = pick_spans if cache.cfg.recall_select == "spans" else pick_pages
    times = {} if times is None else times
    try:
        t = time.perf_counter()
        cache.writer.drain()
        times["drain"] = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(PICK_TRIES):
            try:
                picked = pick(cache, store, queries)
                break
            except PageCorrupt as e:
                FAULTS.pages_corrupt += e.n
        else:   # the next question picks on from what these tombstoned
            FAULTS.recall_failed += 1
            log.error("recall: the pages picked still failed their check after %d picks; this question goes on "
                      "without recall", PICK_TRIES)
            return {}
        times["pick"] = time.perf_counter() - t
        return picked
    except Exception:   # noqa: BLE001 - a question answered without recall, not a failed request
        FAULTS.recall_failed += 1
        log.exception("recall failed; this question goes on without recall")
        return {}


def mergeable_only(cache, picked: dict) -> dict:
    """`picked` without the layers whose pick cannot be merged into the heap (logged and counted:
    that layer goes on without recall)."""
    heaps = {layer.heap.layer: layer.heap for layer in cache.heap_layers}
    for i in [i for i, (pos, _, _) in picked.items() if not mergeable(heaps[i], pos)]:
        FAULTS.recall_failed += 1
        log.error("recall: layer %d's pick cannot be merged (a recalled token is already resident, "
                  "or out of order); this question goes on without it", i)
        del picked[i]
    return picked


def mergeable(heap: LayerHeap, positions: np.ndarray) -> bool:
    """LayerHeap.merge's preconditions, checked before anything moves: positions [H, r] fit the
    heap and, merged with the resident ones, are strictly increasing in every head."""
    H, n = heap.n_kv_heads, heap.resident
    if positions.ndim != 2 or positions.shape[0] != H or n + positions.shape[1] > heap.capacity:
        return False
    both = np.sort(np.concatenate([heap.positions[:, :n], positions], axis=1), axis=1)
    return bool((np.diff(both, axis=1) > 0).all()) and bool((positions >= 0).all())


def release_pages(cache) -> None:
    """Before a session's files are removed: its queued page writes finished (their errors
    dropped: the pages are going) and its store's files closed, so their space comes back now."""
    if getattr(cache, "pages", None) is None:
        return
    try:
        cache.writer.drain()
    except Exception as e:   # noqa: BLE001 - a write that failed for a store being removed
        log.debug("page writes of a removed store failed: %s", e)
    cache.writer.close()
    cache.pages.close()


def page_stats(cache) -> Optional[dict]:
    """The page store's counters and the recalls so far (None with recall off). Writes still
    queued in the background are not counted yet: stats never wait for the disk."""
    if cache.pages is None:
        return None
    last = cache.recall_log[-1] if cache.recall_log else None
    return {**cache.pages.stats(), "recalls": len(cache.recall_log), "last_recall": last,
            "recalled_tokens": sum(e["tokens"] for e in cache.recall_log)}


# -- persistence --------------------------------------------------------------------------
def pages_dir(path: Path) -> Path:
    """Where a heap saved to `path` keeps a page store that lived in a temp dir: beside it."""
    return Path(path).with_suffix(".pages")


def file_version(path: Path) -> Optional[int]:
    """The version a heap file's name carries: a session's generation (`<id>.<gen>.safetensors`,
    sessions/disk.py) or a checkpoint's token count (`<tokens>.safetensors`); a rank's shard
    carries its whole's, a temp file its final name's (the first number in the name). None: a
    name without one."""
    numbers = [part for part in Path(path).name.split(".") if re.fullmatch(r"\d{1,12}", part)]
    return int(numbers[0]) if numbers else None


def checkpoint_pages(cache, path: Path, snapshot: bool = False) -> dict:
    """Before the heap is saved to `path`: the store's state written as the version the file's
    name carries (a store in a temp dir moved beside the file first). Returns the heap file's
    metadata for it: where the store is, relative to the file's directory, which state the file
    opens it at, and the recent recalls. The state is in force once the heap file is committed
    (for a session: by the index, then `commit_pages`). A session's saves point at its one live
    store; a `snapshot` (a checkpoint to fork from) points at hard links of it beside the file,
    with their own state, which the live store's later writes leave as they are (heap/pages.py)."""
    meta: dict[str, Any] = {"recall_log": cache.recall_log[-256:]}
    if cache.pages is None:
        return meta
    cache.writer.drain()
    if cache.pages_owned and not snapshot:
        cache.pages.move_to(pages_dir(path))
        cache.pages_owned = False
    version = file_version(path)
    if snapshot:
        version = 0 if version is None else version
        cache.pages.snapshot(pages_dir(path), version)   # raises: no checkpoint without its pages
        root = pages_dir(path)
    else:
        # a disk that refuses raises here: the turn is not saved (the previous one stays in force)
        version = cache.pages.checkpoint(version)
        root = cache.pages.root
    meta["pages_dir"] = os.path.relpath(root, Path(path).parent)
    meta["pages_state"] = version
    return meta


def commit_pages(cache, path: Path) -> None:
    """The heap file at `path` is committed: the page store's other state files go."""
    if getattr(cache, "pages", None) is not None and not cache.pages._closed:
        version = file_version(path)
        if version is not None and cache.pages.version == version:
            cache.pages.committed(version)


def saved_pages_root(path: Path, meta: dict, into: Optional[Path] = None) -> Path:
    """The page store a heap file saved by `checkpoint_pages` opens. With `into` (a fork's own
    directory), a copy of the saved store made there: a checkpoint's store is never written."""
    saved = Path(path).parent / meta["pages_dir"] if "pages_dir" in meta else pages_dir(path)
    if into is None or Path(into).resolve() == saved.resolve():
        return saved
    copy_tree(saved, into, meta.get("pages_state", LATEST))
    return Path(into)


def saved_pages_state(meta: dict) -> Union[int, str]:
    """The state a saved heap file opens its page store at (LATEST: a file older than versions)."""
    v = meta.get("pages_state")
    return v if isinstance(v, int) and not isinstance(v, bool) else LATEST

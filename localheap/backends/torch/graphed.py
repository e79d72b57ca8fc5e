"""The decode batch as CUDA graphs, a few per slab size (`--cuda-graphs`; torch on CUDA).

On a GPU a decode step is bound by the host issuing its kernels, not by the card (docs/speed.md,
"On a GPU": about 54 launching ops a layer, a step of the 8B shape 26-77 ms where reading its
weights and K/V takes 4-8 ms). The slab step (batch.py, slab.py) has fixed shapes but for three
host values per row (its token, its position, the slot its new token goes to) and where each
row's resident slots end, so it can be captured once per slab size and span of slots, and replayed:

- the rows are the slab's allocated rows R (a power of two), not its members B: rows past the
  members compute a token of their own at slot 0 and attend to it alone (their buffers are
  rewritten whole when a heap joins, slab.py), so one graph serves every B <= R;
- attention reads every row's first T slots, each masked past its own slots, T the longest row's
  rounded up to SLOTS_STEP (the eager step reads exactly to the longest row), one graph per
  (slab size, T): the same logits per slot, summed over more exact zeros, so logits within float
  ulps of the eager slab step, which is itself within tolerance of the heap alone
  (tests/test_torch_batch.py, its slab-graphed cases, holds tokens and logits to it);
- the heap's bookkeeping (LayerHeap.append) stays on the host, before the replay; evictions,
  recall and joins happen between steps, in place, so a graph stays valid until the slab's
  buffers are reallocated (slab.py drops its graphs then).

A graph is checked once per model against the same step run eagerly (`agrees`: bit for bit, on a
scratch slab); where it differs, or where capture fails, the eager step stays, with a warning
(a capture that fails later, at a new slab size, leaves that size's steps eager).
Off CUDA there is nothing to capture: `step` then runs the static step eagerly (tests).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from .slab import DecodeSlab, attend_reference

log = logging.getLogger("localheap.torch")


class StaticSlab:
    """past_key_values (and heap=) of a static step over a slab's R rows: each layer writes the
    rows' new K/V at their slots (static tensors) and attends over its first T slots."""

    packed = True

    def __init__(self, slab: DecodeSlab, T: int, device: torch.device):
        R = slab.rows
        self.slab, self.T = slab, T
        self.inputs = torch.zeros(3, R, dtype=torch.long, device=device)   # ids, positions, slots
        self.host = torch.zeros(3, R, dtype=torch.long, pin_memory=device.type == "cuda")
        self.rows = torch.arange(R, device=device)
        self.past = torch.arange(T, device=device)[None, :]   # [1, T]
        self.layers = [_StaticLayer(self, i) for i in range(len(slab.buffers))]

    @property
    def ids(self) -> torch.Tensor:
        return self.inputs[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.inputs[1]

    @property
    def slots(self) -> torch.Tensor:
        return self.inputs[2]

    def set_inputs(self, ids: torch.Tensor, positions: list[int], slots: list[int]) -> None:
        """The step's values for B <= R rows: ids [B] on the device (no host read), positions and
        slots from the host in one copy; rows past them read token 0 at slot 0."""
        B = len(positions)
        pad = [0] * (self.host.shape[1] - B)
        self.host.copy_(torch.tensor([[0] * B + pad, positions + pad, slots + pad]))
        self.inputs.copy_(self.host, non_blocking=True)   # the host buffer is reused after the step's read
        self.inputs[0, :B].copy_(ids)

    def attend(self, module, query: torch.Tensor, **kwargs) -> torch.Tensor:
        """query: [1, H_q, R, D] -> [1, R, H_q, D]; adds each row's attention mass to its scores."""
        bufs = self.slab.buffers[module.layer_idx]
        R, (_, Hq, _, D) = self.rows.shape[0], query.shape
        H, T = bufs["keys"].shape[1], self.T
        G = Hq // H
        scale = kwargs.get("scaling") or D ** -0.5
        q = query[0].transpose(0, 1).reshape(R, H, G, D) * scale
        hidden = self.past > self.slots[:, None]                          # [R, T]: True past a row's slots
        out, mass = attend_reference(q, bufs["keys"], bufs["values"], None, T, hidden[:, None, None, :])
        for name in ("scores", "window"):
            if name in bufs:
                bufs[name][:R, :, :T] += mass
        if "counts" in bufs:
            bufs["counts"][:R, :, :T] += (~hidden).float()[:, None, :] * float(G)
        return out.reshape(R, Hq, D)[None]


class _StaticLayer:
    def __init__(self, step: StaticSlab, index: int):
        self.step, self.index = step, index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states/value_states: [1, H_kv, R, D], row r's new token -> its slot."""
        bufs, s = self.step.slab.buffers[self.index], self.step
        bufs["keys"][s.rows, :, s.slots] = key_states[0].transpose(0, 1)     # [R, H_kv, D]
        bufs["values"][s.rows, :, s.slots] = value_states[0].transpose(0, 1)
        return key_states, value_states


class SlabGraph:
    """One (slab size, slots read) static step and, on CUDA, its captured graph."""

    def __init__(self, lean, slab: DecodeSlab, T: int, capture: Callable):
        device = slab.buffers[0]["keys"].device
        self.static = StaticSlab(slab, T, device)
        self.keep = torch.arange(slab.rows, device=device)
        self.lean, self.capture = lean, capture
        self.graph = None
        self.out: Optional[torch.Tensor] = None

    def run(self) -> torch.Tensor:
        """The step over the static inputs, eagerly: logits [R, vocab] fp32."""
        s = self.static
        return self.lean.run(s, s.ids[None], s.positions[None], self.keep)[0].to(dtype=torch.float32)

    def step(self) -> torch.Tensor:
        """This step's logits [R, vocab]: replayed, or (the first step at this size) run eagerly,
        which is the step itself, and then captured for the next ones."""
        if self.graph is not None:
            self.graph.replay()
            return self.out
        if self.capture is None:
            return self.run()
        result, graph, out = self.capture(self.run)
        if graph is None:   # capture refused: this slab size steps eagerly
            self.capture = None
        self.graph, self.out = graph, out
        return result


def cuda_capture(fn: Callable[[], torch.Tensor]):
    """fn run once eagerly, on the stream the capture then uses (its first use of cuBLAS there is
    not recorded), then recorded into a CUDA graph (nothing runs). Returns (fn's output now, the
    graph, the tensor each replay writes its output to)."""
    stream = _capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        result = fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: CUDA calls of other threads (a page writer's copy) do not void the capture
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):   # its own memory pool
            out = fn()
    except Exception as e:   # the step ran (result); only the recording failed
        log.warning("--cuda-graphs: capturing the decode step failed (%r); this batch size steps eagerly", e)
        return result, None, None
    return result, graph, out


def _capture_stream():
    global _STREAM
    if _STREAM is None:
        _STREAM = torch.cuda.Stream()
    return _STREAM


_STREAM = None
CAPTURE: Optional[Callable] = None   # tests: an eager stand-in for cuda_capture on the CPU
# A graph reads its rows' first T slots, T the longest row's rounded up to a multiple of this: a
# heap's rows between its evictions span about `slack` slots (with recall on, the whole budget
# less the recall region), so a few graphs per slab size, each reading little past the rows'
# slots. One graph over the whole capacity would read up to 3x the K/V bytes of the eager step.
SLOTS_STEP = 512
EAGER = object()                      # CAPTURE = EAGER: the static step runs eagerly every step (agrees)


def step(lean, slab: DecodeSlab, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """One decode step of the slab's members (tokens [B] in row order, room made): the heaps'
    bookkeeping on the host, then the static step. Returns fp32 logits [B, vocab], or None,
    touching nothing, where a heap's layers sit at different slots (a staggered eviction's spread,
    a recall that filled layers unevenly): the eager step takes those."""
    B = len(slab.members)
    slots = []
    for cache in slab.members:
        heaps = [layer.heap for layer in cache.heap_layers]
        if any(heap.resident != heaps[0].resident for heap in heaps):
            return None
        slots.append(heaps[0].resident)
    positions = [c.heap_layers[0].heap.rope_offset() for c in slab.members]
    for cache in slab.members:
        for layer in cache.heap_layers:
            layer.heap.append(1)
    cap = slab.buffers[0]["keys"].shape[2]
    T = min(cap, -(-(max(slots) + 1) // SLOTS_STEP) * SLOTS_STEP)   # the slots read: the longest row's, rounded up
    graph = slab.graphs.get((slab.rows, T))
    if graph is None:
        capture = CAPTURE if CAPTURE is not None else (cuda_capture if slab.buffers[0]["keys"].is_cuda else EAGER)
        graph = slab.graphs[(slab.rows, T)] = SlabGraph(lean, slab, T, None if capture is EAGER else capture)
    graph.static.set_inputs(tokens, positions, slots)
    return graph.step()[:B].clone()


def agrees(model) -> bool:
    """Whether replayed graphs give the eager static step's logits and scores bit for bit here:
    two small scratch heaps decode 4 steps in a slab each way (the first graphed step runs
    eagerly and captures, the next ones replay). Run once per model, before the first real step."""
    global CAPTURE
    from ...generation import SamplingParams
    from ...heap import HeapConfig
    from .batch import DecodeRow, step_rows
    from .cache import make_heap_cache
    from .generate import Sampler, forward

    cfg = HeapConfig(budget=64, recent=8, slack=16, recall=False)
    vocab = model.config.vocab_size
    runs = []
    before = CAPTURE
    try:
        for capture in (EAGER, before):
            CAPTURE = capture
            caches = []
            for n in (9, 12):
                cache = make_heap_cache(model, cfg)
                forward(model, cache, torch.arange(n, device=model.device) % vocab)
                cache.cuda_graphs = True
                caches.append(cache)
            rows = [DecodeRow(c, Sampler(SamplingParams(), c.device), prompt=[3]) for c in caches]
            slabs: dict = {}
            logits = []
            for _ in range(4):
                if step_rows(model, rows, slabs=slabs) != [None, None]:
                    return False
                logits.append(torch.stack([r.logits for r in rows]))
            scores = [layer.window.clone() for c in caches for layer in c.heap_layers if layer.window is not None]
            runs.append((logits, scores))
    finally:
        CAPTURE = before
    (a, sa), (b, sb) = runs
    return all(torch.equal(x, y) for x, y in zip(a, b)) and all(torch.equal(x, y) for x, y in zip(sa, sb))

"""The slab's CPU attention kernel (slab_cpu.py) against its torch reference (slab.attend_reference):
odd lengths (not a multiple of the kernel's 8-slot blocks), rows holding different numbers of slots,
every instantiated head_dim and group. Skipped where the kernel cannot be built (no C++ compiler, no
AVX2)."""

import pytest
import torch

from localheap.backends.torch import slab_cpu
from localheap.backends.torch.rope import RopeSpec
from localheap.backends.torch.slab import _agree, _kernel, attend_reference

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def kernel():
    if slab_cpu.unavailable() or slab_cpu.load(wait=True) is None:
        pytest.skip(f"slab kernel unavailable: {slab_cpu.unavailable()}")


def _case(B, H, G, D, T, spare=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(B + 1, H, T + spare, D, generator=gen)      # a spare row and slots: the slab's capacity
    values = torch.randn(B + 1, H, T + spare, D, generator=gen)
    q = torch.randn(B, H, G, D, generator=gen) * D ** -0.5
    resident = torch.tensor([T - (5 * b) % T for b in range(B)])   # row 0 holds T, the others fewer
    mask = (torch.arange(T)[None, :] >= resident[:, None])[:, None, None, :] if B > 1 else None
    return q, keys, values, resident, T, mask


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("D", slab_cpu.HEAD_DIMS)
@pytest.mark.parametrize("G", slab_cpu.GROUPS)
@pytest.mark.parametrize("B,H,T", [(1, 1, 1), (1, 2, 8), (3, 2, 37), (4, 3, 130)])
def test_kernel_matches_the_reference(B, H, G, D, T):
    args = _case(B, H, G, D, T)
    (out, mass), (want_out, want_mass) = _kernel(*args), attend_reference(*args)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(mass, want_mass, atol=1e-6, rtol=1e-4)
    resident = args[3]
    for b in range(B):   # the policy's mass: zero past a row's slots, G queries' probabilities in all
        assert (mass[b, :, resident[b]:] == 0).all()
    torch.testing.assert_close(mass.sum(-1), torch.full((B, H), float(G)))
    assert _agree((out, mass), (want_out, want_mass), None)


@pytest.mark.usefixtures("kernel")
def test_kernel_refuses_what_it_has_no_instance_for():
    q, keys, values, resident, T, _ = _case(2, 2, 3, 32, 9)    # G = 3
    with pytest.raises(RuntimeError):
        _kernel(q, keys, values, resident, T, None)
    assert not slab_cpu.fits(torch.float32, keys, 3)
    assert not slab_cpu.fits(torch.bfloat16, keys.bfloat16(), 2)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("LOCALHEAP_SLAB_KERNEL", "0")
    assert slab_cpu.unavailable() == "LOCALHEAP_SLAB_KERNEL=0"
    assert slab_cpu.load() is None


def test_a_failed_build_leaves_the_torch_code(monkeypatch, tmp_path):
    """No compiler (or a failed build): load answers None and says why, for good (slab.attend
    then takes torch's matmuls, slab.attend_reference: the slab-torch cases of test_torch_batch)."""
    import torch.utils.cpp_extension as cpp

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.delenv("LOCALHEAP_SLAB_KERNEL", raising=False)
    monkeypatch.setenv("LOCALHEAP_KERNEL_CACHE", str(tmp_path))   # nothing built there yet
    monkeypatch.setattr(cpp, "load_inline", no_compiler)
    for name, value in (("_module", None), ("_why_not", None), ("_building", None)):
        monkeypatch.setattr(slab_cpu, name, value)
    monkeypatch.setattr(slab_cpu, "_CAPABILITY", "AVX2")
    assert slab_cpu.load(wait=True) is None
    assert "no C++ compiler" in slab_cpu.unavailable()
    assert slab_cpu.load() is None


@pytest.mark.usefixtures("kernel")
def test_rows_split_across_threads_give_what_one_thread_gives():
    """The kernel splits (row, KV head) pairs over torch's intra-op threads (built with OpenMP):
    each pair is one thread's whole work, so the results are bit for bit the one-thread ones."""
    args = _case(8, 2, 2, 32, 4100)
    one = _kernel(*args)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = _kernel(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


class _FakeModule:
    __file__ = "unused"


def test_a_build_killed_midway_does_not_block_the_next(monkeypatch, tmp_path):
    """A server killed while it builds leaves torch's build lock (a file) behind and may hold the
    build's flock when it dies: the next process neither waits for ever on the file nor on the
    dead process's flock, and builds."""
    import subprocess
    import sys
    import time

    import torch.utils.cpp_extension as cpp

    where = tmp_path / "slab"
    where.mkdir()
    (where / "lock").touch()   # torch's baton, as a killed build leaves it
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(600)"), str(where / "build.lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    builds = []

    def fake_build(name, **kwargs):
        builds.append((kwargs["build_directory"], (where / "lock").exists()))
        return _FakeModule()

    monkeypatch.setattr(cpp, "load_inline", fake_build)
    holder.kill()   # dies holding the flock (and the build "half done")
    holder.wait()
    started = time.monotonic()
    assert isinstance(slab_cpu._built_module(where), _FakeModule)
    assert time.monotonic() - started < 10
    assert builds == [(str(where), False)], "built once, with the stale torch lock cleared first"
    assert (where / "built").exists()


@pytest.mark.usefixtures("kernel")
def test_a_finished_build_is_imported_without_building(monkeypatch):
    """Once built (the `kernel` fixture), a process imports the library: no build tool, no lock."""
    import torch.utils.cpp_extension as cpp

    def no_build(*args, **kwargs):
        raise AssertionError("built again")

    monkeypatch.setattr(cpp, "load_inline", no_build)
    module = slab_cpu._built_module(slab_cpu.build_dir())
    q, keys, values, resident, T, mask = _case(2, 2, 2, 32, 37)
    got = tuple(module.attend(q.contiguous(), keys, values, resident, T))
    want = _kernel(q, keys, values, resident, T, mask)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# -- the eviction kernels: take_rotated (page-out) and compact (repack), bit for bit the torch code --
def _layer(H, cap, D, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(H, cap, D, generator=gen), torch.randn(H, cap, D, generator=gen), gen


def _ascending(H, n, k, gen, sinks=2):
    """[H, k] ascending slots of 0..n-1 (the first `sinks` always in), a different set per head."""
    rows = [torch.cat([torch.arange(sinks), torch.randperm(n - sinks, generator=gen)[: k - sinks].sort().values + sinks])
            for _ in range(H)]
    return torch.stack(rows)


def _rope(D, base=10000.0):
    return RopeSpec(1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("D", [16, 32, 64, 80, 128])
@pytest.mark.parametrize("H,cap,n,k", [(1, 40, 40, 17), (2, 300, 290, 100), (3, 4356, 4356, 2052)])
def test_eviction_kernels_give_the_torch_bits(D, H, cap, n, k):
    keys, values, gen = _layer(H, cap, D, seed=D + k)
    rope, module = _rope(D), slab_cpu.load()
    keep = _ascending(H, n, k, gen)
    gone = torch.stack([torch.tensor(sorted(set(range(n)) - set(row.tolist()))) for row in keep])
    # page-out: the evicted slots' keys rotated back by their slot, and their values
    want_k = rope.shift_back(torch.gather(keys, 1, gone[..., None].expand(-1, -1, D)), gone, cap)
    want_v = torch.gather(values, 1, gone[..., None].expand(-1, -1, D))
    cos, sin = rope.table(keys.device, cap)
    got_k, got_v = module.take_rotated(keys, values, gone, cos, sin)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # repack: the kept slots to the front, rotated back by how far each moves; slots past keep untouched
    deltas = torch.arange(k) - keep
    want_keys = rope.shift_back(torch.gather(keys, 1, keep[..., None].expand(-1, -1, D)), -deltas, n - k)
    for rotate in (True, False):
        k_buf, v_buf = keys.clone(), values.clone()
        cos, sin = rope.table(keys.device, n - k)
        module.compact(k_buf, v_buf, keep, cos, sin, rotate)
        want = want_keys if rotate else torch.gather(keys, 1, keep[..., None].expand(-1, -1, D))
        assert torch.equal(k_buf[:, :k], want)
        assert torch.equal(v_buf[:, :k], torch.gather(values, 1, keep[..., None].expand(-1, -1, D)))
        assert torch.equal(k_buf[:, n:], keys[:, n:]) and torch.equal(v_buf[:, n:], values[:, n:])


@pytest.mark.usefixtures("kernel")
def test_compact_refuses_slots_out_of_order():
    keys, values, _ = _layer(1, 10, 8, seed=0)
    cos, sin = _rope(8).table(keys.device, 10)
    with pytest.raises(RuntimeError, match="ascending"):
        slab_cpu.load().compact(keys, values, torch.tensor([[0, 5, 3]]), cos, sin, True)
    with pytest.raises(RuntimeError, match="out of range"):
        slab_cpu.load().take_rotated(keys, values, torch.tensor([[0, 10]]), cos, sin)


@pytest.mark.usefixtures("kernel")
def test_a_heap_evicts_the_same_with_and_without_the_kernels(model_dirs, monkeypatch):
    """A session with recall on (f32 pages) through many eviction events: the heap's buffers and
    every page on disk equal, bit for bit, what the torch code leaves."""
    import numpy as np
    from recall_checks import CFG, load_all, prompt

    from localheap.backends.torch import TorchBackend
    from localheap.backends.torch.generate import prefill

    llama = TorchBackend.load(model_dirs("llama"))
    runs = {}
    calls = {"compact": 0, "take_rotated": 0}
    module = slab_cpu.load()

    class Counted:   # the module's kernels, counted: the kernel run must have used them
        def __getattr__(self, name):
            calls[name] += 1
            return getattr(module, name)

    for name, evicts in (("torch", lambda keys: None), ("kernel", lambda keys: Counted())):
        monkeypatch.setattr(slab_cpu, "evicts", evicts)
        cache = llama.new_cache(CFG)
        prefill(llama.model, cache, prompt(llama, 400))
        cache.writer.drain()
        assert cache.heap_layers[0].heap.evictions > 3
        runs[name] = ([(layer.keys.clone(), layer.values.clone()) for layer in cache.heap_layers],
                      [load_all(cache.pages, layer.heap.layer) for layer in cache.heap_layers])
    assert calls["compact"] > 3 and calls["take_rotated"] > 3
    (heaps, pages), (heaps_k, pages_k) = runs["torch"], runs["kernel"]
    for (k, v), (kk, vk) in zip(heaps, heaps_k):
        assert torch.equal(k, kk) and torch.equal(v, vk)
    for a, b in zip(pages, pages_k):
        assert len(a[0][0]) > 0 and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("D,Q,N", [(32, 64, 9000), (32, 2, 37), (64, 9, 2000), (128, 64, 1500), (20, 11, 500)])
def test_the_page_scorer_gives_the_einsum_scores_bit_for_bit(D, Q, N, threads, monkeypatch):
    """slab_cpu.page_bounds, heap/scoring's native scorer, against recall.score_pages: both
    summaries and both scores, pages not a multiple of its 16-page blocks, head sizes whose lanes
    are unequal (20), one thread and the pairs split over two, the summaries in float32 and as the
    store keeps them (float16, a view of a longer buffer)."""
    import numpy as np
    from test_page_scoring import by_dim, random_scoring_case

    from localheap.heap import scoring
    from localheap.heap.recall import score_pages

    monkeypatch.setattr(scoring, "_NATIVE", slab_cpu.bounds_pages)
    assert slab_cpu.bounds_ready() is True
    torch.set_num_threads(threads)
    rng = np.random.default_rng(D * 1000 + N)
    q, kmin, kmax = random_scoring_case(rng, 3, Q, N, D)
    kmax = kmax.astype(np.float16).astype(np.float32)   # summaries as the store keeps them: float16 values
    for summary in ((kmin, kmax), (kmax,)):
        f32 = by_dim(summary, D)
        # as the store keeps them: float16, the first N slots of a longer buffer (a strided view)
        f16 = tuple(np.concatenate([a, np.ones((*a.shape[:2], 7), a.dtype)], axis=2).astype(np.float16)[:, :, :N]
                    for a in f32)
        for how in ("bound", "zscore"):
            want = score_pages(q, summary, how)
            for given in (f32, f16):
                got = scoring._scores_native(q, given, how)
                np.testing.assert_array_equal(got, want, err_msg=f"{len(summary)} summaries, {how}, {given[0].dtype}")
    monkeypatch.setattr(scoring, "_native_ready", slab_cpu.bounds_ready)
    monkeypatch.setattr(scoring, "_native_verdicts", {})
    assert scoring.native_exact(D), "its own check passes too: recalls score with it"


def test_a_native_scorer_that_rounds_otherwise_or_is_not_built_leaves_numpy_scoring(monkeypatch):
    """scoring.native_exact checks a registered scorer once per head size, once it is built: one
    that sums in another order (a float64 matmul) is refused and numpy scores; one building or not
    to be had here is not asked, and one that answers None is asked again later."""
    import numpy as np
    from test_page_scoring import by_dim, random_scoring_case

    from localheap.heap import scoring
    from localheap.heap.recall import score_pages

    D, asked = 32, []

    def other_order(qs, ks, cut):
        asked.append(1)
        return sum(np.einsum("hqd,hdn->hqn", a.astype(np.float64), b.astype(np.float64)) for a, b in zip(qs, ks)).astype(np.float32)

    rng = np.random.default_rng(3)
    q, kmin, kmax = random_scoring_case(rng, 2, 9, 700, D)
    want = score_pages(q, (kmin, kmax), "zscore")
    monkeypatch.setattr(scoring, "_NATIVE", other_order)
    monkeypatch.setattr(scoring, "_native_verdicts", {})
    for ready in (None, False):   # building, or never here: not asked, no verdict kept
        monkeypatch.setattr(scoring, "_native_ready", lambda ready=ready: ready)
        assert not scoring.native_exact(D) and not asked and D not in scoring._native_verdicts
    monkeypatch.setattr(scoring, "_native_ready", lambda: True)
    assert not scoring.native_exact(D) and asked and scoring._native_verdicts[D] is False
    np.testing.assert_array_equal(scoring.score_pages_by_dim(q, by_dim((kmin, kmax), D), "zscore"), want)
    monkeypatch.setattr(scoring, "_NATIVE", lambda qs, ks, cut: None)
    monkeypatch.setattr(scoring, "_native_verdicts", {})
    assert not scoring.native_exact(D) and D not in scoring._native_verdicts
    np.testing.assert_array_equal(scoring.score_pages_by_dim(q, by_dim((kmin, kmax), D), "zscore"), want)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("H,m,P,D", [(8, 64, 32, 128), (2, 3, 32, 32), (3, 5, 7, 20), (1, 2, 1, 9), (2, 1, 4, 64)])
def test_page_summaries_give_numpys_bits(dtype, H, m, P, D):
    """slab_cpu.summarize_pages, heap/pages' native summaries, against pages.page_summaries (numpy's
    min, max and mean): random keys, pages of one repeated token, ties of +0 and -0 in either order
    (numpy keeps the later), a NaN (it stays), head sizes not a multiple of 8."""
    import numpy as np

    from localheap.heap import pages

    rng = np.random.default_rng(H * 100 + P * 10 + D)
    k = (rng.standard_normal((H, m, P, D)) * 3).astype(dtype)
    k[0, 0] = k[0, 0, :1]
    k[-1, -1, ::2] = np.round(k[-1, -1, ::2] / 8)   # zeros of both signs among small integers
    if P > 1:
        k[0, -1, 0, 0], k[0, -1, 1:, 0] = np.nan, 1.0   # a NaN first, then numbers
        k[0, -1, :, 1] = np.where(np.arange(P) % 2, 0.0, -0.0)
    got, want = slab_cpu.summarize_pages(k), pages.page_summaries(k)
    for a, b, name in zip(got, want, ("kmin", "kmax", "kmean")):
        assert a.shape == b.shape == (m, H, D) and a.dtype == np.float32
        nan = np.isnan(b)
        assert np.array_equal(np.isnan(a), nan), name
        assert np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)), name


@pytest.mark.usefixtures("kernel")
def test_a_page_store_writes_the_same_records_with_the_native_summaries(tmp_path, monkeypatch):
    """An eviction event's pages (f16 and int8 formats, a partial page carried between events) with the
    registered kernel and with numpy's reductions: the same bytes on disk."""
    import numpy as np

    from localheap.heap import pages
    from localheap.heap.pages import PageGeometry, PageStore

    H, D, P = 2, 64, 32
    rng = np.random.default_rng(5)
    events = [(np.tile(np.arange(a, a + n), (H, 1)), rng.standard_normal((H, n, D)).astype(np.float16),
               rng.standard_normal((H, n, D)).astype(np.float16), rng.random((H, n)).astype(np.float32))
              for a, n in ((0, 100), (100, 77), (177, 300))]
    monkeypatch.setattr(pages, "_summaries_verdicts", {})
    monkeypatch.setattr(pages, "_SUMMARIES", slab_cpu.summarize_pages)
    monkeypatch.setattr(pages, "_summaries_ready", slab_cpu.bounds_ready)
    calls = []
    real = pages.summaries
    monkeypatch.setattr(pages, "summaries", lambda k: calls.append(k.dtype) or real(k))
    for fmt in ("f16", "int8"):
        files = {}
        for native in (True, False):
            if not native:
                monkeypatch.setattr(pages, "_SUMMARIES", None)
            store = PageStore(tmp_path / f"{fmt}-{native}", PageGeometry(2, H, D, P, fmt))
            for pos, k, v, val in events:
                store.append_many([(layer, pos, k, v, val) for layer in range(2)])
            store.close()
            files[native] = [(tmp_path / f"{fmt}-{native}" / f"layer{i:03d}.pages").read_bytes() for i in range(2)]
        assert files[True] == files[False] and len(files[True][0]) > 0
        assert pages._summaries_verdicts, "the kernel answered (its check passed)"
        monkeypatch.setattr(pages, "_SUMMARIES", slab_cpu.summarize_pages)
    assert calls


def test_native_summaries_that_differ_or_are_not_built_leave_numpys(monkeypatch):
    """pages.summaries asks a registered kernel only once it is built, and checks it once per dtype and
    page shape: one that sums in another order is refused and numpy's reductions answer."""
    import numpy as np

    from localheap.heap import pages

    asked = []

    def other_order(k):   # the mean summed pairwise in float64
        asked.append(1)
        k32 = k.astype(np.float32)
        return (k32.min(axis=2).transpose(1, 0, 2), k32.max(axis=2).transpose(1, 0, 2),
                k.astype(np.float64).mean(axis=2).astype(np.float32).transpose(1, 0, 2))

    k = np.random.default_rng(0).standard_normal((2, 3, 32, 16)).astype(np.float16)
    want = pages.page_summaries(k)
    monkeypatch.setattr(pages, "_SUMMARIES", other_order)
    monkeypatch.setattr(pages, "_summaries_verdicts", {})
    for ready in (None, False):   # building, or never here: not asked, no verdict kept
        monkeypatch.setattr(pages, "_summaries_ready", lambda ready=ready: ready)
        got = pages.summaries(k)
        assert not asked and not pages._summaries_verdicts
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    monkeypatch.setattr(pages, "_summaries_ready", lambda: True)
    got = pages.summaries(k)
    assert asked and list(pages._summaries_verdicts.values()) == [False]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))

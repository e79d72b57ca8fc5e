"""A cache with sliding-window layers (gemma3, gpt-oss) rolls back to its mark exactly: the
point where a turn's prompt was read, which the next turn comes back to when the chat template
rewrites the reply (gpt-oss drops its reasoning, ends a final answer with <|end|>). A sliding
window cannot bring back what it dropped, so the mark keeps the sliding layers' state."""

import numpy as np
import pytest

from localheap.generation import SamplingParams
from localheap.heap import HeapConfig

CFG = HeapConfig(budget=1024, slack=64, recent=64)


def _backend(kind, path):
    if kind == "torch":
        torch = pytest.importorskip("torch")
        from localheap.backends.torch import TorchBackend
        from localheap.backends.torch.generate import generate_steps

        backend = TorchBackend.load(path, device="cpu", dtype=torch.float32)
        return backend, lambda cache, ids, n: [(t, np.asarray(lg.float().cpu())) for t, lg in
                                               generate_steps(backend.model, cache, ids, SamplingParams(max_tokens=n))]
    pytest.importorskip("mlx.core")
    from localheap.backends.mlx import MLXBackend
    from localheap.backends.mlx.generate import generate_steps as mlx_steps

    backend = MLXBackend.load(path)
    return backend, lambda cache, ids, n: [(t, np.array(lp)) for t, lp in
                                           mlx_steps(backend.model, cache, ids, SamplingParams(max_tokens=n))]


@pytest.mark.parametrize("kind", ["torch", "mlx"])
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text"])
def test_rolled_back_to_the_mark_the_next_turn_is_as_if_the_reply_never_was(model_dirs, torch_one_thread, kind, family):
    backend, steps = _backend(kind, model_dirs(family))
    ids = backend.tokenizer.encode(" ".join(f"the heap keeps token {i} while the window moves" for i in range(40)))
    first, second = ids[:150], ids[150:230]   # both far longer than the sliding window (32)

    def turn_one(cache):
        backend.prefill(cache, first[:-1])
        cache.mark()   # the engine marks here: the prompt read but for its last token
        return steps(cache, first[-1:], 40)   # the reply (its last token sampled, not fed)

    rolled = backend.new_cache(CFG)
    reply = turn_one(rolled)
    assert backend.tokens_in_cache(rolled) == len(first) + 39
    mark = backend.rollback_mark(rolled)
    assert mark == len(first) - 1 and backend.rollback_floor(rolled) > mark
    with pytest.raises(AssertionError):   # between the mark and the end: the window's past is gone
        backend.truncate(rolled, mark + 5)
    backend.truncate(rolled, mark)
    assert backend.tokens_in_cache(rolled) == mark
    backend.prefill(rolled, [first[-1]] + second[:-1])
    got = steps(rolled, second[-1:], 40)

    fresh = backend.new_cache(CFG)
    backend.prefill(fresh, first[:-1])
    backend.prefill(fresh, [first[-1]] + second[:-1])
    want = steps(fresh, second[-1:], 40)
    assert [t for t, _ in got] == [t for t, _ in want] != [t for t, _ in reply]
    for i, ((_, a), (_, b)) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"logits differ at step {i}"


def test_only_heap_layers_need_no_mark(model_dirs, torch_one_thread):
    torch = pytest.importorskip("torch")
    from localheap.backends.torch import TorchBackend

    backend = TorchBackend.load(model_dirs("llama"), device="cpu", dtype=torch.float32)
    cache = backend.new_cache(CFG)
    backend.prefill(cache, list(range(5, 60)))
    cache.mark()
    backend.prefill(cache, list(range(60, 70)))
    assert backend.rollback_mark(cache) is None and backend.rollback_floor(cache) == 0


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_mark_taken_between_decode_steps(model_dirs, torch_one_thread, kind):
    """A turn of one token marks right after the last reply's decode steps: the sliding layers' arrays are
    the ones those steps write into (mlx-lm's rotating cache writes in place), so the mark is a copy."""
    backend, steps = _backend(kind, model_dirs("gpt_oss"))
    ids = backend.tokenizer.encode(" ".join(f"the heap keeps token {i} while the window moves" for i in range(40)))
    prompt, other = ids[:150], ids[160]

    def reply(cache):
        backend.prefill(cache, prompt[:-1])
        return steps(cache, prompt[-1:], 10)

    rolled = backend.new_cache(CFG)
    first = reply(rolled)
    rolled.mark()
    steps(rolled, [first[-1][0]], 30)   # a reply after a one-token turn: 30 steps past the mark
    backend.truncate(rolled, backend.rollback_mark(rolled))
    got = steps(rolled, [other], 20)
    fresh = backend.new_cache(CFG)
    assert [t for t, _ in reply(fresh)] == [t for t, _ in first]
    want = steps(fresh, [other], 20)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, want))

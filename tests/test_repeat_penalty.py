"""The repetition penalty (SamplingParams.repeat_penalty / repeat_last_n; llama.cpp's and Ollama's,
vLLM's repetition_penalty): both backends' samplers against the definition (the window's ids
divided by the penalty where their logit is positive, multiplied where not, after logit_bias and
before the presence and frequency penalties), the heap's greedy tokens against transformers' and
mlx-lm's own repetition penalty with their own caches, and the engine's window holding the
session's earlier tokens (a document fed before the turn) on the batched and round-robin engines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_checks import CFG, drain, engine, greedy_on_both_backends, ids, submit, text
from localheap.backends.torch.generate import Sampler, generate_steps
from localheap.generation import SamplingParams
from localheap.heap import HeapConfig

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CASES = [(1.5, 4), (1.3, -1), (0.7, 8), (2.0, 1)]   # (penalty, last n)


def _logits(steps: int = 40, vocab: int = 24, seed: int = 1, shift: float = 0.0) -> np.ndarray:
    """Logits with leaders a penalty can reorder; `shift` -4: all of them negative (the multiplied side)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps, vocab)).astype(np.float32)
    x[:, :4] += np.array([1.2, 1.0, 0.9, -0.2], np.float32)
    return x + np.float32(shift)


def _reference(logits: np.ndarray, context: list[int], penalty: float, last_n: int, bias: dict = None,
               presence: float = 0.0, frequency: float = 0.0, windowed: bool = False) -> list[int]:
    """Greedy ids by the definition: logit_bias, then the repetition penalty over the window (the
    context's and the reply's last `last_n` ids; -1: all), then the presence and frequency
    penalties, counting the reply's ids (OpenAI's) or, `windowed`, the window's (llama.cpp's)."""
    seen, out, counts = list(context), [], np.zeros(logits.shape[1], np.float32)
    for row in logits:
        row = row.copy()
        for k, v in (bias or {}).items():
            row[k] += v
        window = seen if last_n < 0 else seen[max(0, len(seen) - last_n):]
        for t in set(window):
            row[t] = row[t] * penalty if row[t] < 0 else row[t] / penalty
        if windowed:
            counts = np.bincount(np.array(window, dtype=np.int64), minlength=logits.shape[1]).astype(np.float32)
        row -= presence * (counts > 0) + frequency * counts
        t = int(np.argmax(row))
        out.append(t)
        seen.append(t)
        counts[t] += 1
    return out


def _params(penalty, last_n, context, **kw) -> SamplingParams:
    return SamplingParams(repeat_penalty=penalty, repeat_last_n=last_n, **kw).with_context(context, [])


@pytest.mark.parametrize("shift", [0.0, -4.0])
@pytest.mark.parametrize("penalty,last_n", CASES)
def test_torch_sampler_applies_the_repetition_penalty_as_defined(penalty, last_n, shift):
    logits, context = _logits(shift=shift), [0, 3, 3, 7, 1]
    sampler = Sampler(_params(penalty, last_n, context), torch.device("cpu"))
    got = [int(sampler.sample(torch.from_numpy(row))) for row in logits]
    assert got == _reference(logits, context, penalty, last_n)
    assert got != _reference(logits, context, 1.0, last_n), "the penalty decides some steps of this case"
    assert not sampler.plain


@pytest.mark.parametrize("shift", [0.0, -4.0])
@pytest.mark.parametrize("penalty,last_n", CASES)
def test_mlx_sampler_applies_the_repetition_penalty_as_defined(penalty, last_n, shift):
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
    from localheap.backends.mlx.generate import Sampler as MLXSampler

    logits, context = _logits(shift=shift), [0, 3, 3, 7, 1]
    sample = MLXSampler(_params(penalty, last_n, context))
    got = []
    for row in logits:
        x = mx.array(row[None])
        got.append(int(sample(x, x - mx.logsumexp(x, keepdims=True)).item()))
    assert got == _reference(logits, context, penalty, last_n)


def test_the_order_is_bias_then_repetition_then_presence_on_both_backends():
    logits, context, bias = _logits(seed=4), [2, 5], {3: 1.5, 6: -0.5}
    want = _reference(logits, context, 1.6, 6, bias=bias, presence=0.4)
    assert want != _reference(logits, context, 1.6, 6, presence=0.4)
    params = _params(1.6, 6, context, logit_bias=bias, presence_penalty=0.4)
    for got in greedy_on_both_backends(params, logits):
        assert got == want


@pytest.mark.parametrize("penalty,last_n", [(1.0, 4), (1.0, -1), (1.4, 6), (1.0, 2)])
def test_windowed_presence_and_frequency_count_the_window_on_both_backends(penalty, last_n):
    """llama.cpp's and Ollama's presence and frequency penalties count the window's ids (the
    context's included, an id that left the window no longer counted), with or without the
    repetition penalty; OpenAI's count the reply's alone."""
    logits, context = _logits(seed=6), [0, 0, 1, 3, 2, 0]
    kw = {"presence_penalty": 0.6, "frequency_penalty": 0.5}
    want = _reference(logits, context, penalty, last_n, presence=0.6, frequency=0.5, windowed=True)
    reply_only = _reference(logits, context, penalty, last_n, presence=0.6, frequency=0.5)
    assert want != reply_only, "the window's counts decide some steps of this case"
    windowed = _params(penalty, last_n, context, windowed_penalties=True, **kw)
    assert windowed.windowed and windowed.context == (context if last_n < 0 else context[-last_n:])
    for got in greedy_on_both_backends(windowed, logits):
        assert got == want
    for got in greedy_on_both_backends(_params(penalty, last_n, context, **kw), logits):
        assert got == reply_only


def test_a_window_of_zero_turns_windowed_penalties_off():
    off = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0, repeat_last_n=0, windowed_penalties=True)
    assert not off.penalized and not off.windowed and off.plain_greedy
    assert off.with_context([1, 2], [3]) is off
    assert SamplingParams(presence_penalty=1.0, repeat_last_n=0).penalized   # OpenAI's have no window


def test_the_params_window_and_its_checks():
    p = SamplingParams(repeat_penalty=1.2, repeat_last_n=3)
    assert p.repeating and not p.plain_greedy
    assert p.with_context(np.array([1, 2, 3, 4, 5]), [6]).context == [4, 5, 6]
    assert p.with_context([1], [2]).context == [1, 2]
    whole = SamplingParams(repeat_penalty=1.2, repeat_last_n=-1).with_context([1, 2, 3], [4])
    assert whole.context == [1, 2, 3, 4]
    for off in (SamplingParams(), SamplingParams(repeat_penalty=1.5, repeat_last_n=0)):
        assert not off.repeating and off.with_context([1, 2], [3]) is off
    for bad in ({"repeat_penalty": 0.0}, {"repeat_penalty": -1.0}, {"repeat_penalty": 11.0}, {"repeat_last_n": -2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def _prompt(tokenizer, n=200) -> list[int]:
    text = " ".join(f"the heap keeps token {i} while the window moves" for i in range(100))
    return tokenizer.encode(text)[:n]


def test_torch_heap_gives_transformers_repetition_penalty_tokens(model_dirs):
    """vLLM's and transformers' form (the whole context): the heap's greedy tokens and raw logits
    are transformers' generate(repetition_penalty=...) with its own cache, and not the unpenalized."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from localheap.backends.torch import TorchBackend

    path = model_dirs("llama")
    backend = TorchBackend.load(path, dtype=torch.float32)
    prompt, n = _prompt(backend.tokenizer), 64
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()

    def reference(penalty):
        config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
                                  pad_token_id=0, repetition_penalty=penalty, return_dict_in_generate=True,
                                  output_logits=True)
        out = stock.generate(torch.tensor([prompt]), generation_config=config)
        return out.sequences[0, len(prompt):].tolist(), [lg[0] for lg in out.logits]

    tokens, logits = reference(1.3)
    params = _params(1.3, -1, [], max_tokens=n).with_context([], prompt)
    cache = backend.new_cache(HeapConfig(budget=1024, slack=512, recent=64))
    got = list(generate_steps(backend.model, cache, prompt, params))
    assert [t for t, _ in got] == tokens
    assert all(torch.equal(a, b) for (_, a), b in zip(got, logits))
    assert tokens != reference(1.0)[0], "the penalty changes this reply"


def test_mlx_heap_gives_mlx_lms_repetition_penalty_tokens(model_dirs):
    """mlx-lm's form (its logits processor over the context's last n tokens): the same greedy
    tokens as mlx-lm's generate_step with its own cache."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_repetition_penalty, make_sampler

    from localheap.backends.mlx import make_heap_cache
    from localheap.backends.mlx.generate import generate_tokens

    model, tokenizer = load(str(model_dirs("llama")))
    prompt, n, chunk = _prompt(tokenizer), 64, 64

    def reference(penalty):
        steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(0.0),
                              prefill_step_size=chunk, prompt_cache=make_prompt_cache(model),
                              logits_processors=[make_repetition_penalty(penalty, 20)])
        return [int(t) for t, _ in steps]

    want = reference(1.3)
    cache = make_heap_cache(model, HeapConfig(budget=1024, slack=chunk, recent=64))
    assert list(generate_tokens(model, cache, prompt, _params(1.3, 20, prompt, max_tokens=n))) == want
    assert want != reference(1.0), "the penalty changes this reply"


@pytest.fixture(scope="module")
def demo(demo_either):
    return demo_either


@pytest.mark.parametrize("batched", [True, False])
def test_the_engines_window_holds_the_sessions_earlier_tokens(demo, batched):
    """A turn after a document fed into its session: the reply is the one `generate` gives with the
    document in the window (its tokens are the session's), not the one without it."""
    turn = demo.tokenizer.encode("The pass key of honey is", add_special_tokens=False)
    params = {"max_tokens": 12, "repeat_penalty": 3.0, "repeat_last_n": -1}
    eng = engine(demo, batched=batched)
    try:
        plain = text(drain(submit(eng, turn, max_tokens=12)[1]))[0]
        doc = demo.tokenizer.encode(plain, add_special_tokens=False) * 3 + ids(40, 3)   # the plain reply's tokens
        fed = drain(submit(eng, doc, feed=True)[1])
        got = text(drain(submit(eng, turn, session_id=fed[-1].session_id, **params)[1]))[0]
        alone = text(drain(submit(eng, turn, **params)[1]))[0]
    finally:
        eng.stop()

    def by_generate(context):
        cache = demo.new_cache(CFG)
        if context:
            demo.prefill(cache, context)
        out = []
        for t in demo.generate(cache, turn, SamplingParams(**params).with_context(context, turn)):
            if t in demo.eos_token_ids:
                break
            out.append(t)
        return demo.tokenizer.decode(out)

    assert got == by_generate(doc)
    assert alone == by_generate([])
    assert got != alone, "the document's tokens in the window change the reply"


def test_the_llamacpp_and_ollama_routes_count_the_window():
    from localheap.server.llamacpp import LlamaRequest
    from localheap.server.ollama import GenerateRequest

    llama = LlamaRequest(prompt="x", presence_penalty=0.5, repeat_last_n=16).params(16, None, [], None)
    ollama = GenerateRequest(model="m", prompt="x", options={"frequency_penalty": 0.3}).params(16)
    assert llama.windowed and llama.windowed_penalties and ollama.windowed and ollama.windowed_penalties
    assert llama.with_context(list(range(40)), []).context == list(range(24, 40))

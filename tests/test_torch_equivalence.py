"""With a budget at least as large as the context, the heap gives exactly transformers' tokens.

Both sides run in float32 on the same device. On the CPU the logits are bit-identical. On CUDA
the tokens must still be identical, the logits equal within 1e-4: sdpa picks its kernel by
the mask it is given (stock: is_causal, the heap: an explicit mask in slot space), and those
kernels sum in different orders (measured on an H100: every logit step differed in the last bits).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from localheap.backends.torch import TorchBackend
from localheap.backends.torch.generate import generate_steps, generate_tokens
from localheap.generation import SamplingParams
from localheap.heap import HeapConfig

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma", "gemma3_text", "gpt_oss", "phi3", "glm4",
            "glm4_moe"]
SLACK = 64
NEW_TOKENS = 256
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def prompt_ids(tokenizer, n_tokens=300):
    text = " ".join(f"the heap keeps token {i} while the window moves" for i in range(200))
    ids = tokenizer.encode(text)
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


def stock_steps(path, prompt, n, chunk, attn="sdpa"):
    """transformers' own generate with its stock DynamicCache and sdpa attention (eager where the
    model has no sdpa: gpt-oss, whose learned sinks sit in the softmax)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval().to(DEVICE)
    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=0, prefill_chunk_size=chunk, return_dict_in_generate=True,
                              output_logits=True)
    out = model.generate(torch.tensor([prompt], device=DEVICE), generation_config=config)
    return out.sequences[0, len(prompt):].tolist(), [lg[0] for lg in out.logits]


def assert_same_steps(got, expected):
    """Same tokens and fp32 logits at every step (strong even if tokens repeat): bit-identical on
    the CPU, within 1e-4 on CUDA (see the module docstring)."""
    tokens, logits = expected
    assert len(got) == len(tokens) == NEW_TOKENS
    assert [t for t, _ in got] == tokens
    for i, ((_, a), b) in enumerate(zip(got, logits)):
        if DEVICE.type == "cpu":
            assert torch.equal(a, b), f"logits differ at step {i}: max {(a - b).abs().max().item()}"
        else:
            torch.testing.assert_close(a, b.float(), atol=1e-4, rtol=1e-4, msg=f"logits differ at step {i}")
    assert (logits[0].max() - logits[0].min()).item() > 0.1, "flat logits would make this test weak"


@pytest.fixture(scope="module")
def backends(model_dirs):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = TorchBackend.load(model_dirs(family), device=str(DEVICE), dtype=torch.float32)
        return cache[family]

    return get


@pytest.mark.parametrize("family,positions", [(f, "compact") for f in FAMILIES]
                         + [("llama", "absolute"), ("gemma3_text", "absolute")])
def test_greedy_matches_stock_chunked_prefill(model_dirs, backends, family, positions):
    backend = backends(family)
    eager = family == "gpt_oss"
    assert backend.model.config._attn_implementation == ("localheap_eager" if eager else "localheap_sdpa")
    prompt = prompt_ids(backend.tokenizer)
    expected = stock_steps(model_dirs(family), prompt, NEW_TOKENS, chunk=SLACK, attn="eager" if eager else "sdpa")
    cache = backend.new_cache(HeapConfig(budget=1024, slack=SLACK, recent=64, positions=positions))
    assert_same_steps(list(generate_steps(backend.model, cache, prompt, SamplingParams(max_tokens=NEW_TOKENS))),
                      expected)
    assert cache.stats().evicted == 0 and cache.tokens_seen == len(prompt) + NEW_TOKENS - 1


def test_greedy_matches_stock_whole_prompt(model_dirs, backends):
    """Prompt in one forward, as transformers' generate does by default."""
    backend = backends("mistral")
    prompt = prompt_ids(backend.tokenizer)
    expected = stock_steps(model_dirs("mistral"), prompt, NEW_TOKENS, chunk=None)
    cache = backend.new_cache(HeapConfig(budget=1024, slack=512, recent=64))
    assert_same_steps(list(generate_steps(backend.model, cache, prompt, SamplingParams(max_tokens=NEW_TOKENS))),
                      expected)


def test_sampling_is_seeded_and_warped(backends):
    backend = backends("llama")
    prompt = prompt_ids(backend.tokenizer, 50)

    def run(params):
        cache = backend.new_cache(HeapConfig(budget=256, slack=SLACK, recent=32))
        return list(generate_tokens(backend.model, cache, prompt, params))

    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    a = run(params)
    assert a == run(params)
    assert run(SamplingParams(max_tokens=40, temperature=1.0, seed=8)) != a
    # top-k 1 leaves only the argmax: sampling must then reproduce greedy decoding
    assert run(SamplingParams(max_tokens=40, temperature=0.7, top_k=1, seed=3)) == run(SamplingParams(max_tokens=40))


def test_prefill_chunk_larger_than_the_slack_matches_stock(model_dirs, backends):
    """The prefill chunk is independent of the slack; with no eviction the tokens are still stock's."""
    backend = backends("llama")
    prompt = prompt_ids(backend.tokenizer)
    expected = stock_steps(model_dirs("llama"), prompt, NEW_TOKENS, chunk=SLACK)
    cache = backend.new_cache(HeapConfig(budget=1024, slack=8, prefill_chunk=SLACK, recent=8))
    assert_same_steps(list(generate_steps(backend.model, cache, prompt, SamplingParams(max_tokens=NEW_TOKENS))),
                      expected)
    assert cache.stats().evicted == 0

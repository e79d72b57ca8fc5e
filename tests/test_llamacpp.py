"""llama.cpp's server API (server/llamacpp.py, routes/llamacpp.py): /completion and /infill give
the stock model's greedy tokens for the prompt llama-server would build (text, ids, mixed, several;
infill's repo-level form), streamed or whole, with llama-server's fields (stop_type, stopping_word,
tokens_cached, timings, completion_probabilities, response_fields); its code-completion limits
(n_indent), grammars, options it refuses; /tokenize, /detokenize, /apply-template, /props."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from localheap.server.fim import FIM_TOKENS

pytestmark = pytest.mark.usefixtures("torch_one_thread")

SPECIAL = FIM_TOKENS[0] + ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>")
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("fastapi")
    from localheap.backends.torch import TorchBackend
    from localheap.randmodel import build_random_model
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    path = build_random_model("qwen2", tmp_path_factory.mktemp("coder"), special=SPECIAL)
    backend = TorchBackend.load(path, dtype=torch.float32)
    with ServerThread(create_app(backend, ServerSettings(web_dir=None, default_max_tokens=32))) as srv:
        yield srv


def _post(srv, path: str, body: dict, status: int = 200):
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def _plain(srv, text: str) -> list[int]:
    return list(srv.services.tokenizer.encode(text, add_special_tokens=False))


def _bos(srv) -> list[int]:
    return list(srv.services.tokenizer.encode("a"))[:-len(_plain(srv, "a"))]


def _special(srv, name: str) -> int:
    return srv.services.tokenizer.get_vocab()[name]


def _stock(srv, ids: list[int], n: int, ends=(), **kw) -> list[int]:
    """transformers' greedy continuation of `ids` with its own cache, cut before an end token
    (`kw`: more of its generation options)."""
    backend = srv.services.backend
    with torch.no_grad():
        out = backend.model.generate(torch.tensor([ids], device=backend.model.device), max_new_tokens=n,
                                     do_sample=False, **kw)[0, len(ids):].tolist()
    stops = set(backend.eos_token_ids) | set(ends)
    return out[:next((i for i, t in enumerate(out) if t in stops), len(out))]


def test_completion_is_the_stock_models_greedy_text_and_reuses_the_prefix(server):
    """A text prompt (BOS first, as llama-server adds it): the stock greedy tokens, their ids with
    return_tokens, stop_type limit at n_predict; the same prompt again reads only what the session
    does not hold (tokens_cached) and gives the same text."""
    body = {"prompt": PREFIX, "n_predict": 10, "temperature": 0, "return_tokens": True}
    ids = _bos(server) + _plain(server, PREFIX)
    want = _stock(server, ids, 10)
    got = _post(server, "/completion", body)
    assert got["tokens"] == want and got["content"] == server.services.tokenizer.decode(want) != ""
    assert got["tokens_evaluated"] == len(ids) and got["tokens_cached"] == 0 and got["stop"] is True
    assert got["stop_type"] == ("limit" if len(want) == 10 else "eos")
    assert got["tokens_predicted"] == 10 - (len(want) < 10)
    assert got["timings"]["prompt_n"] == len(ids) and got["timings"]["predicted_n"] == got["tokens_predicted"]
    again = _post(server, "/completions", body)
    assert again["content"] == got["content"] and again["tokens_cached"] >= len(ids) - 1
    assert again["timings"]["prompt_n"] == len(ids) - again["tokens_cached"]


def test_ids_mixed_prompts_and_several_prompts(server):
    """[ids..., text]: the ids as sent, no BOS (the prompt starts with an id); a list of texts:
    one result each, in order, each as its prompt alone would give it."""
    head = _plain(server, "def ")
    got = _post(server, "/completion", {"prompt": head + ["add(a, b):"], "n_predict": 6, "temperature": 0,
                                        "return_tokens": True, "cache_prompt": False})
    ids = head + _plain(server, "add(a, b):")
    assert got["tokens_evaluated"] == len(ids) and got["tokens"] == _stock(server, ids, 6)
    texts = ["x = ", "class A:\n    "]
    many = _post(server, "/completion", {"prompt": texts, "n_predict": 5, "temperature": 0, "return_tokens": True})
    assert [m["index"] for m in many] == [0, 1]
    for text, m in zip(texts, many):
        assert m["tokens"] == _stock(server, _bos(server) + _plain(server, text), 5)


def test_n_cmpl_gives_each_prompt_n_completions_in_llama_servers_order(server):
    """n_cmpl (or n): prompt k's j-th completion is result k * n + j, seeded seed + its index (the
    first as the same request with n 1; each the prompt's own greedy text at temperature 0);
    streamed, every piece names its index and the pieces join to the whole replies."""
    body = {"prompt": PREFIX, "n_predict": 6, "temperature": 1.0, "seed": 9, "return_tokens": True,
            "cache_prompt": False}
    three = _post(server, "/completion", {**body, "n_cmpl": 3})
    assert [r["index"] for r in three] == [0, 1, 2]
    alone = [_post(server, "/completion", {**body, "seed": 9 + i})["tokens"] for i in range(3)]
    assert [r["tokens"] for r in three] == alone and len({tuple(a) for a in alone}) > 1
    assert [r["tokens"] for r in _post(server, "/completion", {**body, "n": 3})] == alone
    texts = ["x = ", "class A:\n    "]
    greedy = _post(server, "/completion", {"prompt": texts, "n_predict": 4, "temperature": 0, "return_tokens": True,
                                           "n_cmpl": 2})
    assert [r["index"] for r in greedy] == [0, 1, 2, 3]
    for k, text in enumerate(texts):
        want = _stock(server, _bos(server) + _plain(server, text), 4)
        assert greedy[2 * k]["tokens"] == greedy[2 * k + 1]["tokens"] == want
    with httpx.stream("POST", server.url + "/completion", json={**body, "n_cmpl": 2, "stream": True},
                      timeout=120) as r:
        pieces = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    for i in range(2):
        mine = [p for p in pieces if p["index"] == i]
        assert "".join(p["content"] for p in mine) == server.services.tokenizer.decode(alone[i])
        assert mine[-1]["stop"] is True
    too_many = _post(server, "/completion", {"prompt": ["a"] * 9, "n_cmpl": 8}, status=400)
    assert too_many["error"]["param"] == "n_cmpl"
    assert _post(server, "/completion", {**body, "n_cmpl": 0}, status=400)["error"]["param"] == "n_cmpl"


def test_the_repetition_penalty_is_transformers_and_the_samplers_list_can_leave_it_out(server):
    """repeat_penalty over the whole context (repeat_last_n -1) on /completion, and vLLM's
    repetition_penalty on /v1/completions: transformers' greedy tokens with its own repetition
    penalty; a `samplers` list without "penalties" leaves it off, as llama-server does."""
    ids = _bos(server) + _plain(server, PREFIX * 3)
    want = _stock(server, ids, 12, repetition_penalty=1.5)
    assert want != _stock(server, ids, 12), "the penalty changes this reply"
    body = {"prompt": ids, "n_predict": 12, "temperature": 0, "return_tokens": True, "ignore_eos": False}
    got = _post(server, "/completion", {**body, "repeat_penalty": 1.5, "repeat_last_n": -1})
    assert got["tokens"] == want
    assert got["generation_settings"]["repeat_penalty"] == 1.5 and "penalties" in got["generation_settings"]["samplers"]
    off = _post(server, "/completion", {**body, "repeat_penalty": 1.5, "samplers": ["top_k", "temperature"]})
    assert off["tokens"] == _stock(server, ids, 12) and off["generation_settings"]["repeat_penalty"] == 1.0
    oai = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0,
                                            "repetition_penalty": 1.5})
    assert oai["choices"][0]["text"] == server.services.tokenizer.decode(want)
    both = _post(server, "/v1/completions", {"prompt": ids, "repetition_penalty": 1.5, "repeat_penalty": 1.2},
                 status=400)
    assert "not both" in json.dumps(both)
    for bad, param in (({"repeat_penalty": 0}, "repeat_penalty"), ({"repeat_last_n": -3}, "repeat_last_n")):
        assert _post(server, "/completion", {**body, **bad}, status=400)["error"]["param"] == param


def test_dry_options_reach_the_sampler_with_the_prompt_in_its_window(server):
    """dry_* on /completion: the tokens `generate` gives with the same DRY params and the prompt as
    its window's start (the breakers found in the vocabulary); a samplers list without "dry" leaves
    it off; the OpenAI routes take the same options."""
    from localheap.dry import DEFAULT_BREAKERS, breaker_ids
    from localheap.generation import SamplingParams
    from localheap.heap import HeapConfig

    backend = server.services.backend
    ids = _bos(server) + _plain(server, "x = x + 1\n" * 6 + "x = x")
    dry = {"dry_multiplier": 1.5, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1}
    body = {"prompt": ids, "n_predict": 12, "temperature": 0, "return_tokens": True, "cache_prompt": False}
    got = _post(server, "/completion", {**body, **dry})
    params = SamplingParams(max_tokens=12, **dry, dry_breakers=breaker_ids(backend.tokenizer, DEFAULT_BREAKERS))
    cache = backend.new_cache(HeapConfig(budget=1024, slack=64))
    want = list(backend.generate(cache, ids, params.with_context([], ids)))
    stops = set(backend.eos_token_ids)
    want = want[:next((i for i, t in enumerate(want) if t in stops), len(want))]
    assert got["tokens"] == want and got["generation_settings"]["dry_multiplier"] == 1.5
    plain = _post(server, "/completion", body)["tokens"]
    assert plain != want, "DRY changes this reply"
    assert _post(server, "/completion", {**body, **dry, "samplers": ["top_k", "temperature"]})["tokens"] == plain
    assert _post(server, "/completion", {**body, **dry, "dry_sequence_breakers": []}, status=400)["error"]["param"] \
        == "dry_sequence_breakers"
    oai = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0, **dry})
    assert oai["choices"][0]["text"] == server.services.tokenizer.decode(want)


@pytest.mark.parametrize("option,value,name", [("typical_p", 0.3, "typ_p"), ("top_n_sigma", 0.5, "top_n_sigma"),
                                               ("xtc_probability", 1.0, "xtc"), ("dynatemp_range", 0.9, "temperature")])
def test_typical_top_n_sigma_xtc_dynatemp_are_taken_and_a_samplers_list_can_leave_them_out(server, option, value,
                                                                                            name):
    """Seeded, sampled at temperature 1: the option changes the draws and shows in the settings;
    a samplers list without its name leaves it off (the plain draws: dynatemp goes with the
    temperature sampler); the OpenAI route takes it."""
    body = {"prompt": PREFIX, "n_predict": 16, "temperature": 1.0, "seed": 3, "top_k": 0, "top_p": 1.0,
            "min_p": 0.0, "return_tokens": True}
    plain = _post(server, "/completion", body)
    got = _post(server, "/completion", {**body, option: value, "xtc_threshold": 0.01})
    assert got["tokens"] != plain["tokens"] and got["generation_settings"][option] == value
    assert name in got["generation_settings"]["samplers"]
    off = _post(server, "/completion", {**body, option: value, "xtc_threshold": 0.01,
                                        "samplers": [s for s in ("penalties", "dry", "temperature") if s != name]})
    assert off["tokens"] == plain["tokens"] and off["generation_settings"][option] != value
    oai = {"prompt": PREFIX, "max_tokens": 4, "temperature": 1.0, "seed": 3, option: value}
    assert _post(server, "/v1/completions", oai)["choices"][0]["finish_reason"]


def test_mirostat_is_taken_in_place_of_the_cut_offs(server):
    body = {"prompt": PREFIX, "n_predict": 16, "temperature": 1.0, "seed": 3, "return_tokens": True}
    plain = _post(server, "/completion", body)
    got = _post(server, "/completion", {**body, "mirostat": 2, "mirostat_tau": 2.0, "mirostat_eta": 0.2})
    assert got["tokens"] != plain["tokens"]
    assert {k: got["generation_settings"][k] for k in ("mirostat", "mirostat_tau", "mirostat_eta")} == \
        {"mirostat": 2, "mirostat_tau": 2.0, "mirostat_eta": 0.2}
    assert _post(server, "/completion", {**body, "mirostat": 3}, status=400)["error"]["param"] == "mirostat"
    oai = {"prompt": PREFIX, "max_tokens": 4, "temperature": 1.0, "mirostat": 1}
    assert _post(server, "/v1/completions", oai)["choices"][0]["finish_reason"]


def test_adaptive_p_is_taken_where_the_samplers_list_names_it(server):
    # (a random model's logits are near-tied: at temperature 0.05 its top 20 spread out, so ids near
    # the target and far from it both stand among them)
    body = {"prompt": PREFIX, "n_predict": 16, "temperature": 0.05, "seed": 3, "top_k": 20, "return_tokens": True,
            "samplers": ["top_k", "temperature", "adaptive_p"]}
    plain = _post(server, "/completion", body)
    got = _post(server, "/completion", {**body, "adaptive_target": 0.1, "adaptive_decay": 0.5})
    assert got["tokens"] != plain["tokens"] and "adaptive_p" in got["generation_settings"]["samplers"]
    assert (got["generation_settings"]["adaptive_target"], got["generation_settings"]["adaptive_decay"]) == (0.1, 0.5)
    unnamed = _post(server, "/completion", {**body, "adaptive_target": 0.1, "samplers": ["top_k", "temperature"]})
    assert unnamed["tokens"] == plain["tokens"]
    assert _post(server, "/completion", {**body, "adaptive_target": 2}, status=400)["error"]["param"] == \
        "adaptive_target"
    oai = {"prompt": PREFIX, "max_tokens": 4, "temperature": 1.0, "adaptive_target": 0.1, "samplers": "kta"}
    assert _post(server, "/v1/completions", oai)["choices"][0]["finish_reason"]


def test_the_openai_routes_give_vllms_stop_reason(server):
    """stop_reason: the stop string or stop_token_ids id that ended the reply (None for the limit
    or end of sequence), whole and on a stream's last chunk."""
    ids = _bos(server) + _plain(server, PREFIX)
    want = _stock(server, ids, 10)
    text = server.services.tokenizer.decode(want)
    body = {"prompt": ids, "max_tokens": 10, "temperature": 0}
    plain = _post(server, "/v1/completions", body)["choices"][0]
    assert plain["text"] == text and plain["stop_reason"] is None
    stop = text[len(text) // 2: len(text) // 2 + 2]
    by_word = _post(server, "/v1/completions", {**body, "stop": [stop]})["choices"][0]
    assert by_word["finish_reason"] == "stop" and by_word["stop_reason"] == stop
    by_id = _post(server, "/v1/completions", {**body, "stop_token_ids": [want[2]]})["choices"][0]
    assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == want[2]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stop": [stop], "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop


def test_stream_pieces_join_to_the_whole_reply(server):
    body = {"prompt": "import os\n", "n_predict": 12, "temperature": 0}
    whole = _post(server, "/completion", body)
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    pieces = [json.loads(line) for line in lines]   # (no [DONE]: every line is JSON)
    assert all(not p["stop"] for p in pieces[:-1]) and pieces[-1]["stop"] is True
    assert "".join(p["content"] for p in pieces) == whole["content"]
    assert sum(len(p["tokens"]) for p in pieces[:-1]) == whole["tokens_predicted"] - (whole["stop_type"] == "eos")
    assert pieces[-1]["timings"]["predicted_n"] == whole["tokens_predicted"]


def test_infill_builds_the_repo_level_prompt_and_writes_the_stock_middle(server):
    """input_extra on a model with <|repo_name|> and <|file_sep|>: [BOS] <|repo_name|>myproject\\n
    <|file_sep|>util.py\\nTEXT <|file_sep|>filename\\n <prefix>...<suffix>...<middle> PROMPT; the reply
    is the stock greedy middle, ended by a FIM end token, also when a warm-up (n_predict 0) read the
    context before it."""
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n", "time": 3}]
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra, "prompt": "a",
            "n_predict": 8, "temperature": 0, "return_tokens": True, "samplers": ["temperature"],
            "t_max_prompt_ms": 500, "id_slot": 0, "cache_prompt": True}
    sep = _special(server, "<|file_sep|>")
    ids = (_bos(server) + [_special(server, "<|repo_name|>")] + _plain(server, "myproject\n")
           + [sep] + _plain(server, "util.py\n" + extra[0]["text"]) + [sep] + _plain(server, "filename\n")
           + [_special(server, "<|fim_prefix|>")] + _plain(server, PREFIX) + [_special(server, "<|fim_suffix|>")]
           + _plain(server, SUFFIX) + [_special(server, "<|fim_middle|>")] + _plain(server, "a"))
    warm = _post(server, "/infill", {**body, "n_predict": 0, "input_prefix": "", "input_suffix": "", "prompt": ""})
    context = len(ids) - len(_plain(server, PREFIX)) - len(_plain(server, SUFFIX)) - len(_plain(server, "a")) - 3
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["tokens_evaluated"] == context
    got = _post(server, "/infill", body)   # reads only what follows the warm-up's context
    assert got["tokens_evaluated"] == len(ids) and got["tokens_cached"] >= context
    want = _stock(server, ids, 8, ends=(_special(server, "<|fim_pad|>"), sep))
    assert got["tokens"] == want and got["content"] == server.services.tokenizer.decode(want)


def test_infill_reads_special_tokens_text_in_the_files_as_text(server):
    """A file may hold a special token's text (this server's own fim.py holds `<|fim_middle|>`):
    llama-server reads input_prefix, input_suffix and input_extra with parse_special off, so the
    prompt's FIM structure is only its own tokens. They were read as those tokens."""
    code = "x = '<|fim_middle|><|file_sep|><|fim_pad|>'\n"
    extra = [{"filename": "t<|file_sep|>.py", "text": code}]
    got = _post(server, "/infill", {"input_prefix": code, "input_suffix": code, "input_extra": extra,
                                    "prompt": "a", "n_predict": 6, "temperature": 0, "return_tokens": True})

    from tokenizers import Tokenizer

    from localheap.grammar import rust_tokenizer

    as_text = Tokenizer.from_str(rust_tokenizer(server.services.tokenizer).to_str())   # (a copy: see below)
    as_text.encode_special_tokens = True

    def text(s):
        return as_text.encode(s, add_special_tokens=False).ids

    sep = _special(server, "<|file_sep|>")
    assert _special(server, "<|fim_middle|>") not in text(code)
    ids = (_bos(server) + [_special(server, "<|repo_name|>")] + text("myproject\n") + [sep]
           + text("t<|file_sep|>.py\n" + code) + [sep] + text("filename\n") + [_special(server, "<|fim_prefix|>")]
           + text(code) + [_special(server, "<|fim_suffix|>")] + text(code) + [_special(server, "<|fim_middle|>")]
           + _plain(server, "a"))
    assert got["tokens_evaluated"] == len(ids)
    assert got["tokens"] == _stock(server, ids, 6, ends=(_special(server, "<|fim_pad|>"), sep))
    # read so on a copy of its own: transformers' split_special_tokens set a flag on the one Rust tokenizer
    # every thread encodes with, and left it set, so a chat prompt read meanwhile lost its special tokens
    assert not rust_tokenizer(server.services.tokenizer).encode_special_tokens
    r = _post(server, "/tokenize", {"content": code, "parse_special": False})
    assert r["tokens"] == text(code) and not rust_tokenizer(server.services.tokenizer).encode_special_tokens
    # Ollama's /api/show lists "insert" for a model that takes a suffix (editors turn FIM on by it)
    assert "insert" in _post(server, "/api/show", {"model": server.services.model_id})["capabilities"]


def test_n_indent_cuts_a_line_less_indented_than_the_cursor(server, force):
    force("x = 1\n        y = 2\n    z\nw")
    got = _post(server, "/infill", {"input_prefix": "if a:\n    ", "input_suffix": "", "n_indent": 4,
                                    "n_predict": 40})
    assert got["content"] == "x = 1\n        y = 2\n    z\n" and got["stop_type"] == "limit"
    force("x = 1\n  y")   # the first line is the cursor's: never cut
    got = _post(server, "/infill", {"input_prefix": "if a:\n    ", "input_suffix": "", "n_indent": 4,
                                    "n_predict": 40})
    assert got["content"] == "x = 1\n  " and got["stop_type"] == "limit"


def test_stop_words_and_eos(server, force):
    force("hello world END more")
    got = _post(server, "/completion", {"prompt": "say", "stop": ["XYZ", "END"], "n_predict": 30})
    assert got["content"] == "hello world " and got["stop_type"] == "word" and got["stopping_word"] == "END"
    force("hello")
    got = _post(server, "/completion", {"prompt": "say", "n_predict": 30})
    assert got["content"] == "hello" and got["stop_type"] == "eos" and got["stopping_word"] == ""


def test_grammar_and_json_schema_hold_the_reply(server):
    got = _post(server, "/completion", {"prompt": "Answer:", "grammar": 'root ::= "yes" | "no"', "n_predict": 8,
                                        "seed": 3})
    assert got["content"] in ("yes", "no") and got["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}
    got = _post(server, "/completion", {"prompt": "JSON:", "json_schema": schema, "n_predict": 40, "seed": 1,
                                        "temperature": 0.5})
    assert got["stop_type"] == "eos" and json.loads(got["content"])["n"] in (1, 2, 3)
    bad = _post(server, "/completion", {"prompt": "a", "grammar": "root ::= (", "n_predict": 2}, status=400)
    assert bad["error"]["param"] == "grammar"


def test_n_probs_and_response_fields(server):
    got = _post(server, "/completion", {"prompt": PREFIX, "n_predict": 4, "temperature": 0, "n_probs": 3,
                                        "return_tokens": True})
    probs = got["completion_probabilities"]
    assert [p["id"] for p in probs] == got["tokens"][:len(probs)] and len(probs) == len(got["tokens"])
    for p in probs:   # greedy: the chosen token is the likeliest
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]
        assert p["top_logprobs"][0]["logprob"] == pytest.approx(p["logprob"])
    picked = _post(server, "/completion", {"prompt": PREFIX, "n_predict": 4, "temperature": 0,
                                           "response_fields": ["content", "timings/prompt_n", "nope/x"]})
    assert set(picked) == {"content", "timings/prompt_n", "localheap"} and picked["content"] == got["content"]


def test_post_sampling_probs_are_the_chains_distribution(server):
    """post_sampling_probs: prob and top_probs of the distribution the token was drawn from: a
    grammar's allowed ids only (a classifier reading label probabilities), top-k's k ids summing
    to 1; greedy, the one id at 1; the chat route writes its logprobs the same way."""
    body = {"prompt": PREFIX, "n_predict": 1, "temperature": 1.0, "n_probs": 10, "post_sampling_probs": True,
            "samplers": ["temperature"], "grammar": 'root ::= "x" | "y" | "z"', "seed": 1}
    got = _post(server, "/completion", body)["completion_probabilities"][0]
    assert {p["token"] for p in got["top_probs"]} <= {"x", "y", "z"} and len(got["top_probs"]) >= 2
    assert sum(p["prob"] for p in got["top_probs"]) == pytest.approx(1.0, abs=1e-4)
    assert got["prob"] == next(p["prob"] for p in got["top_probs"] if p["id"] == got["id"])
    assert "logprob" not in got and "top_logprobs" not in got
    cut = {"prompt": PREFIX, "n_predict": 3, "temperature": 0.7, "top_k": 4, "n_probs": 10, "seed": 2,
           "post_sampling_probs": True, "return_tokens": True}
    whole = _post(server, "/completion", cut)
    assert whole["tokens"] == _post(server, "/completion", {**cut, "post_sampling_probs": False})["tokens"]
    for p in whole["completion_probabilities"]:
        assert len(p["top_probs"]) == 4 and sum(q["prob"] for q in p["top_probs"]) == pytest.approx(1.0, abs=1e-4)
    greedy = _post(server, "/completion", {**cut, "temperature": 0})["completion_probabilities"]
    assert all(p["prob"] == 1.0 and [q["id"] for q in p["top_probs"]] == [p["id"]] for p in greedy)
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  "temperature": 0.7, "top_k": 4, "logprobs": True, "top_logprobs": 5,
                                                  "post_sampling_probs": True})
    for e in chat["choices"][0]["logprobs"]["content"]:
        assert len(e["top_probs"]) == 4 and sum(q["prob"] for q in e["top_probs"]) == pytest.approx(1.0, abs=1e-4)


def test_return_progress_streams_the_prompts_reading(server):
    """return_progress: stream pieces (and OpenAI chat chunks) with prompt_progress as the prompt is
    read, from the cached tokens up to all of them, before the reply's text; whole replies and
    streams without it carry none."""
    long = " ".join(f"line {i} of the file" for i in range(500))
    body = {"prompt": long, "n_predict": 3, "temperature": 0, "stream": True, "return_progress": True,
            "cache_prompt": False}
    with httpx.stream("POST", server.url + "/completion", json=body, timeout=120) as r:
        pieces = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    marks = [p["prompt_progress"] for p in pieces if "prompt_progress" in p]
    total = pieces[-1]["tokens_evaluated"]
    assert len(marks) >= 3 and marks[0]["processed"] == marks[0]["cache"] == 0 and marks[-1]["processed"] == total
    assert [m["processed"] for m in marks] == sorted(m["processed"] for m in marks)
    assert all(m["total"] == total for m in marks) and all(p["content"] == "" for p in pieces if "prompt_progress" in p)
    text = [i for i, p in enumerate(pieces) if p["content"]]
    assert not text or text[0] > pieces.index(next(p for p in pieces if p.get("prompt_progress") == marks[-1]))
    plain = {**body, "return_progress": False}
    with httpx.stream("POST", server.url + "/completion", json=plain, timeout=120) as r:
        assert not any("prompt_progress" in line for line in r.iter_lines())
    chat = {"messages": [{"role": "user", "content": long}], "max_tokens": 2, "stream": True, "return_progress": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, timeout=120) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    marks = [c for c in chunks if "prompt_progress" in c]
    assert len(marks) >= 2 and marks[-1]["prompt_progress"]["processed"] == marks[-1]["prompt_progress"]["total"]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": None} for c in marks)


def test_options_it_has_no_sampler_for_are_refused_unless_off(server):
    base = {"prompt": "a", "n_predict": 2}
    for name, value in (("lora", [{"id": 0, "scale": 1.0}]),):
        bad = _post(server, "/completion", {**base, name: value}, status=400)
        assert bad["error"]["param"] == name and "no LoRA adapters" in bad["error"]["message"]
    off = {"repeat_penalty": 1.0, "mirostat": 0, "typical_p": 1.0, "dry_multiplier": 0.0, "repeat_last_n": 64,
           "xtc_probability": 0.0, "top_n_sigma": -1, "dynatemp_range": 0.0,
           "id_slot": -1, "n_keep": 0, "cache_prompt": True, "timings_per_token": False, "samplers": "kpmt"}
    assert _post(server, "/completion", {**base, **off})["stop"] is True
    # what llama-server does not know either it ignores, and so does this server, naming them
    got = _post(server, "/completion", {**base, "bogus": 1, "samplers": ["top_k", "magic", "Top-P", "temp"]})
    assert got["localheap"]["ignored_options"] == ["bogus", "samplers:magic"]
    assert got["generation_settings"]["top_p"] == 0.95 and got["generation_settings"]["temperature"] == 0.8
    assert "ignored_options" not in _post(server, "/completion", base)["localheap"]
    bad = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2, "samplers": ["magic"]}, status=400)
    assert "magic" in bad["error"]["message"]
    assert _post(server, "/completion", {"prompt": "", "n_predict": 2}, status=400)["error"]["param"] == "prompt"
    assert _post(server, "/completion", {**base, "logit_bias": [[10 ** 7, 1.0]]}, status=400)["error"]["param"] == \
        "logit_bias"


def test_seeded_sampling_repeats_and_logit_bias_bans(server):
    body = {"prompt": "The", "n_predict": 8, "temperature": 1.0, "seed": 42, "return_tokens": True,
            "cache_prompt": False}
    first = _post(server, "/completion", body)["tokens"]
    assert _post(server, "/completion", body)["tokens"] == first
    greedy = _post(server, "/completion", {**body, "temperature": 0})["tokens"]
    banned = _post(server, "/completion", {**body, "temperature": 0, "logit_bias": [[greedy[0], False]]})["tokens"]
    assert banned[0] != greedy[0]
    text_ban = _post(server, "/completion", {**body, "temperature": 0,
                                             "logit_bias": [[server.services.tokenizer.decode([greedy[0]]), False]]})
    assert text_ban["tokens"][0] != greedy[0]


def test_tokenize_detokenize_apply_template_and_props(server):
    tok = server.services.tokenizer
    text = "def f():<|fim_prefix|> é"
    got = _post(server, "/tokenize", {"content": text})["tokens"]
    assert got == list(tok.encode(text, add_special_tokens=False)) and _special(server, "<|fim_prefix|>") in got
    split = _post(server, "/tokenize", {"content": text, "parse_special": False})["tokens"]
    assert _special(server, "<|fim_prefix|>") not in split and tok.decode(split) == text
    assert _post(server, "/tokenize", {"content": "a", "add_special": True})["tokens"] == list(tok.encode("a"))
    pieces = _post(server, "/tokenize", {"content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == got
    data = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert data.decode() == text
    long = "alpha beta gamma " * 6000   # past a tokenizer piece (64K characters): read in pieces, the same ids
    assert _post(server, "/tokenize", {"content": long})["tokens"] == list(tok.encode(long, add_special_tokens=False))
    assert _post(server, "/tokenize", {"content": long, "parse_special": False}, status=400)["error"]["param"] == \
        "content"
    assert _post(server, "/detokenize", {"tokens": got})["content"] == tok.decode(got)
    assert _post(server, "/detokenize", {"tokens": [-1]}, status=400)["error"]["param"] == "tokens"
    msgs = [{"role": "user", "content": "hi"}]
    assert _post(server, "/apply-template", {"messages": msgs})["prompt"] == \
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    props = httpx.get(server.url + "/props", timeout=30).json()
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (0.8, 40, 0.95, 0.05)
    assert props["default_generation_settings"]["n_ctx"] == server.services.settings.max_prompt_tokens
    assert "{%" in props["chat_template"] and props["total_slots"] == server.services.settings.max_active


def test_both_backends_the_openai_routes_reply_and_no_infill_without_fim_tokens(demo_either):
    """On the demo model (torch and MLX): /completion's greedy reply is /v1/completions' (same
    prompt, same session path), its ids are the text's, a stop word is found; the demo model has
    no FIM tokens, so /infill is a 400 that says so."""
    from localheap.server import ServerSettings, create_app
    from localheap.server.testing import ServerThread

    with ServerThread(create_app(demo_either, ServerSettings(web_dir=None))) as srv:
        body = {"prompt": "Once upon a time", "temperature": 0, "cache_prompt": False}
        got = _post(srv, "/completion", {**body, "n_predict": 12, "return_tokens": True})
        oai = _post(srv, "/v1/completions", {"prompt": body["prompt"], "max_tokens": 12, "temperature": 0,
                                              "store": False})["choices"][0]["text"]
        assert got["content"] == oai != "" and srv.services.tokenizer.decode(got["tokens"]) == got["content"]
        word = got["content"].strip().split()[-1] if got["content"].strip() else None
        if word:
            cut = _post(srv, "/completion", {**body, "n_predict": 12, "stop": [word]})
            assert cut["stop_type"] == "word" and cut["stopping_word"] == word
            assert cut["content"] == got["content"][:got["content"].find(word)]
        bad = _post(srv, "/infill", {"input_prefix": "a", "input_suffix": "b"}, status=400)
        assert "fill-in-the-middle" in bad["error"]["message"]


def test_t_max_predict_ms_ends_the_reply_after_a_newline(server, force):
    """Past the time limit, once a newline is written, the reply ends (stop_type limit); before a
    newline it goes on."""
    force("a\nb c d e f g h i j k l m n o p")
    got = _post(server, "/completion", {"prompt": "x", "n_predict": 60, "t_max_predict_ms": 1})
    assert got["stop_type"] == "limit" and got["content"].startswith("a\n")
    assert len(got["content"]) < len("a\nb c d e f g h i j k l m n o p")
    force("abcdefghijklmnop")
    got = _post(server, "/completion", {"prompt": "x", "n_predict": 60, "t_max_predict_ms": 1})
    assert got["content"] == "abcdefghijklmnop" and got["stop_type"] == "eos"


# SillyTavern 1.18's body for its llama.cpp text-completion type on a fresh install (its
# createTextGenGenerationData, every backend's names for the same settings, sent to /completion
# as they are): llama-server ignores the ones it does not know, and so must this server
SILLYTAVERN = {
    "max_new_tokens": 12, "max_tokens": 12, "n_predict": 12, "num_predict": 12, "temperature": 1, "top_p": 0.95,
    "typical_p": 1, "typical": 1, "min_p": 0.01, "repetition_penalty": 1.1, "rep_pen": 1.1, "repeat_penalty": 1.1,
    "frequency_penalty": 0, "presence_penalty": 0, "top_k": 0, "skew": 0, "min_tokens": 0, "add_bos_token": True,
    "smoothing_factor": 0, "smoothing_curve": 1, "dry_allowed_length": 2, "dry_multiplier": 0, "dry_base": 1.75,
    "dry_sequence_breakers": ["\n", ":", "\"", "*"], "dry_penalty_last_n": 0, "max_tokens_second": 0,
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "tfs_z", "typical_p", "xtc", "top_p",
                 "adaptive_p", "min_p", "temperature"],
    "stopping_strings": ["\nUser:"], "stop": ["\nUser:"], "truncation_length": 8192, "num_ctx": 8192,
    "ban_eos_token": False, "ignore_eos": False, "skip_special_tokens": True, "include_reasoning": True, "top_a": 0,
    "tfs": 1, "mirostat_mode": 0, "mirostat": 0, "mirostat_tau": 5, "mirostat_eta": 0.1, "custom_token_bans": "",
    "banned_strings": [], "api_type": "llamacpp", "api_server": "http://127.0.0.1:8080", "xtc_threshold": 0.1,
    "xtc_probability": 0, "nsigma": 0, "top_n_sigma": 0, "min_keep": 0, "adaptive_target": -0.01,
    "adaptive_decay": 0.9, "n": 1, "rep_pen_range": 0, "repetition_penalty_range": 0, "repeat_last_n": 0,
    "guidance_scale": 1, "negative_prompt": "", "rep_pen_slope": 1, "logit_bias": [], "grammar": "",
    "cache_prompt": True}


def test_sillytaverns_llamacpp_requests_as_it_sends_them(server):
    """SillyTavern's body, whole and streamed, and with a seed: the reply its settings give (the
    same tokens as the body with only llama-server's own options), the others named as ignored."""
    prompt = "User: hi\nAssistant:"
    own = {k: v for k, v in SILLYTAVERN.items() if k in ("n_predict", "temperature", "top_p", "typical_p", "min_p",
                                                          "repeat_penalty", "top_k", "stop", "repeat_last_n",
                                                          "dry_multiplier", "xtc_probability", "mirostat")}
    seeded = {**SILLYTAVERN, "prompt": prompt, "seed": 3, "sampler_seed": 3, "return_tokens": True}
    got = _post(server, "/completion", seeded)
    assert got["tokens"] == _post(server, "/completion", {**own, "prompt": prompt, "seed": 3,
                                                          "return_tokens": True})["tokens"]
    ignored = got["localheap"]["ignored_options"]
    assert {"api_server", "nsigma", "truncation_length", "samplers:tfs_z", "samplers:typical_p"} <= set(ignored)
    assert "adaptive_target" not in ignored and "samplers:adaptive_p" not in ignored
    with httpx.stream("POST", server.url + "/completion", json={**seeded, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        pieces = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert "".join(p["content"] for p in pieces) == got["content"] and pieces[-1]["stop"] is True
    assert _post(server, "/tokenize", {"model": "undefined", "content": prompt})["tokens"]   # as it asks for counts


def test_open_webuis_ollama_style_params_and_openais_newer_fields_on_the_openai_routes(server):
    """Open WebUI puts its Advanced Params (Ollama's names) at the top of an OpenAI request: the
    runtime ones change nothing, tfs_z only at 1, think and format become their OpenAI fields.
    OpenAI's newer hints are accepted; an unknown field is still a 400 naming it."""
    from localheap.server.schemas import ChatCompletionRequest

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    plain = _post(server, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    webui = {"num_ctx": 8192, "num_batch": 512, "num_keep": 4, "num_thread": 4, "num_gpu": 99, "use_mmap": True,
             "use_mlock": False, "keep_alive": "5m", "tfs_z": 1, "top_k": 40, "min_p": 0.0, "repeat_last_n": 64,
             "mirostat": 0, "stream_options": None}
    assert _post(server, "/v1/chat/completions", {**chat, **webui})["choices"][0]["message"]["content"] == plain
    assert _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2, "num_ctx": 4096, "keep_alive": 0})[
        "choices"]
    assert _post(server, "/v1/chat/completions", {**chat, "tfs_z": 0.9}, status=400)["error"]["param"] == "tfs_z"
    newer = {"verbosity": "low", "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k",
             "safety_identifier": "u1", "service_tier": "auto", "modalities": ["text"]}
    assert _post(server, "/v1/chat/completions", {**chat, **newer})["choices"][0]["message"]["content"] == plain
    assert _post(server, "/v1/chat/completions", {**chat, "modalities": ["audio"]}, status=400)
    assert _post(server, "/v1/chat/completions", {**chat, "temprature": 0.5}, status=400)["error"]["param"] == \
        "temprature"

    def parsed(**kw):
        return ChatCompletionRequest.model_validate({**chat, **kw})

    assert parsed(think=False).chat_template_kwargs == {"enable_thinking": False}
    assert parsed(think="high").chat_template_kwargs == {"enable_thinking": True}
    assert parsed(think=True, chat_template_kwargs={"x": 1}).chat_template_kwargs == {"x": 1}
    assert parsed(format="json").response_format.type == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert parsed(format=schema).response_format.json_schema.schema_ == schema
    assert _post(server, "/v1/chat/completions", {**chat, "format": 3}, status=400)["error"]["param"] == "format"


def test_llama_vscode_requests_as_it_sends_them(server):
    """llama.vscode's own bodies: its completion (samplers top_k, top_p, infill; n_indent; lora
    absent), its warm-up (n_predict 0, samplers []), and its chat edit on /v1/chat/completions with
    llama-server's options and no model; llama-server's samplers turn the others off there too."""
    chunks = [{"text": "x = 1\n", "time": 1, "filename": "a.py"}]
    fim = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": chunks, "prompt": "", "n_predict": 8,
           "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
           "cache_prompt": True, "n_indent": 4, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000}
    got = _post(server, "/infill", fim)
    assert got["stop"] is True and {"content", "tokens_cached", "timings", "truncated"} <= set(got)
    assert got["generation_settings"]["temperature"] == 1.0   # no "temperature" sampler: the logits as they are
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": chunks, "prompt": "", "n_predict": 0,
            "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1}
    assert _post(server, "/infill", warm)["tokens_predicted"] == 0
    edit = {"messages": [{"role": "system", "content": "You are an expert coder."},
                         {"role": "user", "content": "rename x"}],
            "stream": False, "cache_prompt": True, "samplers": "edkypmxt", "temperature": 0.8, "dynatemp_range": 0,
            "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1,
            "xtc_probability": 0, "xtc_threshold": 0.1, "repeat_last_n": 64, "repeat_penalty": 1,
            "presence_penalty": 0, "frequency_penalty": 0, "dry_multiplier": 0, "dry_base": 1.75,
            "dry_allowed_length": 2, "dry_penalty_last_n": -1, "max_tokens": -1, "timings_per_token": False}
    chat = _post(server, "/v1/chat/completions", {**edit, "max_tokens": 4} | {"max_tokens": -1, "seed": 1})
    assert chat["choices"][0]["message"]["role"] == "assistant"
    two = _post(server, "/v1/chat/completions", {**edit, "n_cmpl": 2, "max_tokens": 3})   # llama-server's n
    assert [c["index"] for c in two["choices"]] == [0, 1]
    bad = _post(server, "/v1/chat/completions", {**edit, "n_cmpl": 9}, status=400)
    assert bad["error"]["param"] == "n"
    greedy = {"messages": edit["messages"], "max_tokens": 6, "temperature": 0, "seed": 5}
    plain = _post(server, "/v1/chat/completions", greedy)["choices"][0]["message"]["content"]
    # temperature 0 but no "temperature" sampler named: sampled at temperature 1 (seeded), not greedy
    unscaled = _post(server, "/v1/chat/completions", {**greedy, "samplers": ["top_k"], "top_k": 0,
                                                      "temperature": 1.0})["choices"][0]["message"]["content"]
    assert _post(server, "/v1/chat/completions", {**greedy, "samplers": ["top_k"]})["choices"][0]["message"][
        "content"] == unscaled
    assert _post(server, "/v1/chat/completions", {**greedy, "samplers": ["temperature"]})["choices"][0]["message"][
        "content"] == plain


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_warm_up_is_checkpointed_so_every_completion_after_it_reuses_the_context(tmp_path, kind):
    """An editor's flow on a heap far smaller than its context (so a session that read one
    completion cannot be rolled back to the context exactly): the warm-up (n_predict 0, the other
    files) reads only the part before <prefix> and checkpoints it; each completion then reuses all
    of it, whatever its prefix, and the editor holds one session, not one a completion. Both
    backends (the checkpoint is each one's own heap file)."""
    from localheap.heap import HeapConfig
    from localheap.randmodel import build_random_model
    from localheap.server import ServerSettings, create_app
    from localheap.server.llamacpp import LlamaRequest, infill_context
    from localheap.server.testing import ServerThread

    path = build_random_model("qwen2", tmp_path / "m", special=SPECIAL)
    if kind == "torch":
        from localheap.backends.torch import TorchBackend

        backend = TorchBackend.load(path, dtype=torch.float32)
    else:
        pytest.importorskip("mlx.core", reason="mlx is not installed (a CUDA machine has none)")
        from localheap.backends.mlx import MLXBackend

        backend = MLXBackend.load(path)
    tight = HeapConfig(budget=48, slack=16, recent=8, policy="h2o")
    code = "".join(f"def f{i}(a):\n    return a + {i}\n" for i in range(12))
    extra = [{"filename": "a.py", "text": code}, {"filename": "b.py", "text": code.replace("f", "g")}]
    with ServerThread(create_app(backend, ServerSettings(web_dir=None, heap=tight, sessions_dir=tmp_path / "s"))) \
            as srv:
        context = len(infill_context(backend.tokenizer, LlamaRequest(input_extra=extra), None).tokens)
        warm = _post(srv, "/infill", {"input_extra": extra, "n_predict": 0})
        assert warm["tokens_evaluated"] == context > 200 and warm["stop_type"] == "limit"
        for k in range(3):   # the cursor moves: a new prefix each time
            body = {"input_prefix": code[:40 + 25 * k], "input_suffix": "\n", "input_extra": extra, "n_predict": 6,
                    "temperature": 0, "return_tokens": True}
            got = _post(srv, "/infill", body)
            assert got["tokens_cached"] >= context, (k, got["tokens_cached"], context)
            assert got["timings"]["prompt_n"] == got["tokens_evaluated"] - got["tokens_cached"]
            # one session however many completions: each forks the checkpoint and the one before goes
            assert len(srv.services.store) == 1, [x.id for x in srv.services.store.sessions()]
            # (the tokens differ from a fresh session's here: this heap evicts, and where it evicts
            # depends on how the prompt was read; at full budget they are stock's, test above)


def test_llama_vim_instructions_as_it_sends_them(server):
    """llama.vim's instruction editing on /v1/chat/completions: a warm-up with n_predict 0 (the
    prompt read, no reply) and model "" (it always sends one), then the instruction, streamed,
    which reuses what the warm-up read."""
    system = {"role": "system", "content": "You are a text-editing assistant.\n--- CONTEXT\n" + PREFIX * 8}
    warm = {"id_slot": 0, "messages": [system, {"role": "user", "content": ""}], "samplers": [], "n_predict": 0,
            "stream": False, "cache_prompt": True, "response_fields": [""], "model": ""}
    got = _post(server, "/v1/chat/completions", warm)
    assert got["choices"][0]["message"]["content"] == "" and got["usage"]["completion_tokens"] == 0
    ask = {"id_slot": 0, "messages": [system, {"role": "user", "content": "INSTRUCTION: rename add"}],
           "min_p": 0.1, "temperature": 0.1, "samplers": ["min_p", "temperature"], "stream": True,
           "cache_prompt": True, "model": "", "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=ask, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens_details"]["cached_tokens"] > 40

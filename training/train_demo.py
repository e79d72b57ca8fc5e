"""Train localheap's demo model: a ~1M-parameter Llama that retrieves a pass key at 4096 tokens.

    nice -n 19 python training/train_demo.py --out runs/demo            # full recipe
    nice -n 19 python training/train_demo.py --out runs/quick --quick   # feasibility (minutes)
    python training/train_demo.py --out runs/demo --export localheap/demo_model   # ship

Seeded and resumable (runs/<name>/ckpt.pt every --ckpt-every steps). Logs JSON lines to
runs/<name>/log.jsonl: loss per step, held-out pass-key accuracy at each eval.
Data: see training/README.md (all text ships with CPython: PSF licence).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from localheap.bench.needle import Filler, build_episode, encode, filler_from_texts, frame, make_key  # noqa: E402
from localheap.randmodel import BOS, EOS, PAD, SPECIAL_TOKENS, _write_json, build_tokenizer  # noqa: E402

MODEL = {   # HF LlamaConfig, flat keys (read identically by mlx-lm and transformers)
    "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "intermediate_size": 384, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "max_position_embeddings": 4096, "hidden_act": "silu", "mlp_bias": False, "attention_bias": False,
    "attention_dropout": 0.0, "tie_word_embeddings": False, "initializer_range": 0.05, "use_cache": True,
}
VOCAB = 1024
# (context, batch, steps, task mix {passkey, copy, repeat, text}, share of passkey rows with a position gap).
# Short contexts first: with few keys to choose from, attention to the right one gets a strong
# gradient and induction heads form in ~200 steps at 64 tokens (never within 400 at 128-256).
PHASES = [
    (64, 64, 250, (0.3, 0.2, 0.4, 0.1), 0.0),
    (128, 32, 200, (0.4, 0.2, 0.3, 0.1), 0.0),
    (256, 16, 200, (0.5, 0.15, 0.2, 0.15), 0.0),
    (512, 8, 200, (0.6, 0.1, 0.15, 0.15), 0.0),
    (1024, 4, 200, (0.65, 0.1, 0.1, 0.15), 0.1),
    (2048, 2, 200, (0.7, 0.1, 0.05, 0.15), 0.2),
    (4096, 1, 300, (0.8, 0.05, 0.0, 0.15), 0.25),
]
QUICK = {"64": [(64, 64, 400, (0.3, 0.2, 0.4, 0.1), 0.0)],
         "128": [(128, 32, 400, (0.3, 0.2, 0.4, 0.1), 0.0)],
         "256": [(256, 16, 400, (0.4, 0.15, 0.3, 0.15), 0.0)]}


# ---------------------------------------------------------------- data

def corpus() -> list[str]:
    """pydoc help topics + long stdlib docstrings: English prose shipped with CPython (PSF)."""
    from pydoc_data import topics

    texts = [topics.topics[k] for k in sorted(topics.topics)]
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo", "ensurepip"}
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 300:
                    texts.append(doc)
    return texts


def split(texts: list[str]) -> tuple[list[str], list[str]]:
    """Held-out = documents whose crc32 is 0 mod 10 (stable across runs)."""
    held = [t for t in texts if zlib.crc32(t.encode()) % 10 == 0]
    train = [t for t in texts if zlib.crc32(t.encode()) % 10 != 0]
    return train, held


class Tasks:
    """Builds training rows: ids [T], loss mask of answer tokens [T], optional position ids."""

    def __init__(self, tok, filler: Filler):
        self.tok, self.filler = tok, filler
        self.frame = frame(tok)
        self.bos, self.eos = tok.convert_tokens_to_ids(BOS), tok.convert_tokens_to_ids(EOS)
        self.user, self.asst = encode(tok, "<|user|>\n"), encode(tok, "<|assistant|>\n")
        self.end = encode(tok, "<|end|>\n")
        self.repeat_prompt = encode(tok, "Repeat after me: ")
        self.vocab = len(tok)

    def passkey(self, rng, T):
        key = make_key(rng)
        ep = build_episode(self.tok, self.filler, self.frame, T - 8, float(rng.random()), key, rng)
        answer = encode(self.tok, f" {key}.") + self.end
        ids = ep.tokens + answer
        mask = [0] * len(ep.tokens) + [1] * (len(answer) - 1) + [0]
        return ids, mask

    def window(self, rng, n):
        f = self.filler.tokens
        s = int(rng.integers(0, len(f) - n))
        return f[s:s + n].tolist()

    def span(self, rng):
        """What to repeat: natural text, random tokens (pure induction) or a 5-digit key."""
        kind = rng.integers(3)
        if kind == 0:
            return self.window(rng, int(rng.integers(8, 64)))
        if kind == 1:
            return rng.integers(len(SPECIAL_TOKENS), self.vocab, int(rng.integers(4, 32))).tolist()
        return encode(self.tok, make_key(rng))

    def copy(self, rng, T):
        ids, mask = [], []
        while len(ids) < T:
            span = self.span(rng)
            q = [self.bos, *self.user, *self.repeat_prompt, *span, *self.end, *self.asst]
            ids += q + span + self.end
            mask += [0] * len(q) + [1] * (len(span) + 1) + [0] * (len(self.end) - 1)
        return ids, mask

    def repeat(self, rng, T):
        """Random tokens, repeated to fill the row: every repeat is pure induction."""
        n = int(rng.integers(4, max(8, min(64, T // 3))))
        chunk = rng.integers(len(SPECIAL_TOKENS), self.vocab, n).tolist()
        ids = [self.bos] + chunk * (T // n + 1)
        return ids, [0] * (n + 1) + [1] * (len(ids) - n - 1)

    def text(self, rng, T):
        return [self.bos, *self.window(rng, T)], [0] * (T + 1)

    def row(self, rng, T, mix, gap_share):
        kind = rng.choice(4, p=mix)
        ids, mask = (self.passkey, self.copy, self.repeat, self.text)[kind](rng, T)
        ids, mask = ids[:T], mask[:T]
        pad = T - len(ids)
        ids, mask = ids + [self.eos] * pad, mask + [0] * pad
        pos = np.arange(T)
        if kind == 0 and rng.random() < gap_share:
            # PoSE-style jump: later tokens sit up to 60K positions further on
            pos = pos + (pos >= int(rng.integers(8, T - 16))) * int(math.exp(rng.uniform(0, math.log(60000))))
        return ids, mask, pos


def batch(tasks, seed, step, T, B, mix, gap_share):
    rng = np.random.default_rng([seed, step])
    rows = [tasks.row(rng, T, mix, gap_share) for _ in range(B)]
    ids = torch.tensor([r[0] for r in rows])
    mask = torch.tensor([r[1] for r in rows], dtype=torch.bool)
    pos = torch.tensor(np.stack([r[2] for r in rows]))
    return ids, mask, pos


def load_tokenizer(path: Path):
    """randmodel's byte-level BPE (1024 tokens, trained on the pydoc topics), as an HF tokenizer."""
    from transformers import AutoTokenizer

    build_tokenizer(path, vocab_size=VOCAB, seed=0)
    return AutoTokenizer.from_pretrained(str(path))


# ---------------------------------------------------------------- model

def build_model(tok, seed: int = 0, init: float = MODEL["initializer_range"], theta: float = MODEL["rope_theta"]):
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in MODEL.items() if k not in ("model_type", "architectures")}
    cfg = LlamaConfig(**{**fields, "initializer_range": init, "rope_theta": theta},
                      vocab_size=len(tok), bos_token_id=tok.convert_tokens_to_ids(BOS),
                      eos_token_id=tok.convert_tokens_to_ids(EOS), pad_token_id=tok.convert_tokens_to_ids(PAD))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def seed_previous_token_head(model, const: float = 0.3, amp: float = 7.0, n_freqs: int = 4) -> None:
    """Start layer 0's first KV head (and query head 0) as a previous-token head.

    Induction (the copy mechanism retrieval needs) = a previous-token head + a head that matches
    on its output. Learning both from scratch takes thousands of steps (a long plateau); seeded,
    the previous-token head gives the matching head a gradient from the first step.
    A constant embedding dimension makes q and k token-independent; RoPE then makes the score
    a function of the offset only: k = q rotated by one position in the fastest n_freqs
    frequency pairs (HF layout: pair (i, i + D/2) turns at theta^(-2i/D)), so the score is
    sum_i amp^2 cos(theta_i (offset - 1)) / sqrt(D), highest at offset 1.
    """
    cfg = model.config
    D, theta = cfg.head_dim, cfg.rope_parameters["rope_theta"]
    embed = model.model.embed_tokens.weight
    embed[:, 0] = const
    rms = embed.pow(2).mean(dim=1).sqrt().mean()
    c = float(const / rms)                       # dim 0 after RMSNorm (weight 1)
    attn = model.model.layers[0].self_attn
    q, k = torch.zeros(D), torch.zeros(D)
    for i in range(n_freqs):
        w = theta ** (-2 * i / D)
        q[i] = amp
        k[i], k[i + D // 2] = amp * math.cos(w), amp * math.sin(w)
    attn.q_proj.weight[:D] = 0
    attn.q_proj.weight[:D, 0] = q / c
    attn.k_proj.weight[:D] = 0
    attn.k_proj.weight[:D, 0] = k / c


@torch.no_grad()
def seed_copying_heads(model, gain: float = 1.0) -> None:
    """Start every head above layer 0 as a copier: W_o = W_v^T (so attending to token B adds a
    multiple of B's normalized embedding) and the unembedding equal to the embedding, so
    attending to B raises B's logit. Then the gradient on *where* to attend is informative
    from the first step (the other half of induction's chicken-and-egg)."""
    cfg = model.config
    D, G = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    for layer in model.model.layers[1:]:
        attn = layer.self_attn
        for h in range(cfg.num_attention_heads):
            kv = h // G
            attn.o_proj.weight[:, h * D:(h + 1) * D] = gain * attn.v_proj.weight[kv * D:(kv + 1) * D].T


def losses(model, ids, mask, pos):
    logits = model(input_ids=ids, position_ids=pos).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    ans = mask[:, 1:]
    lm = ce.mean()
    qa = (ce * ans).sum() / ans.sum().clamp(min=1)
    return lm, qa


@torch.no_grad()
def evaluate(model, tok, filler: Filler, T: int, n: int, seed: int = 12345, batch_size: int = 8) -> dict:
    """Teacher-forced greedy check of the key digits on held-out episodes: exact match and per digit.
    (All 5 argmaxes right under teacher forcing == greedy decoding gets the key right.)"""
    model.eval()
    tasks = Tasks(tok, filler)
    rng = np.random.default_rng([seed, T])
    rows = [tasks.passkey(rng, T) for _ in range(n)]
    exact = digits = 0.0
    for i in range(0, n, batch_size):
        chunk = rows[i:i + batch_size]
        x = torch.tensor([ids[:T] for ids, _ in chunk])
        pred = model(input_ids=x).logits[:, :-1].argmax(-1)
        for b, (_, mask) in enumerate(chunk):
            ans = [j for j, m in enumerate(mask[1:T]) if m][1:6]   # " " then the 5 digits
            ok = (pred[b, ans] == x[b, 1:][ans]).tolist()
            exact += all(ok)
            digits += sum(ok) / len(ok)
    model.train()
    return {"ctx": T, "n": n, "exact": round(exact / n, 4), "digit": round(digits / n, 4)}


# ---------------------------------------------------------------- loop

def lr_at(step, total, peak, warmup=50, hold=0.6, floor=0.1):
    """Linear warmup, constant for `hold` of the run, then cosine down to floor x peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - hold * total) / max(1, (1 - hold) * total)
    if frac <= 0:
        return peak
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = QUICK[args.quick] if args.quick else PHASES
    tok = load_tokenizer(out / "tokenizer")
    train_texts, held_texts = split(corpus())
    digest = hashlib.sha256("\x00".join(train_texts + held_texts).encode()).hexdigest()[:16]
    train_fill, held_fill = filler_from_texts(tok, train_texts), filler_from_texts(tok, held_texts)
    tasks = Tasks(tok, train_fill)
    model = build_model(tok, args.seed, args.init, args.rope_theta)
    if args.seed_prev_token:
        seed_previous_token_head(model)
    if args.seed_copy:
        seed_copying_heads(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    step = 0
    ckpt = out / "ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    log = open(out / "log.jsonl", "a")

    def emit(rec):
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    total = sum(p[2] for p in phases)
    if step == 0:
        emit({"event": "start", "params": sum(p.numel() for p in model.parameters()), "corpus_sha": digest,
              "train_tokens": len(train_fill.tokens), "held_tokens": len(held_fill.tokens),
              "phases": phases, "seed": args.seed, "lr": args.lr, "init": args.init, "rope_theta": args.rope_theta, "seed_prev_token": args.seed_prev_token, "seed_copy": args.seed_copy, "model": MODEL})
    t0, end = time.time(), 0
    for T, B, n_steps, mix, gap in phases:
        end += n_steps
        while step < end:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, args.lr)
            ids, mask, pos = batch(tasks, args.seed, step, T, B, mix, gap)
            lm, qa = losses(model, ids, mask, pos)
            (lm + args.qa_weight * qa).backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                emit({"step": step, "ctx": T, "lm": round(lm.item(), 4), "qa": round(qa.item(), 4),
                      "gnorm": round(gnorm.item(), 3), "lr": round(opt.param_groups[0]["lr"], 6),
                      "elapsed": round(time.time() - t0, 1)})
            if step % args.eval_every == 0 or step == end:
                for ctx in sorted({min(T, 1024), T}):
                    emit({"step": step, "eval": evaluate(model, tok, held_fill, ctx, args.eval_n)})
            if step % args.ckpt_every == 0 or step == end:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
    emit({"step": step, "final": evaluate(model, tok, held_fill, phases[-1][0], args.final_n)})
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)


# ---------------------------------------------------------------- export

def export(args) -> None:
    """Write config.json (flat keys), model.safetensors (fp16) and the tokenizer with a chat template."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src, dst = Path(args.out), Path(args.export)
    dst.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(dst, vocab_size=VOCAB, seed=0)
    tcfg = json.loads((dst / "tokenizer_config.json").read_text())
    tcfg["model_max_length"] = 131072
    _write_json(dst / "tokenizer_config.json", tcfg)
    cfg = {**MODEL, "vocab_size": tok.get_vocab_size(), "bos_token_id": tok.token_to_id(BOS),
           "eos_token_id": tok.token_to_id(EOS), "pad_token_id": tok.token_to_id(PAD), "torch_dtype": "float16"}
    _write_json(dst / "config.json", cfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(dst))
    model.load_state_dict(torch.load(src / "ckpt.pt", weights_only=False)["model"])
    model.to(torch.float16).save_pretrained(dst, safe_serialization=True)
    _write_json(dst / "config.json", cfg)   # save_pretrained rewrote it in its own format
    for extra in ("generation_config.json",):
        (dst / extra).unlink(missing_ok=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="run directory (checkpoint, log)")
    p.add_argument("--quick", default="", help="feasibility run: one short phase (64, 128 or 256 tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rope-theta", type=float, default=MODEL["rope_theta"])
    p.add_argument("--no-seed-prev-token", dest="seed_prev_token", action="store_false",
                   help="do not start layer 0 with a previous-token head")
    p.add_argument("--no-seed-copy", dest="seed_copy", action="store_false",
                   help="do not start the heads above layer 0 as copiers")
    p.add_argument("--init", type=float, default=MODEL["initializer_range"], help="weight init std")
    p.add_argument("--qa-weight", type=float, default=1.0, help="weight of the answer-token loss")
    p.add_argument("--threads", type=int, default=1, help="1 is faster than 2 on a busy shared CPU")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-n", type=int, default=48)
    p.add_argument("--final-n", type=int, default=200)
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--export", default=None, help="export the run's checkpoint into this directory and exit")
    args = p.parse_args(argv)
    export(args) if args.export else train(args)


if __name__ == "__main__":
    main()

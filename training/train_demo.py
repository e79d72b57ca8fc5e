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
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_tasks import Tasks, batches, full_mix  # noqa: E402
from localheap.bench.facts import corpus, names, split  # noqa: E402
from localheap.bench.needle import Filler, filler_from_texts  # noqa: E402
from localheap.randmodel import BOS, EOS, PAD, _write_json, build_tokenizer  # noqa: E402

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
# v2 (fine-tuned from v1's weights): + named facts. (context, batch, steps, mix {passkey, facts,
# copy, repeat, text}, position-gap share, max facts per row, share of key rows whose filler keeps
# its digits). Batches are the CPU ones; --batch-mult scales them on a GPU.
PHASES_V2 = [
    (96, 48, 400, (0.1, 0.8, 0.0, 0.0, 0.1), 0.0, 2, 0.0),
    (192, 24, 300, (0.15, 0.7, 0.05, 0.0, 0.1), 0.0, 4, 0.15),
    (384, 12, 300, (0.15, 0.7, 0.05, 0.0, 0.1), 0.0, 8, 0.2),
    (768, 6, 300, (0.15, 0.7, 0.05, 0.0, 0.1), 0.1, 16, 0.25),
    (1536, 3, 250, (0.2, 0.65, 0.05, 0.0, 0.1), 0.2, 32, 0.25),
    (4096, 1, 400, (0.2, 0.65, 0.05, 0.0, 0.1), 0.25, 32, 0.25),
]
# v2 stage 2 (from stage 1 = --recipe v2 --stop-at 1550, exported): fact rows ask 4 questions
# each (follow-up turns about other facts in the same context): 4x the answers per row, and the
# names must be told apart. Peak lr 1e-3.
PHASES_V2_QA = [
    (768, 6, 300, (0.15, 0.75, 0.0, 0.0, 0.1), 0.1, 24, 0.25, 4),
    (1536, 3, 200, (0.15, 0.75, 0.0, 0.0, 0.1), 0.2, 32, 0.25, 4),
    (4096, 1, 250, (0.2, 0.7, 0.0, 0.0, 0.1), 0.25, 32, 0.25, 4),
]
# v2 stage 3 (from stage 2, exported): 4096 tokens only, 8 questions per fact row (the 16-key
# episodes at 4096 were the weak cell after stage 2: 85%). Peak lr 5e-4.
PHASES_V2_QA8 = [
    (4096, 1, 600, (0.1, 0.8, 0.0, 0.0, 0.1), 0.25, 32, 0.25, 8),
]
# v2 stage 4 (from stage 3): the same rows asking up to 16 questions each, peak lr 3e-4.
PHASES_V2_QA16 = [
    (4096, 1, 400, (0.1, 0.8, 0.0, 0.0, 0.1), 0.25, 32, 0.25, 16),
]
RECIPES = {"v1": PHASES, "v2": PHASES_V2, "v2-qa": PHASES_V2_QA, "v2-qa8": PHASES_V2_QA8, "v2-qa16": PHASES_V2_QA16}
QUICK = {"facts96": [(96, 48, 400, (0.1, 0.8, 0.0, 0.0, 0.1), 0.0, 2, 0.0)],
         "scratch96": [(96, 48, 400, (0.25, 0.35, 0.1, 0.2, 0.1), 0.0, 2, 0.0)],
         "facts256": [(256, 16, 400, (0.2, 0.5, 0.1, 0.05, 0.15), 0.0, 8, 0.25)],
         "facts1024": [(1024, 4, 300, (0.2, 0.55, 0.1, 0.0, 0.15), 0.1, 24, 0.25)],
         "64": [(64, 64, 400, (0.3, 0.2, 0.4, 0.1), 0.0)],
         "128": [(128, 32, 400, (0.3, 0.2, 0.4, 0.1), 0.0)],
         "256": [(256, 16, 400, (0.4, 0.15, 0.3, 0.15), 0.0)]}


# ---------------------------------------------------------------- data

def load_tokenizer(path: Path, init_from: str | None = None):
    """randmodel's byte-level BPE (1024 tokens, trained on the pydoc topics), as an HF tokenizer;
    or the tokenizer of the model a fine-tune starts from (the same one, already built)."""
    from transformers import AutoTokenizer

    if init_from:
        return AutoTokenizer.from_pretrained(init_from)
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
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        logits = model(input_ids=ids, position_ids=pos).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    ans = mask[:, 1:]
    lm = ce.mean()
    qa = (ce * ans).sum() / ans.sum().clamp(min=1)
    return lm, qa


@torch.no_grad()
def evaluate(model, tasks: Tasks, T: int, n: int, keys: int = 0, seed: int = 12345, batch_size: int = 8) -> dict:
    """Teacher-forced greedy check of the key digits on held-out episodes (`tasks` built on the
    held-out filler and names): exact match and per digit. keys=0: v1's pass key; else K named
    facts. (All 5 argmaxes right under teacher forcing == greedy decoding gets the key right.)"""
    model.eval()
    dev = next(model.parameters()).device
    rng = np.random.default_rng([seed, T, keys])
    rows = [tasks.facts(rng, T, keys) if keys else tasks.passkey(rng, T) for _ in range(n)]
    exact = digits = 0.0
    for i in range(0, n, batch_size):
        chunk = rows[i:i + batch_size]
        x = torch.tensor([ids[:T] for ids, _ in chunk], device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            pred = model(input_ids=x).logits[:, :-1].argmax(-1)
        for b, (_, mask) in enumerate(chunk):
            ans = [j for j, m in enumerate(mask[1:T]) if m][1:6]   # " " then the 5 digits
            ok = (pred[b, ans] == x[b, 1:][ans]).tolist()
            exact += all(ok)
            digits += sum(ok) / len(ok)
    model.train()
    return {"ctx": T, "keys": keys, "n": n, "exact": round(exact / n, 4), "digit": round(digits / n, 4)}


@torch.no_grad()
def held_lm_loss(model, filler: Filler, T: int = 1024, n: int = 32, seed: int = 54321) -> float:
    """Mean next-token loss on n windows of held-out text (the figure README compares v1/v2 on)."""
    model.eval()
    dev = next(model.parameters()).device
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(filler.tokens) - T, n)
    x = torch.tensor(np.stack([filler.tokens[s:s + T] for s in starts]), device=dev)
    loss = sum(torch.nn.functional.cross_entropy(model(input_ids=x[i:i + 8]).logits[:, :-1].float().transpose(1, 2),
                                                 x[i:i + 8, 1:]).item() * len(x[i:i + 8]) for i in range(0, n, 8))
    model.train()
    return round(loss / n, 4)


# ---------------------------------------------------------------- loop

def lr_at(step, total, peak, warmup=50, hold=0.6, floor=0.1):
    """Linear warmup, constant for `hold` of the run, then cosine down to floor x peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - hold * total) / max(1, (1 - hold) * total)
    if frac <= 0:
        return peak
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def texts(args) -> list[str]:
    """The corpus: from this Python's stdlib, or a JSON list written by --dump-corpus elsewhere
    (another Python version has other docstrings: the device machine trains on ours)."""
    return json.loads(Path(args.corpus).read_text()) if args.corpus else list(corpus())


def train(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       "cpu" if args.device == "auto" else args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = QUICK[args.quick] if args.quick else RECIPES[args.recipe]
    phases = [(T, B * args.batch_mult, int(n * args.steps_mult), *rest) for T, B, n, *rest in phases]
    tok = load_tokenizer(out / "tokenizer", args.init_from)
    train_texts, held_texts = split(texts(args))
    digest = hashlib.sha256("\x00".join(train_texts + held_texts).encode()).hexdigest()[:16]
    train_fill, held_fill = filler_from_texts(tok, train_texts), filler_from_texts(tok, held_texts)
    tasks = Tasks(tok, train_fill, filler_from_texts(tok, train_texts, keep_digits=True))
    held = Tasks(tok, held_fill, pool=names(held_out=True))
    if args.init_from:   # fine-tune: start from a shipped model's weights (v2 starts from v1)
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
    else:
        model = build_model(tok, args.seed, args.init, args.rope_theta)
        if args.seed_prev_token:
            seed_previous_token_head(model)
        if args.seed_copy:
            seed_copying_heads(model)
    model.to(dev).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    step = 0
    ckpt = out / "ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False, map_location=dev)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    log = open(out / "log.jsonl", "a")

    def emit(rec):
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)

    def evals(T, n, final=False):
        """Held-out accuracy at the phase's context: v1's pass key, and (v2) 1, 4 and 16 named facts."""
        ks = [0] + ([1, 4, 16] if any(full_mix(p[3])[1] for p in phases) else [])
        for k in ([0, 16] if final and len(ks) > 1 else ks):
            if k * 24 < T:
                emit({"step": step, "final" if final else "eval": evaluate(model, held, T, n, k)})

    total = sum(p[2] for p in phases)
    if step == 0:
        emit({"event": "start", "params": sum(p.numel() for p in model.parameters()), "corpus_sha": digest,
              "train_tokens": len(train_fill.tokens), "held_tokens": len(held_fill.tokens), "phases": phases,
              "seed": args.seed, "lr": args.lr, "init": args.init, "rope_theta": args.rope_theta,
              "seed_prev_token": args.seed_prev_token, "seed_copy": args.seed_copy, "model": MODEL,
              "init_from": args.init_from, "recipe": args.recipe, "device": str(dev),
              "held_lm_loss_1024": held_lm_loss(model, held_fill)})
    t0, end, jobs = time.time(), 0, []
    for ph in phases:
        jobs += [(s, ph) for s in range(end, end + ph[2])]
        end += ph[2]
    ends = np.cumsum([p[2] for p in phases])
    for s, (ids, mask, pos) in batches(tasks, args.seed, jobs[step:], args.workers):
        ph = phases[int(np.searchsorted(ends, s, side="right"))]
        T, end = ph[0], int(ends[np.searchsorted(ends, s, side="right")])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args.lr, warmup=args.warmup)
        lm, qa = losses(model, *(torch.from_numpy(a).to(dev) for a in (ids, mask, pos)))
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
            evals(T, args.eval_n)
        if step % args.ckpt_every == 0 or step == end:
            save()
        if step == args.stop_at:
            emit({"step": step, "event": "stop", "held_lm_loss_1024": held_lm_loss(model, held_fill)})
            return
    evals(phases[-1][0], args.final_n, final=True)
    emit({"step": step, "held_lm_loss_1024": held_lm_loss(model, held_fill)})
    save()


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
    p.add_argument("--recipe", choices=sorted(RECIPES), default="v1")
    p.add_argument("--init-from", default=None, help="start from this model directory's weights and tokenizer")
    p.add_argument("--corpus", default=None, help="JSON list of texts (default: this Python's stdlib)")
    p.add_argument("--dump-corpus", default=None, help="write this Python's corpus as JSON here and exit")
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--workers", type=int, default=0, help="processes building batches ahead (0: inline)")
    p.add_argument("--batch-mult", type=int, default=1, help="scale every phase's batch (a GPU takes more rows)")
    p.add_argument("--stop-at", type=int, default=0, help="stop after this step (the schedule stays the recipe's)")
    p.add_argument("--steps-mult", type=float, default=1.0, help="scale every phase's steps")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--export", default=None, help="export the run's checkpoint into this directory and exit")
    args = p.parse_args(argv)
    if args.dump_corpus:
        Path(args.dump_corpus).write_text(json.dumps(list(corpus())))
    else:
        export(args) if args.export else train(args)


if __name__ == "__main__":
    main()

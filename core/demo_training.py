"""Train the tiny demo model pair (target + drafter) on the Python standard library.

Reproducible (seeded) and CPU-only. Produces, under ``--out`` (default ``models``):

* ``demo-target/``  - Llama, hidden 384, 6 layers (~11M params), trained with an auxiliary
  LayerSkip-style early-exit loss at layer 3, so layers 1-3 + final norm + lm_head form a
  usable self-drafter.
* ``demo-drafter/`` - Llama, hidden 128, 2 layers (~0.95M params).
* ``tokenizer/``    - the byte-level BPE (vocab 4096) shared by both; also copied into each
  model directory.

Both models are saved in bfloat16 (safetensors) with the tokenizer files, loadable with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

Usage::

    specpilot train-demo --out models --target-minutes 45 --drafter-minutes 12

Importable: ``main(argv)``, ``HELDOUT_MODULES``, ``corpus_files()``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

# Stdlib modules reserved for workloads (never trained on). Paths relative to the stdlib dir.
HELDOUT_MODULES: tuple[str, ...] = (
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "difflib.py",
    "fractions.py",
    "graphlib.py",
    "heapq.py",
    "ipaddress.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
)

EOS_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 4096
SEQ_LEN = 256
VAL_FRACTION = 0.02

EXCLUDED_DIR_NAMES = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}

TARGET_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=384,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1024,
    tie_word_embeddings=True,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
DRAFTER_CONFIG = dict(TARGET_CONFIG, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=384)
EXIT_LAYER = 3          # hidden_states[3] = output of decoder layer 3 (of 6)
EXIT_LOSS_WEIGHT = 0.5


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _walk_py(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIR_NAMES)
        for f in sorted(filenames):
            if f.endswith(".py"):
                out.append(Path(dirpath) / f)
    return sorted(out)


def corpus_files(seed: int = 0) -> tuple[list[Path], list[Path]]:
    """(train, val) stdlib .py files, held-out modules excluded; seeded split of the sorted list."""
    root = stdlib_dir()
    held = {(root / m).resolve() for m in HELDOUT_MODULES}
    files = [p for p in _walk_py(root) if p.resolve() not in held]
    rng = random.Random(seed)
    shuffled = files[:]
    rng.shuffle(shuffled)
    n_val = max(1, round(len(files) * VAL_FRACTION))
    val = sorted(shuffled[:n_val])
    train = sorted(shuffled[n_val:])
    return train, val


def heldout_paths() -> list[Path]:
    root = stdlib_dir()
    return [root / m for m in HELDOUT_MODULES]


def read_texts(paths: list[Path]) -> list[str]:
    texts = []
    for p in paths:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


# ----------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS_TOKEN) == 0, tok.token_to_id(EOS_TOKEN)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                 pad_token=EOS_TOKEN)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return hf


def load_tokenizer(tok_dir: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tok_dir))


def encode_stream(tok, texts: list[str]):
    """Token ids of the documents joined with the eos token between (and after) files."""
    import torch
    backend = tok.backend_tokenizer if hasattr(tok, "backend_tokenizer") else tok
    encs = backend.encode_batch(texts, add_special_tokens=False)
    ids: list[int] = []
    for e in encs:
        ids.extend(e.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------- training
def _lr_at(step: int, frac: float, peak: float, warmup_steps: int = 50, warmup_frac: float = 0.04,
           min_ratio: float = 0.1) -> float:
    """Linear warmup that ends after `warmup_steps` steps or `warmup_frac` of the time budget, whichever
    comes first (on a slow/contended CPU a step-count warmup could eat the whole budget), then cosine
    decay to `min_ratio` * peak over the time fraction."""
    frac = min(max(frac, 0.0), 1.0)
    warm = min(1.0, max((step + 1) / warmup_steps, frac / warmup_frac))
    cos = min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    return peak * min(warm, cos) if warm < 1.0 else peak * cos


def _losses(model, x, y, aux: bool):
    import torch.nn.functional as F
    out = model(input_ids=x, output_hidden_states=aux, use_cache=False)
    V = out.logits.shape[-1]
    lm = F.cross_entropy(out.logits.float().reshape(-1, V), y.reshape(-1))
    if not aux:
        return lm, None
    h = out.hidden_states[EXIT_LAYER]
    exit_logits = model.lm_head(model.model.norm(h))
    ex = F.cross_entropy(exit_logits.float().reshape(-1, V), y.reshape(-1))
    return lm, ex


def evaluate(model, val_batches, aux: bool, autocast: bool = False):
    import torch
    model.eval()
    tot, tot_ex, n = 0.0, 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for x, y in val_batches:
            lm, ex = _losses(model, x, y, aux)
            tot += lm.item()
            tot_ex += ex.item() if ex is not None else 0.0
            n += 1
    model.train()
    return tot / n, (tot_ex / n if aux else None)


def train_model(name: str, cfg: dict, train_ids, val_ids, tok_dir: Path, out_dir: Path, *,
                minutes: float, lr: float, aux: bool, seed: int, batch_size: int = 16,
                eval_every_s: float = 120.0, n_val_seqs: int = 32, autocast: bool = False) -> dict:
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**cfg)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{name}] parameters: {n_params:,} ({n_params / 1e6:.2f}M)", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    L = SEQ_LEN + 1
    n_train = train_ids.numel() - L

    # fixed validation subset: evenly spaced windows of the val stream
    n_val = min(n_val_seqs, max(1, (val_ids.numel() - 1) // L))
    starts = [int(i * (val_ids.numel() - L) / max(1, n_val - 1)) for i in range(n_val)] if n_val > 1 else [0]
    val_seqs = torch.stack([val_ids[s:s + L] for s in starts])
    val_batches = [(val_seqs[i:i + 16, :-1], val_seqs[i:i + 16, 1:]) for i in range(0, n_val, 16)]

    limit_s = minutes * 60.0
    warmup = 50 if limit_s > 300 else 5
    recent: list[float] = []        # per-step LM losses since the last eval (train_loss = their mean)
    recent_ex: list[float] = []
    log: list[dict] = []
    log_path = out_dir / "train_log.json"
    out_dir.mkdir(parents=True, exist_ok=True)

    model.train()
    t0 = time.time()
    last_eval = t0
    step = 0
    tokens = 0
    ema = None
    bar = tqdm(total=int(limit_s), desc=name, unit="s", file=sys.stderr, mininterval=5.0)
    shown = 0

    def do_eval():
        vl, vx = evaluate(model, val_batches, aux, autocast)
        tl = sum(recent) / len(recent) if recent else None
        rec = dict(step=step, tokens=tokens, elapsed_s=round(time.time() - t0, 1),
                   train_loss=None if tl is None else round(tl, 4),
                   val_loss=round(vl, 4), val_loss_exit=None if vx is None else round(vx, 4))
        if aux:
            rec["train_loss_exit"] = round(sum(recent_ex) / len(recent_ex), 4) if recent_ex else None
        rec["lr"] = float(f"{opt.param_groups[0]['lr']:.3g}")
        recent.clear()
        recent_ex.clear()
        log.append(rec)
        log_path.write_text(json.dumps(log, indent=1))
        tqdm.write(f"[{name}] {json.dumps(rec)}", file=sys.stderr)

    while True:
        elapsed = time.time() - t0
        if elapsed >= limit_s:
            break
        cur_lr = _lr_at(step, elapsed / limit_s, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        idx = torch.randint(0, n_train, (batch_size,), generator=gen)
        batch = torch.stack([train_ids[i:i + L] for i in idx.tolist()])
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lm, ex = _losses(model, x, y, aux)
            loss = lm + EXIT_LOSS_WEIGHT * ex if aux else lm
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        ema = lm.item() if ema is None else 0.9 * ema + 0.1 * lm.item()   # progress bar only
        recent.append(lm.item())
        if aux:
            recent_ex.append(ex.item())
        now = time.time()
        adv = int(min(now - t0, limit_s)) - shown
        if adv > 0:
            bar.update(adv)
            shown += adv
        bar.set_postfix(step=step, loss=f"{ema:.3f}", lr=f"{cur_lr:.2e}",
                        tok_s=f"{tokens / max(now - t0, 1e-6):.0f}", refresh=False)
        if now - last_eval >= eval_every_s:
            do_eval()
            last_eval = time.time()
    bar.close()
    train_s = time.time() - t0
    do_eval()

    model.config.use_cache = True
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                               do_sample=False)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok = load_tokenizer(tok_dir)
    tok.save_pretrained(str(out_dir))
    summary = dict(name=name, params=n_params, steps=step, tokens=tokens, train_seconds=round(train_s, 1),
                   tokens_per_s=round(tokens / train_s, 1), final=log[-1], lr=lr, batch_size=batch_size,
                   seq_len=SEQ_LEN, seed=seed, precision="bf16-autocast" if autocast else "fp32", aux_exit_layer=EXIT_LAYER if aux else None,
                   aux_weight=EXIT_LOSS_WEIGHT if aux else None)
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    log_path.write_text(json.dumps(log, indent=1))
    print(f"[{name}] done: {json.dumps(summary)}", flush=True)
    return summary


def dir_size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="models")
    ap.add_argument("--target-minutes", type=float, default=45.0)
    ap.add_argument("--drafter-minutes", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="training compute: fp32, or bf16 autocast (much slower on CPUs without "
                         "native bf16, e.g. this machine: ~12x slower backward); weights saved in bf16 either way")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences of 256 tokens per step (both models)")
    ap.add_argument("--only", choices=["tokenizer", "target", "drafter", "all"], default="all")
    args = ap.parse_args(argv)

    import torch
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    out = Path(args.out)
    tok_dir = out / "tokenizer"
    train_files, val_files = corpus_files(args.seed)
    t0 = time.time()
    train_texts, val_texts = read_texts(train_files), read_texts(val_files)
    print(f"corpus: {len(train_texts)} train files, {len(val_texts)} val files, "
          f"{sum(map(len, train_texts)) / 1e6:.1f}M chars; held out: {', '.join(HELDOUT_MODULES)}", flush=True)

    if (tok_dir / "tokenizer.json").exists() and args.only != "tokenizer":
        tok = load_tokenizer(tok_dir)
    else:
        tok = train_tokenizer(train_texts, tok_dir)
        print(f"tokenizer trained in {time.time() - t0:.1f}s -> {tok_dir}", flush=True)
    if args.only == "tokenizer":
        return 0

    train_ids = encode_stream(tok, train_texts)
    val_ids = encode_stream(tok, val_texts)
    nchars = sum(map(len, train_texts))
    print(f"tokens: train {train_ids.numel():,} ({nchars / train_ids.numel():.2f} chars/token), "
          f"val {val_ids.numel():,}", flush=True)

    if args.only in ("drafter", "all"):
        train_model("drafter", DRAFTER_CONFIG, train_ids, val_ids, tok_dir, out / "demo-drafter",
                    minutes=args.drafter_minutes, lr=3e-3, aux=False, seed=args.seed,
                    eval_every_s=60.0, batch_size=args.batch_size, autocast=args.precision == "bf16")
    if args.only in ("target", "all"):
        train_model("target", TARGET_CONFIG, train_ids, val_ids, tok_dir, out / "demo-target",
                    minutes=args.target_minutes, lr=1.5e-3, aux=True, seed=args.seed,
                    eval_every_s=150.0, batch_size=args.batch_size, autocast=args.precision == "bf16")

    size = dir_size_bytes(out)
    print(f"total size of {out}: {size / 1e6:.2f} MB", flush=True)
    if size > 25e6:
        print(f"WARNING: {out} exceeds 25 MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

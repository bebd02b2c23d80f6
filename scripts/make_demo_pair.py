"""Build the demo pair shipped in `dflash_mlx/demo_pair/` (for `--demo`).

    python scripts/make_demo_pair.py [--steps 1500 --draft-steps 1000]

1. A byte-level BPE tokenizer and a tiny Qwen3-style code model trained from scratch on the
   Python standard library's own source files (Python Software Foundation License), read
   from the running interpreter's `stdlib` folder: no download.
2. Its DFlash draft, distilled with `dflash-mlx train --regenerate` on starts of stdlib
   files: the target writes the continuations, the draft learns to predict them.

A demonstration, not a useful assistant: it writes Python-looking text. MLX's stock Linux
CPU wheel multiplies with a reference BLAS; when Debian's OpenBLAS is installed
(`apt-get install libopenblas0-pthread`), this script re-runs itself with it preloaded,
which made training about 30x faster here. Nothing requires it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "dflash_mlx" / "demo_pair"
VOCAB = 1024
SEQ = 256


def stdlib_files() -> list[Path]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return [f for f in files if 2_000 < f.stat().st_size < 200_000]


def target_config() -> dict:
    return {
        "model_type": "qwen3",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 384,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 0,
    }


def train_target(folder: Path, ids: list[int], steps: int, batch: int = 16) -> float:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    cfg = target_config()
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    data = np.array(ids, dtype=np.int32)
    rng = np.random.default_rng(0)
    warm = steps // 20
    sched = optim.join_schedules(
        [optim.linear_schedule(0, 2e-3, warm), optim.cosine_decay(2e-3, steps - warm, 1e-4)],
        [warm],
    )
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.05)

    def loss_fn(m, x):
        logits = m(x[:, :-1])
        return nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")

    step_fn = nn.value_and_grad(model, loss_fn)
    tic = time.time()
    loss = float("nan")
    for step in range(steps):
        starts = rng.integers(0, len(data) - SEQ - 1, size=batch)
        x = mx.array(np.stack([data[s : s + SEQ + 1] for s in starts]))
        loss, grads = step_fn(model, x)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        if step % 100 == 0 or step == steps - 1:
            print(
                f"target step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - tic:.0f}s)",
                flush=True,
            )
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--draft-steps", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if OPENBLAS.exists() and "LD_PRELOAD" not in os.environ:
        print(f"re-running with {OPENBLAS} preloaded (faster matmuls)", flush=True)
        env = {**os.environ, "LD_PRELOAD": str(OPENBLAS)}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))

    files = stdlib_files()
    random.Random(0).shuffle(files)
    held_out, train_files = files[:8], files[8:]
    texts = [f.read_text(errors="replace") for f in train_files]
    work = args.out.with_name(args.out.name + ".build")
    shutil.rmtree(work, ignore_errors=True)
    target_dir, draft_dir = work / "target", work / "draft"
    from dflash_mlx.tiny import write_tokenizer

    write_tokenizer(target_dir, texts, VOCAB)

    from tokenizers import Tokenizer

    from dflash_mlx import load

    tk = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    ids = [t for enc in tk.encode_batch(texts) for t in enc.ids + [0]]
    print(f"corpus: {len(train_files)} stdlib files, {len(ids)} tokens", flush=True)
    t0 = time.time()
    loss = train_target(target_dir, ids, args.steps)
    target_time = time.time() - t0
    model, tok = load(target_dir)

    # Draft data: starts of lines in held-in files; the target writes the rest.
    rng = random.Random(1)
    prompts = []
    for text in texts:
        lines = text.splitlines()
        for _ in range(4):
            i = rng.randrange(len(lines))
            prompt = "\n".join(lines[max(0, i - 6) : i + 1])
            if prompt.strip():
                prompts.append({"text": prompt[-400:]})
    data = work / "draft_data.jsonl"
    data.write_text("\n".join(json.dumps(p) for p in prompts))
    eval_prompts = [f.read_text(errors="replace")[:300] for f in held_out]
    t0 = time.time()
    cmd = [
        sys.executable,
        "-c",
        "from dflash_mlx.cli.main import app; app()",
        "train",
        "--target",
        str(target_dir),
        "--data",
        str(data),
        "--out",
        str(draft_dir),
        "--layers",
        "2",
        "--target-layer-ids",
        "1,3",
        "--block-size",
        "16",
        "--steps",
        str(args.draft_steps),
        "--batch",
        "8",
        "--seq-len",
        "192",
        "--anchors-per-seq",
        "24",
        "--lr",
        "3e-3",
        "--loss-gamma",
        "7",
        "--regenerate",
        "--regen-tokens",
        "96",
        "--eval-every",
        "250",
        "--save-every",
        "250",
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)
    draft_time = time.time() - t0
    shutil.rmtree(draft_dir / "training_state", ignore_errors=True)

    from dflash_mlx import generate, load_draft

    draft = load_draft(draft_dir)
    taus = []
    for text in eval_prompts:
        r = generate(model, draft, tok, tok.encode(text), max_tokens=64, block_size=16)
        taus.append(r.mean_acceptance)
    summary = {
        "target": {
            "config": target_config(),
            "train_steps": args.steps,
            "final_loss": loss,
            "train_seconds": round(target_time),
            "corpus_tokens": len(ids),
            "corpus": "Python standard library source (PSF License)",
        },
        "draft": {
            "train_steps": args.draft_steps,
            "train_seconds": round(draft_time),
            "held_out_tau_greedy_w16": round(sum(taus) / len(taus), 3),
        },
        "openblas": "LD_PRELOAD" in os.environ,
    }
    (work / "BUILD.json").write_text(json.dumps(summary, indent=1))
    shutil.rmtree(args.out, ignore_errors=True)
    work.rename(args.out)
    (args.out / "draft_data.jsonl").unlink()
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

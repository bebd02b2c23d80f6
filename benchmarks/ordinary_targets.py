"""Ordinary targets for `dflash-mlx train`, built as a user's would be, and the plain recipe
beside the command on them (issue 64).

    python benchmarks/ordinary_targets.py build stdlib6 --out D/stdlib6   # cached: once
    python benchmarks/ordinary_targets.py build docs6 --out D/docs6
    python benchmarks/ordinary_targets.py plain D/stdlib6 --out D/stdlib6/plain
    python benchmarks/train_curve.py command --out D/stdlib6/now -- --target D/stdlib6/target \
        --data D/stdlib6/data.jsonl --regenerate --steps 250 --batch 16 --anchors-per-seq 32 \
        --seq-len 256 --layers 2 --block-size 8 --target-layer-ids 1,3 --save-every 50
    python benchmarks/ordinary_targets.py curve D/stdlib6 D/stdlib6/plain D/stdlib6/now

Both targets have the issue's shape, not tuned for anything here: Qwen3, 6 layers, hidden
256, 4 heads x 64, 2 KV heads, MLP 768, a 2,048-token byte-level BPE (`tokenizers`), 500
AdamW steps of 16 x 256 tokens (`train_targets.train_target`), every 20th text held out:

- `stdlib6`: the Python standard library's source (every .py file outside tests, idlelib
  and site-packages, sorted; every 20th held out). The issue's target.
- `docs6`: English about code: the standard library's docstrings (one text per module)
  and the reference manual's topics (`pydoc_data.topics`), every 20th text held out.

`build` writes TARGET/ (the model and tokenizer), `data.jsonl` (384 raw prompts of about
400 characters, up to 8 per text from 48 held-in texts: `{"text"}` lines for `train
--regenerate`), `heldout.jsonl` (16 `{"prompt"}` lines from held-out texts), `plain.jsonl`
(2,048 raw ~400-character prompts from across the held-in texts: the plain recipe's) and
`BUILD.json` (the build, held-out loss and perplexity, greedy distinct 4-grams). A folder
that already holds a BUILD.json is not built again.

`plain`: the plain recipe at the command's budget: the target's own 256-token greedy
continuations of the 2,048 plain prompts, 16 x 32 random anchors a step, the paper's loss
and schedule (the command's loop, `trainer.train`, fed those examples), a checkpoint kept
every `--every` steps under OUT/curve. `curve`: engine τ (greedy, W=8, 128 tokens, the
held-out prompts, through `dflash_mlx.generate`) of every kept checkpoint of each run,
with the distinct training tokens each had. Run with OpenBLAS preloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_targets import docstrings, train_target  # noqa: E402

SHAPE = {"layers": 6, "hidden": 256, "vocab": 2048}
TARGETS = {"stdlib6": "stdlib", "docs6": "docs"}
EXCLUDED = {"test", "tests", "idlelib", "site-packages", "lib2to3"}


def stdlib_files() -> list[Path]:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        f for f in root.rglob("*.py") if not EXCLUDED & set(f.relative_to(root).parts)
    )  # fmt: skip


def corpus(name: str) -> tuple[list[str], list[str], list[str]]:
    """(held-in texts, held-out texts, the held-in texts prompts are cut from): every 20th
    text held out."""
    if name == "stdlib":
        files = stdlib_files()
        texts = [f.read_text(errors="replace") for f in files]
        held_in = [t for i, t in enumerate(texts) if i % 20 != 19]
        held_out = [t for i, t in enumerate(texts) if i % 20 == 19]
        top = min(len(f.parts) for f in files)  # top-level files: the prompts' source
        tops = [
            t for i, (f, t) in enumerate(zip(files, texts)) if i % 20 != 19 and len(f.parts) == top
        ]  # fmt: skip
        return held_in, held_out, tops
    if name == "docs":
        from pydoc_data.topics import topics

        texts = [t for t in map(docstrings, stdlib_files()) if len(t) >= 400]
        texts += [topics[k] for k in sorted(topics)]
        held_in = [t for i, t in enumerate(texts) if i % 20 != 19]
        held_out = [t for i, t in enumerate(texts) if i % 20 == 19]
        return held_in, held_out, held_in
    raise ValueError(f"unknown corpus {name}")


def cut(text: str, rng: random.Random, chars: int = 400) -> str | None:
    """A ~`chars`-character stretch of `text` starting at a line's start (None if short)."""
    if len(text) < chars + 50:
        return None
    s = rng.randrange(0, len(text) - chars)
    s = text.rfind("\n", 0, s) + 1
    piece = text[s : s + chars]
    return piece if piece.strip() else None


def prompts(
    texts: list[str], n_texts: int, per: int, seed: int, key: str, shortest: int = 2000
) -> list[dict]:
    """Up to `per` ~400-character prompts from each of `n_texts` texts (seeded)."""
    rng = random.Random(seed)
    pool = [t for t in texts if len(t) >= shortest]
    rng.shuffle(pool)
    out = []
    for t in pool[:n_texts]:
        got = {p for p in (cut(t, rng) for _ in range(per)) if p}
        out += [{key: p} for p in sorted(got)]
    rng.shuffle(out)
    return out


def held_out_loss(folder: Path, texts: list[str], windows: int = 64, seq: int = 256) -> float:
    """Mean next-token cross-entropy (nats) of the target on `windows` seeded windows of the
    held-out texts."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    import dflash_mlx

    model, tok = dflash_mlx.load(str(folder))
    ids = np.array([t for x in texts for t in tok.encode(x) + [0]], np.int32)
    rng = np.random.default_rng(3)
    starts = rng.integers(0, len(ids) - seq - 1, size=windows)
    total = 0.0
    for j in range(0, windows, 16):
        x = mx.array(np.stack([ids[s : s + seq + 1] for s in starts[j : j + 16]]))
        logits = model(x[:, :-1]).astype(mx.float32)
        total += nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum").item()
    return total / (windows * seq)


def greedy_distinct(folder: Path, lines: list[dict], tokens: int = 128) -> dict:
    """The share of distinct 4-grams in the target's greedy continuations of the held-out
    prompts, and the most repeated token's share (a looping target scores low)."""
    from collections import Counter

    from mlx_lm.generate import batch_generate

    import dflash_mlx

    model, tok = dflash_mlx.load(str(folder))
    ps = [tok.encode(x["prompt"]) for x in lines]
    r = batch_generate(model, tok, ps, max_tokens=tokens, return_token_ids=True)
    grams, top = [], Counter()
    for ids in r.token_ids:
        ids = list(ids)
        g = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
        grams.append(len(set(g)) / max(1, len(g)))
        top.update(ids)
    token, n = top.most_common(1)[0]
    return {
        "distinct_4grams": round(sum(grams) / len(grams), 3),
        "most_common_token": tok.decode([token]),
        "its_share": round(n / sum(top.values()), 3),
        "sample": tok.decode(list(r.token_ids[0]))[:300],
    }


def cmd_build(args) -> None:
    if (args.out / "BUILD.json").is_file() and not args.force:
        print(f"{args.out}: built already ({args.out / 'BUILD.json'})")
        return
    held_in, held_out, sources = corpus(TARGETS[args.name])
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / "target"
    tic = time.perf_counter()
    shape = dict(SHAPE)
    if args.shape:  # a smaller stand-in (LAYERS x HIDDEN), when the machine has no time
        shape["layers"], shape["hidden"] = map(int, args.shape.split("x"))
    build = train_target(
        target, held_in, **shape, steps=args.steps, batch=16, seq=256, lr=args.lr,
        log=lambda s: print(s, flush=True),
    )  # fmt: skip
    data = prompts(sources, 48, 8, 1, "text")
    (args.out / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in data))
    held = prompts(held_out, 16, 2, 2, "prompt", shortest=600)[:16]
    (args.out / "heldout.jsonl").write_text("".join(json.dumps(d) + "\n" for d in held))
    rng = random.Random(4)
    plain = [p for p in (cut(rng.choice(held_in), rng) for _ in range(4000)) if p][:2048]
    (args.out / "plain.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in plain))
    loss = held_out_loss(target, held_out)
    build.update(
        name=args.name, held_out_loss=round(loss, 3), held_out_perplexity=round(math.exp(loss), 1),
        prompts=len(data), held_out_prompts=len(held), plain_prompts=len(plain),
        greedy=greedy_distinct(target, held), build_seconds=round(time.perf_counter() - tic),
    )  # fmt: skip
    (args.out / "BUILD.json").write_text(json.dumps(build, indent=1))
    print(json.dumps(build), flush=True)


def cmd_plain(args) -> None:
    """The plain recipe: the target's own `--reply`-token greedy continuations of the
    folder's 2,048 plain prompts (cached in plain_examples.json), 16 x 32 random anchors a
    step, the command's loop; a checkpoint kept every `--every` steps."""
    import shutil

    import dflash_mlx
    from dflash_mlx.cli.train import default_mask_token
    from dflash_mlx.train import trainer as T
    from dflash_mlx.train.data import TargetWriter

    model, tok = dflash_mlx.load(str(args.folder / "target"))
    cache = args.folder / "plain_examples.json"
    if cache.is_file():
        examples = [T.Example(t, s) for t, s in json.loads(cache.read_text())]
    else:
        tic = time.perf_counter()
        lines = (args.folder / "plain.jsonl").read_text().splitlines()
        ps = [tok.encode(json.loads(x)["text"])[-args.prompt :] for x in lines if x.strip()]
        replies = TargetWriter(model, tok, args.reply).replies(ps)
        examples = [T.Example(p + r, len(p)) for p, r in zip(ps, replies) if len(r) >= 2]
        cache.write_text(json.dumps([[e.tokens, e.start] for e in examples]))
        print(f"plain: {len(examples)} continuations written in "
              f"{time.perf_counter() - tic:.0f} s", flush=True)  # fmt: skip
    cfg = T.draft_config_for(
        model, layers=2, block_size=8, target_layer_ids=[1, 3],
        mask_token_id=default_mask_token(tok),
    )  # fmt: skip
    pair = T.init_draft(model, cfg, seed=0)
    st = T.TrainSettings(
        steps=args.steps, batch=16, seq_len=args.prompt + args.reply, anchors_per_seq=32,
        eval_every=10**6, save_every=args.every,
    )  # fmt: skip
    tic = time.perf_counter()

    def keep(entry):
        if entry["phase"] == T.TRAINING and entry["step"] % args.every == 0:
            dst = args.out / "curve" / f"step-{entry['step']:05d}"
            dst.mkdir(parents=True, exist_ok=True)
            for f in ("config.json", "model.safetensors"):
                shutil.copy(args.out / f, dst / f)
            print(f"plain step {entry['step']}: loss {entry['loss']:.3f} "
                  f"({time.perf_counter() - tic:.0f} s)", flush=True)  # fmt: skip

    log = T.train(pair, tok, cfg, examples, st, args.out, progress=keep)
    (args.out / "timing.json").write_text(
        json.dumps({"train_s": time.perf_counter() - tic, "data": log.data})
    )


def cmd_curve(args) -> None:
    """Engine τ (W=8, greedy, 128 tokens, the held-out prompts) of each run's checkpoints,
    with the distinct response tokens each run trains on and the expected share of them
    its steps had drawn by then (16 sequences a step from its examples)."""
    from dflash_mlx import GenerateOptions, Pair, Stats, generate, load, load_draft

    model, tok = load(str(args.folder / "target"))
    lines = (args.folder / "heldout.jsonl").read_text().splitlines()
    ps = [tok.encode(json.loads(x)["prompt"]) for x in lines if x.strip()][: args.prompts]
    options = GenerateOptions(max_tokens=args.tokens, verify_width=8)
    done: dict[Path, dict[int, dict]] = {run: {} for run in args.runs}
    while True:
        for run in args.runs:
            log_file = run / "training_log.json"
            if not log_file.is_file():
                continue
            data = json.loads(log_file.read_text())["data"]
            n, tokens = data["sequences"], data["response_tokens"]
            for ck in sorted((run / "curve").glob("step-*")):
                step = int(ck.name.split("-")[1])
                if (args.only and step not in args.only) or step in done[run]:
                    continue
                pair = Pair(model, load_draft(str(ck)))
                tau = Stats.total([generate(pair, tok, p, options).stats for p in ps]).tau
                seen = tokens * (1 - (1 - 1 / n) ** (16 * step))
                row = {"step": step, "tau": round(tau, 3), "distinct_tokens_seen": int(seen)}
                done[run][step] = row
                print(json.dumps({"run": run.name, **row, "sequences": n,
                                  "response_tokens": tokens}), flush=True)  # fmt: skip
                rows = [done[run][k] for k in sorted(done[run])]
                (run / "curve_tau.json").write_text(json.dumps(rows, indent=1))
        if not args.watch or all(args.watch in d for d in done.values()):
            return
        time.sleep(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="train a target and write its data (once)")
    b.add_argument("name", choices=sorted(TARGETS))
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--steps", type=int, default=500)
    b.add_argument("--lr", type=float, default=3e-3)
    b.add_argument("--force", action="store_true", help="build again over a built folder")
    b.add_argument("--shape", help="LAYERSxHIDDEN instead of the issue's 6x256, e.g. 4x128")
    p = sub.add_parser("plain", help="the plain recipe at the command's budget")
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--prompt", type=int, default=64, help="the prompt's last tokens kept")
    p.add_argument("--reply", type=int, default=256)
    c = sub.add_parser("curve", help="engine τ at W=8 of each run's kept checkpoints")
    c.add_argument("folder", type=Path)
    c.add_argument("runs", type=Path, nargs="+")
    c.add_argument("--prompts", type=int, default=16)
    c.add_argument("--tokens", type=int, default=128)
    c.add_argument("--only", type=lambda v: [int(x) for x in v.split(",")])
    c.add_argument("--watch", type=int, help="evaluate checkpoints as they come, until this step's")
    args = ap.parse_args()
    {"build": cmd_build, "plain": cmd_plain, "curve": cmd_curve}[args.cmd](args)


if __name__ == "__main__":
    main()

"""Learning curves of `dflash-mlx train` against an earlier revision and a minimal reference
loop, on the same data and seeds (issue 28).

    python benchmarks/train_curve.py data --out D/data.jsonl            # the prompts
    python benchmarks/train_curve.py command --root . --out D/now -- --steps 250 ...
    python benchmarks/train_curve.py command --root D/prev --out D/prev -- --steps 250 ...
    python benchmarks/train_curve.py reference --data D/data.jsonl --out D/ref --steps 250
    python benchmarks/train_curve.py eval D/now D/prev D/ref            # engine τ per step

`data`: ~100-token raw prompts cut (seeded) from 48 held-in stdlib files (the demo pair's
training split, scripts/make_demo_pair.py). `command`: the real `dflash-mlx train` of the
checkout at `--root` (this one, or a `git worktree` of an earlier revision), run in its own
process with a copy of every checkpoint kept under OUT/curve/step-N and the time spent
regenerating, stepping and evaluating written to OUT/timing.json. `reference`: a minimal
distillation loop written for the comparison: the same draft initialisation, the target's
greedy replies (`mlx_lm.generate_step`, one prompt at a time, whole, up to 128 tokens) as the
data, anchors at random reply positions, loss = weighted cross-entropy against the target's
own greedy tokens, AdamW (MLX's, or with `--bias-correction` the textbook one) with warm-up
and cosine. `eval`: engine
τ of every kept checkpoint with this checkout's decode engine, greedy, at a fixed verify
width (8), on the demo pair's held-out prompts, each run checked token for token against the
target's greedy decode.
Everything is seeded; run each with OpenBLAS preloaded on an otherwise idle core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
DEMO = HERE / "dflash_mlx" / "demo_pair"

# Imports dflash_mlx (and its `cli` as dflash_mlx.cli) from the tree in argv[1], keeps each
# checkpoint, times the phases, then runs `dflash-mlx train` with the rest of argv.
CHILD = r"""
import importlib.util, json, os, shutil, sys, time
root = sys.argv[1]
MAP = {"dflash_mlx": "dflash_mlx", "dflash_mlx.cli": "cli", "dflash_mlx.quantize": "quantize"}
class Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in MAP:
            d = os.path.join(root, MAP[name])
            return importlib.util.spec_from_file_location(
                name, os.path.join(d, "__init__.py"), submodule_search_locations=[d])
sys.meta_path.insert(0, Finder)
from pathlib import Path
import dflash_mlx.train.trainer as T
import dflash_mlx.cli.train as C
out = Path(sys.argv[sys.argv.index("--out") + 1])
timing = {"regenerate_s": 0.0, "eval_s": 0.0, "evals": 0, "step_s": []}
save, held, regen, train = T._save_state, T.held_out_tau, C._regenerator, T.train
def keep(draft, config, optimizer, out, state_dir, step, log):
    save(draft, config, optimizer, out, state_dir, step, log)
    dst = out / "curve" / f"step-{step:05d}"
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(out / f, dst / f)
def timed_held(*a, **k):
    tic = time.perf_counter()
    r = held(*a, **k)
    timing["eval_s"] += time.perf_counter() - tic
    timing["evals"] += 1
    return r
def timed_regen(*a, **k):
    fn = regen(*a, **k)
    def go(*b, **kw):
        tic = time.perf_counter()
        r = fn(*b, **kw)
        timing["regenerate_s"] += time.perf_counter() - tic
        return r
    return go
def timed_train(*a, **k):
    progress = k.get("progress")
    last = [time.perf_counter(), 0.0]
    def p(entry):
        now = time.perf_counter()
        timing["step_s"].append(now - last[0] - (timing["eval_s"] - last[1]))
        last[0], last[1] = now, timing["eval_s"]
        if progress:
            progress(entry)
    k["progress"] = p
    tic = time.perf_counter()
    r = train(*a, **k)
    timing["train_s"] = time.perf_counter() - tic
    return r
T._save_state, T.held_out_tau, C._regenerator, T.train = keep, timed_held, timed_regen, timed_train
try:  # trees with the continuations' writer (issue 64): it writes the branches and replies
    import dflash_mlx.train.data as Dm
    batch = Dm.TargetWriter._batch
    def timed_batch(*a, **k):
        tic = time.perf_counter()
        r = batch(*a, **k)
        timing["regenerate_s"] += time.perf_counter() - tic
        return r
    Dm.TargetWriter._batch = timed_batch
except ImportError:
    pass
if os.environ.get("TRAIN_CURVE_FLOAT32") == "1":  # an old tree without the CPU float32 upcast
    import dflash_mlx, mlx.core as mx
    load = dflash_mlx.load
    def load32(*a, **k):
        model, tok = load(*a, **k)
        model.set_dtype(mx.float32)
        return model, tok
    dflash_mlx.load = load32
from dflash_mlx.cli.main import app
sys.argv = ["dflash-mlx", "train", *sys.argv[2:]]
try:
    app()
except SystemExit as e:
    if e.code:
        raise
finally:
    steps = timing["step_s"]
    timing["mean_step_s"] = sum(steps[1:]) / max(1, len(steps) - 1)
    (out / "timing.json").write_text(json.dumps(timing, indent=1))
"""


# Times `--steps` training steps of the tree in argv[1] on fixed examples (prompts + replies
# from files), with that tree's own `init_draft` and `train` (old API or new).
STEPS_CHILD = r"""
import importlib.util, json, os, sys, tempfile, time
root, data, replies, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
MAP = {"dflash_mlx": "dflash_mlx", "dflash_mlx.cli": "cli", "dflash_mlx.quantize": "quantize"}
class Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in MAP:
            d = os.path.join(root, MAP[name])
            return importlib.util.spec_from_file_location(
                name, os.path.join(d, "__init__.py"), submodule_search_locations=[d])
sys.meta_path.insert(0, Finder)
import mlx.core as mx
import dflash_mlx
import dflash_mlx.train.trainer as T
from dflash_mlx.cli.train import default_mask_token
model, tok = dflash_mlx.load(sys.argv[5])
model.set_dtype(mx.float32)
texts = [json.loads(x)["text"] for x in open(data).read().splitlines() if x.strip()]
examples = []
for t, r in zip(texts, json.load(open(replies))):
    ids = tok.encode(t)[-128:]
    examples.append(T.Example(ids + r, len(ids)))
cfg = T.draft_config_for(model, layers=2, block_size=8, target_layer_ids=[1, 3],
                         mask_token_id=default_mask_token(tok))
made = T.init_draft(model, cfg, seed=0)
st = T.TrainSettings(steps=steps, batch=16, seq_len=256, anchors_per_seq=32,
                     eval_every=10**6, save_every=10**6)
times, last = [], [0.0]
def progress(entry):
    now = time.perf_counter()
    times.append(now - last[0])
    last[0] = now
out = tempfile.mkdtemp()
last[0] = time.perf_counter()
if hasattr(made, "draft"):  # a Pair: the current API
    T.train(made, tok, cfg, examples, st, __import__("pathlib").Path(out), progress=progress)
else:
    T.train(model, tok, made, cfg, examples, st, __import__("pathlib").Path(out),
            progress=progress)
print(json.dumps(times[2:]))
"""


def cmd_steptime(args) -> None:
    """Seconds a training step of each tree, the trees alternating for `--rounds` rounds on
    the same examples (16 x 32 anchors, block 8, 2 layers reading 1 and 3)."""
    env = dict(os.environ)
    env.setdefault("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
    got = {root: [] for root in args.roots}
    for _ in range(args.rounds):
        for root in args.roots:
            argv = [str(Path(root).resolve()), str(args.data), str(args.replies)]
            argv += [str(args.steps), args.target]
            r = subprocess.run(
                [sys.executable, "-c", STEPS_CHILD, *argv],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            got[root] += json.loads(r.stdout.strip().splitlines()[-1])
    for root, times in got.items():
        times = sorted(times)
        print(f"{root}: median {times[len(times) // 2]:.2f} s a step, min {times[0]:.2f} s")


def cmd_data(args) -> None:
    """~100-token raw prompts: 10 seeded windows from each of 48 held-in stdlib files."""
    sys.path.insert(0, str(HERE / "scripts"))
    from make_demo_pair import split_files
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(Path(args.target) / "tokenizer.json"))
    held_out, train_files = split_files()
    rng = random.Random(args.seed)
    out = []
    key = "prompt" if args.held_out else "text"
    for f in (held_out if args.held_out else train_files)[: args.files]:
        ids = tk.encode(f.read_text(errors="replace")).ids
        for s in sorted(rng.sample(range(0, len(ids) - args.tokens), args.per_file)):
            out.append({key: tk.decode(ids[s : s + args.tokens])})
    rng.shuffle(out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(json.dumps(o) for o in out) + "\n")
    print(f"{len(out)} prompts from {args.files} files -> {args.out}")


def cmd_command(args, rest: list[str]) -> None:
    env = dict(os.environ)
    env.setdefault("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
    if args.float32:
        env["TRAIN_CURVE_FLOAT32"] = "1"
    argv = [sys.executable, "-c", CHILD, str(Path(args.root).resolve()), "--out", str(args.out)]
    subprocess.run([*argv, *rest], check=True, env=env)


# -- the reference loop ------------------------------------------------------------------------


def greedy_reply(model, ids: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for t, _ in generate_step(
        mx.array(ids), model, max_tokens=max_tokens, sampler=lambda x: x.argmax(-1)
    ):
        out.append(int(t))
        if out[-1] in eos:
            break
    return out


def cmd_reference(args) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np

    import dflash_mlx
    from dflash_mlx.cli.train import default_mask_token
    from dflash_mlx.train.trainer import (
        Example,
        draft_config_for,
        init_draft,
        save_draft_checkpoint,
        split_held_out,
    )

    model, tok = dflash_mlx.load(args.target)
    eos = set(tok.eos_token_ids)
    tic = time.perf_counter()
    cached = args.replies is not None and args.replies.is_file()
    replies = json.loads(args.replies.read_text()) if cached else []
    data = []
    prompts = [
        tok.encode(json.loads(line)["text"])[-(args.seq_len - args.reply) :]
        for line in args.data.read_text().splitlines()
        if line.strip()
    ]
    if not cached and args.batched:  # mlx-lm's batched greedy decoding, not the command's code
        from mlx_lm.generate import batch_generate

        r = batch_generate(model, tok, prompts, max_tokens=args.reply, return_token_ids=True)
        replies = [list(t) for t in r.token_ids]
    for i, ids in enumerate(prompts):
        if not cached and not args.batched:
            replies.append(greedy_reply(model, ids, args.reply, eos))
        if len(replies[i]) >= 2:
            data.append(Example(ids + replies[i], len(ids)))
    regen_s = time.perf_counter() - tic
    if args.replies is not None and not cached:
        args.replies.write_text(json.dumps(replies))
    data, _ = split_held_out(data, 8, args.seed)  # the command's training split
    ids = [int(x) for x in args.target_layer_ids.split(",")]
    config = draft_config_for(
        model, layers=args.layers, block_size=args.block_size, target_layer_ids=ids,
        mask_token_id=default_mask_token(tok),
    )  # fmt: skip
    pair = init_draft(model, config, seed=args.seed)
    draft, L = pair.draft, args.block_size
    warm = max(1, int(0.04 * args.steps))
    cosine = optim.cosine_decay(args.lr, args.steps - warm, args.lr * 0.1)
    sched = optim.join_schedules([optim.linear_schedule(0.0, args.lr, warm), cosine], [warm])
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.01, bias_correction=args.bias_correction)
    w = mx.exp(-(mx.arange(1, L) - 1) / args.gamma)

    def loss_fn(draft, feats, labels, block, si, an, valid):
        logits = draft.training_logits(feats, si, an, block, pair.head)
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")
        wv = w[None] * valid
        return (ce * wv).sum() / wv.sum()

    grad = nn.value_and_grad(draft, loss_fn)
    layer_ids = config["dflash_config"]["target_layer_ids"]
    kept = []  # --keep-rows: each example's target forward, alone, once (the target is frozen)
    for e in data if args.keep_rows else []:
        logits, feats = pair.target.forward(mx.array([e.tokens]), None, layer_ids)
        kept.append((feats[0], mx.argmax(logits[0], axis=-1).astype(mx.int32)))
        mx.eval(*kept[-1])
    times, losses = [], []
    for step in range(min(args.steps, args.stop_after or args.steps)):
        t0 = time.perf_counter()
        rng = np.random.default_rng((args.seed, step))
        chosen = rng.choice(len(data), size=args.batch, replace=False)
        seqs = [data[i] for i in chosen]
        S = max(len(e.tokens) for e in seqs)
        toks = np.zeros((len(seqs), S), np.int32)
        si, an = [], []
        for b, e in enumerate(seqs):
            toks[b, : len(e.tokens)] = e.tokens
            where = np.arange(e.start, len(e.tokens) - 1)  # reply positions with a label after
            pos = rng.choice(where, size=min(args.anchors, len(where)), replace=False)
            si += [b] * len(pos)
            an += [int(a) for a in pos]
        toks, si, an = mx.array(toks), mx.array(si, mx.int32), mx.array(an, mx.int32)
        if kept:
            pads = [[(0, S - kept[i][1].shape[0])] for i in chosen]  # each example's own
            feats = mx.stack([mx.pad(kept[i][0], p + [(0, 0)]) for i, p in zip(chosen, pads)])
            greedy = mx.stack([mx.pad(kept[i][1], p) for i, p in zip(chosen, pads)])
        else:
            logits, feats = pair.target.forward(toks, None, layer_ids)
            greedy = mx.argmax(logits, axis=-1).astype(mx.int32)  # greedy[p]: target's at p+1
        pos = an[:, None] + mx.arange(L - 1)[None]
        lens = mx.array([len(e.tokens) for e in seqs])[si]
        valid = pos + 1 < lens[:, None]
        labels = greedy[si[:, None], mx.minimum(pos, S - 1)]
        block = mx.full((an.size, L), config["dflash_config"]["mask_token_id"], mx.int32)
        block[:, 0] = toks[si, an]
        loss, g = grad(draft, mx.stop_gradient(feats), labels, block, si, an, valid)
        g, _ = optim.clip_grad_norm(g, 1.0)
        opt.update(draft, g)
        mx.eval(loss, draft.parameters(), opt.state)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if (
            (step + 1) % args.curve_every == 0
            or step + 1 == args.steps
            or step + 1 == args.stop_after
        ):
            save_draft_checkpoint(draft, config, args.out / "curve" / f"step-{step + 1:05d}")
            print(
                f"reference step {step + 1}: loss {np.mean(losses[-args.curve_every :]):.3f}",
                flush=True,
            )
    timing = {"regenerate_s": regen_s, "step_s": times, "mean_step_s": float(np.mean(times[1:]))}
    (args.out / "timing.json").write_text(json.dumps(timing, indent=1))
    (args.out / "losses.json").write_text(json.dumps(losses))


# -- engine τ of the kept checkpoints --------------------------------------------------------


def cmd_eval(args) -> None:

    from dflash_mlx import GenerateOptions, Pair, Stats, generate, load, load_draft

    model, tok = load(args.target)
    prompts = [
        tok.encode(json.loads(x)["prompt"])
        for x in args.prompts.read_text().splitlines()
        if x.strip()
    ]
    want = [greedy_reply(model, p, args.tokens, set()) for p in prompts]
    options = GenerateOptions(max_tokens=args.tokens, verify_width=args.width)
    table = {}
    for run in args.runs:
        rows = []
        for ck in sorted((run / "curve").glob("step-*")):
            if args.only and int(ck.name.split("-")[1]) not in args.only:
                continue
            pair = Pair(model, load_draft(str(ck)))
            results = [generate(pair, tok, p, options) for p in prompts]
            same = all(r.tokens == w[: len(r.tokens)] and r.tokens for r, w in zip(results, want))
            tau = Stats.total([r.stats for r in results]).tau
            rows.append(
                {"step": int(ck.name.split("-")[1]), "tau": round(tau, 3), "identical": same}
            )
            print(
                f"{run.name} step {rows[-1]['step']}: τ {tau:.2f} (W={args.width}), "
                f"identical {same}",
                flush=True,
            )
        table[str(run)] = rows
        (run / f"curve_tau_{args.prompts.stem}.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps(table))


def main() -> None:
    argv = sys.argv[1:]
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--target", default=str(DEMO / "target"))
    d.add_argument("--files", type=int, default=48)
    d.add_argument("--per-file", type=int, default=10)
    d.add_argument("--tokens", type=int, default=100)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--held-out", action="store_true", help='from the held-out files, as {"prompt"} lines'
    )
    c = sub.add_parser("command", help="`dflash-mlx train` of --root; train options after --")
    c.add_argument("--root", default=str(HERE))
    c.add_argument("--out", type=Path, required=True)
    c.add_argument(
        "--float32",
        action="store_true",
        help="upcast the target to float32 (trees older than the CPU float32 upcast)",
    )
    r = sub.add_parser("reference")
    r.add_argument("--target", default=str(DEMO / "target"))
    r.add_argument("--data", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--steps", type=int, default=250)
    r.add_argument("--batch", type=int, default=16)
    r.add_argument("--anchors", type=int, default=32)
    r.add_argument("--seq-len", type=int, default=256)
    r.add_argument("--reply", type=int, default=128)
    r.add_argument("--lr", type=float, default=2e-3)
    r.add_argument("--gamma", type=float, default=4.0)
    r.add_argument("--layers", type=int, default=2)
    r.add_argument("--block-size", type=int, default=8)
    r.add_argument("--target-layer-ids", default="1,3")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--curve-every", type=int, default=50)
    r.add_argument("--stop-after", type=int, help="stop early (the schedule still --steps)")
    r.add_argument("--replies", type=Path, help="a JSON file of the replies: read, or written")
    r.add_argument(
        "--bias-correction", action="store_true", help="textbook AdamW (MLX's default: off)"
    )
    r.add_argument(
        "--batched", action="store_true", help="write the replies with mlx-lm's batch_generate"
    )
    r.add_argument(
        "--keep-rows",
        action="store_true",
        help="the target's forward of each example once, alone, before the first step",
    )
    t = sub.add_parser("steptime", help="seconds a training step, tree against tree")
    t.add_argument("roots", nargs="+")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--replies", type=Path, required=True, help="written by `reference`")
    t.add_argument("--target", default=str(DEMO / "target"))
    t.add_argument("--steps", type=int, default=8)
    t.add_argument("--rounds", type=int, default=2)
    e = sub.add_parser("eval")
    e.add_argument("runs", type=Path, nargs="+")
    e.add_argument("--target", default=str(DEMO / "target"))
    e.add_argument("--prompts", type=Path, default=DEMO / "heldout_prompts.jsonl")
    e.add_argument("--width", type=int, default=8)
    e.add_argument("--tokens", type=int, default=128)
    e.add_argument(
        "--only", type=lambda v: [int(x) for x in v.split(",")], help="steps, e.g. 100,250"
    )
    args = ap.parse_args(argv)
    if args.cmd == "command":
        cmd_command(args, rest)
    else:
        commands = {"data": cmd_data, "reference": cmd_reference, "eval": cmd_eval}
        {**commands, "steptime": cmd_steptime}[args.cmd](args)


if __name__ == "__main__":
    main()

"""Build the demo pair shipped in `dflash_mlx/demo_pair/` (for `--demo`), reproducibly.

    python scripts/make_demo_pair.py                       # every stage, into --work
    python scripts/make_demo_pair.py --stage target        # or one stage at a time:
    python scripts/make_demo_pair.py --stage draft         #   target, draft, eval, ship
    python scripts/make_demo_pair.py --stage eval
    python scripts/make_demo_pair.py --stage ship          # copies the pair into the package

1. target: a byte-level BPE tokenizer (`tokenizers`) and a small Qwen3-style code model
   trained from scratch on the Python standard library's own source (Python Software
   Foundation License), read from the running interpreter's `stdlib` folder: no download.
   Whole files are held out (seeded) for evaluation and listed in BUILD.json.
2. draft: a block-16 DFlash draft distilled with the real `dflash-mlx train --regenerate`
   on stretches of the held-in files: the target writes the continuations.
3. eval: held-out τ at W=16 with the real engine on prompts cut from the held-out files,
   greedy, each run checked token for token against the target's own greedy decode; τ per
   block position.
4. ship: bf16 weights, tokenizer and BUILD.json into `dflash_mlx/demo_pair/`.

Every random choice is seeded. The target's step count is fixed by `--target-steps` (300);
with `--target-steps 0` it is chosen for `--target-minutes` from the measured speed of the
first steps and written to BUILD.json (pass it back as `--target-steps` to repeat a build).
Budget with the defaults on a 2-core x86 machine with OpenBLAS preloaded, shared with other
jobs: target 33 min, draft 11-21 min (2 min of it the target writing the data), eval and
ship 1 min; the shipped pair's figures are in BUILD.json and the README.

A demonstration, not a useful assistant: it writes Python-looking text. MLX's stock Linux
CPU wheel multiplies with a reference BLAS; when Debian's OpenBLAS is installed
(`apt-get install libopenblas0-pthread`), this script re-runs itself with it preloaded,
which made training about 30x faster here. Nothing requires it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
WORK = Path.home() / ".cache" / "dflash-mlx" / "demo-build"
SEED = 0
HELD_OUT_FILES = 8
# The demo target is a code model, not an assistant: its "chat template" passes the text
# through, so `chat`, `bench` and `serve` prompts are continued as raw code.
RAW_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def stdlib_files() -> list[Path]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return [f for f in files if 2_000 < f.stat().st_size < 200_000]


def split_files(seed: int = SEED) -> tuple[list[Path], list[Path]]:
    """(held-out files, training files): whole files, a seeded shuffle."""
    files = stdlib_files()
    random.Random(seed).shuffle(files)
    return files[:HELD_OUT_FILES], files[HELD_OUT_FILES:]


def target_config(args) -> dict:
    hidden, heads = args.hidden, max(4, args.hidden // 64)
    return {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": args.layers,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 0,
    }


def _update(work: Path, section: str, data: dict) -> None:
    path = work / "BUILD.json"
    build = json.loads(path.read_text()) if path.is_file() else {}
    build[section] = {**build.get(section, {}), **data}
    path.write_text(json.dumps(build, indent=1))


# -- stage 1: the target ---------------------------------------------------------------------


def stage_target(args, work: Path) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes
    from tokenizers import Tokenizer

    from dflash_mlx.models.tiny import write_tokenizer

    held_out, train_files = split_files()
    texts = [f.read_text(errors="replace") for f in train_files]
    folder = work / "target"
    shutil.rmtree(folder, ignore_errors=True)
    write_tokenizer(folder, texts, args.vocab)
    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = [t for enc in tk.encode_batch(texts) for t in enc.ids + [0]]
    print(f"corpus: {len(train_files)} stdlib files, {len(ids)} tokens", flush=True)

    cfg = target_config(args)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(SEED)
    model = model_cls(args_cls.from_dict(cfg))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"target: {n_params / 1e6:.2f}M parameters", flush=True)
    data = np.array(ids, dtype=np.int32)
    rng = np.random.default_rng(SEED)
    seq, batch = args.seq_len, args.batch

    def loss_fn(m, x):
        logits = m(x[:, :-1])
        return nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")

    def batch_at():
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        return mx.array(np.stack([data[s : s + seq + 1] for s in starts]))

    steps = args.target_steps
    if not steps:  # measure a few steps (on a throwaway copy of the optimiser) to size the run
        probe = optim.AdamW(learning_rate=1e-4)
        grad_fn = nn.value_and_grad(model, loss_fn)
        saved = tree_map(lambda v: v, model.parameters())
        for i in range(4):
            if i == 1:
                tic = time.time()
            loss, grads = grad_fn(model, batch_at())
            probe.update(model, grads)
            mx.eval(loss, model.parameters(), probe.state)
        per_step = (time.time() - tic) / 3
        model.update(saved)
        rng = np.random.default_rng(SEED)
        steps = max(50, int(args.target_minutes * 60 / per_step))
        print(f"{per_step:.2f}s a step: {steps} steps for {args.target_minutes} min", flush=True)

    warm = max(1, steps // 20)
    sched = optim.join_schedules(
        [
            optim.linear_schedule(0, args.target_lr, warm),
            optim.cosine_decay(args.target_lr, steps - warm, args.target_lr / 20),
        ],
        [warm],
    )
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.05)
    state = [model.state, opt.state]
    grad_fn = nn.value_and_grad(model, loss_fn)

    from functools import partial

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(x):
        loss, grads = grad_fn(model, x)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    tic = time.time()
    losses = []
    (folder / "config.json").write_text(json.dumps(cfg))
    for step in range(steps):
        loss = step_fn(batch_at())
        mx.eval(loss, state)
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            weights = dict(tree_flatten(model.parameters()))  # a checkpoint, step by step
            mx.save_safetensors(str(folder / "model.safetensors"), weights)
            recent = sum(losses[-50:]) / len(losses[-50:])
            print(
                f"target step {step + 1}/{steps} loss {recent:.3f} ({time.time() - tic:.0f}s)",
                flush=True,
            )
    train_seconds = time.time() - tic
    # Held-out loss: whole files the target never saw.
    held_ids = [
        t
        for enc in tk.encode_batch([f.read_text(errors="replace") for f in held_out])
        for t in enc.ids + [0]
    ]
    hd = np.array(held_ids, dtype=np.int32)
    chunks = [hd[i : i + seq + 1] for i in range(0, len(hd) - seq - 1, seq)][:64]
    held_loss = float(np.mean([loss_fn(model, mx.array(c[None])).item() for c in chunks]))
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    _update(
        work,
        "target",
        {
            "architecture": (
                f"qwen3, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
                f"{cfg['num_attention_heads']} heads ({cfg['num_key_value_heads']} KV), "
                f"vocab {args.vocab} byte-level BPE trained on the same corpus, tied "
                f"embeddings, context {cfg['max_position_embeddings']}, "
                f"{n_params / 1e6:.2f}M parameters"
            ),
            "config": cfg,
            "corpus": (
                f"{len(train_files)} Python standard library source files (Python Software "
                f"Foundation License), {len(ids):,} tokens"
            ),
            "held_out_files": [f.name for f in held_out],
            "seed": SEED,
            "train_steps": steps,
            "batch": f"{batch} x {seq} tokens",
            "lr": args.target_lr,
            "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 3),
            "held_out_loss": round(held_loss, 3),
            "train_seconds": round(train_seconds),
            "reproduce": f"--stage target --target-steps {steps} --layers {args.layers} "
            f"--hidden {args.hidden} --vocab {args.vocab} --seq-len {seq} --batch {batch}",
        },
    )
    print(f"target saved: {folder} (held-out loss {held_loss:.3f})", flush=True)


# -- stage 2: the draft ----------------------------------------------------------------------


def draft_prompts(
    texts: list[str], n: int, seed: int, chars: int, mixed: bool = False
) -> list[dict]:
    """`n` stretches of the given files (chars/4 to chars long), each ending at a line end:
    the target continues them. `mixed`: half of them end anywhere and are 1 to `chars`
    long, so the draft also learns short prompts and prompts cut mid-line (as typed)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        text = texts[rng.randrange(len(texts))]
        if mixed and rng.random() < 0.5:
            end = rng.randrange(1, len(text))
            prompt = text[max(0, end - rng.randrange(1, chars)) : end]
        else:
            cut = text.rfind("\n", 0, rng.randrange(1, len(text)))
            if cut <= 0:
                continue
            prompt = text[max(0, cut + 1 - rng.randrange(chars // 4, chars)) : cut + 1]
        if prompt.strip():
            out.append({"text": prompt})
    return out


def stage_draft(args, work: Path) -> None:
    _, train_files = split_files()
    texts = [f.read_text(errors="replace") for f in train_files]
    prompts = draft_prompts(texts, args.draft_prompts, SEED + 1, args.prompt_chars, mixed=True)
    data = work / "draft_data.jsonl"
    data.write_text("\n".join(json.dumps(p) for p in prompts))
    draft_dir = work / "draft"
    shutil.rmtree(draft_dir, ignore_errors=True)
    cmd = [
        sys.executable, "-c", "from dflash_mlx.cli.main import app; app()", "train",
        "--target", str(work / "target"), "--data", str(data), "--out", str(draft_dir),
        "--layers", str(args.draft_layers), "--block-size", "16",
        "--target-layer-ids", args.target_layer_ids,
        "--steps", str(args.draft_steps), "--batch", str(args.draft_batch),
        "--anchors-per-seq", str(args.anchors), "--seq-len", str(args.draft_seq_len),
        "--regenerate", "--regen-tokens", str(args.regen_tokens), "--seed", str(SEED),
        "--eval-every", str(args.eval_every), "--save-every", str(args.eval_every),
        *args.train_args.split(),
    ]  # fmt: skip
    print("dflash-mlx " + " ".join(cmd[3:]), flush=True)
    tic = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    log = json.loads((draft_dir / "training_log.json").read_text())
    cfg = json.loads((draft_dir / "config.json").read_text())
    _update(
        work,
        "draft",
        {
            "architecture": (
                f"DFlash, {cfg['num_hidden_layers']} layers, block "
                f"{cfg['dflash_config']['block_size']}, reads target layers "
                f"{cfg['dflash_config']['target_layer_ids']}"
            ),
            "command": "dflash-mlx " + " ".join(cmd[3:]),
            "data": f"{len(prompts)} stretches of held-in stdlib files (half cut mid-line, "
            f"1 to {args.prompt_chars} characters) continued by the target",
            "seed": log["settings"]["seed"],
            "train_steps": args.draft_steps,
            "final_loss": round(log["steps"][-1]["loss"], 3),
            "train_seconds": round(time.time() - tic),
            "learning_curve": [[e["step"], round(e["tau"], 2)] for e in log["evals"]],
        },
    )
    shutil.rmtree(draft_dir / "training_state", ignore_errors=True)


# -- stage 3: held-out evaluation ------------------------------------------------------------


def held_out_prompts(args) -> list[dict]:
    held_out, _ = split_files()
    texts = [f.read_text(errors="replace") for f in held_out]
    return draft_prompts(texts, args.eval_prompts, SEED + 2, args.prompt_chars)


def stage_eval(args, work: Path, folder: Path | None = None, section: str = "draft") -> None:
    """Held-out τ of the pair in `folder` (default: the work folder's), into BUILD.json."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from dflash_mlx import GenerateOptions, Stats, generate, load_pair

    folder = folder or work
    pair, tok = load_pair(folder / "target", folder / "draft")
    options = GenerateOptions(max_tokens=args.eval_tokens, verify_width=16)
    prompts = held_out_prompts(args)
    runs = []
    identical = True
    for p in prompts:
        ids = tok.encode(p["text"])
        want = [
            int(t)
            for t, _ in generate_step(
                mx.array(ids),
                pair.model,
                max_tokens=args.eval_tokens,
                sampler=lambda x: x.argmax(-1),
            )
        ]
        r = generate(pair, tok, ids, options)
        n = min(len(r.tokens), len(want))
        identical &= r.tokens[:n] == want[:n] and n > 0
        runs.append(r.stats)
    pooled = Stats.total(runs)
    tau = pooled.tau
    per_position = [round(a, 3) for a in (pooled.acceptance_rates + [0.0] * 15)[:15]]
    print(f"held-out τ at W=16: {tau:.2f} over {len(prompts)} prompts; identical: {identical}")
    print("acceptance by block position:", per_position, flush=True)
    _update(
        work,
        section,
        {
            "held_out_tau_greedy_w16": round(tau, 2),
            "held_out_acceptance_by_position": per_position,
            "held_out_eval": (
                f"{len(prompts)} prompts cut from the held-out files, {args.eval_tokens} "
                "tokens each, greedy, W=16 (scripts/make_demo_pair.py --stage eval)"
            ),
            "token_identical_to_target_greedy": identical,
        },
    )
    if not identical:
        raise SystemExit("a DFlash run differed from the target's greedy decode")


# -- stage 4: ship ---------------------------------------------------------------------------


def window_the_draft(config_path: Path, seq_len: int) -> None:
    """Declare the draft's window: it was trained on `seq_len`-token sequences, so no block
    ever saw more than `seq_len - 1` context rows. Sliding layers with `is_causal: false`
    keep the trained bidirectional block; `--draft-window` still overrides. On held-out
    code at 512-3k tokens (benchmarks/draft_window.py) a 256 window raised τ 3-14% and
    speed 19-42%, and cut TTFT 16-22%, against the whole context."""
    cfg = json.loads(config_path.read_text())
    cfg["layer_types"] = ["sliding_attention"] * cfg["num_hidden_layers"]
    cfg["sliding_window"] = seq_len
    cfg["is_causal"] = False
    config_path.write_text(json.dumps(cfg, indent=2) + "\n")


def stage_ship(args, work: Path) -> None:
    import mlx.core as mx

    out = args.out
    tmp = out.with_name(out.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    for part in ("target", "draft"):
        (tmp / part).mkdir(parents=True)
        for f in (work / part).iterdir():
            if f.suffix == ".safetensors":
                w = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(f)).items()}
                mx.save_safetensors(str(tmp / part / f.name), w)
            elif f.is_file():  # config, tokenizer, the training log
                shutil.copy(f, tmp / part / f.name)
    window_the_draft(tmp / "draft" / "config.json", args.draft_seq_len)
    config = json.loads((tmp / "target" / "tokenizer_config.json").read_text())
    config["chat_template"] = RAW_TEMPLATE
    (tmp / "target" / "tokenizer_config.json").write_text(json.dumps(config))
    # The held-out evaluation prompts, for `dflash-mlx bench --demo --prompts ...`.
    prompts = [{"prompt": p["text"]} for p in held_out_prompts(args)]
    (tmp / "heldout_prompts.jsonl").write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    _update(
        work,
        "shipped",
        {
            "weights": "bf16",
            "bytes": size,
            "built_by": "scripts/make_demo_pair.py",
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
            f"MLX {mx.__version__} CPU, OpenBLAS preloaded: {'LD_PRELOAD' in os.environ}",
        },
    )
    stage_eval(args, work, folder=tmp, section="shipped")  # the bf16 weights as shipped
    shutil.copy(work / "BUILD.json", tmp / "BUILD.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"shipped {out} ({size / 1e6:.1f} MB, bf16)", flush=True)


STAGES = {"target": stage_target, "draft": stage_draft, "eval": stage_eval, "ship": stage_ship}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=[*STAGES, "all"], default="all")
    ap.add_argument("--work", type=Path, default=WORK, help="build folder (outside the package)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--target-steps", type=int, default=300, help="0: sized by --target-minutes")
    ap.add_argument("--target-minutes", type=float, default=40)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-steps", type=int, default=320)
    ap.add_argument("--draft-batch", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=16, help="anchors per sequence")
    ap.add_argument("--draft-seq-len", type=int, default=256)
    ap.add_argument("--target-layer-ids", default="1,3")
    ap.add_argument("--draft-prompts", type=int, default=1024)
    ap.add_argument("--prompt-chars", type=int, default=600, help="longest prompt stretch")
    ap.add_argument("--regen-tokens", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=80)
    ap.add_argument("--train-args", default="", help="more `dflash-mlx train` options")
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-tokens", type=int, default=128)
    args = ap.parse_args()
    if OPENBLAS.exists() and "LD_PRELOAD" not in os.environ:
        print(f"re-running with {OPENBLAS} preloaded (faster matmuls)", flush=True)
        env = {**os.environ, "LD_PRELOAD": str(OPENBLAS)}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    args.work.mkdir(parents=True, exist_ok=True)
    for name, fn in STAGES.items():
        if args.stage in (name, "all"):
            tic = time.time()
            print(f"== stage {name}", flush=True)
            fn(args, args.work)
            _update(args.work, "stage_seconds", {name: round(time.time() - tic)})


if __name__ == "__main__":
    main()

"""τ and speed against plain decoding on long prompts, for each draft context policy.

    python benchmarks/long_context.py [--contexts 1k,3k,8k] [--prompts 3] [--tokens 64]
        [--policies default,w256s16,w1024,whole] [--finetuned DIR] [--width 8]
        [--regime both|stock|openblas] [--repeats 1] [--peer PEER_VENV/bin/python]

On the demo pair's target and its draft, with the draft's config declaring what `dflash-mlx
train` now writes (`training_context: 256`, the length it was trained on) instead of a
sliding window, so that every policy can be set (a declared sliding window cannot be
widened); the target's `max_position_embeddings` is raised to 16384 in the copy, so 8k
prompts run (it was trained on 256-token sequences: 1k, 3k and 8k are all far past it).
Each prompt is the last N tokens before a point in the middle of a held-out file, the
held-out files joined in turn (so an 8k prompt spans several files, never repeats one).

Policies (`--policies`): `default` (the draft's own: its training context as the window,
the default sink), `wN` (`draft_window=N`), `wNsS` (window N, sink S), `whole` (no window);
`--finetuned DIR` adds `finetuned`: that draft (e.g. from `dflash-mlx train --init ...
--long-context ...`) under its own default policy. For every prompt the script runs, after
a warm-up: mlx-lm's greedy decoding (the baseline), then each policy at the automatic width
(the default) and at the fixed width `--width` (what the draft could give where wide
verifies are cheap), checking every output against mlx-lm's tokens. It prints per length
and policy: τ and tok/s / mlx-lm at the automatic width (geometric mean over prompts, with
its 95% interval), the share of tokens decoded plainly, τ and tok/s / mlx-lm at `--width`.

`--peer PY` also runs bstnxbt's dflash-mlx (its defaults: a draft cache of 64 sink positions
and a 1024-position window) on the same pair and prompts, in the venv PY belongs to
(`peer_dflash_mlx.py` says how to make it), each prompt against mlx-lm in that process.

Both regimes by default, each in its own process with a fresh calibration folder: MLX's
stock wheel and Debian's OpenBLAS preloaded. Ratios, not absolute numbers, carry over.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from draft_window import OPENBLAS, counts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1k,3k,8k")
    ap.add_argument("--prompts", type=int, default=3, help="held-out files (one prompt each)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--policies", default="default,w256s16,w1024,whole")
    ap.add_argument("--finetuned", type=Path, help="a fine-tuned draft folder to add")
    ap.add_argument(
        "--width", type=int, default=8, help="the fixed width τ is also taken at (0: none)"
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--regime", choices=["both", "stock", "openblas"], default="both")
    ap.add_argument(
        "--peer",
        type=Path,
        help="the Python of a venv holding bstnxbt's dflash-mlx (see peer_dflash_mlx.py)",
    )
    args = ap.parse_args()
    if args.regime == "both":
        for regime in ("stock", "openblas"):
            argv, skip = [], False
            for a in sys.argv[1:]:  # without "--regime X" / "--regime=X"
                if not skip and not a.startswith("--regime"):
                    argv.append(a)
                skip = a == "--regime"
            code = subprocess.call([sys.executable, __file__, *argv, "--regime", regime])
            if code:
                sys.exit(code)
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if args.regime == "openblas" and "openblas" not in preload:
        env = {**os.environ, "LD_PRELOAD": str(OPENBLAS)}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    if args.regime == "stock" and preload:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    os.environ["DFLASH_MLX_CACHE"] = tempfile.mkdtemp(prefix=f"dflash-long-{args.regime}-")
    run(args)


def greedy_mlx_lm(model, ids: list[int], n: int) -> tuple[float, list[int]]:
    """mlx-lm's greedy decoding of `n` tokens after `ids`: tokens after the first per
    second, and the tokens (also run by `peer_dflash_mlx.py`, in the peer's venv)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out, first = [], 0.0
    for t, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=None):
        if not out:
            first = time.perf_counter()
        out.append(int(t))
    return (n - 1) / (time.perf_counter() - first), out


def declared_pair(target_dir: Path, draft_dir: Path) -> tuple[Path, Path]:
    """The demo pair, its draft declaring `training_context: 256` instead of a sliding
    window, its target's context raised to 16384 (same weights, linked)."""
    out = Path(tempfile.mkdtemp(prefix="dflash-long-pair-"))
    for src, name in ((target_dir, "target"), (draft_dir, "draft")):
        (out / name).mkdir()
        for f in src.iterdir():
            (out / name / f.name).symlink_to(f.resolve())
    cfg = json.loads((draft_dir / "config.json").read_text())
    cfg.pop("sliding_window", None)
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    cfg["dflash_config"]["training_context"] = 256
    (out / "draft" / "config.json").unlink()
    (out / "draft" / "config.json").write_text(json.dumps(cfg, indent=1))
    tcfg = json.loads((target_dir / "config.json").read_text())
    tcfg["max_position_embeddings"] = 16384
    (out / "target" / "config.json").unlink()
    (out / "target" / "config.json").write_text(json.dumps(tcfg, indent=1))
    return out / "target", out / "draft"


def prompts(tok, files: list[str], n: int, count: int) -> list[list[int]]:
    """For each of `count` held-out files: the held-out files joined from it on (in turn),
    and the last `n` tokens before the middle of that first file's part."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / f).read_text(encoding="utf-8", errors="replace") for f in files]
    out = []
    for i in range(min(count, len(texts))):
        order = texts[i:] + texts[:i]
        first = len(tok.encode(order[0]))
        ids = tok.encode("\n".join(order))
        while len(ids) < n + first // 2 + 16:
            ids = ids + ids  # only if every held-out file together is shorter
        end = n + first // 2
        out.append(ids[end - n : end])
    return out


def policy(name: str) -> dict:
    """GenerateOptions fields of a policy name (see the module's help)."""
    if name in ("default", "finetuned"):
        return {}
    if name == "whole":
        return {"draft_window": 1 << 30}
    window, _, sink = name[1:].partition("s")
    return {"draft_window": int(window), "draft_sink": int(sink) if sink else 0}


def paired(xs: list[float]) -> str:
    logs = [math.log(x) for x in xs]
    m = statistics.fmean(logs)
    h = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return f"{math.exp(m):.2f}x [{math.exp(m - h):.2f}-{math.exp(m + h):.2f}]"


def run(args) -> None:
    import mlx.core as mx

    from dflash_mlx import GenerateOptions, load_draft, load_pair, stream_generate
    from dflash_mlx.demo import SHIPPED, demo_pair
    from dflash_mlx.pair import Pair

    target_dir, draft_dir = declared_pair(*demo_pair())
    pair, tok = load_pair(target_dir, draft_dir)
    pairs = {"": pair}
    names = [p for p in args.policies.split(",") if p]
    if args.finetuned:
        pairs["finetuned"] = Pair(pair.model, load_draft(args.finetuned))
        names.append("finetuned")
    files = json.loads((SHIPPED / "BUILD.json").read_text())["target"]["held_out_files"]
    blas = "OpenBLAS preloaded" if args.regime == "openblas" else "stock wheel"
    tic = time.perf_counter()
    for p in pairs.values():
        p.costs()
    print(
        f"# {blas}; MLX {mx.__version__} {mx.default_device()}; {args.prompts} prompts x "
        f"{args.repeats}, {args.tokens} greedy tokens; calibrated in "
        f"{time.perf_counter() - tic:.0f} s",
        flush=True,
    )

    def engine(name: str, ids: list[int], n: int, width: int | None):
        p = pairs.get(name, pair)
        options = GenerateOptions(max_tokens=n, verify_width=width, **policy(name))
        out = []
        for r in stream_generate(p, tok, ids, options):
            out += r.tokens
        return r.stats, out

    warm = prompts(tok, files, 256, 1)[0]
    for name in names:
        engine(name, warm, 16, None)
    greedy_mlx_lm(pair.model, warm, 16)
    print(
        f"{'context':>7} {'policy':<10} {'auto tau':>8} {'auto / mlx-lm':<20} "
        f"{'plain share':>11} {f'tau W={args.width}':>9} {f'W={args.width} / mlx-lm':<20}",
        flush=True,
    )
    for n_ctx in counts(args.contexts):
        rows = {m: {"tau": [], "x": [], "plain": [], "tau_w": [], "x_w": []} for m in names}
        for _ in range(args.repeats):
            for ids in prompts(tok, files, n_ctx, args.prompts):
                base, ref = greedy_mlx_lm(pair.model, ids, args.tokens)
                for name in names:
                    s, out = engine(name, ids, args.tokens, None)
                    if out != ref:
                        sys.exit(f"{name} at {n_ctx}: output differs from mlx-lm's")
                    rows[name]["tau"].append(s.tau)
                    rows[name]["x"].append(s.generation_tps / base)
                    rows[name]["plain"].append(s.plain_fraction)
                    if args.width:
                        s, out = engine(name, ids, args.tokens, args.width)
                        if out != ref:
                            sys.exit(f"{name} W={args.width} at {n_ctx}: output differs")
                        rows[name]["tau_w"].append(s.tau)
                        rows[name]["x_w"].append(s.generation_tps / base)
        for name in names:
            r = rows[name]
            print(
                f"{n_ctx:>7} {name:<10} {statistics.fmean(r['tau']):8.2f} {paired(r['x']):<20} "
                f"{statistics.fmean(r['plain']):11.2f} "
                f"{statistics.fmean(r['tau_w']) if r['tau_w'] else float('nan'):9.2f} "
                f"{paired(r['x_w']) if r['x_w'] else '':<20}",
                flush=True,
            )
    print("every output equals mlx-lm's greedy tokens")
    if args.peer:
        peer(args, tok, files, target_dir, draft_dir)


def peer(args, tok, files: list[str], target_dir: Path, draft_dir: Path) -> None:
    """bstnxbt's dflash-mlx on the same pair and prompts, in its own venv's process (its
    package is also named `dflash_mlx`), each prompt against mlx-lm in that process."""
    cfg = json.loads((draft_dir / "config.json").read_text())
    # its loader reads these three from the top level (they are implied by our format)
    cfg.update(
        model_type="qwen3", tie_word_embeddings=True, block_size=cfg["dflash_config"]["block_size"]
    )
    peer_draft = draft_dir.parent / "peer-draft"
    peer_draft.mkdir(exist_ok=True)
    for f in draft_dir.iterdir():
        if f.name != "config.json" and not (peer_draft / f.name).exists():
            (peer_draft / f.name).symlink_to(f.resolve())
    (peer_draft / "config.json").write_text(json.dumps(cfg, indent=1))
    sets = {n: prompts(tok, files, n, args.prompts) for n in counts(args.contexts)}
    prompts_file = draft_dir.parent / "peer-prompts.json"
    prompts_file.write_text(json.dumps(sets))
    runner = Path(__file__).parent / "peer_dflash_mlx.py"
    rows: dict[int, list[dict]] = {}
    for _ in range(args.repeats):
        proc = subprocess.run(
            [
                str(args.peer),
                str(runner),
                str(target_dir),
                str(peer_draft),
                str(prompts_file),
                str(args.tokens),
            ],  # fmt: skip
            capture_output=True,
            text=True,
            # neither this checkout nor PYTHONPATH: our dflash_mlx would shadow theirs
            cwd=tempfile.gettempdir(),
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        if proc.returncode:
            sys.exit(f"the peer failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                rows.setdefault(r["context"], []).append(r)
    print(f"{'context':>7} {'peer':<22} {'tau':>5} {'peer / mlx-lm':<20} {'same tokens':>11}")
    for n_ctx, rs in rows.items():
        tau = statistics.fmean(r["tau"] for r in rs)
        same = all(r["same"] for r in rs)
        ratios = [r["peer"] / r["mlx_lm"] for r in rs]
        name = "bstnxbt 0.1.8 defaults"
        print(f"{n_ctx:>7} {name:<22} {tau:5.2f} {paired(ratios):<20} {same!s:>11}")


if __name__ == "__main__":
    main()

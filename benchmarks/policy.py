"""The automatic width against every fixed width and plain batching, per device profile.

Each cell (a pair, a context length, c concurrent requests) runs the engine on real tokens:
every fixed width once (its tokens and acceptance do not depend on the clock, so its passes,
read from the engine's trace, are priced on each profile afterwards), plain decoding (the
engine forced to W = 1) the same way, and the automatic width once per profile with the
engine's clock a simulated device (`dflash_mlx.bench.profiles.SimClock`): its decisions see
that device's costs, its calibration is that device's curves. Figures are simulated decode
tokens per second (prefill excluded); the policy carries across a profile's cells, as a
server's does. Profiles `stock` and `openblas` are this CPU's regimes as measured: make them
first with `--calibrate` in each regime (`LD_PRELOAD=.../libblas.so.3` for OpenBLAS).

    python benchmarks/policy.py --calibrate                  # stock curves of both pairs
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/policy.py --calibrate              # OpenBLAS curves
    python benchmarks/policy.py --profile m5,m5-fewrows,stock,openblas
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CURVES = HERE / "profiles"


def counts(text: str) -> list[int]:
    return [int(p[:-1]) * 1024 if p.endswith("k") else int(p) for p in text.lower().split(",") if p]


def load_pairs(names: list[str]):
    from dflash_mlx import load_pair
    from dflash_mlx.demo import demo_pair
    from dflash_mlx.models.deep import pad_pair

    target, draft = demo_pair()
    out = {}
    for name in names:
        if name == "demo":
            out[name] = load_pair(target, draft)
        else:  # deepN: the demo pair padded to N target layers
            root = Path(tempfile.mkdtemp(prefix="dflash-deep-"))
            out[name] = load_pair(*pad_pair(target, draft, root, int(name[4:])))
    return out


def prompts(tok, n: int, c: int) -> list[list[int]]:
    import sysconfig

    from dflash_mlx.demo import SHIPPED

    files = json.loads((SHIPPED / "BUILD.json").read_text())["target"]["held_out_files"]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in (files * c)[:c]:
        ids = tok.encode((stdlib / name).read_text(encoding="utf-8", errors="replace"))
        if len(ids) < n + 16:
            ids = (ids * (-(-(n + 16) // len(ids))))[: n + 16]
        k = len(out) // len(files)  # a second prompt of one file starts elsewhere
        end = max(n, len(ids) // 2 - k * (n // 2 + 97))
        out.append(ids[end - n : end])
    return out


def run(pair, tok, batches: list[list[list[int]]], tokens: int, width: int | None, clock=None):
    """Batches one after another, each its prompts at once: (generated tokens after the
    first of each, the trace, the rows' stats)."""
    from dflash_mlx import GenerateOptions
    from dflash_mlx.engine.batch import BatchDecoder

    events, made, stats = [], 0, []
    opts = GenerateOptions(max_tokens=tokens, verify_width=width)
    for ids in batches:
        dec = BatchDecoder(pair, tok, max_batch=len(ids))
        dec.trace, dec.clock = events.append, clock
        rows = [dec.submit(p, opts) for p in ids]
        last = {}
        while dec.busy:
            for row, out in dec.step():
                if isinstance(out, BaseException):
                    raise out
                last[id(row)] = out
        made += sum(r.generated - 1 for r in rows)
        stats += [last[id(r)].stats for r in rows]
    return made, events, stats


def priced(profile, events) -> float:
    return sum(profile.charge(e) for e in events if e.kind != "prefill")


def calibrate(names: list[str]) -> None:
    from dflash_mlx.calibration import cache_path

    regime = "openblas" if "openblas" in os.environ.get("LD_PRELOAD", "") else "stock"
    CURVES.mkdir(exist_ok=True)
    for name, (pair, _) in load_pairs(names).items():
        tic = time.perf_counter()
        pair.costs()
        data = json.loads(cache_path(pair).read_text())
        (CURVES / f"{regime}-{name}.json").write_text(json.dumps(data, indent=1))
        print(f"{regime} {name}: calibrated in {time.perf_counter() - tic:.1f} s", flush=True)


def profiles_for(names: list[str], pair_name: str):
    from dflash_mlx.bench.profiles import Profile, m5
    from dflash_mlx.calibration import _read

    out = []
    for name in names:
        if name in ("m5", "m5-fewrows"):
            out.append(m5(name == "m5-fewrows"))
            continue
        path = CURVES / f"{name}-{pair_name}.json"
        curves = _read(path, json.loads(path.read_text())["key"]) if path.exists() else None
        if curves is None:
            sys.exit(f"error: no measured curves {path}: run with --calibrate in that regime")
        out.append(Profile(name, curves=curves))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="m5,m5-fewrows,stock,openblas")
    ap.add_argument("--pairs", default="demo,deep24")
    ap.add_argument("--contexts", default="128,1k,3k")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, default=3, help="batches of c requests a cell")
    ap.add_argument("--widths", default="2,3,4,6,8,12,16")
    ap.add_argument("--calibrate", action="store_true", help="measure this regime's curves")
    ap.add_argument("--json", type=Path, help="write every cell's figures here")
    args = ap.parse_args()
    os.environ.setdefault("DFLASH_MLX_CACHE", tempfile.mkdtemp(prefix="dflash-policy-"))
    pair_names = args.pairs.split(",")
    if args.calibrate:
        return calibrate(pair_names)
    from dflash_mlx.bench.profiles import SimCalibration, SimClock

    widths = [int(w) for w in args.widths.split(",")]
    cells = []
    for pair_name, (pair, tok) in load_pairs(pair_names).items():
        profs = profiles_for(args.profile.split(","), pair_name)
        block = pair.draft.config.block_size
        policies = {}
        for n_ctx in counts(args.contexts):
            for c in counts(args.concurrency):
                every = prompts(tok, n_ctx, c * args.batches)
                ids = [every[i * c : (i + 1) * c] for i in range(args.batches)]
                fixed = {}
                for w in [1, *widths]:
                    fixed[w] = run(pair, tok, ids, args.tokens, w)
                for prof in profs:
                    pair.calibration = SimCalibration(prof.as_curves(block))
                    pair.policies = policies.setdefault(prof.name, {})
                    clock = SimClock(prof)
                    made, _, stats = run(pair, tok, ids, args.tokens, None, clock)
                    auto = made / (clock.t - clock.prefill)
                    rate = {w: f[0] / priced(prof, f[1]) for w, f in fixed.items()}
                    best = max(widths, key=rate.get)
                    tau = sum(s.tau for s in stats) / len(stats)
                    cell = {
                        "profile": prof.name,
                        "pair": pair_name,
                        "context": n_ctx,
                        "c": c,
                        "plain": rate[1],
                        "best_w": best,
                        "best": rate[best],
                        "auto": auto,
                        "tau": tau,
                        "rates": rate,
                    }
                    cells.append(cell)
                    print(line(cell), flush=True)
    report(cells)
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))


def line(r: dict) -> str:
    return (
        f"{r['profile']:>10} {r['pair']:>6} {r['context']:>5} c={r['c']}: plain "
        f"{r['plain']:8.1f} · best W={r['best_w']:<2} {r['best']:8.1f} · auto {r['auto']:8.1f} "
        f"(τ {r['tau']:.2f}) · auto/best {r['auto'] / max(r['best'], r['plain']):.2f} · "
        f"auto/plain {r['auto'] / r['plain']:.2f}"
    )


def report(cells: list[dict]) -> None:
    """Per profile: cells where auto >= 0.95x the best of plain and every fixed width, and,
    where no width beats plain, >= 0.98x plain."""
    print(
        "\n| profile | cells | auto >= 0.95x best | no width beats plain: auto >= 0.98x plain "
        "| worst auto/best |"
    )
    print("|---|---:|---:|---:|---:|")
    for prof in dict.fromkeys(r["profile"] for r in cells):
        mine = [r for r in cells if r["profile"] == prof]
        ok = [r for r in mine if r["auto"] >= 0.95 * max(r["best"], r["plain"])]
        flat = [r for r in mine if r["best"] <= r["plain"]]
        flat_ok = [r for r in flat if r["auto"] >= 0.98 * r["plain"]]
        worst = min(r["auto"] / max(r["best"], r["plain"]) for r in mine)
        print(f"| {prof} | {len(mine)} | {len(ok)} | {len(flat_ok)} of {len(flat)} | {worst:.2f} |")


if __name__ == "__main__":
    main()

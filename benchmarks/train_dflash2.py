"""Engine τ of trained drafts, DFlash 1 and 2, chains and selector trees, and z-lab's
reference on the same DFlash 2 checkpoints (issue 39).

    python benchmarks/train_dflash2.py tau --target T --prompts P.jsonl DRAFT [DRAFT ...]
    python benchmarks/train_dflash2.py reference --target T --prompts P.jsonl DRAFT [...]

`tau`: for each draft, greedy on every held-out prompt (`{"prompt"}` lines, encoded raw),
`--tokens` tokens: the chain at verify width `--width` (8) and, for a DFlash 2 draft, the
tree of `--tree` nodes (16) from its selector; pooled τ (verified tokens / cycles), each run
checked token for token against the target's greedy decode. `reference`: z-lab's
`dflash.model_mlx` (`pip install --no-deps dflash==0.1.0`) loads each checkpoint unchanged
and decodes the same prompts greedy at its block size; its τ and tokens beside ours at the
same width. A draft folder may be a training run's `curve/step-N` checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vs_reference import reference_draft  # noqa: E402


def prompts_of(tok, path: Path) -> list[list[int]]:
    return [tok.encode(json.loads(x)["prompt"]) for x in path.read_text().splitlines() if x.strip()]


def greedy(model, ids: list[int], n: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=lambda x: x.argmax(-1))
    return [int(t) for t, _ in steps]


def ours(pair, tok, prompts, tokens: int, width: int, tree: bool):
    from dflash_mlx import GenerateOptions, Stats, generate

    options = GenerateOptions(max_tokens=tokens, verify_width=width, tree=tree)
    results = [generate(pair, tok, p, options) for p in prompts]
    return [r.tokens for r in results], Stats.total([r.stats for r in results]).tau


def cmd_tau(args) -> None:
    from dflash_mlx import Pair, load, load_draft

    model, tok = load(args.target)
    prompts = prompts_of(tok, args.prompts)
    want = [greedy(model, p, args.tokens) for p in prompts]
    table = {}
    for folder in args.drafts:
        pair = Pair(model, load_draft(folder))
        shapes = [("chain", args.width, False)]
        if pair.draft.config.is_dflash2 and args.tree:
            shapes.append(("tree", args.tree, True))
        for name, width, tree in shapes:
            toks, tau = ours(pair, tok, prompts, args.tokens, width, tree)
            same = all(t == w[: len(t)] and t for t, w in zip(toks, want))
            table[f"{folder} {name} {width}"] = {"tau": round(tau, 3), "identical": same}
            print(f"{folder}: {name} of {width}: τ {tau:.2f}, identical {same}", flush=True)
    print(json.dumps(table))


def cmd_reference(args) -> None:
    import dflash.model_mlx as ref

    from dflash_mlx import Pair, load, load_draft

    model, tok = load(args.target)
    ref_model, _ = load(args.target)  # its own instance: the reference patches its layers
    prompts = prompts_of(tok, args.prompts)
    for folder in args.drafts:
        theirs = reference_draft(folder)
        pair = Pair(model, load_draft(folder))
        block = pair.draft.config.block_size
        toks, tau = ours(pair, tok, prompts, args.tokens, block, False)
        got, cycles = [], 0
        for ids in prompts:
            out, n = [], 0
            for r in ref.stream_generate(ref_model, theirs, tok, ids, max_tokens=args.tokens):
                out.extend(r.tokens)
                n += bool(r.tokens)
            got.append(out)
            cycles += n - 1  # its first response is the prefill's token
        ref_tau = sum(len(g) - 1 for g in got) / max(cycles, 1)
        same = got == toks
        print(
            f"{folder}: {type(theirs).__name__} · reference τ {ref_tau:.3f} · ours (W={block}) "
            f"τ {tau:.3f} · same tokens {same}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("tau", "reference"):
        p = sub.add_parser(name)
        p.add_argument("drafts", nargs="+", type=Path)
        p.add_argument("--target", required=True)
        p.add_argument("--prompts", type=Path, required=True)
        p.add_argument("--tokens", type=int, default=128)
        if name == "tau":
            p.add_argument("--width", type=int, default=8)
            p.add_argument("--tree", type=int, default=16, help="tree nodes (0: none)")
    args = ap.parse_args()
    {"tau": cmd_tau, "reference": cmd_reference}[args.cmd](args)


if __name__ == "__main__":
    main()

"""Tree verification against chains on one pair: tau and speed per budget, and auto mode.

Greedy decoding of held-out prompts with the demo pair (or `--target/--draft`), each row
one verify shape: a chain of width W, a tree of B tokens (anchor included), and the
automatic modes (width chosen per cycle; chains only, or chain or tree chosen per cycle).
Prints tau, tok/s and both against the chain of width 8; checks every output equals plain
decoding. Variants are interleaved prompt by prompt, so drift on a loaded machine falls on
all of them. `--draft-block 8` has a block-16 draft draft 8 positions (a block-8 pair).
A DFlash 2 draft's trees come from its selector; `tBaX` (`t16a1.5`): its pair scores times X
before the best-first search (sharper for X > 1; a shape variant, not an option of the
engine). `--prompts-file`: held-out prompts of another target (`{"prompt"}` lines; the demo
pair's by default).

    python benchmarks/trees.py [--draft-block 8] [--prompts 8]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python benchmarks/trees.py
    DFLASH_MLX_DEMO=dflash2 python benchmarks/trees.py --prompts 16 --shapes c8,c16,t16
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

import dflash_mlx.engine.tree as tree_module
from dflash_mlx import GenerateOptions, Pair, generate, load, load_draft
from dflash_mlx.demo import demo_pair

SELECTOR_TREE = tree_module.selector_tree


def scaled_selector_tree(alpha: float):
    """`tree.selector_tree` with the pair scores times `alpha` (a shape variant)."""

    def selector_tree(selector, logits, hidden, anchor, budget):
        cands, table = selector.pair_table(logits, hidden, anchor.reshape(1))
        table = table * alpha
        logp = table - mx.logsumexp(table, axis=-1, keepdims=True)
        return tree_module.build(anchor, logp, cands.astype(mx.int32), budget)

    return selector_tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--draft-block", type=int)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompts-file")
    ap.add_argument("--json", action="store_true", help="also print the table as JSON")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--shapes", default="c4,t4,c8,t8,t16,t32,auto-chain,auto")
    args = ap.parse_args()
    target, draft = (args.target, args.draft) if args.target else demo_pair()
    model, tok = load(str(target))
    pair = Pair(model, load_draft(str(draft)))
    held = args.prompts_file or demo_pair()[0].parent / "heldout_prompts.jsonl"
    prompts = [json.loads(x)["prompt"] for x in open(held)][: args.prompts]

    def options(shape: str) -> GenerateOptions:
        o = GenerateOptions(max_tokens=args.max_tokens, draft_block=args.draft_block)
        if shape == "plain":
            return o.replace(verify_width=1)
        if shape.startswith("auto"):
            return o.replace(tree=None if shape == "auto" else False)
        return o.replace(verify_width=int(shape[1:].split("a")[0]), tree=shape[0] == "t")

    shapes = args.shapes.split(",")
    generate(pair, tok, prompts[0], options("c4").replace(max_tokens=8))  # warm up
    if any(s.startswith("auto") for s in shapes):  # calibrate before timing
        generate(pair, tok, prompts[0], options("auto").replace(max_tokens=8))
    totals = {s: [0, 0, 0.0, True] for s in shapes}  # tokens, cycles, seconds, identical
    for p in prompts:
        want = generate(pair, tok, p, options("plain")).tokens
        for s in shapes:
            alpha = float(s.split("a")[1]) if s[0] == "t" and "a" in s else None
            tree_module.selector_tree = (
                SELECTOR_TREE if alpha is None else scaled_selector_tree(alpha)
            )
            tic = time.perf_counter()
            r = generate(pair, tok, p, options(s))
            t = totals[s]
            t[0] += r.stats.generation_tokens - 1
            t[1] += r.stats.cycles
            t[2] += time.perf_counter() - tic - r.stats.time_to_first_token
            t[3] &= r.tokens == want
    base = totals.get("c8") or next(iter(totals.values()))
    b_tau, b_rate = base[0] / base[1], base[0] / base[2]
    print(f"{'shape':<11}{'tau':>6}{'x c8':>7}{'tok/s':>8}{'x c8':>7}  identical")
    table = {}
    for s, (tokens, cycles, secs, same) in totals.items():
        tau, rate = tokens / cycles, tokens / secs
        print(f"{s:<11}{tau:>6.2f}{tau / b_tau:>7.3f}{rate:>8.1f}{rate / b_rate:>7.3f}  {same}")
        table[s] = {"tau": round(tau, 3), "tok_s": round(rate, 1), "identical": same}
    if args.json:
        print(json.dumps(table))


if __name__ == "__main__":
    main()

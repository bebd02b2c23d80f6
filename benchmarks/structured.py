"""What structured output and sampling controls cost under speculation, on one pair.

For each fixed verify width, the same prompts are decoded greedily:
  - plain: no controls;
  - penalties: presence 0.5, frequency 0.3, a logit bias;
  - schema: a JSON schema, the draft's proposals drawn within the grammar (the default);
  - schema, drafts unmasked: the draft proposes freely, the grammar masks the target only.
It prints tau (tokens per target pass), tok/s, and cycles/s relative to plain: the cost of a
cycle at equal tau, which is what the controls add (mask computation, the row-by-row draft
walk, the processing of each verified row). Ratios are measured in one run, alternating the
variants prompt by prompt so that drift on a loaded machine falls on all of them.

    python benchmarks/structured.py                 # the demo pair, widths 4 and 8
    LD_PRELOAD=.../openblas-pthread/libblas.so.3 python benchmarks/structured.py
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

from dflash_mlx import GenerateOptions, Pair, generate, load, load_draft
from dflash_mlx.demo import demo_pair
from dflash_mlx.engine.controls import compile_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "path": {"type": "string", "maxLength": 40},
        "size": {"type": "integer"},
        "kind": {"enum": ["file", "dir", "link"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "path", "size", "kind", "tags"],
    "additionalProperties": False,
}
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, logit_bias={10: 1.0})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="4,8")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    target, draft = demo_pair()
    model, tok = load(str(target))
    pair = Pair(model, load_draft(str(draft)))
    lines = [json.loads(x)["prompt"] for x in open(target.parent / "heldout_prompts.jsonl")]
    prompts = lines[: args.prompts]
    gen_module = importlib.import_module("dflash_mlx.engine.generate")

    def unmasked(*a):
        return compile_grammar(*a, mask_drafts=False)

    variants = {
        "plain": ({}, compile_grammar),
        "penalties": (PENALTIES, compile_grammar),
        "schema": ({"json_schema": SCHEMA}, compile_grammar),
        "schema, drafts unmasked": ({"json_schema": SCHEMA}, unmasked),
    }
    generate(pair, tok, prompts[0], max_tokens=8, verify_width=4)  # warm up
    print(f"{'W':>2}  {'variant':<24}{'tau':>6}{'tok/s':>8}{'cycles/s':>10}{'vs plain':>10}")
    for w in (int(x) for x in args.widths.split(",")):
        totals = {k: [0, 0, 0.0] for k in variants}  # tokens, cycles, seconds
        for p in prompts:
            for name, (kw, compiler) in variants.items():
                gen_module.compile_grammar = compiler
                o = GenerateOptions(max_tokens=args.max_tokens, verify_width=w, **kw)
                tic = time.perf_counter()
                r = generate(pair, tok, p, o)
                spent = time.perf_counter() - tic - r.stats.time_to_first_token
                t = totals[name]
                t[0] += r.stats.generation_tokens - 1
                t[1] += r.stats.cycles
                t[2] += spent
        gen_module.compile_grammar = compile_grammar
        base = totals["plain"][1] / totals["plain"][2]
        for name, (tokens, cycles, secs) in totals.items():
            rate = cycles / secs
            print(
                f"{w:>2}  {name:<24}{tokens / cycles:>6.2f}{tokens / secs:>8.1f}"
                f"{rate:>10.1f}{rate / base:>10.2f}"
            )


if __name__ == "__main__":
    main()

"""What the seeded rule (`sampling.coupled_accept`: accept drafts equal to the target's
Gumbel-max draw keyed by seed and position) costs in tau against rejection sampling, on the
demo pair's held-out prompts, at a fixed verify width (tau does not depend on the clock).

    python benchmarks/seeded_tau.py [--width 8] [--temps 0.7,1.0] [--prompts 12] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from dflash_mlx import GenerateOptions, generate, load_pair
from dflash_mlx.demo import SHIPPED, demo_pair


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--temps", default="0.7,1.0")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    target, draft = demo_pair()
    pair, tok = load_pair(str(target), str(draft))
    lines = (SHIPPED / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(x)["prompt"] for x in lines[: args.prompts]]
    print(f"demo pair, W={args.width}, {len(prompts)} held-out prompts, {args.tokens} tokens")
    print("temp  rule       mean tau  (per prompt, 3 seeds each)")
    for t in (float(x) for x in args.temps.split(",")):
        for rule in ("rejection", "seeded"):
            taus = []
            for k, p in enumerate(prompts):
                for s in range(3):
                    opts = GenerateOptions(
                        max_tokens=args.tokens, temperature=t, verify_width=args.width
                    )
                    # Rejection sampling: unseeded (the engine draws its own seed).
                    if rule == "seeded":
                        opts = opts.replace(seed=1000 * k + s)
                    taus.append(generate(pair, tok, p, opts).stats.tau)
            print(f"{t:4.1f}  {rule:9s}  {np.mean(taus):8.3f}")


if __name__ == "__main__":
    main()

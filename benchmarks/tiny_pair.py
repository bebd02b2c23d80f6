"""DFlash vs plain mlx-lm greedy decoding on a tiny random pair, measured in one run.

    python benchmarks/tiny_pair.py [--hidden 512 --layers 8 --vocab 320 --tokens 128]

Builds a random Qwen3-style target and a random DFlash draft (`dflash_mlx.models.tiny`), then
alternates, after a warm-up, between:
  * plain   - mlx-lm's own greedy decoding (`mlx_lm.generate.generate_step`);
  * dflash  - `dflash_mlx.generate` with the random draft at each verify width W, the
              draft running its full block (L=16) or only W rows (L=W);
  * bound   - the same engine with a draft whose proposals are read from the target's own
              greedy output (a perfect draft): the ceiling the engine allows, not a result
              a real draft gives.
A random draft is almost never right (tau ~ 1), so its row measures the engine's cost
when speculation fails. Timings on MLX's Linux CPU wheel are compute-bound: read the
ratios, not the absolute numbers, and only within one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_mlx import GenerateOptions, Pair, generate, load, load_draft
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.models.tiny import (
    build_draft,
    build_target,
    draft_config,
    qwen3_config,
    write_tokenizer,
)


class PerfectDraft(DFlashDraft):
    """Proposes the target's own greedy continuation (known in advance)."""

    def __init__(self, base: DFlashDraft, script: list[int]):
        super().__init__(base.config)
        self.update(base.parameters())
        self.script = mx.array(script + [0] * 64)

    def block_logits(self, anchor, length, rows, state):
        rows = length - 1 if rows is None else rows
        pos = state.context_end  # the anchor's position
        want = self.script[pos + 1 : pos + 1 + rows]
        # The real draft pass, so that the cost is a draft's.
        h = self.hidden(mx.concatenate([anchor.reshape(1), want])[None], state)
        onehot = mx.eye(self.config.vocab_size)[want] * 30.0
        return onehot + 0.0 * self.logits(h[0, 1 : rows + 1], state.head).astype(mx.float32)


def plain_greedy(model, ids, n):
    tic = time.perf_counter()
    steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=lambda x: x.argmax(-1))
    first = next(steps)
    t_first = time.perf_counter()
    toks = [int(first[0])] + [int(t) for t, _ in steps]
    return toks, (len(toks) - 1) / (time.perf_counter() - t_first), t_first - tic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--widths", default="2,4,8,16")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    (root / "target").mkdir()
    write_tokenizer(root / "target")
    build_target(root / "target", qwen3_config(args.vocab, args.layers, args.hidden), seed=1)
    ids = [2, args.layers // 2]  # two target layers, as a small z-lab draft would read
    build_draft(root / "draft", draft_config(args.layers, ids, hidden=args.hidden), seed=2)
    model, tok = load(root / "target")
    draft = load_draft(root / "draft")
    prompt = tok.encode("def fibonacci(n):\n    ")
    ref, _, _ = plain_greedy(model, prompt, args.tokens)
    perfect = PerfectDraft(draft, prompt + ref)
    widths = [int(w) for w in args.widths.split(",")]

    pairs = {"dflash": Pair(model, draft), "bound": Pair(model, perfect)}
    configs = []  # (name, pair, options: verify width W, draft block L)
    for w in widths:
        for label, pair in pairs.items():
            for rows in dict.fromkeys((16, w)):
                options = GenerateOptions(max_tokens=args.tokens, verify_width=w, draft_block=rows)
                configs.append((f"{label} W={w} L={rows}", pair, options))
    runs = {"plain": []} | {c[0]: [] for c in configs}
    taus: dict[str, float] = {}
    for rep in range(args.repeats + 1):  # repeat 0 is the warm-up
        toks, tps, _ = plain_greedy(model, prompt, args.tokens)
        assert toks == ref
        if rep:
            runs["plain"].append(tps)
        for name, pair, options in configs:
            out = generate(pair, tok, prompt, options)
            assert out.tokens == ref, f"{name}: output differs from the target's greedy"
            if rep:
                runs[name].append(out.stats.generation_tps)
                taus[name] = out.stats.tau

    base = statistics.median(runs["plain"])
    print(
        f"target: qwen3 hidden={args.hidden} layers={args.layers} vocab={args.vocab}; "
        f"draft: 2 layers, block 16; {args.tokens} tokens; median of {args.repeats} "
        f"after 1 warm-up; device {mx.default_device()}"
    )
    print(f"{'run':<20}{'tok/s':>10}{'spread':>10}{'tau':>7}{'vs plain':>10}")
    for name, vals in runs.items():
        med = statistics.median(vals)
        spread = max(vals) - min(vals)
        tau = taus.get(name, 1.0)
        print(f"{name:<20}{med:>10.1f}{spread:>10.1f}{tau:>7.2f}{med / base:>9.2f}x")
    print("all runs produced the target's greedy tokens exactly")


if __name__ == "__main__":
    main()

"""Structured output against free text on one pair: tau and tok/s, alone and batched.

The same prompts are decoded greedily at one verify width in each variant:
  - free: no constraint (the reference);
  - schema: a JSON schema of fixed keys (a string with maxLength, an enum, an integer, an
    array of short strings);
  - tool call: a forced tool call (the server's envelope, `{"name": ..., "arguments": ...}`
    between call markers, the arguments following the tool's schema);
and the constrained ones in both of the engine's ways of drafting under a grammar: within
the grammar on the host ("walk", the default) and free proposals after the forced run from
the anchor, the masks computed while the verify pass runs ("free"). Forced tokens are
carried as drafts either way (SPEC 6, issue 38). Every constrained reply is checked
against its schema. Alone: one request at a time, variants alternated prompt by prompt (so
drift on a loaded machine falls on all of them). Batched: the prompts 4 at a time
(`batch_generate`, every row the same variant), and a mixed batch (two constrained rows
beside two free ones, each row's own figures). `--trees B`: also trees of B verified
tokens, free and within the grammar (each node masked at its own path, `tree.grammar_tree`).

    python benchmarks/structured.py                 # the demo pair, W = 8
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/structured.py             # the OpenBLAS regime
    python benchmarks/structured.py --pair D --trees 16   # also trees of 16 nodes
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path

from dflash_mlx import GenerateOptions, Pair, batch_generate, generate, load, load_draft
from dflash_mlx.demo import demo_pair
from dflash_mlx.engine.controls import compile_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["file", "dir", "link"]},
        "size": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "kind", "size", "tags"],
    "additionalProperties": False,
}
TOOL = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["city", "unit", "days"],
        "additionalProperties": False,
    },
}
STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# `server.structured.tool_grammar`'s call, with text markers (the demo tokenizer has none).
TOOL_GRAMMAR = (
    'start: "<tool_call>" "\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args "}\\n" '
    '"</tool_call>"\n'
    f"args: %json {json.dumps({**TOOL['parameters'], 'x-guidance': STYLE})}\n"
)


def valid_schema(text: str) -> bool:
    try:
        d = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(d, dict)
        and set(d) == {"name", "kind", "size", "tags"}
        and isinstance(d["name"], str)
        and len(d["name"]) <= 24
        and d["kind"] in ("file", "dir", "link")
        and type(d["size"]) is int
        and isinstance(d["tags"], list)
        and len(d["tags"]) <= 4
        and all(isinstance(t, str) and len(t) <= 12 for t in d["tags"])
    )


def valid_call(text: str) -> bool:
    head, tail = "<tool_call>\n", "\n</tool_call>"
    if not (text.startswith(head) and text.endswith(tail)):
        return False
    try:
        call = json.loads(text[len(head) : -len(tail)])
    except ValueError:
        return False
    a = call.get("arguments")
    return (
        call.get("name") == "get_weather"
        and isinstance(a, dict)
        and set(a) == {"city", "unit", "days"}
        and isinstance(a["city"], str)
        and len(a["city"]) <= 24
        and a["unit"] in ("celsius", "fahrenheit")
        and type(a["days"]) is int
        and 1 <= a["days"] <= 14
    )


CONSTRAINTS = {
    "schema": ({"json_schema": SCHEMA}, valid_schema),
    "tool call": ({"grammar": TOOL_GRAMMAR}, valid_call),
}


def variants(trees: tuple[int, ...] = ()) -> dict[str, tuple[dict, bool, object]]:
    """name -> (options, whether drafts are drawn within the grammar, validator); with
    `trees`, also each budget's tree (free text's and each constraint's, within the grammar:
    `tree.grammar_tree`)."""
    out = {"free": ({}, True, None)}
    for b in trees:
        out[f"free, tree {b}"] = ({"verify_width": b, "tree": True}, True, None)
    for name, (kw, check) in CONSTRAINTS.items():
        out[f"{name}, walk"] = (kw, True, check)
        out[f"{name}, free"] = (kw, False, check)
        for b in trees:
            out[f"{name}, tree {b}"] = ({**kw, "verify_width": b, "tree": True}, True, check)
    return out


def target_alone(pair, tok, prompt: str, opts: GenerateOptions) -> list[int]:
    """The constrained target's own greedy decode, one token at a time, its grammar's mask
    applied to each position's logits (what every constrained reply must equal)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from dflash_mlx.engine.text import encode_prompt

    model = pair.model
    cache = make_prompt_cache(model)
    logits = model(mx.array(encode_prompt(tok, prompt))[None], cache=cache)[0, -1]
    grammar = compile_grammar(opts, tok, logits.shape[-1])
    out = []
    while len(out) < opts.max_tokens:
        row = np.where(grammar.allowed(grammar.mask()), np.array(logits, np.float32), -np.inf)
        out.append(int(np.argmax(row)))
        if out[-1] in grammar.eos:
            break
        grammar.consume(out[-1:])
        logits = model(mx.array([out[-1:]]), cache=cache)[0, -1]
    return out


def load_pair(args):
    """(pair, tokenizer, {constraint: prompts}, what the pair is)."""
    if args.pair is not None:
        target = args.pair / "target"
        draft = args.pair / args.draft
        found = json.loads((args.pair / "prompts.json").read_text())
        prompts = {c: found[c][: args.prompts] for c in CONSTRAINTS}
        what = f"{args.pair} ({draft.name})"
    else:
        target, draft = demo_pair()
        lines = [json.loads(x)["prompt"] for x in open(target.parent / "heldout_prompts.jsonl")]
        prompts = {c: lines[: args.prompts] for c in CONSTRAINTS}
        what = f"demo pair ({draft.name})"
    model, tok = load(str(target))
    return Pair(model, load_draft(str(draft))), tok, prompts, what


def use(masked: bool) -> None:
    """Whether the engine's grammars draw the draft's proposals within the grammar."""
    batch_module = importlib.import_module("dflash_mlx.engine.batch")
    batch_module.compile_grammar = lambda *a: compile_grammar(*a, mask_drafts=masked)


# What `--profile` splits a constrained request's CPU time into: the functions timed (their
# own time, nested timed calls taken out) and the category each counts in.
PROFILED = {
    ("dflash_mlx.engine.controls", "Grammar.mask"): "grammar: masks",
    ("dflash_mlx.engine.controls", "Grammar.forced"): "grammar: forced runs",
    ("dflash_mlx.engine.controls", "Grammar.consume"): "grammar: consume / rollback",
    ("dflash_mlx.engine.controls", "Grammar.rollback"): "grammar: consume / rollback",
    ("dflash_mlx.engine.controls", "Grammar.allowed"): "walk: masks unpacked, rows drawn",
    ("dflash_mlx.engine.walks", "draft_block"): "draft pass + host read of its block",
    ("dflash_mlx.engine.batch_cycle", "grammar_tree"): "grammar tree: built on the host",
    ("dflash_mlx.engine.batch_cycle", "decide"): "verify pass + acceptance (host sync)",
}


def profile(pair, tok, prompts, opts, masked) -> tuple[dict, dict]:
    """CPU seconds (`time.process_time`: every thread of the process, so the device's work
    on this CPU counts where it is waited for) by category over `prompts`, and counts."""
    use(masked)
    spent: dict[str, float] = {}
    counts = {"masks": 0, "verify rows": 0}
    stack: list[list[float]] = []
    undo = []
    for (mod_name, qual), what in PROFILED.items():
        mod = importlib.import_module(mod_name)
        owner, attr = (getattr(mod, qual.split(".")[0]), qual.split(".")[1]) if "." in qual else (
            mod, qual)  # fmt: skip
        real = getattr(owner, attr)

        def timed(*a, _real=real, _what=what, **k):
            stack.append([time.process_time(), 0.0])
            try:
                return _real(*a, **k)
            finally:
                start, inner = stack.pop()
                took = time.process_time() - start
                spent[_what] = spent.get(_what, 0.0) + took - inner
                if stack:
                    stack[-1][1] += took
                if _what == "grammar: masks":
                    counts["masks"] += 1

        setattr(owner, attr, timed)
        undo.append((owner, attr, real))
    total = tokens = cycles = 0
    try:
        for p in prompts:
            tic = time.process_time()
            r = generate(pair, tok, p, opts)
            total += time.process_time() - tic
            tokens += r.stats.generation_tokens - 1
            cycles += r.stats.cycles
            counts["verify rows"] += sum(w * c for w, (c, _) in r.stats.widths.items())
    finally:
        for owner, attr, real in undo:
            setattr(owner, attr, real)
    spent["other (prefill, the cycle's own work)"] = total - sum(spent.values())
    counts.update(tokens=tokens, cycles=cycles, cpu=total)
    return spent, counts


def print_profile(
    pair, tok, prompts, width, max_tokens, constraint="schema", trees: tuple[int, ...] = ()
) -> None:
    kw, _ = CONSTRAINTS[constraint]
    o = GenerateOptions(max_tokens=max_tokens, verify_width=width)
    runs = {
        "free": (o, True),
        f"{constraint[:6]}, walk": (o.replace(**kw), True),
        f"{constraint[:6]}, free": (o.replace(**kw), False),
    }
    for b in trees:
        runs[f"{constraint[:6]}, t{b}"] = (o.replace(**kw, verify_width=b, tree=True), True)
    print(f"\n{constraint}")
    generate(pair, tok, prompts[0], max_tokens=8, verify_width=4)  # warm up
    got = {name: profile(pair, tok, prompts, o, m) for name, (o, m) in runs.items()}
    cats = list(dict.fromkeys(c for spent, _ in got.values() for c in spent))
    print("\nCPU ms per generated token, by where it goes (process CPU time)")
    print(f"{'':<40}" + "".join(f"{n:>14}" for n in got))
    for c in cats:
        row = "".join(
            f"{1000 * spent.get(c, 0.0) / n['tokens']:>14.3f}" for spent, n in got.values()
        )
        print(f"{c:<40}{row}")
    cpu = "".join(f"{1000 * n['cpu'] / n['tokens']:>14.3f}" for _, n in got.values())
    print(f"{'total':<40}{cpu}")
    for key in ("tokens", "cycles", "masks", "verify rows"):
        print(f"{key:<40}" + "".join(f"{n[key]:>14}" for _, n in got.values()))
    print(f"{'tau':<40}" + "".join(f"{n['tokens'] / n['cycles']:>14.2f}" for _, n in got.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--no-batch", action="store_true", help="alone only")
    ap.add_argument(
        "--pair", type=Path, help="a pair built by benchmarks/structured_pair.py (its folder)"
    )
    ap.add_argument(
        "--draft", default="draft", help="--pair's draft folder (draft2: its DFlash 2 draft)"
    )
    ap.add_argument(
        "--profile", action="store_true", help="where a constrained request's CPU time goes"
    )
    ap.add_argument(
        "--trees", default="", help="B[,B...]: also trees of B verified tokens (free and within)"
    )
    args = ap.parse_args()
    pair, tok, prompts, what = load_pair(args)
    regime = "OpenBLAS" if "openblas" in os.environ.get("LD_PRELOAD", "") else "default BLAS"
    n = len(next(iter(prompts.values())))
    print(f"{what}, greedy, W = {args.width}, {n} prompts a constraint, {regime}")
    trees = tuple(int(b) for b in args.trees.split(",") if b)
    if args.profile:
        for c in CONSTRAINTS:
            print_profile(pair, tok, prompts[c], args.width, args.max_tokens, c, trees)
        return

    def options(kw: dict) -> GenerateOptions:
        return GenerateOptions(**{"max_tokens": args.max_tokens, "verify_width": args.width, **kw})

    generate(pair, tok, prompts["schema"][0], max_tokens=8, verify_width=4)  # warm up
    found = variants(trees)
    # Each constraint against free text on its own prompts: (constraint, variant) -> totals.
    totals = {}  # tokens, cycles, seconds, invalid, not the target's own reply
    alone = {}
    for c, ps in prompts.items():
        for p in ps:
            for name, (kw, masked, check) in found.items():
                if not name.startswith(("free", c)):
                    continue
                use(masked)
                tic = time.perf_counter()
                r = generate(pair, tok, p, options(kw))
                spent = time.perf_counter() - tic - r.stats.time_to_first_token
                t = totals.setdefault((c, name), [0, 0, 0.0, 0, 0])
                t[0] += r.stats.generation_tokens - 1
                t[1] += r.stats.cycles
                t[2] += spent
                t[3] += check is not None and not check(r.text)
                if check is not None:  # the constrained target's own reply, token for token
                    want = alone.setdefault((c, p), target_alone(pair, tok, p, options(kw)))
                    t[4] += r.tokens != want
    use(True)
    print(
        f"\nalone\n{'prompts':<11}{'variant':<20}{'tau':>6}{'tok/s':>8}{'vs free':>9}"
        f"{'invalid':>9}{'not target':>12}"
    )
    for (c, name), (tokens, cycles, secs, bad, other) in totals.items():
        free = totals[(c, "free")]
        base = free[0] / free[2]
        print(
            f"{c:<11}{name:<20}{tokens / cycles:>6.2f}{tokens / secs:>8.1f}"
            f"{tokens / secs / base:>9.2f}{bad:>9}{'' if name.startswith('free') else other:>12}"
        )
    if args.no_batch:
        return
    print(
        f"\nbatched, 4 rows a batch\n{'prompts':<11}{'variant':<20}{'tau':>6}{'tok/s':>8}"
        f"{'vs free':>9}{'invalid':>9}"
    )
    for c, ps in prompts.items():
        rates = {}
        for name, (kw, masked, check) in found.items():
            if not name.startswith(("free", c)):
                continue
            use(masked)
            tic = time.perf_counter()
            got = batch_generate(pair, tok, ps, options(kw), max_batch=4)
            secs = time.perf_counter() - tic
            tokens = sum(r.stats.generation_tokens for r in got)
            passes = sum(r.stats.cycles for r in got)
            bad = sum(check is not None and not check(r.text) for r in got)
            rates[name] = tokens / secs
            print(
                f"{c:<11}{name:<20}{(tokens - len(got)) / passes:>6.2f}{rates[name]:>8.1f}"
                f"{rates[name] / rates['free']:>9.2f}{bad:>9}"
            )
    print("\nmixed batch: 2 constrained rows beside 2 free rows (each row's tau)")
    for name, (kw, check) in CONSTRAINTS.items():
        use(True)
        opts = [options(kw), options({}), options(kw), options({})]
        got = batch_generate(pair, tok, prompts[name][:4], opts, max_batch=4)
        taus = " ".join(f"{r.stats.tau:.2f}" for r in got)
        bad = sum(not check(r.text) for r, o in zip(got, opts) if o.constrained)
        print(f"{name:<20} tau per row {taus}   invalid {bad}")
    use(True)


if __name__ == "__main__":
    main()

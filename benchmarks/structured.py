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
beside two free ones, each row's own figures).

    python benchmarks/structured.py                 # the demo pair, W = 8
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/structured.py             # the OpenBLAS regime
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time

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


def variants() -> dict[str, tuple[dict, bool, object]]:
    """name -> (options, whether drafts are drawn within the grammar, validator)."""
    out = {"free": ({}, True, None)}
    for name, (kw, check) in CONSTRAINTS.items():
        out[f"{name}, walk"] = (kw, True, check)
        out[f"{name}, free"] = (kw, False, check)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--no-batch", action="store_true", help="alone only")
    args = ap.parse_args()
    target, draft = demo_pair()
    model, tok = load(str(target))
    pair = Pair(model, load_draft(str(draft)))
    lines = [json.loads(x)["prompt"] for x in open(target.parent / "heldout_prompts.jsonl")]
    prompts = lines[: args.prompts]
    batch_module = importlib.import_module("dflash_mlx.engine.batch")
    regime = "OpenBLAS" if "openblas" in os.environ.get("LD_PRELOAD", "") else "default BLAS"
    print(f"demo pair, greedy, W = {args.width}, {len(prompts)} prompts, {regime}")

    def options(kw: dict) -> GenerateOptions:
        return GenerateOptions(max_tokens=args.max_tokens, verify_width=args.width, **kw)

    def use(masked: bool) -> None:
        batch_module.compile_grammar = lambda *a: compile_grammar(*a, mask_drafts=masked)

    generate(pair, tok, prompts[0], max_tokens=8, verify_width=4)  # warm up
    found = variants()
    totals = {k: [0, 0, 0.0, 0] for k in found}  # tokens, cycles, seconds, invalid
    for p in prompts:
        for name, (kw, masked, check) in found.items():
            use(masked)
            tic = time.perf_counter()
            r = generate(pair, tok, p, options(kw))
            spent = time.perf_counter() - tic - r.stats.time_to_first_token
            t = totals[name]
            t[0] += r.stats.generation_tokens - 1
            t[1] += r.stats.cycles
            t[2] += spent
            t[3] += check is not None and not check(r.text)
    use(True)
    print(f"\nalone\n{'variant':<18}{'tau':>6}{'tok/s':>8}{'vs free':>9}{'invalid':>9}")
    base = totals["free"][0] / totals["free"][2]
    for name, (tokens, cycles, secs, bad) in totals.items():
        print(
            f"{name:<18}{tokens / cycles:>6.2f}{tokens / secs:>8.1f}"
            f"{tokens / secs / base:>9.2f}{bad:>9}"
        )
    if args.no_batch:
        return
    print(
        f"\nbatched, 4 rows a batch\n{'variant':<18}{'tau':>6}{'tok/s':>8}{'vs free':>9}"
        f"{'invalid':>9}"
    )
    rates = {}
    for name, (kw, masked, check) in found.items():
        use(masked)
        tic = time.perf_counter()
        got = batch_generate(pair, tok, prompts, options(kw), max_batch=4)
        secs = time.perf_counter() - tic
        tokens = sum(r.stats.generation_tokens for r in got)
        passes = sum(r.stats.cycles for r in got)
        bad = sum(check is not None and not check(r.text) for r in got)
        rates[name] = tokens / secs
        print(
            f"{name:<18}{(tokens - len(got)) / passes:>6.2f}{rates[name]:>8.1f}"
            f"{rates[name] / rates['free']:>9.2f}{bad:>9}"
        )
    print("\nmixed batch: 2 constrained rows beside 2 free rows (each row's tau)")
    for name, (kw, check) in CONSTRAINTS.items():
        use(True)
        opts = [options(kw), options({}), options(kw), options({})]
        got = batch_generate(pair, tok, prompts[:4], opts, max_batch=4)
        taus = " ".join(f"{r.stats.tau:.2f}" for r in got)
        bad = sum(not check(r.text) for r, o in zip(got, opts) if o.constrained)
        print(f"{name:<18} tau per row {taus}   invalid {bad}")
    use(True)


if __name__ == "__main__":
    main()

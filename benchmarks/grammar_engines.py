"""Grammar engines for constrained (JSON) decoding: llguidance vs xgrammar.

What it measures, on one tokenizer (meant to be a ~150k-token vocabulary):

* tokenizer init  -- building the engine's token trie/info from the HF tokenizer;
* compile ms      -- JSON-schema (or "any JSON") grammar to a ready matcher
                     (median of 3, cache off);
* 1st mask ms     -- the first mask after compiling (lazy work lands there);
* mask ms/token   -- median / p90 / max of one next-token bitmask computation
                     while walking a valid JSON document token by token
                     (mask, check the next token is allowed, consume it; EOS last;
                     5 walks, each from a fresh matcher);
* rollback ms     -- consume 8 tokens then roll back 8 (the rollback alone),
                     median over positions along the document;
* draft-8 ms      -- the masks a speculative verify step needs for a block of
                     8 draft tokens (9 masks: current + after each draft token),
                     done sequentially (mask, consume, ..., rollback 8); for
                     llguidance also with fill_next_token_bitmask_par_with_draft_tokens.

Two grammars: a realistic schema (strings, integer, enum, arrays, a nested
object, additionalProperties false) and json_object, "any JSON" (llguidance:
schema {"type": "object"}; xgrammar: its built-in JSON grammar).

The tokenizer: --build-tokenizer trains a byte-level BPE (151,000 tokens by
default) on the installed Python source, stdlib first, up to 150 MB (about a
minute); where that text is too little for the size, word bigrams fill it up.

Run (pin to one core). xgrammar needs torch, so it lives in its own venv:
`python -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install --no-deps
xgrammar && V/bin/pip install transformers tokenizers numpy apache-tvm-ffi pydantic`
(triton, a GPU-only dependency, is left out; xgrammar runs on the CPU without it).

    taskset -c 0 python benchmarks/grammar_engines.py --build-tokenizer /tmp/tok150k
    taskset -c 0 python benchmarks/grammar_engines.py /tmp/tok150k \
        [--xgrammar-python /path/to/xgrammar-venv/bin/python]

llguidance runs in this interpreter; with --xgrammar-python the same script is
re-run there with --engine xgrammar --json and its rows join one table.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import re
import statistics
import subprocess
import sysconfig
import time

STR, INT = {"type": "string"}, {"type": "integer"}
ADDRESS = {"street": STR, "city": STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
FIELDS = {"id": INT, "name": STR, "status": {"enum": ["active", "inactive", "pending"]}}
FIELDS |= {"tags": {"type": "array", "items": STR}, "scores": {"type": "array", "items": INT}}
FIELDS |= {"address": {"type": "object", "properties": ADDRESS}, "notes": STR}
SCHEMA = {"type": "object", "properties": FIELDS}
for obj in (FIELDS["address"], SCHEMA):  # every field required, nothing else allowed
    obj |= {"required": list(obj["properties"]), "additionalProperties": False}
VALUES = {"id": 48213, "name": "Speculative decoding benchmark user", "status": "pending"}
VALUES |= {"tags": ["mlx", "dflash", "json", "constrained-decoding"], "scores": [97, 4500, 3]}
VALUES |= {"address": {"street": "1 Infinite Loop, Bldg 4", "city": "Cupertino", "zip": "95014"}}
VALUES["notes"] = (
    "The drafter proposes a block of tokens; the target verifies them in one forward pass. "
    "Grammar masks must keep up: a 150k-token vocabulary, every token."
)
DOC = json.dumps(VALUES)  # keys in schema order (llguidance keeps that order)
GRAMMARS = ("schema", "json_object")
EOS = "<|endoftext|>"


def timed(fn):
    """(milliseconds, result) of one call of fn()."""
    t = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t) * 1e3, out


# ---------------------------------------------------------------- tokenizer
def build_tokenizer(out_dir, vocab_size, max_bytes=150e6):
    """Byte-level BPE trained on installed Python source, padded with word bigrams."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = sysconfig.get_paths()["stdlib"]
    texts, size = [], 0  # the stdlib first, then installed packages
    for f in sorted(
        glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True),
        key=lambda f: ("site-packages" in f, f),
    ):
        texts.append(open(f, encoding="utf-8", errors="ignore").read())
        size += len(texts[-1])
        if size > max_bytes:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], initial_alphabet=alphabet
    )
    tok.train_from_iterator(texts, trainer)
    trained = tok.get_vocab_size()
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    # Too little text for the size: pad with word bigrams (in the vocabulary, made by no merge).
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    words = (w for t in texts for w in re.findall(r"[A-Za-z_]{3,}", t))
    for a, b in itertools.pairwise(words):
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(to_bytes.pre_tokenize_str(f" {a} {b}")[0][0], len(vocab))
    tok = Tokenizer.from_str(json.dumps(data))
    os.makedirs(out_dir, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(out_dir)
    print(f"saved {out_dir}: {tok.get_vocab_size()} tokens ({trained} trained by BPE)")


# ---------------------------------------------------------------- engines
class Engine:
    """compile(kind), then fill() the 1-row bitmask, consume(token), rollback(k)."""

    draft_par = None  # or: drafts -> a call computing 1 + len(drafts) masks at once

    def allowed(self, t):
        return (int(self.mask[0, t >> 5]) >> (t & 31)) & 1


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, hf):
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lnp

        self.ll, self.lnp, self.n = llguidance, lnp, len(hf)
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=self.n)
        self.mask = lnp.allocate_token_bitmask(1, self.n)
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, kind):
        m = self.ll.LLMatcher
        g = m.grammar_from_json_schema(SCHEMA if kind == "schema" else {"type": "object"})
        self.m = m(self.tok, g)
        assert not self.m.is_error(), self.m.get_error()

    def fill(self):
        self.lnp.fill_next_token_bitmask(self.m, self.mask)

    def consume(self, t):
        assert self.m.consume_token(t), self.m.get_error()

    def rollback(self, k):
        self.m.rollback(k)

    def draft_par(self, drafts):  # 1 + len(drafts) masks in one native call
        masks = self.lnp.allocate_token_bitmask(len(drafts) + 1, self.n)
        return lambda: self.lnp.fill_next_token_bitmask_par_with_draft_tokens(
            self.executor, [(self.m, 0, drafts)], masks
        )


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, hf):
        import xgrammar as xgr

        self.xgr, self.n = xgr, len(hf)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.n)
        self.mask = xgr.allocate_token_bitmask(1, self.n)

    def compile(self, kind):
        c = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        schema = kind == "schema"
        g = (
            c.compile_json_schema(json.dumps(SCHEMA))
            if schema
            else c.compile_builtin_json_grammar()
        )
        self.m = self.xgr.GrammarMatcher(g)

    def fill(self):
        self.m.fill_next_token_bitmask(self.mask)

    def consume(self, t):
        assert self.m.accept_token(t)

    def rollback(self, k):
        self.m.rollback(k)


def draft_sequential(eng, drafts):
    """The 1 + len(drafts) masks of a verify step, one by one, then back to the start."""
    eng.fill()
    for t in drafts:
        eng.consume(t)
        eng.fill()
    eng.rollback(len(drafts))


def measure(engine_cls, tok_dir, walks=5):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    init_ms, eng = timed(lambda: engine_cls(hf))
    toks = hf.encode(DOC, add_special_tokens=False) + [hf.eos_token_id]
    rows = []
    for kind in GRAMMARS:
        compile_ms = statistics.median(timed(lambda k=kind: eng.compile(k))[0] for _ in range(3))
        masks, first = [], []
        for _ in range(walks):  # the walk: mask, check, consume
            eng.compile(kind)
            for t in toks:
                masks.append(timed(eng.fill)[0])
                assert eng.allowed(t), f"{eng.name}/{kind}: token {t} {hf.decode([t])!r} masked"
                eng.consume(t)
            first.append(masks[-len(toks)])
        rb, seq, par = [], [], []
        for start in range(0, len(toks) - 9, 8):
            eng.compile(kind)
            for t in toks[:start]:
                eng.consume(t)
            drafts = toks[start : start + 8]
            for t in drafts:
                eng.consume(t)
            rb.append(timed(lambda: eng.rollback(8))[0])

            seq.append(timed(lambda d=drafts: draft_sequential(eng, d))[0])
            if eng.draft_par:
                par.append(timed(eng.draft_par(drafts))[0])
        med = statistics.median
        row = dict(engine=eng.name, grammar=kind, vocab=eng.n, tokens=len(toks), init_ms=init_ms)
        row |= dict(
            compile_ms=compile_ms, first_mask=med(first), mask_med=med(masks), mask_max=max(masks)
        )
        row |= dict(mask_p90=statistics.quantiles(masks, n=10)[-1], rollback8=med(rb))
        row |= dict(draft8_seq=med(seq), draft8_par=med(par) if par else None)
        rows.append(row)
    return rows


COLUMNS = """engine:engine:{} grammar:grammar:{} vocab:vocab:{} tokens:doc_tok:{}
init_ms:tok_init_ms:{:.0f} compile_ms:compile_ms:{:.1f} first_mask:1st_mask_ms:{:.2f}
mask_med:mask_med_ms:{:.3f} mask_p90:mask_p90_ms:{:.3f} mask_max:mask_max_ms:{:.3f}
rollback8:rollback_8_ms:{:.4f} draft8_seq:draft8_seq_ms:{:.3f} draft8_par:draft8_par_ms:{:.3f}"""


def table(rows):
    cols = [c.split(":", 2) for c in COLUMNS.split()]
    cells = [[h.replace("_", " ") for _, h, _ in cols]] + [
        ["-" if r[k] is None else f.format(r[k]) for k, _, f in cols] for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tokenizer", nargs="?", help="tokenizer directory (save_pretrained)")
    ap.add_argument("--build-tokenizer", metavar="DIR", help="train a BPE tokenizer into DIR")
    ap.add_argument("--vocab-size", type=int, default=151_000)
    ap.add_argument("--engine", choices=["llguidance", "xgrammar"], default="llguidance")
    ap.add_argument("--xgrammar-python", help="python with xgrammar; adds its rows")
    ap.add_argument("--json", action="store_true", help="print rows as JSON")
    a = ap.parse_args()
    if a.build_tokenizer:
        return build_tokenizer(a.build_tokenizer, a.vocab_size)
    if not a.tokenizer:
        ap.error("tokenizer directory required")
    rows = measure(LLGuidance if a.engine == "llguidance" else XGrammar, a.tokenizer)
    if a.xgrammar_python:
        cmd = [a.xgrammar_python, os.path.abspath(__file__), a.tokenizer, "--engine", "xgrammar"]
        out = subprocess.run([*cmd, "--json"], check=True, capture_output=True, text=True).stdout
        rows += json.loads(out.strip().splitlines()[-1])
    print(json.dumps(rows) if a.json else table(rows))


if __name__ == "__main__":
    main()

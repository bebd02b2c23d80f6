"""benchmarks/grammar_engines.py on a small tokenizer: llguidance walks the JSON documents,
and its one-call draft masks equal the masks computed one token at a time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "grammar_engines.py"


@pytest.fixture(scope="module")
def ge():
    spec = importlib.util.spec_from_file_location("grammar_engines", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok_dir(ge, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    # 1 MB of stdlib source trains fewer merges than 12,000: the rest are word bigrams.
    ge.build_tokenizer(str(out), 12_000, max_bytes=1e6)
    return str(out)


def test_tokenizer_size_and_document(ge, tok_dir):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    assert len(hf) == 12_000 and hf.eos_token == ge.EOS
    assert hf.decode(hf.encode(ge.DOC, add_special_tokens=False)) == ge.DOC


def test_llguidance_rows(ge, tok_dir):
    rows = ge.measure(ge.LLGuidance, tok_dir, walks=1)
    assert [r["grammar"] for r in rows] == list(ge.GRAMMARS)
    for r in rows:
        assert r["vocab"] == 12_000 and r["tokens"] > 20
        assert 0 < r["mask_med"] <= r["mask_p90"] <= r["mask_max"]
        assert r["draft8_par"] is not None
    table = ge.table(rows)
    assert "mask med ms" in table and "llguidance" in table


def test_draft_par_masks_equal_sequential(ge, tok_dir):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    eng = ge.LLGuidance(hf)
    toks = hf.encode(ge.DOC, add_special_tokens=False)
    eng.compile("schema")
    for t in toks[:5]:
        eng.consume(t)
    drafts = toks[5:13]
    seq = []
    eng.fill()
    seq.append(eng.mask[0].copy())
    for t in drafts:
        eng.consume(t)
        eng.fill()
        seq.append(eng.mask[0].copy())
    eng.rollback(len(drafts))
    masks = eng.lnp.allocate_token_bitmask(len(drafts) + 1, eng.n)
    eng.lnp.fill_next_token_bitmask_par_with_draft_tokens(eng.executor, [(eng.m, 0, drafts)], masks)
    assert np.array_equal(masks, np.stack(seq))
    eng.consume(drafts[0])  # the one-call masks left the matcher where it was

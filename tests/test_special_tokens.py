"""Special tokens (`<|im_start|>`, `<|endoftext|>`, ...) never reach a reply's text, though a
sampled reply may contain them: alone and batched (the server's path), streamed or whole."""

from __future__ import annotations

import dflash_mlx
from dflash_mlx.engine.text import special_token_ids
from dflash_mlx.models.tiny import SPECIAL

PROMPT = "def add(a, b):"


def specials(tok) -> dict[int, str]:
    return {tok.convert_tokens_to_ids(s): s for s in SPECIAL}


def test_the_tokenizers_special_tokens_are_known(target):
    _, tok = target
    assert special_token_ids(tok) == frozenset(specials(tok))


def test_a_hundred_sampled_replies_hold_no_special_token_in_their_text(pair, target):
    _, tok = target
    ids = specials(tok)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    # Special tokens made likely (not the eos, which ends the reply): sampled, they land
    # inside the replies, as a model running past its turn writes them. A hundred requests
    # decoded together (each seeded on its own, the server's path), then a few alone,
    # streamed.
    bias = {i: 4.0 for i in ids if i != eos}
    opts = dflash_mlx.GenerateOptions(
        max_tokens=8, temperature=1.0, seed=0, logit_bias=bias, verify_width=4
    )
    results = dflash_mlx.batch_generate(pair, tok, [PROMPT] * 100, opts.replace(max_tokens=6))
    assert sum(t in ids for r in results for t in r.tokens) > 20, "special tokens sampled"
    for r in results:
        assert not any(s in r.text for s in SPECIAL), r.text
    for seed in range(3):
        alone = opts.replace(seed=seed)
        streamed = "".join(r.text for r in dflash_mlx.stream_generate(pair, tok, PROMPT, alone))
        assert not any(s in streamed for s in SPECIAL), (seed, streamed)

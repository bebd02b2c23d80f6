"""bstnxbt's dflash-mlx against mlx-lm's greedy decoding, run by that package's own Python.

    PEER_PYTHON benchmarks/peer_dflash_mlx.py TARGET DRAFT PROMPTS.json TOKENS

Not run by hand: `long_context.py --peer PEER_PYTHON` starts it. bstnxbt's package is also
named `dflash_mlx`, so it lives in a venv of its own:

    python -m venv --system-site-packages /tmp/peer
    /tmp/peer/bin/pip install --no-deps dflash-mlx==0.1.8

It runs with its defaults (adaptive verify, a draft cache of 64 sink positions and a
1024-position window) on token ids, after a warm-up, and prints one JSON line a prompt:
its context, decode tok/s of mlx-lm's `generate_step` and of the peer (tokens after the
first), its tokens per cycle (τ), and whether its tokens equal mlx-lm's.
"""

from __future__ import annotations

import json
import sys
import time

from long_context import greedy_mlx_lm  # this folder's (stdlib imports only at its top)


def main() -> None:
    target, draft, prompts_file, tokens = sys.argv[1:5]
    n = int(tokens)
    from dflash_mlx.engine.events import TokenEvent
    from dflash_mlx.runtime import stream_dflash_generate
    from dflash_mlx.runtime.bundle import load_runtime_bundle
    from dflash_mlx.runtime.context import build_offline_runtime_context

    ctx = build_offline_runtime_context()
    b = load_runtime_bundle(model_ref=target, draft_ref=draft, verify_config=ctx.verify)

    def peer(ids: list[int], k: int) -> tuple[float, list[int], float]:
        out, first, cycles = [], 0.0, 0
        events = stream_dflash_generate(
            target_model=b.target_model,
            target_ops=b.target_ops,
            tokenizer=b.tokenizer,
            draft_model=b.draft_model,
            draft_backend=b.draft_backend,
            prompt="",
            prompt_tokens_override=ids,
            max_new_tokens=k,
            use_chat_template=False,
            stop_token_ids=[],
            runtime_context=ctx,
        )
        for ev in events:
            if isinstance(ev, TokenEvent):
                if not out:
                    first = time.perf_counter()
                out.append(int(ev.token_id))
                cycles = int(ev.cycles_completed)
        tau = (len(out) - 1) / cycles if cycles else 1.0  # its first token is the prefill's
        return (len(out) - 1) / (time.perf_counter() - first), out, tau

    prompts = json.loads(open(prompts_file).read())
    warm = next(iter(prompts.values()))[0][:256]
    greedy_mlx_lm(b.target_model, warm, 16)
    peer(warm, 16)
    for context, lists in prompts.items():
        for ids in lists:
            base, ref = greedy_mlx_lm(b.target_model, ids, n)
            tps, out, tau = peer(ids, n)
            row = {
                "context": int(context),
                "mlx_lm": base,
                "peer": tps,
                "tau": tau,
                "same": out[:n] == ref,
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

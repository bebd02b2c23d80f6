"""One rank's part in tests/test_distributed.py (run by `mlx.launch`, or alone for the
one-process reference): decode a prompt with the library and write what this rank saw to
OUT/rank{N}.json, so that the silent ranks' tokens can be compared too.

    python distributed_rank.py dflash|mlx-lm TARGET DRAFT OUT SETTINGS_JSON [SHARD]

`dflash`: `dflash_mlx.generate` on this rank's shard of TARGET (SHARD, default tensor, when
launched; the whole target alone) with DRAFT; `mlx-lm`: mlx-lm's own greedy decode of the
same (sharded) target; `features`: the target's captured features on the prompt.
SETTINGS_JSON: GenerateOptions fields, plus "prompt".
"""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
from pathlib import Path


def main() -> None:
    mode, target, draft, out, settings = sys.argv[1:6]
    shard = sys.argv[6] if len(sys.argv) > 6 else "tensor"
    settings = json.loads(settings)
    prompt = settings.pop("prompt")

    import dflash_mlx
    from dflash_mlx import distributed
    from dflash_mlx.models.loading import load_sharded

    cluster = distributed.start(shard if distributed.launched() else "none")
    if cluster is not None:
        model, tokenizer = load_sharded(target, shard, cluster.group)
    else:
        model, tokenizer = dflash_mlx.load(target)
    ids = tokenizer.encode(prompt)
    rank = cluster.rank if cluster is not None else 0
    if mode == "features":  # the draft's input: the captured layers' outputs on the prompt
        import mlx.core as mx

        pair = dflash_mlx.Pair(model, dflash_mlx.load_draft(draft))
        ids_ = pair.draft.config.target_layer_ids
        _, feats = pair.target.forward(mx.array([ids]), pair.target.make_cache(), ids_)
        record = {"features": feats.astype(mx.float32).tolist()}
    elif mode == "mlx-lm":
        from mlx_lm import stream_generate

        tokens = [
            r.token
            for r in stream_generate(model, tokenizer, ids, max_tokens=settings["max_tokens"])
        ]
        record = {"tokens": tokens}
    else:
        pair = dflash_mlx.Pair(model, dflash_mlx.load_draft(draft))
        distributed.lockstep_calibration(pair)
        result = dflash_mlx.generate(pair, tokenizer, ids, dflash_mlx.GenerateOptions(**settings))
        s = result.stats
        record = {"tokens": result.tokens, "tau": s.tau, "cycles": s.cycles, "ran": s.what_ran()}
        # The calibration every rank decoded with (rank 0's, across ranks): its curves' digest.
        curves = getattr(pair.calibration, "latest", None)
        record["calibration"] = (
            None if curves is None else hashlib.sha256(pickle.dumps(curves)).hexdigest()
        )
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    distributed.finish(0)


if __name__ == "__main__":
    main()

"""Pipeline shards: the layers a rank holds, the features it shares (SPEC 10, item 5)."""

from __future__ import annotations

from typing import Any


def pipeline_span(backbone: Any, args: Any, layers: list) -> tuple[int | None, list, int]:
    """`(first layer, this rank's layers, the model's layer count)` of a target whose
    backbone mlx-lm split into a pipeline (`model.model.pipeline`: each rank holds a run of
    the layers, rank 0 the last ones); `(None, layers, len(layers))` otherwise."""
    if getattr(backbone, "pipeline_size", 1) <= 1:
        return None, layers, len(layers)
    own = list(backbone.pipeline_layers)
    total = getattr(args, "num_hidden_layers", None)
    if not isinstance(total, int):
        import mlx.core as mx

        total = int(mx.distributed.all_sum(mx.array(len(own)), stream=mx.cpu).item())
    return int(backbone.start_idx), own, total


def pipeline_features(outputs: dict, capture_ids: list[int], target: Any, logits: Any):
    """`(logits, features)` of a pass on a pipeline rank: the captured layers' outputs
    `(B, n, len(capture_ids) * D)`, each layer's rows from the rank that holds it and zeros
    from the others, summed over the ranks in one collective (SPEC 10, item 5). The sum
    follows the pass's own collectives (its input depends on the logits) and the logits
    returned depend on it: every rank makes them in one order whenever the logits are
    evaluated, never one rank the sum of an earlier pass while another waits on this one's."""
    import mlx.core as mx

    b, n = logits.shape[:2]
    zeros = None
    parts = []
    for g in capture_ids:
        out = outputs.get(g - target.first_layer)
        if out is None:
            if zeros is None:
                zeros = mx.zeros((b, n, target.hidden_size), dtype=logits.dtype)
            out = zeros
        parts.append(out.astype(logits.dtype))
    local = mx.depends([mx.concatenate(parts, axis=-1)], [logits])[0]
    feats = mx.distributed.all_sum(local)
    return mx.depends([logits], [feats])[0], feats

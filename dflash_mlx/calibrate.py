"""Measured cost curves of a target/draft pair on the running device (SPEC 5.4).

Times the target's verify pass at widths 1..block and the draft's pass at blocks 1..block,
after a warm-up, and caches the curves per (device, model pair, mlx version) under the user
cache directory (`$DFLASH_MLX_CACHE`, else `$XDG_CACHE_HOME/dflash-mlx`, else
`~/.cache/dflash-mlx`). Knows nothing about acceptance or decoding policy.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten

from .adaptive import CostCurves
from .draft import DFlashDraft
from .loading import bind_draft
from .paths import cache_dir
from .sampling import SamplingParams
from .target import TargetAdapter

CONTEXT = 128  # tokens of context the passes are timed at


def device_description() -> str:
    dev = mx.default_device()
    desc = f"{dev.type}"
    if mx.metal.is_available():
        info = mx.metal.device_info()
        desc += f" {info.get('architecture', '')} {info.get('memory_size', '')}"
    return f"{desc} {platform.system()} {platform.machine()} {os.cpu_count()} cpus"


def _fingerprint(module: nn.Module, extra: dict) -> dict:
    params = tree_flatten(module.parameters())
    return {
        **extra,
        "params": sum(v.size for _, v in params),
        "bytes": sum(v.nbytes for _, v in params),
        "dtypes": sorted({str(v.dtype) for _, v in params}),
    }


def calibration_key(model: nn.Module, draft: DFlashDraft) -> dict:
    t = TargetAdapter.of(model)
    quant = getattr(getattr(model, "args", None), "quantization", None)
    return {
        "device": device_description(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "target": _fingerprint(
            model, {"type": t.model_type, "layers": t.num_layers, "quantization": quant}
        ),
        "draft": _fingerprint(draft, {"config": repr(draft.config)}),
    }


def cache_path(model: nn.Module, draft: DFlashDraft) -> Path:
    """Where this pair's curves for this device and mlx version are cached."""
    return _cache_path(calibration_key(model, draft))


def _cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "calibration" / f"{digest}.json"


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def measure(
    model: nn.Module,
    draft: DFlashDraft,
    *,
    repeats: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> CostCurves:
    """Time verify passes of 1..block tokens and draft passes of 1..block rows."""
    bind_draft(draft, model)
    target = TargetAdapter.of(model)
    block = draft.config.block_size
    ids = draft.config.target_layer_ids
    cache = target.make_cache()
    prompt = mx.random.randint(0, draft.config.vocab_size, (1, CONTEXT), key=mx.random.key(0))
    _, feats = target.forward(prompt, cache, ids)
    draft.reset()
    draft.add_context(feats)
    mx.eval([c.state for c in cache], draft.state)
    anchor = mx.array([1], dtype=mx.int32)
    greedy = SamplingParams()
    steps, done = 2 * block, 0

    def verify(w: int) -> None:
        saved = target.snapshot(cache)
        logits, f = target.forward(mx.zeros((1, w), dtype=mx.int32), cache, ids)
        mx.eval(logits, f)
        target.rewind(cache, keep=0, total=w, snapshot=saved)

    def drafting(n: int) -> None:
        tokens, _ = draft.propose(anchor, n, n - 1, greedy, mx.random.key(0))
        mx.eval(tokens)
        draft.commit(None)

    def plain(chain: int = 8) -> None:
        # Plain decoding as the engine runs it: each step chained on the device token,
        # never waiting for the host (its cost per step is the time of `chain` steps / chain).
        saved = target.snapshot(cache)
        y = anchor[None]
        for _ in range(chain):
            logits, _ = target.forward(y, cache, None)
            y = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)
            mx.async_eval(y)
        mx.eval(y)
        target.rewind(cache, keep=0, total=chain, snapshot=saved)

    verify_t, draft_t = [_median_time(plain, repeats) / 8], [0.0]
    for w in range(2, block + 1):
        verify_t.append(_median_time(lambda w=w: verify(w), repeats))
        done += 1
        if progress is not None:
            progress(done, steps)
    fixed = draft.config.is_dflash2  # drafts its whole block whatever W is
    for n in range(2, block + 1):
        length = block if fixed else n
        draft_t.append(_median_time(lambda n=length: drafting(n), repeats))
        done += 1
        if progress is not None:
            progress(done, steps)
    draft.reset()
    return CostCurves(tuple(verify_t), tuple(draft_t))


def load_or_measure(
    model: nn.Module,
    draft: DFlashDraft,
    *,
    refresh: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> CostCurves:
    """Cached curves for this pair on this device and mlx version, measured when missing."""
    bind_draft(draft, model)
    # Remembered on the draft for this process, so a request costs no fingerprinting.
    known = draft.__dict__.setdefault("_dflash_cost_curves", {})
    memo = (id(model), mx.__version__)
    if not refresh and memo in known:
        return known[memo]
    key = calibration_key(model, draft)
    path = _cache_path(key)
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                curves = CostCurves(tuple(data["verify"]), tuple(data["draft"]))
                known[memo] = curves
                return curves
        except (ValueError, KeyError, TypeError):
            pass  # unreadable cache: measure again
    curves = measure(model, draft, progress=progress)
    known[memo] = curves
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "key": key,
                "verify": list(curves.verify),
                "draft": list(curves.draft),
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            },
            indent=1,
        )
    )
    return curves

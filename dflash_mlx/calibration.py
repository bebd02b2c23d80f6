"""Measured cost curves of a target/draft pair on the running device (SPEC 5.4).

Times the target's verify pass at widths 1..block and the draft's pass at blocks 1..block,
after a warm-up, at a few context depths (`DEPTHS`, within the model's context), and caches
the curves per (device, model pair, mlx version, conditions) under the user cache directory
(`$DFLASH_MLX_CACHE`, else `$XDG_CACHE_HOME/dflash-mlx`, else `~/.cache/dflash-mlx`). The
conditions are what the speed depends on beyond the device: the BLAS library loaded in this
process, and on macOS the power source (Low Power Mode follows it); when they change, the
pair is calibrated again. `Calibration` is a `Pair`'s: it remembers the curves it read for
this process and follows the file when another process re-writes it. Knows nothing about
acceptance or decoding policy.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten

from .engine.batch_cache import keep
from .engine.sampling import SamplingParams, propose
from .paths import cache_dir
from .speed.costs import CostCurves
from .sysinfo import conditions, device_description

if TYPE_CHECKING:
    from .pair import Pair

CONTEXT = 128  # tokens of context the shallowest passes are timed at
DEPTHS = (CONTEXT, 2048, 8192)  # context depths calibrated (those within the model's context)


def _fingerprint(module: nn.Module, extra: dict) -> dict:
    params = tree_flatten(module.parameters())
    return {
        **extra,
        "params": sum(v.size for _, v in params),
        "bytes": sum(v.nbytes for _, v in params),
        "dtypes": sorted({str(v.dtype) for _, v in params}),
    }


def calibration_key(pair: Pair) -> dict:
    model, draft, t = pair.model, pair.draft, pair.target
    quant = getattr(getattr(model, "args", None), "quantization", None)
    return {
        "device": device_description(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "target": _fingerprint(
            model, {"type": t.model_type, "layers": t.num_layers, "quantization": quant}
        ),
        "draft": _fingerprint(draft, {"config": repr(draft.config)}),
        "conditions": conditions(),
    }


def cache_path(pair: Pair) -> Path:
    """Where this pair's curves for this device and mlx version are cached."""
    return _cache_path(calibration_key(pair))


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
    pair: Pair,
    *,
    repeats: int = 3,
    depths: tuple[int, ...] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> CostCurves:
    """Time verify passes of 1..block tokens and draft passes of 1..block rows, at each of
    `depths` tokens of context (default: `DEPTHS` within the model's context), the draft's
    projection of context rows and the target's deferred features (per row)."""
    target, draft = pair.target, pair.draft
    block = draft.config.block_size
    ids = draft.config.target_layer_ids
    depths = depths or calibration_depths(pair)
    cache = target.make_cache()
    prompt = mx.random.randint(0, draft.config.vocab_size, (1, depths[-1]), key=mx.random.key(0))
    _, feats = target.forward(prompt[:, : depths[0]], cache, ids)
    state = pair.draft_state()
    draft.add_context(feats, state)
    mx.eval([c.state for c in cache], state.arrays)
    anchor = mx.array([1], dtype=mx.int32)
    greedy = SamplingParams()
    steps, done = 2 * block * len(depths), 0

    def verify(w: int) -> None:
        saved = target.snapshot(cache)
        logits, f = target.forward(mx.zeros((1, w), dtype=mx.int32), cache, ids)
        mx.eval(logits, f)
        keep(target, cache, [0], w, (saved, {}))

    def drafting(n: int) -> None:
        tokens, _ = propose(draft, state, anchor, n, n - 1, greedy, None)
        mx.eval(tokens)
        state.commit(None)

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
        keep(target, cache, [0], chain, (saved, {}))

    def curves() -> tuple[tuple[float, ...], tuple[float, ...]]:
        nonlocal done
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
        return tuple(verify_t), tuple(draft_t)

    def context(rows: mx.array) -> None:
        # The draft projecting positions of target features into a fresh context.
        fresh = pair.draft_state()
        draft.add_context(rows, fresh)
        mx.eval(fresh.arrays)

    sample = feats[:, :64]
    per_row = _median_time(lambda: context(sample), repeats) / sample.shape[1]

    def deferred(rows: int = 64) -> float:
        # A dormant prefill's window: the caches evaluated, the captured features later.
        saved = target.snapshot(cache)
        _, f = target.forward(mx.zeros((1, rows), dtype=mx.int32), cache, ids)
        mx.eval([c.state for c in cache])
        tic = time.perf_counter()
        mx.eval(f)
        spent = time.perf_counter() - tic
        keep(target, cache, [0], rows, (saved, {}))
        return spent / rows

    deferred()  # warm-up
    lazy = statistics.median(deferred() for _ in range(repeats))
    tables = [curves()]
    for lo, hi in zip(depths, depths[1:]):
        for start in range(lo, hi, 512):  # deepen the context, in prefill-sized chunks
            _, feats = target.forward(prompt[:, start : min(start + 512, hi)], cache, ids)
            draft.add_context(feats, state)
            mx.eval([c.state for c in cache], state.arrays)
            if progress is not None:  # no step done, but a caller may stop here too
                progress(done, steps)
        tables.append(curves())
    (verify_t, draft_t), *deeper = tables
    return CostCurves(
        verify_t,
        draft_t,
        depths=tuple(depths),
        deeper=tuple(deeper),
        context=per_row,
        lazy=lazy,
    )


def calibration_depths(pair: Pair) -> tuple[int, ...]:
    """The depths of `DEPTHS` a block still fits after, within the target's and the draft's
    context."""
    block = pair.draft.config.block_size
    limits = [pair.context_limit, pair.draft.config.max_position_embeddings]
    limit = min((int(n) for n in limits if n), default=DEPTHS[-1] + 2 * block)
    return tuple(d for d in DEPTHS if d + 2 * block <= limit) or (min(CONTEXT, limit // 2),)


class Calibration:
    """A pair's cost curves: read from the cache file (or measured and written there), then
    remembered for this process, so that a request costs no fingerprinting; the file is
    checked for a newer measurement by another process. `cached()` never measures."""

    def __init__(self, pair: Pair):
        self.pair = pair
        # (mlx version, conditions) -> (curves, file, its stamp when read)
        self._known: dict[tuple, tuple[CostCurves, Path, tuple[int, int] | None]] = {}
        self.latest: CostCurves | None = None  # the curves last read or measured, if any

    def curves(
        self, *, refresh: bool = False, progress: Callable[[int, int], None] | None = None
    ) -> CostCurves:
        """Cached curves for this pair on this device, mlx version and conditions, measured
        when missing (or `refresh`). `progress(done, total)` is called as the measurement
        goes; what it raises abandons it (nothing is written or remembered)."""
        curves = None if refresh else self.cached()
        if curves is None:
            memo, key = self._memo(), calibration_key(self.pair)
            path = _cache_path(key)
            curves = measure(self.pair, progress=progress)
            _write(path, key, curves)
            self._known[memo] = (curves, path, _stamp(path))
            self.latest = curves
        return curves

    def cached(self) -> CostCurves | None:
        """The curves `curves()` returns without measuring (None: they must be measured)."""
        memo = self._memo()
        known = self._known.get(memo)
        if known is not None and _stamp(known[1]) == known[2]:
            return known[0]
        key = calibration_key(self.pair)
        path = _cache_path(key)
        curves = _read(path, key)
        if curves is not None:
            self._known[memo] = (curves, path, _stamp(path))
            self.latest = curves
        return curves

    def _memo(self) -> tuple:
        return (mx.__version__, tuple(sorted(conditions().items())))

    @property
    def path(self) -> Path:
        """The file this pair's curves are cached in (for this device, mlx and conditions)."""
        return cache_path(self.pair)

    def forget(self) -> None:
        """Read the file again at the next request (as a new process would)."""
        self._known.clear()


def load_or_measure(
    pair: Pair,
    draft=None,
    *,
    refresh: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> CostCurves:
    """The pair's curves (`pair.costs()`). The old form `load_or_measure(model, draft)` is
    deprecated: it makes a Pair for this call (nothing remembered for the next one)."""
    from .pair import Pair

    if not isinstance(pair, Pair):
        import warnings

        warnings.warn(
            "load_or_measure(model, draft) is deprecated: use Pair(model, draft).costs()",
            DeprecationWarning,
            stacklevel=2,
        )
        pair = Pair(pair, draft)
    return pair.costs(refresh=refresh, progress=progress)


def _read(path: Path, key: dict | None) -> CostCurves | None:
    """The curves a cache file holds for `key` (None: none, another key, or unreadable)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("key") != key:
            return None
        return CostCurves(
            tuple(data["verify"]),
            tuple(data["draft"]),
            depths=tuple(data["depths"]),
            deeper=tuple((tuple(v), tuple(d)) for v, d in data["deeper"]),
            context=data.get("context"),
            lazy=data.get("lazy"),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: Path, key: dict, curves: CostCurves) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "key": key,
                "verify": list(curves.verify),
                "draft": list(curves.draft),
                "depths": list(curves.depths),
                "deeper": [[list(v), list(d)] for v, d in curves.deeper],
                "context": curves.context,
                "lazy": curves.lazy,
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            },
            indent=1,
        )
    )


def _stamp(path: Path) -> tuple[int, int] | None:
    """What tells a rewritten cache file from the one read (None: no file)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size

"""Calibration across ranks: rank 0's curves on every rank (SPEC 10, item 3)."""

from __future__ import annotations

from typing import Any

from .cluster import agree, current, speaks


def lockstep_calibration(pair: Any) -> None:
    """Give `pair` a calibration whose curves are rank 0's (measured in lockstep when
    missing: a measurement runs sharded passes, which every rank must run)."""
    if current() is None or pair.calibration is None:
        return
    from ..calibration import Calibration

    class LockstepCalibration(Calibration):
        """Rank 0's curves, read from its file (keyed also by the sharding) or measured
        with every rank taking part; the other ranks keep rank 0's. Read once per process,
        so that no rank looks at a file the others do not; `freeze` (a server) turns
        later re-measurements into a no-op."""

        frozen = False

        def _key(self) -> dict:
            from ..calibration import calibration_key

            c = current()
            return {**calibration_key(self.pair), "shard": [c.shard, c.size] if c else None}

        def cached(self):
            if self.latest is not None:
                return self.latest
            from ..calibration import _cache_path, _read

            curves = None
            if speaks():
                key = self._key()
                curves = _read(_cache_path(key), key)
            curves = agree("calibration", curves)
            self.latest = curves
            return curves

        def curves(self, *, refresh: bool = False, progress=None):
            curves = None if refresh and not self.frozen else self.cached()
            if curves is None:
                from ..calibration import _cache_path, _write, measure

                curves = measure(self.pair, progress=progress)
                if speaks():
                    key = self._key()
                    try:
                        _write(_cache_path(key), key, curves)
                    except OSError:
                        pass  # not cached for the next run; this one goes on
                curves = agree("calibration", curves)
                self.latest = curves
            return curves

        def forget(self) -> None:
            pass  # the curves stay rank 0's for this process

        @property
        def path(self):
            from ..calibration import _cache_path

            return _cache_path(self._key())

    pair.calibration = LockstepCalibration(pair)


def freeze_calibration(pair: Any) -> None:
    """A server's ranks measure only at start: afterwards no re-measurement (rank 0's worker
    would measure alone, between requests, where the others cannot join)."""
    if pair.calibration is not None and hasattr(type(pair.calibration), "frozen"):
        pair.calibration.frozen = True

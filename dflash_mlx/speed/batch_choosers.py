"""The width choosers of a batch (SPEC 8): one per batch size, priced by what the whole pass
costs (`batch_curves`, then what its cycles measure), reading the acceptance the pair's own
chooser learns from every row (`batch_chooser`). `batch_cycle.learn` teaches them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .adaptive import WidthChooser
from .costs import CostCurves

if TYPE_CHECKING:
    from ..engine.batch_cycle import Row


def batch_curves(curves: CostCurves, rows: int) -> CostCurves:
    """What a cycle of `rows` requests at width W costs, priced before it is measured: the
    target on `rows * W` tokens (the calibrated curve, extended along its last segment) and
    one draft pass per row."""

    def verify(curve: list[float]) -> list[float]:
        def at(tokens: int) -> float:
            if tokens <= len(curve):
                return curve[tokens - 1]
            slope = curve[-1] - curve[-2] if len(curve) > 1 else curve[-1]
            return curve[-1] + max(slope, 0.0) * (tokens - len(curve))

        return [at(rows * w) for w in range(1, len(curve) + 1)]

    def draft(curve: list[float]) -> list[float]:
        return [rows * t for t in curve]

    return CostCurves(
        verify(curves.verify),
        draft(curves.draft),
        curves.depths,
        tuple((verify(v), draft(d)) for v, d in curves.deeper),
        curves.context,
        curves.lazy,
    )


def batch_chooser(
    known: dict[int, tuple[WidthChooser, WidthChooser]],
    size: int,
    base: WidthChooser,
    last: WidthChooser | None = None,
    rows: list[Row] | None = None,
) -> WidthChooser:
    """The width chooser for cycles of `size` rows (alone: `base`, the pair's own). A batch's
    prices its own costs (`batch_curves`) but reads the acceptance `base` has learnt, and
    until it measures speculative cycles of its own, what the pair's other choosers found
    them to cost against their calibration (`WidthChooser.learn_from`). `last`: the chooser
    of the batch's previous cycle, when the batch's size changed since (a row left): the
    batch's probe budget and its time since the last probe go on (`WidthChooser.carry`),
    so that a batch shrinking row by row still probes, and its acceptance is the `rows`
    left's own (`Acceptance.resume_rows`). `known`: the decoder's, `{size: (base,
    chooser)}`."""
    if last is not None and rows:
        base.resume_rows([r.taught for r in rows])
    chooser = _size_chooser(known, size, base)
    if last is not None and last is not chooser:
        chooser.carry(last)
    return chooser


def _size_chooser(
    known: dict[int, tuple[WidthChooser, WidthChooser]], size: int, base: WidthChooser
) -> WidthChooser:
    sizes = [c for b, c in known.values() if b is base]
    if size == 1:
        if not base._spec_seen:
            base.learn_from(sizes)
        return base
    kept = known.get(size)
    if kept is None or kept[0] is not base:
        # A batched cycle is `size` rows' evidence of what speculating costs here: one
        # that lost is enough to budget the next probes at what it really lost.
        chooser = WidthChooser(
            batch_curves(base.costs, size),
            base.block,
            draft_block=base.draft_block,
            floor_evidence=1.0,
            request_budget=base.request_budget,
            budget_tokens=base.budget_tokens,
            first_look=base.first_look,
        )
        kept = known[size] = (base, chooser)
    chooser = kept[1]
    chooser.read_acceptance(base)
    if not chooser._spec_seen:
        chooser.learn_from([base, *sizes])
    return chooser

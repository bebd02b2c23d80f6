"""`Pair`: a target and its draft, bound and checked once (SPEC 5.1).

A Pair owns everything that belongs to that pairing, and nothing is stashed on the models:
- the target adapter (hidden-state capture, caches, rewind) with its own recorder;
- the draft's view of the target (`TargetHead`: the target's embedding and LM head), which
  every request's `DraftState` carries;
- the calibration (measured cost curves and their file, measured once per device and
  conditions);
- the width policies carried across requests (one per fixed draft block), so what a
  request taught about acceptance and costs serves the next one, and the chain-or-tree
  chooser.
One draft used with two targets is two Pairs, and works. A Pair with no draft decodes with
the target alone. `load_pair` loads both from Hub ids or folders.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.nn as nn

from .engine.tree import BRANCH as TREE_BRANCH
from .engine.tree import ShapeChooser
from .errors import BadArgument, ContextTooLong
from .models.draft import DFlashDraft, DraftState, TargetHead
from .models.target import TargetAdapter
from .options import GenerateOptions
from .speed.costs import CostCurves
from .speed.policy import AutoPolicy

# Fallback verify-width cap for quantized targets, before anything is measured on the
# device (SPEC 5.4): wide verifies are slow with MLX's quantized matmul.
QUANTIZED_VERIFY_CAP = 5


class Pair:
    """A target model and (optionally) a DFlash draft built for it."""

    def __init__(self, model: nn.Module, draft: DFlashDraft | None = None):
        from .calibration import Calibration

        self.model = model
        self.draft = draft
        self.target = TargetAdapter(model)
        self.head: TargetHead | None = None
        if draft is not None:
            check_fit(draft, self.target)
            t = self.target
            self.head = draft.head_for(t.embed_tokens, t.lm_head, t.embed_scale)
        self.calibration = Calibration(self) if draft is not None else None
        # One policy per fixed draft block (None: chosen per cycle), carried across requests.
        self.policies: dict[int | None, AutoPolicy] = {}
        self.shapes = ShapeChooser()  # chain or tree, where a request leaves it open
        # Whether `plan` measures curves missing for this device and conditions inside the
        # request it plans (announced by the CLI). A server turns it off and measures while
        # idle (`calibration_due`, `calibrate`): its requests plan from the curves at hand,
        # else the default width. Nothing is ever measured again while anyone waits: the
        # policies learn costs from the passes they run.
        self.calibrate_in_plan = True

    def __repr__(self) -> str:
        draft = "no draft" if self.draft is None else f"draft block {self.draft.config.block_size}"
        return f"Pair({self.target.model_type!r}, {self.target.num_layers} layers, {draft})"

    # -- what the pairing knows ---------------------------------------------------------

    @property
    def context_limit(self) -> int | None:
        """Positions the target can hold (its `max_position_embeddings`), if it says."""
        return self.target.context_limit

    def check_context(self, prompt_tokens: int) -> None:
        """A prompt must leave at least one position of the target's context to generate."""
        check_context(prompt_tokens, self.context_limit)

    def draft_state(
        self, window: int | None = None, base: int = 0, sink: int | None = None
    ) -> DraftState:
        """A fresh draft context for one request (see `DFlashDraft.make_state`)."""
        if self.draft is None:
            raise BadArgument("this pair has no draft")
        return self.draft.make_state(base, window, self.head, sink)

    @property
    def is_quantized(self) -> bool:
        args = getattr(self.model, "args", None)
        if getattr(args, "quantization", None):
            return True
        return any(isinstance(m, nn.QuantizedLinear) for _, m in self.model.named_modules())

    def default_verify_width(self) -> int:
        """W before anything is measured: the draft's block (capped for quantized targets)."""
        if self.draft is None:
            return 1
        width = self.draft.config.block_size
        return min(width, QUANTIZED_VERIFY_CAP) if self.is_quantized else width

    def costs(
        self, *, refresh: bool = False, progress: Callable[[int, int], None] | None = None
    ) -> CostCurves:
        """The pair's cost curves on this device (cached on disk, measured when missing)."""
        if self.calibration is None:
            raise BadArgument("a pair without a draft has no cost curves")
        return self.calibration.curves(refresh=refresh, progress=progress)

    @property
    def calibration_due(self) -> bool:
        """Whether `calibrate` would measure: no curves yet for this device and conditions."""
        return self.calibration is not None and self.calibration.cached() is None

    def calibrate(self, progress: Callable[[int, int], None] | None = None) -> CostCurves:
        """The cost curves, measured now if `calibration_due` (`progress` as in `costs`:
        what it raises abandons the measurement, which stays due)."""
        return self.costs(progress=progress)

    # -- planning a request ---------------------------------------------------------------

    def plan(self, options: GenerateOptions) -> tuple[int, int, AutoPolicy | None]:
        """Verify width W, draft block L, and the policy that plans them per cycle (auto).

        A seeded request gets a policy of its own, fresh from the calibrated curves, so that
        its widths follow from the request alone (the acceptance its own tokens show), never
        from what earlier requests taught or from wall-clock timings: seeds replay.
        """
        width, draft_block = options.verify_width, options.draft_block
        draft = self.draft
        if draft is None:
            if width not in (None, 1):
                raise BadArgument(f"verify_width {width} exceeds 1 (no draft given)")
            if draft_block is not None:
                raise BadArgument(f"draft_block {draft_block}: no draft given")
            return 1, 1, None
        block = draft.config.block_size
        if draft_block is not None:
            if draft_block > block:
                raise BadArgument(f"draft_block {draft_block!r} must be an integer in 2..{block}")
            if draft.config.is_dflash2 and draft_block != block:
                raise BadArgument(
                    f"draft_block {draft_block}: a DFlash 2 draft always drafts its trained "
                    f"block of {block} (its conv and selector see the whole block)"
                )
        rows = draft_block or block
        if width is not None and options.tree:
            # A tree's budget: its tokens spread over at most `rows - 1` depths.
            most = (rows - 1) * TREE_BRANCH + 1
            if width > most:
                raise BadArgument(
                    f"verify_width {width}: a tree over {rows - 1} drafted positions holds at "
                    f"most {most} tokens"
                )
            return width, rows, None
        if width is not None:
            if width > block:
                raise BadArgument(
                    f"verify_width {width} exceeds the draft's trained block size {block}"
                )
            if width > rows:
                raise BadArgument(f"verify_width {width} exceeds draft_block {rows}")
            if draft_block is None and width >= 2 and not draft.config.is_dflash2:
                # A fixed width drafts the positions it verifies, no more (as z-lab's
                # reference drafts its `block_size`): the extra rows of the trained block
                # cost a draft pass more and are never verified. (The automatic width picks
                # the cheapest block covering each W from the calibration instead.)
                rows = width
            return width, rows, None
        fixed = block if draft.config.is_dflash2 else draft_block
        try:
            curves = self.calibrate() if self.calibrate_in_plan else self._curves_at_hand()
        except OSError:  # no writable cache
            curves = None
        if curves is None:  # fall back to the fixed default
            return min(self.default_verify_width(), rows), rows, None
        if options.seed is not None:
            return rows, rows, AutoPolicy(curves, block, draft_block=fixed)
        known = self.policies.get(fixed)
        if known is None or known.table.curves != curves:
            known = self.policies[fixed] = AutoPolicy(curves, block, draft_block=fixed)
        return rows, rows, known

    def _curves_at_hand(self) -> CostCurves | None:
        """Without measuring: the current curves, else the last ones known (e.g. before the
        conditions changed), else None."""
        curves = self.calibration.cached()
        return curves if curves is not None else self.calibration.latest

    def forget(self) -> None:
        """Drop what requests taught the policies (the calibration stays)."""
        self.policies.clear()
        self.shapes = ShapeChooser()


def check_context(prompt_tokens: int, limit: int | None, what: str = "the target's") -> None:
    """The one context check: `ContextTooLong` unless a prompt of `prompt_tokens` tokens
    leaves at least one of `limit` positions (None: no limit) to generate."""
    if limit is not None and prompt_tokens >= limit:
        raise ContextTooLong(
            f"prompt of {prompt_tokens} tokens does not fit {what} context of {limit} "
            "positions: at least one position must be left to generate"
        )


def check_fit(draft: DFlashDraft, target: TargetAdapter) -> None:
    """Refuse a draft that was not built for `target`, naming what differs."""
    c = draft.config
    problems = []
    if c.hidden_size != target.hidden_size:
        problems.append(f"hidden size: draft {c.hidden_size}, target {target.hidden_size}")
    vocab = target.vocab_size
    if c.vocab_size > target.embed_rows or (vocab and c.vocab_size != vocab):
        problems.append(
            f"vocabulary: draft {c.vocab_size}, target {vocab or target.embed_rows} "
            f"({target.embed_rows} embedding rows)"
        )
    if c.num_target_layers != target.num_layers:
        problems.append(
            f"layers: draft built for a {c.num_target_layers}-layer target, "
            f"target has {target.num_layers}"
        )
    if any(i >= target.num_layers for i in c.target_layer_ids):
        problems.append(
            f"target_layer_ids {c.target_layer_ids} out of range for a "
            f"{target.num_layers}-layer target"
        )
    if problems:
        from .models.loading import LoadError

        raise LoadError(f"draft does not fit target {target.model_type!r}: " + "; ".join(problems))


def load_pair(target: str | Path, draft: str | Path | None = None):
    """`(Pair, tokenizer)` for a target and (optionally) a draft, each a Hub id or a local
    folder: loaded, checked against each other, bound."""
    from .models.loading import load, load_draft

    model, tokenizer = load(target)
    return Pair(model, load_draft(draft) if draft is not None else None), tokenizer


def as_pair(model_or_pair: nn.Module | Pair, draft: DFlashDraft | None = None) -> Pair:
    """A Pair given one, else a new Pair of `model` and `draft`."""
    if isinstance(model_or_pair, Pair):
        if draft is not None and draft is not model_or_pair.draft:
            raise BadArgument("a Pair already holds its draft: pass the pair alone")
        return model_or_pair
    if not isinstance(model_or_pair, nn.Module):
        raise BadArgument(f"expected a Pair or an mlx model, got {type(model_or_pair).__name__}")
    return Pair(model_or_pair, draft)

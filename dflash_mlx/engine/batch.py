"""The engine: the one driver of the decode cycle (SPEC 1, 8), for one request or many.

`BatchDecoder` runs the cycle for every active row at once: each row is a
`prefill.Request` of its own (draft state, sampling keys, controls, committed tokens), and
the rows' blocks are verified in **one** target pass over a batch cache (`batch_cache`:
each row its own positions, length and rewind). Rows of different widths are padded at
their end; padding is rewound with the rejected drafts. A request alone is a batch of one:
`stream_generate`, `generate`, chat, bench and `serve --max-batch 1` are `run` with one
row, and `speculative_decode` reads its cycles.

A request arriving while others decode is prefilled alone, in chunks, with one cycle of
the running rows between chunks (a long prompt never stalls them for more than a chunk;
with `on_output` set, their responses are handed out between the chunks too), then joins.
One row decodes on its own caches, as a request alone does; the batch cache is made when
a second joins and undone when one is left.

Widths: a request that fixes its width keeps it; the others share a width the pair's policy
(`speed.port.Policy`) plans per cycle for the whole batch, priced by what the whole pass
costs (all rows' tokens through the target, a draft pass per row, as measured), so under
load widths narrow, or go plain, where extra verified rows stop coming free. The cycle's
steps are `batch_cycle.py`'s. Every pass, plan and lesson is an `Event` for an optional
`trace`; `clock` may be a simulated device that charges each pass what its table says.
Rows that verify trees (SPEC 7) do so in the same pass as the others' chains, each row
masked as its shape says.
Knows nothing about HTTP: `server/engine.py` and `batch_generate` drive it.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from .. import distributed
from ..cache.prompt_cache import PromptCache
from ..options import GenerateOptions
from ..pair import Pair
from ..speed.port import Ask, Policy
from . import batch_cycle as bc
from . import plain
from .batch_cache import add_row, batchable, join, keep_rows, take_row
from .batch_cycle import Row
from .bookkeeping import clear_cache_every, cut_at_eos, snapshot
from .controls import Grammar, compile_grammar, read_logprobs
from .decode import NOTHING_SAVED, Cycle, _Step, commit_draft, first_token
from .generate import GenerationResponse, Reply, batch_generate
from .plain import Ahead
from .prefill import open_request, prefill_prompt
from .text import encode_prompt
from .trace import Clock, Event
from .tree import ShapeChooser, tree_mode

__all__ = ["BatchDecoder", "Event", "Row", "batch_generate"]


class _Cycles:
    """The reply of a row whose caller reads cycles (`speculative_decode`)."""

    @staticmethod
    def feed(cyc: Cycle) -> Cycle:
        return cyc


class BatchDecoder:
    """Decodes up to `max_batch` requests together; more wait, in arrival order."""

    def __init__(self, pair: Pair, tokenizer: Any, *, max_batch: int = 8):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch {max_batch!r} must be an integer >= 1")
        self.pair = pair
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.waiting: deque[Row] = deque()
        self.active: list[Row] = []
        self.cache: list | None = None  # the batch's target cache (None: one row or none)
        # Where every pass, plan and lesson goes as an `Event` (benchmarks, tests), and the
        # clock cycles are timed by (None: the wall; else, e.g., a simulated device).
        self.trace: Callable[[Event], None] | None = None
        self.clock: Clock | None = None
        self._outbox: list[tuple[Row, GenerationResponse | BaseException]] = []
        self.sizes: dict[int, int] = {}  # batch size -> cycles run at it
        # Where the running rows' responses go as soon as a cycle between the chunks of an
        # admission made them (a server hands them to their clients then); without it they
        # are returned by the `step` that admits.
        self.on_output: Callable[[list[tuple[Row, Any]]], None] | None = None
        # Whether something outside the decoder waits for the step to end (a server's
        # request not yet submitted, a client gone): asked between the passes of a stretch.
        self.interrupt: Callable[[], bool] | None = None
        self._ahead: Ahead | None = None  # the next plain pass, launched before its turn
        self._planned: tuple | None = None  # the next cycle's widths, decided in advance
        self._synced = 0.0  # when the last cycle's result reached the host
        self.chained = 0  # plain passes launched before the last result reached the host
        self._stands = 0  # plain steps the latest plan still stands for

    # -- requests -------------------------------------------------------------------------

    def submit(
        self,
        prompt: Any,
        options: GenerateOptions | None = None,
        *,
        handle: Any = None,
        prompt_cache: PromptCache | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Row:
        """Queue a request (text, ids or messages); its settings are checked now."""
        opts = options or GenerateOptions()
        ids = encode_prompt(self.tokenizer, prompt)
        self.pair.check_context(len(ids))
        row = Row(ids, opts, handle, prompt_cache, progress)
        row.grammar = compile_grammar(opts, self.tokenizer, self.pair.target.logits_width)
        row.plan = self.pair.plan(opts)  # once: it refuses widths the pair cannot run
        row.eos = frozenset(getattr(self.tokenizer, "eos_token_ids", None) or ())
        row.learn = opts.seed is None  # a seeded request's reply must not hang on timing
        distributed.submitted(row, ids, opts)  # a server across ranks: told to the others
        self.waiting.append(row)
        return row

    def run(self, row: Row) -> Iterator[Any]:
        """Decode `row` alone, a batch of one (`stream_generate`, `speculative_decode`),
        yielding its responses as they come. Closed early, the row ends as cancelled (its
        prompt cache committed with what was committed); when it fails, its error is raised
        and its prompt cache left as it was."""
        if row not in self.waiting:
            self.waiting.append(row)
        try:
            while self.busy:
                for _, out in self.step():
                    if isinstance(out, BaseException):
                        raise out
                    yield out
        except GeneratorExit:
            self.close()
            raise

    def cancel(self, row: Row) -> None:
        """Stop a request between cycles (waiting ones never start)."""
        if distributed.cancel_later(row):  # across ranks: at the next step, on every rank
            return
        row.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def step(self) -> list[tuple[Row, GenerationResponse | BaseException]]:
        """Admit the next waiting request when there is room (in arrival order; prefilled
        with a cycle of the running rows between its chunks), or else run one cycle of
        every active one, and return what each row produced meanwhile, in order: responses, or
        the exception that ended a row (the others go on)."""
        distributed.step()  # a server across ranks: this step's admissions and cancels
        self._drop_cancelled()
        if self.waiting and len(self.active) < self.max_batch:
            # One at a time, so that each first token goes out as soon as its own prompt
            # is prefilled; the cycle runs once no request waits for room.
            self._admit(self.waiting.popleft())
        elif self.active:
            self._cycle()
        distributed.stepped()  # across ranks: the stall watchdog stops
        out, self._outbox = self._outbox, []
        return out

    def close(self) -> None:
        """End every row (as cancelled), committing their prompt caches."""
        for row in list(self.active) + list(self.waiting):
            row.cancelled = True
        self.waiting.clear()
        self._drop_cancelled()

    # -- membership -----------------------------------------------------------------------

    def _admit(self, row: Row) -> None:
        self._synced = 0.0  # the next cycle is timed from its own launch
        if row.cancelled:
            row.done = True
            return
        try:
            self._prefill(row)
        except Exception as e:  # noqa: BLE001 - the row ends with its error, the rest go on
            self._fail(row, e, joined=False)
            return
        if row.done:
            self._ahead = self._planned = None  # launched for a row that ended at once
            self._finish(row, joined=False)
            return
        self._join(row)

    def _prefill(self, row: Row) -> None:
        pair, opts = self.pair, row.options
        width, rows, policy = row.plan
        row.fixed = None if policy is not None else (width, rows)
        row.rows, row.policy = rows, policy
        speculate = row.speculate
        if speculate is None:
            speculate = pair.draft is not None and (width > 1 or policy is not None)
        draft = pair.draft if speculate and (width > 1 or policy is not None) else None
        if policy is not None and row.ticket is None:
            row.ticket = policy.begin(opts.max_tokens)
        seed = row.seed if row.seed is not None else opts.seed
        if seed is None:
            seed = distributed.agree("seed", int.from_bytes(os.urandom(8), "little"))
        if row.prompt_cache is not None:
            row.lease, saved = row.prompt_cache.take(pair.model, draft)
        else:
            saved = None
        mx.reset_peak_memory()
        if row.reply is None:
            eos, n = row.eos, len(row.prompt)
            ticket = row.ticket if draft is not None else None
            row.reply = Reply(self.tokenizer, opts, n, eos, ticket, speculate, width)
        cached = row.prompt_cache is not None
        req = open_request(pair, draft, row.prompt, opts, seed, saved, row.grammar, cached)
        row.req = req
        why = batchable(req.cache) if self.max_batch > 1 else None
        if why is not None:
            raise NotImplementedError(f"this target cannot decode in a batch: {why}")
        req.trees = tree_mode(req, opts, pair.shapes if policy is not None else None, row.learn)

        last = [req.reused]

        def between_chunks(done: int, total: int) -> None:
            if row.progress is not None:
                row.progress(done, total)
            if done < total and done - last[0] >= opts.prefill_step and self.active:
                # The running rows go on between the chunks of a long prompt, and what they
                # produced goes out now, not when the admission ends.
                last[0] = done
                if not row.cancelled:
                    self._drop_cancelled()
                    self._cycle()
                    self._hand_out()

        progress = between_chunks
        if row.prompt_cache is not None:
            progress = row.prompt_cache.watch(between_chunks)
        # Where the policy plans a plain first cycle at the size the request joins, the
        # prompt's draft context is only a deferred window (a dormant prefill).
        window = None
        if policy is not None and draft is not None:
            size = min(self.max_batch, len(self.active) + len(self.waiting) + 1)
            first = Ask(row.ticket, len(row.prompt) - 1, max(1, opts.max_tokens - 1))
            if policy.plan([first], rows=size).widths[0] == 1:
                window = policy.window
        self._emit(Event("prefill", 1, len(row.prompt) - req.reused, len(row.prompt)))
        with mx.stream(generation_stream):
            logits = prefill_prompt(req, opts.prefill_step, progress, window)
            anchor, lp = first_token(req, logits)
            if req.controls is not None:
                req.controls.commit(anchor)
        tok = anchor.item()
        if row.grammar is not None:
            row.grammar.consume([tok])
        req.generated.append(tok)
        row.anchor = anchor
        if not self.active and not self.waiting:
            plain.launch_first(self, row)
        cyc = Cycle([tok], 0, 0, req.reused, read_logprobs(lp, [0], [tok]), tree_note=req.tree_note)
        self._respond(row, cyc)
        if tok in row.eos or opts.max_tokens <= 1:
            row.done = True

    def _join(self, row: Row) -> None:
        if self.active:
            with mx.stream(generation_stream):
                if self.cache is None:  # one row so far: its own caches become the batch's
                    self.cache = join([self.active[0].req.cache, row.req.cache])
                else:
                    self.cache = add_row(self.cache, row.req.cache)
                mx.eval([c.state for c in self.cache])
        self.active.append(row)

    def _leave(self, rows: list[Row]) -> None:
        """Take `rows` out of the batch; their own caches are handed back to them."""
        gone = {id(r) for r in rows}
        if self.cache is not None:
            for b, r in enumerate(self.active):
                if id(r) in gone:
                    r.req.cache = take_row(self.cache, b)
        stay = [b for b, r in enumerate(self.active) if id(r) not in gone]
        if self.cache is not None:
            if len(stay) > 1:
                keep_rows(self.cache, stay)
            elif stay:
                self.active[stay[0]].req.cache = take_row(self.cache, stay[0])
        self.active = [self.active[b] for b in stay]
        if len(self.active) <= 1:
            self.cache = None

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(row)
            row.done = True
        ending = [r for r in self.active if r.cancelled]
        if ending:
            self._leave(ending)
            for row in ending:
                self._commit_prompt_cache(row)
                row.done = True

    def _finish(self, row: Row, joined: bool = True) -> None:
        if joined:
            self._leave([row])
        self._commit_prompt_cache(row)
        row.done = True

    def _fail(self, row: Row, error: BaseException, joined: bool = True) -> None:
        """End `row` with `error` (its prompt cache is left as it was: never half-written)."""
        if joined and row in self.active:
            self._leave([row])
        row.done, row.error = True, error
        self._outbox.append((row, error))

    def _commit_prompt_cache(self, row: Row) -> None:
        req = row.req
        if row.prompt_cache is None or req is None or not req.generated:
            return
        if req.keep_snapshots and not row.snapped and not row.cut:
            # Its last cycle ran in a batch: the state its own cache is left at now.
            snapshot(req, len(req.prompt) + len(req.generated) - 1)
        row.prompt_cache.commit(row.lease, req.saved())

    def _hand_out(self) -> None:
        """Give what the rows produced so far to `on_output`, when there is one."""
        if self.on_output is not None and self._outbox:
            out, self._outbox = self._outbox, []
            self.on_output(out)

    def _respond(self, row: Row, cyc: Cycle) -> None:
        response = row.reply.feed(cyc)
        self._outbox.append((row, response))
        if getattr(response, "finish_reason", None) is not None:
            row.done = True

    # -- the cycle ------------------------------------------------------------------------

    def _cycle(self) -> None:
        """One cycle of every active row, its steps in order: (1) the plain pass launched
        ahead, when there is one, is this cycle; else (2) plan each row's width, (3) catch
        the drafts' context up where speculation resumes, (4) draft, (5) verify every row in
        one pass, (6) accept, (7) rewind each row to what it accepted, (8) learn, (9)
        commit and respond."""
        rows = [r for r in self.active if not r.done]
        lazy = [r.req for r in rows if r.req.lazy_context]
        if lazy:  # a prompt's last chunk of draft context, before anything this cycle times
            mx.eval([a for req in lazy for a in req.state.arrays])
            for req in lazy:
                req.lazy_context = False
        ahead, self._ahead = self._ahead, None
        planned, self._planned = self._planned, None
        if ahead is not None:
            ran = {id(r): b for b, r in enumerate(ahead.rows)}
            if rows and all(id(r) in ran for r in rows):
                # This cycle's pass already runs, chained on the last cycle's tokens.
                self._plain_cycle(rows, None, ahead, [ran[id(r)] for r in rows])
                return
            # A request joined since: the chained pass is committed for the rows it ran
            # for (and still run), then every row cycles.
            old = [r for r in rows if id(r) in ran]
            if old:
                self._plain_cycle(old, None, ahead, [ran[id(r)] for r in old], chain=False)
            rows = [r for r in self.active if not r.done]
            planned = None
        size = len(rows)
        if not size:
            return
        policy = self._policy(rows)
        if planned is not None and planned[0] == [id(r) for r in rows]:
            # Decided when the last cycle chained nothing, before its token was committed:
            # no row may verify more than it has tokens left now.
            widths, captures, made = planned[1]
            widths = [
                (max(1, min(w, r.options.max_tokens - r.generated)), length)
                for r, (w, length) in zip(rows, widths)
            ]
        else:
            widths, captures, made = self._plan(rows, policy)
        if bc.plain(self.pair.target, rows, widths):
            self._plain_cycle(rows, policy, captures=captures)
            return
        tic = self._now()
        late = bc.catch_up(rows, widths, captures, self._emit)
        caught = distributed.agree("catch-up", self._now() - tic) if any(late) else 0.0
        cache = self.cache if size > 1 else rows[0].req.cache
        target = self.pair.target
        depth = max(len(r.prompt) + r.generated - 1 for r in rows)
        with mx.stream(generation_stream):
            drafted = bc.draft(rows, widths, captures)
            block = max((length for w, length in widths if w > 1), default=1)
            self._emit(Event("draft", sum(w > 1 for w, _ in widths), 0, depth, block))
            logits, feats, width, saved = bc.verify(target, rows, drafted, cache, captures)
            self._emit(Event("verify", size, size * width, depth, width))
            steps, results = bc.decide(rows, drafted, logits, feats, width, saved, captures)
        bc.rewind(target, rows, steps, results, cache, width)
        spent = self._sync()
        if spent is not None:
            spent -= caught
        tree = size == 1 and steps[0].tree is not None
        self._learn(policy, rows, widths, results, spent, made, 1, (*late, caught), tree)
        for r, s, (n, _) in zip(rows, steps, results):
            if isinstance(r.req.trees, ShapeChooser) and s.width >= 3 and spent is not None:
                r.req.trees.observe(s.tree is not None, n + 1, spent)
        self.sizes[size] = self.sizes.get(size, 0) + 1
        self._commit_rows(rows, steps, results, size)

    @staticmethod
    def _policy(rows: list[Row]) -> Policy | None:
        """The policy of `rows`' automatic ones (None: every row's width is fixed)."""
        return next((r.policy for r in rows if r.fixed is None and r.req.draft is not None), None)

    def _plan(self, rows: list[Row], policy: Policy | None, ahead: int = 0) -> tuple:
        """`batch_cycle.plan`, its plan traced; a plain one stands for its `stands` steps."""
        widths, captures, made = bc.plan(rows, policy, ahead)
        if made is not None:
            self._stands = made.stands if all(w == 1 for w, _ in widths) else 0
            self._emit(Event("plan", len(rows), detail=made))
        return widths, captures, made

    def _learn(self, policy, rows, widths, results, spent, made, times, caught, tree=False):
        record = bc.learn(policy, rows, widths, results, spent, made, times, caught, tree)
        if record is not None:
            self._emit(Event("learn", len(rows), detail=record))

    def _emit(self, event: Event) -> None:
        if self.clock is not None:
            self.clock.charge(event)
        if self.trace is not None:
            self.trace(event)

    def _now(self) -> float:
        return self.clock.now() if self.clock is not None else time.perf_counter()

    def _sync(self) -> float | None:
        """A cycle's result reached the host: its seconds since the last cycle's sync, host
        work between them included (None for the first cycle after an admission: its time
        is mixed with the prefill's)."""
        now = self._now()
        spent = now - self._synced if self._synced else None
        self._synced = now
        return distributed.agree("cycle seconds", spent)  # rank 0's, across ranks

    def _commit_rows(
        self, rows: list[Row], steps: list, results: list, size: int, plain: bool = False
    ) -> None:
        """Each row's tokens of the cycle committed and handed out (`plain`: a chained
        plain pass's, whose drafts and recurrent states were kept when it was launched);
        rows that ended or failed leave the batch."""
        finished = []
        for r, s, (n, new) in zip(rows, steps, results):
            if r.error is None:
                try:
                    self._commit_row(r, s, n, new, size, plain)
                except Exception as e:  # noqa: BLE001 - this row ends with its error
                    r.error = e
            if r.error is not None:
                r.done = True
                self._outbox.append((r, r.error))
            if r.done:
                finished.append(r)
        if finished:
            self._leave(finished)
            for r in finished:
                if r.error is None:
                    self._commit_prompt_cache(r)

    def _plain_cycle(
        self,
        rows: list[Row],
        policy: Policy | None,
        ahead: Ahead | None = None,
        index: list[int] | None = None,
        chain: bool = True,
        captures: list[bool] | None = None,
    ) -> None:
        """A plain cycle of every row: its pass (`ahead`, already launched, the rows at
        `index` of it; else launched now with `captures`), each row's draft and controls
        told of its token on the device, and, while every row stays plain, the next cycle's
        pass launched on those device tokens before this one's reach the host, as mlx-lm
        chains its steps. What a chained pass feeds a row that ends here is never read.
        `policy`: the rows' (None: looked up for these rows)."""
        size = len(rows)
        target = self.pair.target
        cache = self.cache if size > 1 else rows[0].req.cache
        if ahead is None:
            anchors = mx.concatenate([r.anchor for r in rows])
            at = [r.generated - 1 for r in rows]
            top, feats, lps = bc.plain_pass(target, rows, anchors, cache, captures, at)
            self._emit_plain(rows)
        else:
            top, feats, lps, captures = ahead.top, ahead.feats, ahead.lps, ahead.captures
            if top.shape[0] != size:  # rows left since it was launched (the order stays)
                pick = mx.array(index)
                top = top[pick]
                feats = feats[pick] if feats is not None else None
                lps = [lps[i] for i in index] if lps is not None else None
                captures = [captures[i] for i in index]
        steps = []
        for b, r in enumerate(rows):
            f = feats[b : b + 1] if feats is not None and captures[b] else None
            lp = lps[b] if lps is not None else None
            steps.append(_Step(None, top[b : b + 1], f, NOTHING_SAVED, 1, 0.0, True, lp))
            commit_draft(r.req, steps[-1], 0)
            if size == 1 and r.req.keep_snapshots:  # before the next pass feeds
                snapshot(r.req, len(r.req.prompt) + r.generated)
                r.snapped = True
        if policy is None:
            policy = self._policy(rows)
        if (
            chain
            and not self.waiting
            and all(r.options.max_tokens - r.generated >= 2 and not r.cancelled for r in rows)
        ):
            widths, caps, made = self._plan(rows, policy, ahead=1)  # the next cycle's, now
            if bc.plain(target, rows, widths):
                at = [r.generated for r in rows]
                launch = self._now()
                nxt = bc.plain_pass(target, rows, top, cache, caps, at)
                self._emit_plain(rows, 1)
                built = distributed.agree("launch seconds", self._now() - launch)
                self._ahead = Ahead(rows, *nxt, caps, built)
            else:
                self._planned = ([id(r) for r in rows], (widths, caps, made))
        got = [[t] for t in top.tolist()]
        if self._ahead is not None and plain.stretches(self, rows, lps, policy):
            plain.stretch(self, rows, got, policy)  # more plain steps, each row's tokens
        # On a CPU much of a pass runs inside its launch: each cycle is charged its own,
        # wherever it fell between host syncs.
        spent = self._sync()
        if spent is not None:
            spent += ahead.built if ahead is not None else 0.0
            spent -= self._ahead.built if self._ahead is not None else 0.0
        results = [(0, g) for g in got]
        ran = len(got[0])  # plain steps (more than one: a stretch's)
        if spent is not None:
            spent /= ran
        self._learn(policy, rows, [(1, 1)] * size, results, spent, None, ran, (0, 0, 0.0))
        self.sizes[size] = self.sizes.get(size, 0) + ran
        self.chained += ran - 1 + (self._ahead is not None)
        self._commit_rows(rows, steps, results, size, plain=True)

    def _emit_plain(self, rows: list[Row], ahead: int = 0) -> None:
        depth = max(len(r.prompt) + r.generated - 1 + ahead for r in rows)
        self._emit(Event("plain", len(rows), len(rows), depth, 1))

    def _commit_row(
        self, r: Row, s: _Step, n: int, new: list[int], size: int, plain: bool = False
    ) -> None:
        req = r.req
        new, r.cut = cut_at_eos(new, r.eos)
        if r.grammar is not None:
            r.grammar.consume(new)
        clear_cache_every(len(req.generated), len(new))
        req.generated.extend(new)
        r.anchor = mx.array(new[-1:], dtype=mx.int32)
        if not plain:
            # Everything but the last emitted token was fed (after an EOS cut, more was).
            r.snapped = size == 1 and req.keep_snapshots and not r.cut
            if r.snapped:
                snapshot(req, len(req.prompt) + len(req.generated) - 1)
        lp = read_logprobs(s.logprobs, range(len(new)), new)
        batch = size if size > 1 else 0
        tree = s.tree is not None
        steps = len(new) if plain else 1  # a stretch of plain steps, one per token
        self._respond(r, Cycle(new, n, s.width, logprobs=lp, tree=tree, batch=batch, steps=steps))
        if new[-1] in r.eos or len(req.generated) >= r.options.max_tokens:
            r.done = True


def speculative_decode(
    pair: Pair,
    prompt: list[int],
    options: GenerateOptions,
    *,
    width: int | None = None,
    draft_block: int | None = None,
    policy: Policy | None = None,
    seed: int | None = None,
    eos_ids: frozenset[int] = frozenset(),
    learn_costs: bool = True,
    progress: Callable[[int, int], None] | None = None,
    prompt_cache: PromptCache | None = None,
    speculate: bool = True,
    grammar: Grammar | None = None,
) -> Iterator[Cycle]:
    """Decode up to `options.max_tokens` tokens after `prompt` (token ids) with `pair`,
    yielding each committed `Cycle`: the engine (`BatchDecoder`) with one row, read cycle by
    cycle (`speculate=False`, or a pair without a draft: the target alone).

    `width` is the verify width W (1 = plain decoding, no draft pass) and `draft_block` the
    rows L >= W the draft runs; with a `policy`, (W, L) are planned each cycle instead, and
    it learns acceptance from every verify and, with `learn_costs`, the wall time of every
    cycle (default: `pair.plan(options)`). Random draws follow `seed` (default:
    `options.seed`, else 0) and the generated position (SPEC 4). Stops after EOS or
    `max_tokens`. With a `prompt_cache`, the state of its previous request is reused from
    the longest common prefix on; this request's state is committed back when it ends or is
    closed between cycles, and not at all when it fails. A `grammar` (compiled by
    `controls.compile_grammar` for `options`' constraint) masks the target's logits.
    """
    if width is None:
        width, draft_block, policy = pair.plan(options)
    assert 1 <= width and (options.tree or width <= max(draft_block, 1))
    row = Row(list(prompt), options, None, prompt_cache, progress)
    row.plan, row.grammar, row.eos, row.learn = (
        (width, draft_block, policy),
        grammar,
        eos_ids,
        learn_costs,
    )
    row.seed = seed if seed is not None else options.seed if options.seed is not None else 0
    row.speculate, row.reply = speculate, _Cycles()
    yield from BatchDecoder(pair, None, max_batch=1).run(row)

"""A simulated device for the engine (`BatchDecoder.clock`) and a traced decode.

`SimClock` charges every pass the engine launches what a `CostCurves` table says it costs
(tokens, acceptance and decisions stay real); `decode` runs one request as
`speculative_decode` does, on a `BatchDecoder` whose `trace` and `clock` the test sets, and
returns its cycles and the engine's events. Nothing of the engine is patched.
"""

from __future__ import annotations

from dflash_mlx.engine.batch import BatchDecoder
from dflash_mlx.engine.batch_cycle import Row
from dflash_mlx.engine.trace import Event
from dflash_mlx.options import GenerateOptions
from dflash_mlx.speed.costs import CostCurves


def curves(verify, draft, block: int = 16, **kw) -> CostCurves:
    """Curves from functions of W (verify) and L (draft), W, L = 1..block."""
    return CostCurves(
        tuple(float(verify(w)) for w in range(1, block + 1)),
        tuple(float(draft(n)) for n in range(1, block + 1)),
        **kw,
    )


class SimClock:
    """Seconds are what `truth` says each pass costs: a plain step of r rows or a verify of
    t tokens costs `truth.target(tokens)`, a draft pass `truth.drafting`, a catch-up
    `truth.catch_up`, a prefill `prefill` seconds a token. Starts at 1.0 (0.0 is the
    engine's "never synced")."""

    def __init__(self, truth: CostCurves, prefill: float = 0.0):
        self.truth, self.prefill = truth, prefill
        self.t = 1.0
        self.charged: list[tuple[str, float]] = []

    def now(self) -> float:
        return self.t

    def charge(self, event: Event) -> None:
        c, e = self.truth, event
        if e.kind == "plain":
            s = c.target(e.rows, e.depth)
        elif e.kind == "verify":
            s = c.target(e.tokens, e.depth)
        elif e.kind == "draft":
            s = c.drafting(e.rows, e.block, e.depth) if e.rows else 0.0
        elif e.kind == "catch-up":
            s = c.catch_up(e.tokens, e.block, e.depth)
        elif e.kind == "prefill":
            s = self.prefill * e.tokens
        else:
            return
        self.t += s
        self.charged.append((e.kind, s))


class _Cycles:
    @staticmethod
    def feed(cyc):
        return cyc


def decode(
    pair,
    ids: list[int],
    n: int,
    policy=None,
    *,
    width: int = 16,
    draft_block: int = 16,
    clock=None,
    seed: int | None = 0,
    prompt_cache=None,
    learn_costs: bool = True,
    options: GenerateOptions | None = None,
):
    """`speculative_decode(pair, ids, ...)` with `policy`, on `clock`: (cycles, events)."""
    opts = options or GenerateOptions(max_tokens=n, seed=seed)
    row = Row(list(ids), opts, None, prompt_cache, None)
    row.plan = (width, draft_block, policy)
    row.learn = learn_costs
    row.seed = seed if seed is not None else 0
    row.speculate, row.reply = True, _Cycles()
    dec = BatchDecoder(pair, None, max_batch=1)
    events: list[Event] = []
    dec.trace, dec.clock = events.append, clock
    cycles = list(dec.run(row))
    return cycles, events


def tokens(cycles) -> list[int]:
    return [t for c in cycles for t in c.tokens]


def plans(events) -> list:
    return [e.detail for e in events if e.kind == "plan"]


def records(events) -> list:
    return [e.detail for e in events if e.kind == "learn"]


def drive(
    policy,
    cost,
    accept,
    tokens: int,
    *,
    depth: int = 100,
    ticket=None,
    behind: tuple[int, int] = (0, 0),
    catch=None,
) -> list[tuple]:
    """Run `policy` as the engine does for one request of `tokens` tokens, without models:
    a cycle of width W drafting a block of L costs `cost(W, L)` seconds (W = 1: a plain
    step; a plain plan that stands runs its steps as one stretch) and accepts
    `accept(cycle, W)` drafts (at most W - 1). The draft's context is `behind` = (rows,
    lazy) until the first speculative cycle catches it up, in `catch(rows, lazy)` seconds.
    Returns a log of `(W, probe, accepted, seconds, times)` per cycle (a speculative
    cycle's seconds include its catch-up)."""
    from dflash_mlx.speed.port import Ask, Record

    ticket = ticket if ticket is not None else policy.begin(tokens)
    log, done = [], 0
    while done < tokens:
        ask = Ask(ticket, depth + done, tokens - done, *behind)
        plan = policy.plan([ask])
        w, block = plan.widths[0], plan.blocks[0]
        if w == 1:
            times = min(plan.stands + 1, tokens - done)
            seconds = cost(1, 1)
            policy.learn(Record((ask,), (1,), (0,), depth + done, seconds, block=1, times=times))
            log.append((1, False, 0, seconds, times))
            done += times
            continue
        seconds = cost(w, block)
        n = max(0, min(accept(len(log), w), w - 1))
        caught = catch(*behind) if any(behind) and catch is not None else 0.0
        record = Record(
            (ask,),
            (w,),
            (n,),
            depth + done,
            seconds,
            block=block,
            caught=behind[0],
            lazy=behind[1],
            caught_seconds=caught,
            probe=plan.probe,
        )
        policy.learn(record)
        log.append((w, plan.probe, n, seconds + caught, 1))
        behind = (0, 0)
        done += n + 1
    return log


def rate(log, skip: int = 0) -> float:
    """Tokens per second of a `drive` log, after its first `skip` tokens."""
    made = spent = 0.0
    for w, _, n, s, times in log:
        if w == 1:
            steps = max(0, times - skip)
            made, spent, skip = made + steps, spent + steps * s, max(0, skip - times)
        elif skip > 0:
            skip = max(0, skip - n - 1)
        else:
            made, spent = made + n + 1, spent + s
    return made / spent

"""The width chooser's probes and their budgets (SPEC 5.4, docs/cost-model.md): when plain
decoding wins, a speculative cycle is re-tried now and then, priced with everything it
costs (its cycle's loss and the draft's catch-up), within `probe_budget` of the decoding
time and `request_budget` of each request's (less for a short request, more for the first
look at a calibration not yet confirmed); and whether a prompt's draft context is worth
building in prefill (`builds_context`), where costs only extrapolated past the calibration
are a guess (`extrapolated`). A mixin of `WidthChooser` (`adaptive.py`), whose constructor
sets the fields it reads."""

from __future__ import annotations

import math

from .costs import depth_bucket

# Costs more than this many times the calibration's deepest point are only extrapolated
# until a plain step and a speculative cycle were timed there (`Probes.extrapolated`).
EXTRAPOLATED = 2.0


class Probes:
    """When the next probe comes, at what width, and what each request may spend on them."""

    def begin_request(self) -> None:
        """A new request starts: its own probe budget starts empty, and what earlier
        requests showed of the draft's acceptance stays only as a prior worth
        `REQUEST_MEMORY` cycles, with probes at the base interval again. Costs belong to
        the device and carry over whole; acceptance belongs to the text, and one prompt's
        useless drafts say little about the next prompt's (on the demo pair τ at W=16 runs
        from 1.1 to 14 across six stretches of standard-library code). So the request's
        first speculative cycle, on that prior alone, may lose no more than half its probe
        budget were every draft wrong, and when it falls well short of the prior, the
        prior goes (`update`)."""
        self.life_time += self.req_time
        self.life_lost += self.req_lost
        self.req_time = 0.0
        self.req_lost = 0.0
        self.req_tokens = None
        self.req_done = False
        self._coast = 0
        self.as_prior()
        self.carried = self.block > 1 and self.trials[1] > 0  # until its first speculative cycle
        self.follow_up = 0  # what the last request's good probe promised was its text's
        if self.probe_interval > self.base_probe and self.floor.net >= 0.0:
            # Speculation did not lose lately (as measured): probes at the base interval
            # again. Not merely while too few cycles were measured to call it `losing`: on
            # the stock wheel, where every probe lost, three failed probes a request were
            # too few, and each request reset the interval and spent its 3% (0.96x plain).
            self.probe_interval = self.base_probe
            self.since_probe = 0
        elif self.probe_interval > self.base_probe and (
            self.life_lost <= 1.5 * self.probe_budget * self.life_time
        ):
            # While speculation keeps losing on this device (measured), the interval keeps
            # what probes grew it to, but a new text is looked at: its first probe comes
            # within the base interval (as the request's budget affords it, `_probe`), not
            # after the interval that earlier texts grew, which a short request never
            # reaches (a chat of 96-token replies then stayed plain on texts whose drafts
            # were right 13 times in 14, at 0.4x the speed it had before). Such looks spend
            # at most 1.5 times the probe budget over the chooser's life: one a request cost
            # short requests on a device where nothing pays 1.8% of their time.
            self.since_probe = max(self.since_probe, self.probe_interval - self.base_probe)

    def coasting(self) -> bool:
        """Plain until the next probe is due, or dormant and far from it, the last decision
        stands for a few steps (what plain steps teach meanwhile cannot make speculation
        win), capturing features or not as it said (`capture`), and a plain step pays
        nothing for it (the full decision cost it ~50 us of host time): takes one such step
        and says so, or says there is none left (`choose` decides anew)."""
        if not self._coast:
            return False
        self._coast -= 1
        self.since_probe += 1
        self.req_time += self._coast_cost
        return True

    def _affordable(self, widths: list[int], limit: int, context: tuple[int, int]) -> bool:
        """Whether a probe could fit the budget of a request of `limit` tokens by its
        middle (one made later has too little left to win its cost back: a 64-token request
        on the stock wheel captured features for it for 20 steps and probed with 15 tokens
        left), woken on a window of context (`context`: what the draft is behind now)."""
        _, loss = self._probe_price(widths)
        loss += self.context_cost(min(context[0], self.window), context[1])
        return self.budget() * (0.5 * limit * self.plain_cost() + loss) >= loss

    def _probe_price(self, widths: list[int], follow_up: int = 0) -> tuple[int, float]:
        """A probe's width among `widths` (the best by rates not priced optimistically
        among the widths that could win, or the `follow_up` width promised) and what its
        cycle loses against plain decoding (as predicted, or as speculative cycles have
        lately really lost, if more). A width could win when its cycle, every draft right,
        commits its tokens in less time than plain decoding takes for them: a probe at a
        width that cannot only loses, and shows nothing a wider cycle could use (on the
        stock wheel a W=2 cycle costs 2.1 plain steps; such probes, chosen on the poor
        acceptance earlier probes left, were all a 256-token request made: 0.98x plain,
        where W=4 and wider pay on predictable texts). Until a speculative cycle has been
        timed here (`looked`), the probe is the first look at a calibration that may be
        stale: what it must show is what a cycle costs, which the cheapest width shows
        for all (a W=3 look on cached stock-wheel curves cost a 64-token request 10%)."""
        curve = self.curve(optimistic=False)
        spec = [w for w in widths if w > 1]
        if not self.looked:
            w = min(spec, key=lambda w: curve[w - 1])
        else:
            safe = self.rates(optimistic=False)
            useful = [w for w in spec if curve[w - 1] < w * curve[0]]
            w = max(useful or spec, key=lambda w: safe[w][0])
        if follow_up:
            w = max(w, min(follow_up, max(widths)))
        return w, max(self.probe_loss(w), self.floor.cycle_loss())

    def _probe(self, widths: list[int], limit: int | None, context: tuple[int, int]) -> int:
        """The width of a probe due now, or 1 when it is put off (or, when it can no longer
        pay back in what is left of the request, given up for the request); `context` the
        `(rows, lazy)` it would first catch the draft's context up on."""
        catch_up = self.context_cost(*context)
        # Everything it costs: the cycle's loss and the catch-up of the draft's context.
        w, loss = self._probe_price(widths, self.follow_up)
        loss += catch_up
        left = None if limit is None else limit - w
        if self._spec_seen and not self.follow_up and self.saving(left, perfect=True) <= loss:
            # Even were every draft accepted from here on, it would not pay back (by costs
            # measured: until one speculative cycle is, the calibration may be stale).
            self.req_done = True
            return 1
        t1 = self.plain_cost()
        b = self.budget()
        short = self.req_lost + loss - b * (self.req_time + loss)
        # A follow-up of a probe whose drafts were all accepted is not held back by the
        # budget: by the latest evidence it loses nothing.
        if short <= 0 or self.follow_up:
            self.probing = True
            self.probes += 1
            self.since_probe = 0
            self.req_lost += loss
            return w
        # This request cannot afford it yet: wait the steps that pay for it; none, when
        # half of what is left is decoded first (too little would be left to win its cost
        # back, `_affordable`). Capturing meanwhile, each step adds a row the probe must
        # first catch up on (at a cost that may outgrow what the step adds to the budget:
        # put off again and again, a 64-token request captured for 50 steps and never
        # probed); else dormant meanwhile, awake a window before, the catch-up a window's.
        wait = math.ceil(short / (b * t1))
        if context[0] and wait > 1:  # capturing: rows pile up
            base, row = loss - catch_up, self.context_cost(1)
            net = b * t1 - (1.0 - b) * row
            wait = math.ceil(short / net) if net > 0 else math.inf
            if wait > self.window:
                lw = base + self.context_cost(self.window, context[1])
                wait = max(
                    self.window + 1,
                    math.ceil((self.req_lost + lw - b * (self.req_time + lw)) / (b * t1)),
                )
        if left is not None and 2 * wait >= left:  # not before half of what is left
            self.req_done = True
        self.since_probe = self.probe_interval - min(wait, self.max_probe_interval)
        return 1

    @property
    def confirms(self) -> bool:
        """Whether the speculative cycles it timed agree with the calibration (their decayed
        log ratio to it, plain steps' scale applied, within a factor of 1.5)."""
        return self._spec_seen > 0 and abs(self.disagreement) <= math.log(1.5)

    @property
    def looked(self) -> bool:
        """Whether a speculative cycle's cost has been timed on this device, by this chooser
        or (`learn_from`) another of the pair's: until then it is the calibration's word."""
        return bool(self._spec_seen) or self._kin_seen

    def budget(self) -> float:
        """The share of the current request's time its probes may lose: `request_budget`,
        less for a request of fewer than `budget_tokens` tokens (in proportion); at least
        `first_look` until a speculative cycle has been timed (`looked`)."""
        b = self.request_budget
        if self.req_tokens is not None and self.budget_tokens > 0:
            b *= min(1.0, self.req_tokens / self.budget_tokens)
        return b if self.looked else max(b, self.first_look)

    def _probed(self, width: int, all_accepted: bool) -> None:
        """A probe of `width` ran: its interval grows while plain decoding wins, and a probe
        whose drafts were all accepted, and that did not lose against plain decoding (where
        a pass costs what its tokens do, all accepted still loses), is followed by one at
        twice the width."""
        rates = self.rates()
        if max(rates, key=lambda w: rates[w][0]) == 1 or self.floor.losing:
            self.probe_interval = min(2 * self.probe_interval, self.probe_cap(width))
        else:
            self.probe_interval = self.base_probe
        self.follow_up = 0
        if all_accepted and width < self.block and self.floor.last >= 0.0:
            self.follow_up = min(2 * width, self.block)
            self.since_probe = self.probe_interval  # the next plain choice probes

    def probe_loss(self, width: int) -> float:
        """Seconds a probe of `width` may lose against plain decoding at the current depth:
        what it loses when every draft is wrong (its cycle less the one token it commits
        whatever happens). A probe tests the acceptance, so the budget it is paid from
        bounds that loss, not the loss the acceptance so far expects: on an unwindowed
        draft at 1k tokens, acceptance learnt on short prompts priced each W=4 probe at
        0.5 plain steps where it lost 1.5-2.7, and a 128-token request made three
        (0.93x plain)."""
        curve = self.curve(optimistic=False)
        return max(curve[width - 1] - curve[0], 0.0)

    def probe_cap(self, width: int) -> int:
        """The longest interval between probes of `width`: just long enough that what a
        probe loses against plain decoding is at most `probe_budget` of the time between."""
        loss = max(self.probe_loss(width), self.floor.cycle_loss()) + self.context_cost(self.window)
        steps = math.ceil(loss / (self.probe_budget * self.plain_cost()))
        return max(self.base_probe, min(steps, self.max_probe_interval))

    def timed_at(self, depth: int) -> bool:
        """Whether a speculative cycle was timed in `depth`'s bucket (its acceptance, too,
        seen near that depth)."""
        bucket = self._buckets.get(depth_bucket(depth))
        return bucket is not None and bool(bucket.widths())

    def extrapolated(self, depth: int) -> bool:
        """Whether the costs at `depth` are only extrapolated: more than `EXTRAPOLATED`
        times the calibration's deepest point, and not both a plain step and a speculative
        cycle timed in its depth bucket (plain steps alone only scale the calibration's
        extrapolated widths: at 8k the first ones, which grow the caches, read 12.6 ms where
        later ones took 9, and a W=4 cycle on the prior lost 5% of a 64-token request)."""
        deepest = self.costs.depths[-1]  # 0: curves that hold at every depth
        if not 0 < EXTRAPOLATED * deepest < depth:
            return False
        bucket = self._buckets.get(depth_bucket(depth))
        return bucket is None or not bucket.seen[1] or not bucket.widths()

    def builds_context(self, depth: int, tokens: int | None, rows: int) -> bool:
        """Whether a prompt's draft context is worth building in its prefill (else the
        prefill is dormant, and a speculative cycle first catches up on a window): at
        `depth` speculation is expected to win, and to save more over the request's
        `tokens` than the `rows` of context the first cycle then evaluates cost (the
        prompt's last chunk: the target layers the draft reads and their projection), as
        `choose` weighs waking a dormant draft. The build is a bet on an acceptance that
        nothing of the prompt's text has shown, and it may lose all it costs; so where
        this depth's costs or acceptance are only guessed, that loss is bounded: where
        costs are only `extrapolated` (their noise multiplied), or no speculative cycle
        was timed in the depth's bucket (the acceptance was learnt on other contexts:
        shallower texts, whose drafts the unwindowed demo draft got right 4 times in 5 at
        W=5, where at 1k its first cycle committed one token), the context must also cost
        less than the request's probe budget (a long reply still gets the prompt's whole
        context). At 1k tokens such a build cost a 128-token request its first cycle,
        48 ms against 3 ms plain steps (0.87-0.90x mlx-lm, OpenBLAS); at 8k the demo
        draft's last 255 rows cost 7-11 plain steps, paid in a 64-token request's first
        cycle whatever it decides, on curves calibrated at 128 and 2048 tokens that priced
        a plain step there at 11 ms where it took 9 (0.82-0.94x mlx-lm before this
        check)."""
        if self.expects_plain(depth):
            return False
        if tokens is None or rows <= 0:
            return True
        cost = self.context_cost(rows, rows, depth)
        guessed = self.extrapolated(depth) or not self.timed_at(depth)
        if guessed and cost > self.request_budget * tokens * self.plain_cost(depth):
            return False  # a wrong guess would cost more than the request's probe budget
        return self.saving(tokens, depth=depth) > cost

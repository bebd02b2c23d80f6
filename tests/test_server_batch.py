"""Concurrent requests decoded in one batch (SPEC 8, `serve --max-batch`), against a real
uvicorn server on loopback through the official `openai` client.

Which requests share a batch is made certain, never left to timing: the server's target
passes are held (`gate`) until the engine holds every request of the test, and requests
are sent one after another, each once the engine holds the ones before, so that rows join
in a known order. The references come from `dflash_mlx.generate`, one request at a time,
while the server is idle. Each check is also run once against a broken engine and must
fail there (the tests named `..._has_power`). Nothing here decides from a duration.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest

import dflash_mlx
from dflash_mlx.cache.prompt_cache import CachedState
from dflash_mlx.engine import batch as batch_module
from dflash_mlx.engine import batch_cache
from dflash_mlx.engine.generate import Reply, encode_prompt
from dflash_mlx.server import batching
from dflash_mlx.server.engine import Job
from dflash_mlx.server.prompt_pool import PromptCachePool

from .test_cli_serve import dflash, serve, text
from .test_server import LONG, MODEL, TIMEOUT, WIDTH, Server, first_content, serving
from .test_server_structured import FORMAT

PROMPTS = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(4)]
MAX_TOKENS = [12, 20, 9, 16]  # each request its own: rows leave the batch at different cycles


# ---------------------------------------------------------------------------------------
# Helpers


def jobs(health: dict) -> int:
    return health["running"] + health["waiting"]


def admitted(health: dict) -> int:
    """Requests the engine has taken since it started: those it holds and those it ended.
    Never decreases (a request moves from held to ended under one lock)."""
    return jobs(health) + health["completed"] + health["cancelled"] + health["failed"]


@contextmanager
def gate(server: Server, held: Callable[[], bool]) -> Iterator[None]:
    """The server's target passes wait while `held()` is true (bounded by TIMEOUT)."""
    target = server.engine.pair.target
    real = target.forward

    def forward(tokens, cache, capture_ids):
        deadline = time.monotonic() + TIMEOUT
        while held() and time.monotonic() < deadline:
            time.sleep(0.002)
        return real(tokens, cache, capture_ids)

    target.forward = forward  # this server's adapter only, for this test
    try:
        yield
    finally:
        del target.forward


def until_engine_holds(server: Server, n: int) -> Callable[[], bool]:
    """A `gate` condition: hold until `n` requests are in the engine (then never again)."""
    opened = threading.Event()

    def held() -> bool:
        if not opened.is_set() and jobs(server.engine.status()) >= n:
            opened.set()
        return not opened.is_set()

    return held


def in_order(server: Server, pool: ThreadPoolExecutor, calls: list[Callable]) -> list:
    """Start `calls` on `pool`, each once the engine has taken the requests before it; their
    futures, in order.

    Waits on the count of requests the engine has taken, which never decreases: once the
    last one is in, a `gate` opens and the batch may finish (and the engine hold none)
    before a poll of /health on a loaded machine sees it held."""
    before = admitted(server.health())
    futures = []
    for i, call in enumerate(calls):
        futures.append(pool.submit(call))
        server.wait_until(lambda h, i=i: admitted(h) >= before + i + 1, f"request {i + 1} queued")
    return futures


@contextmanager
def recorded() -> Iterator[list[tuple[Job, object]]]:
    """Every item the engine hands to a request, in the order the worker handed them."""
    items: list[tuple[Job, object]] = []
    real = Job._put

    def put(self, item):
        items.append((self, item))
        real(self, item)

    Job._put = put
    try:
        yield items
    finally:
        Job._put = real


def ask(client: openai.OpenAI, messages, max_tokens: int):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


def streamed(client: openai.OpenAI, messages, max_tokens: int) -> str:
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def references(model_dir, draft, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[str]:
    model, tok = dflash_mlx.load(str(model_dir))
    return [
        dflash_mlx.generate(
            model, draft, tok, p, max_tokens=m, temperature=0, verify_width=WIDTH
        ).text
        for p, m in zip(prompts, max_tokens)
    ]


def concurrent_replies(server: Server) -> list:
    """The four PROMPTS sent at once (rows joining in that order), non-streaming."""
    server.wait_idle()
    client = server.client()
    with gate(server, until_engine_holds(server, len(PROMPTS))), ThreadPoolExecutor(4) as pool:
        calls = [lambda p=p, m=m: ask(client, p, m) for p, m in zip(PROMPTS, MAX_TOKENS)]
        futures = in_order(server, pool, calls)
        return [f.result(timeout=TIMEOUT) for f in futures]


def check_batched_and_identical(outs: list, refs: list[str]) -> None:
    """Every reply is its solo run's, and each ran in a batch with speculation on."""
    texts = [o.choices[0].message.content for o in outs]
    assert texts == refs, "a batched reply differs from its solo run"
    for out in outs:
        timings = out.model_extra["timings"]
        ran = timings["ran"]
        assert max(int(b) for b in ran["batches"] or {"1": 0}) > 1, f"never batched: {ran}"
        assert ran["draft"] == "active" and timings["draft_n"] > 0, f"no speculation: {ran}"
        assert any(int(w) > 1 for w in ran["widths"]), f"no verify width above 1: {ran}"
        assert timings["tau"] is not None and timings["tau"] >= 1, timings


@pytest.fixture(scope="module")
def server(models_dir) -> Iterator[Server]:
    with serving(models_dir, verify_width=WIDTH, max_batch=4) as s:
        yield s


@pytest.fixture(scope="module")
def refs(models_dir, draft) -> list[str]:
    return references(models_dir / "qwen3", draft)


# ---------------------------------------------------------------------------------------
# (a) Concurrent greedy requests: each its solo reply


def test_concurrent_requests_are_batched_and_each_equals_its_solo_run(server, refs):
    check_batched_and_identical(concurrent_replies(server), refs)
    health = server.wait_idle()
    assert health["max_batch"] == 4 and health["failed"] == 0


def test_concurrent_requests_on_a_hybrid_target_equal_their_solo_runs(models_dir, draft):
    refs = references(models_dir / "qwen35", draft)
    with serving(models_dir, target="qwen35", verify_width=WIDTH, max_batch=4) as s:
        check_batched_and_identical(concurrent_replies(s), refs)


def test_the_identity_check_has_power(server, refs, monkeypatch):
    """A batch cache that rewinds every row by the largest drop (one shared offset)."""

    def shared_drop(self, drops):
        self.lengths = [length - max(drops) for length in self.lengths]
        self.offset = batch_cache.mx.array(self.lengths)

    monkeypatch.setattr(batch_cache.RowsKVCache, "trim_rows", shared_drop)
    outs = concurrent_replies(server)
    with pytest.raises(AssertionError, match="differs from its solo run"):
        check_batched_and_identical(outs, refs)


def test_the_batched_check_has_power(server, refs, monkeypatch):
    """An engine that runs one request at a time: identical, but never batched."""
    monkeypatch.setattr(server.engine, "max_batch", 1)
    outs = concurrent_replies(server)
    with pytest.raises(AssertionError, match="never batched"):
        check_batched_and_identical(outs, refs)


def test_trees_grammars_and_penalties_run_in_the_batch_as_alone(server):
    """A tree request (verified as trees in the batch's passes), a JSON-schema one and one
    with a penalty, beside a plain one: each reply is the one the server gives it alone."""
    kinds = [
        {},
        {"extra_body": {"tree": True}},
        {"response_format": FORMAT},
        {"frequency_penalty": 0.5},
    ]
    client = server.client()

    def send(i: int):
        return client.chat.completions.create(
            model=MODEL, messages=PROMPTS[i], max_tokens=24, temperature=0, **kinds[i]
        )

    server.wait_idle()
    alone = [send(i) for i in range(4)]
    with gate(server, until_engine_holds(server, 4)), ThreadPoolExecutor(4) as pool:
        together = [f.result(timeout=TIMEOUT) for f in in_order(server, pool, [
            lambda i=i: send(i) for i in range(4)
        ])]  # fmt: skip
    texts = [o.choices[0].message.content for o in together]
    assert texts == [o.choices[0].message.content for o in alone], "batched differs from alone"
    for out in together:
        assert max(int(b) for b in out.model_extra["timings"]["ran"]["batches"]) > 1
    ran = together[1].model_extra["timings"]["ran"]
    assert ran["trees"] and ran["tree_note"] is None, ran


# ---------------------------------------------------------------------------------------
# (b) A client leaving mid-stream: the others finish as they would alone


def run_with_one_leaving(server: Server) -> tuple[list[str], int, dict, dict]:
    """Request 2 of 4 (LONG tokens) is closed by its client after its first content; from
    its first text on, every target pass waits until the engine has cancelled it (the
    others are then mid-reply). The three others' texts, the tokens the leaving one got
    after its first text, and /health before and after."""
    server.wait_idle()
    before = server.health()
    client = server.client()
    holds = until_engine_holds(server, len(PROMPTS))

    def leave() -> None:
        stream = client.chat.completions.create(
            model=MODEL, messages=PROMPTS[1], max_tokens=LONG, temperature=0, stream=True
        )
        first_content(stream)
        stream.close()

    calls = [lambda i=i: streamed(client, PROMPTS[i], MAX_TOKENS[i]) for i in (0, 2, 3)]
    calls.insert(1, leave)
    with recorded() as items:

        def leaving() -> bool:  # the leaving request has its first text, not yet cancelled
            mine = [j for j, r in items if j.options.max_tokens == LONG and getattr(r, "text", "")]
            return bool(mine) and not mine[0].cancelled

        with gate(server, lambda: holds() or leaving()), ThreadPoolExecutor(4) as pool:
            futures = in_order(server, pool, calls)
            outs = [f.result(timeout=TIMEOUT) for k, f in enumerate(futures) if k != 1]
            futures[1].result(timeout=TIMEOUT)
            server.wait_until(lambda h: h["cancelled"] > before["cancelled"], "cancelled")
        after = server.wait_idle()
    got = [r for job, r in items if job.options.max_tokens == LONG and hasattr(r, "stats")]
    shown = next(r for r in got if r.text).stats.generation_tokens
    return outs, got[-1].stats.generation_tokens - shown, before, after


def test_a_stream_cancelled_mid_batch_leaves_the_others_identical(server, refs):
    outs, spent, before, after = run_with_one_leaving(server)
    assert outs == [refs[0], refs[2], refs[3]], "a batched reply differs from its solo run"
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"] + 3
    # After its first text, at most the cycle its cancellation was waiting for.
    assert spent <= WIDTH, f"the abandoned request went on for {spent} tokens"


def test_the_cancellation_check_has_power(server, refs, monkeypatch):
    """A batch that keeps the wrong rows when one leaves (their order reversed)."""
    real = batch_module.keep_rows
    monkeypatch.setattr(batch_module, "keep_rows", lambda cache, rows: real(cache, rows[::-1]))
    outs, _, _, _ = run_with_one_leaving(server)
    assert outs != [refs[0], refs[2], refs[3]], "the broken batch went unnoticed"


# ---------------------------------------------------------------------------------------
# (c) A row failing inside the engine: its request alone gets the error


BAD = [{"role": "user", "content": "This one fails inside the engine, after two responses."}]


@contextmanager
def failing_row(prompt_tokens: int) -> Iterator[None]:
    """The row of the request whose prompt has `prompt_tokens` tokens fails at its third
    response (inside the decoder, on its own path)."""
    real = Reply.feed

    def feed(self, cyc):
        if self.stats.prompt_tokens == prompt_tokens and self.stats.generation_tokens >= 2:
            raise RuntimeError("injected failure of one row")
        return real(self, cyc)

    Reply.feed = feed
    try:
        yield
    finally:
        Reply.feed = real


def run_with_one_failing(server: Server, target) -> tuple[list, dict, dict]:
    """Request 2 of 4 fails mid-decode: what each of the four got (a reply or an error),
    /health before and after."""
    n_bad = len(encode_prompt(target[1], BAD))
    assert n_bad not in {len(encode_prompt(target[1], p)) for p in PROMPTS}
    server.wait_idle()
    before = server.health()
    client = server.client()

    def call(messages, max_tokens):
        try:
            return ask(client, messages, max_tokens)
        except openai.APIError as e:
            return e

    prompts = [PROMPTS[0], BAD, PROMPTS[2], PROMPTS[3]]
    budgets = [MAX_TOKENS[0], 30, MAX_TOKENS[2], MAX_TOKENS[3]]
    held = until_engine_holds(server, 4)
    with failing_row(n_bad), gate(server, held), ThreadPoolExecutor(4) as pool:
        calls = [lambda p=p, m=m: call(p, m) for p, m in zip(prompts, budgets)]
        got = [f.result(timeout=TIMEOUT) for f in in_order(server, pool, calls)]
    return got, before, server.wait_idle()


def check_one_failed(got: list, refs: list[str]) -> None:
    bad = got[1]
    assert isinstance(bad, openai.InternalServerError), f"the failing request got {bad!r}"
    assert bad.status_code == 500 and "internal error" in bad.message, bad.message
    others = [g.choices[0].message.content if not isinstance(g, Exception) else g for g in got]
    assert [others[0], others[2], others[3]] == [refs[0], refs[2], refs[3]], (
        "a batched reply differs from its solo run"
    )


def test_a_row_failing_in_the_engine_fails_its_request_alone(server, refs, target):
    got, before, after = run_with_one_failing(server, target)
    check_one_failed(got, refs)
    assert after["failed"] == before["failed"] + 1
    assert after["completed"] == before["completed"] + 3
    assert after["status"] == "ok" and after["restarts"] == before["restarts"]
    out = ask(server.client(), PROMPTS[0], MAX_TOKENS[0])  # still serving
    assert out.choices[0].message.content == refs[0]


def test_the_failure_check_has_power(server, refs, target, monkeypatch):
    """An engine where one row's error ends the whole batch."""
    real = batching.Batcher._dispatch

    def dispatch(self, out):
        real(self, out)
        error = next((item for _, item in out if isinstance(item, RuntimeError)), None)
        if error is not None:
            self._fail_all(error)

    monkeypatch.setattr(batching.Batcher, "_dispatch", dispatch)
    got, _, _ = run_with_one_failing(server, target)
    with pytest.raises(AssertionError, match="differs from its solo run"):
        check_one_failed(got, refs)


# ---------------------------------------------------------------------------------------
# (d) The queue: max_batch running, then max_queue waiting, then 503 with Retry-After


def fill_the_queue(server: Server, accepted: int) -> tuple[list, list]:
    """Requests sent while the engine's passes are held, until one is refused (at most
    accepted + 1): the accepted ones' replies (after the passes resume), the refusals."""
    server.wait_idle()
    client = server.client()
    release = threading.Event()
    refused = []
    with gate(server, lambda: not release.is_set()), ThreadPoolExecutor(accepted + 1) as pool:
        calls = [lambda i=i: ask(client, PROMPTS[i], MAX_TOKENS[i]) for i in range(accepted)]
        try:
            futures = in_order(server, pool, calls)
            extra = pool.submit(ask, client, PROMPTS[accepted], MAX_TOKENS[accepted])
            server.wait_until(
                lambda h: extra.done() or jobs(h) > accepted, "the extra request answered or queued"
            )
        finally:
            release.set()
        replies = [f.result(timeout=TIMEOUT) for f in futures]
        try:
            replies.append(extra.result(timeout=TIMEOUT))
        except openai.InternalServerError as e:
            refused.append(e)
    return replies, refused


def check_refused(replies: list, refused: list, refs: list[str]) -> None:
    assert refused, "the request beyond max_batch + max_queue was not refused"
    e = refused[0]
    assert e.status_code == 503 and e.code == "queue_full", e
    assert e.response.headers["retry-after"].isdigit()
    assert [r.choices[0].message.content for r in replies] == refs[: len(replies)], (
        "a batched reply differs from its solo run"
    )


@pytest.fixture(scope="module")
def pair_server(models_dir) -> Iterator[Server]:
    """--max-batch 2 --max-queue 1."""
    with serving(models_dir, verify_width=WIDTH, max_batch=2, max_queue=1) as s:
        yield s


def test_beyond_max_batch_and_max_queue_requests_get_503_with_retry_after(pair_server, refs):
    before = pair_server.health()
    replies, refused = fill_the_queue(pair_server, accepted=3)  # 2 running + 1 waiting
    check_refused(replies, refused, refs)
    pair_server.engine.max_queue = 0
    try:
        replies, refused = fill_the_queue(pair_server, accepted=2)  # the batch alone
        check_refused(replies, refused, refs)
    finally:
        pair_server.engine.max_queue = 1
    after = pair_server.wait_idle()
    assert after["rejected"] == before["rejected"] + 2
    assert after["completed"] == before["completed"] + 5


def test_the_queue_check_has_power(pair_server, refs, monkeypatch):
    """An engine whose queue has no bound."""
    monkeypatch.setattr(pair_server.engine, "max_queue", 100)
    replies, refused = fill_the_queue(pair_server, accepted=3)
    with pytest.raises(AssertionError, match="was not refused"):
        check_refused(replies, refused, refs)


def two_requests(server: Server, budget: int) -> list:
    """Two requests sent at once to a server whose rows may hold `budget` positions."""
    engine = server.engine
    server.wait_idle()
    old, engine.max_batch_tokens = engine.max_batch_tokens, budget
    try:
        client = server.client()
        held = until_engine_holds(server, 2)
        with gate(server, held), ThreadPoolExecutor(2) as pool:
            calls = [lambda i=i: ask(client, PROMPTS[i], MAX_TOKENS[i]) for i in range(2)]
            return [f.result(timeout=TIMEOUT) for f in in_order(server, pool, calls)]
    finally:
        engine.max_batch_tokens = old


def check_one_after_the_other(outs: list, refs: list[str]) -> None:
    assert [o.choices[0].message.content for o in outs] == refs[:2]
    for out in outs:
        batches = out.model_extra["timings"]["ran"]["batches"]
        assert set(batches) <= {"1"}, f"rows over max_batch_tokens ran together: {batches}"


def first_alone(server: Server) -> int:
    """The positions of the first request alone: the second does not fit beside it."""
    return len(encode_prompt(server.engine.tokenizer, PROMPTS[0])) + MAX_TOKENS[0]


def test_rows_beyond_max_batch_tokens_wait_until_the_batch_empties(pair_server, refs):
    """Two requests whose positions exceed max_batch_tokens together run one after the
    other (a lone request over the budget still runs)."""
    check_one_after_the_other(two_requests(pair_server, first_alone(pair_server)), refs)
    check_one_after_the_other(two_requests(pair_server, 1), refs)


def test_the_budget_check_has_power(pair_server, refs):
    """A budget that holds both: they run together, which the check must see."""
    outs = two_requests(pair_server, 2 * first_alone(pair_server) + 100)
    with pytest.raises(AssertionError, match="ran together"):
        check_one_after_the_other(outs, refs)


# ---------------------------------------------------------------------------------------
# (e) A late request starts while the others stream


def run_a_late_request(server: Server) -> tuple[list, str, str]:
    """Request A streams; once it has its first token, its passes wait until request B is
    in the engine. What the engine handed out, in order, and both texts."""
    server.wait_idle()
    client = server.client()
    with recorded() as items:
        b_in = until_engine_holds(server, 2)

        def held() -> bool:  # A has had its first token, and B is not in yet
            return bool(items) and b_in()

        with gate(server, held), ThreadPoolExecutor(2) as pool:
            a = pool.submit(streamed, client, PROMPTS[0], 60)
            server.wait_until(lambda h: len(items) > 0, "A's first token")
            b = pool.submit(streamed, client, PROMPTS[1], 6)
            text_a, text_b = a.result(timeout=TIMEOUT), b.result(timeout=TIMEOUT)
    server.wait_idle()
    return list(items), text_a, text_b


def check_b_started_while_a_streamed(items: list) -> None:
    """B's first response was handed out before A's last one, and A went on after it."""
    a = items[0][0]
    responses = [(job is a, item) for job, item in items if hasattr(item, "finish_reason")]
    b_first = next(k for k, (is_a, _) in enumerate(responses) if not is_a)
    a_last = max(k for k, (is_a, r) in enumerate(responses) if is_a and r.finish_reason)
    assert b_first < a_last, "the late request's first token came after the others finished"
    assert any(is_a for is_a, _ in responses[b_first + 1 :]), "A did not go on after B started"


def test_a_late_request_starts_while_others_stream(server, models_dir, draft):
    refs = references(models_dir / "qwen3", draft, PROMPTS[:2], [60, 6])
    items, text_a, text_b = run_a_late_request(server)
    check_b_started_while_a_streamed(items)
    assert [text_a, text_b] == refs


def test_the_late_request_check_has_power(server, monkeypatch):
    """An engine that serializes: B waits for A to finish."""
    monkeypatch.setattr(server.engine, "max_batch", 1)
    items, _, _ = run_a_late_request(server)
    with pytest.raises(AssertionError, match="after the others finished"):
        check_b_started_while_a_streamed(items)


# ---------------------------------------------------------------------------------------
# (f) A long prompt admitted while another request streams never freezes that stream


def long_prompt(first: str) -> list[dict]:
    """~1800 tokens, four prefill chunks of 512; a `first` word of its own, so that no
    prompt cache holds any of it."""
    return [{"role": "user", "content": first + " fox" * 600}]


def stream_while_a_long_prompt_is_admitted(server: Server, first: str) -> list[int]:
    """Request A streams; request B, a prompt of several prefill chunks, arrives. How many
    responses the engine had handed to A's client when each of B's chunks started."""
    server.wait_idle()
    client = server.client()
    seen: list[int] = []
    target = server.engine.pair.target
    real = target.forward
    with recorded() as items:

        def forward(tokens, cache, capture_ids):
            if tokens.shape[1] >= 256:  # one of B's prefill chunks
                a = items[0][0]
                seen.append(sum(job is a for job, _ in items))
            return real(tokens, cache, capture_ids)

        target.forward = forward
        try:
            with ThreadPoolExecutor(2) as pool:
                a = pool.submit(streamed, client, PROMPTS[0], 400)
                server.wait_until(lambda h: len(items) > 2, "A streaming")
                b = pool.submit(streamed, client, long_prompt(first), 4)
                b.result(timeout=TIMEOUT)
                a.result(timeout=TIMEOUT)
        finally:
            del target.forward
    server.wait_idle()
    return seen


def test_a_long_prompt_admitted_mid_stream_leaves_the_stream_flowing(server):
    """The running stream's tokens made between the long prompt's chunks go to its client
    before the next chunk starts: it waits for one chunk and one cycle, not for the whole
    admission (issue 34)."""
    seen = stream_while_a_long_prompt_is_admitted(server, "wolf")
    assert len(seen) >= 3, f"the long prompt ran in {len(seen)} chunks"
    assert all(b > a for a, b in zip(seen, seen[1:])), seen


def test_the_long_prompt_check_has_power(server, monkeypatch):
    """A decoder that keeps the running rows' responses until the admission ends."""
    monkeypatch.setattr(batch_module.BatchDecoder, "_hand_out", lambda self: None)
    seen = stream_while_a_long_prompt_is_admitted(server, "bear")
    assert len(seen) >= 3
    assert not any(b > a for a, b in zip(seen, seen[1:])), seen


# ---------------------------------------------------------------------------------------
# Prompt caches: one request at a time each


def test_a_prompt_cache_in_use_is_never_handed_out_again():
    """Two requests running at once never share a PromptCache, even of one conversation
    or with every slot taken; released, the pool keeps its slots and its conversations."""
    pool = PromptCachePool(1)
    a = pool.acquire([1, 2, 3])
    b = pool.acquire([1, 2, 3])  # the same conversation again, while `a` runs
    c = pool.acquire([4, 5])  # the only slot is taken
    assert len({id(a), id(b), id(c)}) == 3, "a running request's cache was handed out again"
    lease, _ = a.take("model", None)
    a.commit(lease, CachedState(owner=("model", None), tokens=[1, 2, 3, 9], target_cache=[]))
    for pc in (b, c, a):
        pool.release(pc)
    assert pool._caches == [a], "the pool keeps as many caches as its slots"
    assert pool.acquire([1, 2, 3, 9, 7]) is a, "the next turn continues its conversation"


# ---------------------------------------------------------------------------------------
# The command


def test_serve_refuses_a_max_batch_below_one():
    done = dflash("serve", "--model", "org/m", "--max-batch", "0")
    out, err = text(done)
    assert done.returncode == 2, err
    assert err.startswith("error: --max-batch 0 must be >= 1"), err


def test_serve_says_its_batch_size(models_dir):
    with serve("--model", str(models_dir / "qwen3"), "--max-batch", "3") as server:
        out = server.post("/v1/completions", {"model": "x", "prompt": "def", "max_tokens": 2})
    assert out["usage"]["completion_tokens"] == 2
    log = " ".join("".join(server.log).split())
    assert "batches of up to 3 requests" in log, log

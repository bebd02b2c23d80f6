"""`dflash-mlx serve` through the official `openai` client, against a real uvicorn server.

The servers run in this process on a free 127.0.0.1 port over their own copy of the tiny
session pair; the references come from `dflash_mlx.generate` on the session fixtures, always
while the server is idle (only one thread runs MLX at a time). One test starts the real
command in a subprocess. Every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.cache.prompt_cache import common_prefix
from dflash_mlx.cli.main import app as cli_app
from dflash_mlx.cli.serve import exposure_warning
from dflash_mlx.engine.generate import encode_prompt
from dflash_mlx.server import Engine, ServerSettings, create_server

MODEL = "tiny"
WIDTH = 4  # the main server's verify width: real draft-and-verify cycles (tau ~ 1 here)
TIMEOUT = 60.0  # seconds, for every client call and every wait
LONG = 4000  # tokens for a request that must still be running while the test acts
KEY = "sk-test-key"
USER = [{"role": "user", "content": "def add(a, b):"}]


@dataclass
class Server:
    base: str
    engine: Engine

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base}/v1", api_key=api_key, timeout=TIMEOUT, max_retries=0
        )

    def health(self) -> dict:
        return httpx.get(f"{self.base}/health", timeout=TIMEOUT).json()

    def wait_until(self, condition, what: str) -> dict:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            state = self.health()
            if condition(state):
                return state
            time.sleep(0.02)
        raise AssertionError(f"server never reached: {what} (last /health: {state})")

    def wait_idle(self) -> dict:
        return self.wait_until(
            lambda h: h["status"] == "ok" and not h["running"] and not h["waiting"], "idle"
        )


@contextmanager
def serving(
    models_dir, *, target="qwen3", draft="draft", settings=None, **engine_kwargs
) -> Iterator[Server]:
    """A real uvicorn server on a free loopback port over its own copy of a model pair;
    `settings`: ServerSettings fields beyond the defaults here."""
    api_key = engine_kwargs.pop("api_key", None)
    # The server's generation defaults (e.g. verify_width) go to the engine's options.
    names = {f.name for f in dataclasses.fields(dflash_mlx.GenerateOptions)}
    defaults = {k: engine_kwargs.pop(k) for k in list(engine_kwargs) if k in names}
    model, tok = dflash_mlx.load(str(models_dir / target))
    pair = dflash_mlx.Pair(model, dflash_mlx.load_draft(str(models_dir / draft)))
    options = dflash_mlx.GenerateOptions(**defaults)
    engine = Engine(pair, tok, options=options, **engine_kwargs)
    fields = dict(
        model_id=MODEL, api_key=api_key, default_max_tokens=16, context_length=pair.context_limit
    )
    settings = ServerSettings(**{**fields, **(settings or {})})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = create_server(engine, settings, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    handle = Server(f"http://127.0.0.1:{sock.getsockname()[1]}", engine)
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{handle.base}/health", timeout=TIMEOUT).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            raise AssertionError("the server did not become healthy")
        yield handle
    finally:
        server.should_exit = True
        thread.join(timeout=TIMEOUT)
        sock.close()
    assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def server(models_dir) -> Iterator[Server]:
    with serving(models_dir, verify_width=WIDTH) as s:
        yield s


@pytest.fixture(scope="module")
def strict_server(models_dir) -> Iterator[Server]:
    """--api-key, --max-queue 1 behind one request at a time (--max-batch 1), the engine's
    own (automatic) verify width."""
    with serving(models_dir, api_key=KEY, max_queue=1, max_batch=1) as s:
        yield s


@pytest.fixture
def client(server) -> openai.OpenAI:
    server.wait_idle()  # references below run MLX on this thread: never beside the worker
    return server.client()


def reference(target, draft, prompt, max_tokens: int, **kw) -> dflash_mlx.GenerationResult:
    model, tok = target
    return dflash_mlx.generate(
        model, draft, tok, prompt, max_tokens=max_tokens, temperature=0, verify_width=WIDTH, **kw
    )


def streamed_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = ""
    for c in chunks:
        if c.choices:
            choice = c.choices[0]
            text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
    return text, chunks


# ---------------------------------------------------------------------------------------
# Completions


def test_models_endpoint_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_completion_at_temperature_0_equals_library_generate(client, target, draft):
    ref = reference(target, draft, USER, 12)
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text, "server and library disagree at temperature 0"
    assert choice.finish_reason == ref.finish_reason
    prompt_tokens = len(encode_prompt(target[1], USER))
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == ref.generation_tokens
    assert out.usage.total_tokens == prompt_tokens + ref.generation_tokens
    timings = out.model_extra["timings"]
    assert timings["predicted_n"] == ref.generation_tokens
    assert timings["cycles"] == ref.cycles and timings["verify_width"] == WIDTH
    assert timings["draft_n"] == sum(ref.drafted_per_position) > 0
    assert timings["draft_n_accepted"] == sum(ref.accepted_per_position)
    assert timings["tau"] == pytest.approx(ref.mean_acceptance)


def test_streamed_chat_matches_the_reference_and_ends_with_usage(client, target, draft):
    ref = reference(target, draft, USER, 12)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, chunks = streamed_text(stream)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == ref.finish_reason and finishes.count(None) == len(finishes) - 1
    assert chunks[-1].choices == [], "the usage chunk comes last, without choices"
    assert chunks[-1].usage.completion_tokens == ref.generation_tokens
    assert chunks[-1].usage.prompt_tokens == len(encode_prompt(target[1], USER))
    assert all(c.usage is None for c in chunks[:-1])


def test_text_completion_streamed_and_not_equals_library_generate(client, target, draft):
    prompt = "The quick brown fox"
    ref = reference(target, draft, prompt, 10)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(encode_prompt(target[1], prompt))
    assert out.usage.completion_tokens == ref.generation_tokens
    text, chunks = streamed_text(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True
        )
    )
    assert text == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_token_id_prompts_and_sampling_seeds_are_honoured(client, target, draft):
    ids = target[1].encode("for i in range(10):")
    ref = reference(target, draft, ids, 6)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert out.choices[0].text == ref.text
    kw = dict(model=MODEL, messages=USER, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    first = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw).choices[0].message.content == first


def test_a_vanishing_temperature_is_greedy_decoding(client, target, draft):
    ref = reference(target, draft, USER, 12)
    for temperature in (1e-39, 1e-6):  # 1/T overflows: sampled as written, it is garbage
        out = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=12, temperature=temperature, seed=1
        )
        assert out.choices[0].message.content == ref.text, temperature


def test_stop_strings_are_never_emitted_even_across_chunk_boundaries(client, target, draft):
    model, tok = target
    pieces = [
        r.text
        for r in dflash_mlx.stream_generate(
            model, draft, tok, USER, max_tokens=24, temperature=0, verify_width=WIDTH
        )
    ]
    full = "".join(pieces)
    # A stop string made of the end of one streamed piece and the start of the next.
    cut = None
    for i in range(1, len(pieces) - 1):
        k = len("".join(pieces[: i + 1]))
        if pieces[i] and pieces[i + 1] and full.find(full[k - 1 : k + 1]) == k - 1:
            cut = k - 1
            break
    assert cut is not None, f"no usable chunk boundary in {pieces!r}"
    stop = full[cut : cut + 2]
    for stops in (stop, ["never-in-the-output", stop]):
        kw = dict(model=MODEL, messages=USER, max_tokens=24, temperature=0, stop=stops)
        out = client.chat.completions.create(**kw)
        assert out.choices[0].message.content == full[:cut]
        assert out.choices[0].finish_reason == "stop"
        text, chunks = streamed_text(client.chat.completions.create(**kw, stream=True))
        assert text == full[:cut], f"stop {stop!r} leaked into the stream"
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_eight_concurrent_streaming_clients_match_sequential_runs(client, target, draft):
    prompts = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(8)]
    refs = [reference(target, draft, p, 8).text for p in prompts]

    def ask(messages) -> str:
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        return streamed_text(stream)[0]

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(ask, prompts, timeout=TIMEOUT))
    assert outs == refs, "a concurrent run differs from its sequential reference"


def test_second_turn_prefills_only_the_new_tokens(client, target, draft):
    tok = target[1]
    ref1 = reference(target, draft, USER, 8)
    out1 = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0)
    reply = out1.choices[0].message.content
    assert reply == ref1.text
    turn2 = USER + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and the quick brown fox"},
    ]
    out2 = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8, temperature=0)
    p1, p2 = encode_prompt(tok, USER), encode_prompt(tok, turn2)
    # Reusable: every committed position (all but the last generated token) shared with turn 2.
    expected = min(common_prefix((p1 + ref1.tokens)[:-1], p2), len(p2) - 1)
    assert expected >= len(p1) - 1, "the test's turns should share the first prompt"
    timings = out2.model_extra["timings"]
    assert timings["cache_n"] == expected, "turn 2 did not reuse turn 1's prompt cache"
    assert timings["prompt_n"] == len(p2) - expected, "turn 2 prefilled more than its new tokens"
    assert out2.usage.prompt_tokens_details.cached_tokens == expected
    assert out2.choices[0].message.content == reference(target, draft, turn2, 8).text


def test_a_new_conversation_reuses_a_prefix_another_one_cached(models_dir, target, draft):
    """Agents resend one long system prompt from many conversations: a new conversation
    prefills only what follows the prefix it shares with a cached one, and that one keeps
    its own cache (two slots: the second conversation finds a free one)."""
    tok = target[1]
    system = {"role": "system", "content": "You are a coding agent. " * 40}
    a = [system, {"role": "user", "content": "def add(a, b):"}]
    b = [system, {"role": "user", "content": "for i in range(10):"}]
    c = [system, {"role": "user", "content": "import os"}]
    pa, pb, pc = (encode_prompt(tok, m) for m in (a, b, c))
    ref_a, ref_b, ref_c = (reference(target, draft, m, 6) for m in (a, b, c))
    with serving(models_dir, verify_width=WIDTH, prompt_cache_slots=2) as s:
        client = s.client()
        kw = dict(model=MODEL, max_tokens=6, temperature=0)
        out_a = client.chat.completions.create(messages=a, **kw)
        assert out_a.model_extra["timings"]["cache_n"] == 0
        out_b = client.chat.completions.create(messages=b, **kw)
        shared = common_prefix(pa, pb)
        assert shared > 200
        assert out_b.model_extra["timings"]["cache_n"] == shared, "B prefilled the shared prefix"
        assert out_b.choices[0].message.content == ref_b.text
        # A's cache survived B: A's next turn reuses its whole first exchange.
        a2 = a + [
            {"role": "assistant", "content": out_a.choices[0].message.content},
            {"role": "user", "content": "and the quick brown fox"},
        ]
        out_a2 = client.chat.completions.create(messages=a2, **kw)
        pa2 = encode_prompt(tok, a2)
        expected = min(common_prefix((pa + ref_a.tokens)[:-1], pa2), len(pa2) - 1)
        assert out_a2.model_extra["timings"]["cache_n"] == expected, "B took A's cache"
        assert out_a2.choices[0].message.content == reference(target, draft, a2, 6).text
        # The pool is full (A, B): C still starts from the prefix.
        out_c = client.chat.completions.create(messages=c, **kw)
        assert out_c.model_extra["timings"]["cache_n"] == common_prefix(pa, pc)
        assert out_c.choices[0].message.content == ref_c.text


# ---------------------------------------------------------------------------------------
# Errors


MSG = [{"role": "user", "content": "hi"}]
CHAT, TEXT = "chat/completions", "completions"
LONG_TEXT = "fox " * 5000  # more tokens than the tiny target's 4096 positions
IMAGE = [{"type": "image_url", "image_url": {"url": "x"}}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]
TYPE, VALUE, MISSING = "invalid_type", "invalid_value", "missing_required_parameter"
UNSUPPORTED, CONTEXT = "unsupported_parameter", "context_length_exceeded"
ERRORS = [
    # (what, path, body, status, param, code)
    ("malformed JSON", CHAT, b'{"messages": [', 400, None, None),
    ("messages of a wrong type", CHAT, {"messages": "hi"}, 400, "messages", TYPE),
    ("max_tokens of a wrong type", CHAT, {"messages": MSG, "max_tokens": "5"}, 400, "max_tokens",
     TYPE),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages", MISSING),
    ("missing prompt", TEXT, {"model": MODEL}, 400, "prompt", MISSING),
    ("negative max_tokens", CHAT, {"messages": MSG, "max_tokens": -3}, 400, "max_tokens", VALUE),
    ("chat over the context", CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400,
     "messages", CONTEXT),
    ("prompt over the context", TEXT, {"prompt": LONG_TEXT}, 400, "prompt", CONTEXT),
    ("token id outside the vocabulary", TEXT, {"prompt": [1, 10**6]}, 400, "prompt", VALUE),
    ("n > 1", CHAT, {"messages": MSG, "n": 2}, 400, "n", UNSUPPORTED),
    ("tools, to a template without tool support", CHAT, {"messages": MSG, "tools": TOOLS}, 400,
     "tools", "tools_unsupported"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400,
     "top_logprobs", VALUE),
    ("an image part", CHAT, {"messages": [{"role": "user", "content": IMAGE}]}, 400,
     "messages[0].content", UNSUPPORTED),
    ("an unknown route", "embeddings", {"input": "x"}, 404, None, None),
]  # fmt: skip


def test_errors_are_openai_shaped_and_leave_the_server_working(client, server, target, draft):
    for what, path, body, status, param, code in ERRORS:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        headers = {"Content-Type": "application/json"}
        r = httpx.post(f"{server.base}/v1/{path}", timeout=TIMEOUT, headers=headers, **kw)
        assert r.status_code == status, f"{what}: {r.status_code} {r.text}"
        err = r.json()["error"]
        assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
        assert err["message"] and err["type"] == "invalid_request_error", what
        assert (err["param"], err["code"]) == (param, code), f"{what}: {err}"
    with pytest.raises(openai.BadRequestError) as e:  # the official client reads them too
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=-1)
    assert e.value.param == "max_tokens"
    ref = reference(target, draft, USER, 6)
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    assert out.choices[0].message.content == ref.text, "a bad request changed a later one"
    assert server.health()["status"] == "ok"


def test_a_body_must_be_sent_as_json(server):
    """A web page can POST text/plain or a form without a CORS preflight: such bodies are
    refused, so no page can drive the server."""
    body = b'{"prompt": "def", "max_tokens": 2}'
    for ctype in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"Content-Type": ctype} if ctype else {}
        r = httpx.post(
            f"{server.base}/v1/completions", content=body, headers=headers, timeout=TIMEOUT
        )
        assert r.status_code == 415, (ctype, r.text)
        assert "application/json" in r.json()["error"]["message"]
    r = httpx.post(
        f"{server.base}/v1/completions",
        content=body,
        headers={"Content-Type": "application/json; charset=utf-8"},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_api_key_is_required_when_set(strict_server):
    with pytest.raises(openai.AuthenticationError) as e:
        strict_server.client("sk-wrong").models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.post(f"{strict_server.base}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT)
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    out = strict_server.client(KEY).completions.create(model=MODEL, prompt="def", max_tokens=2)
    assert out.usage.completion_tokens == 2
    assert httpx.get(f"{strict_server.base}/health", timeout=TIMEOUT).status_code == 200
    preflight = httpx.options(  # a browser's CORS check carries no key
        f"{strict_server.base}/v1/chat/completions",
        headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
        timeout=TIMEOUT,
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"]


# ---------------------------------------------------------------------------------------
# The worker: queue, disconnects


def first_content(stream) -> Iterator:
    """The stream's iterator, advanced past its first content chunk (so the job is running)."""
    it = iter(stream)
    for chunk in it:
        if chunk.choices and chunk.choices[0].delta.content:
            return it
    raise AssertionError("the stream ended before any content")


def test_full_queue_answers_503_with_retry_after(strict_server):
    strict_server.wait_idle()
    client = strict_server.client(KEY)
    long = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=LONG, temperature=0, stream=True
    )
    try:
        first_content(long)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(
                client.completions.create, model=MODEL, prompt="def", max_tokens=2
            )
            strict_server.wait_until(lambda h: h["waiting"] == 1, "one request waiting")
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model=MODEL, prompt="def", max_tokens=2)
            assert e.value.status_code == 503 and e.value.code == "queue_full"
            assert e.value.response.headers["retry-after"].isdigit()
            long.close()  # the running request goes away: the waiting one runs
            assert waiting.result(timeout=TIMEOUT).usage.completion_tokens == 2
    finally:
        long.close()
    health = strict_server.wait_idle()
    assert health["rejected"] >= 1 and health["cancelled"] >= 1


@contextmanager
def held_until_cancelled(server, hold: threading.Event | None = None):
    """Decode passes of the running request wait, once `hold` is set (default: from its
    first cycle on), until the request is cancelled: the client's departure always finds
    the request running and the worker free to notice it, however fast this machine is."""
    target = server.engine.pair.target
    real = target.forward
    passes = [0]

    def forward(tokens, cache, capture_ids):
        passes[0] += 1
        held = hold.is_set() if hold is not None else passes[0] > 2  # after the prefill
        job = server.engine.running
        deadline = time.monotonic() + TIMEOUT
        while held and job is not None and not job.cancelled and time.monotonic() < deadline:
            time.sleep(0.005)
        return real(tokens, cache, capture_ids)

    target.forward = forward  # this pair's adapter only, for this test
    try:
        yield
    finally:
        del target.forward


def test_a_client_leaving_mid_stream_frees_the_worker(client, server):
    before = server.health()
    hold = threading.Event()
    with held_until_cancelled(server, hold):
        long = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=LONG, temperature=0, stream=True
        )
        next(first_content(long))
        hold.set()
        long.close()
        server.wait_until(lambda h: h["cancelled"] > before["cancelled"], "cancelled")
    # The worker is free: the next request runs (it would wait behind a request never
    # cancelled until the client's own timeout).
    out = client.completions.create(model=MODEL, prompt="def", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
    after = server.wait_idle()
    assert after["cancelled"] == before["cancelled"] + 1
    spent = after["generated_tokens"] - before["generated_tokens"] - 2
    assert spent < LONG // 8, f"the abandoned request went on for {spent} tokens"


def test_a_client_giving_up_on_a_whole_response_frees_the_worker(client, server):
    before = server.health()
    with held_until_cancelled(server):
        with pytest.raises(httpx.ReadTimeout):  # the client leaves before the response is ready
            body = {"model": MODEL, "prompt": "def", "max_tokens": LONG, "temperature": 0}
            httpx.post(f"{server.base}/v1/completions", json=body, timeout=0.5)
        after = server.wait_until(lambda h: h["cancelled"] > before["cancelled"], "cancelled")
    server.wait_idle()
    spent = after["generated_tokens"] - before["generated_tokens"]
    assert spent < LONG // 8, f"the abandoned request went on for {spent} tokens"


# ---------------------------------------------------------------------------------------
# The command


def test_exposure_warning_only_for_other_interfaces_without_a_key():
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("::1", None) is None
    assert exposure_warning("localhost", None) is None
    assert "api-key" in exposure_warning("0.0.0.0", None)
    assert exposure_warning("0.0.0.0", "k") is None


def test_serve_refuses_bad_options_with_exit_code_2(models_dir):
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    runner = CliRunner()
    result = runner.invoke(cli_app, ["serve", "--demo", *pair])
    assert result.exit_code == 2 and "--demo" in result.output
    for bad, named in (
        (["--cors-origin", "evil.example"], "--cors-origin"),
        (["--max-body-mb", "0"], "--max-body-mb"),
        (["--api-key", " "], "--api-key"),
    ):
        result = runner.invoke(cli_app, ["serve", *pair, *bad])
        assert result.exit_code == 2 and named in result.output, result.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        result = runner.invoke(cli_app, ["serve", *pair, "--port", port])
    assert result.exit_code == 2 and "cannot listen" in result.output


def test_serve_command_answers_and_stops_cleanly_on_ctrl_c(models_dir):
    target = str(models_dir / "qwen3")
    cmd = [sys.executable, "-c", "from dflash_mlx.cli.main import app; app()", "serve"]
    cmd += ["--model", target, "--draft", str(models_dir / "draft"), "--port", "0"]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A shell that runs the tests in the background has SIGINT ignored, and children
        # inherit that: give the command the default Ctrl-C a user's terminal gives it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()
    log: list[str] = []
    try:
        deadline = time.monotonic() + TIMEOUT
        port = None
        while port is None and time.monotonic() < deadline:
            try:
                log.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, "".join(log)
                continue
            found = re.search(r"serving http://127\.0\.0\.1:(\d+)/v1", log[-1])
            port = found and int(found.group(1))
        assert port, "".join(log)
        base = f"http://127.0.0.1:{port}"
        handle = Server(base, engine=None)
        handle.wait_until(lambda h: h["status"] == "ok", "ok")
        ids = [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=TIMEOUT).json()["data"]]
        assert ids == [target]
        client = handle.client()  # a local folder's name works as the model name too
        # Greedy: a sampled first token may be EOS (it was, once in CI), and this test is
        # about the command serving and stopping, not about sampling.
        out = client.completions.create(model="qwen3", prompt="def", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT) == 130, "Ctrl-C: a clean stop, exit code 130"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
    reader.join(timeout=TIMEOUT)
    while not lines.empty():
        log.append(lines.get())
    assert "terminate called" not in "".join(log), "".join(log)
    assert os.environ.get("DFLASH_MLX_CACHE"), "the subprocess must use the session cache"


def test_the_listening_socket_lets_asyncio_set_tcp_nodelay():
    """asyncio sets TCP_NODELAY on accepted connections only when the listening socket says
    it is TCP; without it each reply on a kept-alive connection waits for a delayed ACK."""
    from dflash_mlx.cli.serve import listen

    sock = listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_any_model_name_is_served_by_the_loaded_model(client, server, target, draft):
    """Clients hard-code model names: the loaded model answers them all (as mlx-lm's server
    and llama-server do) and says which it is; retrieving an unknown model by name is a 404."""
    ref = reference(target, draft, USER, 6)
    for name in ("gpt-4o", "whatever", MODEL):
        out = client.chat.completions.create(model=name, messages=USER, max_tokens=6, temperature=0)
        assert out.choices[0].message.content == ref.text and out.model == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"


def test_the_log_has_one_line_per_request_with_its_figures(client, server, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="dflash_mlx.server")
    client.completions.create(model=MODEL, prompt="def", max_tokens=5, temperature=0)
    server.wait_idle()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("request completed: 5 tokens · ") and "tok/s · τ " in line, line
    assert "W=" in line and "prefill " in line and line.endswith(" s"), line
    assert " · hit max_tokens · " in line, line

"""DFlash on a target sharded across ranks (`--shard`, `dflash_mlx.distributed`): two ranks
on 127.0.0.1 over MLX's ring backend, started by `mlx.launch` as users start them, each run
bounded in time. The flag's refusals are fast; the two-rank runs are slow (CI's slow set).

What they show: rank 0's tokens at temperature 0 are one process's and mlx-lm's own greedy
decode of the sharded target; every rank decodes the same tokens with the same τ (the silent
ranks' are written to files by `distributed_rank.py`); a seeded sampled run is the same on
every rank and in one process; `serve` answers the openai SDK from rank 0 with one process's
replies and batches concurrent requests; a rank killed mid-request ends the others within
10 s with one clear error.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_mlx.demo import demo_pair

from .test_cli_faults import run, serve_never_listens, user_error  # noqa: F401
from .test_cli_serve import dflash, exe, text

HERE = Path(__file__).parent
LAUNCH = [
    sys.executable,
    "-c",
    "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
]
TIMEOUT = 240  # seconds for a whole two-rank run (two processes on a shared 2-core CPU)
PROMPT = "class Stack:"


def free_ports(n: int = 2) -> int:
    """A first port of `n` consecutive free ones (the ring backend takes one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n >= 65535:
            continue
        try:
            held = []
            for p in range(first, first + n):
                t = socket.socket()
                held.append(t)
                t.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
    raise RuntimeError("no free ports")


def env() -> dict:
    root = str(HERE.parent)
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}",
        "OPENBLAS_NUM_THREADS": "1",
        "COLUMNS": "120",
    }


def launch_cmd(*command: str) -> list[str]:
    return [
        *LAUNCH,
        "--backend",
        "ring",
        "--hosts",
        "127.0.0.1",
        "-n",
        "2",
        "--starting-port",
        str(free_ports()),
        "--",
        *command,
    ]


def start(*command: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        launch_cmd(*command),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(),
        start_new_session=True,  # its ranks are ended with it if the test gives up
        **kw,
    )


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"two ranks still ran after {timeout} s:\n{err.decode()[-3000:]}")
    return proc.returncode, out.decode(), err.decode()


def launched(*command: str, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    return finish(start(*command), timeout)


def ranks(
    mode: str, out: Path, *, alone: bool = False, pair=None, shard="tensor", **settings
) -> list[dict]:
    """`distributed_rank.py` on two ranks (or `alone`): what each rank decoded (`pair`:
    target and draft folders, default the demo pair)."""
    target, draft = pair or demo_pair()
    out.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable,
        str(HERE / "distributed_rank.py"),
        mode,
        str(target),
        str(draft),
        str(out),
        json.dumps({"prompt": PROMPT, **settings}),
        shard,
    ]
    if alone:
        done = subprocess.run(args, capture_output=True, timeout=TIMEOUT, env=env())
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        return [json.loads((out / "rank0.json").read_text())]
    code, _, err = launched(*args)
    assert code == 0, err[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


# -- the flag, refused before anything loads (fast) -------------------------------------------


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_shard_refusals_are_one_line_exit_2(command):
    cases = [
        (["--shard", "bogus"], ["--shard 'bogus'", "auto, tensor, pipeline, none"]),
        (["--shard", "pipeline"], ["--shard pipeline", "'qwen3' supports tensor sharding only"]),
        (["--shard", "tensor"], ["--shard tensor", "not one of several ranks", "mlx.launch"]),
    ]
    for flags, names in cases:
        extra = [PROMPT] if command == "generate" else ["--port", "0"]
        user_error(run(command, "--demo", *flags, *extra), *names)


def test_chat_across_ranks_is_refused_naming_why(tmp_path, monkeypatch):
    why = ["chat does not run across ranks", "never closes it", "dflash-mlx serve"]
    user_error(run("chat", "--demo", "--shard", "tensor"), "chat --shard tensor", *why)
    user_error(run("chat", "--demo", "--shard", "pipeline"), "chat --shard pipeline", *why)
    user_error(run("chat", "--demo", "--shard", "bogus"), "--shard 'bogus'", "auto, tensor")
    # Started by mlx.launch (its variables: a rank, a hostfile of two): refused by default,
    # and with --shard none, before anything loads.
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("MLX_HOSTFILE", str(hosts))
    user_error(run("chat", "--demo"), "chat under mlx.launch", *why)
    user_error(run("chat", "--demo", "--shard", "none"), "chat --shard none", "mlx.launch")


@pytest.mark.parametrize("value", ["abc", "0", "-3", "inf", "nan"])
def test_a_bad_watchdog_timeout_is_one_line_before_loading(tmp_path, monkeypatch, value):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("MLX_HOSTFILE", str(hosts))
    for name in ("DFLASH_MLX_RANK_TIMEOUT", "DFLASH_MLX_STALL_TIMEOUT"):
        monkeypatch.setenv(name, value)
        result = run("generate", "--demo", "--shard", "tensor", PROMPT)
        user_error(result, f"{name}={value!r}", "seconds > 0")
        monkeypatch.delenv(name)


def test_rank_0_failing_after_a_peer_vanished_names_the_peer():
    """A rank killed mid-collective: rank 0's own collective may fail (its peer gone) before
    its watcher reads the closed connection, and the session then ends as failing. The
    one line it says is the cause, the vanished rank, not its collective's error."""
    import threading

    from dflash_mlx.distributed.control import Channel

    ch = Channel.__new__(Channel)  # rank 0's side of the control connections, unconnected
    ch.rank, ch.size, ch.said_bye, ch.gone, ch.failures = 0, 2, set(), set(), []
    ch.heard, ch.ending, ch._lock = {}, True, threading.Lock()  # rank 0 is already ending
    said: list[tuple[str, int]] = []
    ch._abort = lambda message, code=1, grace=False: said.append((message, code))
    mine, theirs = socket.socketpair()
    theirs.close()  # rank 1 is gone, without a word
    ch._watch_peer(1, mine)
    assert ch.gone == {1}
    said.clear()  # (the watcher's own attempt: rank 0 was ending, so it said nothing)
    ch.failed_first(1, wait=0.5)
    assert said == [("rank 1 ended without a word (killed, or its machine is gone): "
                     "every rank stops", 1)]  # fmt: skip
    mine.close()


@pytest.mark.parametrize("code,says", [(1, True), (2, True), (0, False), (130, False)])
def test_a_failing_rank_whose_leader_vanished_names_rank_0(monkeypatch, code, says):
    """Rank 0 killed mid-collective: rank 1's own collective may fail first, and rank 1 ends
    as failing (telling rank 0, which is gone) before its watcher reads the closed
    connection. The watcher still says that rank 0 ended: no abort came, and rank 1's
    failure follows from rank 0's loss. A rank ending cleanly, or on Ctrl-C, says nothing."""
    import queue
    import threading

    from dflash_mlx.distributed import control
    from dflash_mlx.distributed.control import CLOSED, Channel

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    said: list[str] = []
    monkeypatch.setattr(control, "say", lambda message, fresh_line=False: said.append(message))
    monkeypatch.setattr(control.os, "_exit", exit_)
    ch = Channel.__new__(Channel)  # rank 1's side of its connection to rank 0
    ch.rank, ch.size, ch.said_bye, ch.aborted, ch.heard = 1, 2, set(), None, {}
    ch.inbox, ch.ending, ch.failing, ch._lock = queue.Queue(), False, False, threading.Lock()
    mine, theirs = socket.socketpair()
    ch.leader = mine
    theirs.close()  # rank 0 is gone, without a word
    ch.close(code, "RuntimeError: [ring] the peer closed the connection")
    if says:
        with pytest.raises(Exited):
            ch._watch_leader()
        assert said == [
            "error: rank 0 ended without a word (killed, or its machine is gone): rank 1 stops too"
        ]
    else:
        ch._watch_leader()
        assert said == [] and ch.inbox.get_nowait() is CLOSED
    mine.close()


def test_a_rank_ending_tells_the_others_its_exit_code():
    """How each way a rank's command ends is told to the others: a command's chosen exit
    (click's and typer's, distinct classes in typer >= 0.10), Ctrl-C, a bad argument, ours."""
    import click
    import typer

    from dflash_mlx.distributed.cluster import _exit_code
    from dflash_mlx.errors import BadArgument

    assert _exit_code(None) == 0
    assert _exit_code(typer.Exit(130)) == 130 and _exit_code(typer.Exit()) == 0
    assert _exit_code(click.exceptions.Exit(2)) == 2
    assert _exit_code(KeyboardInterrupt()) == 130
    assert _exit_code(BadArgument("x")) == 2 and _exit_code(RuntimeError("x")) == 1
    assert _exit_code(SystemExit(3)) == 3


def test_a_silent_rank_failing_alone_before_joining_says_its_line(tmp_path):
    """Rank 1 (silent: rank 0 speaks) fails before the ranks join, where rank 0 saw no
    error: after waiting for rank 0 to say it, it says its own line, naming itself, on its
    real stderr; nothing on stdout. (Rank 0's side: the chat test under mlx.launch.)"""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    done = subprocess.run(
        [*exe(), "generate", "--demo", "--shard", "bogus", PROMPT],
        capture_output=True,
        timeout=120,
        env={**env(), "MLX_RANK": "1", "MLX_HOSTFILE": str(hosts)},
    )
    err = done.stderr.decode()
    assert done.returncode == 2 and not done.stdout.strip(), err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --shard 'bogus'"), err
    assert lines[0].endswith("(rank 1)") and "auto, tensor" in lines[0], err


@pytest.mark.slow
def test_chat_under_mlx_launch_ends_with_one_line_not_a_hang():
    code, out, err = launched(*exe(), "chat", "--demo", timeout=120)
    # Every rank refuses alike; rank 0 says it (the other waits for it to, and the launcher
    # ends it once rank 0 has exited): one line, whichever rank the launcher saw end first.
    assert "chat under mlx.launch" in one_error(err), err
    assert "(rank 1)" not in err, err
    assert re.search(r"Node with rank [01] exited with code 2", err) and not out.strip(), err


def test_a_family_mlx_lm_cannot_shard_is_named(tmp_path):
    target, _ = demo_pair()
    folder = tmp_path / "starcoder"
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((target / f).read_bytes())
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "starcoder2",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 2048,
                "norm_epsilon": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": True,
            }
        )
    )
    result = run("generate", "--model", str(folder), "--no-draft", "--shard", "tensor", "hi")
    user_error(result, "target family 'starcoder2'", "neither tensor nor pipeline", "--shard none")


def test_shard_none_and_auto_alone_are_todays_path():
    for flag in ("none", "auto"):
        result = run(
            "generate", "--demo", "--raw", "-n", "8", "--verify-width", "4", "--json",
            "--shard", flag, PROMPT,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["generation_tokens"] == 8


# -- two ranks (slow) -------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_two_ranks_greedy_is_one_process_and_mlx_lm(tmp_path):
    args = ["generate", "--demo", "--raw", "-n", "64", "--verify-width", "8", "--json", PROMPT]
    code, out, err = launched(*exe(), *args, "--shard", "tensor")
    assert code == 0, err
    assert out.count("\n") == 1, out  # one JSON object: rank 0's; rank 1 is silent
    two = json.loads(out)
    done = dflash(*args)
    assert done.returncode == 0, text(done)[1]
    one = json.loads(text(done)[0])
    assert two["tokens"] == one["tokens"] and len(two["tokens"]) == 64
    assert two["mean_acceptance"] == one["mean_acceptance"] > 1.5
    assert two["ran"] == one["ran"]
    # mlx-lm's own greedy decode of the sharded target, on the same ranks.
    plain = ranks("mlx-lm", tmp_path / "mlx-lm", max_tokens=64)
    assert plain[0]["tokens"] == plain[1]["tokens"] == two["tokens"]


@pytest.mark.slow
def test_every_rank_decodes_the_same_and_a_seed_replays_in_one_process(tmp_path):
    sampled = dict(max_tokens=48, temperature=0.8, seed=7, verify_width=8)
    both = ranks("dflash", tmp_path / "sampled", **sampled)
    alone = ranks("dflash", tmp_path / "alone", alone=True, **sampled)
    assert both[0] == both[1]  # tokens, τ, cycles, widths: the same cycle on both ranks
    assert both[0]["tokens"] == alone[0]["tokens"] and both[0]["tau"] == alone[0]["tau"]
    # The automatic width: timing-based choices are rank 0's on every rank.
    auto = ranks("dflash", tmp_path / "auto", max_tokens=64, temperature=0.0)
    assert auto[0] == auto[1]  # the calibration too: rank 0's curves on both ranks
    assert auto[0]["calibration"] is not None
    assert auto[0]["tokens"] == alone_greedy(tmp_path)


def alone_greedy(tmp_path) -> list[int]:
    return ranks("mlx-lm", tmp_path / "greedy", alone=True, max_tokens=64)[0]["tokens"]


@pytest.mark.slow
def test_serve_two_ranks_answers_the_openai_sdk_like_one_process(tmp_path):
    from openai import OpenAI

    from .test_cli_serve import serve

    prompts = [PROMPT, "def f(x):", "import os\n", "for i in range("]

    def ask(client) -> tuple[list[str], str]:
        def one(p: str) -> str:
            r = client.completions.create(model="m", prompt=p, max_tokens=24, temperature=0)
            return r.choices[0].text

        from concurrent.futures import ThreadPoolExecutor

        single = one(PROMPT)
        stream = client.completions.create(
            model="m", prompt=PROMPT, max_tokens=24, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].text for c in stream)
        assert streamed == single
        # A client that leaves mid-stream: its row is cancelled (on every rank, at one step).
        left = client.completions.create(
            model="m", prompt="def g(", max_tokens=150, temperature=0, stream=True
        )
        for _, _ in zip(range(3), left):
            pass
        left.close()
        chat = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0
        )
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(one, prompts))
        return [single, streamed, chat.choices[0].message.content, *together]

    with serve("--demo", "--verify-width", "8") as one_process:
        expected = ask(OpenAI(base_url=f"{one_process.base}/v1", api_key="x", max_retries=0))

    port = free_ports(1)
    proc = start(*exe(), "serve", "--demo", "--verify-width", "8", "--port", str(port))
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                client.models.list()
                break
            except Exception:  # noqa: BLE001 - not listening yet
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                assert time.monotonic() < deadline
                time.sleep(0.3)
        assert ask(client) == expected
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
    err = err.decode()
    widest = max(int(n) for n in __import__("re").findall(r"batched ≤(\d+)", err) or ["1"])
    assert widest >= 2, err[-3000:]  # the concurrent requests decoded together
    assert err.count("serving http://") == 1  # rank 0 alone speaks


def hybrid_pair(root: Path) -> tuple[Path, Path]:
    """A tiny random Qwen3.5 pair (GatedDeltaNet and attention layers, which mlx-lm can
    split into a pipeline), its weights indexed as `sharded_load` reads a checkpoint's."""
    import mlx.core as mx

    from dflash_mlx.models.tiny import (
        build_draft,
        build_target,
        draft_config,
        qwen35_config,
        write_tokenizer,
    )

    target, draft = root / "target", root / "draft"
    target.mkdir(parents=True)
    write_tokenizer(target)
    build_target(target, qwen35_config(), seed=3)
    build_draft(draft, draft_config(4, [1, 2]), seed=4)  # layer 1 on rank 1, layer 2 on 0
    names = mx.load(str(target / "model.safetensors"))
    index = {"weight_map": {k: "model.safetensors" for k in names}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target, draft


@pytest.mark.slow
def test_pipeline_two_ranks_share_the_captured_layers(tmp_path):
    """Each rank holds two of the four layers; the draft reads layer 1 (rank 1's) and 2
    (rank 0's): both ranks decode mlx-lm's greedy tokens of the pipelined target, the same
    cycles, and a seeded sampled run is one process's."""
    import numpy as np

    pair = hybrid_pair(tmp_path / "pair")
    split = ranks("features", tmp_path / "f2", pair=pair, shard="pipeline")
    whole = ranks("features", tmp_path / "f1", pair=pair, alone=True)[0]["features"]
    for r in split:  # each rank reads every captured layer, its own and the other's
        np.testing.assert_allclose(np.array(r["features"]), np.array(whole), atol=1e-4)
    both = ranks("dflash", tmp_path / "greedy", pair=pair, shard="pipeline",
                 max_tokens=32, verify_width=4)  # fmt: skip
    plain = ranks("mlx-lm", tmp_path / "plain", pair=pair, shard="pipeline", max_tokens=32)
    alone = ranks("mlx-lm", tmp_path / "alone", pair=pair, alone=True, max_tokens=32)
    assert both[0] == both[1]
    assert both[0]["tokens"] == plain[0]["tokens"] == plain[1]["tokens"] == alone[0]["tokens"]
    sampled = dict(max_tokens=32, temperature=0.8, seed=5, verify_width=4)
    two = ranks("dflash", tmp_path / "sampled", pair=pair, shard="pipeline", **sampled)
    one = ranks("dflash", tmp_path / "sampled1", pair=pair, alone=True, **sampled)
    assert two[0] == two[1] and two[0]["tokens"] == one[0]["tokens"]
    assert two[0]["tau"] == one[0]["tau"]


def _rank_pid(launcher: subprocess.Popen, rank: int, timeout: float = 60) -> int:
    """The pid of `rank` among the launcher's processes (read from their environment)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if f"MLX_RANK={rank}".encode() in environ and int(stat.split()[5]) == launcher.pid:
                return int(pid)  # same session as the launcher we started
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never started")


def _mid_request(proc: subprocess.Popen) -> None:
    """Wait until rank 0 has streamed some text (the launch is mid-request)."""
    os.set_blocking(proc.stdout.fileno(), False)
    seen, deadline = b"", time.monotonic() + TIMEOUT
    while len(seen) < 40:
        assert proc.poll() is None and time.monotonic() < deadline
        seen += proc.stdout.read() or b""
        time.sleep(0.1)
    os.set_blocking(proc.stdout.fileno(), True)


@pytest.mark.slow
@pytest.mark.parametrize("victim,survivor_says", [(1, "rank 1 ended"), (0, "rank 0 ended")])
def test_a_rank_killed_mid_request_ends_the_others_by_the_lost_link(victim, survivor_says):
    """The survivor notices the killed rank's closed connection: with the heartbeat's
    timeout far past the run's (NO_HEARTBEAT), nothing else could end it in time. Decided
    by what ended it, not by seconds."""
    proc = start_with(NO_HEARTBEAT,
        *exe(), "generate", "--demo", "--raw", "-n", "3000", "--verify-width", "4",
        "--shard", "tensor", PROMPT,
    )  # fmt: skip
    pid = _rank_pid(proc, victim)
    _mid_request(proc)
    os.kill(pid, signal.SIGKILL)
    _, _, err = finish(proc)  # mlx.launch itself exits 0 whatever its ranks did
    assert "DFLASH_MLX_RANK_TIMEOUT" not in err, "ended by the heartbeat, not the lost link"
    assert f"Node with rank {victim} exited with code -9" in err
    assert survivor_says in one_error(err), err


@pytest.mark.slow
def test_the_launchers_sigterm_before_the_loss_is_seen_waits_for_the_survivors_word():
    """mlx.launch ends every rank (SIGTERM) once one has exited with an error, and on a loaded
    machine that can reach the survivor before it has seen its peer go. Here it comes first
    on purpose: rank 1 is sent SIGTERM, rank 0 is killed half a second later, and rank 1
    still says that rank 0 ended (not ended by the signal at once, which would have rank 0
    gone unexplained, or taken for the one that vanished)."""
    proc = start_with(NO_HEARTBEAT, *exe(), *GENERATE, PROMPT)
    survivor, victim = _rank_pid(proc, 1), _rank_pid(proc, 0)
    _mid_request(proc)
    os.kill(survivor, signal.SIGTERM)
    time.sleep(0.5)
    try:
        os.kill(victim, signal.SIGKILL)
    except ProcessLookupError:
        raise AssertionError("rank 1 ended at once on SIGTERM: the launcher ended rank 0") from None
    _, _, err = finish(proc)
    assert "DFLASH_MLX_RANK_TIMEOUT" not in err, "ended by the heartbeat, not the lost link"
    assert "Node with rank 0 exited with code -9" in err
    assert "Node with rank 1 exited with code 1" in err, err
    assert "rank 0 ended" in one_error(err), err


# -- failures: every rank ends with one line, never a hang (slow) ------------------------------

GENERATE = ["generate", "--demo", "--raw", "-n", "3000", "--verify-width", "4", "--shard", "tensor"]


# A heartbeat timeout longer than any run's TIMEOUT: a rank can only learn of a lost peer
# from its closed connection.
NO_HEARTBEAT = {"DFLASH_MLX_RANK_TIMEOUT": str(10 * TIMEOUT)}


def start_with(extra_env: dict, *command: str) -> subprocess.Popen:
    return subprocess.Popen(
        launch_cmd(*command),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env(), **extra_env},
        start_new_session=True,
    )


def one_error(err: str) -> str:
    """The one `error:` message among the launcher's lines (rich may wrap it), on one line.
    mlx.launch prints its `[WARN] Node with rank N exited …` lines piece by piece from
    another thread than the ranks' output, so a rank's line can land inside one: its pieces
    are taken out first."""
    assert "Traceback" not in err, err
    clean = re.sub(r"\x1b\[33m\[WARN\]|\x1b\[0m", "\n", err)
    clean = re.sub(r" ?Node with rank \d+ (exited with code -?\d+|was killed) ?", "\n", clean)
    lines = [ln.strip() for ln in clean.splitlines()]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("error:")]
    assert len(starts) == 1, err
    message = []
    for ln in lines[starts[0] :]:
        if message and (not ln or re.search(r"^\[ring\]|closed by the peer|recv errors", ln)):
            break  # the launcher's own lines, taken out; the ring backend's (its pieces too)
        message.append(ln)
    return " ".join(message)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,settings,says",
    [
        ("1:raise:5", {}, "rank 1 failed: RuntimeError: injected fault on rank 1"),
        ("0:raise:5", {}, "internal error: RuntimeError: on rank 0 of 2: injected fault"),
        # Rank 1's main thread never returns (its heartbeat goes on): rank 0 waits in a
        # collective, and the stall watchdog ends it.
        ("1:hang:5", {"DFLASH_MLX_STALL_TIMEOUT": "3"}, "made no progress for"),
    ],
)
def test_a_rank_failing_mid_request_ends_every_rank_with_one_line(fault, settings, says):
    proc = start_with({"DFLASH_MLX_TEST_FAULT": fault, **settings}, *exe(), *GENERATE, PROMPT)
    code, out, err = finish(proc, timeout=TIMEOUT)
    assert out, err  # rank 0 had streamed text: the failure came mid-request
    message = one_error(err)
    assert says in message, err
    for rank in (0, 1):  # every rank ended with an error (none with 0, none left running)
        assert re.search(rf"Node with rank {rank} exited with code (1|-15)\b", err), err


@pytest.mark.slow
@pytest.mark.parametrize("victim,says", [(1, "rank 1 stopped answering"), (0, "rank 0 stopped")])
def test_a_rank_that_stops_answering_is_noticed_within_the_timeout(victim, says):
    """SIGSTOP: the rank neither fails nor closes its connection; the others notice its
    missing heartbeat after DFLASH_MLX_RANK_TIMEOUT (3 s here) and end with one line.
    mlx.launch waits for the stopped rank: the test ends it."""
    proc = start_with({"DFLASH_MLX_RANK_TIMEOUT": "3"}, *exe(), *GENERATE, PROMPT)
    pid = _rank_pid(proc, victim)
    os.set_blocking(proc.stdout.fileno(), False)
    os.set_blocking(proc.stderr.fileno(), False)
    seen, err, deadline = b"", b"", time.monotonic() + TIMEOUT
    try:
        while len(seen) < 40:
            assert proc.poll() is None and time.monotonic() < deadline, err.decode()
            seen += proc.stdout.read() or b""
            err += proc.stderr.read() or b""
            time.sleep(0.1)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while b"\nerror:" not in b"\n" + err and time.monotonic() < stopped + 30:
            err += proc.stderr.read() or b""
            time.sleep(0.1)
        noticed = time.monotonic() - stopped
    finally:
        os.kill(pid, signal.SIGKILL)
    assert noticed < 10, err.decode()
    assert noticed >= 2.5  # not before the timeout: the rank was alive until stopped
    os.set_blocking(proc.stderr.fileno(), True)
    _, _, rest = finish(proc, timeout=60)
    err = err.decode() + rest
    assert says in one_error(err) and "DFLASH_MLX_RANK_TIMEOUT" in err, err
    survivor = 1 - victim
    assert f"Node with rank {survivor} exited with code 1" in err, err


def serving(extra_env: dict, *flags: str) -> tuple[subprocess.Popen, str]:
    """`serve --demo` on two ranks: the launcher, and rank 0's base URL once it answers."""
    port = free_ports(1)
    proc = start_with(extra_env, *exe(), "serve", "--demo", "--port", str(port), *flags)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + TIMEOUT
    import httpx

    while True:
        try:
            if httpx.get(f"{base}/health", timeout=5).json()["status"] == "ok":
                return proc, base
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _, _, err = finish(proc, timeout=30)
            pytest.fail(f"the server never answered:\n{err[-3000:]}")
        time.sleep(0.3)


def stop_serving(proc: subprocess.Popen) -> str:
    """Ctrl-C as a terminal sends it: to every process of the group (each rank ends); the
    launcher's stderr. Never fails itself (a failure in the test's body stays the one
    reported): ranks still running after 60 s are killed, which the text then says."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
        return err.decode()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return err.decode() + "\n(the ranks still ran 60 s after Ctrl-C: killed)"


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,stream,says",
    [
        ("1:raise:8", True, "rank 1 failed: RuntimeError: injected fault on rank 1"),
        ("0:raise:8", False, "rank 0 failed in a decode step: RuntimeError: injected fault"),
    ],
)
def test_serve_answers_requests_in_flight_when_a_rank_fails_then_ends(fault, stream, says):
    import httpx

    proc, base = serving({"DFLASH_MLX_TEST_FAULT": fault}, "--verify-width", "4")
    try:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 400, "temperature": 0}
        with httpx.Client(timeout=60) as client:
            if stream:  # the headers went out with the first tokens: the error is an event
                with client.stream(
                    "POST", f"{base}/v1/completions", json={**body, "stream": True}
                ) as reply:
                    assert reply.status_code == 200
                    events = [ln[6:] for ln in reply.iter_lines() if ln.startswith("data: ")]
                assert len(events) > 2 and "[DONE]" not in events, events  # mid-request
                error = json.loads(events[-1])["error"]
                assert error["code"] == "shutting_down", error
            else:
                reply = client.post(f"{base}/v1/completions", json=body)
                assert reply.status_code == 503, reply.text
                error = reply.json()["error"]
            assert error["type"] == "server_error" and says in error["message"], error
            # Then the server ends: new requests are refused, never left hanging.
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert proc.poll() is not None
            with pytest.raises(httpx.ConnectError):
                client.post(f"{base}/v1/completions", json=body)
    finally:
        err = stop_serving(proc)
    assert says in one_error(err), err


# -- the prompt store across ranks (slow) -------------------------------------------------------


@pytest.mark.slow
def test_serve_two_ranks_reuses_a_stored_prompt_prefix_like_one_process(tmp_path):
    """A long prompt, a short one, the first again (one conversation slot: the third request
    resumes from the store, not the pool): every rank restores the same stored blocks of
    its own shard (the third prefills only the rest, said in `timings`), the replies are one
    process's; a second server on the same folders reads the blocks back from each rank's
    own folder."""
    import inspect
    import textwrap

    import httpx

    from .test_cli_serve import serve

    long_a = inspect.getsource(textwrap)[:3000]  # ~980 tokens: 3 blocks of 256
    # Another prompt takes the one slot. (A long one would do too, but a tensor-parallel
    # target's sums run in another order than one process's: on a long prompt the demo's
    # near-ties can go the other way, as in mlx-lm's own greedy decode of the split target.)
    short = "import os\n"
    flags = ["--verify-width", "4", "--prompt-cache-size", "1"]

    def ask(base: str, prompts: list[str]) -> list[tuple[str, dict]]:
        out = []
        with httpx.Client(timeout=TIMEOUT) as client:
            for p in prompts:
                body = {"model": "m", "prompt": p, "max_tokens": 16, "temperature": 0}
                r = client.post(f"{base}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                out.append((r.json()["choices"][0]["text"], r.json()["timings"]))
        return out

    one_dir = tmp_path / "one"
    with serve("--demo", *flags, "--prompt-cache-dir", str(one_dir)) as one_process:
        expected = ask(one_process.base, [long_a, short, long_a])
    assert expected[2][1]["cache_memory_n"] == 768  # the reference reused it too

    two_dir = tmp_path / "two"
    proc, base = serving({}, *flags, "--prompt-cache-dir", str(two_dir))
    try:
        got = ask(base, [long_a, short, long_a])
    except Exception:
        print(stop_serving(proc))  # the ranks' side, with the failure
        raise
    err = stop_serving(proc)
    assert "error:" not in err and "still ran" not in err, err  # (mlx.launch dies of Ctrl-C)
    # Ctrl-C right after the last reply: each rank ends as interrupted (130), none as failed,
    # and the others' block writes of that last request are not cut short (below).
    assert re.search(r"rank 0 exited with code 130", err), err
    assert not re.search(r"exited with code (1|-15)\b", err), err
    assert [t for t, _ in got] == [t for t, _ in expected]
    first, _, again = (timings for _, timings in got)
    assert first["cache_memory_n"] == 0
    assert again["cache_memory_n"] == 768 and again["prompt_n"] < first["prompt_n"] - 700
    folders = sorted(p.name for p in two_dir.iterdir())
    assert folders == ["tensor-2-rank0", "tensor-2-rank1"], folders
    for f in folders:  # each rank wrote its own shard's blocks
        assert len(list((two_dir / f).rglob("*.block"))) >= 3, list((two_dir / f).rglob("*"))

    # A new server on the same folders: each rank reads its blocks from its own disk folder.
    proc, base = serving({}, *flags, "--prompt-cache-dir", str(two_dir))
    try:
        ((text_a, timings),) = ask(base, [long_a])
    except Exception:
        print(stop_serving(proc))
        raise
    err = stop_serving(proc)
    assert "error:" not in err and "still ran" not in err, err
    assert text_a == expected[0][0]
    assert timings["cache_disk_n"] == 768, timings


def test_the_other_ranks_pools_make_rank_0s_choices():
    """A server's prompt caches across ranks: rank 0's pool acquisitions and releases,
    recorded by the hooks and replayed on another pool (`serving.replay`, as `follow` does),
    leave that pool with the same caches in the same order, holding the same conversations,
    through continued conversations, forks of a shared prefix and evictions (in-process)."""
    from dflash_mlx.cache.prompt_cache import CachedState
    from dflash_mlx.distributed import cluster, serving
    from dflash_mlx.server.prompt_pool import PromptCachePool

    class Channel:
        sent: list = []

        def send(self, msg):
            self.sent.append(msg)

    lead = cluster.Cluster(None, 0, 2, "tensor", Channel(), leading=True)
    owner = (object(), None)
    system = list(range(100))  # a long shared prefix: new conversations fork it

    def commit(pc, tokens):
        lease, _ = pc.take(*owner)
        pc.commit(lease, CachedState(owner=owner, tokens=tokens, target_cache=[]))

    prompts = [
        system + [1, 2],  # a new conversation
        system + [1, 2, 7, 3, 4],  # it continues
        system + [5],  # shares the prefix: a fork
        [9, 9, 9],  # unrelated
        system + [1, 2, 7, 3, 4, 8, 6],  # the first conversation again
        [4] * 5,
        system + [5, 11, 12],
    ]
    pool = PromptCachePool(2)
    cluster._CLUSTER = lead
    try:
        held = []
        for i, p in enumerate(prompts):
            pc = pool.acquire(p)
            commit(pc, p + [50 + i])
            held.append(pc)
            if i % 2:  # two run at once at times, then both end
                for pc in held:
                    pool.release(pc)
                held = []
        for pc in held:
            pool.release(pc)
        serving.step()  # the step's message carries them
    finally:
        cluster._CLUSTER = None
    ((kind, events),) = Channel.sent
    assert kind == "step" and [e[0] for e in events].count("acquire") == len(prompts)

    other, caches = PromptCachePool(2), {}
    for ev in events:
        serving.replay(ev, other, caches, None, {})
        if ev[0] == "acquire":  # the request's commit, at the same step on every rank
            commit(caches[ev[1]], ev[2] + [50 + prompts.index(ev[2])])
    assert [pc.tokens for pc in other._caches] == [pc.tokens for pc in pool._caches]
    assert other._prompt_len == pool._prompt_len and len(other._caches) == 2

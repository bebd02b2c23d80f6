"""benchmarks/concurrency.py (issue 36) without servers: its tables computed from a recorded
run (`tests/data/concurrency_run.json`, a real `--quick` run of both regimes against ours,
mlx_lm.server and vllm-mlx), a batched reply of ours that differs (exit 1), a peer or one of
ours that did not run, the streams of the three servers as they send them, the waves of c,
the servers' command lines and environments per regime, and bad options refused in one
line, exit 2, before any server starts. Nothing here decides from wall time."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "concurrency.py"
RUN = Path(__file__).resolve().parent / "data" / "concurrency_run.json"


@pytest.fixture(scope="module")
def cc():
    spec = importlib.util.spec_from_file_location("concurrency_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture
def run():
    return json.loads(RUN.read_text())


def script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60
    )


def section(text: str, regime: str) -> str:
    """The lines of one regime's part of the report."""
    title = {"stock": "### stock wheel", "openblas": "### OpenBLAS preloaded"}[regime]
    part = text.split(title, 1)[1]
    return part.split("\n### ", 1)[0]


def table(part: str, title: str) -> dict[str, list[str]]:
    """A table's rows by their first cell: the cells after the draft column."""
    block = part.split(f"{title}:", 1)[1].strip().split("\n\n", 1)[0]
    rows = {}
    for line in block.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[2:]
    return rows


def aggregate(requests: list[dict]) -> float:
    return sum(r["tokens"] for r in requests) / max(r["last"] for r in requests)


def mean_ttft(requests: list[dict]) -> float:
    return statistics.fmean(r["first"] - r["sent"] for r in requests)


def shown(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def test_the_recorded_run_gives_the_issues_tables(cc, run):
    text, code = cc.render(run)
    assert code == 0, text
    assert "2 streamed /v1/completions of 32 greedy tokens per c, sent in waves of c" in text
    assert "servers on core 1 (OPENBLAS_NUM_THREADS=1), client on core 0" in text
    assert "vllm-mlx 0.6.0" in text and "load average 11.64 / 11.11 / 8.07 before" in text
    for regime in ("stock", "openblas"):
        part = section(text, regime)
        servers = {s["name"]: s["results"] for s in run["regimes"][regime]}
        assert list(servers) == ["ours batched", "ours serial", "mlx_lm.server", "vllm-mlx"]
        agg = table(part, "aggregate tok/s")
        ttft = table(part, "mean TTFT, ms")
        assert list(agg)[:4] == list(servers) and list(ttft)[:4] == list(servers)
        for name, results in servers.items():
            assert agg[name] == [shown(aggregate(results[f"0:{c}"])) for c in (1, 2)]
            assert ttft[name] == [shown(1000 * mean_ttft(results[f"0:{c}"])) for c in (1, 2)]
        for c, cell, serial_cell in zip(
            (1, 2),
            agg["ours batched / better plain server"],
            agg["ours batched / ours serial"],
        ):
            ours = aggregate(servers["ours batched"][f"0:{c}"])
            peers = {p: aggregate(servers[p][f"0:{c}"]) for p in ("mlx_lm.server", "vllm-mlx")}
            best = max(peers, key=peers.get)
            assert cell == f"{ours / peers[best]:.2f}× ({best})"
            assert serial_cell == f"{ours / aggregate(servers['ours serial'][f'0:{c}']):.2f}×"
        for c, cell in zip((1, 2), ttft["ours batched / faster plain server"]):
            peers = {p: mean_ttft(servers[p][f"0:{c}"]) for p in ("mlx_lm.server", "vllm-mlx")}
            best = min(peers, key=peers.get)
            assert (
                cell
                == f"{mean_ttft(servers['ours batched'][f'0:{c}']) / peers[best]:.2f}× ({best})"
            )  # noqa: E501
        assert "All 4 batched replies of ours equal their serial replies." in part
        assert "mlx_lm.server: 4 of 4 replies equal ours serial (for information)." in part
        assert "vllm-mlx: 4 of 4 replies equal ours serial (for information)." in part


def test_a_batched_reply_that_differs_exits_1_naming_it(cc, run):
    run["regimes"]["openblas"][0]["results"]["0:2"][1]["text"] += "x"
    text, code = cc.render(run)
    assert code == 1
    part = section(text, "openblas")
    assert "**1 of 4 batched replies of ours differ from their serial reply:** " in part
    assert "ours batched round 1 c = 2 request 2" in part
    assert "All 4 batched replies of ours equal" in section(text, "stock")


def test_a_peer_that_differs_is_reported_for_information_only(cc, run):
    run["regimes"]["stock"][3]["results"]["0:1"][0]["text"] = "something else"
    text, code = cc.render(run)
    assert code == 0
    assert "vllm-mlx: 3 of 4 replies equal ours serial (for information)." in text


def test_a_peer_that_did_not_run_leaves_its_cells_empty_and_the_ratio_to_the_other(cc, run):
    vllm = run["regimes"]["stock"][3]
    vllm["failed"], vllm["results"] = "exited: ModuleNotFoundError: No module named 'x'", {}
    text, code = cc.render(run)
    assert code == 0, text
    part = section(text, "stock")
    agg = table(part, "aggregate tok/s")
    assert agg["vllm-mlx"] == ["–", "–"]
    mlx = run["regimes"]["stock"][2]["results"]
    ours = run["regimes"]["stock"][0]["results"]
    assert agg["ours batched / better plain server"] == [
        f"{aggregate(ours[f'0:{c}']) / aggregate(mlx[f'0:{c}']):.2f}× (mlx_lm.server)"
        for c in (1, 2)
    ]
    assert "vllm-mlx did not run (to the end): exited: ModuleNotFoundError" in part
    assert "vllm-mlx: " not in part.split("did not run")[1]  # no comparison of no replies


def test_one_of_ours_that_did_not_run_exits_1(cc, run):
    serial = run["regimes"]["openblas"][1]
    serial["failed"], serial["results"] = "not ready after 600 s: calibrating", {}
    text, code = cc.render(run)
    assert code == 1
    part = section(text, "openblas")
    assert table(part, "aggregate tok/s")["ours batched / ours serial"] == ["–", "–"]
    assert "ours serial did not run (to the end): not ready after 600 s" in part


def test_rounds_are_medians(cc, run):
    """Three rounds: each cell is the median of the rounds' figures, not their mean."""
    servers = run["regimes"]["stock"]
    for s in servers:
        for c in (1, 2):
            base = s["results"][f"0:{c}"]
            for rnd, scale in ((1, 2.0), (2, 10.0)):  # times × 2 and × 10: slower rounds
                s["results"][f"{rnd}:{c}"] = [
                    {**r, "first": r["first"] * scale, "last": r["last"] * scale,
                     "sent": r["sent"] * scale} for r in base
                ]  # fmt: skip
    run["settings"]["rounds"] = 3
    text, _ = cc.render(run)
    agg = table(section(text, "stock"), "aggregate tok/s")
    got = servers[2]["results"]
    assert agg["mlx_lm.server"] == [shown(aggregate(got[f"1:{c}"])) for c in (1, 2)]
    assert "median of 3 round(s)" in text


def test_the_recorded_run_prints_again_from_the_command_line(cc, tmp_path, capsys):
    done = script("--from-json", str(RUN))
    assert done.returncode == 0, done.stderr
    assert "| server | draft | c = 1 | c = 2 |" in done.stdout
    assert "| ours batched / better plain server |" in done.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"settings": {}}))
    done = script("--from-json", str(bad))
    assert done.returncode == 2
    assert (
        done.stderr.startswith("error: --from-json ")
        and "not a run written by --json" in done.stderr
    )
    assert "Traceback" not in done.stderr


# The streams as each server sends them (recorded on the demo target, 3 tokens).
OURS_SSE = [
    'data: {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "\\n   ", "logprobs": null, "finish_reason": null}]}',  # noqa: E501
    "",
    'data: {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": " \'", "logprobs": null, "finish_reason": null}]}',  # noqa: E501
    "",
    'data: {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "HAVE", "logprobs": null, "finish_reason": null}]}',  # noqa: E501
    "",
    'data: {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}], "timings": {"tau": 1.0}}',  # noqa: E501
    "",
    'data: {"id": "c", "object": "text_completion", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}',  # noqa: E501
    "",
    "data: [DONE]",
]
MLX_LM_SSE = [
    ": keepalive 6/7",
    "",
    'data: {"id": "c", "object": "text_completion", "model": "default_model", "choices": [{"index": 0, "finish_reason": null, "text": "\\n   "}]}',  # noqa: E501
    'data: {"id": "c", "object": "text_completion", "model": "default_model", "choices": [{"index": 0, "finish_reason": null, "text": " \'"}]}',  # noqa: E501
    'data: {"id": "c", "object": "text_completion", "model": "default_model", "choices": [{"index": 0, "finish_reason": null, "text": "HAVE"}]}',  # noqa: E501
    'data: {"id": "c", "object": "text_completion", "model": "default_model", "choices": [{"index": 0, "finish_reason": "length", "text": ""}]}',  # noqa: E501
    'data: {"id": "c", "object": "chat.completion", "model": "default_model", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}',  # noqa: E501
    "data: [DONE]",
]
VLLM_SSE = [
    'data: {"id": "a", "object": "text_completion", "choices": [{"index": 0, "text": "\\n   ", "finish_reason": null}]}',  # noqa: E501
    "",
    'data: {"id": "b", "object": "text_completion", "choices": [{"index": 0, "text": " \'", "finish_reason": null}]}',  # noqa: E501
    "",
    'data: {"id": "d", "object": "text_completion", "choices": [{"index": 0, "text": "HAVE", "finish_reason": "length"}], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}',  # noqa: E501
    "",
    "data: [DONE]",
    'data: {"choices": [{"index": 0, "text": "after the end"}]}',
]


@pytest.mark.parametrize(
    "lines, last_at",
    [(OURS_SSE, 4), (MLX_LM_SSE, 4), (VLLM_SSE, 3)],
    ids=["ours", "mlx_lm.server", "vllm-mlx"],
)
def test_each_servers_stream_reads_the_same(cc, lines, last_at):
    ticks = iter(range(1, 100))
    got = cc.read_stream(lines, lambda: float(next(ticks)))
    # The clock is read once per data event: the first carries text, `last_at` is the last
    # event with a choice (the usage-only event after it is not the reply's end).
    assert got == {"text": "\n    'HAVE", "tokens": 3, "first": 1.0, "last": float(last_at),
                   "finish": "length"}  # fmt: skip


def test_a_stream_without_usage_or_with_an_error_is_an_error_naming_the_server(cc):
    with pytest.raises(RuntimeError, match="vllm-mlx: no usage in the stream"):
        cc.read_stream(VLLM_SSE[:2] + ["data: [DONE]"], lambda: 0.0, "vllm-mlx")
    error = ['data: {"error": {"message": "out of memory"}}']
    with pytest.raises(RuntimeError, match="ours batched: error in the stream: .*out of memory"):
        cc.read_stream(error, lambda: 0.0, "ours batched")


def test_requests_go_in_waves_of_c_each_after_the_last_ended(cc, monkeypatch):
    """5 prompts at c = 2: waves of 2, 2 and 1; a wave's requests are in flight together,
    the next is sent only when they have all ended; times from the first wave's sending."""
    active, most, log = [0], [0], []
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=10)  # a wave of 2 is only done when both are in

    def fake(server, prompt, tokens, clock):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
            log.append(("start", prompt))
        if not prompt.endswith("4"):
            both.wait()
        with lock:
            active[0] -= 1
            log.append(("end", prompt))
        return {"text": prompt.upper(), "tokens": tokens, "first": clock(), "last": clock(),
                "finish": "length"}  # fmt: skip

    monkeypatch.setattr(cc, "ask", fake)
    server = cc.Server("x", cc.OURS, [])
    prompts = [f"p{k}" for k in range(5)]
    out = cc.waves(server, prompts, 7, 2)
    assert [r["text"] for r in out] == [p.upper() for p in prompts]
    assert [r["wave"] for r in out] == [0, 0, 1, 1, 2]
    assert most[0] == 2
    # Every request of a wave started before any of the next wave.
    order = [p for what, p in log if what == "start"]
    ended = [p for what, p in log if what == "end"]
    for w in range(2):
        later = {f"p{k}" for k in range(2 * (w + 1), 5)}
        assert set(order[: 2 * (w + 1)]).isdisjoint(later)
        assert ended.index(f"p{2 * w}") < order.index(f"p{2 * w + 2}")
        assert ended.index(f"p{2 * w + 1}") < order.index(f"p{2 * w + 2}")
    sent = [r["sent"] for r in out]
    assert sent[0] == sent[1] <= sent[2] == sent[3] <= sent[4]
    assert all(r["sent"] <= r["first"] for r in out)


def test_figures_count_a_request_from_its_wave(cc):
    requests = [
        {"tokens": 10, "sent": 0.0, "first": 0.5, "last": 1.0},
        {"tokens": 10, "sent": 0.0, "first": 0.25, "last": 2.0},
        {"tokens": 20, "sent": 2.0, "first": 3.0, "last": 4.0},
    ]
    f = cc.figures(requests)
    assert f["aggregate"] == 40 / 4.0
    assert f["ttft_mean"] == pytest.approx((0.5 + 0.25 + 1.0) / 3)
    assert f["ttft_max"] == 1.0
    assert f["per_request"] == pytest.approx((10 / 1.0 + 10 / 2.0 + 20 / 2.0) / 3)


def test_each_regime_pins_every_server_and_preloads_openblas_into_every_one(cc, tmp_path):
    pin = ["taskset", "-c", "1"]
    for regime in ("stock", "openblas"):
        where = tmp_path / regime
        env = cc.regime_env(regime, where, True, "/lib/libblas.so.3")
        servers = cc.servers_for(
            "/t", "/d", "/t32", env=env, folder=where, pin=pin, width_4=False, mlx_lm=True,
            vllm="/venv/bin/vllm-mlx",
        )  # fmt: skip
        assert [s.name for s in servers] == [
            "ours batched", "ours serial", "mlx_lm.server", "vllm-mlx"
        ]  # fmt: skip
        for s in servers:
            assert s.argv[:3] == pin, s.argv
            assert s.env["OPENBLAS_NUM_THREADS"] == "1"
            assert s.env["DFLASH_MLX_CACHE"] == str(where / "dflash-mlx-cache")
            assert s.env.get("LD_PRELOAD") == (
                "/lib/libblas.so.3" if regime == "openblas" else None
            )  # noqa: E501
        batched, serial, mlx, vllm = servers
        assert "--max-batch" not in batched.argv and serial.argv[-2:] == ["--max-batch", "1"]
        assert batched.argv[batched.argv.index("--draft") + 1] == "/d" and batched.draft
        assert mlx.argv[3:] == [sys.executable, "-m", "mlx_lm.server", "--model", "/t32",
                                "--log-level", "WARNING"]  # fmt: skip
        assert vllm.argv[3:] == ["/venv/bin/vllm-mlx", "serve", "/t32", "--continuous-batching",
                                 "--host", "127.0.0.1"]  # fmt: skip
        assert vllm.env["HOME"] == str(where / "vllm-home") and (where / "vllm-home").is_dir()
    with_4 = cc.servers_for(
        "/t", "/d", "/t", env={}, folder=tmp_path, pin=[], width_4=True, mlx_lm=False, vllm=None
    )
    assert [s.name for s in with_4] == [
        "ours batched", "ours serial", "ours W=4 batched", "ours W=4 serial"
    ]  # fmt: skip
    assert with_4[2].argv[-2:] == ["--verify-width", "4"] and with_4[2].argv[0] != "taskset"


def test_without_vllm_mlx_the_peer_is_left_out_saying_so(cc, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert cc.find_vllm("/venv/bin/vllm-mlx") == ("/venv/bin/vllm-mlx", None)
    path, why = cc.find_vllm(None)
    assert path is None
    assert why.startswith("vllm-mlx left out: no --vllm-mlx PATH and no vllm-mlx on PATH")


def test_options_are_checked_before_what_the_machine_has(cc, monkeypatch):
    """A machine without Debian's OpenBLAS (or taskset) still names a bad option first; the
    missing library is named once the options are good."""
    monkeypatch.setattr(cc, "OPENBLAS", "/no/openblas-pthread/libblas.so.3")
    monkeypatch.setattr(cc.shutil, "which", lambda name: None)
    for bad, message in (
        (["--model", "/no/target"], "--model '/no/target': no such folder"),
        (["--server-core", "4096"], "--server-core 4096: not a core this process may use"),
    ):
        with pytest.raises(cc.BadOption, match=message):
            cc.check(cc.parser().parse_args(bad))
    args = cc.check(cc.parser().parse_args(["--quick"]))
    with pytest.raises(cc.BadOption, match="--openblas '/no/openblas-pthread/libblas.so.3'"):
        cc.check_machine(args)
    with pytest.raises(cc.BadOption, match="pinning needs taskset"):
        cc.check_machine(cc.check(cc.parser().parse_args(["--regimes", "stock"])))
    cc.check_machine(cc.check(cc.parser().parse_args(["--regimes", "stock", "--no-pin"])))


def test_quick_is_a_short_run_and_options_given_win(cc):
    args = cc.check(cc.parser().parse_args(["--quick"]))
    assert (args.cs, args.requests, args.tokens) == ([1, 2], 2, 32)
    args = cc.check(cc.parser().parse_args(["--quick", "--tokens", "64", "--regimes", "stock"]))
    assert (args.cs, args.requests, args.tokens, args.regime_list) == ([1, 2], 2, 64, ["stock"])
    args = cc.check(cc.parser().parse_args(["--no-pin", "--regimes", "stock"]))
    assert (args.cs, args.requests, args.tokens) == ([1, 2, 4, 8], 8, 128)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--concurrency", "0"], "--concurrency '0': '0' is not a number of requests at once"),
        (["--concurrency", "1,,2"], "--concurrency '1,,2': '' is not a number of requests"),
        (["--concurrency", "x"], "--concurrency 'x': 'x' is not a number of requests"),
        (["--requests", "0"], "--requests 0: use an integer >= 1"),
        (["--tokens", "-1"], "--tokens -1: use an integer >= 1"),
        (["--rounds", "0"], "--rounds 0: use an integer >= 1"),
        (["--regimes", "stock,metal"], "--regimes 'stock,metal': 'metal' is not a regime"),
        (["--openblas", "/no/libblas.so"], "--openblas '/no/libblas.so': no such file"),
        (["--vllm-mlx", "/no/vllm-mlx"], "--vllm-mlx '/no/vllm-mlx': not an executable file"),
        (["--model", "/no/target"], "--model '/no/target': no such folder"),
        (["--prompts", "/no/p.jsonl"], "--prompts '/no/p.jsonl': no such file"),
        (["--server-core", "4096"], "--server-core 4096: not a core this process may use"),
        (["--from-json", "/no/run.json"], "--from-json '/no/run.json': no such file"),
    ],
)
def test_bad_options_are_one_line_exit_2_before_any_server(args, message):
    done = script(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""

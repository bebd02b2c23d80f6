"""Concurrent requests through HTTP: `dflash-mlx serve` batched and serial against the plain
batching servers `mlx_lm.server` and vllm-mlx, in both BLAS regimes, in one run (issue 36).

    python benchmarks/concurrency.py [--concurrency 1,2,4,8] [--requests 8] [--tokens 128]
        [--rounds 1] [--regimes stock,openblas] [--vllm-mlx PATH] [--quick]
        [--model TARGET --draft DRAFT] [--prompts FILE.jsonl] [--json OUT]
    python benchmarks/concurrency.py --from-json OUT    # the tables of a recorded run again

Per regime (`stock`: MLX's bundled BLAS; `openblas`: Debian's OpenBLAS preloaded with
LD_PRELOAD into every server, ours and the peers), over the demo pair unless --model/--draft
say otherwise, it starts real servers on free 127.0.0.1 ports, one after another (each
ready, ours calibrated, before the next starts; ours share a fresh DFLASH_MLX_CACHE per
regime, so the first calibration serves both):
  * ours batched: `dflash-mlx serve --model TARGET --draft DRAFT` (continuous batching)
  * ours serial:  the same with `--max-batch 1` (one request at a time, the rest queue)
  * `python -m mlx_lm.server --model TARGET`               (no draft; batches by itself)
  * `vllm-mlx serve TARGET --continuous-batching`           (no draft; batches plainly)
and, with --width-4, ours batched and serial at `--verify-width 4` too. vllm-mlx 0.6.0 pins
mlx-lm < 0.32, so it lives in a venv of its own (docs/measurements.md says how to make it):
--vllm-mlx names that venv's `vllm-mlx` executable (default: one on PATH); without one the
peer is left out, saying so. Its disk prefix cache goes to the run's scratch folder (its
HOME there). With OpenBLAS our `load` computes a half-precision target in float32 (MLX's
CPU backend has no BLAS path for half precision); the peers then get a float32 copy of the
target, so that all compute the same model. Ours run with `--no-prompt-cache-dir`, and every
prompt starts with a line naming its round, c and slot, so no request finds its prefix
cached by an earlier one.

Pinning, as the issue measured: each server runs under `taskset -c 1` with
OPENBLAS_NUM_THREADS=1 and the client (this process, its threads included) on core 0
(--server-core, --client-core; --no-pin leaves both unpinned).

For each c of --concurrency, --requests `/v1/completions` (greedy, --tokens tokens,
`stream: true` with usage) are sent in waves of c at once: a wave is sent when the one
before has ended. Per server and c: aggregate tok/s (every completion token over the time
from sending the first wave to the last chunk of the last), mean TTFT (a request's sending
to its first chunk carrying text), per-request tok/s (a request's tokens over its own time
from sending to its last chunk). Rounds (--rounds, median) take the servers in an order
that rotates with the round and c, and the regimes in an order that alternates, so slow
drift spreads over all. The tables, per regime: aggregate tok/s, rows = servers, columns =
c, then ours batched / the better plain server at each c and ours batched / ours serial;
mean TTFT the same way. Every batched reply of ours must equal its serial reply (texts
compared); the peers' replies are compared with our serial ones for information. Exits 1
when a batched reply of ours differs or one of our servers did not run; a bad option is one
`error:` line, exit 2, before any server starts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
REGIMES = {"stock": "stock wheel (MLX's bundled BLAS)", "openblas": "OpenBLAS preloaded"}
OURS, MLX_LM, VLLM = "ours", "mlx_lm.server", "vllm-mlx"
PEERS = (MLX_LM, VLLM)
QUICK = {"concurrency": "1,2", "requests": 2, "tokens": 32}
DEFAULTS = {"concurrency": "1,2,4,8", "requests": 8, "tokens": 128}


class BadOption(Exception):
    """A bad command-line value: one `error:` line, exit 2."""


@dataclass
class Server:
    name: str
    kind: str  # OURS, MLX_LM or VLLM
    argv: list[str]
    width: str = "auto"  # ours: "auto" or "4"; whose serial a batched server is compared with
    serial: bool = False  # ours with --max-batch 1
    draft: bool = False  # speculates with a draft
    env: dict[str, str] = field(default_factory=dict)
    base: str = ""
    model: str = ""
    proc: subprocess.Popen | None = None
    log: Path | None = None
    failed: str | None = None  # why it did not run (to the end)
    results: dict = field(default_factory=dict)  # (round, c) -> list of request dicts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wide_env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "200"}


def ours_command() -> list[str]:
    """`dflash-mlx` next to this Python (its venv's), else the one on PATH."""
    here = Path(sys.executable).parent / "dflash-mlx"
    return [str(here)] if here.exists() else ["dflash-mlx"]


def has_max_batch() -> bool:
    done = subprocess.run(
        [*ours_command(), "serve", "--help"], capture_output=True, text=True, env=_wide_env()
    )
    return "--max-batch" in done.stdout


def start(server: Server, folder: Path, timeout: float) -> None:
    """Start `server` and wait for its /health (ours: ready means calibrated)."""
    port = free_port()
    server.base = f"http://127.0.0.1:{port}"
    server.log = folder / (server.name.replace(" ", "_").replace("/", "_") + ".log")
    with open(server.log, "w") as log:
        server.proc = subprocess.Popen(
            [*server.argv, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server.env or None,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            break
        try:
            if httpx.get(f"{server.base}/health", timeout=5).status_code == 200:
                if server.kind == MLX_LM:  # it would load any other model named
                    server.model = "default_model"
                    return
                models = httpx.get(f"{server.base}/v1/models", timeout=5).json()
                server.model = models["data"][0]["id"]
                return
        except (httpx.TransportError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.2)
    tail = server.log.read_text(errors="replace").strip().splitlines()[-5:]
    how = "exited" if server.proc.poll() is not None else f"not ready after {timeout:.0f} s"
    server.failed = f"{how}: " + " | ".join(tail)
    stop(server)


def stop(server: Server) -> None:
    if server.proc is not None and server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def read_stream(lines: Iterable[str], clock: Callable[[], float], name: str = "server") -> dict:
    """A streamed completion's server-sent events: its text, completion tokens (from the
    usage), finish reason, and the `clock()` readings at its first chunk carrying text
    (`first`) and its last chunk with a choice (`last`). Any event shape the three servers
    send: SSE comments and blank lines skipped, usage in the last choice's chunk or a chunk
    of its own."""
    text, first, last, used, finish = [], None, None, None, None
    for line in lines:
        if not line.startswith("data:"):
            continue  # SSE comments (mlx_lm.server's keep-alives), blank lines
        data = line[5:].strip()
        if data == "[DONE]":
            break
        obj = json.loads(data)
        now = clock()
        if obj.get("error"):
            raise RuntimeError(f"{name}: error in the stream: {obj['error']}")
        if obj.get("usage"):
            used = obj["usage"]["completion_tokens"]
        for choice in obj.get("choices") or ():
            last = now
            if choice.get("text"):
                text.append(choice["text"])
                first = now if first is None else first
            finish = choice.get("finish_reason") or finish
    if used is None:
        raise RuntimeError(f"{name}: no usage in the stream")
    if last is None:
        raise RuntimeError(f"{name}: no completion in the stream")
    return {"text": "".join(text), "tokens": used, "first": first, "last": last,
            "finish": finish}  # fmt: skip


def ask(server: Server, prompt: str, tokens: int, clock: Callable[[], float]) -> dict:
    """One streamed greedy completion, times by `clock`."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {r.text[:300]}")
        return read_stream(r.iter_lines(), clock, server.name)


def wave(server: Server, prompts: list[str], tokens: int, clock) -> list[dict]:
    """The prompts sent at once, each on its own thread and connection."""
    out: list[dict | BaseException | None] = [None] * len(prompts)
    gate = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        gate.wait()
        try:
            out[i] = ask(server, prompts[i], tokens, clock)
        except BaseException as e:  # noqa: BLE001 - raised in the calling thread below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    gate.wait()
    for t in threads:
        t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def waves(server: Server, prompts: list[str], tokens: int, c: int) -> list[dict]:
    """`prompts` in waves of `c` at once, each wave sent when the one before has ended. Per
    request: its wave, when the wave was sent (`sent`), its first text and last chunk
    (`first`, `last`), all in seconds from the first wave's sending."""
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    out = []
    for w, i in enumerate(range(0, len(prompts), c)):
        sent = clock()
        for r in wave(server, prompts[i : i + c], tokens, clock):
            out.append({**r, "wave": w, "sent": sent})
    return out


def figures(requests: list[dict]) -> dict:
    """Aggregate tok/s, per-request tok/s, mean and max TTFT of one server's requests at
    one c (one round)."""
    end = max(r["last"] for r in requests)
    ttft = [(r["first"] if r["first"] is not None else r["last"]) - r["sent"] for r in requests]
    return {
        "aggregate": sum(r["tokens"] for r in requests) / end,
        "per_request": statistics.fmean(r["tokens"] / (r["last"] - r["sent"]) for r in requests),
        "ttft_mean": statistics.fmean(ttft),
        "ttft_max": max(ttft),
        "tokens": sum(r["tokens"] for r in requests),
    }


def wants_float32(regime: str) -> bool:
    """Whether our `load` computes a half-precision target in float32 in `regime`."""
    forced = os.environ.get("DFLASH_MLX_CPU_FLOAT32")
    if forced in ("0", "1"):
        return forced == "1"
    return regime == "openblas"


def float32_copy(target: str, folder: Path) -> str | None:
    """A copy of `target` with its half-precision weights in float32 (None when it has
    none)."""
    import mlx.core as mx

    out = folder / "target-float32"
    if out.exists():
        return str(out)
    out.mkdir(parents=True)
    half = False
    for f in Path(target).iterdir():
        if f.suffix != ".safetensors":
            if f.is_file():
                shutil.copy(f, out / f.name)
            continue
        weights = mx.load(str(f))
        for k, v in weights.items():
            if v.dtype in (mx.float16, mx.bfloat16):
                weights[k], half = v.astype(mx.float32), True
        mx.save_safetensors(str(out / f.name), weights)
    if not half:
        shutil.rmtree(out)
    return str(out) if half else None


def regime_env(regime: str, folder: Path, pin: bool, openblas: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["DFLASH_MLX_CACHE"] = str(folder / "dflash-mlx-cache")  # fresh per regime
    if regime == "openblas":
        env["LD_PRELOAD"] = openblas
    if pin:
        env["OPENBLAS_NUM_THREADS"] = "1"
    return env


def servers_for(
    target: str,
    draft: str | None,
    peer_target: str,
    *,
    env: dict[str, str],
    folder: Path,
    pin: list[str],
    width_4: bool,
    mlx_lm: bool,
    vllm: str | None,
) -> list[Server]:
    """The servers of one regime: ours batched and serial (and at W=4), then the peers."""
    ours = [*pin, *ours_command(), "serve", "--model", target, "--no-prompt-cache-dir"]
    ours += ["--max-queue", "64", *(["--draft", draft] if draft else ["--no-draft"])]
    out = []
    for width, extra in (("auto", []), ("4", ["--verify-width", "4"])):
        if width == "4" and not (width_4 and draft):
            continue
        label = "ours" if width == "auto" else "ours W=4"
        for serial in (False, True):
            name = f"{label} {'serial' if serial else 'batched'}"
            argv = [*ours, *extra, *(["--max-batch", "1"] if serial else [])]
            out.append(Server(name, OURS, argv, width, serial, bool(draft), env))
    if mlx_lm:
        argv = [*pin, sys.executable, "-m", "mlx_lm.server", "--model", peer_target]
        out.append(Server(MLX_LM, MLX_LM, [*argv, "--log-level", "WARNING"], env=env))
    if vllm:
        home = folder / "vllm-home"  # its prefix cache persists under ~/.cache/vllm-mlx
        home.mkdir(parents=True, exist_ok=True)
        argv = [*pin, vllm, "serve", peer_target, "--continuous-batching"]
        out.append(
            Server(VLLM, VLLM, [*argv, "--host", "127.0.0.1"], env={**env, "HOME": str(home)})
        )
    return out


# ---------------------------------------------------------------------------------- options


def parse_concurrency(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            n = int(part)
        except ValueError:
            n = 0
        if n < 1:
            raise BadOption(f"--concurrency {text!r}: {part.strip()!r} is not a number of "
                            "requests at once (an integer >= 1; e.g. 1,2,4,8)")  # fmt: skip
        out.append(n)
    return list(dict.fromkeys(out))


def parse_regimes(text: str) -> list[str]:
    out = []
    for part in text.split(","):
        if part.strip() not in REGIMES:
            raise BadOption(f"--regimes {text!r}: {part.strip()!r} is not a regime "
                            f"(expected {', '.join(REGIMES)})")  # fmt: skip
        out.append(part.strip())
    return list(dict.fromkeys(out))


def positive(name: str, value: int) -> int:
    if value < 1:
        raise BadOption(f"{name} {value}: use an integer >= 1")
    return value


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", help="requests at once, comma-separated (default 1,2,4,8)")
    ap.add_argument("--requests", type=int, help="requests per c, in waves of c (default 8)")
    ap.add_argument("--tokens", type=int, help="greedy tokens per request (default 128)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds (median; default 1)")
    ap.add_argument("--regimes", default="stock,openblas", help="stock, openblas or both")
    ap.add_argument("--openblas", default=OPENBLAS, help=f"the BLAS preloaded (default {OPENBLAS})")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: c = 1,2, 2 requests of 32 tokens (options given win)",
    )
    ap.add_argument("--model", help="target folder (default: the demo pair's)")
    ap.add_argument("--draft", help="draft folder (default: the demo pair's; none with --model)")
    ap.add_argument("--prompts", type=Path, help="JSONL prompts (default: the demo's held-out)")
    ap.add_argument("--width-4", action="store_true", help="also ours at --verify-width 4")
    ap.add_argument("--no-mlx-lm", action="store_true", help="leave mlx_lm.server out")
    ap.add_argument(
        "--vllm-mlx",
        metavar="PATH",
        help="the vllm-mlx executable of its venv (default: vllm-mlx on PATH)",
    )
    ap.add_argument("--server-core", type=int, default=1, help="core of every server (default 1)")
    ap.add_argument("--client-core", type=int, default=0, help="core of the client (default 0)")
    ap.add_argument("--no-pin", action="store_true", help="pin neither servers nor client")
    ap.add_argument("--startup", type=float, default=600, help="seconds a server may take")
    ap.add_argument("--json", type=Path, help="write the run (every request's figures) here")
    ap.add_argument(
        "--from-json",
        type=Path,
        metavar="RUN",
        help="print the tables of a run written by --json; starts no server",
    )
    return ap


def check(args) -> argparse.Namespace:
    """Every option checked (BadOption naming the first bad one), defaults filled in."""
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    args.cs = parse_concurrency(args.concurrency)
    positive("--requests", args.requests)
    positive("--tokens", args.tokens)
    positive("--rounds", args.rounds)
    args.regime_list = parse_regimes(args.regimes)
    if args.from_json is not None:
        if not args.from_json.is_file():
            raise BadOption(f"--from-json {str(args.from_json)!r}: no such file")
        return args
    for name in ("model", "draft"):
        value = getattr(args, name)
        if value is not None and not Path(value).is_dir():
            raise BadOption(f"--{name} {value!r}: no such folder")
    if args.prompts is not None and not args.prompts.is_file():
        raise BadOption(f"--prompts {str(args.prompts)!r}: no such file")
    if args.vllm_mlx is not None:
        path = Path(args.vllm_mlx)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BadOption(f"--vllm-mlx {args.vllm_mlx!r}: not an executable file (expected "
                            "the vllm-mlx command of the venv it is installed in)")  # fmt: skip
    if not args.no_pin:
        cores = os.sched_getaffinity(0)
        for name in ("server_core", "client_core"):
            core = getattr(args, name)
            if core not in cores:
                raise BadOption(
                    f"--{name.replace('_', '-')} {core}: not a core this process may "
                    f"use ({', '.join(map(str, sorted(cores)))}); or --no-pin"
                )
    return args


def check_machine(args) -> None:
    """What this machine must have for the run the options ask for (BadOption naming the
    first thing missing): after `check`, so a bad option is named first on any machine."""
    if args.from_json is not None:
        return
    if "openblas" in args.regime_list and not Path(args.openblas).is_file():
        raise BadOption(f"--openblas {args.openblas!r}: no such file (apt-get install "
                        "libopenblas0-pthread, or --regimes stock)")  # fmt: skip
    if not args.no_pin and shutil.which("taskset") is None:
        raise BadOption("pinning needs taskset (util-linux) on PATH; or --no-pin")


def find_vllm(given: str | None) -> tuple[str | None, str | None]:
    """The vllm-mlx executable to run (the one given, else one on PATH) and, without one, the
    line that says the peer is left out."""
    found = given or shutil.which("vllm-mlx")
    if found:
        return found, None
    return None, (
        "vllm-mlx left out: no --vllm-mlx PATH and no vllm-mlx on PATH (install vllm-mlx "
        "0.6.0 in a venv of its own: docs/measurements.md, 'Against plain batching servers')"
    )


def vllm_version(path: str) -> str:
    """vllm-mlx's version, asked of the Python its executable runs with."""
    try:
        first = Path(path).read_text(errors="replace").splitlines()[0]
        python = first[2:].strip() if first.startswith("#!") else sys.executable
        code = "import importlib.metadata as m; print(m.version('vllm-mlx'))"
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        return done.stdout.strip() or "?"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "?"


def environment(args, vllm: str | None) -> dict:
    from importlib.metadata import version

    import mlx.core as mx

    repo = Path(__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    pinned = (
        "unpinned"
        if args.no_pin
        else f"servers on core {args.server_core} (OPENBLAS_NUM_THREADS=1), client on core "
        f"{args.client_core}"
    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit or None,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "vllm_mlx": vllm_version(vllm) if vllm else None,
        "pinning": pinned,
        "load_before": list(os.getloadavg()),
    }


# -------------------------------------------------------------------------------------- run


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        check_machine(check(args))
    except BadOption as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.from_json is not None:
        try:
            run = json.loads(args.from_json.read_text())
            text, code = render(run)
        except (ValueError, KeyError, TypeError) as e:
            print(f"error: --from-json {str(args.from_json)!r}: not a run written by --json "
                  f"({type(e).__name__}: {e})", file=sys.stderr)  # fmt: skip
            return 2
        print(text)
        return code
    say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    if not args.no_pin:  # before any thread: the client's threads inherit it
        os.sched_setaffinity(0, {args.client_core})
    vllm, why = find_vllm(args.vllm_mlx)
    if why:
        say(why)

    from dflash_mlx.bench.concurrency import in_turn
    from dflash_mlx.bench.prompts import load_suite, read_prompts

    if args.model is None:
        from dflash_mlx.demo import demo_pair

        target_dir, draft_dir = demo_pair()
        target, draft = str(target_dir), args.draft or str(draft_dir)
        default_prompts = target_dir.parent / "heldout_prompts.jsonl"
    else:
        target, draft, default_prompts = args.model, args.draft, None
    path = args.prompts or default_prompts
    pool = read_prompts(path) if path is not None else load_suite("all")
    texts = [p.summary for p in in_turn(pool, args.requests)]

    folder = Path(tempfile.mkdtemp(prefix="concurrency-"))
    run = {
        "settings": {
            "concurrency": args.cs,
            "requests": args.requests,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "regimes": args.regime_list,
            "target": target,
            "draft": draft,
            "prompts": texts,
        },  # fmt: skip
        "environment": environment(args, vllm),
        "regimes": {},
    }
    if not has_max_batch():
        say("error: this dflash-mlx serve has no --max-batch (the serial server needs it)")
        return 2
    pin = [] if args.no_pin else ["taskset", "-c", str(args.server_core)]
    by_regime: dict[str, list[Server]] = {}
    try:
        for regime in args.regime_list:
            where = folder / regime
            where.mkdir()
            peer_target = target
            if wants_float32(regime) and (vllm or not args.no_mlx_lm):
                peer_target = float32_copy(target, folder) or target
                if peer_target != target:
                    say(f"{regime}: the peers get a float32 copy of the target ({peer_target})")
            servers = servers_for(
                target, draft, peer_target,
                env=regime_env(regime, where, not args.no_pin, args.openblas), folder=where,
                pin=pin, width_4=args.width_4, mlx_lm=not args.no_mlx_lm, vllm=vllm,
            )  # fmt: skip
            by_regime[regime] = servers
            for s in servers:
                say(f"{regime}: starting {s.name}: {' '.join(s.argv)}")
                start(s, where, args.startup)
                if s.failed:
                    say(f"  {s.name} did not start ({s.failed}); going on without it")
                    continue
                try:  # compile, allocate; not measured
                    waves(s, [f"# warm-up\n{texts[0]}"], 32, 1)
                    warm = [f"# warm-up {k}\n{t}" for k, t in enumerate(texts)]
                    waves(s, warm, 16, max(args.cs))
                except (RuntimeError, httpx.HTTPError) as e:
                    s.failed = f"warm-up failed: {e}"
                    stop(s)
                    say(f"  {s.name}: {s.failed}; going on without it")
        for rnd in range(args.rounds):
            for i, c in enumerate(args.cs):
                order = args.regime_list[(rnd + i) % len(args.regime_list) :]
                order += args.regime_list[: (rnd + i) % len(args.regime_list)]
                for regime in order:
                    up = [s for s in by_regime[regime] if not s.failed]
                    if not up:
                        continue
                    shift = (rnd * len(args.cs) + i) % len(up)
                    for s in up[shift:] + up[:shift]:
                        prompts = [f"# request {rnd}.{c}.{k}\n{t}" for k, t in enumerate(texts)]
                        try:
                            s.results[f"{rnd}:{c}"] = waves(s, prompts, args.tokens, c)
                        except (RuntimeError, httpx.HTTPError) as e:
                            s.failed = f"round {rnd + 1} c = {c}: {e}"
                            stop(s)
                            say(f"{regime}: {s.name} failed ({s.failed}); going on without it")
                            continue
                        f = figures(s.results[f"{rnd}:{c}"])
                        say(f"{regime} round {rnd + 1} c={c} {s.name}: {f['aggregate']:.1f} "
                            f"tok/s, mean TTFT {f['ttft_mean'] * 1000:.0f} ms")  # fmt: skip
    finally:
        for servers in by_regime.values():
            for s in servers:
                stop(s)
    run["environment"]["load_after"] = list(os.getloadavg())
    for regime, servers in by_regime.items():
        run["regimes"][regime] = [
            {"name": s.name, "kind": s.kind, "width": s.width, "serial": s.serial,
             "draft": s.draft, "argv": s.argv, "failed": s.failed, "results": s.results}
            for s in servers
        ]  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(run, indent=1) + "\n")
    if any(s.failed for servers in by_regime.values() for s in servers):
        say(f"servers' logs kept in {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    text, code = render(run)
    print(text)
    return code


# ----------------------------------------------------------------------------------- report


def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def render(run: dict) -> tuple[str, int]:
    """The tables of a run (as --json writes it) and the exit code: 1 when a batched reply
    of ours differs from its serial reply or one of our servers did not run."""
    st, env = run["settings"], run["environment"]
    cs, rounds = st["concurrency"], st["rounds"]
    lines = [
        f"{st['requests']} streamed /v1/completions of {st['tokens']} greedy tokens per c, "
        f"sent in waves of c at once; median of {rounds} round(s).",
        f"{env['date']} · commit {env.get('commit') or '?'} · {env['machine']} · mlx "
        f"{env['mlx']}, mlx-lm {env['mlx_lm']}, vllm-mlx {env.get('vllm_mlx') or '–'} · "
        f"{env['pinning']} · load average {_load(env.get('load_before'))} before, "
        f"{_load(env.get('load_after'))} after",
    ]
    code = 0
    head = "| server | draft | " + " | ".join(f"c = {c}" for c in cs) + " |"
    rule = "|---|---|" + "---:|" * len(cs)
    for regime in st["regimes"]:
        servers = run["regimes"].get(regime, [])

        def med(s: dict, c: int, key: str) -> float | None:
            got = [s["results"][f"{r}:{c}"] for r in range(rounds) if f"{r}:{c}" in s["results"]]
            return statistics.median(figures(g)[key] for g in got) if got else None

        def cells(s: dict, key: str, scale: float = 1.0) -> str:
            vals = [med(s, c, key) for c in cs]
            return " | ".join("–" if v is None else _num(v * scale) for v in vals)

        def ratio_row(label: str, top: dict | None, others: list[dict], key: str, best) -> str:
            out = []
            for c in cs:
                mine = med(top, c, key) if top else None
                theirs = [(med(o, c, key), o["name"]) for o in others]
                theirs = [(v, n) for v, n in theirs if v is not None]
                if mine is None or not theirs:
                    out.append("–")
                    continue
                v, n = best(theirs, key=lambda t: t[0])
                named = f" ({n})" if len(others) > 1 else ""
                out.append(f"{mine / v:.2f}×{named}")
            return f"| {label} | | " + " | ".join(out) + " |"

        ours = [s for s in servers if s["kind"] == OURS]
        peers = [s for s in servers if s["kind"] != OURS]
        batched = [s for s in ours if not s["serial"]]
        serial = {s["width"]: s for s in ours if s["serial"]}
        lines += ["", f"### {REGIMES[regime]}", ""]
        for title, key, scale, best in (
            ("aggregate tok/s", "aggregate", 1.0, max),
            ("mean TTFT, ms", "ttft_mean", 1000.0, min),
        ):
            lines += [f"{title}:", "", head, rule]
            for s in servers:
                draft = "DFlash" if s["draft"] else "none"
                lines.append(f"| {s['name']} | {draft} | {cells(s, key, scale)} |")
            for b in batched:
                if peers:
                    label = "better" if key == "aggregate" else "faster"
                    lines.append(
                        ratio_row(f"{b['name']} / {label} plain server", b, peers, key, best)
                    )
                if serial.get(b["width"]):
                    s = serial[b["width"]]
                    lines.append(ratio_row(f"{b['name']} / {s['name']}", b, [s], key, best))
            lines.append("")
        for s in servers:
            if s["failed"]:
                lines.append(f"{s['name']} did not run (to the end): {s['failed']}")
                code = 1 if s["kind"] == OURS else code
        differ, compared = [], 0
        for b in batched:
            base = serial.get(b["width"])
            if base is None:
                continue
            for key, replies in b["results"].items():
                for k, (mine, theirs) in enumerate(zip(replies, base["results"].get(key, []))):
                    compared += 1
                    if mine["text"] != theirs["text"]:
                        rnd, c = key.split(":")
                        differ.append(f"{b['name']} round {int(rnd) + 1} c = {c} request {k + 1}")
        if differ:
            code = 1
            lines.append(f"**{len(differ)} of {compared} batched replies of ours differ from "
                         "their serial reply:** " + "; ".join(differ[:20]))  # fmt: skip
        elif compared:
            lines.append(f"All {compared} batched replies of ours equal their serial replies.")
        base = serial.get("auto")
        for p in peers:
            same = total = 0
            for key, replies in p["results"].items():
                for mine, theirs in zip(replies, (base or {}).get("results", {}).get(key, [])):
                    total += 1
                    same += mine["text"] == theirs["text"]
            if total:
                lines.append(f"{p['name']}: {same} of {total} replies equal ours serial "
                             "(for information).")  # fmt: skip
    return "\n".join(lines), code


def _load(values) -> str:
    return " / ".join(f"{v:.2f}" for v in values) if values else "?"


if __name__ == "__main__":
    sys.exit(main())

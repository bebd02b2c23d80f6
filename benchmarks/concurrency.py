"""Concurrent requests through HTTP: `dflash-mlx serve` serial and batched, and `mlx_lm.server`.

    python benchmarks/concurrency.py [--concurrency 1,2,4,8] [--tokens 128] [--rounds 1]
        [--model TARGET --draft DRAFT] [--prompts FILE.jsonl] [--no-mlx-lm] [--json OUT]

Starts real servers on free 127.0.0.1 ports, one after another (each ready, its pair
calibrated, before the next starts; they share one DFLASH_MLX_CACHE, so the first
calibration serves them all), over the demo pair unless --model/--draft say otherwise:
  * ours, default settings, `--max-batch 1`     (serial: one request at a time, the rest queue)
  * ours, default settings                       (batched: continuous batching)
  * ours, `--verify-width 4`, `--max-batch 1`     (serial at W=4)
  * ours, `--verify-width 4`                     (batched at W=4)
  * `python -m mlx_lm.server --model TARGET`     (no draft; batches by itself)
With an optimized BLAS in the process (OpenBLAS preloaded), our `load` computes a
half-precision target in float32 (MLX's CPU backend has no BLAS path for half precision);
mlx_lm.server then gets a float32 copy of the target, so that both compute the same model.
Ours run with `--no-prompt-cache-dir` (each process keeps its prompt prefixes in memory
only: the servers would otherwise share a disk store and answer each other's prompts from
it), and every prompt starts with a line naming its round, N and slot, so no request finds
its prefix cached by an earlier one. Without `serve --max-batch` (older checkouts), the
serial rows send the requests one after another to the default server instead.

For each N, N `/v1/completions` requests (greedy, `--tokens` tokens, `stream: true` with
usage) are sent at once; the servers take turns in an order that rotates with N and the
round, so slow drift spreads over all. Per server and N: aggregate tok/s (every completion
token over the time from sending to the last chunk of any), per-request tok/s (each
request's tokens over its time from sending to its last chunk, mean), mean and max TTFT
(sending to the first chunk carrying text), and ratios of aggregate tok/s against our
serial server at the same width and against mlx_lm.server. Every batched reply of ours must
equal its serial reply (texts compared); mlx_lm.server's replies are compared with our
serial ones too (same target, greedy), for information. Prints a markdown table; exits 1
when a batched reply of ours differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dflash_mlx.bench.concurrency import in_turn
from dflash_mlx.bench.prompts import load_suite, read_prompts

MLX_LM = "mlx_lm.server"


@dataclass
class Server:
    name: str
    argv: list[str]
    width: str  # "auto" or "4": whose serial it is compared with
    serial: bool  # served one request at a time
    ours: bool = True
    client_serial: bool = False  # no --max-batch: the client sends one after another
    base: str = ""
    model: str = ""
    proc: subprocess.Popen | None = None
    log: Path | None = None
    failed: str | None = None  # why it did not start
    results: dict = field(default_factory=dict)  # (round, n) -> list of request dicts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_max_batch() -> bool:
    done = subprocess.run(
        ["dflash-mlx", "serve", "--help"], capture_output=True, text=True, env=_wide_env()
    )
    return "--max-batch" in done.stdout


def _wide_env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "200"}


def start(server: Server, folder: Path, timeout: float) -> None:
    """Start `server` and wait for its /health (ours: ready means calibrated)."""
    port = free_port()
    server.base = f"http://127.0.0.1:{port}"
    server.log = folder / (server.name.replace(" ", "_").replace("/", "_") + ".log")
    with open(server.log, "w") as log:
        server.proc = subprocess.Popen(
            [*server.argv, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            break
        try:
            if httpx.get(f"{server.base}/health", timeout=5).status_code == 200:
                if not server.ours:  # it would load any other model named
                    server.model = "default_model"
                    return
                models = httpx.get(f"{server.base}/v1/models", timeout=5).json()
                server.model = models["data"][0]["id"]
                return
        except (httpx.TransportError, ValueError, KeyError):
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


def ask(server: Server, prompt: str, tokens: int, t0: float) -> dict:
    """One streamed completion: its text, completion tokens and times from `t0`."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, first, last, used, finish = [], None, None, None, None
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue  # SSE comments (mlx_lm.server's keep-alives), blank lines
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            now = time.perf_counter() - t0
            if obj.get("usage"):
                used = obj["usage"]["completion_tokens"]
            for choice in obj.get("choices") or ():
                last = now
                if choice.get("text"):
                    text.append(choice["text"])
                    first = now if first is None else first
                finish = choice.get("finish_reason") or finish
    if used is None:
        raise RuntimeError(f"{server.name}: no usage in the stream")
    return {"text": "".join(text), "tokens": used, "ttft": first or last, "last": last,
            "finish": finish}  # fmt: skip


def burst(server: Server, prompts: list[str], tokens: int) -> list[dict]:
    """The prompts sent at once (or, client-side serial, one after another), all timed from
    the same moment."""
    out: list[dict | BaseException | None] = [None] * len(prompts)
    t0 = 0.0
    if server.client_serial:
        t0 = time.perf_counter()
        return [ask(server, p, tokens, t0) for p in prompts]
    gate = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        gate.wait()
        try:
            out[i] = ask(server, prompts[i], tokens, t0)
        except BaseException as e:  # noqa: BLE001 - raised in the main thread below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    gate.wait()
    for t in threads:
        t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def figures(requests: list[dict]) -> dict:
    end = max(r["last"] for r in requests)
    return {
        "aggregate": sum(r["tokens"] for r in requests) / end,
        "per_request": statistics.fmean(r["tokens"] / r["last"] for r in requests),
        "ttft_mean": statistics.fmean(r["ttft"] for r in requests),
        "ttft_max": max(r["ttft"] for r in requests),
        "tokens": sum(r["tokens"] for r in requests),
    }


def float32_copy(target: str, folder: Path) -> str | None:
    """A copy of `target` with its half-precision weights in float32, when our `load` would
    compute it in float32 here (else None)."""
    import mlx.core as mx

    from dflash_mlx.models.loading import _optimized_blas

    if not _optimized_blas():
        return None
    out = folder / "target-float32"
    out.mkdir()
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
    return str(out) if half else None


def servers_for(target: str, draft: str | None, max_batch: bool, mlx_target: str) -> list[Server]:
    ours = ["dflash-mlx", "serve", "--model", target, "--no-prompt-cache-dir", "--max-queue", "64"]
    ours += ["--draft", draft] if draft else ["--no-draft"]
    out = []
    for width, extra in (("auto", []), ("4", ["--verify-width", "4"])):
        if width == "4" and not draft:
            continue
        label = "ours" if width == "auto" else "ours W=4"
        serial = [*ours, *extra, *(["--max-batch", "1"] if max_batch else [])]
        out.append(Server(f"{label} serial", serial, width, True, client_serial=not max_batch))
        out.append(Server(f"{label} batched", [*ours, *extra], width, False))
    out.append(
        Server(
            MLX_LM,
            [
                sys.executable,
                "-m",
                "mlx_lm.server",
                "--model",
                mlx_target,
                "--log-level",
                "WARNING",
            ],
            "auto",
            False,
            ours=False,
        )  # fmt: skip
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--model", help="target folder (default: the demo pair's)")
    ap.add_argument("--draft", help="draft folder (default: the demo pair's; none with --model)")
    ap.add_argument("--prompts", type=Path, help="JSONL prompts (default: the demo's held-out)")
    ap.add_argument("--no-mlx-lm", action="store_true", help="leave mlx_lm.server out")
    ap.add_argument("--startup", type=float, default=600, help="seconds a server may take")
    ap.add_argument("--json", type=Path, help="write every request's figures here")
    args = ap.parse_args()
    ns = [int(x) for x in args.concurrency.split(",")]

    if args.model is None:
        from dflash_mlx.demo import demo_pair

        target_dir, draft_dir = demo_pair()
        target, draft = str(target_dir), args.draft or str(draft_dir)
        default_prompts = target_dir.parent / "heldout_prompts.jsonl"
    else:
        target, draft, default_prompts = args.model, args.draft, None
    path = args.prompts or default_prompts
    pool = read_prompts(path) if path is not None else load_suite("all")
    texts = [p.summary for p in in_turn(pool, max(ns))]

    say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    folder = Path(tempfile.mkdtemp(prefix="concurrency-"))
    mlx_target = None if args.no_mlx_lm else float32_copy(target, folder)
    if mlx_target:
        say(f"an optimized BLAS is loaded: mlx_lm.server gets a float32 copy ({mlx_target})")
    max_batch = has_max_batch()
    servers = servers_for(target, draft, max_batch, mlx_target or target)
    if args.no_mlx_lm:
        servers = [s for s in servers if s.ours]
    if not max_batch:
        say("note: this serve has no --max-batch: serial rows send one request after another")
    try:
        for s in servers:
            say(f"starting {s.name}: {' '.join(s.argv)}")
            start(s, folder, args.startup)
            if s.failed:
                say(f"  {s.name} did not start ({s.failed}); going on without it")
                continue
            burst(s, [f"# warm-up\n{texts[0]}"], 32)  # compile, allocate; not measured
            burst(s, [f"# warm-up {k}\n{t}" for k, t in enumerate(texts)], 16)
        up = [s for s in servers if not s.failed]
        for rnd in range(args.rounds):
            for i, n in enumerate(ns):
                shift = (rnd * len(ns) + i) % len(up)
                for s in up[shift:] + up[:shift]:
                    prompts = [f"# request {rnd}.{n}.{k}\n{t}" for k, t in enumerate(texts[:n])]
                    s.results[(rnd, n)] = burst(s, prompts, args.tokens)
                    agg = figures(s.results[(rnd, n)])["aggregate"]
                    say(f"round {rnd + 1} N={n} {s.name}: {agg:.1f} tok/s")
    finally:
        for s in servers:
            stop(s)
    if not any(s.failed for s in servers):  # logs kept only when a server failed
        shutil.rmtree(folder, ignore_errors=True)
    return report(servers, ns, args)


def report(servers: list[Server], ns: list[int], args) -> int:
    up = [s for s in servers if not s.failed]
    serial = {s.width: s for s in up if s.ours and s.serial}
    mlx = next((s for s in up if not s.ours), None)

    def med(s: Server, n: int, key: str) -> float:
        return statistics.median(figures(s.results[(r, n)])[key] for r in range(args.rounds))

    print(f"\n{args.tokens} greedy tokens per request, /v1/completions streamed, "
          f"median of {args.rounds} round(s)\n")  # fmt: skip
    print("| N | server | aggregate tok/s | per-request tok/s | mean TTFT | max TTFT "
          "| × our serial | × mlx_lm.server |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in ns:
        for s in up:
            agg = med(s, n, "aggregate")
            base = serial.get(s.width) if s.ours else serial.get("auto")
            vs_serial = f"{agg / med(base, n, 'aggregate'):.2f}×" if base else "–"
            vs_mlx = f"{agg / med(mlx, n, 'aggregate'):.2f}×" if mlx else "–"
            print(
                f"| {n} | {s.name} | {agg:.1f} | {med(s, n, 'per_request'):.1f} | "
                f"{med(s, n, 'ttft_mean') * 1000:.0f} ms | {med(s, n, 'ttft_max') * 1000:.0f} ms "
                f"| {vs_serial} | {vs_mlx} |"
            )
    for s in servers:
        if s.failed:
            print(f"\n{s.name} did not run: {s.failed}")

    differ, compared, mlx_same, mlx_compared = [], 0, 0, 0
    for s in up:
        base = serial.get(s.width) if s.ours else serial.get("auto")
        if base is None or base is s:
            continue
        for key, replies in s.results.items():
            for k, (mine, theirs) in enumerate(zip(replies, base.results[key])):
                same = mine["text"] == theirs["text"]
                if s.ours:
                    compared += 1
                    if not same:
                        differ.append(f"{s.name} round {key[0] + 1} N={key[1]} request {k + 1}")
                else:
                    mlx_compared += 1
                    mlx_same += same
    print()
    if differ:
        print(f"**{len(differ)} of {compared} batched replies differ from their serial reply:** "
              + "; ".join(differ[:20]))  # fmt: skip
    else:
        print(f"All {compared} batched replies of ours equal their serial replies.")
    if mlx_compared:
        print(f"mlx_lm.server: {mlx_same} of {mlx_compared} replies equal our serial replies.")
    if args.json:
        data = {s.name: {f"{r}:{n}": v for (r, n), v in s.results.items()} for s in up}
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

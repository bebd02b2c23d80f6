"""No request waits on a measurement: a fresh `dflash-mlx serve --demo` (automatic width)
against one forced plain (`--verify-width 1`), both started as a user starts them, each with
a fresh cache folder, sent the same sequential streamed requests in alternating order, first
on this machine as it is, then with every core loaded by busy loops. The client's clock: the
first streamed chunk (TTFT) and the whole request.

    python benchmarks/serve_busy.py [--requests 12 --tokens 48]

Prints per phase the medians and the default / forced plain ratios (goal: TTFT within 1.5x,
whole requests within 1.3x), and each server's slowest request against its phase's median
(goal: none over 3x).
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
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "DFLASH_MLX_CACHE": tempfile.mkdtemp(prefix="dflash-serve-busy-")}
    exe = Path(sys.executable).with_name("dflash-mlx")
    cmd = [str(exe if exe.exists() else shutil.which("dflash-mlx")), "serve", "--demo"]
    cmd += ["--port", str(port)]
    proc = subprocess.Popen(cmd + extra, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1800):
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            sys.exit(f"error: the server exited: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.1)
    sys.exit("error: the server did not answer /health in 180 s")


def ask(base: str, prompt: str, tokens: int) -> tuple[float, float]:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    tic, first = time.perf_counter(), None
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                if json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - tic
    return first if first is not None else float("nan"), time.perf_counter() - tic


def phase(name: str, servers: dict, prompts: list[str], tokens: int) -> None:
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in servers}
    for i, p in enumerate(prompts):
        order = list(servers) if i % 2 == 0 else list(servers)[::-1]
        for k in order:
            got[k].append(ask(servers[k], p, tokens))
    med = {
        k: (statistics.median(t for t, _ in v), statistics.median(w for _, w in v))
        for k, v in got.items()
    }
    (ta, wa), (tp, wp) = med["auto"], med["plain"]
    print(
        f"{name}: TTFT auto {ta * 1e3:.0f} ms, plain {tp * 1e3:.0f} ms ({ta / tp:.2f}x); "
        f"whole auto {wa * 1e3:.0f} ms, plain {wp * 1e3:.0f} ms ({wa / wp:.2f}x)",
        flush=True,
    )
    for k, v in got.items():
        worst = max(w for _, w in v) / med[k][1]
        worst_t = max(t for t, _ in v) / med[k][0]
        print(
            f"  {k}: slowest request {worst:.2f}x its median, slowest TTFT {worst_t:.2f}x",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    from dflash_mlx.demo import SHIPPED

    lines = (SHIPPED / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(x)["prompt"] for x in lines][: args.requests]
    prompts = (prompts * (-(-args.requests // len(prompts))))[: args.requests]
    procs, servers = [], {}
    try:
        for name, extra in (("auto", []), ("plain", ["--verify-width", "1"])):
            proc, base = start(extra)
            procs.append(proc)
            servers[name] = base
        phase("as it is", servers, prompts, args.tokens)
        loops = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)
        ]
        try:
            phase("cores loaded", servers, prompts, args.tokens)
        finally:
            for p in loops:
                p.kill()
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


if __name__ == "__main__":
    main()

"""What a request arriving mid-stream costs the stream already running, by the client's clock.

    python benchmarks/admission_gap.py [--before REV] [--rounds 3] [--prompt-words 700]

Starts the real server (uvicorn, `--max-batch 8`) over the demo pair on a free 127.0.0.1
port, streams one greedy chat reply (A) and, once A has streamed a few events, sends B:
  * long prompt - a prompt of about 2000 tokens (`--prompt-words` 330), 8 greedy tokens;
  * costly schema - a short prompt whose `response_format` is a JSON schema with a 4 600-way
                    `pattern` alternation (its grammar takes a while to build).
For each, by the client's clock: A's worst gap between two events while B was in flight,
B's own time (sent to last event), and their ratio (the issue's goal: under a third).
With `--before REV`, the same runs against git revision REV's package (extracted to a
temporary folder, imported in a subprocess of its own), so both columns come from one run.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", metavar="REV")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=330)
    ap.add_argument("--package-root", help=argparse.SUPPRESS)  # (the subprocess's)
    args = ap.parse_args()
    if args.package_root is not None or args.before is None:
        if args.package_root:
            sys.path.insert(0, args.package_root)
        print(json.dumps(measure(args)))
        return
    runs = {}
    for name, root in [("this tree", str(ROOT)), (args.before, extract(args.before))]:
        argv = [sys.executable, __file__, "--package-root", root]
        argv += ["--rounds", str(args.rounds), "--prompt-words", str(args.prompt_words)]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        runs[name] = json.loads(out.strip().splitlines()[-1])
    print(f"{'case':<14} {'revision':<12} {'worst gap s':>11} {'B s':>7} {'gap / B':>8}")
    for case in ("long prompt", "costly schema"):
        for name, got in runs.items():
            r = got[case]
            print(
                f"{case:<14} {name[:12]:<12} {r['gap']:>11.3f} {r['own']:>7.3f} "
                f"{r['gap'] / r['own']:>8.2f}"
            )


def extract(rev: str) -> str:
    out = tempfile.mkdtemp(prefix="dflash-gap-before-")
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "dflash_mlx"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return out


def measure(args) -> dict:
    import httpx

    import dflash_mlx
    from dflash_mlx.demo import demo_pair
    from dflash_mlx.server import Engine, ServerSettings, create_server

    target_dir, draft_dir = demo_pair()
    pair, tok = dflash_mlx.load_pair(target_dir, draft_dir)
    engine = Engine(pair, tok, max_batch=8)
    settings = ServerSettings(model_id="demo", context_length=pair.context_limit)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = create_server(engine, settings, log_level="warning")
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
    for _ in range(200):
        try:
            httpx.get(base.replace("/v1/chat/completions", "/health"), timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.05)

    def stream(body: dict, stamps: list[float]) -> None:
        with httpx.stream("POST", base, json={**body, "stream": True}, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    stamps.append(time.perf_counter())

    # As costly as the server accepts: a pattern under its 65,536-character bound.
    alts = "|".join(f"[a-z]{{{i % 7 + 1}}}x{i}" for i in range(4600))
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": f"^({alts})$"}}}
    cases = {
        "long prompt": lambda k: {
            "messages": [{"role": "user", "content": f"{k} " + "lorem ipsum " * args.prompt_words}],
            "max_tokens": 8,
        },
        "costly schema": lambda k: {
            "messages": [{"role": "user", "content": f"Give a word, take {k}."}],
            "max_tokens": 8,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": f"w{k}", "schema": {**schema, "title": f"s{k}"}},
            },
        },
    }
    warm = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    stream({**warm, "temperature": 0}, [])
    out = {}
    for case, body_of in cases.items():
        gaps, owns = [], []
        for k in range(args.rounds):
            a_stamps: list[float] = []
            a_body = {
                "model": "demo",
                "temperature": 0,
                "max_tokens": 1500,
                "messages": [{"role": "user", "content": f"Round {k} of {case}: count on."}],
            }
            a = threading.Thread(target=stream, args=(a_body, a_stamps))
            a.start()
            while len(a_stamps) < 5:
                time.sleep(0.001)
            b_stamps: list[float] = []
            sent = time.perf_counter()
            stream({"model": "demo", "temperature": 0, **body_of(f"{case}-{k}")}, b_stamps)
            if len(b_stamps) < 2:
                sys.exit(f"{case}: B was answered with no tokens (refused?)")
            ended = b_stamps[-1] if b_stamps else time.perf_counter()
            a.join()
            # A's events while B was in flight (A may end first: its end ends the window).
            end = min(ended, a_stamps[-1])
            edges = [sent, *[t for t in a_stamps if sent < t < end], end]
            gaps.append(max(y - x for x, y in zip(edges, edges[1:])))
            owns.append(ended - sent)
        out[case] = {"gap": statistics.median(gaps), "own": statistics.median(owns)}
    server.should_exit = True
    engine.close()
    return out


if __name__ == "__main__":
    main()

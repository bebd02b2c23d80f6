"""`dflash-mlx serve --tree` with concurrent greedy requests: every reply batched, verified
as trees, and equal to the same request sent alone (issue 34's check, as a user runs it).

    python benchmarks/serve_trees.py [--clients 4] [--tokens 64] [--verify-width 12]

Runs the real command (uvicorn on a free loopback port) on the shipped demo pair (a trained
DFlash draft), at the automatic width (shown: where speculation cannot pay it decodes
plainly, and no tree runs) and at a fixed `--verify-width` (every speculative cycle a tree
of that budget), and on the demo target with a DFlash 2 draft built here (random weights:
its proposals are rarely right) at that width. For each, the requests are sent one at a
time, then all at once, through the `openai` client; it prints, per request, the batch
sizes its cycles ran at (`timings.ran.batches`), its tree cycles (`timings.ran.trees`),
tau, and whether the batched reply equals the lone one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from dflash_mlx.demo import demo_pair
from dflash_mlx.models.tiny import build_draft, draft_config

PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\ndef walk(root):",
    "for i in range(10):\n    if i % 2",
    "def parse(line):\n    parts = line.split(",
    "with open(path) as f:",
    "try:\n    import json\nexcept",
    "def merge(a, b):\n    out = []",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    exe = shutil.which("dflash-mlx") or "dflash-mlx"
    cmd = [exe, "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"serve exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit("serve did not start")


def ask(client, prompt: str, tokens: int):
    return client.completions.create(model="x", prompt=prompt, max_tokens=tokens, temperature=0)


def check(name: str, args: list[str], n: int, tokens: int) -> bool:
    proc, base = serve(args)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=600)
        prompts = PROMPTS[:n]
        alone = [ask(client, p, tokens) for p in prompts]
        with ThreadPoolExecutor(n) as pool:
            together = list(pool.map(lambda p: ask(client, p, tokens), prompts))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"\n{name}: serve {' '.join(args)}; {n} concurrent greedy requests, {tokens} tokens")
    print("req  batches (size: cycles)      tree cycles (budget: cycles)   tau   same as alone")
    ok = True
    for i, (a, t) in enumerate(zip(alone, together)):
        ran = t.model_extra["timings"]["ran"]
        batches = {int(k): v for k, v in ran["batches"].items()}
        trees = {int(k): v["cycles"] for k, v in ran["trees"].items()}
        same = a.choices[0].text == t.choices[0].text
        tau = t.model_extra["timings"].get("tau")
        ok &= same and max(batches, default=0) >= 2 and bool(trees)
        print(f"{i:3d}  {json.dumps(batches):26s}  {json.dumps(trees):30s} {tau!s:5.5}  {same}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--verify-width", type=int, default=12)
    args = ap.parse_args()
    target, _ = demo_pair()
    cfg = json.loads((Path(target) / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        d2 = Path(tmp) / "dflash2-draft"
        config = draft_config(
            cfg["num_hidden_layers"],
            [1, 3],
            block=16,
            vocab=cfg["vocab_size"],
            hidden=cfg["hidden_size"],
            dflash2=True,
        )
        build_draft(d2, config, seed=5)
        width = ["--verify-width", str(args.verify_width)]
        n = (args.clients, args.tokens)
        # The automatic width: where speculation cannot pay (a compute-bound CPU at this
        # batch size) it decodes plainly, so no tree runs; shown, not counted.
        check("trained DFlash pair (demo), automatic width", ["--demo", "--tree"], *n)
        ok = check("trained DFlash pair (demo)", ["--demo", "--tree", *width], *n)
        ok &= check(
            "DFlash 2 draft (random weights)",
            ["--model", str(target), "--draft", str(d2), "--tree", *width],
            *n,
        )
    print("\nevery reply batched, verified as trees, equal to alone:", ok)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

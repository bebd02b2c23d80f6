"""`dflash-mlx serve` under load on the tiny random demo pair, through the `openai` client.

    python benchmarks/serve_tiny.py [--rounds 5 --clients 8 --tokens 16]

Starts the real server (uvicorn, one engine worker) on a free 127.0.0.1 port over the
demo pair (`dflash_mlx.demo`, random: gibberish, tau ~ 1), then:
  * load        - `--rounds` times, `--clients` concurrent chat requests of `--tokens`
                  greedy tokens each; requests/s per round and per-request latency p50/p95;
  * second turn - a two-turn conversation: prompt tokens of turn 2, how many came from the
                  prompt cache and how many were prefilled. A reply is sent back as text
                  and re-tokenized; the random pair's replies (invalid UTF-8 shown as U+FFFD)
                  mostly re-tokenize differently, so their tokens are prefilled again.
The worker serves one request at a time, so latency under load is mostly queueing.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

import dflash_mlx
from dflash_mlx.demo import demo_pair
from dflash_mlx.server import Engine, ServerSettings, context_length, create_server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()

    target_dir, draft_dir = demo_pair()
    model, tok = dflash_mlx.load(str(target_dir))
    engine = Engine(model, dflash_mlx.load_draft(str(draft_dir)), tok)
    settings = ServerSettings(model_id="demo", context_length=context_length(model))
    server = create_server(engine, settings, log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", timeout=120, max_retries=0)

    def ask(i: int) -> float:
        tic = time.perf_counter()
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": f"Request {i}: what is {i} + {i}?"}],
            max_tokens=args.tokens,
            temperature=0,
        )
        return time.perf_counter() - tic

    ask(-1)  # warm the HTTP path
    latencies, rates = [], []
    with ThreadPoolExecutor(args.clients) as pool:
        for r in range(args.rounds):
            tic = time.perf_counter()
            latencies += pool.map(ask, range(r * args.clients, (r + 1) * args.clients))
            rates.append(args.clients / (time.perf_counter() - tic))
    latencies.sort()
    p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
    print(
        f"{args.clients} concurrent requests × {args.rounds} rounds, {args.tokens} tokens each: "
        f"{statistics.median(rates):.1f} req/s (median round, min {min(rates):.1f}, "
        f"max {max(rates):.1f}); latency p50 {statistics.median(latencies) * 1000:.0f} ms, "
        f"p95 {p95 * 1000:.0f} ms"
    )

    turn1 = [{"role": "user", "content": "Explain speculative decoding in two sentences."}]
    reply = client.chat.completions.create(
        model="demo", messages=turn1, max_tokens=64, temperature=0
    )
    turn2 = turn1 + [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "Now say it in one."},
    ]
    out = client.chat.completions.create(model="demo", messages=turn2, max_tokens=16)
    t = out.model_extra["timings"]
    print(
        f"turn 1: {reply.usage.prompt_tokens} prompt tokens, {reply.usage.completion_tokens} "
        f"generated; turn 2: {out.usage.prompt_tokens} prompt tokens, {t['cache_n']} from the "
        f"prompt cache, {t['prompt_n']} prefilled (the new message, and whatever of the reply "
        "re-tokenizes differently from the tokens generated: much of a random reply does)"
    )
    server.should_exit = True
    thread.join(timeout=30)


if __name__ == "__main__":
    main()

"""`dflash-mlx serve` under load on the tiny random demo pair, through the `openai` client.

    python benchmarks/serve_tiny.py [--rounds 5 --clients 8 --tokens 16]

Starts the real server (uvicorn, one engine worker) on a free 127.0.0.1 port over the
demo pair (`dflash_mlx.demo`, random: gibberish, tau ~ 1), then:
  * load        - `--rounds` times, `--clients` concurrent chat requests of `--tokens`
                  greedy tokens each; requests/s per round and per-request latency p50/p95;
  * second turn - a two-turn conversation: prompt tokens of turn 2, how many came from the
                  prompt cache and how many were prefilled.
  * shared prefix - an agent's case: a new conversation whose system prompt (`--prefix`
                  tokens, default 4000) another conversation already sent; time to first
                  token of the second conversation against the first, both measured by
                  the server (`timings.prompt_ms`) and by the client (first streamed
                  chunk), median of `--rounds`. A reply is sent back as text
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
from dflash_mlx.server import Engine, ServerSettings, create_server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=4000)
    args = ap.parse_args()

    target_dir, draft_dir = demo_pair()
    pair, tok = dflash_mlx.load_pair(str(target_dir), str(draft_dir))
    engine = Engine(pair, tok)
    # Room for the shared-prefix phase (the random pair has no trained context length).
    context = max(pair.context_limit or 0, args.prefix + 512)
    settings = ServerSettings(model_id="demo", context_length=context)
    server = create_server(engine, settings, log_level="warning")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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

    shared_prefix(client, tok, args.prefix, args.rounds)
    server.should_exit = True
    thread.join(timeout=30)


def shared_prefix(client: openai.OpenAI, tok, n: int, rounds: int) -> None:
    words = "Tools: read_file(path), write_file(path, text), run(cmd), search(query). " * n
    system = tok.decode(tok.encode(words)[:n])  # about n tokens of a system prompt

    def ttft(question: str) -> tuple[float, float, dict]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        tic = time.perf_counter()
        first = None
        stream = client.chat.completions.create(
            model="demo", messages=messages, max_tokens=2, temperature=0, stream=True
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
                if chunk.choices[0].delta.content:
                    first = time.perf_counter() - tic
            timings = chunk.model_extra.get("timings") or {}
        return timings["prompt_ms"], (first or time.perf_counter() - tic) * 1000, timings

    a_server, a_client, b_server, b_client = [], [], [], []
    for r in range(rounds):
        tag = f"{r}-{time.time_ns()}"  # new conversations each round, same system prompt
        system = f"[{tag}] " + system[len(f"[{tag}] ") :]  # a prefix no earlier round shares
        s, c, _ = ttft(f"Conversation A{r}: list the files.")
        a_server.append(s)
        a_client.append(c)
        s, c, t = ttft(f"Conversation B{r}: run the tests.")
        b_server.append(s)
        b_client.append(c)
    med = statistics.median
    print(
        f"shared prefix: {t['cache_n'] + t['prompt_n']}-token prompts sharing a ~{n}-token "
        f"system prompt; conversation B reused {t['cache_n']} cached tokens and prefilled "
        f"{t['prompt_n']}. TTFT (server) A {med(a_server):.0f} ms, B {med(b_server):.0f} ms "
        f"({med(a_server) / max(med(b_server), 1e-9):.1f}x); (client) A {med(a_client):.0f} ms, "
        f"B {med(b_client):.0f} ms ({med(a_client) / max(med(b_client), 1e-9):.1f}x); "
        f"median of {rounds}"
    )


if __name__ == "__main__":
    main()

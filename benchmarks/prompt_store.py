"""Time to first token with the prompt store: cold, memory hit, disk hit after a restart.

    python benchmarks/prompt_store.py                         # the demo pair, 2048 tokens
    python benchmarks/prompt_store.py --pair large --lengths 8192,16384

For each length N, two conversations share an N-token prefix (Python source, what the demo
pair was trained on) and differ in a short last message. In one process: a request with
no store (the baseline), conversation A with an empty store (cold: every block prefilled,
then kept), conversation B with the same store (memory hit). Then a new process (a
restart) on the same folder: conversation B again (disk hit: blocks read and verified),
and once more (memory hit, the blocks read before). TTFT is `Stats.time_to_first_token`
(prefill, store lookup and block reads included), the median of `--repeats` runs, each on
a fresh folder. Every hit's tokens are checked against the same prompt with no store.
`--pair large`: a random 8-layer target (hidden 256, 32k positions) and a random draft,
built once under the cache folder, for lengths past the demo target's 4096 positions.
Files are read through the OS page cache (this benchmark cannot drop it): on a cold SSD a
disk hit also waits for the read, at the drive's speed.

    python benchmarks/prompt_store.py --serve --lengths 2400

The real server: `dflash-mlx serve --demo --prompt-cache-dir D` answers conversation A
(an N-token prefix and a short message, token ids through /v1/completions), stops; a new
one on D answers conversation B (the same prefix, another message); a third with
--no-prompt-cache-dir answers B for the reference text. TTFT as the server measured it
(`timings.prompt_ms`) and the whole request as the client saw it.

    python benchmarks/prompt_store.py --draft [--lengths 2048]

The draft after a hit: blocks hold the target's cache only, so the draft's context starts
where the prefill does. Against a request with no store (the draft has seen the whole
prompt), at verify width 16 (every cycle drafts), 96 tokens, on 8 prompts (N tokens of
four stdlib modules at two offsets, then the next 30 tokens of the file): TTFT and tau
when the hit leaves the draft no rows of the prefix (what the store does) and when the
last 256 prefix positions are prefilled again for it (recomputing them: the store then
holds a prefix 256 tokens shorter).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import dflash_mlx
from dflash_mlx import GenerateOptions, PromptCache, stream_generate
from dflash_mlx.cache.prompt_store import PromptStore

SUFFIXES = ["\n\ndef first_request(x):\n", "\n\nclass SecondRequest:\n"]


def large_pair() -> tuple[Path, Path]:
    from dflash_mlx.demo import demo_pair
    from dflash_mlx.models.tiny import build_draft, build_target, draft_config, qwen3_config
    from dflash_mlx.paths import cache_dir

    folder = cache_dir() / "bench-large-pair-v1"
    if not (folder / "complete").exists():
        demo_target, _ = demo_pair()
        (folder / "target").mkdir(parents=True, exist_ok=True)
        for f in demo_target.glob("tokenizer*"):
            shutil.copy(f, folder / "target" / f.name)
        cfg = qwen3_config(vocab=2048, layers=8, hidden=256)
        cfg["max_position_embeddings"] = 32768
        build_target(folder / "target", cfg, seed=5)
        build_draft(folder / "draft", draft_config(8, [1, 6], vocab=2048, hidden=256), seed=6)
        (folder / "complete").write_text("ok\n")
    return folder / "target", folder / "draft"


def pair_dirs(name: str) -> tuple[Path, Path]:
    from dflash_mlx.demo import demo_pair

    return demo_pair() if name == "demo" else large_pair()


def prefix_ids(tok, n: int) -> list[int]:
    import inspect
    import typing

    text = ""
    for mod in (inspect, typing, json, argparse, statistics, shutil):
        text += Path(mod.__file__).read_text()
    ids = tok.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def ttft(pair, tok, ids, pc=None) -> tuple[float, list[int], tuple[int, int]]:
    opts = GenerateOptions(max_tokens=8)
    chunks = list(stream_generate(pair, tok, ids, opts, prompt_cache=pc))
    tokens = [t for c in chunks for t in c.tokens]
    return chunks[0].stats.time_to_first_token, tokens, pc.sources if pc else (0, 0)


def phase(args) -> dict:
    """One process's measurements (`--phase first` or `restart`), as JSON on stdout."""
    target, draft = pair_dirs(args.pair)
    pair, tok = dflash_mlx.load_pair(str(target), str(draft))
    prefix = prefix_ids(tok, args.length)
    a, b = (prefix + tok.encode(s) for s in SUFFIXES)
    ttft(pair, tok, prefix_ids(tok, 64))  # kernels and the pair's costs, before timing
    out: dict = {}
    if args.phase == "first":
        out["none"], ref, _ = ttft(pair, tok, b)
        store = PromptStore(args.folder)
        out["cold"], _, _ = ttft(pair, tok, a, PromptCache(store=store))
        out["memory"], got, src = ttft(pair, tok, b, PromptCache(store=store))
        assert got == ref and src[0] > 0, (src, "memory hit")
        store.flush()
        out["written"] = store.stats()["disk_bytes_written"]
        out["stored_tokens"] = src[0]
        Path(args.folder, "reference.json").write_text(json.dumps(ref))
    else:
        store = PromptStore(args.folder)
        out["disk"], got, src = ttft(pair, tok, b, PromptCache(store=store))
        assert src[1] > 0, (src, "no disk hit")
        out["memory_after"], got2, _ = ttft(pair, tok, b, PromptCache(store=store))
        ref = json.loads(Path(args.folder, "reference.json").read_text())
        assert got == ref == got2, "a disk hit changed the tokens"
        out["disk_tokens"] = src[1]
    return out


def draft_warmth(pair_name: str, n: int) -> None:
    import inspect
    import typing

    target, draft = pair_dirs(pair_name)
    pair, tok = dflash_mlx.load_pair(str(target), str(draft))
    opts = GenerateOptions(max_tokens=96, verify_width=16)

    def go(ids, pc=None):
        chunks = list(stream_generate(pair, tok, ids, opts, prompt_cache=pc))
        tokens = [t for c in chunks for t in c.tokens]
        return chunks[0].stats.time_to_first_token, chunks[-1].stats.tau, tokens

    go(tok.encode("def f(x):\n"))  # kernels, before timing
    rows: dict[str, list] = {}
    for mod in (inspect, typing, argparse, shutil):
        ids = tok.encode(Path(mod.__file__).read_text())
        for off in (3000, 9000):
            prefix, b = ids[off - n : off], ids[off - n : off + 30]
            t0, tau0, ref = go(b)
            rows.setdefault("no store: the draft saw the whole prompt", []).append((t0, tau0))
            for back, what in [(0, "hit, no draft rows for the prefix"),
                               (256, "hit, the last 256 prefix rows recomputed")]:  # fmt: skip
                store = PromptStore(None)
                go(prefix[: n - back] + ids[off + 500 : off + 530], PromptCache(store=store))
                t1, tau1, out = go(b, PromptCache(store=store))
                assert out == ref, "a hit changed the tokens"
                rows.setdefault(what, []).append((t1, tau1))
    print(f"| {pair_name} pair, {n}-token prefix, W=16 | TTFT (median) | tau (mean) |")
    print("|---|---:|---:|")
    for what, v in rows.items():
        ttft_s = statistics.median(x[0] for x in v)
        tau = statistics.mean(x[1] for x in v)
        print(f"| {what} | {ttft_s:.3f} s | {tau:.2f} |")


def serve_restart(n: int) -> None:
    """`dflash-mlx serve --demo` on a fresh folder: conversation A, a restart, conversation
    B sharing A's first `n` tokens (token-id prompts through /v1/completions); and a server
    with --no-prompt-cache-dir for B's reference text."""
    import re
    import signal
    import time

    import httpx

    from dflash_mlx.demo import demo_pair

    target, _ = demo_pair()
    tok = dflash_mlx.load(str(target))[1]
    prefix = prefix_ids(tok, n)
    a, b = (prefix + tok.encode(s) for s in SUFFIXES)
    folder = tempfile.mkdtemp(prefix="prompt-store-serve-")

    def ask(flags: list[str], ids: list[int]) -> dict:
        cmd = [sys.executable, "-c", "from dflash_mlx.cli.main import app; app()"]
        cmd += ["serve", "--demo", "--port", "0"]
        proc = subprocess.Popen(
            cmd + flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            port = None
            for line in proc.stdout:
                found = re.search(r"serving http://127\.0\.0\.1:(\d+)/v1", line)
                if found:
                    port = int(found.group(1))
                    break
            base = f"http://127.0.0.1:{port}"
            while httpx.get(f"{base}/health", timeout=600).json()["status"] != "ok":
                time.sleep(0.1)
            tic = time.perf_counter()
            body = {"prompt": ids, "max_tokens": 8, "temperature": 0}
            out = httpx.post(f"{base}/v1/completions", json=body, timeout=600).json()
            out["wall"] = time.perf_counter() - tic
            return out
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)

    on = ["--prompt-cache-dir", folder]
    cold = ask(on, a)
    hit = ask(on, b)  # a new process: the blocks come from disk
    ref = ask(["--no-prompt-cache-dir"], b)
    shutil.rmtree(folder, ignore_errors=True)
    assert hit["choices"][0]["text"] == ref["choices"][0]["text"], "a disk hit changed the text"
    t0, t1, tr = cold["timings"], hit["timings"], ref["timings"]
    print(f"| serve --demo, {len(b)}-token prompt | TTFT (server) | request (client) | from disk |")
    print("|---|---:|---:|---:|")
    for what, t, r in [("cold (A, empty folder)", t0, cold), ("no store (B)", tr, ref),
                       ("after a restart (B)", t1, hit)]:  # fmt: skip
        print(
            f"| {what} | {t['prompt_ms'] / 1000:.3f} s | {r['wall']:.3f} s | {t['cache_disk_n']} |"
        )
    print(f"after a restart / cold: {t1['prompt_ms'] / t0['prompt_ms']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=["demo", "large"], default="demo")
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft", action="store_true", help="the draft after a hit (see above)")
    ap.add_argument("--serve", action="store_true", help="a restarted demo server (see above)")
    ap.add_argument("--phase", choices=["first", "restart"], help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return
    if args.serve:
        for n in (int(x) for x in args.lengths.split(",")):
            serve_restart(n)
        return
    if args.draft:
        for n in (int(x) for x in args.lengths.split(",")):
            draft_warmth(args.pair, n)
        return
    pair_dirs(args.pair)  # built once, before the timed processes
    print(
        "| pair | prompt tokens | no store | cold | memory hit | disk hit (restart) | "
        "bytes written |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        runs = []
        for _ in range(args.repeats):
            folder = tempfile.mkdtemp(prefix="prompt-store-bench-")
            row = {}
            for ph in ("first", "restart"):
                cmd = [sys.executable, __file__, "--pair", args.pair, "--phase", ph,
                       "--folder", folder, "--length", str(n)]  # fmt: skip
                res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
                if res.returncode:
                    sys.exit(res.stderr)
                row.update(json.loads(res.stdout.strip().splitlines()[-1]))
            shutil.rmtree(folder, ignore_errors=True)
            runs.append(row)

        def med(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        cold = med("cold")
        print(
            f"| {args.pair} | {n} | {med('none'):.3f} s | {cold:.3f} s | "
            f"{med('memory'):.3f} s ({med('memory') / cold:.3f}x) | "
            f"{med('disk'):.3f} s ({med('disk') / cold:.3f}x) | "
            f"{med('written') / 1e6:.1f} MB |",
            flush=True,
        )


if __name__ == "__main__":
    main()

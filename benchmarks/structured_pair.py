"""A pair that writes JSON, for issue 38's must-show: constrained against free on a trained pair.

The shipped demo target is a code model: it neither writes the issue's schema's JSON nor
calls tools, so under a grammar its free strings are noise the draft cannot predict, and
`benchmarks/structured.py` on it measures the pair, not the engine. Real assistants are
trained on structured replies. This script makes a pair that is, small and offline:

1. target: the shipped demo target trained further on a mix of its own code corpus (the
   held-in standard library files) and replies of the issue's schema and tool calls to
   prompts that state their content (a file's name, kind, size and tags; a city, unit and
   number of days), the reply written as `json.dumps` writes it (the grammar's style).
2. draft: its DFlash draft, the shipped draft fine-tuned with the real `dflash-mlx train
   --init ... --regenerate` on prompts of the same mix (the target writes the replies).
3. draft2: the same draft upgraded to DFlash 2 (`dflash-mlx train --from`).
4. bench: `benchmarks/structured.py --pair DIR` on held-out prompts (files and cities never
   trained on), each constraint against free text on its own prompts.

    python benchmarks/structured_pair.py --dir D            # every stage (cached in D)
    python benchmarks/structured_pair.py --dir D --stage bench -- --width 8

Each stage is skipped when its output is in D already. Everything is seeded. Run it on one
core with OpenBLAS preloaded (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/
libblas.so.3). Measured on one core shared with 3-4 other jobs (load average 8-10): target
400 steps 20 min (its first steps, before the load rose, about 1 s each), draft 300 steps
14 min, draft2 100 steps about 7 min, each draft's data written by the target first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "scripts"))

CITIES = (
    "Paris London Berlin Madrid Rome Vienna Prague Warsaw Lisbon Dublin Oslo Helsinki "
    "Stockholm Copenhagen Athens Zurich Geneva Brussels Amsterdam Munich Hamburg Milan "
    "Naples Porto Seville Krakow Budapest Sofia Bucharest Riga Tallinn Vilnius Tokyo Osaka "
    "Kyoto Seoul Beijing Shanghai Delhi Mumbai Bangkok Hanoi Manila Jakarta Sydney "
    "Melbourne Auckland Toronto Montreal Vancouver Chicago Boston Denver Seattle Austin "
    "Houston Miami Atlanta Dallas Lima Bogota Quito Santiago Cairo Nairobi Lagos Accra "
    "Casablanca Tunis Dakar Marseille Lyon Nice Bordeaux Toulouse Nantes Lille"
).split()
HELD_OUT_CITIES = 12
UNITS = ("celsius", "fahrenheit")
KINDS = ("file", "dir", "link")


def files_info(files: list[Path]) -> list[tuple[str, int, list[str]]]:
    """(name, size, tags) of each file: its name, byte size, and the words of its name and
    first identifiers (at most 4 tags of at most 12 characters)."""
    import re

    out = []
    for f in files:
        text = f.read_text(errors="replace")
        words = [f.stem] + re.findall(r"^(?:def|class) ([A-Za-z_]\w*)", text, re.M)
        tags = []
        for w in words:
            w = w.strip("_").lower()[:12]
            if w and w not in tags:
                tags.append(w)
        out.append((f.name[:24], len(text.encode()), tags))
    return out


def schema_example(info, rng: random.Random) -> tuple[str, str]:
    """(prompt, reply) of the schema: the prompt states what the reply holds."""
    name, size, tags = info
    kind = rng.choice(KINDS)
    if kind != "file":
        name = name.removesuffix(".py")
    size = size if kind == "file" else rng.randrange(0, 4096)
    tags = tags[: rng.randint(0, 4)]
    prompt = (
        f"# {kind} {name}, {size} bytes" + (f", tags {' '.join(tags)}" if tags else "") + "\n"
        "# as JSON:\n"
    )
    reply = json.dumps({"name": name, "kind": kind, "size": size, "tags": tags})
    return prompt, reply


def tool_example(city: str, rng: random.Random) -> tuple[str, str]:
    unit, days = rng.choice(UNITS), rng.randint(1, 14)
    prompt = f"# User: the weather in {city} for {days} days, in {unit}.\n# Call a tool:\n"
    call = {"name": "get_weather", "arguments": {"city": city, "unit": unit, "days": days}}
    return prompt, f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def split():
    """(held-in code files, held-out code files), (held-in cities, held-out cities)."""
    from make_demo_pair import split_files

    held_out, held_in = split_files()
    cities = list(CITIES)
    random.Random(3).shuffle(cities)
    return (held_in, held_out), (cities[HELD_OUT_CITIES:], cities[:HELD_OUT_CITIES])


def stage_target(d: Path, steps: int, batch: int, seq: int) -> None:
    """The shipped target, trained further on code + structured replies (float32)."""
    import mlx.core as mx
    from train_targets import train_target

    from dflash_mlx.demo import SHIPPED

    base = d / "base"  # the shipped target's bf16 weights as float32, to train from
    base.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(SHIPPED / "target" / name, base / name)
    weights = mx.load(str(SHIPPED / "target" / "model.safetensors"))
    mx.save_safetensors(
        str(base / "model.safetensors"), {k: v.astype(mx.float32) for k, v in weights.items()}
    )
    cfg = json.loads((base / "config.json").read_text())
    (code_in, _), (cities_in, _) = split()
    rng = random.Random(0)
    infos = files_info(code_in)
    structured = []
    for _ in range(3000):
        p, r = schema_example(rng.choice(infos), rng)
        structured.append(p + r)
        p, r = tool_example(rng.choice(cities_in), rng)
        structured.append(p + r)
    # About as many tokens of code as of structured replies: a quarter of the code files.
    code = [f.read_text(errors="replace") for f in code_in]
    rng.shuffle(code)
    code = code[: max(8, len(code) // 4)]
    texts = structured + code
    rng.shuffle(texts)
    build = train_target(
        d / "target",
        texts,
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        vocab=cfg["vocab_size"],
        steps=steps,
        batch=batch,
        seq=seq,
        lr=1e-3,
        log=lambda s: print(s, flush=True),
        init=base,
    )
    (d / "target" / "BUILD.json").write_text(json.dumps(build, indent=1))
    print(json.dumps(build), flush=True)


def write_data(d: Path) -> None:
    """The draft's prompts (held-in) and the bench's prompts (held-out), as JSONL."""
    from tokenizers import Tokenizer
    from train_targets import windows

    (code_in, code_out), (cities_in, cities_out) = split()
    rng = random.Random(1)
    infos = files_info(code_in)
    tk = Tokenizer.from_file(str(d / "target" / "tokenizer.json"))
    longest = sorted(code_in, key=lambda f: f.stat().st_size, reverse=True)[:24]
    code = windows([f.read_text(errors="replace") for f in longest], tk, 8, 100, 1, "prompt")
    lines = code[:192]
    lines += [{"prompt": schema_example(rng.choice(infos), rng)[0]} for _ in range(160)]
    lines += [{"prompt": tool_example(rng.choice(cities_in), rng)[0]} for _ in range(160)]
    rng.shuffle(lines)
    (d / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rng = random.Random(2)
    bench = {
        "schema": [schema_example(i, rng)[0] for i in files_info(code_out)],
        "tool call": [tool_example(c, rng)[0] for c in cities_out[:8]],
    }
    (d / "prompts.json").write_text(json.dumps(bench, indent=1))


def train_draft(d: Path, out: str, how: list[str], steps: int) -> None:
    cmd = [
        sys.executable, "-c", "from dflash_mlx.cli.main import app; app()", "train",
        "--target", str(d / "target"),
        "--data", str(d / "data.jsonl"), "--out", str(d / out), "--regenerate",
        "--regen-tokens", "96", "--steps", str(steps), "--batch", "8",
        "--anchors-per-seq", "16", "--seq-len", "256", "--eval-every", str(steps),
        "--save-every", str(steps), "--force", *how,
    ]  # fmt: skip
    print("dflash-mlx " + " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the stages are cached")
    ap.add_argument("--stage", choices=["target", "draft", "draft2", "bench", "all"], default="all")
    ap.add_argument("--target-steps", type=int, default=400)
    ap.add_argument("--draft-steps", type=int, default=300)
    ap.add_argument("--draft2-steps", type=int, default=100)
    ap.add_argument("bench_args", nargs="*", help="after --: benchmarks/structured.py's")
    args = ap.parse_args()
    from dflash_mlx.demo import SHIPPED

    d, stage, times = args.dir, args.stage, {}
    d.mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    if stage in ("target", "all") and not (d / "target" / "BUILD.json").is_file():
        stage_target(d, args.target_steps, 16, 128)
        times["target"] = time.perf_counter() - tic
    if not (d / "prompts.json").is_file():
        write_data(d)
    if stage in ("draft", "all") and not (d / "draft" / "config.json").is_file():
        tic = time.perf_counter()
        train_draft(d, "draft", ["--init", str(SHIPPED / "draft")], args.draft_steps)
        times["draft"] = time.perf_counter() - tic
    if stage in ("draft2", "all") and not (d / "draft2" / "config.json").is_file():
        tic = time.perf_counter()
        train_draft(d, "draft2", ["--from", str(d / "draft")], args.draft2_steps)
        times["draft2"] = time.perf_counter() - tic
    if times:
        print("stage seconds: " + json.dumps({k: round(v) for k, v in times.items()}))
    if stage in ("bench", "all"):
        cmd = [sys.executable, str(HERE / "structured.py"), "--pair", str(d), *args.bench_args]
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


if __name__ == "__main__":
    main()

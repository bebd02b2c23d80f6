"""Targets this project never tuned `dflash-mlx train` on, built here, and their data (issue 44).

    python benchmarks/train_targets.py build code6 --out D/code6   # target, data, held-out
    python benchmarks/train_targets.py build prose --out D/prose
    python benchmarks/train_curve.py command --out D/code6/now -- --target D/code6/target \
        --data D/code6/data.jsonl --regenerate --steps 250 ...
    python benchmarks/train_curve.py reference --target D/code6/target --data D/code6/data.jsonl \
        --out D/code6/ref ...
    python benchmarks/train_curve.py eval D/code6/now D/code6/ref --target D/code6/target \
        --prompts D/code6/heldout.jsonl

(Issue 64's ordinary targets, `stdlib6` and `docs6`, with the plain recipe beside the
command: `benchmarks/ordinary_targets.py`.)

Two small Qwen3 targets trained from scratch on text already on this machine (no download),
each unlike the demo pair's (4 layers, hidden 256, a 2k BPE, stdlib code):

- `code6`: 6 layers, hidden 256, a 2k byte-level BPE, the Python standard library's source
  (the target of issue 44's report; the demo pair's held-in / held-out file split).
- `prose`: 5 layers, hidden 192, a 1k byte-level BPE, English shipped with the interpreter:
  the standard library's docstrings (one text per module) and the reference manual's topics
  (`pydoc_data.topics`), whole texts held out. (A 4k BPE on the topics alone, 105k tokens,
  made a target that wrote newlines.)

`build` writes TARGET/{config.json, model.safetensors, tokenizer*}, `data.jsonl` (480 raw
~100-token prompts from the held-in text, {"text"} lines for `train --regenerate`),
`heldout.jsonl` (16 {"prompt"} lines from held-out text) and `BUILD.json` (the steps, loss,
held-out loss, seconds). Everything is seeded. Run it with OpenBLAS preloaded on one core.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

TARGETS = {
    "code6": {"layers": 6, "hidden": 256, "vocab": 2048, "corpus": "stdlib"},
    "prose": {"layers": 5, "hidden": 192, "vocab": 1024, "corpus": "docs"},
}


def docstrings(path: Path) -> str:
    """The docstrings (of the module, its classes and functions) of a Python file, in order,
    those of 80 characters or more: English prose about code."""
    import ast

    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except (SyntaxError, ValueError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds)]
    return "\n\n".join(d for d in found if d and len(d) >= 80)


def corpus(name: str) -> tuple[list[str], list[str]]:
    """(held-in texts, held-out texts) of a corpus."""
    if name == "stdlib":
        sys.path.insert(0, str(HERE / "scripts"))
        from make_demo_pair import split_files

        held_out, held_in = split_files()
        read = lambda fs: [f.read_text(errors="replace") for f in fs]  # noqa: E731
        return read(held_in), read(held_out)
    if name == "pydoc":
        from pydoc_data.topics import topics

        texts = [topics[k] for k in sorted(topics)]
        random.Random(0).shuffle(texts)
        return texts[8:], texts[:8]
    if name == "docs":
        # English prose shipped with the interpreter: the standard library's docstrings (one
        # text per module, packages included, tests left out) and the reference manual's
        # topics (pydoc_data); whole texts held out.
        import sysconfig
        from pydoc_data.topics import topics

        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(
            f for f in root.rglob("*.py")
            if not {"test", "tests", "idlelib", "site-packages"} & set(f.relative_to(root).parts)
        )  # fmt: skip
        texts = [t for t in map(docstrings, files) if len(t) >= 400]
        texts += [topics[k] for k in sorted(topics)]
        random.Random(0).shuffle(texts)
        return texts[12:], texts[:12]
    raise ValueError(f"unknown corpus {name}")


def qwen3(layers: int, hidden: int, vocab: int) -> dict:
    heads = max(4, hidden // 64)
    return {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 0,
    }


def _fast_qwen3():
    """Patches mlx-lm's Qwen3 for the build's training only: SwiGLU and attention with
    `blocks.exp` (2**x: MLX 0.32's CPU exp is ~3x slower than its power, and the softmax and
    SiLU of every layer, forward and backward, were most of a step). The same values to
    float32 rounding; the weights are a plain Qwen3's. Returns the undo."""
    import mlx.core as mx
    import mlx_lm.models.qwen3 as qwen3_module

    from dflash_mlx.train.blocks import cross_entropy, exp, silu

    def swiglu(gate, x):
        return silu(gate) * x

    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        if sinks is not None or hasattr(cache, "bits"):
            return saved[1](queries, keys, values, cache, scale, mask, sinks)
        B, H, T, D = queries.shape
        Hkv, S = keys.shape[1], keys.shape[2]
        q = queries.reshape(B, Hkv, H // Hkv, T, D) * scale
        s = q @ keys[:, :, None].swapaxes(-1, -2)  # (B, Hkv, G, T, S)
        if isinstance(mask, str):  # "causal"
            mask = mx.arange(S)[None] <= mx.arange(S - T, S)[:, None]
        if mask is not None:
            s = mx.where(mask, s, -mx.inf) if mask.dtype == mx.bool_ else s + mask
        e = exp(s - mx.stop_gradient(s.max(-1, keepdims=True)))
        p = e / e.sum(-1, keepdims=True)
        return (p @ values[:, :, None]).reshape(B, H, T, D)

    saved = (qwen3_module.swiglu, qwen3_module.scaled_dot_product_attention)
    qwen3_module.swiglu, qwen3_module.scaled_dot_product_attention = swiglu, attention

    def undo():
        qwen3_module.swiglu, qwen3_module.scaled_dot_product_attention = saved

    return undo, cross_entropy


def train_target(
    folder: Path,
    texts: list[str],
    *,
    layers: int,
    hidden: int,
    vocab: int,
    steps: int,
    batch: int = 16,
    seq: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
    log=None,
    init: Path | None = None,
) -> dict:
    """A Qwen3 target trained from scratch on `texts` (with its own BPE) into `folder`, or
    (`init`) trained further from the target in `init` (its tokenizer and weights)."""
    from functools import partial

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from tokenizers import Tokenizer

    from dflash_mlx.models.tiny import write_tokenizer

    if init is not None:
        import shutil

        folder.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(init / name, folder / name)
    else:
        write_tokenizer(folder, texts, vocab)
    # A raw-text model: its "chat template" passes the text through, as the demo target's.
    cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())  # (already so when copied)
    tok_cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg_path.write_text(json.dumps(tok_cfg))
    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    data = np.array([t for e in tk.encode_batch(texts) for t in e.ids + [0]], np.int32)
    cfg = qwen3(layers, hidden, vocab)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    if init is not None:
        model.load_weights(str(init / "model.safetensors"))
        seed += 1  # other batches than the first run's
    rng = np.random.default_rng(seed)

    undo, fast_ce = _fast_qwen3()

    def loss_fn(m, x):
        return fast_ce(m(x[:, :-1]), x[:, 1:]).mean()

    warm = max(1, steps // 20)
    sched = optim.join_schedules(
        [optim.linear_schedule(0, lr, warm), optim.cosine_decay(lr, steps - warm, lr / 20)],
        [warm],
    )
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.05)
    state = [model.state, opt.state]
    grad_fn = nn.value_and_grad(model, loss_fn)

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(x):
        loss, grads = grad_fn(model, x)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    tic, losses = time.perf_counter(), []
    for step in range(steps):
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        loss = step_fn(mx.array(np.stack([data[s : s + seq + 1] for s in starts])))
        mx.eval(loss, state)
        losses.append(loss.item())
        if log and (step % 25 == 0 or step == steps - 1):
            log(f"target step {step + 1}/{steps} loss {np.mean(losses[-25:]):.3f} "
                f"({time.perf_counter() - tic:.0f} s)")  # fmt: skip
    undo()
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return {
        "config": cfg,
        "tokens": int(data.size),
        "steps": steps,
        "batch": f"{batch} x {seq}",
        "lr": lr,
        "final_loss": round(float(np.mean(losses[-25:])), 3),
        "train_seconds": round(time.perf_counter() - tic),
    }


def windows(texts: list[str], tk, n_per: int, tokens: int, seed: int, key: str) -> list[dict]:
    """`n_per` seeded ~`tokens`-token windows of each text, as {key: text} lines."""
    rng = random.Random(seed)
    out = []
    for text in texts:
        ids = tk.encode(text).ids
        if len(ids) <= tokens + 8:
            continue
        for s in sorted(rng.sample(range(len(ids) - tokens), min(n_per, len(ids) - tokens))):
            piece = tk.decode(ids[s : s + tokens])
            if piece.strip():
                out.append({key: piece})
    rng.shuffle(out)
    return out


def cmd_build(args) -> None:
    from tokenizers import Tokenizer

    spec = TARGETS[args.name]
    held_in, held_out = corpus(spec["corpus"])
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / "target"
    build = train_target(
        target,
        held_in,
        layers=spec["layers"],
        hidden=spec["hidden"],
        vocab=spec["vocab"],
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        log=lambda s: print(s, flush=True),
        init=args.init,
    )
    tk = Tokenizer.from_file(str(target / "tokenizer.json"))
    # 480 training prompts: 10 windows from each of 48 held-in texts (the longest ones).
    longest = sorted(held_in, key=len, reverse=True)[:48]
    data = windows(longest, tk, 10, 100, 1, "text")
    (args.out / "data.jsonl").write_text("\n".join(json.dumps(d) for d in data) + "\n")
    held = windows(held_out, tk, 3, 100, 2, "prompt")[:16]
    (args.out / "heldout.jsonl").write_text("\n".join(json.dumps(d) for d in held) + "\n")
    build.update(name=args.name, corpus=spec["corpus"], prompts=len(data), held_out=len(held))
    if args.init is not None:  # the steps before, from the first run's BUILD.json
        before = json.loads((args.init.parent / "BUILD.json").read_text())
        build["trained_from"] = {k: before[k] for k in ("steps", "lr", "final_loss")}
    (args.out / "BUILD.json").write_text(json.dumps(build, indent=1))
    print(json.dumps(build), flush=True)


def examples_of(folder: Path, model, tok, seq_len: int = 256, reply: int = 128, first=None):
    """The command's own training examples of `folder`'s data (the target writes the replies
    with `train --regenerate`'s batched regenerator), cached in folder/examples.json; or of
    its `first` lines only (not cached)."""
    import tempfile

    from dflash_mlx.cli.train import _regenerator
    from dflash_mlx.train.trainer import Example, read_examples

    cache = folder / "examples.json"
    data = folder / "data.jsonl"
    if first is not None:
        data = Path(tempfile.mkdtemp()) / "data.jsonl"
        data.write_text("\n".join((folder / "data.jsonl").read_text().splitlines()[:first]))
    elif cache.is_file():
        return [Example(*e) for e in json.loads(cache.read_text())]
    tic = time.perf_counter()
    examples, _ = read_examples(
        data, tok, seq_len=seq_len, regenerate=_regenerator(model, tok, reply),
        reply_room=min(reply, seq_len // 2),
    )  # fmt: skip
    print(f"regenerated {len(examples)} replies in {time.perf_counter() - tic:.0f} s", flush=True)
    if first is not None:
        return examples
    cache.write_text(json.dumps([[e.tokens, e.start] for e in examples]))
    return examples


def engine_tau(pair, tok, prompts: list[list[int]], width: int = 8, tokens: int = 128) -> float:
    from dflash_mlx import GenerateOptions, Stats, generate

    options = GenerateOptions(max_tokens=tokens, verify_width=width)
    return Stats.total([generate(pair, tok, p, options).stats for p in prompts]).tau


def cmd_sweep(args) -> None:
    """Short runs of recipe variants on one target, the same data and seed: engine τ at W=8
    on the held-out prompts, and the command's own held-out estimate."""
    import dflash_mlx
    from dflash_mlx.cli.train import default_mask_token
    from dflash_mlx.train import trainer as T

    model, tok = dflash_mlx.load(str(args.folder / "target"))
    examples = examples_of(args.folder, model, tok)
    train_set, estimate_prompts = T.split_held_out(examples, 8, 0)
    lines = (args.folder / "heldout.jsonl").read_text().splitlines()
    prompts = [tok.encode(json.loads(x)["prompt"]) for x in lines if x.strip()]
    results = []
    for variant in args.variant:
        over = dict(kv.split("=", 1) for kv in variant.split(",") if "=" in kv)
        ids = [int(x) for x in over.pop("layers_ids", "1,3").split(",")]
        cfg = T.draft_config_for(
            model, layers=2, block_size=8, target_layer_ids=ids,
            mask_token_id=default_mask_token(tok),
        )  # fmt: skip
        init = over.pop("init", "copy")
        pair = T.init_draft(model, cfg, seed=0)
        if init == "random":  # the draft's own random layers and fc, the target's norm
            import mlx.core as mx

            from dflash_mlx import Pair
            from dflash_mlx.models.config import DraftConfig
            from dflash_mlx.models.draft import DFlashDraft

            mx.random.seed(0)
            pair = Pair(model, DFlashDraft(DraftConfig.from_dict(cfg)))
            mx.eval(pair.draft.parameters())
        fields = {
            f: type(getattr(T.TrainSettings(), f)) for f in T.TrainSettings.__dataclass_fields__
        }
        kw = {
            k: (float(v) if fields.get(k) in (float, type(None)) else int(v))
            for k, v in over.items()
        }
        st = T.TrainSettings(
            **{"steps": args.steps, "batch": 16, "seq_len": 256, "anchors_per_seq": 32,
               "eval_every": 10**6, "save_every": 10**6, **kw}
        )  # fmt: skip
        out = args.folder / "sweep" / variant.replace("=", "_").replace(",", "+")
        tic = time.perf_counter()
        log = T.train(pair, tok, cfg, train_set, st, out)
        secs = time.perf_counter() - tic
        est = T.held_out_tau(pair, tok, estimate_prompts, 128)
        tau = engine_tau(pair, tok, prompts)
        row = {"variant": variant, "steps": args.steps, "loss": round(log.steps[-1]["loss"], 3),
               "estimate": round(est, 3), "engine_tau": round(tau, 3),
               "seconds": round(secs)}  # fmt: skip
        results.append(row)
        print(json.dumps(row), flush=True)
    with open(args.folder / "sweep.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in results))


def cmd_profile(args) -> None:
    """Where a training step's time goes (the recipe's step: 16 x ~228 tokens, 32 anchors,
    block 8, 2 layers reading 1 and 3): each part evaluated on its own, median of --steps."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    import dflash_mlx
    from dflash_mlx.cli.train import default_mask_token
    from dflash_mlx.train import trainer as T
    from dflash_mlx.train.blocks import grouped_blocks

    model, tok = dflash_mlx.load(str(args.folder / "target"))
    examples = examples_of(args.folder, model, tok, first=args.examples)
    cfg = T.draft_config_for(
        model, layers=2, block_size=8, target_layer_ids=[1, 3],
        mask_token_id=default_mask_token(tok),
    )  # fmt: skip
    pair = T.init_draft(model, cfg, seed=0)
    st = T.TrainSettings(steps=250, batch=16, seq_len=256, anchors_per_seq=32)
    opt = T.make_optimizer(st)
    grad = nn.value_and_grad(pair.draft, T.block_loss)
    tic = time.perf_counter()
    rows = T.TargetRows(pair, examples, 16)
    kept = time.perf_counter() - tic
    parts: dict[str, list[float]] = {}

    def timed(name, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        mx.eval(out)
        parts.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    def update(g):
        g, _ = optim.clip_grad_norm(g, 1.0)
        opt.update(pair.draft, g)
        return pair.draft.parameters(), opt.state

    for step in range(args.steps):
        chosen, tokens, lengths, si, an = T.sample_rows(examples, st, step)
        m, slot = grouped_blocks(si, len(tokens))
        toks = mx.array(tokens)
        timed("target forward (each step)", T.block_targets, pair, toks)
        feats, nxt = timed("kept rows, padded", rows.batch, chosen, tokens.shape[1])
        a = (pair, feats, nxt, toks, mx.array(si), mx.array(an), mx.array(lengths), 4.0)
        layout = (m, mx.array(slot))
        timed("draft forward", T.block_loss, *a, layout)
        _, g = timed("draft forward + backward", grad, *a, layout)
        timed("clip + AdamW", update, g)
    n = sum(len(e.tokens) for e in examples)
    print(f"the target reads {len(examples)} examples ({n} tokens) once: {kept:.2f} s")
    for name, ts in parts.items():
        ts = sorted(ts[1:])
        print(f"{name}: median {ts[len(ts) // 2]:.3f} s, min {ts[0]:.3f} s")


def cmd_check(args) -> None:
    """Whether a target writes text or loops: its greedy continuations of the held-out
    prompts (128 tokens), the share of distinct 4-grams in them and the most repeated token
    (a target that only repeats itself makes any draft look good)."""
    from collections import Counter

    from mlx_lm.generate import batch_generate

    import dflash_mlx

    model, tok = dflash_mlx.load(str(args.folder / "target"))
    lines = (args.folder / "heldout.jsonl").read_text().splitlines()
    prompts = [tok.encode(json.loads(x)["prompt"]) for x in lines if x.strip()]
    r = batch_generate(model, tok, prompts, max_tokens=128, return_token_ids=True)
    grams, top = [], Counter()
    for ids in r.token_ids:
        ids = list(ids)
        g = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
        grams.append(len(set(g)) / max(1, len(g)))
        top.update(ids)
    token, n = top.most_common(1)[0]
    print(json.dumps({
        "distinct_4grams": round(sum(grams) / len(grams), 3),
        "most_common_token": tok.decode([token]), "its_share": round(n / sum(top.values()), 3),
        "sample": tok.decode(list(r.token_ids[0]))[:300],
    }, ensure_ascii=False))  # fmt: skip


def cmd_gap(args) -> None:
    """Why the command's held-out estimate differs from engine τ: a trained draft's engine τ
    (W=8, 128 greedy tokens) on other windows of its training texts, on held-in texts it
    never trained on (the target did), and on the held-out prompts; each prompt's τ, and
    the spread of the pooled τ of 8 prompts (the estimate's count) drawn from each set."""
    import numpy as np
    from tokenizers import Tokenizer

    import dflash_mlx
    from dflash_mlx import GenerateOptions, Pair, Stats, generate, load_draft

    build = json.loads((args.folder / "BUILD.json").read_text())
    held_in, _ = corpus(build["corpus"])
    model, tok = dflash_mlx.load(str(args.folder / "target"))
    pair = Pair(model, load_draft(str(args.draft)))
    tk = Tokenizer.from_file(str(args.folder / "target" / "tokenizer.json"))
    longest = sorted(held_in, key=len, reverse=True)
    data = (args.folder / "data.jsonl").read_text().splitlines()
    trained = {json.loads(x)["text"] for x in data if x.strip()}
    lines = (args.folder / "heldout.jsonl").read_text().splitlines()
    sets = {
        "other windows of the draft's training texts": [
            w["p"] for w in windows(longest[:48], tk, 2, 100, 7, "p") if w["p"] not in trained
        ][:16],
        "held-in texts the draft never trained on": [
            w["p"] for w in windows(longest[48:88], tk, 1, 100, 8, "p")
        ][:16],
        "held-out prompts": [json.loads(x)["prompt"] for x in lines if x.strip()],
    }
    options = GenerateOptions(max_tokens=128, verify_width=8)
    rng = np.random.default_rng(0)
    for name, prompts in sets.items():
        stats = [generate(pair, tok, tok.encode(p), options).stats for p in prompts]
        per = np.array([(s.tau * s.cycles, s.cycles) for s in stats])
        picks = rng.integers(0, len(per), size=(4000, 8))
        pooled = per[picks, 0].sum(1) / per[picks, 1].sum(1)
        print(json.dumps({
            "set": name, "prompts": len(prompts),
            "engine_tau": round(Stats.total(stats).tau, 3),
            "per_prompt": sorted(round(a / b, 2) for a, b in per),
            "pooled_8_p5_p95": [round(float(x), 2) for x in np.percentile(pooled, [5, 95])],
        }), flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="train a target and write its data")
    b.add_argument("name", choices=sorted(TARGETS))
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--steps", type=int, default=200)
    b.add_argument("--batch", type=int, default=16)
    b.add_argument("--lr", type=float, default=3e-3)
    b.add_argument("--init", type=Path, help="train further the target in this folder")
    w = sub.add_parser("sweep", help="short runs of recipe variants (key=value,... settings)")
    w.add_argument("folder", type=Path)
    w.add_argument("--steps", type=int, default=60)
    w.add_argument("--variant", action="append", default=[])
    f = sub.add_parser("profile", help="where a training step's time goes")
    f.add_argument("folder", type=Path)
    f.add_argument("--steps", type=int, default=6)
    f.add_argument("--examples", type=int, default=64, help="the data's first lines only")
    k = sub.add_parser("check", help="does the target write text or loop")
    k.add_argument("folder", type=Path)
    g = sub.add_parser("gap", help="a draft's τ on training texts, held-in and held-out ones")
    g.add_argument("folder", type=Path)
    g.add_argument("--draft", type=Path, required=True)
    args = ap.parse_args()
    commands = {"build": cmd_build, "sweep": cmd_sweep, "profile": cmd_profile}
    {**commands, "check": cmd_check, "gap": cmd_gap}[args.cmd](args)


if __name__ == "__main__":
    main()

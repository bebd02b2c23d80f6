"""PromptStore: a prompt prefix prefilled once, taken by any conversation and after a
restart, and the tokens always those of a request with no cache (SPEC 1)."""

from __future__ import annotations

import logging
import shutil

import mlx.core as mx
import pytest

from dflash_mlx import GenerateOptions, Pair, PromptCache, load, stream_generate
from dflash_mlx.cache.prompt_store import PromptStore

from .test_prompt_cache import greedy

BLOCK = 64
STEP = 128  # prefill chunks end on block boundaries: a hybrid target keeps states there
PREFIX = "You are a coding agent. Tools: read, write, run.\n" * 12


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def named(request, models_dir, draft):
    model, tok = load(str(models_dir / request.param))
    return request.param, Pair(model, draft), tok


def run(pair, tok, ids, pc=None, width=4):
    opts = GenerateOptions(max_tokens=12, verify_width=width, prefill_step=STEP)
    chunks = list(stream_generate(pair, tok, ids, opts, prompt_cache=pc))
    return [t for c in chunks for t in c.tokens], chunks[0].stats.cached_tokens


def store(folder=None, **kw) -> PromptStore:
    return PromptStore(folder, **{"block_tokens": BLOCK, "write_after_tokens": 0, **kw})


def prompts(tok):
    prefix = tok.encode(PREFIX)
    a = prefix + tok.encode("def add(a, b):")
    b = prefix + tok.encode("import os\nprint(os.getcwd())")
    return prefix, a, b


def test_a_new_conversation_and_a_restart_take_the_stored_prefix(named, tmp_path):
    """Dense and hybrid targets: conversation B finds what A prefilled in memory, and a new
    store on the same folder (a restarted process) finds it on disk; B's tokens are the
    target's own greedy tokens every time."""
    name, pair, tok = named
    prefix, a, b = prompts(tok)
    assert len(prefix) > 4 * BLOCK
    ref_b = greedy(pair.model, tok, b)
    s = store(tmp_path)
    out, cached = run(pair, tok, a, PromptCache(store=s))
    assert cached == 0 and out == greedy(pair.model, tok, a)
    pc = PromptCache(store=s)
    out, cached = run(pair, tok, b, pc)
    # The blocks wholly inside the shared prefix (a hybrid target: at a chunk's end, where
    # its recurrent state was kept).
    whole = len(prefix) // BLOCK * BLOCK
    expected = whole if name == "qwen3" else whole // STEP * STEP
    assert cached == expected and pc.sources == (expected, 0), name
    assert out == ref_b, f"{name}: a stored prefix changed the tokens"
    assert s.flush(timeout=30)

    restarted = store(tmp_path)
    pc = PromptCache(store=restarted)
    out, cached = run(pair, tok, b, pc)
    assert cached == expected and pc.sources == (0, expected), f"{name}: no disk hit"
    assert out == ref_b, f"{name}: blocks read from disk changed the tokens"
    # Read once, the blocks are in memory too.
    pc = PromptCache(store=restarted)
    assert run(pair, tok, b, pc) == (ref_b, expected) and pc.sources == (expected, 0)


def test_a_conversation_keeps_its_own_longer_state(target, draft, tmp_path):
    """The store never shortens what the conversation's own cache gives (a next turn
    resumes after the whole previous exchange, not at a block boundary)."""
    model, tok = target
    pair = Pair(model, draft)
    _, a, _ = prompts(tok)
    pc = PromptCache(store=store(tmp_path))
    out, _ = run(pair, tok, a, pc)
    turn2 = a + out + tok.encode(" and the quick brown fox")
    out2, cached = run(pair, tok, turn2, pc)
    assert cached == len(a) + len(out) - 1 and pc.sources == (0, 0)
    assert out2 == greedy(model, tok, turn2)


def test_plain_decoding_and_drafts_share_the_target_blocks(target, draft, tmp_path):
    """Blocks hold the target's cache alone: a plain request (W = 1, no draft) takes what a
    speculative one stored, and the reverse."""
    model, tok = target
    pair = Pair(model, draft)
    _, a, b = prompts(tok)
    s = store(tmp_path)
    run(pair, tok, a, PromptCache(store=s), width=1)
    out, cached = run(pair, tok, b, PromptCache(store=s), width=4)
    assert cached > 0 and out == greedy(model, tok, b)


def stored(target, draft, tmp_path):
    """A store under `tmp_path` holding prompt `a`'s blocks, written to disk: the pair, the
    tokenizer, prompts `a` and `b`, the store and its block files."""
    model, tok = target
    pair = Pair(model, draft)
    _, a, b = prompts(tok)
    s = store(tmp_path)
    run(pair, tok, a, PromptCache(store=s))
    assert s.flush(timeout=30)
    return pair, tok, a, b, s, sorted(tmp_path.rglob("*.block"))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign"])
def test_bad_block_files_are_removed_and_answers_stay_right(
    target, draft, tmp_path, damage, caplog
):
    pair, tok, a, b, s, files = stored(target, draft, tmp_path)
    assert len(files) >= 4
    contents = [f.read_bytes() for f in files]
    for i, f in enumerate(files):
        if damage == "garbage":
            f.write_bytes(bytes((i * 7 + j) % 256 for j in range(len(contents[i]))))
        elif damage == "truncated":
            f.write_bytes(contents[i][: len(contents[i]) // 2])
        else:  # another block's file under this block's name
            f.write_bytes(contents[(i + 1) % len(files)])
    caplog.set_level(logging.WARNING, logger="dflash_mlx.cache.prompt_store")
    restarted = store(tmp_path)
    pc = PromptCache(store=restarted)
    out, cached = run(pair, tok, b, pc)
    assert out == greedy(pair.model, tok, b), f"{damage} files changed the answer"
    assert cached == 0 and pc.sources == (0, 0)
    assert restarted.stats()["disk_removed_bad"] >= 1
    assert any("removed" in r.getMessage() for r in caplog.records)
    # The bad file the request met is gone, replaced by the request's own good blocks.
    assert restarted.flush(timeout=30)
    again = PromptCache(store=store(tmp_path))
    assert run(pair, tok, b, again)[1] > 0 and again.sources[1] > 0


@pytest.mark.parametrize("forgery", ["re-keyed", "narrower", "not finite", "other model"])
def test_forged_block_files_are_rejected_and_counted(target, draft, tmp_path, forgery):
    """A file whose checksum and key are right but whose contents are not what the key says
    (issue 43): another block re-keyed, a head size one less, NaNs, another model's claim.
    Removed and counted; the answer is a cold one."""
    from dflash_mlx.cache.prompt_store.disk import decode, encode

    pair, tok, a, b, s, files = stored(target, draft, tmp_path)
    decoded = [decode(f.read_bytes(), f.stem) for f in files]
    for i, (f, (layers, meta)) in enumerate(zip(files, decoded)):
        if forgery == "re-keyed":  # the next file's whole contents, its key made this one's
            layers, meta = decoded[(i + 1) % len(files)]
        elif forgery == "narrower":
            layers[0].values = layers[0].values[..., :-1]
        elif forgery == "not finite":
            layers[-1].keys = layers[-1].keys * mx.array(float("nan"), layers[-1].keys.dtype)
        else:
            meta = {**meta, "model": "0" * 64}
        f.write_bytes(encode(layers, {**meta, "key": f.stem}))
    restarted = store(tmp_path)
    pc = PromptCache(store=restarted)
    out, cached = run(pair, tok, b, pc)
    assert out == greedy(pair.model, tok, b), f"{forgery} blocks changed the answer"
    assert cached == 0 and pc.sources == (0, 0)
    counts = restarted.stats()
    assert counts["rejected_blocks"] >= 1 and counts["disk_removed_bad"] >= 1, counts


def test_a_block_key_holds_the_model_and_its_dtype(models_dir, target, draft, tmp_path):
    """Blocks of one model are never taken by another one whose caches have the same shapes:
    its 4-bit quantization, or the same weights in another dtype."""
    model, tok = target
    _, a, b = prompts(tok)
    stored = tmp_path / "stored"
    run(Pair(model, draft), tok, a, PromptCache(store=(s := store(stored))))
    assert s.flush(timeout=30)
    quantized, _ = load(str(models_dir / "qwen3-4bit"))
    half, _ = load(str(models_dir / "qwen3"))
    half.set_dtype(mx.float16)
    for other, what in [(quantized, "4-bit"), (half, "float16")]:
        in_memory = store()
        run(Pair(model, draft), tok, a, PromptCache(store=in_memory))
        on_disk = tmp_path / what
        shutil.copytree(stored, on_disk)
        for where in (in_memory, store(on_disk)):  # memory, and disk after a restart
            out, cached = run(Pair(other, draft), tok, b, PromptCache(store=where))
            assert cached == 0, f"the {what} model took the other model's blocks"
            assert out == greedy(other, tok, b)


def test_the_memory_budget_holds_under_distinct_prefixes(target, draft):
    model, tok = target
    pair = Pair(model, draft)
    one = store()
    ids = tok.encode(PREFIX)
    run(pair, tok, ids, PromptCache(store=one))
    per_block = one.stats()["memory_bytes"] // one.stats()["memory_blocks"]
    budget = 5 * per_block
    s = store(memory_bytes=budget)
    for i in range(4):
        distinct = tok.encode(f"# request {i}\n") + ids
        run(pair, tok, distinct, PromptCache(store=s))
        st = s.stats()
        assert st["memory_bytes"] <= budget and st["memory_blocks"] <= 5
    # The most recent prefix is still there, in memory.
    pc = PromptCache(store=s)
    assert run(pair, tok, distinct + tok.encode("x"), pc)[1] > 0 and pc.sources[1] == 0


def test_short_prompts_are_written_when_seen_twice_and_bytes_are_counted(target, draft, tmp_path):
    model, tok = target
    pair = Pair(model, draft)
    _, a, _ = prompts(tok)
    s = store(tmp_path, write_after_tokens=10_000)
    run(pair, tok, a, PromptCache(store=s))
    assert s.flush(timeout=30)
    assert s.stats()["disk_written"] == 0 and not list(tmp_path.rglob("*.block"))
    run(pair, tok, a, PromptCache(store=s))  # seen twice: now worth the disk
    assert s.flush(timeout=30)
    files = list(tmp_path.rglob("*.block"))
    st = s.stats()
    assert st["disk_written"] == len(files) == (len(a) - 1) // BLOCK
    assert st["disk_bytes_written"] == sum(f.stat().st_size for f in files)


def test_bad_settings_are_refused_naming_the_value(tmp_path):
    from dflash_mlx.errors import BadArgument

    with pytest.raises(BadArgument, match="block_tokens=0"):
        PromptStore(block_tokens=0)
    with pytest.raises(BadArgument, match="memory_bytes=-1"):
        PromptStore(memory_bytes=-1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadArgument, match="file"):
        PromptStore(tmp_path / "file")


@pytest.mark.parametrize("costs", ["steep", "flat"])
def test_the_automatic_width_after_a_hit_keeps_the_tokens(target, draft, tmp_path, costs):
    """The default (automatic) width on synthetic costs: a CPU's steep curve (the draft
    dormant, its prompt window deferred) and a GPU's flat one (speculating from the start,
    the draft's context from where the prefill resumed)."""
    from .test_adaptive import FLAT, STEEP

    model, tok = target
    pair = Pair(model, draft)
    pair.calibrate_in_plan = False
    curves = STEEP if costs == "steep" else FLAT
    pair._curves_at_hand = lambda: curves
    _, a, b = prompts(tok)
    opts = GenerateOptions(max_tokens=24, prefill_step=STEP, seed=1)
    s = store(tmp_path)
    list(stream_generate(pair, tok, a, opts, prompt_cache=PromptCache(store=s)))
    chunks = list(stream_generate(pair, tok, b, opts, prompt_cache=PromptCache(store=s)))
    assert chunks[0].stats.cached_tokens > 0 and chunks[-1].stats.verify_width is None
    assert (max(c.width for c in chunks) > 1) == (costs == "flat")
    assert [t for c in chunks for t in c.tokens] == greedy(model, tok, b, 24)


def test_two_chat_sessions_share_a_system_prompt_through_the_store(pair, target, tmp_path):
    """The chat REPL's session takes the store: a second conversation with the same system
    prompt, in this process or after a restart, prefills only what follows the stored
    prefix, and answers as a session with no store does."""
    from dflash_mlx.chat.session import CHAT_DEFAULTS, ChatSession

    tok = target[1]
    opts = CHAT_DEFAULTS.replace(max_tokens=8, verify_width=4, prefill_step=STEP)

    def ask(store_, text):
        session = ChatSession(pair, tok, system=PREFIX, options=opts, store=store_)
        out = list(session.send(text))
        return [t for r in out for t in r.tokens], out[-1].stats.cached_tokens

    alone = ask(None, "def mul(a, b):")
    assert alone[1] == 0
    s = store(tmp_path)
    assert ask(s, "def add(a, b):")[1] == 0
    tokens, cached = ask(s, "def mul(a, b):")
    assert cached >= BLOCK and tokens == alone[0], (cached, "a stored prefix changed the reply")
    assert s.flush(timeout=30)
    tokens, cached = ask(store(tmp_path), "def mul(a, b):")  # a new process on the folder
    assert cached >= BLOCK and tokens == alone[0]


def test_chat_takes_the_prompt_cache_folder(models_dir, tmp_path):
    """`dflash-mlx chat` keeps prefixes in --prompt-cache-dir (shared with serve), and
    --no-prompt-cache-dir keeps nothing on disk."""
    from .test_cli_serve import dflash, text

    args = ["chat", "-m", str(models_dir / "qwen3"), "-d", str(models_dir / "draft")]
    args += ["--system", PREFIX * 2, "--max-tokens", "4", "--verify-width", "2", "-v"]
    folder = tmp_path / "blocks"
    for prompt in ("def add(a, b):", "def mul(a, b):"):
        done = dflash(*args, "--prompt-cache-dir", str(folder), input=prompt)
        assert done.returncode == 0, text(done)[1]
    assert "reused" in text(done)[1], "the second conversation took the first one's prefix"
    assert any(p.is_file() for p in folder.rglob("*")), "blocks were written to the folder"
    off = tmp_path / "off"
    done = dflash(*args, "--no-prompt-cache-dir", input="x", env={"DFLASH_MLX_CACHE": str(off)})
    assert done.returncode == 0, text(done)[1]
    assert not (off / "prompt-cache").exists()
    both = dflash(*args, "--prompt-cache-dir", str(folder), "--no-prompt-cache-dir", input="x")
    assert both.returncode == 2 and "--no-prompt-cache-dir" in text(both)[1]

"""The server's prompt store, through a real uvicorn server: a prefix one server prefilled
is read from disk by the next one on the same folder, token-identical."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_mlx.cache.prompt_cache import common_prefix
from dflash_mlx.cache.prompt_store import PromptStore
from dflash_mlx.cli.main import app as cli_app
from dflash_mlx.engine.generate import encode_prompt

from .test_server import MODEL, reference, serving

SYSTEM = {"role": "system", "content": "You are a coding agent. Tools: read, write, run. " * 24}
A = [SYSTEM, {"role": "user", "content": "def add(a, b):"}]
B = [SYSTEM, {"role": "user", "content": "import os"}]
BLOCK = 64


def store(folder) -> PromptStore:
    return PromptStore(folder, block_tokens=BLOCK, write_after_tokens=0)


def test_a_restarted_server_reads_the_prefix_from_disk(models_dir, target, draft, tmp_path):
    tok = target[1]
    ref_a, ref_b = reference(target, draft, A, 6), reference(target, draft, B, 6)
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    with serving(models_dir, verify_width=4, prompt_store=store(tmp_path)) as s:
        out = s.client().chat.completions.create(messages=A, **kw)
        assert out.choices[0].message.content == ref_a.text
        t = out.model_extra["timings"]
        assert (t["cache_n"], t["cache_memory_n"], t["cache_disk_n"]) == (0, 0, 0)
    # Closing the server waited for its block writes.
    assert list(tmp_path.rglob("*.block"))
    with serving(models_dir, verify_width=4, prompt_store=store(tmp_path)) as s:
        out = s.client().chat.completions.create(messages=B, **kw)
        pb = encode_prompt(tok, B)
        t = out.model_extra["timings"]
        shared = common_prefix(encode_prompt(tok, A), pb)
        assert t["cache_n"] > 3 * BLOCK, "the restarted server prefilled the shared prefix"
        assert t["cache_n"] == t["cache_disk_n"] and t["cache_memory_n"] == 0
        assert t["cache_n"] <= shared and t["prompt_n"] == len(pb) - t["cache_n"]
        assert out.choices[0].message.content == ref_b.text, "blocks from disk changed tokens"
        assert s.health()["prompt_cache"]["disk_tokens"] == t["cache_n"]


def test_serve_refuses_a_folder_and_no_folder_at_once(models_dir, tmp_path):
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    result = CliRunner().invoke(
        cli_app, ["serve", *pair, "--prompt-cache-dir", str(tmp_path), "--no-prompt-cache-dir"]
    )
    assert result.exit_code == 2 and "--no-prompt-cache-dir" in result.output
    result = CliRunner().invoke(cli_app, ["serve", *pair, "--prompt-cache-gb", "-1"])
    assert result.exit_code == 2 and "--prompt-cache-gb -1" in result.output


def test_the_cache_command_shows_and_clears_a_folder(tmp_path):
    from dflash_mlx.cache.prompt_store.disk import DiskTier

    from .test_prompt_store_disk import block

    tier = DiskTier(tmp_path, 10**9)
    for seed in range(3):
        tier.write(*block(seed))
    size = tier.usage()
    runner = CliRunner()
    shown = runner.invoke(cli_app, ["cache", "show", "--dir", str(tmp_path), "--json"])
    assert shown.exit_code == 0, shown.output
    info = json.loads(shown.output)
    assert (info["blocks"], info["bytes"]) == (3, size)
    shown = runner.invoke(cli_app, ["cache", "show", "--dir", str(tmp_path)])
    assert "3 blocks" in shown.output
    kept = runner.invoke(cli_app, ["cache", "clear", "--dir", str(tmp_path)], input="n\n")
    assert kept.exit_code == 1 and tier.usage() == size, "cleared without asking"
    cleared = runner.invoke(cli_app, ["cache", "clear", "--dir", str(tmp_path), "--yes"])
    assert cleared.exit_code == 0 and "removed 3 blocks" in cleared.output
    assert not tier.scan() and tmp_path.is_dir()
    empty = runner.invoke(cli_app, ["cache", "show", "--dir", str(tmp_path / "none")])
    assert empty.exit_code == 0 and "no prompt cache" in empty.output
    assert not (tmp_path / "none").exists(), "show created the folder"


def _forge(folder, make) -> int:
    """Rewrite every block file under `folder` as `make(key, layers, meta)` returns it, with a
    valid checksum and the file's own key (a forgery the disk tier's checks pass)."""
    from dflash_mlx.cache.prompt_store.disk import decode, encode

    files = sorted(folder.rglob("*.block"))
    for path in files:
        key = path.name.removesuffix(".block")
        layers, meta = decode(path.read_bytes(), key)
        layers, meta = make(key, layers, meta)
        path.write_bytes(encode(layers, {**meta, "key": key}))
    return len(files)


@pytest.mark.slow  # five servers: ~18 s here (test_prompt_store.py checks each forgery fast)
def test_forged_blocks_are_never_served(models_dir, target, draft, tmp_path):
    """Block files whose checksum and key are right but whose contents are not what the key
    says (another prefix's blocks, another model's, arrays of the wrong shape) are removed
    and counted, and the reply is a cold server's, token for token (issue 43: one was used,
    and a wrong head size gave a 500)."""
    import shutil

    from dflash_mlx.cache.prompt_store.disk import decode

    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    cold = reference(target, draft, B, 6).text
    other = [SYSTEM | {"content": "Another agent. " * 120}, A[1]]

    def written(folder, messages, target_name="qwen3"):
        with serving(
            models_dir, target=target_name, verify_width=4, prompt_store=store(folder)
        ) as s:
            s.client().chat.completions.create(messages=messages, **kw)
        return sorted(
            folder.rglob("*.block"), key=lambda p: int(decode(p.read_bytes(), p.stem)[1]["start"])
        )

    genuine = written(tmp_path / "genuine", A)
    foreign = written(tmp_path / "other-prefix", other)
    quantized = written(tmp_path / "other-model", A, "qwen3-4bit")
    assert len(genuine) >= 3 and len(foreign) >= len(genuine) and len(quantized) == len(genuine)
    order = {p.stem: i for i, p in enumerate(genuine)}

    def contents_of(files):
        def make(key, layers, meta):
            source = files[order[key]]
            layers, theirs = decode(source.read_bytes(), source.stem)
            return layers, theirs  # its own claims: another prefix's, or another model's

        return make

    def narrower(key, layers, meta):
        layers[0].keys = layers[0].keys[..., :-1]  # a head size one less, claims unchanged
        return layers, meta

    def shorter(key, layers, meta):
        for c in layers:
            c.keys, c.values, c.offset = c.keys[..., :-1, :], c.values[..., :-1, :], c.offset - 1
        return layers, meta

    for what, make in [
        ("another prefix's contents", contents_of(foreign)),
        ("another model's contents", contents_of(quantized)),
        ("a wrong head size", narrower),
        ("one position short", shorter),
    ]:
        folder = tmp_path / what.replace(" ", "-")
        shutil.copytree(tmp_path / "genuine", folder)
        assert _forge(folder, make) == len(genuine)
        with serving(models_dir, verify_width=4, prompt_store=store(folder)) as s:
            out = s.client().chat.completions.create(messages=B, **kw)
            counts = s.health()["prompt_cache"]
        assert out.choices[0].message.content == cold, what
        assert out.model_extra["timings"]["cache_disk_n"] == 0, what
        assert counts["rejected_blocks"] >= 1 and counts["disk_removed_bad"] >= 1, (what, counts)
    # The genuine files still serve: the checks refuse forgeries, not blocks.
    with serving(models_dir, verify_width=4, prompt_store=store(tmp_path / "genuine")) as s:
        out = s.client().chat.completions.create(messages=B, **kw)
    assert out.choices[0].message.content == cold
    assert out.model_extra["timings"]["cache_disk_n"] > 3 * BLOCK

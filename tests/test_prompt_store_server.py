"""The server's prompt store, through a real uvicorn server: a prefix one server prefilled
is read from disk by the next one on the same folder, token-identical."""

from __future__ import annotations

import json

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

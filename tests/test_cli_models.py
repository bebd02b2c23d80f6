"""`dflash-mlx ls / pull / rm` as users run them (the real command in a subprocess), on a
Hugging Face cache built in the test: tiny models saved in the cache's own layout (blobs,
snapshots linking to them, refs), named as a published target and its DFlash draft."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from dflash_mlx.models import human_size
from dflash_mlx.tiny import build_draft, build_target, draft_config, qwen3_config, write_tokenizer

from .test_cli_serve import dflash, text

TARGET = "mlx-community/Qwen3-4B-4bit"
DRAFT = "z-lab/Qwen3-4B-DFlash-b16"
PLAIN = "someone/tiny-lm"  # no DFlash draft is known for it


def cache_repo(cache: Path, repo_id: str, folder: Path) -> int:
    """`folder`'s files as huggingface_hub keeps a downloaded revision; their bytes."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    size = 0
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        size += len(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    return size


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """A cache with a 4-bit target, its registry draft and a float target without one."""
    src = tmp_path_factory.mktemp("built")
    cache = tmp_path_factory.mktemp("hub")
    for name in ("target", "plain"):
        (src / name).mkdir()
        write_tokenizer(src / name)
    build_target(src / "target", qwen3_config(), seed=1, quantize_bits=4)
    build_target(src / "plain", qwen3_config(), seed=2)
    build_draft(src / "draft", draft_config(4, [1, 2]), seed=3)
    sizes = {
        TARGET: cache_repo(cache, TARGET, src / "target"),
        DRAFT: cache_repo(cache, DRAFT, src / "draft"),
        PLAIN: cache_repo(cache, PLAIN, src / "plain"),
    }
    return cache, sizes


def run(cache: Path, *args: str, env: dict | None = None):
    return dflash(*args, env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", **(env or {})})


def listed(cache: Path, *args: str) -> dict[str, dict]:
    done = run(cache, "ls", "--json", *args)
    out, err = text(done)
    assert done.returncode == 0, err
    return {m["name"]: m for m in json.loads(out)}


def test_ls_lists_a_target_and_its_draft_with_sizes_and_the_pairing(hub):
    cache, sizes = hub
    done = run(cache, "ls")
    out, err = text(done)
    assert done.returncode == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {TARGET, DRAFT, PLAIN}
    assert out.splitlines()[0].split() == ["MODEL", "SIZE", "WEIGHTS", "DFLASH", "WHERE"]
    assert f"draft {DRAFT} (here)" in rows[TARGET]
    assert "4-bit (group 32)" in rows[TARGET]
    assert "DFlash draft for Qwen3-4B" in rows[DRAFT]
    assert "no known draft" in rows[PLAIN] and "float32" in rows[PLAIN]
    for name, size in sizes.items():
        assert human_size(size) in rows[name]
    models = listed(cache)
    for name, size in sizes.items():
        assert models[name]["size_bytes"] == size
        assert models[name]["source"] == "hf-cache"
    assert models[TARGET]["draft"] == DRAFT and models[TARGET]["draft_here"] is True
    assert models[DRAFT]["is_draft"] is True and models[PLAIN]["draft"] is None


def test_ls_reads_models_dir_folders_too(hub, models_dir):
    cache, _ = hub
    models = listed(cache, "--models-dir", str(models_dir))
    assert models["qwen3-4bit"]["weights"] == "4-bit (group 32)"
    assert models["qwen3-4bit"]["source"] == "models-dir"
    assert models["draft"]["is_draft"] is True
    size = sum(f.stat().st_size for f in (models_dir / "qwen3").iterdir())
    assert models["qwen3"]["size_bytes"] == size
    assert TARGET in models  # the cache is listed as well
    done = run(cache, "ls", "--models-dir", str(models_dir / "nowhere"))
    out, err = text(done)
    assert done.returncode == 2 and err.strip().count("\n") == 0
    assert "--models-dir" in err and "nowhere" in err


def test_rm_removes_a_draft_and_ls_then_says_it_is_missing(hub, tmp_path):
    cache = tmp_path / "hub"
    shutil.copytree(hub[0], cache, symlinks=True)
    refused = run(cache, "rm", DRAFT)  # no terminal to ask in, no --yes
    assert refused.returncode == 2 and "--yes" in text(refused)[1]
    assert (cache / ("models--" + DRAFT.replace("/", "--"))).exists()
    done = run(cache, "rm", DRAFT, "--yes")
    out, err = text(done)
    assert done.returncode == 0, err
    assert f"removed {DRAFT}" in out and human_size(hub[1][DRAFT]) in out
    models = listed(cache)
    assert DRAFT not in models and models[TARGET]["draft_here"] is False
    done = run(cache, "ls")
    out, err = text(done)
    assert f"draft {DRAFT} (not downloaded)" in out
    assert f"dflash-mlx pull {TARGET}" in err
    gone = run(cache, "rm", DRAFT, "--yes")
    assert gone.returncode == 2
    assert text(gone)[1].strip() == (
        f"error: no model '{DRAFT}' in the Hugging Face cache ({cache}): `dflash-mlx ls` lists them"
    )


def test_rm_removes_a_models_dir_folder(tmp_path, models_dir):
    root = tmp_path / "models"
    shutil.copytree(models_dir / "draft", root / "mine")
    done = run(tmp_path / "hub", "rm", "mine", "--models-dir", str(root), "--yes")
    assert done.returncode == 0, text(done)[1]
    assert not (root / "mine").exists() and root.exists()


@pytest.mark.parametrize(
    "env, says",
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
        ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot be reached"),
    ],
)
def test_pull_offline_fails_in_one_line_with_exit_2(tmp_path, env, says):
    done = run(tmp_path / "hub", "pull", TARGET, env=env)
    out, err = text(done)
    assert done.returncode == 2
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: cannot download {TARGET}: offline") and says in err
    assert "--model PATH" in err  # what to do instead
    assert not (tmp_path / "hub").exists() or not any((tmp_path / "hub").iterdir())


@pytest.mark.parametrize(
    "args, says",
    [
        (["./folder"], "TARGET './folder' must be a Hugging Face model id"),
        (["a/b/c"], "TARGET 'a/b/c' must be a Hugging Face model id"),
        ([TARGET, "--draft", "x y"], "--draft 'x y' must be a Hugging Face model id"),
        ([TARGET, "--draft", DRAFT, "--no-draft"], "--draft and --no-draft: give one"),
    ],
)
def test_pull_refuses_what_is_not_a_model_id_before_any_download(tmp_path, args, says):
    done = run(tmp_path / "hub", "pull", *args)
    out, err = text(done)
    assert done.returncode == 2 and err.count("\n") == 1, err
    assert says in err

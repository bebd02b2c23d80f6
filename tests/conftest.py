"""Session fixtures: tiny models built inside the test session, no downloads, no hub.

The builders live in `dflash_mlx.models.tiny` (shared with demos and benchmarks).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash_mlx.models.tiny import (
    VOCAB,
    build_draft,
    build_target,
    draft_config,
    qwen3_config,
    qwen35_config,
    write_tokenizer,
)


def pytest_configure(config):
    # Also in pyproject.toml; registered here for runs without it (.ci/floors.sh runs these
    # files from a copy outside the checkout, where slow tests are not deselected).
    config.addinivalue_line("markers", "slow: a slow end-to-end or statistical test")


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Calibration curves go to a session folder, never the user's cache."""
    old = os.environ.get("DFLASH_MLX_CACHE")
    os.environ["DFLASH_MLX_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        os.environ.pop("DFLASH_MLX_CACHE", None)
    else:
        os.environ["DFLASH_MLX_CACHE"] = old


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for name, cfg, seed, bits in [
        ("qwen3", qwen3_config(), 1, None),
        ("qwen3-4bit", qwen3_config(), 1, 4),
        ("qwen35", qwen35_config(), 2, None),
    ]:
        folder = root / name
        folder.mkdir()
        assert write_tokenizer(folder) <= VOCAB
        build_target(folder, cfg, seed, bits)
    build_draft(root / "draft", draft_config(4, [1, 2]), seed=3)
    return root


@pytest.fixture(scope="session")
def target(models_dir):
    from dflash_mlx import load

    return load(str(models_dir / "qwen3"))


@pytest.fixture(scope="session")
def draft(models_dir):
    from dflash_mlx import load_draft

    return load_draft(str(models_dir / "draft"))


@pytest.fixture
def pair(target, draft):
    """The session target and draft as a fresh Pair (nothing learnt by other tests)."""
    from dflash_mlx import Pair

    return Pair(target[0], draft)


@pytest.fixture
def prompt_file(tmp_path):
    """A few benchmark prompts as a JSONL file (the bench's `--prompts`)."""
    import json

    from .test_bench import PROMPTS

    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in PROMPTS))
    return path

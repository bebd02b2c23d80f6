"""Session fixtures: tiny models built inside the test session, no downloads, no hub.

The builders live in `dflash_mlx.tiny` (shared with demos and benchmarks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_mlx.tiny import (  # noqa: F401  (re-exported for the test modules)
    VOCAB,
    build_draft,
    build_target,
    draft_config,
    qwen3_config,
    qwen35_config,
    write_tokenizer,
)


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

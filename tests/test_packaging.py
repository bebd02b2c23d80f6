"""What `pip install` gets: the sdist and the wheel built from it hold every module and data
file of the tree, under the one top-level name `dflash_mlx`.

Builds with `python -m build` (sdist, then the wheel from the sdist, as an index or
`pip install git+URL` would), so a file the sdist drops is missing from the wheel too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Repository folder -> where it installs.
LAYOUT = {"dflash_mlx": "dflash_mlx", "cli": "dflash_mlx/cli", "quantize": "dflash_mlx/quantize"}


def expected_files(root: Path = ROOT) -> set[str]:
    """Every file the installed package needs: each module and each data file, tree-wide."""
    out = set()
    for folder, installed in LAYOUT.items():
        for path in (root / folder).rglob("*"):
            rel = path.relative_to(root / folder)
            if path.is_dir() or "__pycache__" in rel.parts or path.suffix == ".pyc":
                continue
            if rel.parts[0].endswith(".build"):  # scratch folders of scripts/make_demo_pair.py
                continue
            out.add(f"{installed}/{rel.as_posix()}")
    return out


def missing_from(names: set[str], root: Path = ROOT) -> list[str]:
    return sorted(expected_files(root) - names)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[set[str], set[str], str]:
    pytest.importorskip("build", reason="the test extras install `build`")
    # A clean copy of what git would hand a user (tracked and not ignored): no egg-info
    # from an editable install, whose file list would smuggle missing modules back in.
    src = tmp_path_factory.mktemp("src")
    listed = (
        subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as z:
        wheel_names = set(z.namelist())
        (entry,) = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = z.read(entry).decode()
    with tarfile.open(sdist) as t:
        # "dflash_mlx_engine-0.1.0/cli/main.py" -> "cli/main.py"
        sdist_names = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    return wheel_names, sdist_names, entry_points


def test_the_wheel_holds_every_module_and_data_file(built):
    wheel_names, _, _ = built
    assert missing_from(wheel_names) == []
    # The places that were missing before: a subpackage and the shipped demo pair.
    assert "dflash_mlx/server/app.py" in wheel_names
    assert "dflash_mlx/demo_pair/target/model.safetensors" in wheel_names
    assert "dflash_mlx/server/page/index.html" in wheel_names  # the chat page at /


def test_the_sdist_holds_every_source_file(built):
    _, sdist_names, _ = built
    missing = sorted(f for folder in LAYOUT for f in _tree(folder) if f not in sdist_names)
    assert missing == []
    assert {"pyproject.toml", "setup.py", "README.md"} <= sdist_names


def test_only_dflash_mlx_lands_at_the_top_of_site_packages(built):
    wheel_names, _, entry_points = built
    top = {n.split("/")[0] for n in wheel_names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"dflash_mlx"}
    assert "dflash-mlx = dflash_mlx.cli.main:app" in entry_points


def test_the_check_sees_a_subpackage_left_out(tmp_path):
    """The comparison itself: a new subpackage absent from a wheel is reported by name."""
    for folder in LAYOUT:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "dflash_mlx" / "newsub").mkdir()
    (tmp_path / "dflash_mlx" / "newsub" / "__init__.py").write_text("")
    (tmp_path / "cli" / "main.py").write_text("")
    wheel = {
        "dflash_mlx/__init__.py",
        "dflash_mlx/cli/__init__.py",
        "dflash_mlx/cli/main.py",
        "dflash_mlx/quantize/__init__.py",
    }
    assert missing_from(wheel, tmp_path) == ["dflash_mlx/newsub/__init__.py"]


def _tree(folder: str) -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / folder).rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.suffix != ".pyc"
        and not any(part.endswith(".build") for part in p.relative_to(ROOT).parts)
    }


def test_the_public_api_names_functions_whichever_submodule_loads_first():
    """The API loads lazily; importing `dflash_mlx.generate` the module (as the benchmark
    does) must leave `dflash_mlx.generate` the function."""
    code = (
        "import dflash_mlx.engine.generate, dflash_mlx.bench.benchmark, dflash_mlx\n"
        "from dflash_mlx import generate, stream_generate, load, load_draft\n"
        "assert dflash_mlx.generate is generate and callable(generate), dflash_mlx.generate\n"
        "assert generate.__name__ == 'generate' and stream_generate.__name__ == 'stream_generate'\n"
        "assert set(dflash_mlx.__all__) <= set(dir(dflash_mlx))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

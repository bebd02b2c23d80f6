"""Issue 63, item 8: user errors that exited 1 as "internal error ... a bug" exit 2 with
one `error:` line naming the value, before the slow work: `train` numbers and layer ids,
output folders that cannot be made (tried, not judged from permissions: root passes those),
`bench --json` into a missing folder (made up front), a prompt-cache budget no machine has,
and `ls` / `rm` of malformed or symlinked model folders."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from .test_cli_faults import run, user_error
from .test_cli_habits import data as data  # noqa: F401  (a fixture)
from .test_cli_serve import dflash, text


@pytest.mark.parametrize(
    "extra, names",
    [
        (["--draft-block", "0"], ["--draft-block 0", ">= 1"]),
        (["--block-size", "0"], ["--block-size 0", ">= 1"]),
        (["--steps", "0"], ["--steps 0", ">= 1"]),
        (["--batch", "0"], ["--batch 0", ">= 1"]),
        (["--layers", "0"], ["--layers 0", ">= 1"]),
        (["--target-layer-ids", "1,x"], ["--target-layer-ids '1,x'", "layer numbers"]),
    ],
)
def test_train_numbers_are_refused_before_loading(data, tmp_path, extra, names):
    """Each was an internal error (exit 1), after the target had loaded."""
    done = run("train", "-m", "/nonexistent/model", "--data", str(data),
               "--out", str(tmp_path / "o"), *extra)  # fmt: skip
    user_error(done, *names)
    assert not (tmp_path / "o").exists()


def test_train_layer_ids_the_target_lacks_are_refused_before_the_data_is_read(
    models_dir, data, tmp_path, monkeypatch
):
    from dflash_mlx.train import trainer

    def never(*args, **kwargs):
        raise AssertionError("the data was read")

    monkeypatch.setattr(trainer, "read_examples", never)
    done = run("train", "-m", str(models_dir / "qwen3"), "--data", str(data),
               "--out", str(tmp_path / "o"), "--target-layer-ids", "1,99")  # fmt: skip
    user_error(done, "--target-layer-ids 1,99", "layer 99", "0 to 3")


def _uncreatable(tmp_path: Path) -> list[Path]:
    """Output paths whose folder cannot be made, whoever runs the test (root included)."""
    paths = [tmp_path / ("x" * 300) / "out"]  # a name longer than the filesystem takes
    if Path("/proc/self").is_dir():
        paths.append(Path("/proc/dflash-mlx-62/out"))  # no folder can be made under /proc
    return paths


def test_out_folders_that_cannot_be_made_are_refused_up_front(data, tmp_path):
    for out in _uncreatable(tmp_path):
        done = run("train", "-m", "/nonexistent/model", "--data", str(data), "--out", str(out))
        user_error(done, "--out", "cannot be")
        for kind in ("draft", "target"):
            user_error(run("quantize", kind, "/nonexistent/model", "--out", str(out)), "--out")
        user_error(run("bench", "--model", "/nonexistent/m", "--json", str(out / "r.json")))


def test_bench_json_into_a_missing_folder_makes_it_before_the_bench_runs(tmp_path):
    """The folder was not made: the bench ran whole, then failed to write (results lost)."""
    where = tmp_path / "results" / "today" / "r.json"
    done = run("bench", "--model", "/nonexistent/model", "--json", str(where))
    assert done.exit_code == 2 and where.parent.is_dir(), done.output


def test_serve_refuses_a_cache_budget_no_machine_has():
    done = run("serve", "--demo", "--prompt-cache-memory-gb", "1e300")
    user_error(done, "--prompt-cache-memory-gb 1e+300", "1,000,000")
    user_error(run("serve", "--demo", "--prompt-cache-gb", "2e6"), "--prompt-cache-gb")


# -- ls / rm / -m -----------------------------------------------------------------------


def _malformed(root: Path, source: Path) -> dict[str, Path]:
    """Model folders of shapes `ls` and `rm` met in the wild (issue 63, item 8)."""
    import shutil

    shapes = {
        "arch-int": {"architectures": 5},
        "quant-str": {"quantization": "4bit"},
        "quant-odd": {"quantization": {"bits": 4, "group_size": [64], "mode": 3}},
        "dtype-list": {"torch_dtype": ["float16"]},
        "text-config": {"text_config": 7},
    }
    made = {}
    for name, config in shapes.items():
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(config))
        made[name] = root / name
    headers = {
        "header-list": [1, 2],
        "offsets-3": {"w": {"dtype": "F16", "data_offsets": [0, 1, 2]}},
        "dtype-obj": {"w": {"dtype": {"x": 1}, "data_offsets": [0, 2]}},
        "offsets-str": {"w": {"dtype": "F16", "data_offsets": ["0", "2"]}},
    }
    for name, header in headers.items():
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        raw = json.dumps(header).encode()
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
        made[name] = folder
    (root / "not-utf8").mkdir()
    (root / "not-utf8" / "config.json").write_bytes(b'{"x": "\xff"}')
    (root / "dangling").mkdir()
    (root / "dangling" / "config.json").write_text("{}")
    (root / "dangling" / "gone.safetensors").symlink_to(root / "nowhere")
    made["dangling"] = root / "dangling"
    (root / "loop").mkdir()
    (root / "loop" / "config.json").write_text("{}")
    (root / "loop" / "self").symlink_to(root / "loop" / "self")
    made["loop"] = root / "loop"
    shutil.copytree(source, root / "fine")
    made["fine"] = root / "fine"
    return made


def test_ls_and_rm_take_malformed_model_folders(tmp_path, models_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)  # names relative to here, as a user types them
    made = _malformed(Path("models"), models_dir / "draft")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = dflash("ls", "--models-dir", "models", env=env)
    assert done.returncode == 0, text(done)[1]
    done = dflash("ls", "--json", "--models-dir", "models", env=env)
    names = {m["name"] for m in json.loads(text(done)[0])}
    assert {f"models/{n}" for n in made} <= names, names
    for name in made:
        done = dflash("rm", f"models/{name}", "--models-dir", "models", "--yes", env=env)
        assert done.returncode == 0, (name, text(done)[1])
        assert not made[name].exists()


def test_rm_refuses_a_symlinked_model_folder_and_keeps_what_it_points_to(tmp_path, models_dir):
    import shutil

    real = tmp_path / "elsewhere" / "draft"
    shutil.copytree(models_dir / "draft", real)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "linked").symlink_to(real)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    where = str(tmp_path / "models")
    done = dflash("rm", "linked", "--models-dir", where, "--yes", env=env)
    out, err = text(done)
    assert done.returncode == 2 and err.startswith("error: rm ") and "symbolic link" in err, err
    assert (real / "config.json").is_file() and (tmp_path / "models" / "linked").is_symlink()

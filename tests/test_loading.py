"""Loading checks (issue: point 7): bad sources are refused with a message naming the problem."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from dflash_mlx import LoadError, generate, load, load_draft
from dflash_mlx.pair import Pair

from .conftest import build_draft, draft_config


def make_draft(tmp_path, name="d", **changes):
    cfg = draft_config(4, [1, 2])
    dcfg = changes.pop("dflash_config", {})
    cfg.update(changes)
    cfg["dflash_config"].update(dcfg)
    return build_draft(tmp_path / name, cfg, seed=0)


def copied_draft(models_dir, tmp_path, edit=None):
    """A copy of the session's draft folder, its config.json optionally edited in place."""
    folder = tmp_path / "d"
    shutil.copytree(models_dir / "draft", folder)
    if edit is not None:
        cfg = json.loads((folder / "config.json").read_text())
        edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_local_pair_loads_and_generates(models_dir):
    model, tok = load(models_dir / "qwen3")
    d = load_draft(models_dir / "draft")
    assert d.config.block_size == 16 and d.config.target_layer_ids == [1, 2]
    out = generate(model, d, tok, "hello", max_tokens=5)
    assert len(out.tokens) == 5


def test_draft_for_another_hidden_size_is_refused(target, tmp_path):
    model, _ = target
    cfg = draft_config(4, [1, 2])
    cfg.update(hidden_size=32, head_dim=8)
    d = load_draft(build_draft(tmp_path / "d", cfg, seed=0))
    with pytest.raises(LoadError, match=r"hidden size: draft 32, target 64"):
        Pair(model, d)


def test_draft_for_another_vocabulary_is_refused(target, tmp_path):
    model, _ = target
    d = load_draft(make_draft(tmp_path, vocab_size=500))
    with pytest.raises(LoadError, match=r"vocabulary: draft 500, target 320"):
        generate(model, d, target[1], "hi", max_tokens=2)


def test_draft_for_a_deeper_target_is_refused(target, tmp_path):
    model, _ = target
    cfg = draft_config(36, [1, 9, 17, 25, 33])
    d = load_draft(build_draft(tmp_path / "d", cfg, seed=0))
    with pytest.raises(LoadError) as e:
        Pair(model, d)
    msg = str(e.value)
    assert "36-layer target, target has 4" in msg and "[1, 9, 17, 25, 33] out of range" in msg


def test_target_layer_ids_outside_num_target_layers_are_refused(models_dir, tmp_path):
    folder = copied_draft(
        models_dir, tmp_path, lambda c: c["dflash_config"].update(target_layer_ids=[1, 7])
    )
    with pytest.raises(LoadError, match=r"target_layer_ids \[1, 7\] out of range"):
        load_draft(folder)


def test_missing_config_names_the_file(models_dir, tmp_path):
    folder = copied_draft(models_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(LoadError, match=r"config.json: file not found"):
        load_draft(folder)


def test_malformed_config_names_the_file(models_dir, tmp_path):
    folder = copied_draft(models_dir, tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match=r"config.json: not valid JSON"):
        load_draft(folder)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.pop("hidden_size"), r"missing field\(s\) hidden_size"),
        (lambda c: c.pop("dflash_config"), r"missing 'dflash_config'"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), r"no 'mask_token_id'"),
        (lambda c: c["dflash_config"].pop("block_size"), r"no 'block_size'"),
        (lambda c: c.update(layer_types=["banana", "full_attention"]), r"unknown layer type"),
        (lambda c: c.update(layer_types=["sliding_attention"] * 2), r"no sliding_window"),
    ],
)
def test_bad_config_fields_are_named(models_dir, tmp_path, edit, message):
    folder = copied_draft(models_dir, tmp_path, edit)
    with pytest.raises(LoadError, match=message):
        load_draft(folder)


def test_missing_weights_file_names_the_folder(models_dir, tmp_path):
    folder = copied_draft(models_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(LoadError, match=r"no \*.safetensors weights file"):
        load_draft(folder)


def test_weights_that_do_not_match_the_config_are_refused(models_dir, tmp_path):
    folder = copied_draft(models_dir, tmp_path)
    w = mx.load(str(folder / "model.safetensors"))
    w.pop("fc.weight")
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    with pytest.raises(LoadError, match=r"weights do not match config.json.*fc.weight"):
        load_draft(folder)


def test_dflash2_config_without_conv_and_selector_fields_is_refused(models_dir, tmp_path):
    folder = copied_draft(
        models_dir, tmp_path, lambda c: c.update(architectures=["DFlash2DraftModel"])
    )
    with pytest.raises(LoadError, match=r"DFlash 2 draft without dflash_config.conv_kernel_size"):
        load_draft(folder)


def test_unreachable_hub_id_says_how_to_pass_a_folder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LoadError, match=r"Hugging Face Hub.*local folder"):
        load_draft("dflash-mlx-tests/no-such-draft")
    with pytest.raises(LoadError, match=r"Hugging Face Hub.*local folder"):
        load("dflash-mlx-tests/no-such-target")


def test_a_path_that_does_not_exist_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(LoadError, match=r"no such folder"):
        load_draft(tmp_path / "nowhere")
    with pytest.raises(LoadError, match=r"is a file"):
        (tmp_path / "f").write_text("x")
        load(tmp_path / "f")


def test_a_target_folder_without_tokenizer_is_refused(models_dir, tmp_path):
    folder = tmp_path / "t"
    shutil.copytree(models_dir / "qwen3", folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(LoadError, match=r"no tokenizer file"):
        load(folder)


def _bf16_copy(src, dst):
    """A copy of a checkpoint folder with its floating-point weights stored in bfloat16."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        w = mx.load(str(f))
        mx.save_safetensors(
            str(f),
            {
                k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
                for k, v in w.items()
            },
        )
    return dst


def _dtypes(model):
    from mlx.utils import tree_flatten

    return {v.dtype for _, v in tree_flatten(model.parameters())}


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the float32 upcast is CPU-only")
def test_half_precision_weights_run_in_float32_on_a_cpu_with_openblas(
    models_dir, tmp_path, monkeypatch
):
    """MLX's CPU matmul has no BLAS path for bf16: with an optimized BLAS loaded such pairs
    are computed in float32; with the stock wheel's reference BLAS they are not."""
    from dflash_mlx import sysinfo

    monkeypatch.setattr(sysinfo, "blas_library", lambda: "libblas.so.3,libopenblasp-r0.3.21.so")
    target_dir = _bf16_copy(models_dir / "qwen3", tmp_path / "t")
    draft_dir = _bf16_copy(models_dir / "draft", tmp_path / "d")
    model, tok = load(target_dir)
    d = load_draft(draft_dir)
    assert _dtypes(model) == {mx.float32} and _dtypes(d) == {mx.float32}
    # still lossless: the upcast pair against its own plain greedy decode
    assert (
        generate(model, d, tok, "hello", max_tokens=12, verify_width=4).tokens
        == generate(model, None, tok, "hello", max_tokens=12).tokens
    )
    monkeypatch.setenv("DFLASH_MLX_CPU_FLOAT32", "0")
    assert _dtypes(load(target_dir)[0]) == {mx.bfloat16}
    assert _dtypes(load_draft(draft_dir)) == {mx.bfloat16}
    monkeypatch.delenv("DFLASH_MLX_CPU_FLOAT32")
    monkeypatch.setattr(sysinfo, "blas_library", lambda: "libblas-bd8a282c.so.3.10.0")
    assert _dtypes(load(target_dir)[0]) == {mx.bfloat16}, "reference BLAS: half is faster"
    monkeypatch.setenv("DFLASH_MLX_CPU_FLOAT32", "1")
    assert _dtypes(load(target_dir)[0]) == {mx.float32}


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the float32 upcast is CPU-only")
def test_quantized_and_oversized_models_keep_their_dtype(models_dir, tmp_path, monkeypatch):
    from dflash_mlx.models import loading

    monkeypatch.setenv("DFLASH_MLX_CPU_FLOAT32", "1")
    quantized = load(models_dir / "qwen3-4bit")[0]
    quantized.set_dtype(mx.bfloat16)  # scales and biases in bf16, as mlx-lm writes them
    assert not loading.cpu_float32(quantized)
    assert _dtypes(quantized) == {mx.uint32, mx.bfloat16}
    target_dir = _bf16_copy(models_dir / "qwen3", tmp_path / "t")
    monkeypatch.setenv("DFLASH_MLX_CPU_FLOAT32", "1")
    monkeypatch.setattr(loading, "_physical_memory", lambda: 1024)  # no room for the copy
    assert _dtypes(load(target_dir)[0]) == {mx.bfloat16}

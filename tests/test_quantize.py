"""Quantized drafts and targets (`quantize/`), round trips and errors."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from typer.testing import CliRunner

from dflash_mlx import Pair, generate, load, load_draft
from dflash_mlx.cli.main import app
from dflash_mlx.models.conv import DynamicConv
from dflash_mlx.quantize import compare_drafts, quantize_draft, quantize_target, save_draft

from .conftest import build_draft, draft_config
from .test_decode import PROMPTS, target_greedy


def block_logits(draft, model, seed=0):
    state = Pair(model, draft).draft_state()
    mx.random.seed(seed)
    draft.add_context(mx.random.normal((1, 24, 128)), state)
    return draft.block_logits(mx.array([9]), draft.config.block_size, None, state)


def relative_error(a: mx.array, b: mx.array) -> float:
    return (mx.sqrt(((a - b) ** 2).sum()) / mx.sqrt((b**2).sum())).item()


@pytest.fixture(scope="module")
def draft2(models_dir):
    folder = models_dir / "draft2-q"
    if not folder.exists():
        build_draft(folder, draft_config(4, [1, 2], dflash2=True), seed=5)
    return load_draft(folder)


# Affine quantization rounds each weight to one of 2^b levels spanning its group's range:
# for roughly uniform weights the relative RMS error per layer is about 1 / (2^b - 1)
# (0.4% at 8 bits, 6.7% at 4 bits). Errors of the ~10 quantized matmuls on the path to the
# logits add up roughly in quadrature (x3), so the bounds below leave a 2-3x margin.
BOUNDS = {8: 0.03, 4: 0.4}


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_keeps_logits_close_and_layers_quantized(target, draft, tmp_path, bits):
    model, _ = target
    q, cfg = quantize_draft(draft, bits=bits, group_size=32)
    save_draft(q, cfg, tmp_path / "q")
    loaded = load_draft(tmp_path / "q")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization"] == {
        "group_size": 32,
        "bits": bits,
        "mode": "affine",
    }
    err = relative_error(block_logits(loaded, model), block_logits(draft, model))
    assert err < BOUNDS[bits], f"{bits}-bit logits drifted by {err:.3f}"
    assert err > 0, "the quantized draft must differ from the float one"
    kinds = {p: type(m) for p, m in loaded.named_modules()}
    assert kinds["fc"] is nn.QuantizedLinear
    assert kinds["layers.0.self_attn.q_proj"] is nn.QuantizedLinear
    assert kinds["layers.1.mlp.down_proj"] is nn.QuantizedLinear
    assert kinds["layers.0.input_layernorm"] is nn.RMSNorm and kinds["norm"] is nn.RMSNorm


def test_dflash2_conv_and_selector_stay_float(target, draft2, tmp_path):
    q, cfg = quantize_draft(draft2, bits=4, group_size=32)
    save_draft(q, cfg, tmp_path / "q2")
    loaded = load_draft(tmp_path / "q2")
    conv = loaded.layers[0].attention_conv
    assert isinstance(conv, DynamicConv) and type(conv.kernel_projection) is nn.Linear
    assert type(loaded.candidate_selector.hidden_projection) is nn.Linear
    assert loaded.candidate_selector.predecessor_codebook.dtype == mx.float32
    assert type(loaded.layers[0].self_attn.k_proj) is nn.QuantizedLinear


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_greedy_decoding_with_a_quantized_draft_is_still_lossless(target, draft, bits):
    model, tok = target
    q, _ = quantize_draft(draft, bits=bits, group_size=32)
    pair = Pair(model, q)
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt)
        out = generate(pair, tok, ids, max_tokens=30, verify_width=8)
        assert out.tokens == target_greedy(model, ids, 30)


def test_compare_drafts_reports_tau_and_memory(target, draft):
    model, tok = target
    q, _ = quantize_draft(draft, bits=4, group_size=32)
    r = compare_drafts(model, tok, draft, q, prompts=2, max_tokens=12)
    assert r.tau_original >= 1 and r.tau_quantized >= 1
    assert r.bytes_quantized < r.bytes_original / 4 and r.bytes_saved > 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"bits": 7}, r"bits 7 not supported in affine mode"),
        ({"mode": "int3"}, r"mode 'int3' is not an MLX quantization mode"),
        ({"bits": 8, "mode": "mxfp4", "group_size": 32}, r"bits 8 not supported in mxfp4"),
        ({"group_size": 48}, r"group size 48 not supported"),
    ],
)
def test_unsupported_settings_are_refused(draft, kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_draft(draft, **{"bits": 4, "group_size": 64, **kwargs})


def test_a_group_size_that_does_not_divide_a_layer_names_it(tmp_path):
    cfg = draft_config(4, [1, 2], hidden=96)  # fc input 192, projections 96: not / 128
    d = load_draft(build_draft(tmp_path / "d96", cfg, seed=0))
    with pytest.raises(ValueError, match=r"does not divide the input dimension 192 of layer fc"):
        quantize_draft(d, bits=4, group_size=128)


def test_cli_quantizes_a_draft_checks_tau_and_refuses_existing_output(models_dir, tmp_path):
    runner = CliRunner()
    out = tmp_path / "q8"
    args = [
        "quantize",
        "draft",
        str(models_dir / "draft"),
        "-o",
        str(out),
        "--bits",
        "8",
        "--group-size",
        "32",
    ]
    r = runner.invoke(app, [*args, "--check", "--target", str(models_dir / "qwen3")])
    assert r.exit_code == 0, r.output
    assert "τ check" in r.stdout and "change" in r.stdout
    assert load_draft(out).config.quantization["bits"] == 8
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "exists; pass --force" in again.stderr
    forced = runner.invoke(app, [*args, "--force"])
    assert forced.exit_code == 0, forced.output


def test_cli_refuses_a_source_that_is_not_a_draft(models_dir, tmp_path):
    r = CliRunner().invoke(
        app, ["quantize", "draft", str(models_dir / "qwen3"), "-o", str(tmp_path / "x")]
    )
    assert r.exit_code == 2
    assert "dflash_config" in r.stderr and "Traceback" not in r.output


def test_target_wrapper_writes_a_folder_dflash_mlx_loads(models_dir, draft, tmp_path):
    out = tmp_path / "t4"
    quantize_target(str(models_dir / "qwen3"), out, bits=4, group_size=32)
    model, tok = load(out)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    ids = tok.encode(PROMPTS[0])
    assert generate(Pair(model, draft), tok, ids, max_tokens=12, verify_width=4).tokens == (
        target_greedy(model, ids, 12)
    )


@pytest.mark.parametrize(("seconds", "noted"), [((1e-3, 1.5e-3), True), ((1e-3, 0.8e-3), False)])
def test_check_says_when_a_quantized_draft_keeps_tau_but_runs_slower(
    models_dir, tmp_path, monkeypatch, seconds, noted
):
    """The draft pass timed on this device (injected here: a slower and a faster one):
    a quantized draft that keeps τ but drafts slower gets a note saying so."""
    import sys

    check = sys.modules["dflash_mlx.quantize.check"]
    timings = iter(seconds)
    monkeypatch.setattr(check, "draft_seconds", lambda model, draft: next(timings))
    out = tmp_path / "q8"
    args = ["quantize", "draft", str(models_dir / "draft"), "-o", str(out), "--bits", "8"]
    args += ["--group-size", "32", "--check", "--target", str(models_dir / "qwen3")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "draft pass" in r.stdout and "1.00 ms" in r.stdout
    said = " ".join(r.stderr.split())
    assert ("keeps τ" in said and "1.50× slower" in said) == noted, said

"""`--model` alone, in every command: the registry of published drafts names the draft, and a
target with none known decodes plainly with one note saying how to add one (issue 25, item
1). The real `dflash-mlx` command in a subprocess, on the tiny session models."""

from __future__ import annotations

import json

import dflash_mlx

from .test_cli_serve import dflash, text

PROMPT = "def add(a, b):"


def test_generate_with_model_alone_decodes_plainly_with_one_note(models_dir, target):
    done = dflash("generate", "-m", str(models_dir / "qwen3"), "--raw", "--json", "-n", "8", PROMPT)
    out, err = text(done)
    assert done.returncode == 0, err
    model, tokenizer = target
    ref = dflash_mlx.generate(model, None, tokenizer, PROMPT, max_tokens=8, temperature=0)
    data = json.loads(out)
    assert data["tokens"] == ref.tokens and data["verify_width"] == 1
    said = " ".join(err.split())
    assert said.count("no known DFlash draft") == 1 and "--draft DRAFT" in said, err
    assert "error" not in err


def test_generate_with_a_known_target_loads_its_published_draft(models_dir, tmp_path):
    """A folder named as a conversion of Qwen3-4B gets z-lab's Qwen3-4B draft (offline here,
    so loading it fails, naming it: the lookup happened)."""
    folder = tmp_path / "Qwen3-4B-4bit"
    folder.symlink_to(models_dir / "qwen3", target_is_directory=True)
    done = dflash("generate", "-m", str(folder), "-n", "4", PROMPT, env={"HF_HUB_OFFLINE": "1"})
    out, err = text(done)
    assert done.returncode == 2, err
    assert "draft: z-lab/Qwen3-4B-DFlash-b16, published for Qwen3-4B" in " ".join(err.split())
    assert "error: could not fetch draft 'z-lab/Qwen3-4B-DFlash-b16'" in err
    assert "--draft is required" not in err


def test_chat_with_an_unknown_target_decodes_plainly_with_one_note(models_dir, target):
    done = dflash("chat", "-m", str(models_dir / "qwen3"), "--max-tokens", "4", input="hello")
    out, err = text(done)
    assert done.returncode == 0, err
    model, tokenizer = target
    messages = [{"role": "user", "content": "hello"}]
    ref = dflash_mlx.generate(model, None, tokenizer, messages, max_tokens=4, temperature=0)
    assert out == ref.text + "\n"
    assert " ".join(err.split()).count("no known DFlash draft") == 1


def test_bench_with_model_alone_measures_plain_decoding(models_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    model, out_json = str(models_dir / "qwen3"), str(tmp_path / "r.json")
    done = dflash("bench", "-m", model, "--prompts", str(prompts), "--repeats", "1",
                  "--max-tokens", "4", "--json", out_json)  # fmt: skip
    out, err = text(done)
    assert done.returncode == 0, err
    assert "no known DFlash draft" in " ".join(err.split())
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["models"]["draft"] is None and result["lossless"] is True

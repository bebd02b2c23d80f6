"""Tiny random model pairs: for tests, offline demos and benchmarks, not useful assistants.

Targets are real mlx-lm architectures (Qwen3 dense, optionally quantized; Qwen3.5 hybrid
with GatedDeltaNet layers) with random weights, saved as folders that `dflash_mlx.load`
reads, with a byte-level BPE tokenizer trained by `tokenizers` on a few lines of text.
Drafts are random DFlash drafts in the z-lab format that `dflash_mlx.load_draft` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import DraftConfig
from .draft import DFlashDraft

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nimport sys\nprint(os.getcwd())\n",
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts a block and the target verifies it in one pass.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 20

SPECIAL = ["<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 320
BLOCK = 16


def write_tokenizer(folder: Path, texts: list[str] | None = None, vocab: int = VOCAB) -> int:
    """Train a byte-level BPE tokenizer on `texts` (default: a few lines) into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS if texts is None else texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return tok.get_vocab_size()


def save_model(folder: Path, model: nn.Module, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return folder


def _heads(hidden: int) -> int:
    return max(4, hidden // 64)


def qwen3_config(vocab: int = VOCAB, layers: int = 4, hidden: int = 64) -> dict:
    return {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": _heads(hidden),
        "num_key_value_heads": _heads(hidden) // 2,
        "head_dim": hidden // _heads(hidden),
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
    }


def qwen35_config(vocab: int = VOCAB) -> dict:
    return {
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "vocab_size": vocab,
            "max_position_embeddings": 4096,
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 1,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
        },
        "eos_token_id": 0,
    }


def build_target(folder: Path, config: dict, seed: int, quantize_bits: int | None = None):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # Sharper logits than the default init, so greedy decoding has clear winners.
    head = model.language_model if "language_model" in model else model
    head.lm_head.weight = head.lm_head.weight * 4.0
    mx.eval(model.parameters())
    if quantize_bits:
        nn.quantize(model, group_size=32, bits=quantize_bits)
        config = {**config, "quantization": {"group_size": 32, "bits": quantize_bits}}
    return save_model(folder, model, config)


def draft_config(
    target_layers: int,
    layer_ids: list[int] | None,
    block: int = BLOCK,
    vocab: int = VOCAB,
    layers: int = 2,
    hidden: int = 64,
    dflash2: bool = False,
) -> dict:
    dcfg = {"mask_token_id": 1, "block_size": block}
    if layer_ids is not None:
        dcfg["target_layer_ids"] = layer_ids
    if dflash2:
        dcfg.update(conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)
    return {
        "architectures": ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": _heads(hidden),
        "num_key_value_heads": _heads(hidden) // 2,
        "head_dim": hidden // _heads(hidden),
        "intermediate_size": 2 * hidden,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "num_target_layers": target_layers,
        "rope_theta": 10000.0,
        "dflash_config": dcfg,
    }


def build_draft(folder: Path, config: dict, seed: int) -> Path:
    mx.random.seed(seed)
    model = DFlashDraft(DraftConfig.from_dict(config))
    if "candidate_selector" in model:  # random codebooks, so the pair term matters
        sel = model.candidate_selector
        sel.predecessor_codebook = mx.random.normal(sel.predecessor_codebook.shape) * 0.5
        sel.successor_codebook = mx.random.normal(sel.successor_codebook.shape) * 0.5
    mx.eval(model.parameters())
    return save_model(folder, model, config)

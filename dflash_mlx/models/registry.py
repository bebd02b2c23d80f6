"""Known target -> DFlash draft pairs: which published draft speeds up which model.

A draft is trained for one base model; quantized or repackaged conversions of that model
(`mlx-community/Qwen3-4B-4bit`, `Qwen/Qwen3-4B-MLX-8bit`, a local folder or Hub cache
snapshot of either) share its draft. Lookups therefore compare *base names*: the repository
name without its organisation and without quantization or packaging suffixes. Knows names
only: loads and downloads nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class DraftEntry:
    """One published draft and the base model(s) it was trained for."""

    target: str  # the base model as its authors name it, e.g. "Qwen3-4B"
    draft: str  # Hub id of the draft
    aliases: tuple[str, ...] = ()  # other names of the same base model
    # Chat-template arguments the draft was trained with (e.g. thinking off).
    template_kwargs: dict = field(default_factory=dict)
    note: str = ""


_NO_THINKING = {"enable_thinking": False}

# z-lab's published drafts, as listed in the z-lab/dflash README and model cards.
REGISTRY: tuple[DraftEntry, ...] = (
    DraftEntry(
        "Qwen3-4B",
        "z-lab/Qwen3-4B-DFlash-b16",
        template_kwargs=_NO_THINKING,
        note="trained without thinking",
    ),
    DraftEntry(
        "Qwen3-8B",
        "z-lab/Qwen3-8B-DFlash-b16",
        template_kwargs=_NO_THINKING,
        note="trained without thinking",
    ),
    DraftEntry("Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
    DraftEntry(
        "Qwen3-Coder-30B-A3B-Instruct",
        "z-lab/Qwen3-Coder-30B-A3B-DFlash",
        aliases=("Qwen3-Coder-30B-A3B",),
    ),
    DraftEntry("Qwen3-Coder-Next", "z-lab/Qwen3-Coder-Next-DFlash"),
    DraftEntry("Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash"),
    DraftEntry("Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash"),
    DraftEntry("Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash"),
    DraftEntry("Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash"),
    DraftEntry("Qwen3.5-122B-A10B", "z-lab/Qwen3.5-122B-A10B-DFlash"),
    DraftEntry("Qwen3.5-397B-A17B", "z-lab/Qwen3.5-397B-A17B-DFlash"),
    DraftEntry("Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash"),
    DraftEntry("Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash"),
    DraftEntry("Qwen3.8-27B", "z-lab/Qwen3.8-27B-DFlash2", note="DFlash 2"),
    DraftEntry("gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash"),
    DraftEntry("gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash"),
    DraftEntry("gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash"),
    DraftEntry("gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash"),
    DraftEntry("Kimi-K2.5", "z-lab/Kimi-K2.5-DFlash"),
    DraftEntry("MiniMax-M2.5", "z-lab/MiniMax-M2.5-DFlash"),
)

# What `dflash-mlx chat` runs when no model is given: a 4-bit community conversion.
DEFAULT_TARGET = "mlx-community/Qwen3-4B-4bit"

# Name parts that describe a conversion, not the model: everything from the first one on
# is dropped ("Qwen3-4B-4bit-DWQ-053125" -> "Qwen3-4B").
_CONVERSION = re.compile(
    r"^(\d+(\.\d+)?bits?|\d+bpw|bf16|fp16|f16|fp32|f32|fp8|mlx|dwq|awq|gptq|gguf|mixed|"
    r"mxfp\d+|nvfp\d+|int\d+|w\d+a\d+|q\d+(k(m|s|l)?)?|qat|exl\d+|optiq)$"
)


def base_name(model_id: str | Path) -> str:
    """The normalised base model name of a Hub id or local folder.

    >>> base_name("mlx-community/Meta-Llama-3.1-8B-Instruct-4bit")
    'llama-3.1-8b-instruct'
    """
    text = str(model_id).rstrip("/")
    # A Hugging Face cache snapshot: .../models--org--name/snapshots/<hash>
    cached = re.search(r"models--[^/]+--([^/]+)", text)
    name = cached.group(1) if cached else text.rsplit("/", 1)[-1]
    name = re.sub(r"(\d)[-_ ]bits?\b", r"\1bit", name.lower())  # "8-bit" -> "8bit"
    parts = [p for p in re.split(r"[-_ ]+", name) if p]
    for i, part in enumerate(parts):
        if _CONVERSION.match(part):
            parts = parts[:i]
            break
    if parts[:1] == ["meta"]:  # "Meta-Llama-3.1-..." is "Llama-3.1-..."
        parts = parts[1:]
    # "LLaMA3.1" and "Llama-3.1" are one name: split a family name from its version.
    return "-".join(re.sub(r"(?<=[a-z])(?=\d)", "-", p) for p in parts)


def _index() -> dict[str, DraftEntry]:
    return {base_name(name): e for e in REGISTRY for name in (e.target, *e.aliases)}


def find_draft(model_id: str | Path) -> DraftEntry | None:
    """The published draft for `model_id` (exact or a conversion of it), or None."""
    return _index().get(base_name(model_id))


def known_targets() -> list[str]:
    return [e.target for e in REGISTRY]

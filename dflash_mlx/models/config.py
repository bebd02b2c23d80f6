"""DraftConfig: the DFlash draft's `config.json`, parsed and validated (SPEC 2.1).

Owns the field names and defaults of the published z-lab format. Knows nothing about
weights, targets or decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")

# The context's first rows a windowed block sees besides its window (an attention sink),
# unless the checkpoint declares its own (`dflash_config.context_sink`): measured on the
# demo pair, see docs/long-context.md.
DEFAULT_SINK = 0

_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The layer ids z-lab drafts read when the config does not list them (SPEC 2.1)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    is_causal: bool | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    architectures: list[str] = field(default_factory=list)
    quantization: dict | None = None
    # DFlash 2 (SPEC 3); None on DFlash 1 drafts.
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    conv_cross_block_state: bool = False
    # The longest context a block saw in training (`dflash_config.training_context`, which
    # `dflash-mlx train` writes): the default draft window; None: not declared.
    training_context: int | None = None
    # Under a window, the context's first rows a block sees as well (`context_sink`).
    context_sink: int = DEFAULT_SINK
    # The checkpoint's config.json as read (for tools that rewrite the checkpoint).
    raw: dict | None = field(default=None, repr=False, compare=False)

    @property
    def is_dflash2(self) -> bool:
        return self.conv_kernel_size is not None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads} and no head_dim is given"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size} must be at least 2")
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise ValueError(f"unknown layer type {t!r} in layer_types; expected {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but no sliding_window")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        for i in self.target_layer_ids:
            if not 0 <= i < self.num_target_layers:
                raise ValueError(
                    f"target_layer_ids {self.target_layer_ids} out of range for "
                    f"num_target_layers {self.num_target_layers}"
                )
        if self.is_dflash2:
            for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 1:
                    raise ValueError(
                        f"DFlash 2 field {name} is {value!r}; expected an integer >= 1"
                    )
            if self.hidden_size % self.conv_group_size:
                raise ValueError(
                    f"conv_group_size {self.conv_group_size} does not divide "
                    f"hidden_size {self.hidden_size}"
                )
        if self.training_context is not None and (
            isinstance(self.training_context, bool)
            or not isinstance(self.training_context, int)
            or self.training_context < 2
        ):
            raise ValueError(
                f"dflash_config.training_context {self.training_context!r}: expected an "
                "integer >= 2 (the longest context a block saw in training)"
            )
        if (
            isinstance(self.context_sink, bool)
            or not isinstance(self.context_sink, int)
            or self.context_sink < 0
        ):
            raise ValueError(
                f"dflash_config.context_sink {self.context_sink!r}: expected an integer >= 0"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} outside the vocabulary of {self.vocab_size}"
            )

    def layer_is_causal(self, i: int) -> bool:
        """Inside the block a layer is bidirectional unless declared causal (SPEC 2.2)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[i] == "sliding_attention"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> DraftConfig:
        missing = [k for k in _REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
        dcfg = cfg.get("dflash_config")
        if not isinstance(dcfg, dict):
            raise ValueError(f"{source}: missing 'dflash_config' (is this a DFlash draft?)")
        if "mask_token_id" not in dcfg:
            raise ValueError(f"{source}: dflash_config has no 'mask_token_id'")
        block_size = dcfg.get("block_size", cfg.get("block_size"))
        if block_size is None:
            raise ValueError(f"{source}: no 'block_size' at the top level or in dflash_config")
        n_draft = int(cfg["num_hidden_layers"])
        n_target = cfg.get("num_target_layers")
        ids = dcfg.get("target_layer_ids")
        if ids is None:
            if n_target is None:
                raise ValueError(
                    f"{source}: needs 'num_target_layers' or dflash_config.target_layer_ids"
                )
            ids = default_target_layer_ids(int(n_target), n_draft)
        if n_target is None:
            n_target = max(ids) + 1
        dflash2 = {}
        if any("DFlash2" in a for a in cfg.get("architectures") or []):
            names = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
            missing = [n for n in names if dcfg.get(n) is None]
            if missing:
                raise ValueError(
                    f"{source}: DFlash 2 draft without dflash_config.{', '.join(missing)}"
                )
            dflash2 = {n: dcfg[n] for n in names}
            dflash2["conv_cross_block_state"] = bool(dcfg.get("conv_cross_block_state", False))
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        try:
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                num_hidden_layers=n_draft,
                num_attention_heads=int(cfg["num_attention_heads"]),
                num_key_value_heads=int(cfg["num_key_value_heads"]),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                num_target_layers=int(n_target),
                target_layer_ids=[int(i) for i in ids],
                mask_token_id=int(dcfg["mask_token_id"]),
                block_size=int(block_size),
                head_dim=cfg.get("head_dim"),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                layer_types=list(cfg.get("layer_types") or []),
                sliding_window=cfg.get("sliding_window"),
                is_causal=cfg.get("is_causal"),
                output_multiplier=float(dcfg.get("output_multiplier", 1.0)),
                final_logit_softcapping=dcfg.get("final_logit_softcapping"),
                input_embedding_scale=float(dcfg.get("input_embedding_scale", 1.0)),
                training_context=dcfg.get("training_context"),
                context_sink=dcfg.get("context_sink", DEFAULT_SINK),
                architectures=list(cfg.get("architectures") or []),
                quantization=cfg.get("quantization"),
                raw=cfg,
                **dflash2,
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e

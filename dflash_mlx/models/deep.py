"""A deep stand-in for a pair: its target padded with identity layers (docs/cost-model.md).

Published pairs run a 1-5 layer draft against a 28-64 layer target, so the draft is a small
share of a cycle; tiny pairs built here run 2 draft layers against 4-6, where the draft costs
about as much as the target. `pad_pair` writes a copy of a pair whose target has `layers`
layers: the real ones spread evenly, each followed by copies of itself whose `o_proj` and
`down_proj` are zero. Such a layer adds exactly nothing to the residual stream (x + 0 = x), so
the padded target's tokens and the draft's acceptance are the original's, while each padding
layer costs a real layer's compute and keeps a real KV cache. The draft's `target_layer_ids`
are remapped to where the real layers now sit.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx

ZEROED = ("self_attn.o_proj.", "mlp.down_proj.")  # what a padding layer adds to the stream
_LAYER = re.compile(r"^(model\.layers\.)(\d+)\.(.*)$")


def padded_positions(real: int, layers: int) -> list[int]:
    """Where each of `real` layers sits among `layers` (evenly spread, the first at 0)."""
    if not 1 <= real <= layers:
        raise ValueError(f"cannot pad a {real}-layer target to {layers} layers")
    return [i * layers // real for i in range(real)]


def pad_pair(target: Path, draft: Path, out: Path, layers: int) -> tuple[Path, Path]:
    """Write the padded target and its remapped draft under `out` (`target/`, `draft/`)."""
    target, draft, out = Path(target), Path(draft), Path(out)
    config = json.loads((target / "config.json").read_text())
    real = int(config["num_hidden_layers"])
    where = padded_positions(real, layers)
    weights: dict[str, mx.array] = {}
    for file in sorted(target.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    padded: dict[str, mx.array] = {}
    for key, value in weights.items():
        m = _LAYER.match(key)
        if m is None:
            padded[key] = value
            continue
        i = int(m.group(2))
        end = where[i + 1] if i + 1 < real else layers
        for j in range(where[i], end):
            zero = j != where[i] and m.group(3).startswith(ZEROED) and value.dtype != mx.uint32
            padded[f"{m.group(1)}{j}.{m.group(3)}"] = mx.zeros_like(value) if zero else value
    t_out, d_out = out / "target", out / "draft"
    for src, dst in ((target, t_out), (draft, d_out)):
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if (
                f.is_file()
                and f.suffix != ".safetensors"
                and f.name != "model.safetensors.index.json"
            ):
                shutil.copy2(f, dst / f.name)
    mx.save_safetensors(str(t_out / "model.safetensors"), padded)
    config["num_hidden_layers"] = layers
    (t_out / "config.json").write_text(json.dumps(config, indent=1))
    for file in draft.glob("*.safetensors"):
        shutil.copy2(file, d_out / file.name)
    dconf = json.loads((draft / "config.json").read_text())
    dconf["num_target_layers"] = layers
    section = dconf.get("dflash_config", dconf)
    section["target_layer_ids"] = [where[i] for i in section["target_layer_ids"]]
    (d_out / "config.json").write_text(json.dumps(dconf, indent=1))
    return t_out, d_out

"""Hub id or local folder -> models, and the draft/target compatibility checks (SPEC 5.1).

Owns: resolving a source (folder, or a Hugging Face Hub id fetched with huggingface_hub),
reading the z-lab draft format unchanged. Targets load through `mlx_lm.load`. Whether a
draft fits a target is the `Pair`'s check (`pair.check_fit`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import BadCheckpoint
from .config import DraftConfig
from .draft import DFlashDraft

_DRAFT_FILES = ["*.json", "*.safetensors"]
_TARGET_WEIGHTS = "model*.safetensors"  # what mlx_lm.load reads
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken")


class LoadError(BadCheckpoint):
    """A model source that cannot be used, with what to do about it."""


# MLX's CPU backend runs float16/bfloat16 matmuls without BLAS, float32 ones with the BLAS
# the process loaded. With an optimized BLAS (OpenBLAS, MKL, BLIS) float32 is far faster: on
# the demo pair a 16-token verify costs 32 ms in bfloat16 and 6.5 ms in float32, a 512-token
# prefill chunk 4x less. With the reference BLAS the stock wheel bundles it is slower (a
# prefill chunk 1.8x, a wide verify 2x). So on a CPU with an optimized BLAS, half-precision
# weights are computed in float32 when that copy takes at most this share of the memory.
# DFLASH_MLX_CPU_FLOAT32=0 / =1 turns it off / on whatever the BLAS. No effect on a GPU.
CPU_FLOAT32_SHARE = 0.25
OPTIMIZED_BLAS = ("openblas", "mkl", "blis", "atlas")


def _optimized_blas() -> bool:
    from ..sysinfo import blas_library

    return any(name in (blas_library() or "").lower() for name in OPTIMIZED_BLAS)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_float32(model: nn.Module) -> bool:
    """Upcast `model`'s half-precision parameters to float32 when it runs on the CPU backend
    with an optimized BLAS (see `CPU_FLOAT32_SHARE`); quantized models are left as they are.
    Whether it did."""
    forced = os.environ.get("DFLASH_MLX_CPU_FLOAT32")
    if mx.default_device() != mx.cpu or forced == "0":
        return False
    from mlx.nn import QuantizedLinear
    from mlx.utils import tree_flatten

    if any(isinstance(m, QuantizedLinear) for _, m in model.named_modules()):
        return False
    params = [v for _, v in tree_flatten(model.parameters())]
    if not any(v.dtype in (mx.float16, mx.bfloat16) for v in params):
        return False
    if forced != "1" and not _optimized_blas():  # last: it reads /proc/self/maps
        return False
    if 4 * sum(v.size for v in params) > CPU_FLOAT32_SHARE * _physical_memory():
        return False
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return True


def resolve(source: str | Path, what: str, allow_patterns: list[str] | None = None) -> Path:
    """A local folder for `source`: the folder itself, or a Hub snapshot downloaded for it."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise LoadError(f"{what} {str(source)!r} is a file; expected a model folder")
        return path
    text = str(source)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise LoadError(f"{what} {text!r}: no such folder, and not a Hub id of the form 'org/name'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, allow_patterns=allow_patterns))
    except Exception as e:  # offline, unknown repo, gated repo, ...
        raise LoadError(
            f"could not fetch {what} {text!r} from the Hugging Face Hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}). "
            "If this machine is offline, download the model elsewhere and pass its local "
            "folder instead of the Hub id."
        ) from e


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise LoadError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise LoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_weights(path: Path) -> dict[str, mx.array]:
    """The tensors of one safetensors file; one mlx cannot read (truncated, an LFS pointer,
    not safetensors at all) is a `LoadError` naming it."""
    try:
        return mx.load(str(path), format="safetensors")
    except Exception as e:  # "[load_safetensors] <what>. Perhaps an incomplete download ..."
        detail = re.sub(r"^\[\w+\] ", "", str(e)).split(" Perhaps ")[0].rstrip(".")
        raise LoadError(
            f"{path}: damaged or incomplete safetensors file ({detail}): download or convert "
            "it again"
        ) from e


def load(target: str | Path):
    """Load a target `(model, tokenizer)` with mlx-lm, from a Hub id or a local folder (on
    the CPU backend, half-precision weights are computed in float32: `cpu_float32`)."""
    from mlx_lm import load as mlx_lm_load

    folder = resolve(target, "target")
    read_json(folder / "config.json")
    if not any(any(folder.glob(p)) for p in _TOKENIZER_FILES):
        raise LoadError(
            f"{folder}: no tokenizer file (expected one of {', '.join(_TOKENIZER_FILES)})"
        )
    try:
        model, tokenizer = mlx_lm_load(str(folder))
    except (ValueError, FileNotFoundError) as e:
        raise LoadError(f"target {str(target)!r}: {e}") from e
    except Exception:  # mlx-lm does not say which file: a damaged one is named, else ours
        for f in sorted(folder.glob(_TARGET_WEIGHTS)):
            read_weights(f)
        raise
    cpu_float32(model)
    return model, tokenizer


def shard_support(folder: Path) -> tuple[str, tuple[str, ...]]:
    """The target family in `folder` (its config's model_type) and the sharding mlx-lm
    offers for it: ("tensor", "pipeline"), either, or neither. Builds the model lazily: no
    weights are read."""
    from mlx_lm.utils import load_model

    config = read_json(folder / "config.json")
    family = str(config.get("model_type", "?"))
    try:
        model, _ = load_model(folder, lazy=True, strict=False)
    except (ValueError, ImportError) as e:
        raise LoadError(f"target {str(folder)!r}: {e}") from e
    kinds = []
    if hasattr(model, "shard"):
        kinds.append("tensor")
    if hasattr(model, "model") and hasattr(model.model, "pipeline"):
        kinds.append("pipeline")
    return family, tuple(kinds)


# Sharding mlx-lm offers that DFlash runs (both: docs/distributed.md).
DFLASH_SHARDS = ("tensor", "pipeline")


def choose_shard(target: str | Path, shard: str) -> str:
    """The sharding to load `target` with under `mx.distributed`: `shard` ("auto": what the
    family supports, tensor first), refused in one line naming the family when mlx-lm or
    DFlash cannot shard it so."""
    import mlx_lm

    folder = resolve(target, "target")
    family, kinds = shard_support(folder)
    if not kinds:
        raise LoadError(
            f"target family {family!r} supports neither tensor nor pipeline sharding in "
            f"mlx-lm {mlx_lm.__version__}: run it in one process (--shard none)"
        )
    if shard == "auto":
        usable = [k for k in kinds if k in DFLASH_SHARDS]
        if not usable:
            raise LoadError(
                f"target family {family!r} supports only {' and '.join(kinds)} sharding in "
                f"mlx-lm {mlx_lm.__version__}, which DFlash does not run yet (it runs "
                f"{', '.join(DFLASH_SHARDS)}): run it in one process (--shard none)"
            )
        return usable[0]
    if shard not in kinds:
        raise LoadError(
            f"--shard {shard}: target family {family!r} supports "
            f"{' and '.join(kinds)} sharding only in mlx-lm {mlx_lm.__version__}"
        )
    if shard not in DFLASH_SHARDS:
        raise LoadError(
            f"--shard {shard}: DFlash does not run {shard}-parallel targets yet (a captured "
            f"layer's features live on one rank); use --shard "
            f"{' or '.join(DFLASH_SHARDS)}"
        )
    return shard


def load_sharded(target: str | Path, shard: str, group=None):
    """Load this rank's shard of a target `(model, tokenizer)` with mlx-lm's `sharded_load`
    (`shard`: "tensor" or "pipeline", from `choose_shard`), over `group` (default: the
    launch's). Every rank calls it: the load ends in a collective."""
    from mlx_lm.utils import sharded_load

    folder = resolve(target, "target")
    if not any(any(folder.glob(p)) for p in _TOKENIZER_FILES):
        raise LoadError(
            f"{folder}: no tokenizer file (expected one of {', '.join(_TOKENIZER_FILES)})"
        )
    if shard == "pipeline" and not (folder / "model.safetensors.index.json").is_file():
        raise LoadError(
            f"{folder}: pipeline sharding reads model.safetensors.index.json (which layer is "
            "in which file), and this folder has none; mlx_lm.convert writes one"
        )
    group = group if group is not None else mx.distributed.init()
    kwargs = {"tensor_group": group} if shard == "tensor" else {"pipeline_group": group}
    try:
        model, tokenizer = sharded_load(str(folder), **kwargs)
    except (ValueError, FileNotFoundError) as e:
        raise LoadError(f"target {str(target)!r} ({shard} sharding): {e}") from e
    cpu_float32(model)
    return model, tokenizer


def load_draft(draft: str | Path) -> DFlashDraft:
    """Load a DFlash draft in the published z-lab format from a Hub id or a local folder."""
    folder = resolve(draft, "draft", _DRAFT_FILES)
    cfg_path = folder / "config.json"
    raw = read_json(cfg_path)
    try:
        cfg = DraftConfig.from_dict(raw, source=str(cfg_path))
    except ValueError as e:
        raise LoadError(str(e)) from e
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{folder}: no *.safetensors weights file")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(read_weights(f))
    # Drafts borrow the target's embedding and head; ignore copies a checkpoint may carry.
    weights = {k: v for k, v in weights.items() if not k.startswith(("embed_tokens.", "lm_head."))}
    model = DFlashDraft(cfg)
    if cfg.quantization:
        q = cfg.quantization
        nn.quantize(
            model,
            group_size=q.get("group_size", 64),
            bits=q.get("bits", 4),
            mode=q.get("mode", "affine"),
            # DFlash 2's conv projections and selector stay in floating point.
            class_predicate=lambda p, m: (
                f"{p}.scales" in weights and "conv" not in p and "candidate_selector" not in p
            ),
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        detail = " ".join(str(e).split())
        raise LoadError(f"{folder}: weights do not match {cfg_path.name}: {detail}") from e
    mx.eval(model.parameters())
    cpu_float32(model)
    model.eval()
    return model


def bind_draft(draft: DFlashDraft, model: nn.Module):
    """Deprecated: use `Pair(model, draft)`, which checks the fit and binds once (and
    returns here)."""
    import warnings

    from ..pair import Pair

    warnings.warn(
        "bind_draft(draft, model) is deprecated: use dflash_mlx.Pair(model, draft)",
        DeprecationWarning,
        stacklevel=2,
    )
    return Pair(model, draft)

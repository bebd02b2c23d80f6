"""What makes a stored block valid, and the keys of a prompt's blocks.

A block holds the target's cache for `block` tokens. Its key is a hash chain: the root is
the hash of everything a block's contents depend on besides the tokens (the model's
configuration and weights, their dtypes and quantization, the kind of cache each layer
keeps, the block size, the versions of MLX and mlx-lm that computed it, and this
package's `CACHE_FORMAT`), and block `i`'s key is the hash of block `i - 1`'s key and its
own tokens. Equal keys mean an equal prefix on an equal model: a block is found only by a
request whose prompt starts with every token before and in it, on the same model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import weakref
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

# Bump when what a block file holds, or how it is laid out, changes: older files are then
# never looked up again (their keys differ) and age out of the disk budget.
CACHE_FORMAT = 2  # 2: a block file's metadata says what it claims to hold (checked on read)
# Elements read from each parameter for the fingerprint (evenly spaced, first and last).
SAMPLES = 256

_lock = threading.Lock()
_fingerprints: dict[int, tuple[weakref.ref, str]] = {}


def _config(module: Any) -> Any:
    args = getattr(module, "args", None) or getattr(module, "config", None)
    if args is None:
        return None
    if dataclasses.is_dataclass(args):
        return dataclasses.asdict(args)
    return dict(vars(args)) if hasattr(args, "__dict__") else str(args)


def fingerprint(module: Any) -> str:
    """A hash of a model: its configuration, every parameter's name, shape and dtype, and
    `SAMPLES` evenly spaced values of each (the whole weights would take seconds to hash on
    a large model; a different checkpoint, fine-tune or quantization differs in these).
    Computed once per loaded model."""
    with _lock:
        known = _fingerprints.get(id(module))
        if known is not None and known[0]() is module:
            return known[1]
    h = hashlib.sha256()
    h.update(json.dumps(_config(module), sort_keys=True, default=str).encode())
    params = tree_flatten(module.parameters())
    samples = []
    for name, p in params:
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)};".encode())
        flat = p.reshape(-1)
        step = max(1, flat.size // SAMPLES)
        samples.append(mx.concatenate([flat[::step][:SAMPLES], flat[-1:]]).view(mx.uint8))
    mx.eval(samples)
    for s in samples:
        h.update(np.array(s).tobytes())
    digest = h.hexdigest()
    with _lock:
        _fingerprints[id(module)] = (weakref.ref(module), digest)
    return digest


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:  # e.g. a source checkout on the path
        return "unknown"


def validity(model: Any, cache: list[Any], block: int) -> dict[str, Any]:
    """Everything a block of `model`'s cache depends on besides its tokens."""
    return {
        "format": CACHE_FORMAT,
        "block": block,
        "model": fingerprint(model),
        "cache": [type(c).__name__ for c in cache],
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx-lm"),
    }


def root_key(valid: dict[str, Any]) -> bytes:
    return hashlib.sha256(json.dumps(valid, sort_keys=True).encode()).digest()


def chain(root: bytes, tokens: list[int], block: int, blocks: int) -> list[str]:
    """The keys of the first `blocks` full blocks of `tokens` (hex), each chained on the
    one before it from `root`."""
    keys, prev = [], root
    ids = np.asarray(tokens[: blocks * block], dtype=np.int64)
    for i in range(blocks):
        prev = hashlib.sha256(prev + ids[i * block : (i + 1) * block].tobytes()).digest()
        keys.append(prev.hex())
    return keys

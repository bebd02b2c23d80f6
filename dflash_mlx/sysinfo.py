"""What a bug report needs to say about this install: versions, device, kernels, cache."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

from .paths import cache_dir

DISTRIBUTION = "dflash-mlx-engine"


def _version_of(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def system_info() -> dict[str, str]:
    """Ordered name -> value pairs; importing MLX is the only side effect."""
    import mlx.core as mx

    from .models.conv import use_metal_kernel

    metal = mx.metal.is_available()
    return {
        DISTRIBUTION: _version_of(DISTRIBUTION),
        "mlx": _version_of("mlx"),
        "mlx-lm": _version_of("mlx-lm"),
        "python": f"{platform.python_version()} ({platform.system()} {platform.machine()})",
        "device": str(mx.default_device()).removeprefix("Device(").split(",")[0],
        "metal": "available" if metal else "not available",
        "dflash2 conv kernel": (
            "Metal kernel" if use_metal_kernel() else "pure-MLX reference (no Metal GPU)"
        ),
        "cache": str(cache_dir()),
    }

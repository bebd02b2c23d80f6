"""What a bug report needs to say about this install (versions, device, kernels, cache), and
what a calibration is keyed by besides the models: the device and the conditions its speed
depends on (the BLAS library loaded, on macOS the power source: Low Power Mode follows it)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
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


_CONDITIONS_TTL = 30.0  # seconds a reading of the conditions is trusted
_conditions: tuple[float, dict] | None = None


def blas_library() -> str | None:
    """The BLAS shared libraries mapped into this process (Linux) that MLX can call, e.g. an
    LD_PRELOADed OpenBLAS: they change what wide passes cost on a CPU. NumPy's and SciPy's
    private ILP64 builds (suffixed symbols, loaded whenever numpy is imported) are not."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "blas" in line.lower() and "/" in line}
    except OSError:
        return None
    names = {os.path.basename(p) for p in libs}
    names = {n for n in names if "openblas64" not in n and "scipy_openblas" not in n}
    return ",".join(sorted(names)) or None


def _power_source() -> str | None:
    """macOS: "AC Power" or "Battery Power" (Low Power Mode, throttling follow it)."""
    if sys.platform != "darwin":
        return None
    try:
        out = subprocess.run(
            ["pmset", "-g", "ps"], capture_output=True, text=True, timeout=2
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.splitlines()[0] if out else ""
    return first.split("'")[1] if first.count("'") >= 2 else None


def conditions() -> dict:
    """What the calibration was measured under besides the device and the models (read at
    most every 30 seconds)."""
    global _conditions
    now = time.monotonic()
    if _conditions is None or now - _conditions[0] > _CONDITIONS_TTL:
        _conditions = (now, {"blas": blas_library(), "power": _power_source()})
    return _conditions[1]


def device_description() -> str:
    import mlx.core as mx

    dev = mx.default_device()
    desc = f"{dev.type}"
    if mx.metal.is_available():
        info = mx.metal.device_info()
        desc += f" {info.get('architecture', '')} {info.get('memory_size', '')}"
    return f"{desc} {platform.system()} {platform.machine()} {os.cpu_count()} cpus"

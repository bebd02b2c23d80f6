"""Package discovery for a layout that installs three folders under one namespace.

`dflash_mlx/` is the library; the repository's `cli/` and `quantize/` install as
`dflash_mlx.cli` and `dflash_mlx.quantize`. Every package below each root is found by
setuptools' own discovery, so a new subpackage can never be left out of the wheel
(tests/test_packaging.py builds the wheel and checks it against the tree).
"""

from setuptools import find_packages, setup

MAPPED = {"dflash_mlx.cli": "cli", "dflash_mlx.quantize": "quantize"}


def _packages() -> list[str]:
    found = find_packages(include=["dflash_mlx", "dflash_mlx.*"])
    for name, folder in MAPPED.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return found


setup(packages=_packages(), package_dir=MAPPED)

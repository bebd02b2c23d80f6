#!/usr/bin/env bash
# The declared floor versions: install the wheel with exactly the lowest mlx and mlx-lm that
# pyproject.toml admits into a fresh virtualenv outside the checkout, and run the lossless
# tests (every width, DFlash 1 and 2, plain, quantized and hybrid targets) against it.
# FLOOR_MLX / FLOOR_MLX_LM override the versions (to show that a too-low floor fails);
# arguments go to pytest (e.g. -k qwen35).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
floor() {  # the version after `>=` in the dependency line for $1
  python - "$1" <<'PY'
import re, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
name = sys.argv[1]
for d in deps:
    m = re.match(rf"{re.escape(name)}(\[[^\]]*\])?>=([0-9.]+)", d)
    if m and "darwin" not in d:
        print(m.group(2)); break
else:
    sys.exit(f"no floor for {name} in pyproject.toml")
PY
}
cd "$repo"
mlx_floor="${FLOOR_MLX:-$(floor mlx)}"
mlx_lm_floor="${FLOOR_MLX_LM:-$(floor mlx-lm)}"
work="$(mktemp -d /tmp/dflash-floor.XXXXXX)"
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
git archive HEAD | tar -x -C "$work/src"
cp -r "$work/src/tests" "$work/tests"  # run against the installed wheel, not the checkout
python -m build --wheel --outdir "$work/dist" "$work/src" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
python -m venv "$work/venv"
quiet() { "$@" 2>&1 | { grep -v -e "is ignored: it is neither" -e "dependency conflicts" -e "requires mlx" || true; }; }
quiet "$work/venv/bin/pip" install -q "$work/dist/"*.whl "pytest>=8" "pytest-xdist>=3" "tokenizers>=0.20"
# Then exactly the floors, over what the wheel pulled (--no-deps: an override below the
# declared floor installs too, and then the tests, not the resolver, say it is too low).
quiet "$work/venv/bin/pip" install -q --force-reinstall --no-deps \
  "mlx==$mlx_floor" "mlx-cpu==$mlx_floor" "mlx-lm==$mlx_lm_floor"
"$work/venv/bin/python" -c "import mlx.core, mlx_lm; from importlib.metadata import version as v; print('floor job: mlx', v('mlx'), 'mlx-lm', v('mlx-lm'))"
cd "$work"
# On every core (xdist, as the README's command runs): ~9 min serially here, half on 2 cores.
DFLASH_MLX_CACHE="$work/cache" "$work/venv/bin/python" -m pytest -q -p no:cacheprovider -n auto \
  tests/test_decode.py tests/test_dflash2.py tests/test_sampling.py tests/test_prompt_cache.py "$@"

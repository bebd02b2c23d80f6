#!/usr/bin/env bash
# What a user installs: build the sdist, then the wheel from it, out of HEAD; install
# the wheel into a fresh virtualenv outside the checkout, and run the commands a newcomer
# runs (version, generate, serve until /health answers, a one-prompt bench), all offline
# with the shipped demo pair.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d /tmp/dflash-wheel.XXXXXX)"
trap 'kill "${server:-}" 2>/dev/null || true; rm -rf "$work"' EXIT

mkdir "$work/src"
# What is committed (HEAD), as `pip install git+URL` would get it.
git -C "$repo" archive HEAD | tar -x -C "$work/src"
python -m build --outdir "$work/dist" "$work/src" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
echo "built: $(cd "$work/dist" && ls)"

python -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$work/dist/"*.whl 2>&1 | { grep -v "is ignored: it is neither" || true; }
export PATH="$work/venv/bin:$PATH"
export DFLASH_MLX_CACHE="$work/cache" HF_HUB_OFFLINE=1
cd "$work"  # nothing of the checkout on sys.path

echo "--- top level of site-packages from this wheel"
python - <<'PY'
import zipfile, glob
names = zipfile.ZipFile(glob.glob("dist/*.whl")[0]).namelist()
top = sorted({n.split("/")[0] for n in names})
print(" ", top)
assert [t for t in top if not t.endswith(".dist-info")] == ["dflash_mlx"], top
PY
echo "--- dflash-mlx --version"
dflash-mlx --version
echo "--- import dflash_mlx.server"
python -c "import dflash_mlx.server, dflash_mlx.cli.main, dflash_mlx.quantize; print('  ok:', dflash_mlx.server.__file__)"
case "$(python -c 'import dflash_mlx; print(dflash_mlx.__file__)')" in
  "$repo"/*) echo "dflash_mlx imported from the checkout, not the wheel"; exit 1;;
esac
echo "--- dflash-mlx generate --demo"
dflash-mlx generate --demo --prompt "def fibonacci(n):" --max-tokens 24

echo "--- dflash-mlx serve --demo --port 0"
dflash-mlx serve --demo --port 0 2> "$work/serve.log" &
server=$!
url=""
for _ in $(seq 1 240); do
  url="$(grep -o 'http://127\.0\.0\.1:[0-9]*' "$work/serve.log" | head -1 || true)"
  if [ -n "$url" ] && curl -fsS "$url/health" > "$work/health.json" 2>/dev/null; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then cat "$work/serve.log"; echo "server exited"; exit 1; fi
  sleep 0.5
done
[ -s "$work/health.json" ] || { cat "$work/serve.log"; echo "no /health answer"; exit 1; }
echo "  $url/health -> $(cat "$work/health.json")"
# The chat page's files come from the wheel (package data), not from the checkout.
for page in / /page/chat.js /page/markdown.js /page/chat.css; do
  curl -fsS "$url$page" > "$work/page" || { echo "GET $page failed"; exit 1; }
done
curl -fsS "$url/" > "$work/page"
grep -q '/page/chat.js' "$work/page" || { echo "GET / is not the chat page"; exit 1; }
curl -fsS "$url/metrics" > "$work/metrics"
grep -q '^# TYPE dflash_requests_total counter' "$work/metrics" || { echo "no /metrics"; exit 1; }
echo "  chat page, /metrics: ok"
kill -INT "$server"; wait "$server" || true; server=""

echo "--- dflash-mlx bench --demo (one prompt)"
echo '{"prompt": "def merge_sort(items):"}' > "$work/one.jsonl"
dflash-mlx bench --demo --prompts "$work/one.jsonl" --max-tokens 32 --repeats 1
echo "wheel smoke: ok"

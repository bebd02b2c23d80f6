"""`dflash-mlx ls / pull / rm` as users run them (the real command in a subprocess), on a
Hugging Face cache built in the test: tiny models saved in the cache's own layout (blobs,
snapshots linking to them, refs), named as a published target and its DFlash draft."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_mlx.models.hub import human_size
from dflash_mlx.models.tiny import (
    build_draft,
    build_target,
    draft_config,
    qwen3_config,
    write_tokenizer,
)

from .test_cli_serve import dflash, text

TARGET = "mlx-community/Qwen3-4B-4bit"
DRAFT = "z-lab/Qwen3-4B-DFlash-b16"
PLAIN = "someone/tiny-lm"  # no DFlash draft is known for it


def cache_repo(cache: Path, repo_id: str, folder: Path) -> int:
    """`folder`'s files as huggingface_hub keeps a downloaded revision; their bytes."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    size = 0
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        size += len(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    return size


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A 4-bit target, its draft and a float target, each in a folder of its own."""
    src = tmp_path_factory.mktemp("built")
    for name in ("target", "plain"):
        (src / name).mkdir()
        write_tokenizer(src / name)
    build_target(src / "target", qwen3_config(), seed=1, quantize_bits=4)
    build_target(src / "plain", qwen3_config(), seed=2)
    build_draft(src / "draft", draft_config(4, [1, 2]), seed=3)
    return src


@pytest.fixture(scope="module")
def hub(built, tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """A cache with a 4-bit target, its registry draft and a float target without one."""
    src = built
    cache = tmp_path_factory.mktemp("hub")
    sizes = {
        TARGET: cache_repo(cache, TARGET, src / "target"),
        DRAFT: cache_repo(cache, DRAFT, src / "draft"),
        PLAIN: cache_repo(cache, PLAIN, src / "plain"),
    }
    return cache, sizes


def run(cache: Path, *args: str, env: dict | None = None):
    return dflash(*args, env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", **(env or {})})


def listed(cache: Path, *args: str) -> dict[str, dict]:
    done = run(cache, "ls", "--json", *args)
    out, err = text(done)
    assert done.returncode == 0, err
    return {m["name"]: m for m in json.loads(out)}


def test_ls_lists_a_target_and_its_draft_with_sizes_and_the_pairing(hub):
    cache, sizes = hub
    done = run(cache, "ls")
    out, err = text(done)
    assert done.returncode == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {TARGET, DRAFT, PLAIN}
    assert out.splitlines()[0].split() == ["MODEL", "SIZE", "WEIGHTS", "DFLASH", "WHERE"]
    assert f"draft {DRAFT} (here)" in rows[TARGET]
    assert "4-bit (group 32)" in rows[TARGET]
    assert "DFlash draft for Qwen3-4B" in rows[DRAFT]
    assert "no known draft" in rows[PLAIN] and "float32" in rows[PLAIN]
    for name, size in sizes.items():
        assert human_size(size) in rows[name]
    models = listed(cache)
    for name, size in sizes.items():
        assert models[name]["size_bytes"] == size
        assert models[name]["source"] == "hf-cache"
    assert models[TARGET]["draft"] == DRAFT and models[TARGET]["draft_here"] is True
    assert models[DRAFT]["is_draft"] is True and models[PLAIN]["draft"] is None


def test_ls_reads_models_dir_folders_too(hub, models_dir):
    cache, _ = hub
    models = listed(cache, "--models-dir", str(models_dir))
    # Named by their path (as --models-dir gave it): the name -m loads.
    name = {n: str(models_dir / n) for n in ("qwen3-4bit", "draft", "qwen3")}
    assert models[name["qwen3-4bit"]]["weights"] == "4-bit (group 32)"
    assert models[name["qwen3-4bit"]]["source"] == "models-dir"
    assert models[name["draft"]]["is_draft"] is True
    size = sum(f.stat().st_size for f in (models_dir / "qwen3").iterdir())
    assert models[name["qwen3"]]["size_bytes"] == size
    assert TARGET in models  # the cache is listed as well
    done = run(cache, "ls", "--models-dir", str(models_dir / "nowhere"))
    out, err = text(done)
    assert done.returncode == 2 and err.strip().count("\n") == 0
    assert "--models-dir" in err and "nowhere" in err


def test_rm_removes_a_draft_and_ls_then_says_it_is_missing(hub, tmp_path):
    cache = tmp_path / "hub"
    shutil.copytree(hub[0], cache, symlinks=True)
    refused = run(cache, "rm", DRAFT)  # no terminal to ask in, no --yes
    assert refused.returncode == 2 and "--yes" in text(refused)[1]
    assert (cache / ("models--" + DRAFT.replace("/", "--"))).exists()
    done = run(cache, "rm", DRAFT, "--yes")
    out, err = text(done)
    assert done.returncode == 0, err
    assert f"removed {DRAFT}" in out and human_size(hub[1][DRAFT]) in out
    models = listed(cache)
    assert DRAFT not in models and models[TARGET]["draft_here"] is False
    done = run(cache, "ls")
    out, err = text(done)
    assert f"draft {DRAFT} (not downloaded)" in out
    assert f"dflash-mlx pull {TARGET}" in err
    gone = run(cache, "rm", DRAFT, "--yes")
    assert gone.returncode == 2
    assert text(gone)[1].strip() == (
        f"error: no model '{DRAFT}' in the Hugging Face cache ({cache}): `dflash-mlx ls` lists them"
    )


def test_rm_removes_a_models_dir_folder(tmp_path, models_dir):
    root = tmp_path / "models"
    shutil.copytree(models_dir / "draft", root / "mine")
    done = run(tmp_path / "hub", "rm", "mine", "--models-dir", str(root), "--yes")
    assert done.returncode == 0, text(done)[1]
    assert not (root / "mine").exists() and root.exists()


@pytest.mark.parametrize(
    "env, says",
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
        ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot be reached"),
    ],
)
def test_pull_offline_fails_in_one_line_with_exit_2(tmp_path, env, says):
    done = run(tmp_path / "hub", "pull", TARGET, env=env)
    out, err = text(done)
    assert done.returncode == 2
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: cannot download {TARGET}: offline") and says in err
    assert "--model PATH" in err  # what to do instead
    assert not (tmp_path / "hub").exists() or not any((tmp_path / "hub").iterdir())


@pytest.mark.parametrize(
    "args, says",
    [
        (["./folder"], "TARGET './folder' must be a Hugging Face model id"),
        (["a/b/c"], "TARGET 'a/b/c' must be a Hugging Face model id"),
        ([TARGET, "--draft", "x y"], "--draft 'x y' must be a Hugging Face model id"),
        ([TARGET, "--draft", DRAFT, "--no-draft"], "--draft and --no-draft: give one"),
    ],
)
def test_pull_refuses_what_is_not_a_model_id_before_any_download(tmp_path, args, says):
    done = run(tmp_path / "hub", "pull", *args)
    out, err = text(done)
    assert done.returncode == 2 and err.count("\n") == 1, err
    assert says in err


COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The Hugging Face Hub's HTTP API, as much as huggingface_hub's `model_info` and
    `snapshot_download` ask of it, over `repos` (id -> folder)."""

    repos: dict[str, Path] = {}

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(code)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _files(self, repo: str) -> dict[str, bytes]:
        return {f.name: f.read_bytes() for f in sorted(self.repos[repo].iterdir())}

    def do_GET(self) -> None:
        api = re.match(r"/api/models/([^/]+/[^/?]+)(/revision/[^?]+|/tree/[^?]+)?", self.path)
        resolve = re.match(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", self.path)
        repo = (api or resolve).group(1) if (api or resolve) else None
        if repo not in self.repos:
            return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"})
        files = self._files(repo)
        if resolve:
            body = files[resolve.group(2)]
            etag = hashlib.sha1(body).hexdigest()
            return self._send(200, body, {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'})
        if api.group(2) and api.group(2).startswith("/tree/"):
            listing = [
                {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for f, b in files.items()
            ]
        else:
            listing = {
                "id": repo,
                "sha": COMMIT,
                "siblings": [{"rfilename": f, "size": len(b)} for f, b in files.items()],
            }
        self._send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"})

    do_HEAD = do_GET


@pytest.fixture
def fake_hub(built) -> Iterator[str]:
    handler = type("Hub", (FakeHub,), {"repos": {TARGET: built / "target", DRAFT: built / "draft"}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_pull_fetches_the_target_and_its_registry_draft_with_progress(fake_hub, built, tmp_path):
    """Against a Hub (here a local one speaking its HTTP API, through HF_ENDPOINT): both
    repositories are announced with their size, downloaded with progress bars, and `ls`
    then lists them paired."""
    cache = tmp_path / "hub"
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": fake_hub}
    done = run(cache, "pull", TARGET, env=env)
    out, err = text(done)
    assert done.returncode == 0, err
    for repo, folder in ((TARGET, built / "target"), (DRAFT, built / "draft")):
        files = sorted(folder.iterdir())
        size = human_size(sum(f.stat().st_size for f in files))
        assert f"pulling {repo} ({len(files)} files, {size})" in err
    assert err.count("Fetching") >= 2  # huggingface_hub's progress bars, one per repository
    assert f"ready: dflash-mlx chat --model {TARGET}" in err
    models = listed(cache)
    assert set(models) == {TARGET, DRAFT}
    assert models[TARGET]["draft_here"] is True and models[DRAFT]["is_draft"] is True
    snapshot = Path(models[DRAFT]["path"])
    for f in (built / "draft").iterdir():
        assert (snapshot / f.name).read_bytes() == f.read_bytes()

    unknown = run(cache, "pull", "nobody/nothing", env=env)
    out, err = text(unknown)
    assert unknown.returncode == 2 and err.count("\n") == 1, err
    assert "no model 'nobody/nothing' on the Hugging Face Hub" in err


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_rm_asks_first_in_a_terminal(hub, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    from .test_cli_serve import exe

    cache = tmp_path / "hub"
    shutil.copytree(hub[0], cache, symlinks=True)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    for answer, kept in (("n", True), ("y", False)):
        child = pexpect.spawn(exe()[0], ["rm", PLAIN], env=env, timeout=60)
        child.expect(re.escape(f"remove {PLAIN} ({human_size(hub[1][PLAIN])}) from the Hugging"))
        child.sendline(answer)
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == (1 if kept else 0)
        assert (cache / ("models--" + PLAIN.replace("/", "--"))).exists() == kept

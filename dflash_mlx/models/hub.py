"""The models on this machine, and fetching or removing them (`dflash-mlx ls / pull / rm`).

Models are found in the Hugging Face cache (`huggingface_hub.scan_cache_dir`, the folder
`HF_HUB_CACHE` / `HF_HOME` name) and in folders given as model folders (`--models-dir`):
each holding a `config.json`, directly or one level down (`org/name`). For each: its size,
its weights' dtype or quantization (from `config.json`, else the safetensors headers),
whether it is a DFlash draft, and for a target the draft the registry knows for it and
whether that draft is here too. Reads files only; `pull` downloads through huggingface_hub.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import BadArgument, UserError
from .registry import REGISTRY, find_draft


@dataclass
class LocalModel:
    name: str  # a Hub id (org/name) for cached models, the folder's name otherwise
    path: Path  # the folder holding config.json (a cache snapshot, or the folder)
    source: str  # "hf-cache" or "models-dir"
    size_bytes: int
    weights: str  # "bfloat16", "4-bit (group 64)", ... or "?" when unknown
    is_draft: bool
    # A target: the registry's draft for it (a Hub id), and whether it is here.
    # A draft: the base model it was published for, if the registry knows it.
    draft: str | None = None
    draft_here: bool = False
    draft_for: str | None = None
    revisions: tuple[str, ...] = ()  # cache revisions (commit hashes), for `rm`

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["path"] = str(self.path)
        out["revisions"] = list(self.revisions)
        return out


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _config(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


_SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8",
    "F8_E5M2": "float8",
}


def _header_dtypes(folder: Path) -> Counter:
    """Bytes of tensors per dtype over the folder's safetensors files (headers only)."""
    out: Counter = Counter()
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > 100_000_000:
                    continue
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            continue
        if not isinstance(header, dict):
            continue
        for name, t in header.items():
            if name == "__metadata__" or not isinstance(t, dict):
                continue
            offsets, dtype = t.get("data_offsets"), t.get("dtype", "?")
            if not (isinstance(dtype, str) and isinstance(offsets, list) and len(offsets) == 2):
                continue  # a header of another shape: not counted
            if all(isinstance(x, int) for x in offsets):
                out[dtype] += offsets[1] - offsets[0]
    return out


def weights_kind(folder: Path, config: dict[str, Any]) -> str:
    """The weights' form: `4-bit (group 64)` for MLX quantization, else their dtype."""
    q = config.get("quantization") or config.get("quantization_config")
    if isinstance(q, dict) and q.get("bits"):
        group = f" (group {q['group_size']})" if q.get("group_size") else ""
        mode = f" {q['mode']}" if q.get("mode") and q["mode"] != "affine" else ""
        return f"{q['bits']}-bit{mode}{group}"
    if isinstance(q, dict) and q.get("quant_method"):
        return str(q["quant_method"])
    dtypes = _header_dtypes(folder)
    floats = {d: n for d, n in dtypes.items() if d in _SAFETENSORS_DTYPES}
    if floats:
        return _SAFETENSORS_DTYPES[max(floats, key=floats.get)]
    dtype = config.get("torch_dtype") or config.get("dtype")
    if isinstance(dtype, str):
        return dtype
    text = config.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("torch_dtype"), str):
        return text["torch_dtype"]
    return "?"


def is_draft_config(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    return "dflash_config" in config or any("DFlash" in str(a) for a in archs)


def _draft_target(name: str) -> str | None:
    """The base model a published draft was trained for, by its Hub id or folder name."""
    tail = name.rstrip("/").rsplit("/", 1)[-1].lower()
    for e in REGISTRY:
        if e.draft.rsplit("/", 1)[-1].lower() == tail:
            return e.target
    return None


def _folder_size(folder: Path) -> int:
    total = 0
    for p in folder.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:  # a dangling or looping link, a file gone meanwhile
            continue
    return total


def _model(name: str, folder: Path, source: str, size: int, revisions=()) -> LocalModel | None:
    config = _config(folder)
    if config is None:
        return None
    try:
        draft = is_draft_config(config)
    except TypeError:  # a config.json of another shape (`architectures` not a list)
        draft = False
    try:
        weights = weights_kind(folder, config)
    except (TypeError, ValueError, AttributeError, KeyError):  # fields of other shapes
        weights = "?"
    return LocalModel(
        name=name,
        path=folder,
        source=source,
        size_bytes=size,
        weights=weights,
        is_draft=draft,
        draft_for=_draft_target(name) if draft else None,
        revisions=tuple(revisions),
    )


def _cached(cache: Path) -> list[LocalModel]:
    from huggingface_hub import scan_cache_dir

    if not cache.is_dir():
        return []
    try:
        info = scan_cache_dir(cache)
    except Exception as e:  # CacheNotFound, CorruptedCacheException
        raise UserError(f"cannot read the Hugging Face cache {cache}: {e}") from None
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        latest = max(repo.revisions, key=lambda r: r.last_modified)
        found = _model(
            repo.repo_id,
            Path(latest.snapshot_path),
            "hf-cache",
            repo.size_on_disk,
            [r.commit_hash for r in repo.revisions],
        )
        if found is not None:
            out.append(found)
    return out


def _in_folder(root: Path) -> list[LocalModel]:
    if not root.is_dir():
        raise UserError(f"--models-dir {root}: no such folder")
    out = []
    candidates = [root] + sorted(p for p in root.iterdir() if p.is_dir())
    for folder in candidates:
        subfolders = [folder] if (folder / "config.json").is_file() else []
        if not subfolders and folder != root:  # org/name
            subfolders = sorted(p for p in folder.iterdir() if (p / "config.json").is_file())
        for sub in subfolders:
            # Named by its path as given (`--models-dir models`: `models/pair-target`), so
            # that the name `ls` prints is one `-m` loads.
            name = sub.as_posix()
            found = _model(name, sub, "models-dir", _folder_size(sub))
            if found is not None:
                out.append(found)
    return out


def list_models(models_dirs: Iterable[Path] = (), cache: Path | None = None) -> list[LocalModel]:
    """Every model in the Hugging Face cache and under `models_dirs`, each target with the
    registry's draft for it and whether that draft is among them."""
    models = _cached(cache if cache is not None else hub_cache())
    for root in models_dirs:
        models += _in_folder(Path(root))
    here = {m.name.rsplit("/", 1)[-1].lower() for m in models if m.is_draft}
    here |= {m.name.lower() for m in models if m.is_draft}
    for m in models:
        if m.is_draft:
            continue
        entry = find_draft(m.name)
        if entry is not None:
            m.draft = entry.draft
            m.draft_here = (
                entry.draft.lower() in here or entry.draft.rsplit("/", 1)[-1].lower() in here
            )
    return models


def find(name: str, models_dirs: Iterable[Path] = (), cache: Path | None = None) -> LocalModel:
    """The one model called `name` (a Hub id, or a folder under a models dir)."""
    dirs = [Path(d) for d in models_dirs]

    def named(m: LocalModel) -> bool:  # as `ls` names it, or its path under a models dir
        if m.name == name:
            return True
        return m.source == "models-dir" and any(
            os.path.abspath(d / name) == os.path.abspath(m.path) for d in dirs
        )

    matches = [m for m in list_models(dirs, cache) if named(m)]
    if not matches:
        where = f"the Hugging Face cache ({cache if cache is not None else hub_cache()})"
        if models_dirs:
            where += " or " + ", ".join(str(d) for d in models_dirs)
        raise UserError(f"no model {name!r} in {where}: `dflash-mlx ls` lists them")
    if len(matches) > 1:
        raise UserError(
            f"{name!r} is both in the Hugging Face cache and under --models-dir "
            f"({', '.join(str(m.path) for m in matches)}): remove one by hand"
        )
    return matches[0]


def check_removable(model: LocalModel) -> None:
    """A `UserError` for a model `remove` will not delete: a folder that is a symbolic link
    (deleting what it points to is not what removing a listed name should do)."""
    if model.source != "hf-cache" and model.path.is_symlink():
        raise UserError(
            f"rm {model.name}: {model.path} is a symbolic link (to {os.readlink(model.path)}); "
            "remove the link, or the folder it points to, by hand"
        )


def remove(model: LocalModel, cache: Path | None = None) -> int:
    """Delete `model` from disk (every cached revision, or its folder); the bytes freed."""
    if model.source == "hf-cache":
        from huggingface_hub import scan_cache_dir

        strategy = scan_cache_dir(cache if cache is not None else hub_cache()).delete_revisions(
            *model.revisions
        )
        strategy.execute()
        return strategy.expected_freed_size
    check_removable(model)
    size = _folder_size(model.path)
    shutil.rmtree(model.path)
    return size


class OfflineError(UserError):
    pass


@dataclass
class Download:
    repo_id: str
    files: int
    size_bytes: int | None  # None: the Hub did not say


def plan_pull(repo_id: str, *, draft: str | None = None, with_draft: bool = True) -> list[Download]:
    """What `pull` would fetch: `repo_id` and (unless `with_draft` is False) its draft,
    `draft` or the registry's, each checked on the Hub (it exists, it can be reached) before
    anything downloads."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    for name, rid in (("TARGET", repo_id), ("--draft", draft)):
        if rid is None:
            continue
        try:
            validate_repo_id(rid)
            ok = rid.count("/") == 1
        except HFValidationError:
            ok = False
        if not ok:
            raise BadArgument(
                f"pull: {name} {rid!r} must be a Hugging Face model id such as "
                "mlx-community/Qwen3-4B-4bit (a local folder needs no pull)"
            )
    ids = [repo_id]
    if with_draft:
        entry = find_draft(repo_id)
        chosen = draft or (entry.draft if entry is not None else None)
        if chosen:
            ids.append(chosen)
    if constants.HF_HUB_OFFLINE:
        raise OfflineError(_offline(repo_id, True, None))
    api = HfApi()
    out = []
    for rid in ids:
        with _hub_errors(rid):
            info = api.model_info(rid, files_metadata=True)
        files = [f for f in info.siblings or [] if _wanted(f.rfilename)]
        sizes = [f.size for f in files]
        known = all(isinstance(n, int) for n in sizes)
        out.append(Download(rid, len(files), sum(sizes) if known else None))
    return out


def download(item: Download, cache: Path | None = None) -> Path:
    """Fetch one planned repository into the cache (huggingface_hub's progress bars go to
    stderr); its snapshot folder."""
    from huggingface_hub import snapshot_download

    with _hub_errors(item.repo_id):
        return Path(snapshot_download(item.repo_id, cache_dir=cache, allow_patterns=_PATTERNS))


def _wanted(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in _PATTERNS)


@contextmanager
def _hub_errors(rid: str) -> Iterator[None]:
    """The Hub's failures as the user's, in one line each."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    try:
        yield
    except RepositoryNotFoundError:
        raise UserError(
            f"pull: no model {rid!r} on the Hugging Face Hub (or it is private: log in with "
            "`hf auth login`)"
        ) from None
    except GatedRepoError:
        raise UserError(
            f"pull: {rid!r} is gated: accept its terms on huggingface.co and log in with "
            "`hf auth login`"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        raise OfflineError(_offline(rid, constants.HF_HUB_OFFLINE, e)) from None
    except HfHubHTTPError as e:
        raise UserError(f"pull {rid}: the Hub refused: {_short(e)}") from None
    except Exception as e:
        if _is_connection_error(e):
            raise OfflineError(_offline(rid, constants.HF_HUB_OFFLINE, e)) from None
        if isinstance(e, OSError):  # the cache folder cannot be written
            raise UserError(f"pull {rid}: cannot write the download: {e}") from None
        raise


# What mlx-lm and the draft loader read; not other frameworks' copies of the weights.
_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def _is_connection_error(e: BaseException) -> bool:
    """A failure to reach the Hub, whichever HTTP client huggingface_hub uses (httpx, a
    fork of it, or requests before 1.0): known by its classes' names."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"TransportError", "NetworkError", "TimeoutException", "ConnectionError"})


def _offline(rid: str, offline: bool, e: BaseException | None) -> str:
    if offline:
        why = "HF_HUB_OFFLINE is set (unset it to download)"
    else:
        found = re.search(r"(\w+Error: [^\n]+)", str(e))
        cause = found.group(1).strip() if found else f"{type(e).__name__}: {_short(e)}"
        why = f"the Hugging Face Hub cannot be reached ({cause})"
    return (
        f"cannot download {rid}: offline: {why}; connect to the internet and run "
        f"`dflash-mlx pull {rid}` again, or copy the model's folder to this machine and pass it "
        "as --model PATH"
    )


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 160 else text[:157] + "..."


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


__all__ = [
    "Download",
    "LocalModel",
    "OfflineError",
    "download",
    "find",
    "human_size",
    "list_models",
    "plan_pull",
    "remove",
]

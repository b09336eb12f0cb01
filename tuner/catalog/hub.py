"""A model's `config.json` and safetensors index: from a local directory, the local Hugging Face cache, else the hub.

The hub is asked through `huggingface_hub` (which reads `HF_TOKEN` from the environment by name, and `HF_HUB_OFFLINE`);
the cache is the one vLLM's container mounts (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub). The
index's `metadata.total_size` is the checkpoint's real byte count: better than parameter arithmetic for quantised,
MoE and multimodal checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.errors import CatalogError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class ModelFiles:
    """What was found for one model, and where."""

    name: str
    config: dict[str, Any]
    index_total_size: int | None
    where: str  # the directory or cache snapshot it came from, or "hub"


def hub_cache_dir() -> Path:
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = Path(env.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser()
    return home / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CatalogError(f"cannot read {what} {path}: {e}") from None
    if not isinstance(data, dict):
        raise CatalogError(f"{what} {path} is not a JSON object")
    return data


def _total_size(index: dict[str, Any] | None) -> int | None:
    meta = index.get("metadata") if index else None
    size = meta.get("total_size") if isinstance(meta, dict) else None
    try:
        return int(size) if size else None
    except (TypeError, ValueError):
        return None


def _from_directory(directory: Path) -> ModelFiles:
    config = _read_json(directory / CONFIG, "model config")
    index_path = directory / INDEX
    index = _read_json(index_path, "safetensors index") if index_path.is_file() else None
    return ModelFiles(str(directory), config, _total_size(index), str(directory))


def _cached(repo_id: str, filename: str, revision: str | None) -> Path | None:
    """A file of the hub cache without the network, through huggingface_hub when it is installed."""
    cache = hub_cache_dir()
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # the cache layout is stable: models--org--name/refs/<rev> -> snapshots/<sha>/<file>
        folder = cache / ("models--" + repo_id.replace("/", "--"))
        ref = folder / "refs" / (revision or "main")
        sha = ref.read_text().strip() if ref.is_file() else (revision or "")
        path = folder / "snapshots" / sha / filename
        return path if sha and path.is_file() else None
    found = try_to_load_from_cache(repo_id, filename, cache_dir=str(cache), revision=revision)
    return Path(found) if isinstance(found, str) else None


def _download(repo_id: str, filename: str, revision: str | None, required: bool) -> Path | None:
    try:
        from huggingface_hub import errors, hf_hub_download
        from huggingface_hub.utils import logging as hf_logging
    except ImportError:
        if required:
            raise CatalogError(
                f"{repo_id!r} is not in the Hugging Face cache ({hub_cache_dir()}) and huggingface_hub is not "
                "installed to fetch it: pip install huggingface_hub, or give a directory with a config.json"
            ) from None
        return None
    what = f"{filename} of {repo_id!r}"
    # huggingface_hub logs every retry of an unreachable hub; the one line below says it once.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=str(hub_cache_dir())))
    except errors.LocalEntryNotFoundError:  # before EntryNotFoundError, its base: the hub could not be reached
        if not required:
            return None
        raise CatalogError(
            f"cannot fetch {what}: the Hugging Face hub cannot be reached and it is not in the cache "
            f"({hub_cache_dir()}); download it where there is network, or give a directory with a config.json"
        ) from None
    except errors.GatedRepoError:
        if not required:
            return None
        raise CatalogError(f"{repo_id!r} is a gated model: accept its licence on the hub and set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        if not required:
            return None
        raise CatalogError(
            f"no model {repo_id!r} on the Hugging Face hub (a private one needs HF_TOKEN in the environment)"
        ) from None
    except errors.EntryNotFoundError:
        if required:
            raise CatalogError(f"{repo_id!r} on the Hugging Face hub has no {filename}") from None
        return None
    except Exception as e:  # bad revisions, HTTP errors: one line naming the model and why
        if not required:
            return None
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CatalogError(f"cannot fetch {what} from the Hugging Face hub: {reason}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


_REMOTE: dict[tuple[str, str | None, str], ModelFiles] = {}


def locate(name: str, revision: str | None = None, *, allow_download: bool = True) -> ModelFiles | None:
    """The config (and index size) of a local directory or a Hugging Face repo id; None when `name` is neither a
    directory nor something shaped like a repo id. Raises CatalogError when it should be there and is not."""
    path = Path(name).expanduser()
    if path.is_file() and path.name == CONFIG:
        path = path.parent
    if path.is_dir():
        if not (path / CONFIG).is_file():
            raise CatalogError(f"model directory {path} has no {CONFIG}")
        return _from_directory(path)
    if not _REPO_ID.match(name) or "/" not in name:
        return None
    # A job reads its model several times; the hub is asked once a process.
    key = (name, revision, str(hub_cache_dir()))
    if key in _REMOTE:
        return _REMOTE[key]
    config_path = _cached(name, CONFIG, revision)
    index_path = _cached(name, INDEX, revision)
    where = str(config_path.parent) if config_path else "hub"
    if config_path is None:
        if _offline() or not allow_download:
            raise CatalogError(
                f"{name!r} is not in the Hugging Face cache ({hub_cache_dir()}) and the hub is offline "
                "(HF_HUB_OFFLINE): download it once (huggingface-cli download NAME config.json), or give a "
                "directory with a config.json"
            )
        config_path = _download(name, CONFIG, revision, required=True)
    if index_path is None and allow_download and not _offline():
        index_path = _download(name, INDEX, revision, required=False)
    assert config_path is not None
    config = _read_json(config_path, "model config")
    index = _read_json(index_path, "safetensors index") if index_path is not None else None
    found = ModelFiles(name, config, _total_size(index), where)
    _REMOTE[key] = found
    return found


__all__ = ["CONFIG", "INDEX", "ModelFiles", "hub_cache_dir", "locate"]

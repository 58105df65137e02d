"""A Hugging Face hub id (``org/name``) as a model source, read from the local cache only.

``model: {hf: ORG/NAME}``: when the value is not an existing path (relative to the pipeline file) and
looks like a hub id, it names the snapshot that ``huggingface_hub`` keeps in its cache
(``models--org--name/snapshots/<commit>``, the commit read from ``refs/main``). Nothing is ever
downloaded: a model absent from the cache is one line naming the cache searched and how to fill it.

The cache is the one huggingface_hub uses, read from the environment at each call (so a test or a
user may point ``HF_HUB_CACHE`` elsewhere after huggingface_hub was imported): ``HF_HUB_CACHE``, else
``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
``~/.cache/huggingface/hub``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from opus.models.config import ModelLoadError

# org/name as the hub spells repo ids: one slash, no ".." or "--", neither part starting or ending in "." or "-".
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache huggingface_hub would use now."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def looks_like_hub_id(value: str) -> bool:
    """``org/name``: not absolute, not ``./x`` or ``../x``, exactly one slash."""
    return (bool(_HUB_ID.fullmatch(value)) and ".." not in value and "--" not in value
            and not any(part.endswith((".", "-")) for part in value.split("/")))


def cached_snapshot(repo_id: str, cache_dir: Path | None = None, repo_type: str = "model") -> Path | None:
    """The cached snapshot directory of ``repo_id`` (a model, or a ``dataset``; its ``main`` revision), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        found = snapshot_download(repo_id, repo_type=repo_type, cache_dir=str(cache_dir or hub_cache_dir()),
                                  local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None
    path = Path(str(found))
    return path if path.is_dir() else None


def not_cached(repo_id: str, local: Path, cache_dir: Path | None = None, repo_type: str = "model") -> str:
    """The one line said when ``repo_id`` is neither a directory nor in the cache."""
    cache = cache_dir or hub_cache_dir()
    kind, flag = ("models", "") if repo_type == "model" else (f"{repo_type}s", f" --repo-type {repo_type}")
    return (f"{repo_id!r} is not a directory ({local}) and not in the Hugging Face cache {cache} "
            f"(no {kind}--{repo_id.replace('/', '--')}/snapshots there); Opus never downloads: download it "
            f"there first (hf download {repo_id}{flag}) or set HF_HUB_CACHE / HF_HOME to the cache that holds it")


def resolve_hf_dir(value: str | Path, base_dir: Path | str = ".") -> Path:
    """The directory an ``hf:`` value means: a path (relative to ``base_dir``) when one exists, else
    a hub id's cached snapshot; a hub id absent from the cache is a ModelLoadError saying so."""
    p = Path(value).expanduser()
    local = p if p.is_absolute() else Path(base_dir) / p
    if local.exists() or not looks_like_hub_id(str(value)):
        return local
    snapshot = cached_snapshot(str(value))
    if snapshot is None:
        raise ModelLoadError(not_cached(str(value), local))
    return snapshot

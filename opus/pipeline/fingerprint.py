"""Content fingerprints for stage keys: model sources and data files.

Small files are hashed whole; large ones by size plus their first and last MiB, so a fingerprint of a
multi-GB checkpoint stays quick yet changes when the file does. Modification times are ignored: a
fresh clone must reproduce the same keys.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

WHOLE_FILE_LIMIT = 64 << 20
EDGE = 1 << 20


def _file_digest(path: Path, digest: Any) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}:".encode())
    with open(path, "rb") as fh:
        if size <= WHOLE_FILE_LIMIT:
            while block := fh.read(1 << 20):
                digest.update(block)
        else:
            digest.update(fh.read(EDGE))
            fh.seek(size - EDGE)
            digest.update(fh.read(EDGE))


def fingerprint_paths(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        if path.is_dir():
            for child in sorted(p for p in path.rglob("*") if p.is_file()):
                _file_digest(child, digest)
        elif path.is_file():
            _file_digest(path, digest)
    return digest.hexdigest()


def fingerprint_source(source: dict[str, Any], base_dir: Path) -> str:
    """Identify a model source by content: an HF directory, a GGUF file or a factory's code + args."""
    if "factory" in source:
        module_name = source["factory"].split(":")[0]
        spec = importlib.util.find_spec(module_name)
        files = [Path(spec.origin)] if spec and spec.origin else []
        extra = json.dumps(source.get("args", {}), sort_keys=True, default=str)
        return hashlib.sha256((fingerprint_paths(files) + extra).encode()).hexdigest()
    path = base_dir / (source.get("hf") or source.get("gguf"))
    return fingerprint_paths([path])


def fingerprint_text_set(text_set: Any, base_dir: Path) -> str | None:
    """A data set's declaration plus the content of what it points at."""
    if text_set is None:
        return None
    if text_set.files is not None:
        paths = [Path(p) for pattern in text_set.files
                 for p in glob.glob(str(base_dir / pattern), recursive=True)]
    else:
        from opus.runtime.data import DataError, resolve_dataset

        try:  # a hub dataset id: its cached snapshot's files
            paths = [resolve_dataset(text_set.dataset, base_dir)]
        except DataError:
            paths = [base_dir / text_set.dataset]
    declared = json.dumps(text_set.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256((declared + fingerprint_paths(paths)).encode()).hexdigest()

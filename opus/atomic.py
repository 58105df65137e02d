"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync the directory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any

import yaml

_UMASK = os.umask(0)
os.umask(_UMASK)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp creates 0600; results are for everyone to read
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_yaml(path: Path, obj: Any) -> None:
    write_text(path, yaml.safe_dump(obj, sort_keys=False, allow_unicode=True))


def not_a_regular_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file (missing, a directory, a FIFO, a device...), or None.

    Asked before opening anything a user or a stranger named: opening a FIFO blocks until someone
    writes to it, and a device never ends."""
    try:
        mode = os.stat(path).st_mode  # follows a symlink: what would be opened
    except OSError as exc:
        return "missing" if isinstance(exc, FileNotFoundError) else exc.strerror or str(exc)
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return "not a regular file: " + next((kind for test, kind in kinds.items() if test(mode)), "a special file")


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def member_problem(directory: Path, name: object) -> str | None:
    """Why ``name``, read from a record in ``directory``, is not a regular file inside it, or None.

    A record may come from a stranger: an absolute name, a ``..`` or a symlink out of the directory
    would read another file; a FIFO would block."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        return f"{name!r} is not a file name inside the directory"
    file = Path(directory) / name
    if not file.resolve().is_relative_to(Path(directory).resolve()):
        return f"{name} leads out of the directory (a symlink to {file.resolve()})"
    problem = not_a_regular_file(file)
    return None if problem is None else f"{name} is {problem}"


def first_mismatch(directory: Path, digests: dict[str, str], record: str) -> str | None:
    """None when every file named in ``digests`` (paths relative to ``directory``) matches its sha256,
    else what the first one that does not is: missing, not a file inside the directory, or changed since
    ``record`` listed it."""
    if not isinstance(digests, dict):
        return f"{record} lists no files"
    for name, digest in digests.items():
        file = directory / name
        if problem := member_problem(directory, name):
            return problem
        if sha256_file(file) != digest:
            return f"{name} does not match its sha256 in {record}"
    return None


# Opus's own records are kilobytes to a few megabytes; a larger one is not read into memory.
MAX_JSON_BYTES = 64 * 1024 * 1024


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON in ``path``; ValueError for invalid JSON, a text that is not UTF-8, a file over
    ``max_bytes`` or anything but a regular file (a FIFO would block the read)."""
    problem = not_a_regular_file(Path(path))
    if problem == "missing":
        raise FileNotFoundError(f"no such file: {path}")
    if problem:
        raise ValueError(problem)
    size = Path(path).stat().st_size
    if size > max_bytes:
        raise ValueError(f"{size} bytes, more than the {max_bytes} a record may have")
    return json.loads(Path(path).read_text(encoding="utf-8"))


def new_temp_dir(final_dir: Path) -> Path:
    """A fresh directory beside ``final_dir`` to fill before ``replace_dir`` puts it in place."""
    tmp = final_dir.parent / f".tmp-{final_dir.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Atomically put a completed directory in place; a stale one there is replaced."""
    old = None
    if final_dir.exists():
        old = final_dir.parent / f".old-{final_dir.name}-{uuid.uuid4().hex[:6]}"
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def relative_path(path: Path | str, start: Path | str) -> str:
    """``path`` relative to the directory ``start`` (with ``..`` where needed), POSIX separators."""
    return Path(os.path.relpath(Path(path).resolve(), Path(start).resolve())).as_posix()

"""Checkpoints: built in a temporary directory beside their final place, manifest written last.

A directory without a ``manifest.json`` whose sha256 sums all verify is not a checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from opus.atomic import first_mismatch, fsync_dir, fsync_file, read_json, sha256_file, write_json
from opus.errors import InputError
from opus.pipeline.contracts import JOB_FILE, RESULT_FILE, ResultRecord, read_result
from opus.pipeline.state import STATE_FILE, TENSORS_FILE

MANIFEST = "manifest.json"
BOOKKEEPING = {RESULT_FILE, JOB_FILE}  # the worker's orders and its report: evidence, not content


class DiskSpaceError(OSError):
    """Not enough free disk to write a checkpoint; nothing already committed is touched."""


def is_disk_full(exc: BaseException) -> bool:
    """True for every way a full disk shows: ours, the OS's, or a library's wrapper of the OS error."""
    if isinstance(exc, DiskSpaceError) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
        return True
    # safetensors raises its own SafetensorError and keeps only the OS error's text.
    return "No space left on device" in str(exc) or "os error 28" in str(exc)


def check_free_disk(where: Path, needed_bytes: int, reserve_mb: int) -> None:
    free = shutil.disk_usage(where).free
    wanted = needed_bytes + reserve_mb * (1 << 20)
    if free < wanted:
        raise DiskSpaceError(
            f"not enough free disk in {where}: {free / 2**20:.0f} MiB free, "
            f"{wanted / 2**20:.0f} MiB needed (checkpoint + run.min_free_disk_mb reserve)")


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # checkpoints are immutable once committed, so sharing the inode is safe
    except OSError:
        shutil.copy2(src, dst)


def write_checkpoint(out_dir: Path, *, key: str, stage_id: str, uses: str, state: dict[str, Any],
                     result: ResultRecord, tensors: dict[str, Any] | None = None,
                     inherit_tensors_from: Path | None = None, reserve_mb: int = 0,
                     key_parts: dict[str, str] | None = None) -> None:
    """Fill ``out_dir`` with state, tensors, result and artifacts; fsync; then write the manifest.

    ``tensors`` are new tensors to save; ``inherit_tensors_from`` is the incoming checkpoint whose
    tensor file is reused unchanged (hard-linked) when the stage did not change the model.
    """
    state = dict(state)
    if tensors:
        from safetensors.torch import save_file

        check_free_disk(out_dir, sum(t.numel() * t.element_size() for t in tensors.values()), reserve_mb)
        save_file(tensors, str(out_dir / TENSORS_FILE))
        state["tensors"] = TENSORS_FILE
    elif inherit_tensors_from is not None and state.get("tensors"):
        _link_or_copy(inherit_tensors_from / state["tensors"], out_dir / TENSORS_FILE)
        state["tensors"] = TENSORS_FILE
    else:
        check_free_disk(out_dir, 0, reserve_mb)
        state["tensors"] = None
    write_json(out_dir / STATE_FILE, state)
    write_json(out_dir / RESULT_FILE, result.as_json())
    files = sorted(p for p in out_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    for path in files:
        fsync_file(path)
    manifest = {
        "key": key, "key_parts": key_parts or {}, "stage": stage_id, "uses": uses, "created": time.time(),
        "files": {str(p.relative_to(out_dir)): sha256_file(p) for p in files},
    }
    write_json(out_dir / MANIFEST, manifest)
    fsync_dir(out_dir)


def verify_checkpoint(path: Path) -> str | None:
    """None when every file in the manifest verifies, else the reason it does not."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (the checkpoint was never completed)"
    try:
        manifest = read_json(manifest_path)
    except ValueError as exc:
        return f"manifest.json is unreadable: {exc}"
    return first_mismatch(path, manifest.get("files", {}), MANIFEST)


def intact(checkpoint: Path) -> Path:
    """The checkpoint, once every file its manifest lists matches its sha256 (else ``InputError``): a
    state.json edited by hand or a tensors file cut short must not load as the model the run measured."""
    if problem := verify_checkpoint(checkpoint):
        raise InputError(f"the checkpoint is damaged ({problem}); `opus resume` on the run redoes its stage",
                         file=str(checkpoint))
    return checkpoint


def read_manifest(path: Path) -> dict[str, Any]:
    return read_json(path / MANIFEST)


def content_digest(path: Path) -> str:
    """What a descendant stage consumes from this checkpoint, as one sha256.

    The manifest's key (which chains every ancestor's digest), the sha256 of every file but the
    job and result files, and the metrics in result.json; not the bookkeeping that differs between
    two otherwise equal builds (temporary paths, creation time, duration, attempt). A checkpoint
    rebuilt with other content gets another digest, so exactly the stages downstream of a change
    get new keys.
    """
    manifest = read_manifest(path)
    files = {name: digest for name, digest in manifest.get("files", {}).items() if name not in BOOKKEEPING}
    payload = {"key": manifest.get("key"), "files": files, "metrics": read_result(path).metrics}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def estimate_checkpoint_bytes(incoming: Path | None) -> int:
    """A stage that changes the model writes at most about the incoming tensors again."""
    tensors = incoming / TENSORS_FILE if incoming else None
    return tensors.stat().st_size if tensors and tensors.is_file() else 0


def move_aside(path: Path, into: Path, suffix: str = "") -> Path:
    """Move a directory out of the way (e.g. into ``discarded/``) without deleting evidence."""
    into.mkdir(parents=True, exist_ok=True)
    target = into / f"{path.name}{suffix}-{uuid.uuid4().hex[:6]}"
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


def drop_tensors(path: Path) -> None:
    """Rejected candidates keep their metrics and artifacts for the report, not their tensors."""
    (path / TENSORS_FILE).unlink(missing_ok=True)


def clean_temporaries(stages_dir: Path) -> list[Path]:
    """Remove half-built checkpoints left by a crash or kill; they never had a verdict."""
    removed = []
    if stages_dir.is_dir():
        for path in stages_dir.iterdir():
            if path.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def read_manifest_key(path: Path) -> str | None:
    try:
        return read_manifest(path).get("key")
    except (OSError, ValueError):
        return None


def find_checkpoint(stages_dir: Path, stage_id: str, key: str) -> tuple[Path | None, str | None]:
    """``(path, problem)``: the committed checkpoint of ``stage_id`` under ``key``.

    A directory with another key is stale (a parameter or an input changed) and is replaced when the
    stage commits; one without a readable manifest, or whose files fail their sha256, is damaged:
    ``problem`` says why and the caller moves it aside.
    """
    for path in sorted(stages_dir.glob(f"[0-9][0-9]-{stage_id}")):
        found = read_manifest_key(path)
        if found is None:
            return path, "no readable manifest.json (never completed, or damaged)"
        if found != key:
            continue
        problem = verify_checkpoint(path)
        return path, problem
    return None, None

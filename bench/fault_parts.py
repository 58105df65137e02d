"""Helpers of bench/faults.py: opus in its own session, run directories read through their JSON and
YAML files (nothing unpickled), damage, a full tmpfs, tables."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = ("_ms", "margin", "reason", "speedup", "tied", "notes")  # plan.yaml's timings and the words on them
QUALITY = ("perplexity", "agreement", "top1_accuracy", "logits_cosine")
DAMAGE_KINDS = ("truncate", "bitflip", "state", "result", "manifest", "manifest-key", "no-manifest")
TINY_STAGES = "tests.fixtures.stages"


# -- running opus -------------------------------------------------------------------------------
CODE = {"dir": ROOT}  # where opus runs from: the checkout, or a snapshot of it (snapshot_code)


def snapshot_code(into: Path) -> str:
    """Run opus from a copy of opus/, stages/ and the test fixtures: a stage's key hashes the opus
    sources, so an edit to the checkout during hours of trials would make every resume recompute."""
    for part in ("opus", "stages", "tests/fixtures"):
        shutil.copytree(ROOT / part, into / part, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    shutil.copy2(ROOT / "tests" / "__init__.py", into / "tests" / "__init__.py")
    CODE["dir"] = into
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return f"opus runs from a snapshot of the checkout ({git.stdout.strip() or 'not a git checkout'}) in {into}"


def _popen(args: tuple[object, ...], **kwargs: Any) -> subprocess.Popen:
    """``python -m opus.cli.main ARGS`` from CODE, offline, in its own session (its own process group)."""
    code = str(CODE["dir"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "opus.cli.main", *map(str, args)], cwd=code, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)


@dataclass
class Call:
    rc: int
    out: str
    err: str
    seconds: float


def opus(*args: object, timeout: float | None = None) -> Call:
    """One opus command to its end (a timeout kills its whole process group)."""
    started = time.monotonic()
    proc = _popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, err = proc.communicate()
        return Call(124, out, err + f"\n[faults] timed out after {timeout:.0f} s", time.monotonic() - started)
    return Call(proc.returncode, out, err, time.monotonic() - started)


def spawn(*args: object, log: Path) -> subprocess.Popen:
    """Start an opus command, its output to ``log``; the caller waits or kills."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return _popen(args, stdout=fh, stderr=subprocess.STDOUT)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _proc_stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    return (_proc_stat(pid) or ["Z"])[0] != "Z"


def processes_of(root_pid: int, run_dir: Path) -> set[int]:
    """``root_pid``'s descendants, and every process whose command line names ``run_dir`` (a worker)."""
    children: dict[int, list[int]] = {}
    named, found, todo = set(), set(), [root_pid]
    for entry in Path("/proc").glob("[0-9]*"):
        stat = _proc_stat(int(entry.name))
        if stat is None:
            continue
        children.setdefault(int(stat[1]), []).append(int(entry.name))
        try:
            if str(run_dir) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                named.add(int(entry.name))
        except OSError:
            continue
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return (found | named) - {os.getpid()}


def wait_gone(pids: set[int], timeout: float = 15.0) -> list[int]:
    """Wait until none of ``pids`` lives; the ones still alive after ``timeout`` (then killed)."""
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = sorted(p for p in pids if _alive(p))
    for pid in survivors:  # descendants of a run this script started, by their id
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return survivors


# -- reading run directories ----------------------------------------------------------------------
def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    return read_json(path) if path.is_file() else {}


def statuses(run_dir: Path) -> dict[str, str]:
    return {s["id"]: s["status"] for s in summary(run_dir).get("stages", [])}


def events(run_dir: Path) -> list[dict[str, Any]]:
    path, out = run_dir / "events.jsonl", []
    for line in (path.read_text(errors="replace").splitlines() if path.is_file() else []):
        with contextlib.suppress(ValueError):  # a line torn by the kill
            out.append(json.loads(line))
    return out


def stage_dir(run_dir: Path, stage_id: str) -> Path | None:
    found = sorted((run_dir / "stages").glob(f"[0-9][0-9]-{stage_id}"))
    return found[0] if found else None


def manifests(run_dir: Path) -> dict[str, dict[str, Any]]:
    """{stage: manifest} of every committed checkpoint (a stage directory with a readable manifest)."""
    out = {}
    for path in sorted((run_dir / "stages").glob("[0-9][0-9]-*")):
        with contextlib.suppress(OSError, ValueError):
            out[path.name[3:]] = read_json(path / "manifest.json")
    return out


def committed(run_dir: Path) -> dict[str, str]:
    return {s: m.get("key", "") for s, m in manifests(run_dir).items()}


def pipeline_order(run_dir: Path) -> list[tuple[str, str, list[str]]]:
    """[(stage, uses, needs)] in the file's order, from the pipeline.yaml the run was run with."""
    doc = yaml.safe_load((run_dir / "pipeline.yaml").read_text())
    return [(s["id"], s["uses"], list(s.get("needs") or [])) for s in doc["stages"]]


def descendants(order: list[tuple[str, str, list[str]]], stage_id: str) -> list[str]:
    below = {stage_id}
    for sid, _, needs in order:
        if below & set(needs):
            below.add(sid)
    return [sid for sid, _, _ in order if sid in below and sid != stage_id]


def default_target(ref: Path) -> str:
    """The stage to damage: quantize, else the first stage with tensors of its own, else the second."""
    order = pipeline_order(ref)
    with_tensors = [s for s, t in tensor_sums(ref).items() if t]
    return next((s for s, u, _ in order if u == "quantize"), with_tensors[0] if with_tensors else order[1][0])


def digests_of(run_dir: Path) -> dict[str, str]:
    """{stage: content digest}: what the runner chains into the keys of the stages that consume it."""
    from opus.pipeline.checkpoint import content_digest

    return {s: content_digest(p) for s in committed(run_dir) if (p := stage_dir(run_dir, s))}


def quality(run_dir: Path) -> dict[str, float]:
    final = summary(run_dir).get("final") or {}
    return {k: final[k] for k in QUALITY if isinstance(final.get(k), (int, float))}


def plan_choices(run_dir: Path) -> tuple[Any, list[tuple[str, str]] | None]:
    """(plan.yaml, [(group, format)]) of the run's plan stage, or (None, None) without one."""
    for path in sorted((run_dir / "stages").glob("[0-9][0-9]-*/artifacts/plan.yaml")):
        doc = yaml.safe_load(path.read_text()) or {}
        return doc, [(g.get("name", "?"), g.get("format", "?")) for g in doc.get("groups", [])]
    return None, None


def leaf_diffs(a: Any, b: Any, path: str = "") -> set[str]:
    """Where two JSON/YAML documents differ, as paths with list indices folded (``groups[].margin``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return set().union(*(leaf_diffs(a.get(k), b.get(k), f"{path}.{k}".lstrip(".")) for k in a.keys() | b.keys()))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return set().union(*(leaf_diffs(x, y, f"{path}[]") for x, y in zip(a, b)))
    return set() if a == b else {path or "(all)"}


def decisions(run_dir: Path) -> dict[str, str]:
    """{'stage: what': winner} from every decisions.json (timing choices: plan, KV cache, compile)."""
    out = {}
    for path in sorted((run_dir / "stages").glob("[0-9][0-9]-*/artifacts/decisions.json")):
        for entry in read_json(path).get("decisions", []):
            out[f"{path.parents[1].name[3:]}: {entry.get('what')}"] = str(entry.get("winner"))
    return out


def recipe(run_dir: Path) -> list[Any] | None:
    final = summary(run_dir).get("final_stage")
    path = stage_dir(run_dir, final) if final else None
    return read_json(path / "state.json").get("recipe") if path and (path / "state.json").is_file() else None


def tensor_sums(run_dir: Path) -> dict[str, str | None]:
    """{stage: sha256 of its tensors.safetensors from its manifest} (None: the stage has none)."""
    return {s: m.get("files", {}).get("tensors.safetensors") for s, m in manifests(run_dir).items()}


def compare(ref: Path, run: Path) -> dict[str, str]:
    """How a run's outcome compares with the reference's: final quality, plan choices, recipe."""
    q_ref, q_run = quality(ref), quality(run)
    if not q_run:
        q = "no final metrics"
    elif q_ref == q_run:
        q = "identical"
    else:
        q = "differs: " + ", ".join(f"{k} {q_ref.get(k)!r} vs {q_run.get(k)!r}"
                                    for k in sorted(set(q_ref) | set(q_run)) if q_ref.get(k) != q_run.get(k))
    _, c_ref = plan_choices(ref)
    _, c_run = plan_choices(run)
    if c_ref is None:
        plan = "n/a (no plan.yaml)"
    elif c_ref == c_run:
        plan = f"identical ({len(c_ref)} groups)"
    else:
        diff = sum(a != b for a, b in zip(c_ref, c_run or [])) + abs(len(c_ref) - len(c_run or []))
        plan = f"differs in {diff} of {len(c_ref)} groups"
    where = sorted(leaf_diffs(recipe(ref), recipe(run)))
    return {"quality": q, "plan": plan, "recipe": "identical" if not where else "differs at " + ", ".join(where)}


def disk_bytes(path: Path) -> int:
    """Bytes a directory takes, each inode counted once (hard-linked tensors are shared)."""
    seen, total = set(), 0
    for file in path.rglob("*"):
        st = file.lstat()
        if file.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


# -- damage ---------------------------------------------------------------------------------------
def _rewrite(path: Path, data: bytes) -> None:
    path.unlink()  # break a hard link: only this checkpoint is damaged, not the ones sharing the inode
    path.write_bytes(data)


def _edit_json(path: Path, edit: Any) -> None:
    doc = read_json(path)
    edit(doc)
    _rewrite(path, json.dumps(doc, indent=2).encode())


def damage(checkpoint: Path, kind: str) -> str:
    """Damage one committed checkpoint in place; says what was done (or why it cannot be)."""
    tensors, manifest = checkpoint / "tensors.safetensors", checkpoint / "manifest.json"
    if kind in ("truncate", "bitflip") and not tensors.is_file():
        return "n/a: no tensors.safetensors"
    if kind == "truncate":
        data = tensors.read_bytes()
        _rewrite(tensors, data[: len(data) // 2])
        return f"tensors.safetensors cut from {len(data)} to {len(data) // 2} bytes"
    if kind == "bitflip":
        data = bytearray(tensors.read_bytes())
        at = len(data) * 2 // 3  # in the tensor data, past the header
        data[at] ^= 0x01
        _rewrite(tensors, bytes(data))
        return f"bit 0 of byte {at} of tensors.safetensors flipped"
    if kind == "state":
        _edit_json(checkpoint / "state.json", lambda d: d.update(edited_by="bench/faults.py"))
        return "state.json: a key added"
    if kind == "result":
        metrics = read_json(checkpoint / "result.json")["metrics"]
        name = next((k for k, v in metrics.items() if isinstance(v, float)), "edited")
        _edit_json(checkpoint / "result.json", lambda d: d["metrics"].update({name: metrics.get(name, 1.0) * 1.01}))
        return f"result.json: metric {name} raised by 1 %"
    if kind == "manifest":
        _edit_json(manifest, lambda d: d["files"].update({"state.json": "0" * 64}))
        return "manifest.json: the sha256 of state.json replaced"
    if kind == "manifest-key":
        _edit_json(manifest, lambda d: d.update(key="0" * 64))
        return "manifest.json: the key replaced (a stale checkpoint, by the runner's rules)"
    if kind == "no-manifest":
        manifest.unlink()
        return "manifest.json deleted"
    raise ValueError(f"unknown damage kind {kind!r}")


# -- full disk ------------------------------------------------------------------------------------
def mount_tmpfs(where: Path, size_mb: int) -> str | None:
    """None when a tmpfs of ``size_mb`` MiB is mounted at ``where``, else why not."""
    if not sys.platform.startswith("linux"):
        return f"skipped: needs Linux (this is {platform.system()})"
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
                          capture_output=True, text=True)
    return None if done.returncode == 0 else f"skipped: cannot mount tmpfs ({done.stderr.strip() or done.returncode})"


def unmount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(where: Path, leave_bytes: int) -> int:
    """Take all free space on ``where``'s file system but ``leave_bytes`` (fallocate); the bytes taken."""
    size = max(0, shutil.disk_usage(where).free - leave_bytes)
    fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return size


def wait_for_event(proc: subprocess.Popen, run_dir: Path, event: str, stage: str, timeout: float) -> bool:
    """Poll events.jsonl until ``event`` for ``stage`` is written; False when the run ends first."""
    deadline, seen, path = time.monotonic() + timeout, 0, run_dir / "events.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if path.is_file():
            lines = path.read_text(errors="replace").splitlines()
            for line in lines[seen:]:
                if f'"event": "{event}"' in line and f'"stage": "{stage}"' in line:
                    return True
            seen = max(0, len(lines) - 1)  # the last line may be half written
        time.sleep(0.01)
    return False


# -- printing -------------------------------------------------------------------------------------
def table(title: str, headers: list[str], rows: list[list[Any]]) -> None:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n== {title} ==")
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def machine() -> str:
    import torch

    from opus.runtime.machine import cpu_model

    return (f"machine: {cpu_model()}; {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable); "
            f"torch {torch.__version__}; Python {platform.python_version()}; {platform.system()} {platform.release()}")


def tiny_pipeline(path: Path) -> Path:
    """Five cheap stages of the runner tests' fixtures on a factory model: the whole campaign in minutes."""
    scale, measure = f"{TINY_STAGES}.scale", f"{TINY_STAGES}.measure"
    spec = {"name": "faults-tiny", "model": {"factory": "tests.fixtures.tiny:tiny_model"},
            "run": {"stall_timeout_s": 60}, "stages": [
                {"id": "base", "uses": measure, "with": {"baseline": True}},
                {"id": "scale", "uses": scale, "needs": ["base"], "with": {"factor": 2.0, "steps": 4, "step_s": 0.25}},
                {"id": "check", "uses": measure, "needs": ["scale"], "with": {"from_model": True}},
                {"id": "jitter", "uses": scale, "needs": ["check"],  # fresh noise: a rebuild differs
                 "with": {"factor": 0.5, "steps": 4, "step_s": 0.25, "noise": True}},
                {"id": "eval", "uses": measure, "needs": ["base", "jitter"],
                 "with": {"role": "eval", "from_model": True, "perplexity": 10.5}}]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path

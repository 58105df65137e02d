"""Runs in git: commit a run's small files, find committed runs in history, read them back from trees.

A run is committed from a temporary index built from HEAD plus the run's files only, so whatever the
user has staged or changed stays exactly as it was; the same entries are then added to the user's
index so that ``git status`` does not report the new files as staged deletions.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import git
import yaml

from opus.errors import EXIT_INVALID, OpusError
from opus.pipeline.run_files import SUMMARY_FILE
from opus.pipeline.summary import headline
from opus.report.publish import ratio_line, tracked_files

ZERO_SHA = "0" * 40
FALLBACK_IDENTITY = {"GIT_AUTHOR_NAME": "Opus", "GIT_AUTHOR_EMAIL": "opus@localhost",
                     "GIT_COMMITTER_NAME": "Opus", "GIT_COMMITTER_EMAIL": "opus@localhost"}


class HistoryError(OpusError):
    """A git operation Opus refuses or cannot do; the message is one line."""


class RevisionError(HistoryError):
    """The user named a revision git does not know: invalid input, not a failed operation."""

    exit_code = EXIT_INVALID


def open_repo(path: Path) -> git.Repo:
    try:
        return git.Repo(path, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise HistoryError(f"{path} is not inside a git repository") from None


def _busy_state(repo: git.Repo) -> str | None:
    """Why committing now would be wrong: an unfinished merge, rebase, cherry-pick or conflict."""
    git_dir = Path(repo.git_dir)
    for name, what in (("MERGE_HEAD", "a merge"), ("CHERRY_PICK_HEAD", "a cherry-pick"),
                       ("REVERT_HEAD", "a revert"), ("rebase-merge", "a rebase"), ("rebase-apply", "a rebase")):
        if (git_dir / name).exists():
            return f"the repository is in the middle of {what}; finish or abort it first"
    if repo.index.unmerged_blobs():
        return "the index has unresolved merge conflicts; resolve them first"
    return None


def check_committable(repo: git.Repo) -> None:
    if repo.bare:
        raise HistoryError(f"{repo.git_dir} is a bare repository")
    if repo.head.is_detached:
        raise HistoryError("HEAD is detached; check out a branch (git switch NAME) to commit runs")
    busy = _busy_state(repo)
    if busy:
        raise HistoryError(busy)


def commit_message(summary: dict[str, Any], run_info: dict[str, Any], rel_dir: str) -> str:
    """Subject with the headline ratios; body with baseline, final and rollbacks."""
    name = run_info.get("name") or "pipeline"
    ratios = ratio_line(summary.get("ratios") or {}) or "no ratios vs baseline"
    lines = [f"opus: {name} {summary.get('status', '?')} — {ratios}", ""]
    # What a reader must not miss comes first: why the run is not simply finished, and warnings.
    lines += [f"why: {reason}" for reason in summary.get("reasons") or []]
    lines += [f"warning: {warning}" for warning in summary.get("warnings") or []]
    lines += [f"run: {rel_dir}", f"final stage: {summary.get('final_stage') or 'none'}"]
    if summary.get("baseline"):
        lines.append(f"baseline: {headline(summary['baseline'])}")
    if summary.get("final"):
        lines.append(f"final:    {headline(summary['final'])}")
    if summary.get("ratios"):
        lines.append("ratios:   " + "  ".join(f"{k} ×{v:.4g}" for k, v in summary["ratios"].items()))
    for rb in summary.get("rollbacks", []):
        lines.append(f"rollback: {rb['stage']} attempt {rb['attempt']}: {rb['reason']} → {rb['action']}")
    if summary.get("error"):
        lines.append(f"error: {summary['error']}")
    return "\n".join(lines + ["", f"Opus-Run: {rel_dir}"]) + "\n"


def _identity_env(repo: git.Repo) -> dict[str, str]:
    """A fallback author only where git has none, so a fresh machine can still commit."""
    reader = repo.config_reader()
    configured = reader.has_option("user", "name") and reader.has_option("user", "email")
    return {} if configured or "GIT_AUTHOR_NAME" in os.environ else dict(FALLBACK_IDENTITY)


@dataclass
class Committed:
    sha: str
    branch: str
    paths: list[str]
    message: str
    warning: str | None = None


def commit_run(run_dir: Path) -> Committed | None:
    """Commit the run's small files, and only those; None when they are already committed unchanged."""
    try:
        return _commit_run(Path(run_dir).resolve())
    except git.GitCommandError as exc:
        raise HistoryError(f"git {exc.command[1] if len(exc.command) > 1 else ''} failed: {_git_reason(exc)}") \
            from None


def _commit_run(run_dir: Path) -> Committed | None:
    repo = open_repo(run_dir)
    check_committable(repo)
    root = Path(repo.working_tree_dir).resolve()
    if not (run_dir / SUMMARY_FILE).is_file():
        raise HistoryError(f"{run_dir} has no summary.json (the run has not finished)")
    files = tracked_files(run_dir)
    paths = [p.resolve().relative_to(root).as_posix() for p in files]
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    run_info = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    rel_dir = run_dir.relative_to(root).as_posix()
    message = commit_message(summary, run_info, rel_dir)
    branch = repo.head.reference
    parent = repo.head.commit.hexsha if repo.head.is_valid() else None
    shas = repo.git.hash_object("-w", "--", *paths).split()  # blobs exactly as committed
    cacheinfo = [a for sha, path in zip(shas, paths, strict=True)
                 for a in ("--cacheinfo", f"{_mode(root / path)},{sha},{path}")]
    tmp_index = Path(repo.git_dir) / f"opus-index-{uuid.uuid4().hex[:8]}"
    try:
        with repo.git.custom_environment(GIT_INDEX_FILE=str(tmp_index), **_identity_env(repo)):
            if parent:
                repo.git.read_tree(parent)
            else:
                repo.git.read_tree("--empty")
            repo.git.update_index("--add", *cacheinfo)
            tree = repo.git.write_tree()
            if parent and tree == repo.head.commit.tree.hexsha:
                return None
            new = repo.git.commit_tree(tree, *(["-p", parent] if parent else []), "-m", message)
    finally:
        tmp_index.unlink(missing_ok=True)
    # Compare-and-swap: if someone moved the branch meanwhile, git refuses instead of losing their commit.
    repo.git.update_ref("-m", f"opus: commit run {rel_dir}", branch.path, new, parent or ZERO_SHA)
    done = Committed(sha=new, branch=branch.name, paths=paths, message=message)
    try:
        repo.git.update_index("--add", *cacheinfo)  # the user's index: only these entries change
    except git.GitCommandError as exc:  # e.g. another git process holds index.lock; the commit stands
        done.warning = (f"your index was not updated ({_git_reason(exc)}); `git reset -q -- {rel_dir}` "
                        "stops git status from showing the run's files as staged deletions")
    return done


def _mode(path: Path) -> str:
    return "100755" if os.access(path, os.X_OK) else "100644"


# -- reading committed runs ----------------------------------------------------------------------
@dataclass
class RunAt:
    """A run as recorded in one commit (or a directory on disk when ``commit`` is None)."""

    path: str  # the run directory, relative to the repository root (or a filesystem path)
    commit: str | None
    date: float | None
    summary: dict[str, Any] | None
    run_info: dict[str, Any]
    pipeline: dict[str, Any] | None
    error: str | None = None

    @property
    def where(self) -> str:
        return f"{self.commit[:10]}:{self.path}" if self.commit else self.path


def _blob_text(tree: git.Tree, path: str) -> str | None:
    try:
        return (tree / path).data_stream.read().decode("utf-8")
    except KeyError:
        return None


def read_run_at(commit: git.Commit, path: str) -> RunAt:
    path = path.strip("/")
    texts = {name: _blob_text(commit.tree, f"{path}/{name}") for name in ("summary.json", "run.json",
                                                                          "pipeline.yaml")}
    run = RunAt(path=path, commit=commit.hexsha, date=commit.committed_date, summary=None, run_info={},
                pipeline=None)
    if texts["summary.json"] is None:
        run.error = f"no {path}/summary.json in {commit.hexsha[:10]}"
        return run
    try:
        run.summary = json.loads(texts["summary.json"])
        run.run_info = json.loads(texts["run.json"]) if texts["run.json"] else {}
        run.pipeline = yaml.safe_load(texts["pipeline.yaml"]) if texts["pipeline.yaml"] else None
    except (ValueError, yaml.YAMLError) as exc:
        run.error = f"unreadable run files in {commit.hexsha[:10]}:{path}: {exc}".splitlines()[0]
    return run


def read_run_dir(path: Path) -> RunAt:
    path = Path(path)
    run = RunAt(path=str(path), commit=None, date=None, summary=None, run_info={}, pipeline=None)
    if not (path / SUMMARY_FILE).is_file():
        run.error = f"{path}: no summary.json (not a finished run directory)"
        return run
    try:
        run.summary = json.loads((path / SUMMARY_FILE).read_text())
        run.date = (path / SUMMARY_FILE).stat().st_mtime
        if (path / "run.json").is_file():
            run.run_info = json.loads((path / "run.json").read_text())
        if (path / "pipeline.yaml").is_file():
            run.pipeline = yaml.safe_load((path / "pipeline.yaml").read_text())
    except (ValueError, yaml.YAMLError) as exc:
        run.error = f"{path}: unreadable run files: {exc}".splitlines()[0]
    return run


def runs_in_history(repo: git.Repo, rev: str = "HEAD", max_count: int | None = None) -> list[RunAt]:
    """Runs whose summary.json a commit in ``rev``'s history added or changed, newest first."""
    if rev.startswith("-"):  # git would read it as an option
        raise RevisionError(f"'{rev}' is not a revision")
    args = [rev, "--format=%x00%H", "--name-only", "--diff-filter=AM", "--no-renames"]
    if max_count:
        args.append(f"--max-count={max_count}")
    try:
        out = repo.git.log(*args, "--", f":(top,glob)**/{SUMMARY_FILE}")
    except git.GitCommandError as exc:  # in a readable repository, that is a revision git does not know
        raise RevisionError(f"cannot read the history of '{rev}': {_git_reason(exc)}") from None
    runs = []
    for block in out.split("\x00")[1:]:
        sha, *names = [line for line in block.splitlines() if line.strip()]
        commit = repo.commit(sha)
        for name in names:
            folder = name.rsplit("/", 1)[0] if "/" in name else ""
            if folder and _blob_text(commit.tree, f"{folder}/run.json") is not None:
                runs.append(read_run_at(commit, folder))
    return runs


def _git_reason(exc: git.GitCommandError) -> str:
    """git's last line of complaint. GitPython wraps stderr as ``stderr: '...'``: unwrap that one pair
    of quotes only, so the quotes git puts around a name (``bad revision 'x'``) stay."""
    text = (exc.stderr or str(exc)).strip()
    if text.startswith("stderr: '") and text.endswith("'"):
        text = text[len("stderr: '"):-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else str(exc)


def resolve_run(spec: str, cwd: Path | None = None) -> RunAt:
    """``spec`` is a run directory, ``REV:path/to/run`` or a revision (its latest committed run).

    Never raises for a bad spec: the returned run carries the error instead.
    """
    cwd = Path(cwd or Path.cwd())
    local = cwd / spec
    if local.is_dir():
        run = read_run_dir(local)
        run.path = spec  # shown as the user wrote it
        return run
    blank = RunAt(path=spec, commit=None, date=None, summary=None, run_info={}, pipeline=None)
    try:
        repo = open_repo(cwd)
    except HistoryError as exc:
        blank.error = f"'{spec}' is not a run directory, and {exc}"
        return blank
    rev, sep, path = spec.partition(":")
    try:
        commit = repo.commit(rev)
    except (git.BadName, ValueError, git.GitCommandError):
        if not sep and repo.head.is_valid():  # a run path deleted from disk but committed at HEAD
            committed = read_run_at(repo.head.commit, spec)
            if committed.error is None:
                return committed
        blank.error = f"'{rev}' is neither a run directory nor a known git revision"
        return blank
    if sep:
        return read_run_at(commit, path)
    found = runs_in_history(repo, commit.hexsha, max_count=1)
    if not found:
        blank.error = f"no committed run in the history of '{rev}' ({commit.hexsha[:10]})"
        return blank
    return found[0]

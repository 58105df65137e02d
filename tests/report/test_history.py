"""Committing runs to git (only their small files, never the user's changes) and ``opus log``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opus.cli.main import main
from opus.report.history import HistoryError, commit_run, open_repo, runs_in_history
from tests.fabricate import fake_run, git, make_repo
from tests.helpers import MEASURE, pipeline, run_cli, summary, write_pipeline


def _user_changes(repo: Path) -> dict[str, str]:
    """Stage an edit of b.txt, leave an edit of a.txt unstaged and c.txt untracked."""
    (repo / "b.txt").write_text("b\nstaged\n")
    git(repo, "add", "b.txt")
    (repo / "a.txt").write_text("a\nunstaged\n")
    (repo / "c.txt").write_text("untracked\n")
    return _snapshot(repo)


def _snapshot(repo: Path) -> dict[str, str]:
    untracked = git(repo, "ls-files", "--others", "--exclude-standard").split()
    return {"staged": git(repo, "diff", "--cached"), "unstaged": git(repo, "diff"),
            "untracked": [p for p in untracked if not p.startswith("runs/")]}  # the run's own files aside


def test_commit_takes_only_the_run_files_and_keeps_user_changes(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    plan = {"groups": [{"name": "layers.0.mlp", "format": "int8", "score": {"int8": 0.01}, "reason": "cheap"}]}
    run_dir = fake_run(repo / "runs" / "r1", artifacts={"quant": {"plan.yaml": json.dumps(plan)}})
    before = _user_changes(repo)
    head = git(repo, "rev-parse", "HEAD").strip()

    from opus.report.publish import publish

    publish(run_dir)
    done = commit_run(run_dir)

    assert done is not None and done.branch == "main"
    assert git(repo, "rev-parse", "HEAD~1").strip() == head
    changed = git(repo, "diff", "--name-only", "HEAD~1", "HEAD").split()
    assert changed and all(p.startswith("runs/r1/") for p in changed)
    assert "runs/r1/summary.json" in changed and "runs/r1/pipeline.yaml" in changed
    assert "runs/r1/artifacts/quant/plan.yaml" in changed and "runs/r1/checkpoints.json" in changed
    assert not any("stages/" in p or p.endswith(".safetensors") for p in changed)  # tensors: by hash only
    refs = json.loads(git(repo, "show", "HEAD:runs/r1/checkpoints.json"))
    assert refs["checkpoints"][0]["files"]["tensors.safetensors"] == "ab" * 32
    # The user's staged, unstaged and untracked changes are exactly as they were.
    assert _snapshot(repo) == before
    assert "runs/" not in git(repo, "status", "--porcelain")
    message = git(repo, "log", "-1", "--format=%B")
    assert "P ×1.500" in message and "D ×0.800" in message and "ppl ×1.020" in message
    assert "Opus-Run: runs/r1" in message
    assert commit_run(run_dir) is None  # unchanged: nothing to commit


def test_commit_in_a_repository_without_commits(tmp_path: Path) -> None:
    repo = tmp_path / "fresh"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    run_dir = fake_run(repo / "runs" / "r1")
    done = commit_run(run_dir)
    assert done is not None
    assert git(repo, "rev-list", "--count", "HEAD").strip() == "1"


def test_detached_head_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    git(repo, "checkout", "-q", "--detach")
    run_dir = fake_run(repo / "runs" / "r1")
    head = git(repo, "rev-parse", "HEAD").strip()
    with pytest.raises(HistoryError, match="HEAD is detached"):
        commit_run(run_dir)
    assert git(repo, "rev-parse", "HEAD").strip() == head
    assert (run_dir / "summary.json").is_file()


def test_merge_in_progress_is_refused(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    git(repo, "checkout", "-q", "-b", "other")
    (repo / "a.txt").write_text("other\n")
    git(repo, "commit", "-q", "-am", "other")
    git(repo, "checkout", "-q", "main")
    (repo / "a.txt").write_text("main\n")
    git(repo, "commit", "-q", "-am", "main")
    with pytest.raises(Exception):  # noqa: B017 - the merge conflicts, as intended
        git(repo, "merge", "other")
    run_dir = fake_run(repo / "runs" / "r1")
    with pytest.raises(HistoryError, match="middle of a merge"):
        commit_run(run_dir)


def test_not_a_repository(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="not inside a git repository"):
        commit_run(fake_run(tmp_path / "r1"))


def test_run_commit_outside_a_repository_warns_and_keeps_the_run(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    path = write_pipeline(tmp_path / "p.yaml", pipeline([{"id": "base", "uses": MEASURE,
                                                          "with": {"baseline": True}}]))
    run_dir = tmp_path / "run"
    assert run_cli("run", path, "--run-dir", run_dir, "--commit") == 0  # the run's own exit code
    err = capsys.readouterr().err
    assert "warning: run not committed:" in err and "not inside a git repository" in err
    assert summary(run_dir)["status"] == "finished" and (run_dir / "report.html").is_file()


def test_pipeline_with_track_git_commits_at_the_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    repo = make_repo(tmp_path / "repo")
    before = _user_changes(repo)
    stages = [{"id": "base", "uses": MEASURE, "with": {"baseline": True, "throughput_tok_s": 100.0}},
              {"id": "fast", "uses": MEASURE, "needs": ["base"], "with": {"throughput_tok_s": 250.0,
                                                                          "perplexity": 10.5}}]
    spec = pipeline(stages, name="tracked")
    spec["run"]["track"] = "git"
    path = write_pipeline(repo / "p.yaml", spec)
    assert run_cli("run", path, "--run-dir", repo / "runs" / "night1") == 0
    assert "committed" in capsys.readouterr().out
    changed = git(repo, "diff", "--name-only", "HEAD~1", "HEAD").split()
    assert {"runs/night1/summary.json", "runs/night1/report.md", "runs/night1/report.html",
            "runs/night1/events.jsonl", "runs/night1/run.json"} <= set(changed)
    assert not any("/stages/" in p for p in changed)
    assert git(repo, "log", "-1", "--format=%s").startswith("opus: tracked finished — P ×2.500  ppl ×1.050")
    assert _snapshot(repo)["staged"] == before["staged"] and _snapshot(repo)["unstaged"] == before["unstaged"]


def _two_committed_runs(repo: Path) -> None:
    for index, throughput in ((1, 150.0), (2, 210.0)):
        commit_run(fake_run(repo / "runs" / f"r{index}", throughput=throughput, factor=float(index)))


def test_log_lists_committed_runs_newest_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    repo = make_repo(tmp_path / "repo")
    _two_committed_runs(repo)
    (repo / "a.txt").write_text("unrelated\n")
    git(repo, "commit", "-q", "-am", "unrelated work")
    runs = runs_in_history(open_repo(repo))
    assert [r.path for r in runs] == ["runs/r2", "runs/r1"]
    monkeypatch.chdir(repo)
    assert main(["log", "--plot", str(tmp_path / "history.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "P ×2.100" in lines[0] and "runs/r2" in lines[0] and "demo" in lines[0] and "finished" in lines[0]
    assert "P ×1.500" in lines[1] and "D ×0.800" in lines[1] and "ppl ×1.020" in lines[1]
    assert (tmp_path / "history.png").read_bytes().startswith(b"\x89PNG")


def test_log_outside_a_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["log"]) == 3
    assert "not inside a git repository" in capsys.readouterr().err


@pytest.mark.parametrize("rev", ["no-such-rev", "--all"])  # git would take --all as an option
def test_log_with_a_bad_revision_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture, rev: str) -> None:
    repo = make_repo(tmp_path / "repo")
    _two_committed_runs(repo)
    monkeypatch.chdir(repo)
    assert main(["log", "--", rev]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert captured.err.startswith("error: ") and rev in captured.err
    assert main(["log", "HEAD~1"]) == 0 and "runs/r1" in capsys.readouterr().out  # a good one still works


def test_log_with_a_revision_in_a_repository_without_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    repo = tmp_path / "empty"
    repo.mkdir()
    git(repo, "init", "-q")
    monkeypatch.chdir(repo)
    assert main(["log"]) == 0 and capsys.readouterr().out == "no commits yet\n"
    assert main(["log", "main~3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "main~3" in captured.err

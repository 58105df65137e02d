"""Harness task files: read by path, and written from a folder of text (``opus tasks``).

A task named by a path (``tasks/k3_next_line.yaml``) is read here with ``yaml.safe_load`` (a task file
may come from anyone: ``!function`` tags, which import Python beside the file, are refused) and handed
to the harness as a config, its ``data_files`` resolved against the task file's folder, so a task
folder works from any directory. Any other name is the harness's own task (its index, or a user's
``--include_path``), loaded from the user's cached datasets: never a hub download (``HF_HUB_OFFLINE``).

Written from text (source code or prose), three tasks a model of that text should do well:

- ``<name>_next_line`` (multiple choice, ``acc``): up to 16 lines of a file, then which of four lines
  comes next: the real one, or one of three other lines of the same file.
- ``<name>_word_order`` (multiple choice, ``acc``): the same context, then which of four orders of the
  next line's words is the real one.
- ``<name>_line_end`` (generation, ``exact_match``): the same context and the first part of a line,
  then the rest of the line, generated greedily until the newline.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from opus.atomic import write_text
from opus.errors import InputError

CONTEXT_LINES = 16
MIN_LINE_CHARS = 12


def task_entry(entry: str, base: Path) -> str | dict[str, Any]:
    """A ``tasks:`` entry as the harness takes it: a task file's config (path relative to ``base``), or a name."""
    path = (base / entry) if not Path(entry).is_absolute() else Path(entry)
    if not entry.endswith((".yaml", ".yml")):
        return entry
    if not path.is_file():
        raise InputError("no such task file", file=str(path))
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.constructor.ConstructorError as error:
        raise InputError(f"a tag Opus does not run ({error.problem}); a task that needs Python (!function) is "
                         "the harness's own: pass its name with --include_path", file=str(path)) from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise InputError(f"not a task file ({str(error).splitlines()[0]})", file=str(path)) from None
    if not isinstance(config, dict) or not isinstance(config.get("task"), str):
        raise InputError("a task file is a mapping with a 'task' name", file=str(path))
    reach = _template_reaching_python(config)
    if reach:
        raise InputError(f"a template that reaches Python's internals ({reach!r}): the harness renders templates "
                         "with jinja2, where '__' attributes lead to running code; not run", file=str(path))
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if files is not None:
        config["dataset_kwargs"]["data_files"] = _resolved(files, path.parent)
    return config


def _template_reaching_python(value: Any) -> str | None:
    """The first jinja template in a task's config that names a dunder attribute (``{{ x.__class__ }}``):
    from a stranger's file, the harness's unsandboxed jinja2 would run what such a template reaches."""
    if isinstance(value, dict):
        return next((found for v in value.values() if (found := _template_reaching_python(v))), None)
    if isinstance(value, list):
        return next((found for v in value if (found := _template_reaching_python(v))), None)
    if isinstance(value, str) and ("{{" in value or "{%" in value) and "__" in value:
        return value[:60]
    return None


def _resolved(files: Any, folder: Path) -> Any:
    if isinstance(files, str):
        return files if "://" in files or Path(files).is_absolute() else str((folder / files).resolve())
    if isinstance(files, list):
        return [_resolved(f, folder) for f in files]
    if isinstance(files, dict):
        return {split: _resolved(f, folder) for split, f in files.items()}
    return files


@dataclass(frozen=True)
class Line:
    file: int
    index: int
    text: str

    @property
    def indent(self) -> int:
        return len(self.text) - len(self.text.lstrip())


def _lines(files: list[Path]) -> tuple[list[list[str]], list[Line]]:
    texts = [f.read_text(encoding="utf-8", errors="replace").splitlines() for f in files]
    usable = [Line(f, i, line) for f, lines in enumerate(texts) for i, line in enumerate(lines)
              if i >= 4 and len(line.strip()) >= MIN_LINE_CHARS]
    return texts, usable


def _context(texts: list[list[str]], line: Line) -> str:
    return "\n".join(texts[line.file][max(0, line.index - CONTEXT_LINES) : line.index]) + "\n"


def _same_file(line: Line, texts: list[list[str]], rng: random.Random) -> list[str] | None:
    """Three other lines of the same file, at least four lines away: the file's own vocabulary and style,
    so only reading the context tells the real next line."""
    lines = texts[line.file]
    near = {t for i, t in enumerate(lines)
            if abs(i - line.index) > 3 and len(t.strip()) >= MIN_LINE_CHARS and t.strip() != line.text.strip()}
    return rng.sample(sorted(near), 3) if len(near) >= 3 else None


def _shuffled(line: Line, texts: list[list[str]], rng: random.Random) -> list[str] | None:
    """Three orders of the line's own words: which one is well-formed."""
    words = line.text.split()
    if len(words) < 4:
        return None
    found: set[str] = set()
    for _ in range(30):
        order = rng.sample(words, len(words))
        text = " " * line.indent + " ".join(order)
        if order != words and text not in found:
            found.add(text)
        if len(found) == 3:
            return sorted(found)
    return None


def choice_docs(texts: list[list[str]], usable: list[Line], samples: int, rng: random.Random,
                distractors: Callable[[Line, list[list[str]], random.Random], list[str] | None]) -> list[dict]:
    docs = []
    for line in rng.sample(usable, len(usable)):
        others = distractors(line, texts, rng)
        if others is None:
            continue
        choices = [line.text, *others]
        rng.shuffle(choices)
        docs.append({"context": _context(texts, line), "choices": choices, "label": choices.index(line.text)})
        if len(docs) == samples:
            break
    return docs


def line_end_docs(texts: list[list[str]], usable: list[Line], samples: int, rng: random.Random) -> list[dict]:
    docs = []
    for line in rng.sample(usable, len(usable)):
        body = line.text.rstrip()
        start = line.indent
        cuts = [i for i in range(start + 4, len(body) - 4) if body[i] in " (.,=[" and body[i - 1] != " "]
        if len(body) - start < 24 or not cuts:
            continue
        cut = cuts[len(cuts) // 2] + 1
        docs.append({"context": _context(texts, line) + body[:cut], "target": body[cut:]})
        if len(docs) == samples:
            break
    return docs


def _task_yaml(task: str, kind: str) -> str:
    common = {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": f"{task}.jsonl"}},
              "test_split": "test", "doc_to_text": "context"}
    if kind != "line_end":
        config = {**common, "output_type": "multiple_choice", "doc_to_choice": "choices", "doc_to_target": "label",
                  "target_delimiter": "", "metric_list": [{"metric": "acc", "aggregation": "mean",
                                                           "higher_is_better": True},
                                                          {"metric": "acc_norm", "aggregation": "mean",
                                                           "higher_is_better": True}]}
    else:
        config = {**common, "output_type": "generate_until", "doc_to_target": "target", "target_delimiter": "",
                  "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    config["metadata"] = {"version": 1, "written_by": "opus tasks"}
    text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
    if kind == "line_end":  # in JSON's flow style: a newline stop reads as "\n", not as a folded block
        text += 'generation_kwargs: {"until": ["\\n"], "max_gen_toks": 48, "do_sample": false}\n'
    return text


def write_tasks(files: list[Path], out: Path, name: str, samples: int = 100, seed: int = 0) -> list[Path]:
    """``<name>_next_line``, ``<name>_word_order`` and ``<name>_line_end`` (a ``.yaml`` and its ``.jsonl``
    each) in ``out``; the task files, which name their data relative to themselves."""
    if not files:
        raise InputError("no text files to write tasks from")
    texts, usable = _lines(sorted(files))
    written = []
    makers: dict[str, Callable[[random.Random], list[dict]]] = {
        "next_line": lambda rng: choice_docs(texts, usable, samples, rng, _same_file),
        "word_order": lambda rng: choice_docs(texts, usable, samples, rng, _shuffled),
        "line_end": lambda rng: line_end_docs(texts, usable, samples, rng),
    }
    for kind, make in makers.items():
        docs = make(random.Random(f"{seed}-{kind}"))
        if not docs:
            raise InputError(f"no {kind} item could be made from {len(files)} files: too little text")
        task = f"{name}_{kind}"
        write_text(out / f"{task}.jsonl", "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
        write_text(out / f"{task}.yaml", _task_yaml(task, kind))
        written.append(out / f"{task}.yaml")
    return written

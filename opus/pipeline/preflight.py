"""Checks before anything runs, beyond the spec's shape: what would otherwise fail hours later.

``preflight`` runs in ``opus check`` and at the start of ``opus run`` / ``opus resume``, after the
spec and the stage configs validated, and takes seconds:

- the device exists here (``cpu``, ``cuda``, ``cuda:N`` with N below the device count);
- Ray is installed when ``run.executor`` asks for it;
- each stage type's own checks of its config against the pipeline (``preflight(cfg, spec)``, e.g. a
  plan that asks for a format this device cannot run);
- every gate names a metric its stage type reports: a stage type declares ``METRICS``, the keys it
  may report (``*`` matches a varying part, e.g. ``groups_*``); gate names go through the aliases
  of ``opus.pipeline.gates``. A stage type without ``METRICS`` is not checked;
- the model's files (``opus.pipeline.preflight_model``): config.json / GGUF header, the family, complete
  safetensors files, weights that fit in memory;
- each text set: its files are text (not empty, not binary, UTF-8), a dataset directory holds a
  Dataset (or the DatasetDict's ``split``) with the text column, and with the model's tokenizer
  the text makes ``samples`` blocks of ``seq_len`` tokens. The reading and counting is
  ``opus.runtime.data``'s own, so the check and the run cannot disagree.

Each failure is one ``InputError`` naming the pipeline's file, line and key.
"""

from __future__ import annotations

import difflib
import re
from fnmatch import fnmatchcase
from types import ModuleType
from typing import Any

from pydantic import BaseModel

from opus.cluster.settings import RAY_MISSING, ray_installed
from opus.pipeline.gates import ALIASES, metric_key
from opus.pipeline.preflight_model import UNKNOWN, TokenizerLoader, check_model
from opus.pipeline.registry import StageType
from opus.pipeline.spec import LoadedPipeline

_CUDA = re.compile(r"cuda(?::(\d+))?")


def preflight(loaded: LoadedPipeline, types: dict[str, tuple[StageType, BaseModel]]) -> None:
    """Raise the first problem found as an InputError; cheap checks first."""
    check_device(loaded)
    check_executor(loaded)
    check_stage_configs(loaded, types)
    check_gates(loaded, types)
    tokenizer = check_model(loaded)
    check_text_sets(loaded, tokenizer)


def check_executor(loaded: LoadedPipeline) -> None:
    """A pipeline that fans out on Ray needs Ray here (the driver side): say so before anything runs."""
    if loaded.spec.run.executor != "local" and not ray_installed():
        raise loaded.error(RAY_MISSING, ("run", "executor"))


def check_device(loaded: LoadedPipeline) -> None:
    device, loc = loaded.spec.model.device, ("model", "device")
    if device == "cpu":
        return
    match = _CUDA.fullmatch(device)
    if match is None:
        raise loaded.error(f"unknown device {device!r}; use cpu, cuda or cuda:N (one device)", loc)
    import torch

    if not torch.cuda.is_available():
        built = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise loaded.error(f"device {device!r}: CUDA is not available here ({built}); use device: cpu", loc)
    count = torch.cuda.device_count()
    if match[1] is not None and int(match[1]) >= count:
        raise loaded.error(f"device {device!r}: this machine has {count} CUDA device(s), "
                           f"cuda:0 to cuda:{count - 1}", loc)


def _reports(metrics: frozenset[str], key: str) -> bool:
    return any(fnmatchcase(key, pattern) for pattern in metrics)


def undeclared_metrics(module: ModuleType, metrics: dict[str, Any]) -> list[str]:
    """The numbers a stage reported that its type's METRICS does not declare (tests keep METRICS true).

    Only numbers can be gated: a dict beside a metric (its ``_spread``) is not a gate's metric.
    """
    declared = frozenset(getattr(module, "METRICS", ()))
    return sorted(key for key, value in metrics.items()
                  if isinstance(value, (int, float)) and not _reports(declared, key))


def check_gates(loaded: LoadedPipeline, types: dict[str, tuple[StageType, BaseModel]]) -> None:
    for index, stage in enumerate(loaded.spec.stages):
        stage_type, _ = types[stage.id]
        metrics = getattr(stage_type.module, "METRICS", None)
        if metrics is None:
            continue  # a stage type that does not declare what it reports cannot be checked
        metrics = frozenset(metrics)
        for name in stage.gate:
            if _reports(metrics, metric_key(name)):
                continue
            known = sorted(metrics)
            names = known + [alias for alias, key in ALIASES.items() if key in metrics]
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise loaded.error(f"stage type '{stage.uses}' does not report '{name}'; {hint}"
                               f"it reports: {', '.join(known)}", ("stages", index, "gate", name))


def check_stage_configs(loaded: LoadedPipeline, types: dict[str, tuple[StageType, BaseModel]]) -> None:
    for index, stage in enumerate(loaded.spec.stages):
        stage_type, cfg = types[stage.id]
        for key, message in stage_type.preflight(cfg, loaded.spec, loaded.base_dir):
            raise loaded.error(message, ("stages", index, "with", *key))


def check_text_sets(loaded: LoadedPipeline, tokenizer: TokenizerLoader) -> None:
    from opus.runtime.data import DataError, check_enough_text, documents

    sets = {name: getattr(loaded.spec.data, name) for name in ("calibration", "evaluation")}
    sets = {name: text_set for name, text_set in sets.items() if text_set is not None}
    if not sets:
        return
    tok: Any = tokenizer()
    for name, text_set in sets.items():
        if tok is None:  # every stage that reads this text would fail on it
            # Only an hf directory can get here: a GGUF's tokenizer either loads or fails the model check.
            raise loaded.error("the model has no tokenizer (an hf directory needs tokenizer.json), so this text "
                               "cannot be turned into tokens", ("data", name))
        try:
            if tok is UNKNOWN:  # a factory's tokenizer: only the text itself can be checked
                documents(text_set, loaded.base_dir)
            else:
                check_enough_text(text_set, tok, loaded.base_dir)
        except DataError as exc:
            default = "files" if text_set.files is not None else "dataset"
            raise loaded.error(str(exc), ("data", name, exc.key or default)) from None

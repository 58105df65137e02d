"""The pipeline spec: pydantic models (extra keys forbidden) and the loader that maps errors to lines."""

from __future__ import annotations

import glob
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from opus.cluster.settings import ExecutorSettings
from opus.errors import InputError
from opus.pipeline.yaml_lines import Loc, dotted, line_of, load_yaml_with_lines, parse_yaml
from opus.runtime.text_set import TextSetSpec


class Strict(BaseModel):
    # allow_inf_nan=False: a bound of .nan compares false with everything, so a gate on it could never fail.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


class ModelSpec(Strict):
    hf: str | None = None  # a directory, or a hub id "org/name" read from the local HF cache (opus.models.hub)
    gguf: str | None = None
    factory: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    # The cached snapshot an ``hf`` hub id names (set by load_pipeline): what every reader of the source gets.
    _hf_dir: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        given = [k for k in ("hf", "gguf", "factory") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("give exactly one model source: hf, gguf or factory")
        if self.factory and ":" not in self.factory:
            raise ValueError("factory must look like 'package.module:function'")
        return self

    def source(self) -> dict[str, Any]:
        if self.factory:
            return {"factory": self.factory, "args": dict(self.args)}
        return {"hf": self._hf_dir or self.hf} if self.hf else {"gguf": self.gguf}


class DataSpec(Strict):
    calibration: TextSetSpec | None = None
    evaluation: TextSetSpec | None = None


class WorkloadSpec(Strict):
    batch_size: int = Field(32, gt=0)
    input_len: int = Field(512, gt=0)
    output_len: int = Field(128, gt=0)
    warmup: int = Field(1, ge=0)
    repeats: int = Field(3, gt=0)


class RunSpec(Strict):
    stage_timeout_s: float | None = Field(None, gt=0)
    stall_timeout_s: float = Field(1800.0, gt=0)
    # One torch compile reports nothing until it ends (a 30-layer model's first took ~4 min here): while
    # one runs, the watchdog waits this long instead (opus.pipeline.supervise.stall_reason).
    compile_timeout_s: float = Field(7200.0, gt=0)
    max_retries: int = Field(2, ge=0, le=20)
    min_free_disk_mb: int = Field(256, ge=0)
    # Threads per stage worker; "auto": the cores idle just before each stage starts (opus.runtime.machine).
    threads: PositiveInt | Literal["auto"] | None = None
    track: Literal["none", "git"] = "none"
    # An earlier run whose timing decisions this one replays (opus.pipeline.replay); `opus run --decisions-from`.
    decisions_from: str | None = None
    # Where the plan stage's sensitivity sweep runs: this machine, or {ray: {...}} (opus.cluster). Not part
    # of any stage key: the same units come out either way, so a run can move between the two and resume.
    executor: Literal["local"] | ExecutorSettings = "local"

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, value: Any) -> Any:
        if value is None or value == "auto" or (type(value) is int and value > 0):
            return value
        raise ValueError("a positive number of threads, or auto")


class Threshold(Strict):
    min: float | None = None
    max: float | None = None
    min_ratio: float | None = None
    max_ratio: float | None = None
    max_increase: float | None = None
    max_decrease: float | None = None
    max_drop: float | None = None  # an accuracy's fall from the baseline's on the same samples (opus.pipeline.gates)

    @model_validator(mode="after")
    def _some_bound(self) -> Threshold:
        if all(v is None for v in self.model_dump().values()):
            raise ValueError("a threshold needs at least one of " + ", ".join(Threshold.model_fields))
        return self


class StageSpec(Strict):
    id: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
    uses: str
    with_: dict[str, Any] = Field(default_factory=dict, alias="with")
    needs: list[str] = Field(default_factory=list)
    gate: dict[str, Threshold] = Field(default_factory=dict)
    on_fail: Literal["retry", "skip", "abort"] = "skip"
    retries: int | None = Field(None, ge=0, le=20)
    timeout_s: float | None = Field(None, gt=0)
    description: str | None = None  # cosmetic: not part of the stage key

    @field_validator("needs", mode="before")
    @classmethod
    def _one_need(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class PipelineSpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
    description: str | None = None
    model: ModelSpec
    data: DataSpec = Field(default_factory=DataSpec)
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    run: RunSpec = Field(default_factory=RunSpec)
    stages: list[StageSpec] = Field(min_length=1)

    def stage(self, stage_id: str) -> StageSpec:
        return next(s for s in self.stages if s.id == stage_id)


@dataclass
class LoadedPipeline:
    """A validated spec plus what is needed to point back into the YAML."""

    spec: PipelineSpec
    raw: dict[str, Any]
    path: Path
    base_dir: Path
    lines: dict[Loc, int] = field(default_factory=dict)
    override_keys: set[Loc] = field(default_factory=set)

    def error(self, message: str, loc: Loc) -> InputError:
        loc = tuple(loc)
        for override in self.override_keys:
            if loc[: len(override)] == override or override[: len(loc)] == loc:
                return InputError(message, file="--set", key=dotted(loc))
        return InputError(message, file=str(self.path), line=line_of(self.lines, loc), key=dotted(loc))

    def invalid(self, exc: ValidationError, under: Loc = (), owner: str | None = None) -> InputError:
        """pydantic's first complaint as one line naming the file, line and key (``under``: where the
        validated mapping sits in the file; ``owner``: whose keys, for an unknown one)."""
        first = exc.errors()[0]
        # Union members' names ("function-after[...]") are pydantic's, not keys of the file.
        loc = (*under, *(p for p in first["loc"] if not (isinstance(p, str) and "[" in p)))
        message = first["msg"]
        if first["type"] == "extra_forbidden":
            message = f"unknown key '{loc[-1]}'" + (f" for {owner}" if owner else "")
        elif "input" in first and not isinstance(first["input"], (dict, list)):
            message += f" (got {first['input']!r})"
        return self.error(message, loc)

    def stage_loc(self, stage_id: str) -> Loc:
        return ("stages", next(i for i, s in enumerate(self.spec.stages) if s.id == stage_id))


def _override_loc(data: dict[str, Any], dotted_key: str) -> Loc:
    """Turn ``stages.quantize.with.alpha`` into a key path; stages are addressed by id or index."""
    parts: list[Any] = dotted_key.split(".")
    if parts[0] == "stages" and len(parts) > 1:
        stages = data.get("stages") or []
        ids = [s.get("id") if isinstance(s, dict) else None for s in stages]
        if parts[1] in ids:
            parts[1] = ids.index(parts[1])
        elif parts[1].isdigit() and int(parts[1]) < len(stages):
            parts[1] = int(parts[1])
        else:
            raise InputError(f"no stage with id '{parts[1]}' (stages: {', '.join(map(str, ids))})",
                             file="--set", key=dotted_key)
    return tuple(parts)


def _override_value(text: str, key: str) -> Any:
    """A value on the command line is YAML too, with the same limits as a pipeline file."""
    try:
        return parse_yaml(text, "--set")[0]
    except InputError as exc:
        raise InputError(exc.message, file="--set", key=key) from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> set[Loc]:
    """Apply ``dotted.key=value`` strings in place (values parsed as YAML scalars)."""
    touched: set[Loc] = set()
    for item in overrides:
        if "=" not in item:
            raise InputError("expected dotted.key=value", file="--set", key=item)
        key, _, text = item.partition("=")
        loc = _override_loc(data, key.strip())
        node: Any = data
        for part in loc[:-1]:
            if isinstance(node, list):
                node = node[part]
            else:
                node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise InputError("cannot set a key inside a scalar", file="--set", key=key)
        node[loc[-1]] = _override_value(text, key) if text.strip() else None
        touched.add(loc)
    return touched


def _resolve_hub_id(loaded: LoadedPipeline, required: bool) -> None:
    """``hf: org/name`` that is no path here: the snapshot it names in the local Hugging Face cache
    (opus.models.hub; nothing is downloaded). Absent from the cache, one line before anything runs."""
    model = loaded.spec.model
    if not model.hf or (loaded.base_dir / model.hf).exists():
        return
    from opus.models.hub import cached_snapshot, looks_like_hub_id, not_cached

    if not looks_like_hub_id(model.hf):
        return  # a path that does not exist: _check_paths says so
    snapshot = cached_snapshot(model.hf)
    if snapshot is not None:
        model._hf_dir = str(snapshot)
    elif required:
        raise loaded.error(not_cached(model.hf, loaded.base_dir / model.hf), ("model", "hf"))


def _check_paths(loaded: LoadedPipeline) -> None:
    """Paths that must exist before anything runs: the model source and the data files."""
    spec, base = loaded.spec, loaded.base_dir
    for key in ("hf", "gguf"):
        value = getattr(spec.model, key)
        if value and not (base / value).exists() and not (key == "hf" and spec.model._hf_dir):
            raise loaded.error(f"model path does not exist: {base / value}", ("model", key))
    for set_name in ("calibration", "evaluation"):
        text_set = getattr(spec.data, set_name)
        if text_set is None:
            continue
        if text_set.dataset and not (base / text_set.dataset).exists():  # else a hub dataset id, if cached
            from opus.runtime.data import DataError, resolve_dataset

            try:
                resolve_dataset(text_set.dataset, base)
            except DataError as exc:
                raise loaded.error(str(exc), ("data", set_name, "dataset")) from None
        for index, pattern in enumerate(text_set.files or []):
            if not glob.glob(str(base / pattern), recursive=True):
                raise loaded.error(f"no file matches '{pattern}' (relative to {base})",
                                   ("data", set_name, "files", index))


def load_pipeline(path: Path | str, overrides: list[str] | None = None,
                  base_dir: Path | None = None, check_paths: bool = True) -> LoadedPipeline:
    """Read, override and validate a pipeline file; every failure is an InputError naming the line."""
    path = Path(path)
    data, lines = load_yaml_with_lines(path)
    if not isinstance(data, dict):
        raise InputError("a pipeline must be a YAML mapping", file=str(path), line=1)
    touched = apply_overrides(data, overrides or [])
    loaded = LoadedPipeline(spec=None, raw=data, path=path,  # type: ignore[arg-type]
                            base_dir=(base_dir or path.parent).resolve(), lines=lines,
                            override_keys=touched)
    try:
        loaded.spec = PipelineSpec.model_validate(data)
    except ValidationError as exc:
        raise loaded.invalid(exc) from None
    _resolve_hub_id(loaded, required=check_paths)
    if check_paths:
        _check_paths(loaded)
    return loaded

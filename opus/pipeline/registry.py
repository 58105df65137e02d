"""Stage types: found through the entry-point group ``opus.stages`` or given as a dotted module path.

A stage type is a module with a pydantic ``Config``, an entry function ``run(ctx, cfg)``, a
``VERSION`` string, optionally a ``ROLE`` (one of ``ROLES``, or a function of the config returning
one) and ``remedy(cfg, failure)`` that proposes a new config after a failed gate.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

from pydantic import BaseModel

from opus.pipeline.code_reach import stage_code_digest
from opus.pipeline.contracts import Failure

ENTRY_POINT_GROUP = "opus.stages"

# What a stage means to the run's verdict (opus.pipeline.verdict). A stage type that declares no ROLE is
# taken as a transform: if it fails, the run cannot claim the optimization it was asked for.
ROLES = {
    "baseline": "measures the unmodified model; every ratio depends on it, so it cannot be skipped",
    "transform": "changes the model (weights, structure or how it runs)",
    "eval": "measures the optimized model against the baseline; its gates decide the run",
    "measure": "measures without changing the model (profile)",
    "analysis": "decides without changing the model (plan)",
    "export": "writes the model in other formats",
}


class UnknownStageType(LookupError):
    pass


@dataclass(frozen=True)
class StageType:
    name: str
    module: ModuleType

    @property
    def config_class(self) -> type[BaseModel]:
        return self.module.Config

    @property
    def code_version(self) -> str:
        """The declared VERSION plus a hash of the code that can change the stage's result.

        That code is the stage's module and every module it reaches by import, plus what the worker
        and the recipes run (``opus.pipeline.code_reach``); an edit there re-runs the stage, an edit to
        the report, the command line or a benchmark does not.
        """
        digest = stage_code_digest(self.module.__name__)[:16]
        return f"{getattr(self.module, 'VERSION', '0')}+{digest}"

    def role(self, cfg: BaseModel) -> str:
        declared = getattr(self.module, "ROLE", "transform")
        role = declared(cfg) if callable(declared) else declared
        if role not in ROLES:
            raise UnknownStageType(f"stage type '{self.name}' declares ROLE {role!r}; known: {', '.join(ROLES)}")
        return role

    def remedy(self, cfg: BaseModel, failure: Failure) -> BaseModel | None:
        fn = getattr(self.module, "remedy", None)
        return fn(cfg, failure) if fn else None

    def preflight(self, cfg: BaseModel, spec: Any, base_dir: Any = None) -> list[tuple[tuple[str, ...], str]]:
        """The stage type's own checks of its config against the pipeline (``spec``; its paths are relative
        to ``base_dir``) before anything runs: ``(key path under the stage's with:, message)`` per problem.
        Optional: ``preflight(cfg, spec)`` or ``preflight(cfg, spec, base_dir)``."""
        fn = getattr(self.module, "preflight", None)
        if fn is None:
            return []
        takes_dir = "base_dir" in inspect.signature(fn).parameters
        return list(fn(cfg, spec, base_dir) if takes_dir else fn(cfg, spec))

    @property
    def has_remedy(self) -> bool:
        return hasattr(self.module, "remedy")


def known_stage_types() -> dict[str, str]:
    """Registered names -> module paths."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _check_module(name: str, module: ModuleType) -> None:
    missing = [attr for attr in ("Config", "run") if not hasattr(module, attr)]
    if missing:
        raise UnknownStageType(f"stage type '{name}' ({module.__name__}) lacks {', '.join(missing)}")


def load_stage_type(name: str) -> StageType:
    """Resolve ``uses``: a registered name, or a dotted module path for unpackaged stages."""
    registered = known_stage_types()
    if name in registered:
        module = importlib.import_module(registered[name].split(":")[0])
    elif "." in name:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise UnknownStageType(f"cannot import stage module '{name}': {exc}") from None
    else:
        known = ", ".join(sorted(registered)) or "none installed"
        raise UnknownStageType(f"unknown stage type '{name}' (known: {known})")
    _check_module(name, module)
    return StageType(name=name, module=module)

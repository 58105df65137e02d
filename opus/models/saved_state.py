"""A model as a state: its base source, the recipe re-applied to it, and the tensors that differ from the base.

Never a pickled module. Rebuilding a state loads the base model, re-applies the recipe, then loads
the saved tensors; a saved tensor that matches no parameter or buffer is an error naming it. The run
engine's checkpoints (opus.pipeline.state) and the native export (opus.export.native) are both states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opus.atomic import member_problem
from opus.errors import InputError
from opus.recipe import apply_step


@dataclass
class Materialized:
    model: Any
    tokenizer: Any
    state: dict[str, Any]
    # (data_ptr, version) of every base tensor: an untouched tensor need not be saved again.
    base_marks: dict[str, tuple[int, int]] = field(default_factory=dict)


def tensor_marks(model: Any) -> dict[str, tuple[int, int]]:
    return {name: (t.data_ptr(), t._version) for name, t in model.state_dict(keep_vars=True).items()}


def apply_state(model: Any, tokenizer: Any, state: dict[str, Any], tensors_dir: Path | None,
                device: str) -> Materialized:
    """Re-apply a state's recipe to a freshly loaded base model, then load its tensors from ``tensors_dir``."""
    marks = tensor_marks(model)
    for step in state["recipe"]:
        model = apply_step(model, step)
    if state.get("tensors"):
        tensors = _read_tensors(tensors_dir, state["tensors"], device)
        for alias, target in state.get("aliases", {}).items():
            tensors[alias] = tensors[target]
        for prefix, module in model.named_modules():
            if hasattr(module, "upgrade_tensors"):  # checkpoints written by an older layout
                module.upgrade_tensors(f"{prefix}." if prefix else "", tensors)
        own = model.state_dict(keep_vars=True)
        for name, value in tensors.items():
            if name not in own:
                raise ValueError(f"checkpoint tensor '{name}' matches no parameter or buffer of the model")
            if own[name].shape != value.shape:
                raise ValueError(f"checkpoint tensor '{name}' has shape {tuple(value.shape)}, "
                                 f"the model expects {tuple(own[name].shape)}")
        # load_state_dict (not a raw copy) so modules can re-derive kernel layouts in their hooks.
        model.load_state_dict(tensors, strict=False)
    model.eval()
    return Materialized(model=model, tokenizer=tokenizer, state=state, base_marks=marks)


def _read_tensors(directory: Path, name: Any, device: str) -> dict[str, Any]:
    """The state's tensors file: a regular file inside ``directory``, and a complete safetensors file (a header
    that claims more bytes than the file has is one line naming it, not a traceback)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if problem := member_problem(directory, name):
        raise InputError(f"state.tensors: {problem}", file=str(directory))
    try:
        return load_file(str(directory / name), device=device)
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"{name}: not a complete safetensors file ({exc})", file=str(directory)) from None


def changed_tensors(model: Any, base_marks: dict[str, tuple[int, int]]) -> tuple[dict, dict[str, str]]:
    """Tensors that are new or modified relative to the base; shared storages saved once."""
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    by_storage: dict[tuple[int, int, tuple], str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if base_marks.get(name) == (tensor.data_ptr(), tensor._version):
            continue
        ident = (tensor.data_ptr(), tensor.numel(), tuple(tensor.shape))
        if ident in by_storage:
            aliases[name] = by_storage[ident]
            continue
        by_storage[ident] = name
        tensors[name] = tensor.detach().contiguous().cpu()
    return tensors, aliases

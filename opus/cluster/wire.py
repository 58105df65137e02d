"""A model and its calibration tensors as plain data: JSON text and safetensors bytes.

What a Ray task receives goes through Ray's object store; sending the model as a Python object would
pickle it. Instead the driver sends an Opus decoder's configuration as JSON and its tensors as one
safetensors blob, put once into the store and shared by every task, and the task rebuilds the model
(``opus.models.load.build_model``, the loader every source goes through). A worker keeps the last model
it rebuilt, so the tasks of one sweep that land on one worker rebuild it once.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import nn

from opus.models.config import ModelConfig
from opus.models.decoder import DecoderLM
from opus.models.load import build_model

HEAD = "lm_head.weight"
_last: dict[str, Any] = {}  # this worker's last rebuilt model, by the digest of what it was built from


class NotShippable(ValueError):
    """The model is not a plain Opus decoder, so a task could not rebuild it."""


def pack_check(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state, if a task can rebuild the model from it; else NotShippable, saying why."""
    if not isinstance(model, DecoderLM):
        raise NotShippable(f"the model is a {type(model).__name__}, not an Opus decoder (hf, gguf or a factory "
                           "that builds opus.models.DecoderLM)")
    state = model.state_dict()
    unexpected = sorted(set(state) - set(_skeleton_keys(model.config)))
    if unexpected:
        raise NotShippable(f"the model has parts a plain decoder has not ({unexpected[0]}): it was already "
                           "transformed")
    return state


def pack_model(model: nn.Module, extra: dict[str, torch.Tensor] | None = None) -> tuple[str, bytes]:
    """``(meta JSON, safetensors bytes)``: the decoder's config and dtype, its state, and ``extra``
    tensors (calibration blocks, ...) under ``extra.<name>``."""
    state = pack_check(model)
    tied = model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    tensors = {k: v.detach().contiguous() for k, v in state.items() if not (tied and k == HEAD)}
    tensors.update({f"extra.{k}": v.detach().contiguous() for k, v in (extra or {}).items()})
    blob = save_tensors(tensors)
    meta = {"config": model.config.to_dict(), "dtype": str(model.model.embed_tokens.weight.dtype).split(".")[-1],
            "tied": tied, "digest": hashlib.sha256(blob).hexdigest(),
            "device": "cuda" if model.model.embed_tokens.weight.is_cuda else "cpu"}  # a task's own GPU is cuda
    return json.dumps(meta, sort_keys=True), blob


def unpack_model(meta_json: str, blob: bytes) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model and the extra tensors, as ``pack_model`` was given them (cached per worker)."""
    meta = json.loads(meta_json)
    digest = meta["digest"]
    if digest not in _last:
        _last.clear()
        tensors = load_tensors(blob)
        extra = {k.removeprefix("extra."): tensors.pop(k) for k in [k for k in tensors if k.startswith("extra.")]}
        cfg = ModelConfig(**meta["config"])
        head = None if meta["tied"] or not cfg.tie_word_embeddings else tensors.pop(HEAD)
        model = build_model(cfg, tensors, meta["dtype"], meta["device"], origin="the driver's model")
        if head is not None:  # tied in the config, untied in the state the driver sent
            model.lm_head.weight = nn.Parameter(head.to(meta["device"]), requires_grad=False)
        extra = {k: v.to(meta["device"]) for k, v in extra.items()}
        _last[digest] = (model, extra)
    return _last[digest]


def _skeleton_keys(cfg: ModelConfig) -> list[str]:
    with torch.device("meta"):
        return list(DecoderLM(cfg).state_dict())

"""Read a Hugging Face model directory: config.json, (sharded) safetensors, tokenizer.json.

Checkpoint names are mapped onto the Opus decoder's names. MoE experts come in three layouts and
all are accepted: Mixtral's legacy ``block_sparse_moe.experts.E.w1/w2/w3`` (what transformers 5.24
``save_pretrained`` still writes for Mixtral), per-expert ``mlp.experts.E.gate_proj/up_proj/down_proj``
(Qwen-MoE on disk), and the fused in-memory layout of transformers 5.x
(``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from opus.models.config import ModelConfig, ModelLoadError, config_from_hf, require_regular_file

_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def read_config(model_dir: Path) -> tuple[dict[str, Any], ModelConfig]:
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory not found: {model_dir}")
    require_regular_file(path)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from e
    return raw, config_from_hf(raw)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from the shard index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted({str(n) for n in json.loads(index.read_bytes())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # torn JSON, no weight_map
            raise ModelLoadError(f"{index}: not a shard index (a JSON object with a weight_map): {e}") from None
        return _readable([model_dir / n for n in names], f" (listed in {index.name})")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
            raise ModelLoadError(f"{model_dir}: only pickle weights (*.bin/*.pt) found; Opus reads safetensors only")
        raise ModelLoadError(f"missing file: {model_dir / 'model.safetensors'}")
    return _readable(files, "")


def _readable(files: list[Path], listed: str) -> list[Path]:
    """``files``, each a regular file (a FIFO named model.safetensors would block the first read forever)."""
    for f in files:
        require_regular_file(f, listed)
    return files


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, st.get_tensor(name)


def map_hf_tensors(tensors: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename checkpoint tensors to the Opus decoder's names, unfusing fused expert weights."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if _IGNORED.search(name):
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$", name)
        if m:
            name = f"{m[1]}.{m[2]}.{_MIXTRAL_EXPERT[m[3]]}.weight"
        m = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj|gate_proj|up_proj)$", name)
        if m:  # fused 3D expert tensor [E, out, in]
            _unfuse(out, m[1], m[2], t, cfg)
            continue
        out[name] = t
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
    return out


def _unfuse(out: dict[str, torch.Tensor], prefix: str, kind: str, t: torch.Tensor, cfg: ModelConfig) -> None:
    if t.dim() != 3:
        raise ModelLoadError(f"tensor {prefix}.{kind}: expected 3 dims [experts, out, in], got {tuple(t.shape)}")
    inter = cfg.moe_intermediate_size
    for e in range(t.shape[0]):
        if kind == "gate_up_proj":
            if t.shape[1] != 2 * inter:
                raise ModelLoadError(f"tensor {prefix}.gate_up_proj: shape {tuple(t.shape)}, expected "
                                     f"{(t.shape[0], 2 * inter, cfg.hidden_size)}")
            out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter]
            out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:]
        else:
            out[f"{prefix}.{e}.{kind}.weight"] = t[e]


def read_hf_tensors(model_dir: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return map_hf_tensors(_iter_tensors(weight_files(model_dir)), cfg)


def load_hf_tokenizer(model_dir: Path) -> Any | None:
    """A ``PreTrainedTokenizerFast`` from tokenizer.json (offline), or None when there is none."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    require_regular_file(path)
    from transformers import PreTrainedTokenizerFast  # slow import: only when a tokenizer exists

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # a broken tokenizer must not hide which file it was
        raise ModelLoadError(f"{model_dir / 'tokenizer.json'}: cannot load tokenizer: {e}") from e

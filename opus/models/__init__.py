"""Opus's own compact decoder-only LMs and the loaders that fill them from HF or GGUF checkpoints.

Public surface::

    load_model(source, base_dir, dtype="float32", device="cpu") -> (model, tokenizer_or_None)
    config_from_hf(config_json_dict) -> ModelConfig
    DecoderLM(ModelConfig)       # model(input_ids, cache=None, start_pos=0, last_only=False)
    ModelLoadError               # one-line, names the file / tensor / architecture at fault
"""

from opus.models.config import FAMILIES, ModelConfig, ModelLoadError, config_from_hf
from opus.models.decoder import DecoderLM
from opus.models.load import build_model, load_model

__all__ = [
    "FAMILIES",
    "DecoderLM",
    "ModelConfig",
    "ModelLoadError",
    "build_model",
    "config_from_hf",
    "load_model",
]

"""Hugging Face directory with compressed-tensors: the format llm-compressor writes, transformers and vLLM load.

``export_hf`` writes ``hf/`` under the export directory: config.json carrying the
``quantization_config`` (one config group per quantization scheme of the plan, each targeting its
layers by name; float layers under ``ignore``; the source's config.json, or for a GGUF or factory
source one written from the model's config when it reads back exactly), the tokenizer files,
generation_config.json and
model.safetensors, in the source checkpoint's own tensor names (fused layers split back, experts
unstacked, SmoothQuant folded into the weights: ``opus.export.unfused``). The quantized tensors are
made by compressed-tensors itself from each layer's weight and Opus's scales, so an int8 layer holds
exactly the integers Opus runs. Then the directory is loaded in transformers and its logits compared
with Opus's model as ``opus.load`` runs it, at every position of the pipeline's held-out text
(``hf_next_token_agreement``, ``hf_logits_cosine``, ``hf_max_abs_diff``; ``compare_in_transformers``).

transformers 5.x keeps a MoE layer's experts fused (``model.layers.N.mlp.experts``, no module per
expert) and dequantizes them while loading with one scheme for all of them: the experts' config group
targets those fused modules, and experts planned in different formats (or left float in a quantized
model) are all stored in one 8-bit scheme (``_experts_scheme``).

Where the compressed-tensors representation differs from Opus's kernel, the layer is named in
``layers_not_as_planned`` with how it was stored:
- w4a16: Opus's groups are asymmetric (a float zero per group); compressed-tensors' asymmetric packed
  zero points do not load in transformers 5.x, so each group is requantized symmetrically.
- int8 MoE experts: transformers 5.x dequantizes MoE experts only from packed or FP8 tensors, so
  int8 experts are written ``pack-quantized`` (the same 8-bit integers and scales, packed in int32).
"""

from __future__ import annotations

import math
import re
import shutil
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opus.atomic import read_json, write_json, write_text
from opus.export.targets import TargetOutcome
from opus.export.unfused import Layer, checkpoint_name, layers, other_tensors
from opus.quant.formats import FORMATS

SUBDIR = "hf"
ERROR_FILE = "hf_error.txt"
WEIGHTS_FILE = "model.safetensors"
SIDE_FILES = ("generation_config.json",)  # copied from an HF source when present
EXPERT = re.compile(r"\.experts\.\d+\.")


def _scheme_args(layer: Layer) -> dict[str, Any] | None:
    """The compressed-tensors scheme (as data) the layer is stored in; None: stored dense."""
    mapping = FORMATS[layer.fmt].export.compressed_tensors
    if mapping is None:
        return None
    args = {k: (dict(v) if isinstance(v, dict) else v) for k, v in mapping.items() if k != "preset"}
    if args["weights"].get("group_size") == "from the recipe":
        args["weights"]["group_size"] = layer.group_size
    if EXPERT.search(layer.name) and args["format"] == "int-quantized":
        args["format"] = "pack-quantized"
    return args


def _experts_scheme(planned: dict[str, tuple[Layer, dict[str, Any] | None]]) -> dict[str, Any] | None:
    """The one scheme every MoE expert is stored in when the plan's experts differ (None: they do not).

    transformers 5.x fuses a layer's experts into one tensor and dequantizes them while loading with a
    single scheme for all of a model's experts (its ``get_experts_scheme``); an expert in another scheme
    came out as garbage (measured: next-token agreement 0.002 with K3's experts in three formats) and a
    float expert failed the load. So mixed experts are written in one 8-bit scheme, symmetric, per group
    of the largest size that divides every expert's input features and planned group: exact for Opus's
    int8 experts (each row's scale repeated per group), within 8-bit rounding for the others (each named
    in ``layers_not_as_planned``)."""
    experts = [(layer, args) for layer, args in planned.values() if EXPERT.search(layer.name)]
    schemes = {repr(args) for _, args in experts}
    # Float experts in an otherwise quantized model failed transformers' load too (its experts converter
    # then takes a dense layer's scheme): they are stored in the 8-bit scheme as well.
    quantized = any(args is not None for _, args in planned.values())
    if not experts or (len(schemes) == 1 and (experts[0][1] is not None or not quantized)):
        return None
    group = 0
    for layer, _ in experts:
        group = math.gcd(group, layer.weight.shape[1], layer.group_size or 0)
    return {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": group},
            "input_activations": None, "format": "pack-quantized"}


def _storage_note(layer: Layer, args: dict[str, Any], exact: bool, unified: bool) -> str | None:
    notes = []
    if not exact:
        w = args["weights"]
        notes.append(f"{layer.fmt} requantized by compressed-tensors from the dequantized weight "
                     f"({w['num_bits']}-bit, {w['strategy']}, symmetric={w['symmetric']})")
    planned = FORMATS[layer.fmt].export.compressed_tensors
    if unified:
        w = args["weights"]
        notes.append(f"{layer.fmt} expert stored in the experts' one scheme ({w['num_bits']}-bit, {w['strategy']} "
                     f"{w.get('group_size') or ''}; transformers 5.x reads all of a model's experts in one scheme)")
    elif planned is not None and planned["format"] != args["format"]:
        notes.append(f"{layer.fmt} expert written {args['format']} (transformers reads MoE experts only from "
                     "packed or FP8 tensors)")
    return "; ".join(notes) or None


def _compress(layer: Layer, args: dict[str, Any]) -> tuple[dict[str, torch.Tensor], bool]:
    """The layer's serialized tensors, made by compressed-tensors from its weight and scales, and whether
    they hold exactly Opus's integers (Opus's own per-row scales) rather than a requantization."""
    from compressed_tensors.compressors import compress_module
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = QuantizationScheme(targets=["Linear"], **args)
    linear = nn.Linear(layer.weight.shape[1], layer.weight.shape[0], bias=layer.bias is not None)
    linear.weight = nn.Parameter(layer.weight.clone(), requires_grad=False)
    if layer.bias is not None:
        linear.bias = nn.Parameter(layer.bias.clone(), requires_grad=False)
    initialize_module_for_quantization(linear, scheme)
    weights = scheme.weights
    own_scale = getattr(layer.module, "scale", None)
    exact = isinstance(own_scale, torch.Tensor) and (weights.strategy == "channel" or (
        weights.strategy == "group" and layer.module.qweight.dtype == torch.int8 and weights.num_bits == 8))
    with torch.no_grad():
        if exact:
            # Opus's own per-row scales (repeated per group): compression recovers exactly the integers Opus runs.
            start, stop = layer.rows
            rows = own_scale.detach().float().reshape(-1)[start:stop].reshape(-1, 1)
            linear.weight_scale.copy_(rows.expand(linear.weight_scale.shape))
        else:
            w = layer.weight
            if weights.strategy == "group":
                w = w.reshape(w.shape[0], -1, weights.group_size)
            lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
            scale, zero = calculate_qparams(lo, hi, weights)
            linear.weight_scale.copy_(scale.reshape(linear.weight_scale.shape))
            if hasattr(linear, "weight_zero_point"):
                linear.weight_zero_point.copy_(zero.reshape(linear.weight_zero_point.shape))
    compress_module(linear)
    return {name: t.detach().contiguous() for name, t in linear.state_dict().items()}, exact


def _config_groups(stored: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One config group per distinct scheme. A dense layer is targeted by its name; the experts by the module
    transformers 5.x has for them, each MoE layer's fused ``model.layers.N.mlp.experts`` (one ``re:`` target:
    a per-expert name matches no module there, and the ``re:`` with "experts" is how it finds their scheme)."""
    from compressed_tensors.quantization import QuantizationScheme

    by_scheme: dict[str, list[str]] = defaultdict(list)
    expert_layers: dict[str, set[str]] = defaultdict(set)
    schemes: dict[str, dict[str, Any]] = {}
    for name, args in stored.items():
        key = repr(sorted(args.items()))
        schemes[key] = args
        if EXPERT.search(name) and (layer := re.match(r"model\.layers\.(\d+)\.", name)):
            expert_layers[key].add(layer.group(1))
        else:
            by_scheme[key].append(name)
    for key, indices in expert_layers.items():
        by_scheme[key].append(rf"re:^model\.layers\.({'|'.join(sorted(indices, key=int))})\.mlp\.experts$")
    return {f"group_{i}": QuantizationScheme(targets=sorted(by_scheme[key]), **schemes[key])
            for i, key in enumerate(sorted(by_scheme, key=lambda k: sorted(by_scheme[k])[0]))}


def _config(model: nn.Module, source_dir: Path | None) -> dict[str, Any] | None:
    """The source's config.json, else one written from the model's config (a GGUF or factory source)
    when it reads back exactly (``opus.models.config.hf_config``), else None."""
    if source_dir is not None and (source_dir / "config.json").is_file():
        return read_json(source_dir / "config.json")
    from opus.models.config import ModelConfig, hf_config

    cfg = getattr(model, "config", None)
    return hf_config(cfg) if isinstance(cfg, ModelConfig) else None


def _source_dir(source: dict[str, Any], base_dir: Path) -> Path | None:
    if "hf" not in source:
        return None
    path = Path(source["hf"]).expanduser()
    return path if path.is_absolute() else base_dir / path


def write_hf(model: nn.Module, tokenizer: Any, config: dict[str, Any], source_dir: Path | None, out: Path,
             dtype: torch.dtype) -> dict[str, Any]:
    """Write the directory; returns info (config groups, storage notes) for the outcome."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from safetensors.torch import save_file

    family = model.config.family
    tensors: dict[str, torch.Tensor] = {}
    stored: dict[str, dict[str, Any]] = {}
    ignore, notes = [], {}
    planned = {layer.name: (layer, _scheme_args(layer)) for layer in layers(model).values()}
    experts_scheme = _experts_scheme(planned)
    for layer, args in planned.values():
        disk = checkpoint_name(layer.name, family)
        unified = experts_scheme is not None and EXPERT.search(layer.name) is not None
        if unified:
            args = experts_scheme
        if args is None:
            own = getattr(layer.module, "weight", None)  # a cast layer (bf16, fp16) keeps its own dtype
            keep = own.dtype if isinstance(own, torch.Tensor) and own.is_floating_point() else dtype
            tensors[f"{disk}.weight"] = layer.weight.to(keep)
            if layer.bias is not None:
                tensors[f"{disk}.bias"] = layer.bias.to(keep)
            ignore.append(disk)
            continue
        serialized, exact = _compress(layer, args)
        for name, t in serialized.items():
            tensors[f"{disk}.{name}"] = t
        stored[disk] = args
        if note := _storage_note(layer, args, exact, unified):
            notes[disk] = note
    for name, t in other_tensors(model).items():
        tensors[checkpoint_name(name, family)] = t.to(dtype) if t.is_floating_point() else t
    config = dict(config)
    # A quantized lm_head no longer shares the embedding's float weight.
    config["tie_word_embeddings"] = bool(config.get("tie_word_embeddings")) and "lm_head" in ignore
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    groups = _config_groups(stored)
    if groups:
        formats = {g.format for g in groups.values()}
        qconfig = QuantizationConfig(config_groups=groups, ignore=sorted(ignore),
                                     format=formats.pop() if len(formats) == 1 else "mixed-precision",
                                     quantization_status=QuantizationStatus.COMPRESSED)
        ModelCompressor(quantization_config=qconfig).update_config(str(out))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(out))
    for name in SIDE_FILES if source_dir is not None else ():
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, out / name)
    return {"config_groups": {k: {"targets": len(g.targets), "format": g.format,
                                  "weights": g.weights.model_dump(exclude_none=True) if g.weights else None,
                                  "input_activations": bool(g.input_activations)} for k, g in groups.items()},
            "float_layers": len(ignore), "quantized_layers": len(stored), "notes": notes}


def compare_in_transformers(model: nn.Module, out: Path, texts: list[torch.Tensor]) -> dict[str, float]:
    """Load the directory in transformers, as its users do, and compare its next-token logits at every position
    of ``texts`` (the pipeline's held-out text, else the export prompts) with Opus's model as ``opus.load``
    runs it: ``hf_next_token_agreement`` (share of positions with the same greedy token), ``hf_logits_cosine``
    (mean over positions), ``hf_max_abs_diff``: what a user of transformers gets next to a user of Opus.

    They differ where Opus computes otherwise than compressed-tensors can say: a W8A16 GEMM takes bf16
    activations (transformers: float32), transformers dequantizes MoE experts and runs them on float
    activations (Opus's W8A8 experts quantize theirs), compressed-tensors rounds W8A8 activations its own
    way, and Opus's asymmetric 4-bit groups are stored symmetric (``layers_not_as_planned``).
    """
    from loguru import logger
    from transformers import AutoModelForCausalLM

    logger.disable("compressed_tensors")  # its progress and notes are not the user's business here
    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32).eval()

    device = next(model.parameters()).device
    max_diff, agree, positions, cosine = 0.0, 0, 0, 0.0
    with torch.no_grad():
        for ids in texts:
            theirs = hf(ids).logits.float()
            ours = model(ids.to(device)).float().cpu()
            max_diff = max(max_diff, float((ours - theirs).abs().max()))
            agree += int(ours.argmax(-1).eq(theirs.argmax(-1)).sum())
            positions += ids.numel()
            cosine += float(torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).sum())
    return {"hf_max_abs_diff": max_diff, "hf_next_token_agreement": agree / positions,
            "hf_logits_cosine": cosine / positions, "hf_compared_positions": float(positions)}


def export_hf(model: nn.Module, tokenizer: Any, state: dict[str, Any], out_dir: Path, settings: Any) -> TargetOutcome:
    from opus.export.settings import make_prompts, one_line, vocab_size

    source_dir = _source_dir(settings.source, settings.base_dir)
    config = _config(model, source_dir)
    if config is None:
        kind = next(iter(settings.source), "?")
        return TargetOutcome("hf", False, reason=f"no Hugging Face config.json for this model: its source is "
                                                 f"'{kind}' and its config has no exact config.json form")
    out = out_dir / SUBDIR
    try:
        from opus.models.load import resolve_dtype

        info = write_hf(model, tokenizer, config, source_dir, out, resolve_dtype(settings.dtype))
    except Exception as exc:  # noqa: BLE001 - a model this format cannot hold is a finding, not a crash
        shutil.rmtree(out, ignore_errors=True)
        write_text(out_dir / ERROR_FILE, "".join(traceback.format_exception(exc)))
        return TargetOutcome("hf", False, reason=f"{one_line(exc)} (traceback in {ERROR_FILE})")
    notes = info.pop("notes")
    metrics: dict[str, float] = {"hf_file_mb": (out / WEIGHTS_FILE).stat().st_size / 2**20}
    try:
        settings.progress("loading the HF export in transformers")
        texts = settings.held_out or make_prompts(tokenizer, vocab_size(model), settings)
        metrics.update(compare_in_transformers(model, out, texts))
        metrics["hf_loads_in_transformers"] = 1
    except Exception as exc:  # noqa: BLE001 - written, but transformers cannot read it: say so
        metrics["hf_loads_in_transformers"] = 0
        info["transformers_error"] = one_line(exc)
    return TargetOutcome("hf", True, path=SUBDIR, metrics=metrics, info=info, layers_not_as_planned=notes)

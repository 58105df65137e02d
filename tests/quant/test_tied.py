"""A tied model's embedding reads its int8 lm_head's rows: one table, the lookup exact to those rows,
rebuilt from the recipe, cast with the model, and written by the exporters as a table of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from opus.models.saved_state import apply_state, changed_tensors, tensor_marks
from opus.quant.apply import quantize_model
from opus.quant.tied import SharedInt8Embedding, share_embedding, shared_embedding_step, why_not_shared
from opus.runtime.metrics import MB, model_mb
from tests.quant.tiny import blocks, tiny_decoder


def _tied() -> nn.Module:
    model = tiny_decoder("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    return model.eval()


@pytest.mark.parametrize("fmt", ["w8a8", "w8a16"])
@torch.no_grad()
def test_the_embedding_is_the_int8_head_rows_in_one_table_and_replays(fmt: str) -> None:
    model, data = _tied(), blocks(2, 16)
    marks = tensor_marks(model)
    step = quantize_model(model, {"lm_head": fmt}, None)
    unshared, before_mb = model(data), model_mb(model)
    assert why_not_shared(model) is None
    share_embedding(model)
    embedding, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embedding, SharedInt8Embedding)
    table = head.qweight.float() * head.scale.reshape(-1, 1)
    assert torch.equal(embedding(data), nn.functional.embedding(data, table))  # exactly the head's rows
    vocab, hidden = table.shape
    assert model_mb(model) == pytest.approx(before_mb - vocab * hidden * 4 / MB)  # the float table is gone
    out = model(data)
    assert 0 < float((out - unshared).norm() / unshared.norm()) < 0.02  # the table rounded to int8, no more
    tensors, aliases = changed_tensors(model, marks)
    assert not [k for k in (*tensors, *aliases) if k.startswith("model.embed_tokens")]  # saved once, as the head
    replayed = apply_state(_tied(), None, {"recipe": [step, shared_embedding_step()], "tensors": None}, None, "cpu")
    replayed.model.load_state_dict(tensors, strict=False)
    assert torch.equal(replayed.model(data), out)
    bf16 = replayed.model.to(torch.bfloat16)
    assert bf16.model.embed_tokens(data).dtype == torch.bfloat16  # the lookup follows the model's cast


@torch.no_grad()
def test_what_cannot_share_says_why() -> None:
    untied = tiny_decoder("llama")
    quantize_model(untied, {"lm_head": "w8a8"}, None)
    assert why_not_shared(untied) == "the model does not tie its embedding to its lm_head"
    assert "not int8 per output row" in why_not_shared(_tied())  # a float head shares the float table
    grouped = _tied()
    quantize_model(grouped, {"lm_head": "w4a16"}, None, group_size=32)
    assert "not int8 per output row" in why_not_shared(grouped)
    changed = _tied()
    quantize_model(changed, {"lm_head": "w8a8"}, None)
    changed.model.embed_tokens.weight[5] += 1.0  # the table moved after the head was quantized from it
    assert "not the embedding table rounded" in why_not_shared(changed)
    shared = _tied()
    quantize_model(shared, {"lm_head": "w8a8"}, None)
    assert why_not_shared(share_embedding(shared)) == "the embedding already reads the lm_head's rows"


@torch.no_grad()
def test_the_gguf_has_one_table_in_the_head_format_and_loads_back_tied(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from opus.export.gguf_mix import FILE, export_gguf
    from opus.models import load_model
    from tests.export.test_gguf_mix import K3, _data, _model, _settings, _types

    model = _model("llama", tie=True)
    quantize_model(model, {"lm_head": "w8a8"}, None)
    share_embedding(model)
    ours = model(_data())
    outcome = export_gguf(model, AutoTokenizer.from_pretrained(K3), {}, tmp_path, _settings())
    assert outcome.exported, outcome.reason
    types = _types(tmp_path / FILE)
    assert types["token_embd.weight"] == "Q8_0" and "output.weight" not in types
    loaded, _ = load_model({"gguf": str(tmp_path / FILE)})
    assert loaded.config.tie_word_embeddings
    theirs = loaded(_data())  # Q8_0's blocks of 32 round the int8 rows once more: close, not equal
    assert float((theirs - ours).norm() / ours.norm()) < 0.02


@torch.no_grad()
def test_the_hugging_face_export_writes_the_table_and_transformers_agrees(tmp_path: Path) -> None:
    from opus.export.hf_compressed import export_hf
    from opus.models import load_model
    from tests.export.test_hf_compressed import _settings, _tiny_llama

    source = _tiny_llama(tmp_path, tie=True)
    model, _ = load_model({"hf": str(source)}, Path("."))
    quantize_model(model, {"lm_head": "w8a8"}, None)
    share_embedding(model)
    outcome = export_hf(model, None, {}, tmp_path / "x", _settings({"hf": str(source)}))
    assert outcome.exported, outcome.reason
    assert outcome.metrics["hf_loads_in_transformers"] == 1, outcome.info.get("transformers_error")
    assert outcome.metrics["hf_next_token_agreement"] == 1.0


def test_the_quantize_stage_shares_the_k3_table_and_the_run_loads_it_so(tmp_path: Path) -> None:
    """K3's demo model ties its embedding: a plan with an int8 lm_head leaves one table, which the run's
    checkpoint rebuilds (``opus.load``)."""
    import yaml

    import opus
    from tests.helpers import summary

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({"groups": [{"name": "lm_head", "format": "w8a16",
                                                                     "modules": ["lm_head"]}]}))
    stages = [{"id": "plan", "uses": "plan", "with": {"plan_file": str(tmp_path / "plan.yaml")}},
              {"id": "quantize", "uses": "quantize", "needs": ["plan"]}]
    pipeline = repo / "pipelines" / "smoke.yaml"
    assert opus.run(pipeline, set={"stages": stages}, run_dir=tmp_path / "run", quiet=True)["status"] == "finished"
    quantize_row = summary(tmp_path / "run")["stages"][1]
    info = json.loads((tmp_path / "run" / "stages" / "01-quantize" / "result.json").read_text())["info"]
    assert info["tied_embedding"] == {"shared": True, "reason": None}
    model = opus.load(tmp_path / "run").model
    assert isinstance(model.model.embed_tokens, SharedInt8Embedding)
    assert model_mb(model) == pytest.approx(quantize_row["metrics"]["model_mb"])  # the stage measured what loads
    shape = model.lm_head.qweight.shape
    assert not [n for n, t in model.state_dict().items() if t.is_floating_point() and t.shape == shape]


@torch.no_grad()
def test_the_stage_keeps_the_float_table_when_told_or_when_the_head_stays_float() -> None:
    from stages.quantize import Config, _share_embedding

    class Log:  # the stage context's log, all _share_embedding asks of it
        def __init__(self) -> None:
            self.lines: list[str] = []

        def log(self, line: str) -> None:
            self.lines.append(line)

    model, log = _tied(), Log()
    step = quantize_model(model, {"lm_head": "w8a8"}, None)
    off = _share_embedding(log, Config(share_tied_embedding=False), model, step)
    assert off == {"shared": False, "reason": "share_tied_embedding is off"}
    assert isinstance(model.model.embed_tokens, nn.Embedding) and log.lines[-1].endswith("share_tied_embedding is off")
    float_head = _tied()
    kept = _share_embedding(log, Config(), float_head, quantize_model(float_head, {}, None))
    assert kept["shared"] is False and "stays float" in kept["reason"]
    assert _share_embedding(log, Config(), nn.Linear(2, 2), step)["reason"] == "not tied"  # no config at all

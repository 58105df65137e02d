"""The plan stage's end-to-end check runs the contenders as the pipeline's later stages may: with the
prefill compiled where the kv_config stage may keep a compiled prefill."""

from __future__ import annotations

import pytest
import torch
from fusion_project import make_project, prompts, tiny_lm

from opus.errors import InputError
from opus.pipeline.spec import load_pipeline
from opus.quant.validate import COMPILED
from opus.runtime.engine import generate
from stages import plan

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def request_for(tmp_path, kv_with: dict | None, runtime: str = "auto") -> dict:
    stages = [{"id": "plan", "uses": "plan"}]
    if kv_with is not None:
        stages.append({"id": "kv", "uses": "kv_config", "needs": ["plan"], "with": kv_with})
    tmp_path.mkdir(exist_ok=True)
    spec = load_pipeline(make_project(tmp_path, stages)).spec
    return plan._runtime_request(tiny_lm(), runtime, spec)


@torch.no_grad()
def test_a_kv_config_that_may_compile_the_prefill_has_the_check_compile_it(tmp_path) -> None:
    request = request_for(tmp_path, {"include_static_prefill": True, "static_attention": ["blocked"]})
    assert request["check_runtime"] == f"{COMPILED}, prefill compiled"
    assert request["compiled_kernels"]
    model, ids = tiny_lm(), prompts(2, 12)
    expected = generate(model, ids, 3).tokens
    fused, factory = request["check_prepare"](model, ids)
    cache = factory(2, 16)
    assert cache.prefills_itself and cache.attention == "sdpa"  # the same in every contender; fast to compile
    assert torch.equal(generate(fused, ids, 3, factory).tokens, expected)  # the same tokens, compiled


@pytest.mark.parametrize("kv_with", [None, {}, {"include_static_prefill": False}])
def test_without_a_compiled_prefill_to_keep_the_check_compiles_the_decode_steps_only(tmp_path, kv_with) -> None:
    request = request_for(tmp_path, kv_with)
    assert request["check_runtime"] == COMPILED
    _, factory = request["check_prepare"](tiny_lm(), prompts(2, 12))
    cache = factory(2, 16)
    assert not cache.prefills_itself and cache.attention == "sdpa"


def test_an_eager_runtime_readies_nothing(tmp_path) -> None:
    request = request_for(tmp_path, {"include_static_prefill": True}, runtime="eager")
    assert request == {"check_prepare": None, "check_runtime": "eager", "compiled_kernels": False}
    with pytest.raises(InputError, match="one of auto, compiled, eager"):
        request_for(tmp_path / "x", None, runtime="fast")

"""Mistral's sliding window: within it Opus's decoder is exact (test_parity); beyond it, refused, never wrong."""

from __future__ import annotations

import pytest
import torch
from opus_model_kit import VOCAB, GrowingCache, hf_logits, make_hf, save_hf

from opus.models import DecoderLM, config_from_hf, load_model
from opus.models.decoder import BeyondSlidingWindow, window_guard


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> tuple[object, DecoderLM]:
    ref = make_hf("mistral", sliding_window=8)
    model, _ = load_model({"hf": str(save_hf(ref, tmp_path_factory.mktemp("mistral")))})
    return ref, model


def _ids(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(5))


def test_the_window_is_read_for_the_families_that_have_one() -> None:
    ref = make_hf("mistral", sliding_window=8)
    assert config_from_hf(ref.config.to_dict()).sliding_window == 8
    assert config_from_hf({**ref.config.to_dict(), "sliding_window": None}).sliding_window is None
    mixtral = make_hf("mixtral", sliding_window=32)  # no longer refused: the same rule as Mistral
    assert config_from_hf(mixtral.config.to_dict()).sliding_window == 32
    assert config_from_hf(make_hf("llama").config.to_dict()).sliding_window is None


def test_exact_up_to_the_window(mistral) -> None:
    ref, model = mistral
    ids = _ids(8)
    with torch.no_grad():
        assert (model(ids) - hf_logits(ref, ids)).abs().max().item() < 1e-4
        cache = GrowingCache()
        steps = [model(ids[:, :5], cache=cache)] + [model(ids[:, p:p + 1], cache=cache, start_pos=p)
                                                    for p in range(5, 8)]
    assert (torch.cat(steps, 1) - hf_logits(ref, ids)).abs().max().item() < 1e-4


def test_beyond_the_window_is_refused_not_approximated(mistral) -> None:
    ref, model = mistral
    ids = _ids(9)
    with torch.no_grad():
        # transformers masks keys older than the window: full attention would differ, so Opus refuses.
        with pytest.raises(BeyondSlidingWindow, match="attention over 9 positions, beyond the model's sliding "
                                                      "window of 8") as err:
            model(ids)
        assert "\n" not in str(err.value)
        cache = GrowingCache()
        model(ids[:, :8], cache=cache)
        with pytest.raises(BeyondSlidingWindow):  # a decode step past the window, too
            model(ids[:, 8:9], cache=cache, start_pos=8)


def test_the_guard_is_an_fx_leaf(mistral) -> None:
    _, model = mistral
    gm = torch.fx.symbolic_trace(model, concrete_args={"cache": None, "start_pos": 0, "last_only": False})
    assert sum(n.target is window_guard for n in gm.graph.nodes) == model.config.num_layers
    ids = _ids(6)
    with torch.no_grad():
        assert torch.equal(gm(ids, None, 0, False), model(ids))
    with pytest.raises(BeyondSlidingWindow):
        gm(_ids(12), None, 0, False)

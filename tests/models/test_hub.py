"""``hf: org/name``: a hub id read from the local Hugging Face cache (opus.models.hub), never downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from opus_model_kit import hf_logits, make_hf

from opus.models import DecoderLM, ModelLoadError, load_model
from opus.models.hub import cached_snapshot, hub_cache_dir, looks_like_hub_id, resolve_hf_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root: Path, repo_id: str, model: object) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    model.save_pretrained(snapshot)  # type: ignore[attr-defined]
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.mark.parametrize("value, hub", [("org/name", True), ("Qwen/Qwen3-0.6B", True), ("a.b/c_d-1", True),
                                        ("models/k3", True), ("./org/name", False), ("../org/name", False),
                                        ("/abs/name", False), ("org/name/sub", False), ("name", False),
                                        ("org/../x", False), ("org/name.", False), ("org--x/name", False)])
def test_what_looks_like_a_hub_id(value: str, hub: bool) -> None:
    assert looks_like_hub_id(value) is hub


def test_the_cache_follows_the_environment(monkeypatch, tmp_path) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert hub_cache_dir() == tmp_path / "hfhome" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    assert hub_cache_dir() == tmp_path / "hubcache"


def test_a_cached_hub_id_loads_like_its_directory(monkeypatch, tmp_path) -> None:
    ref = make_hf("llama")
    cache = tmp_path / "hub"
    snapshot = fake_cache(cache, "tiny-org/tiny-llama", ref)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert cached_snapshot("tiny-org/tiny-llama") == snapshot
    assert resolve_hf_dir("tiny-org/tiny-llama", tmp_path / "elsewhere") == snapshot
    model, _ = load_model({"hf": "tiny-org/tiny-llama"}, base_dir=tmp_path / "elsewhere")
    assert isinstance(model, DecoderLM)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids) - hf_logits(ref, ids)).abs().max().item() < 1e-4
    written = sorted(p.name for p in (cache / "models--tiny-org--tiny-llama").iterdir())
    assert written == ["refs", "snapshots"]  # nothing added to the cache


def test_a_local_directory_wins_over_the_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    fake_cache(tmp_path / "hub", "org/name", make_hf("llama"))
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    assert resolve_hf_dir("org/name", tmp_path) == local


def test_an_uncached_hub_id_is_one_line_naming_the_cache(monkeypatch, tmp_path) -> None:
    cache = tmp_path / "empty-hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(ModelLoadError) as err:
        load_model({"hf": "org/absent"}, base_dir=tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and str(cache) in msg and "'org/absent'" in msg and "hf download org/absent" in msg
    # A value that is no hub id stays a missing directory.
    with pytest.raises(ModelLoadError, match="model directory not found"):
        load_model({"hf": "./org/absent"}, base_dir=tmp_path)

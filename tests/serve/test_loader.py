"""What ``opus serve`` takes from the run's KV-cache choice: compiled decode steps when the run chose them."""

from __future__ import annotations

from opus.serve.loader import compiled_choice

STATIC = {"kind": "static", "provider": "opus.kv.static", "compile": True, "slot_multiple": 128}


def test_compiled_steps_follow_the_runs_choice_per_batch_too() -> None:
    assert compiled_choice(STATIC)
    assert not compiled_choice({**STATIC, "compile": False}) and not compiled_choice({"kind": "growing"})
    assert not compiled_choice(None)
    # SmolLM2's run chose a static compiled cache at batch 1 and at its batch: served eagerly before the fix.
    by_batch = {"kind": "by_batch", "rules": [{"up_to": 1, "cache": {**STATIC, "attention": "blocked"}},
                                              {"cache": STATIC}]}
    assert compiled_choice(by_batch)
    assert not compiled_choice({"kind": "by_batch", "rules": [{"up_to": 1, "cache": {"kind": "growing"}},
                                                              {"cache": {"kind": "pooled"}}]})

"""The serving engine in process: continuous batching gives each request exactly what it would get alone."""

from __future__ import annotations

import time

import pytest
import torch

from opus.serve.scheduler import QueueFull, TooLong
from tests.serve.serve_kit import Collector, make_engine, reference, tiny_decoder

PROMPTS = [[5, 17, 3, 44, 9], [1, 2, 3], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80], [8], [5, 17, 3, 44, 9, 60, 61]]


def _serve(engine, prompts, new, stagger_s=0.0, **kw):
    collect = Collector(len(prompts))
    engine.start()
    try:
        for index, prompt in enumerate(prompts):
            engine.submit(collect.request(index, prompt, new, **kw))
            time.sleep(stagger_s)
        assert collect.done.wait(60), f"unfinished: {collect.reasons}"
    finally:
        engine.stop(10)
    return collect


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_requests_batched_at_different_positions_get_what_they_would_alone(moe: bool) -> None:
    """Five prompts of different lengths, arriving while others decode, through a batch of 4 (one waits
    for a row) and prefill chunks of 4 tokens: every request's greedy tokens equal a lone generate()."""
    model = tiny_decoder(moe)
    engine = make_engine(model, max_batch=4, prefill_chunk=4)
    got = _serve(engine, PROMPTS, 12, stagger_s=0.003)
    for index, prompt in enumerate(PROMPTS):
        assert got.tokens[index] == reference(model, prompt, 12), index
        assert got.reasons[index] == "length"
    assert engine.blocks.used == 0, "every block went back (cached prefixes are evictable, not used)"


def _step(engine, model) -> list[tuple[int, int]]:
    """One engine step run by hand: its forwards as (rows, tokens), in order."""
    shapes: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(lambda _m, args, _kw: shapes.append(tuple(args[0].shape)),
                                           with_kwargs=True)
    try:
        with torch.inference_mode():
            engine.step()
    finally:
        hook.remove()
    return shapes


def test_each_step_spends_a_token_budget_decode_first_and_equal_chunks_run_as_one_forward() -> None:
    """Two 8-token prompts in chunks of 4 run as one [2, 4] forward a step; a 20-token prompt that arrives
    while two requests decode gets what the two decode rows leave of the 8-token budget (6, 6, 6, 2), a
    decode step after each chunk; and every request still gets exactly what it would alone."""
    model = tiny_decoder()
    engine = make_engine(model, max_batch=4, prefill_chunk=4, step_tokens=8)
    first, late = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28]], list(range(40, 60))
    collect = Collector(3)
    for index, prompt in enumerate(first):
        engine.submit(collect.request(index, prompt, 9))
    assert _step(engine, model) == [(2, 4)]  # both prompts' first chunks in one forward
    assert _step(engine, model) == [(2, 4), (2, 1)]  # their last chunks, then both decoded together
    engine.prefill_chunk = 8
    engine.submit(collect.request(2, late, 4))
    steps = [_step(engine, model) for _ in range(4)]
    assert steps == [[(1, 6), (2, 1)], [(1, 6), (2, 1)], [(1, 6), (2, 1)], [(1, 2), (4, 1)]]  # 3 rows: bucket 4
    while len(collect.reasons) < 3:
        _step(engine, model)
    assert collect.tokens[0] == reference(model, first[0], 9) and collect.tokens[1] == reference(model, first[1], 9)
    assert collect.tokens[2] == reference(model, late, 4)


def test_a_step_budget_no_larger_than_the_batch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"step_tokens \(4\) must exceed max_batch \(4\)"):
        make_engine(tiny_decoder(), max_batch=4, step_tokens=4)


def test_a_shared_prompt_prefix_is_read_from_the_prefix_cache() -> None:
    model = tiny_decoder()
    shared = list(range(10, 30))  # five blocks of 4
    prompts = [shared + [40, 41], shared + [50]]
    engine = make_engine(model, block_size=4)
    first = _serve(engine, prompts[:1], 6)
    assert engine.blocks.hits == 0
    second_engine_run = Collector(1)
    engine.start()
    engine.submit(second_engine_run.request(0, prompts[1], 6))
    assert second_engine_run.done.wait(60)
    engine.stop(10)
    # The second prompt's first 20 tokens are five full blocks; its last token is always computed.
    assert engine.blocks.hits == 20
    assert first.tokens[0] == reference(model, prompts[0], 6)
    assert second_engine_run.tokens[0] == reference(model, prompts[1], 6)


def test_eos_ends_a_request_and_stop_ids_can_be_ignored() -> None:
    model = tiny_decoder()
    alone = reference(model, PROMPTS[0], 8)
    eos = alone[2]
    engine = make_engine(model)
    got = _serve(engine, [PROMPTS[0], PROMPTS[0]], 8)  # no stop ids: both run to max_tokens
    engine = make_engine(model)
    collect = Collector(2)
    engine.start()
    engine.submit(collect.request(0, PROMPTS[0], 8, stop_ids=frozenset({eos})))
    engine.submit(collect.request(1, PROMPTS[0], 8))
    assert collect.done.wait(60)
    engine.stop(10)
    first_eos = alone.index(eos)
    assert collect.tokens[0] == alone[: first_eos + 1] and collect.reasons[0] == "stop"
    assert collect.tokens[1] == alone == got.tokens[0] and collect.reasons[1] == "length"


def test_cancelled_requests_free_their_blocks_and_others_go_on() -> None:
    model = tiny_decoder()
    engine = make_engine(model, max_batch=2, prefix_caching=False)
    collect = Collector(2)
    engine.start()
    long_one = collect.request(0, PROMPTS[2], 200)
    engine.submit(long_one)
    engine.submit(collect.request(1, PROMPTS[1], 6))
    deadline = time.time() + 30
    while len(collect.tokens[0]) < 3 and time.time() < deadline:
        time.sleep(0.005)
    engine.cancel(long_one)
    assert collect.done.wait(60)
    engine.stop(10)
    assert collect.reasons == {0: "cancelled", 1: "length"}
    assert 3 <= len(collect.tokens[0]) < 200
    assert collect.tokens[1] == reference(model, PROMPTS[1], 6)
    assert engine.blocks.used == 0 and engine.blocks.free == engine.blocks.usable


def test_limits_refuse_what_can_never_run_and_a_full_queue() -> None:
    model = tiny_decoder()
    engine = make_engine(model, num_blocks=9, block_size=4, max_waiting=1)  # 8 usable blocks: 32 tokens
    with pytest.raises(TooLong, match="256 tokens"):
        engine.check(250, 10)  # beyond the model's context
    with pytest.raises(TooLong, match="KV blocks"):
        engine.check(20, 20)  # within the context, beyond the pool
    collect = Collector(2)
    engine.submit(collect.request(0, [1, 2], 4))  # not started: it waits
    with pytest.raises(QueueFull, match="limit 1"):
        engine.submit(collect.request(1, [1, 2], 4))


def test_sampling_follows_the_seed() -> None:
    from opus.runtime.engine import Sampling

    model = tiny_decoder()
    runs = []
    for _ in range(2):
        engine = make_engine(model)
        runs.append(_serve(engine, [PROMPTS[0], PROMPTS[0]], 10,
                           sampling=Sampling(temperature=1.5, top_p=0.9, seed=7)).tokens)
    assert runs[0] == runs[1]
    assert runs[0][0] == runs[0][1]  # same seed, same prompt, batched together: the same tokens
    assert runs[0][0] != reference(model, PROMPTS[0], 10)


def test_compiled_decode_steps_give_the_eager_tokens() -> None:
    """The compiled step (one graph per batch bucket, the key length dynamic) against the eager step."""
    from torch._dynamo.utils import counters

    model = tiny_decoder()
    results = {}
    for compiled in (False, True):
        engine = make_engine(model, max_batch=2, compile_decode=compiled)
        engine.steps.warm_up(engine.blocks.block_size)
        graphs = counters["stats"]["unique_graphs"]
        results[compiled] = _serve(engine, PROMPTS[:3], 10, stagger_s=0.002).tokens
        assert not engine.steps.notes, engine.steps.notes
        # Warmed up, serving compiles nothing more: every key count and batch in its bucket's graph.
        assert counters["stats"]["unique_graphs"] == graphs
    assert results[True] == results[False]


def test_opus_serve_refuses_a_step_budget_no_larger_than_its_batch_in_one_line(tmp_path, capsys) -> None:  # noqa: ANN001
    from opus.cli.main import main

    assert main(["serve", str(tmp_path), "--max-batch", "8", "--step-tokens", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step-tokens must exceed --max-batch (8)" in err[0]

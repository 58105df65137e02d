"""``OpusLM``: the harness's requests answered by Opus's model, and ``opus lm-eval`` on a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opus.harness.lm import OpusLM
from opus.kv.cache import cache_factory
from opus.models import load_model
from opus.runtime.engine import full_logits, generate
from tests.conftest import REPO

pytestmark = pytest.mark.usefixtures("one_thread")
CODE = (REPO / "examples" / "k3" / "data" / "heldout" / "abc.py.txt").read_text()[:1500]


class Request:  # the harness's Instance, as far as a model class reads it
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def k3() -> OpusLM:
    model, tokenizer = load_model({"hf": str(REPO / "examples" / "k3" / "model")})
    return OpusLM.of(model, tokenizer, batch_size=3)


def test_rolling_loglikelihood_is_the_models_own_sum(k3: OpusLM) -> None:
    ids = k3.tok_encode(CODE)
    inputs = torch.tensor([[k3.prefix_token_id, *ids]])
    logprobs = full_logits(k3.model, inputs).float().log_softmax(-1)[0, :-1]
    expected = logprobs.gather(1, inputs[0, 1:, None]).sum().item()
    assert k3.loglikelihood_rolling([Request(CODE)])[0] == pytest.approx(expected, rel=1e-5)
    k3.max_length = 64  # windows of 64 tokens: every token is still scored once
    try:
        windowed = k3.loglikelihood_rolling([Request(CODE)])[0]
    finally:
        k3.max_length = 2048
    assert windowed < 0 and windowed != pytest.approx(expected, rel=1e-3)  # less context, another sum


def test_batched_scores_equal_one_at_a_time_and_greedy_is_the_models_choice(k3: OpusLM) -> None:
    prompt = CODE[:400]
    greedy = generate(k3.model, torch.tensor([k3.tok_encode(prompt)]), 6).tokens[0].tolist()
    continuation = k3.tok_decode(greedy)
    requests = [Request(prompt, continuation), Request(prompt, " zzz qqq"), Request(CODE[:90], "\n    def"),
                Request(CODE[:200], " return"), Request("", "import os")]
    batched = k3.loglikelihood(requests)
    k3.batch_size = 1
    try:
        alone = k3.loglikelihood(requests)
    finally:
        k3.batch_size = 3
    for (a, ga), (b, gb) in zip(batched, alone):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
    assert batched[0][1] and not batched[1][1] and batched[0][0] > batched[1][0]


def test_choices_of_one_context_share_its_prefill_and_score_as_if_alone(k3: OpusLM) -> None:
    context = CODE[:300]
    choices = ["\n    def f(self):", " = 1", "\n", " import os\nimport sys\nimport re"]
    shared = k3.loglikelihood([Request(context, c) for c in choices])
    pairs = [k3._encode_pair(context, c) for c in choices]
    alone = k3.score_rows([k3._window(c, t) for c, t in pairs], [t for _, t in pairs])  # cache-less, batched
    for (a, ga), (b, gb) in zip(shared, alone):
        assert a == pytest.approx(b, abs=1e-3) and ga == gb
    assert len({round(a, 3) for a, _ in shared}) == 4


def test_generation_stops_at_the_stop_sequence_and_matches_the_engine(k3: OpusLM) -> None:
    prompt = "class A:\n    def __init__(self):\n"
    kwargs = {"until": ["\n"], "max_gen_toks": 40, "do_sample": False}
    text = k3.generate_until([Request(prompt, kwargs)])[0]
    engine = generate(k3.model, torch.tensor([k3.tok_encode(prompt)]), 40, cache_factory(k3.model)).tokens[0]
    full = k3.tok_decode(engine.tolist())
    assert "\n" not in text and full.startswith(text) and full[len(text)] == "\n"
    longer = k3.generate_until([Request(prompt, {"until": ["never"], "max_gen_toks": 12})])[0]
    assert longer == k3.tok_decode(engine[:12].tolist())


def test_opus_lm_eval_runs_the_shipped_tasks_on_a_run(smoke_run, tmp_path: Path) -> None:
    """``lm_eval`` as its users run it, model class opus, from another directory: the tasks' data resolve."""
    tasks = REPO / "examples" / "k3" / "tasks"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    names = f"{tasks}/k3_word_order.yaml,{tasks}/k3_line_end.yaml"
    done = subprocess.run([sys.executable, "-m", "opus.cli.main", "lm-eval", "--model", "opus", "--model_args",
                           f"path={smoke_run.run_dir}", "--tasks", names, "--limit", "20", "--output_path",
                           str(tmp_path / "out")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "k3_word_order" in done.stdout and "exact_match" in done.stdout
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    # The trained K3 tells its code's word order from shuffles; a broken model would be near 1 in 4.
    assert results["k3_word_order"]["acc,none"] >= 0.8
    assert 0 <= results["k3_line_end"]["exact_match,none"] <= 1


def test_opus_lm_eval_needs_a_path() -> None:
    done = subprocess.run([sys.executable, "-m", "opus.cli.main", "lm-eval", "--model", "opus", "--tasks",
                           "hellaswag"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0

"""The serving benchmark: its percentiles and counts, a server that will not start, the load generator
against llama-cpp-python's real server on a tiny GGUF (skipped without llama-cpp-python[server]), and
``opus bench --serve``'s input errors."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from opus.cli.main import main
from opus.errors import EXIT_INVALID
from opus.runtime.serve_load import (
    LevelRun,
    RequestResult,
    make_client,
    one_request,
    percentile,
    plan_levels,
    run_level,
    summarize,
)
from opus.runtime.server_process import Server, ServerError, free_port

HAS_LLAMA_SERVER = all(importlib.util.find_spec(m) for m in ("llama_cpp", "sse_starlette", "openai"))
NEEDS_LLAMA_SERVER = pytest.mark.skipif(not HAS_LLAMA_SERVER, reason="llama-cpp-python[server] or openai is not "
                                        "installed (pip install 'opus[llama]')")
PROMPTS = ["def main import os sys print", "return value self class if", "else for in range list dict"]


def test_percentile_on_known_inputs() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([5, 1, 4, 2, 3], 50) == 3
    assert percentile([1, 2, 3, 4, 5], 99) == pytest.approx(4.96)
    assert percentile([10, 20], 25) == pytest.approx(12.5)
    values = np.random.default_rng(0).exponential(size=101).tolist()
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summary_counts_tokens_errors_and_rates() -> None:
    first = LevelRun([RequestResult(True, ttft_s=0.010, itl_s=[0.001, 0.003], tokens=3, chunks=3),
                      RequestResult(True, ttft_s=0.030, itl_s=[0.002], tokens=2, chunks=2),  # short: 2 of 3
                      RequestResult(False, "APIConnectionError: refused")], wall_s=0.5)
    second = LevelRun([RequestResult(False, "APIStatusError: 429"),
                       RequestResult(True, ttft_s=0.020, itl_s=[0.004, 0.005], tokens=3, chunks=3)], wall_s=0.1)
    level = summarize([first, second], concurrency=2, max_tokens=3)
    assert (level.rounds, level.requests, level.ok, level.errors, level.short) == (2, 5, 3, 2, 1)
    assert level.first_error == "APIConnectionError: refused"
    assert level.output_tokens == 8 and level.wall_s == pytest.approx(0.6)
    assert level.output_tok_s == pytest.approx((10 + 30) / 2) and level.output_tok_s_range == (10, 30)
    assert level.requests_s == pytest.approx((4 + 10) / 2)  # completed requests only
    assert level.ttft_ms_p50 == pytest.approx(20.0) and level.ttft_ms_p99 == pytest.approx(29.8)  # every round's
    assert level.itl_ms_p50 == pytest.approx(3.0) and level.itl_ms_p99 == pytest.approx(4.96)
    assert first.ttft_ms_p99 == pytest.approx(29.8) and second.output_tok_s == pytest.approx(30)


def test_ratios_pair_the_rounds_both_servers_ran() -> None:
    from opus.bench.serve_run import paired_ratios

    def run(tokens: int, ttft_s: float) -> LevelRun:  # one request per pass, one second of wall time
        return LevelRun([RequestResult(True, ttft_s=ttft_s, tokens=tokens)], wall_s=1.0)

    opus = {0: run(100, 0.010), 1: run(120, 0.010), 2: run(90, 0.020)}
    llama = {0: run(50, 0.020), 1: run(60, 0.020), 3: run(10, 0.001)}  # round 2 missing, round 3 unpaired
    ratios = paired_ratios(opus, llama)
    assert ratios["paired_rounds"] == 2
    assert ratios["output_tok_s"] == pytest.approx(2.0) and ratios["output_tok_s_range"] == [2.0, 2.0]
    assert not ratios["output_tok_s_noisy"] and ratios["ttft_ms_p99"] == pytest.approx(0.5)
    wide = paired_ratios({0: run(100, 0.01), 1: run(100, 0.01)}, {0: run(100, 0.01), 1: run(80, 0.01)})
    assert wide["output_tok_s"] == pytest.approx(1.125) and wide["output_tok_s_noisy"]  # [1.0, 1.25]
    assert paired_ratios({}, llama) == {"paired_rounds": 0, "output_tok_s": None, "output_tok_s_range": None,
                                        "output_tok_s_noisy": False, "ttft_ms_p99": None, "ttft_ms_p99_range": None,
                                        "ttft_ms_p99_noisy": False}


def test_a_sweep_gives_every_request_and_warm_up_its_own_prompt() -> None:
    levels, total = plan_levels([1, 2, 4], lambda c: 2 * c)
    assert [(lv.concurrency, lv.requests, lv.first_prompt) for lv in levels] == [(1, 2, 0), (2, 4, 3), (4, 8, 9)]
    assert total == 21  # 14 timed requests and 7 warm-up requests
    levels, total = plan_levels([1, 2], lambda c: 2 * c, rounds=3)
    assert [levels[1].first(r) for r in range(3)] == [9, 15, 21] and total == 27


def test_errors_counted_when_the_server_is_down() -> None:
    port = free_port()  # nothing listens there
    run = asyncio.run(run_level(f"http://127.0.0.1:{port}", "m", PROMPTS, 4, concurrency=2, requests=5))
    level = summarize([run], 2, 4)
    assert (level.requests, level.ok, level.errors, level.output_tokens) == (5, 0, 5, 0)
    assert level.first_error and "Connection" in level.first_error
    assert level.ttft_ms_p99 is None and level.output_tok_s == 0


def test_a_server_that_dies_is_an_error_with_its_log(tmp_path) -> None:
    code = "import sys; print('model file is broken'); sys.exit(3)"
    server = Server("llama.cpp", [sys.executable, "-c", code], free_port(), "/v1/models", tmp_path / "s.log")
    with pytest.raises(ServerError, match=r"exited with code 3(.|\n)*model file is broken"):
        server.start(timeout_s=30)


def test_serve_options_are_checked_before_anything_starts(tmp_path, capsys) -> None:
    assert main(["bench", "--serve", str(tmp_path), "--concurrency", "1,x"]) == EXIT_INVALID
    assert "--concurrency" in capsys.readouterr().err
    assert main(["bench", "--serve", str(tmp_path), "--only", "fp32"]) == EXIT_INVALID
    assert "--only: does not apply" in capsys.readouterr().err
    assert main(["bench", "--serve", str(tmp_path), "--output-len", "0"]) == EXIT_INVALID
    assert main(["bench", "--serve", str(tmp_path)]) == EXIT_INVALID  # not a run directory
    assert "no run.json" in capsys.readouterr().err


def test_prompts_are_windows_of_the_pipeline_s_text_at_distinct_offsets(tmp_path) -> None:
    from opus.bench.target import resolve_target
    from opus.runtime.serve_prompts import pipeline_tokenizer, serve_prompts
    from tests.bench.project import make_project

    target = resolve_target(make_project(tmp_path), tmp_path / "runs")
    spec, base = target.loaded.spec, target.loaded.base_dir
    tokenizer = pipeline_tokenizer(spec, base, target.loaded.path)
    prompts, source = serve_prompts(spec.data, base, tokenizer, 40, 16)
    assert len(prompts) == 40 and len(set(prompts)) == 40 and "40 16-token windows at distinct offsets" in source
    assert all(abs(len(tokenizer(p)["input_ids"]) - 16) <= 2 for p in prompts)  # text again: about 16 tokens
    again, _ = serve_prompts(spec.data, base, tokenizer, 40, 16)
    assert again == prompts  # seeded: the same prompts for every server and every bench
    few, source = serve_prompts(spec.data, base, tokenizer, 10_000, 200)  # the text has fewer than 10 000 windows
    assert len(few) < 10_000 and "in turn" in source


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """The tiny bench project's Llama as a float GGUF (Opus's writer, as the export stage writes it)."""
    from opus.export.gguf_mix import export_gguf
    from opus.export.settings import ExportSettings
    from opus.models import load_model
    from tests.bench.project import make_project

    root = tmp_path_factory.mktemp("serve")
    make_project(root)
    model, tokenizer = load_model({"hf": str(root / "model")}, root)
    outcome = export_gguf(model, tokenizer, {}, root / "export", ExportSettings(source={"hf": "model"}, base_dir=root))
    assert outcome.exported, outcome.reason
    return root / "export" / str(outcome.path)


@pytest.fixture(scope="module")
def llama_server(tiny_gguf, tmp_path_factory):  # noqa: ANN201 - a fixture
    from opus.bench.serve_servers import llamacpp_server

    server = llamacpp_server(tiny_gguf, threads=1, n_ctx=128, log_dir=tmp_path_factory.mktemp("logs"))
    with server.start(timeout_s=120):
        yield server


@NEEDS_LLAMA_SERVER
def test_load_generator_against_llama_cpp_server(llama_server) -> None:
    assert llama_server.extra_body["logit_bias"] == {"0": -1e9}  # <|endoftext|>, the tiny vocabulary's only EOG
    run = asyncio.run(run_level(llama_server.url, llama_server.model, PROMPTS, 12, concurrency=2, requests=5,
                                extra_body=llama_server.extra_body))
    level = summarize([run], 2, 12)
    assert (level.requests, level.ok, level.errors, level.short) == (5, 5, 0, 0), level.first_error
    assert level.output_tokens == 5 * 12 and level.tokens_counted_by == "chunks"  # no usage in its stream
    assert 0 < level.ttft_ms_p50 <= level.ttft_ms_p99 < level.wall_s * 1000
    assert level.itl_ms_p50 is not None and level.output_tok_s == pytest.approx(60 / level.wall_s)


@NEEDS_LLAMA_SERVER
def test_streamed_tokens_equal_the_server_s_usage(llama_server) -> None:
    """What the stream delivered, counted chunk by chunk, is what the server says it generated for the same
    greedy request without streaming; a server made to stop at once delivers no token and that is an error."""
    async def both(extra_body: dict) -> tuple[RequestResult, Any]:
        client = make_client(llama_server.url)
        try:
            streamed = await one_request(client, llama_server.model, PROMPTS[0], 9, extra_body)
            whole = await client.completions.create(model=llama_server.model, prompt=PROMPTS[0], max_tokens=9,
                                                    temperature=0.0, extra_body=extra_body)
            return streamed, whole.usage
        finally:
            await client.close()

    streamed, usage = asyncio.run(both(llama_server.extra_body))
    assert streamed.ok and streamed.tokens == usage.completion_tokens == 9 and len(streamed.itl_s) == 8
    assert llama_server.count_tokens(PROMPTS[0]) == usage.prompt_tokens  # what the bench reports of its prompts
    stopped, usage = asyncio.run(both({"logit_bias": {"0": 1e9}}))  # end of text forced first
    assert usage.completion_tokens == 0 and not stopped.ok and stopped.error == "the stream ended without a token"


HAS_OPUS_SERVER = all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "opus.cli.serve"))


@NEEDS_LLAMA_SERVER
@pytest.mark.skipif(not HAS_OPUS_SERVER, reason="opus serve (opus.cli.serve, fastapi, uvicorn) is not here")
def test_bench_serve_end_to_end_on_the_smoke_run(smoke_run, tmp_path, capsys, monkeypatch) -> None:
    """``opus bench --serve`` on the session's smoke run (K3, every stage, its GGUF exported): both servers
    started, two levels in two rounds each, every request answered at its fixed length, the files written."""
    from opus.bench import serve_run

    # llama-cpp-python's server here (a llama-server binary on this machine is another test's subject).
    monkeypatch.setattr(serve_run, "find_llama_server", lambda given: None)
    assert smoke_run.summary is not None and smoke_run.summary["status"] == "finished", smoke_run.result.tail()
    out = tmp_path / "out"
    assert main(["bench", "--serve", str(smoke_run.run_dir), "--concurrency", "1,2", "--requests", "2", "--rounds",
                 "2", "--input-len", "24", "--output-len", "6", "--threads", "1", "--eager", "--out", str(out),
                 "--format", "json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads((out / "serve.json").read_text()) == report
    assert (out / "serve.png").read_bytes()[:4] == b"\x89PNG" and "| 2 | opus |" in (out / "serve.md").read_text()
    for name, counted in (("opus", "usage"), ("llama.cpp", "chunks")):
        server = report["servers"][name]
        for level in server["levels"]:
            assert (level["rounds"], level["requests"], level["ok"], level["short"]) == (2, 4, 4, 0), level
            assert level["output_tokens"] == 4 * 6 and level["tokens_counted_by"] == counted
            assert 0 < level["ttft_ms_p50"] <= level["ttft_ms_p99"] and level["itl_ms_p50"] is not None
        assert Path(server["log"]).is_file()
    assert report["servers"]["opus"]["exit_code"] == 0  # SIGTERM drains and exits 0
    assert any("the run's export" in note for note in report["servers"]["llama.cpp"]["notes"])
    for name in ("opus", "llama.cpp"):  # how long the prompts were in each server's own tokenizer
        assert any(note.startswith("prompts in its tokenizer: median") for note in report["servers"][name]["notes"])
    for ratio in report["ratios"]:
        assert ratio["orders"] == [["opus", "llama.cpp"], ["llama.cpp", "opus"]]  # the first server alternates
        assert ratio["paired_rounds"] == 2 and ratio["output_tok_s"] > 0 and ratio["ttft_ms_p99"] > 0
    assert report["machine"]["threads"] == 1 and "load" in report["environment"]


def test_llama_server_is_found_or_said_missing(tmp_path, monkeypatch) -> None:
    """llama.cpp's own server: --llama-server, else on the PATH, else what `make llama-server` built; its
    command serves one slot per client with continuous batching and asks for fixed lengths with ignore_eos."""
    from opus.bench import serve_servers

    with pytest.raises(ServerError, match="no such file"):
        serve_servers.find_llama_server(tmp_path / "nope")
    monkeypatch.setenv("OPUS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert serve_servers.find_llama_server(None) is None
    built = serve_servers.built_llama_server()
    built.parent.mkdir(parents=True)
    built.write_text("")
    assert serve_servers.find_llama_server(None) == built
    (tmp_path / "bin").mkdir()
    on_path = tmp_path / "bin" / "llama-server"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert serve_servers.find_llama_server(None) == on_path
    server = serve_servers.llama_server(on_path, tmp_path / "m.gguf", 2, 700, 8, tmp_path)
    flags = server.command
    assert flags[flags.index("--parallel") + 1] == "8" and flags[flags.index("--ctx-size") + 1] == str(700 * 8)
    assert "--cont-batching" in flags and server.extra_body == {"ignore_eos": True}
    assert (server.ready_path, server.count_path, server.count_style) == ("/health", "/tokenize", "tokens")


def test_a_llama_server_that_crashed_at_its_defaults_runs_again_without_repacking(tmp_path) -> None:
    import subprocess

    from opus.bench import serve_servers

    binary = tmp_path / "llama-server"
    server = serve_servers.llama_server(binary, tmp_path / "m.gguf", 2, 256, 4, tmp_path)
    assert serve_servers.without_repacking(server) is None  # never started: nothing to retry
    server.process = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    server.process.wait()
    again = serve_servers.without_repacking(server)
    assert again is not None and again.command[-1] == "--no-repack" and "--no-repack" in again.notes[-1]
    assert again.command[again.command.index("--port") + 1] == str(again.port)
    assert serve_servers.without_repacking(again) is None  # once only

"""``opus serve`` as a client meets it: a real server process on a free port, driven by the openai package."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from opus.runtime.server_process import Server, free_port

# A minimal chat template: the K3 demo's tokenizer has none (the server then refuses chat requests).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


# The module's server requires an API key, as a server more than one person reaches should.
API_KEY = "sk-opus-test-" + "0123456789abcdef"


def _server(path: Path, log: Path, *flags: str, api_key: str | None = None) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "opus.cli.main", "serve", str(path), "--port", str(port), "--threads", "1",
               *flags, *(["--api-key", api_key] if api_key else [])]
    return Server("opus", command, port, "/health", log, api_key=api_key).start(timeout_s=180)


def _post(server: Server, path: str, body: bytes) -> urllib.request.Request:
    return urllib.request.Request(server.url + path, body, {"Content-Type": "application/json", **server.headers})


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def server(smoke_run, tmp_path_factory):
    assert smoke_run.summary is not None and smoke_run.summary["status"] == "finished", smoke_run.result.tail()
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(TEMPLATE)
    srv = _server(smoke_run.run_dir, template.parent / "serve.log", "--eager", "--max-batch", "2", "--max-waiting",
                  "4", "--chat-template", str(template), "--max-body-kb", "64", api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(smoke_run):
    import opus

    return opus.load(smoke_run.run_dir, eager=True)  # as the server runs (--eager): no compile per prompt shape


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key or "none", max_retries=0, timeout=120)


def _metrics(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(urllib.request.Request(server.url + "/metrics", headers=server.headers),
                                timeout=10) as response:
        text = response.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(opus_[\w{}=\"]+) ([-\d.e+]+)$", text, re.M)}


def test_completion_is_what_the_run_generates(server, reference) -> None:
    client = _client(server)
    assert [m.id for m in client.models.list().data] == [server.model]
    prompt = "Once upon a time"
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    expected = reference.generate(prompt, max_new_tokens=12, stop_at_eos=False)
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(reference.encode(prompt)) and out.usage.completion_tokens == 12


def test_streaming_sends_the_same_text_in_chunks_and_ends_with_done(server, reference) -> None:
    client = _client(server)
    chunks = list(client.completions.create(model=server.model, prompt="The cat", max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference.generate("The cat", max_new_tokens=10, stop_at_eos=False)
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    body = json.dumps({"prompt": "The cat", "max_tokens": 3, "stream": True}).encode()
    raw = _post(server, "/v1/completions", body)
    with urllib.request.urlopen(raw, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.read().decode().splitlines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_concurrent_requests_each_get_their_own_answer(server, reference) -> None:
    """Four clients at once on a batch of two (two or more wait; the queue holds four): each gets what the
    run generates for it alone."""
    client = _client(server)
    prompts = ["Once upon a time", "The little dog", "She said", "In the morning the"]

    def ask(prompt: str) -> str:
        return client.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == [reference.generate(p, max_new_tokens=16, stop_at_eos=False) for p in prompts]


def test_a_stop_string_ends_the_text_before_it(server, reference) -> None:
    full = reference.generate("Once upon a time", max_new_tokens=20, stop_at_eos=False)
    word = re.search(r"[A-Za-z]{2,}", full[4:])
    assert word is not None, full
    stop = word.group()
    out = _client(server).completions.create(model=server.model, prompt="Once upon a time", max_tokens=20,
                                             temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_chat_completion_through_the_template(server) -> None:
    client = _client(server)
    out = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hello"}],
                                         max_tokens=6, temperature=0, seed=1)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    stream = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, temperature=0, stream=True)
    deltas = list(stream)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == out.choices[0].message.content


def test_bad_requests_are_400_with_an_openai_error_body(server) -> None:
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=server.model, prompt="hi " * 10, max_tokens=100000)
    message = too_long.value.body["message"]
    assert "max_tokens is 100000" in message and "context of" in message
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.completions.create(model=server.model, prompt="hi", n=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi")
    for body in (b"{not json", b'{"max_tokens": 3}', b'{"prompt": "hi", "temperature": "hot"}'):
        request = _post(server, "/v1/completions", body)
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request, timeout=30)
        assert error.value.code == 400
        assert json.loads(error.value.read())["error"]["type"] == "invalid_request_error"


def test_without_the_api_key_every_route_but_health_is_401(server) -> None:
    for key in ("none", API_KEY[:-1]):
        stranger = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as refused:
            stranger.completions.create(model=server.model, prompt="hi", max_tokens=2)
        assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    for path in ("/metrics", "/v1/models"):
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(server.url + path, timeout=10)  # no Authorization header at all
        assert error.value.code == 401 and error.value.headers["WWW-Authenticate"] == "Bearer"
        assert json.loads(error.value.read())["error"]["type"] == "invalid_request_error"
    with urllib.request.urlopen(server.url + "/health", timeout=10) as response:  # what a load balancer probes
        assert response.status == 200


def _headers_only(server: Server, **headers: str) -> tuple[int, dict]:
    """A POST's headers and no body: the refusal comes before any upload, so it cannot race one."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.putrequest("POST", "/v1/completions")
        for name, value in {"Content-Type": "application/json", **server.headers, **headers}.items():
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_a_body_over_the_limit_or_without_a_length_is_refused(server) -> None:
    status, body = _headers_only(server, **{"Content-Length": str(64 * 1024 + 1)})
    assert status == 413 and "is 65537 bytes; this server accepts at most 65536" in body["error"]["message"]
    status, body = _headers_only(server)  # no length declared (a chunked upload would be the same)
    assert status == 411 and "Content-Length" in body["error"]["message"]


def test_a_full_queue_is_429_with_retry_after(server) -> None:
    """Batch 2, queue 4: of eight long requests at once, some are refused; the rest finish."""
    def ask(_: int) -> int:
        body = json.dumps({"prompt": "Once", "max_tokens": 600, "ignore_eos": True, "temperature": 0}).encode()
        request = _post(server, "/v1/completions", body)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            assert exc.headers["Retry-After"] == "1"
            assert json.loads(exc.read())["error"]["type"] == "rate_limit_error"
            return exc.code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(ask, range(8)))
    # The first four always find room in the queue; which others do depends on when the engine admits them.
    assert codes.count(429) >= 1 and codes.count(200) >= 4 and set(codes) == {200, 429}, codes


def test_a_client_that_goes_away_frees_its_blocks_and_metrics_show_it(server) -> None:
    client = _client(server)
    before = _metrics(server)
    stream = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=400,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for index, _chunk in enumerate(stream):
        if index == 3:
            break
    assert _metrics(server)["opus_kv_blocks_used"] > 0
    stream.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        now = _metrics(server)
        if now["opus_kv_blocks_used"] == 0 and now["opus_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert now["opus_kv_blocks_used"] == 0 and now["opus_requests_running"] == 0
    assert now["opus_generation_tokens_total"] - before["opus_generation_tokens_total"] < 400
    assert now["opus_time_to_first_token_seconds_count"] > before["opus_time_to_first_token_seconds_count"]
    assert now["opus_inter_token_latency_seconds_count"] > 0 and now["opus_prompt_tokens_total"] > 0
    assert now["opus_kv_blocks_total"] > 0


def test_sigterm_finishes_running_requests_exits_0_and_never_writes_the_run(smoke_run, tmp_path) -> None:
    before = _files(smoke_run.run_dir)
    srv = _server(smoke_run.run_dir, tmp_path / "serve.log", "--eager")
    client = _client(srv)
    stream = client.completions.create(model=srv.model, prompt="Once", max_tokens=60, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert srv.process is not None
    srv.process.terminate()
    rest = list(stream)
    assert sum(1 for c in [first, *rest] if c.choices and c.choices[0].text) >= 50
    assert rest[-1].choices[0].finish_reason == "length"
    assert srv.process.wait(30) == 0, srv.tail()
    assert "stopped: every request answered" in srv.tail()
    assert _files(smoke_run.run_dir) == before

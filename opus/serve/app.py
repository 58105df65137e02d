"""The HTTP side of ``opus serve``: OpenAI's completions and chat completions, /v1/models, /health,
/metrics. Requests go to the engine (``opus.serve.scheduler``), which runs in its own thread; tokens come
back through an asyncio queue per request and are streamed as server-sent events ending in ``[DONE]``.

A client that goes away (a dropped stream, a closed connection) cancels its request: the engine frees
its blocks on its next step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from opus.runtime.engine import Sampling
from opus.serve import scheduler as eng
from opus.serve.loader import Served
from opus.serve.prometheus import ServerMetrics
from opus.serve.prompts import ChatTemplateMissing, chat_prompt_ids, completion_prompt_ids
from opus.serve.protocol import DEFAULT_MAX_TOKENS, ChatRequest, CompletionRequest, error_body
from opus.serve.text import TextStream

RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, kind, param, code), headers


def create_app(served: Served, chat_template: str | None = None) -> FastAPI:
    engine = served.engine
    metrics = ServerMetrics(engine)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if not engine.alive:
            engine.start()
        yield
        await asyncio.to_thread(engine.stop)  # running and waiting requests finish first

    app = FastAPI(title="opus serve", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(str(exc.status)).inc()
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            metrics.requests.labels("400").inc()
            reason = (first.get("ctx") or {}).get("error", "")
            return JSONResponse(error_body(f"the request body is not valid JSON: {reason}".rstrip(": ")),
                                status_code=400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        metrics.requests.labels("400").inc()
        return JSONResponse(error_body(f"{where}: {message}" if where else message, param=where or None),
                            status_code=400)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.error is not None or not engine.alive:
            reason = f"engine stopped: {engine.error!r}" if engine.error else "engine not running"
            return JSONResponse({"status": "error", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": int(time.time()), "owned_by": "opus",
            "max_model_len": engine.max_context, "root": str(served.path)}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ids = _or_400(lambda: completion_prompt_ids(served.tokenizer, body.single_prompt()), "prompt")
        return await _answer(request, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        try:
            ids = chat_prompt_ids(served.tokenizer, body.messages, chat_template)
        except ChatTemplateMissing as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        except ValueError as exc:
            raise ApiError(400, f"messages: {exc}", param="messages") from exc
        return await _answer(request, body, ids, body.limit, chat=True)

    async def _answer(request: Request, body: CompletionRequest | ChatRequest, ids: list[int],
                      max_tokens: int | None, chat: bool) -> Response:
        if body.model is not None and body.model != served.name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {served.name!r}",
                           param="model", code="model_not_found")
        limit = max_tokens or min(DEFAULT_MAX_TOKENS, max(1, engine.max_context - len(ids)))
        try:
            engine.check(len(ids), limit)
        except eng.TooLong as exc:
            raise ApiError(400, str(exc), param="max_tokens" if max_tokens else "prompt",
                           code="context_length_exceeded") from exc
        call = _Call(served, body, ids, limit, chat)
        try:
            engine.submit(call.request)
        except eng.QueueFull as exc:
            raise ApiError(429, str(exc), kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
        metrics.requests.labels("200").inc()
        if body.stream:
            options = (body.model_extra or {}).get("stream_options") or {}
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return StreamingResponse(call.events(include_usage), media_type="text/event-stream")
        try:
            await call.until_done()
        except asyncio.CancelledError:
            engine.cancel(call.request)
            raise
        if call.reason == "error":
            raise ApiError(500, f"the engine failed: {engine.error!r}", kind="server_error")
        return JSONResponse(call.whole())

    return app


def _or_400(fn: Any, param: str) -> list[int]:
    try:
        return fn()
    except ValueError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from exc


class _Call:
    """One request's way through the engine and back to its client."""

    def __init__(self, served: Served, body: CompletionRequest | ChatRequest, ids: list[int], limit: int,
                 chat: bool) -> None:
        self.served, self.chat, self.model = served, chat, served.name
        self.queue: asyncio.Queue[tuple[int | None, str | None]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        sampling = None
        if body.temperature > 0:
            seed = body.seed if body.seed is not None else secrets.randbits(63)
            sampling = Sampling(temperature=body.temperature, top_p=body.top_p, seed=seed)
        stop_ids = frozenset() if body.ignore_eos else served.eos_ids
        self.request = eng.Request(ids, limit, lambda tok, why: loop.call_soon_threadsafe(
            self.queue.put_nowait, (tok, why)), sampling=sampling, stop_ids=stop_ids)
        self.text = TextStream(served.tokenizer, body.stops, skip=served.eos_ids)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.completion_tokens = 0
        self.reason: str | None = None
        self.parts: list[str] = []

    async def pieces(self) -> AsyncIterator[str]:
        """The text as it can be handed out; ``reason`` is set when it ends."""
        while self.reason is None:
            token, why = await self.queue.get()
            if token is not None and not self.text.stopped:
                self.completion_tokens += 1
                piece = self.text.push(token)
                if self.text.stopped:
                    self.served.engine.cancel(self.request)  # the rest of its tokens are not wanted
                    self.reason = "stop"
                if piece:
                    yield piece
            if why is not None and self.reason is None:  # a stop string has set it already
                self.reason = why
        tail = self.text.finish()
        if tail:
            yield tail

    async def until_done(self) -> None:
        async for piece in self.pieces():
            self.parts.append(piece)

    def usage(self) -> dict[str, int]:
        prompt = len(self.request.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

    def whole(self) -> dict[str, Any]:
        text = "".join(self.parts)
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text}}
                                  if self.chat else {"index": 0, "text": text, "logprobs": None})
        choice["finish_reason"] = self.reason
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, reason: str | None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        finished = False
        try:
            if self.chat:
                yield _sse(self.chunk(None, None, first=True))
            async for piece in self.pieces():
                yield _sse(self.chunk(piece, None))
            if self.reason == "error":
                yield _sse(error_body(f"the engine failed: {self.served.engine.error!r}", "server_error"))
            else:
                yield _sse(self.chunk(None, self.reason))
            if include_usage:
                yield _sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                            "created": self.created, "model": self.model, "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:  # the client went away mid-stream: free its blocks now
                self.served.engine.cancel(self.request)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

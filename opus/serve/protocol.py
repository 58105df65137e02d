"""The OpenAI request bodies the server accepts (pydantic), and its error body.

Only what the server does is accepted: a parameter it would ignore (``n > 1``, ``logprobs``,
``echo``, ``best_of``, ``suffix``, tools) is a 400 naming it, never silently dropped. Other unknown
fields are ignored, as OpenAI-compatible servers do. ``ignore_eos`` (as vLLM) keeps generating past
the end-of-sequence token: benchmarks use it for fixed output lengths.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_MAX_TOKENS = 256
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions", "logit_bias")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = 1
    ignore_eos: bool = False
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> _Sampling:
        if self.n != 1:
            raise ValueError(f"n={self.n}: this server returns one choice per request (n=1)")
        extra = self.model_extra or {}
        for name in UNSUPPORTED:
            value = extra.get(name)
            if value not in (None, False, "", [], {}) and not (name == "best_of" and value == 1):
                raise ValueError(f"{name} is not supported by this server")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 sequences")
        return self

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a list of one is accepted), or ValueError."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"prompt: {len(prompt)} prompts in one request; send one per request")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt: empty")
        return prompt  # type: ignore[return-value]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: text only
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"content part of type {part.get('type')!r}: only text is supported")
                parts.append(str(part.get("text", "")))
            return "".join(parts)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

"""Prompts to token ids: a completion's text or ids, a chat's messages through the chat template."""

from __future__ import annotations

from typing import Any

from opus.serve.protocol import ChatMessage


class ChatTemplateMissing(ValueError):
    pass


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"])
        if not ids:
            raise ValueError("encodes to no token")
        return ids
    size = len(tokenizer)
    bad = [t for t in prompt if not 0 <= t < size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary of {size}")
    return list(prompt)


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage], template: str | None = None) -> list[int]:
    """The tokenizer's chat template (or ``template``, from ``opus serve --chat-template``) applied to the
    messages, with the assistant's turn opened."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateMissing("the model's tokenizer has no chat template: use /v1/completions, or start "
                                  "the server with --chat-template FILE")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    text = tokenizer.apply_chat_template(conversation, chat_template=template, add_generation_prompt=True,
                                         tokenize=False)
    # The template writes the special tokens (a BOS among them) itself.
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError("the chat template gave an empty prompt")
    return ids

"""The OpenAI-compatible request bodies, the chat template, and the response objects.

Field names, defaults and response shapes follow OpenAI's Completions and Chat Completions
APIs, so the official ``openai`` client works unchanged. Extensions that vLLM also accepts
(``top_k``, ``stop_token_ids``, ``ignore_eos``) are allowed; parameters we cannot honour (``n`` > 1,
``logprobs``, ``best_of`` > 1) are refused with a message rather than silently ignored.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..tokenizer import SPECIAL_TOKENS


class StreamOptions(BaseModel):
    include_usage: bool = False


class CommonParams(BaseModel):
    """The parameters completions and chat share."""
    model_config = ConfigDict(extra="allow")   # unknown OpenAI fields are accepted and ignored

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False   # vLLM's extension: run to max_tokens (fixed-length load tests)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    logprobs: Any = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported: send one request per completion")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v not in (None, False):
            raise ValueError("logprobs are not supported by this server")
        return v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops


class CompletionRequest(CommonParams):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)    # OpenAI's default for completions
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("send one prompt per request (a list of several is not supported)")
            return v[0]
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("best_of > 1 is not supported")
        return v


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(CommonParams):
    messages: list[ChatMessage] = Field(min_length=1)

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if v[-1].role != "user":
            raise ValueError("the last message must come from the user")
        return v


TICKET, TRIAGE, REPLY, END = SPECIAL_TOKENS[2:6]


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The chat template: the model was trained on support tickets, so a user turn becomes a
    ticket and the assistant answers with its triage line and reply. A system message is
    put at the head of the first ticket; earlier assistant turns close with ``<|end|>``."""
    system = "".join(m.content + "\n" for m in messages if m.role == "system")
    parts: list[str] = []
    for m in messages:
        if m.role == "user":
            parts.append(f"{TICKET}{system}{m.content}\n{TRIAGE}")
            system = ""
        elif m.role == "assistant":
            parts.append(f"{m.content}\n{END}")
    return "".join(parts)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict[str, int],
                    timings: dict[str, float] | None = None) -> dict[str, Any]:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            "usage": use}
    if timings is not None:
        body["timings"] = timings
    return body


def completion_chunk(rid: str, model: str, text: str, finish: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}


def chat_body(rid: str, model: str, text: str, finish: str | None, use: dict[str, int],
              timings: dict[str, float] | None = None) -> dict[str, Any]:
    body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish, "logprobs": None}],
            "usage": use}
    if timings is not None:
        body["timings"] = timings
    return body


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def usage_chunk(rid: str, model: str, obj: str, use: dict[str, int],
                timings: dict[str, float] | None) -> dict[str, Any]:
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [], "usage": use}
    if timings is not None:
        body["timings"] = timings
    return body


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

"""The OpenAI-compatible request bodies, the chat template, and the response objects.

Field names, defaults and response shapes follow OpenAI's Completions and Chat Completions
APIs, so the official ``openai`` client works unchanged. Extensions that vLLM also accepts
(``top_k``, ``stop_token_ids``, ``ignore_eos``) are allowed. A parameter that would change the
reply and that we cannot honour (:data:`UNSUPPORTED`: ``tools``, ``response_format``, ``n`` > 1,
``logprobs`` ...) is refused with a 400 naming it, never silently ignored; fields that change
nothing in the reply (``user``, ``metadata``, ``store`` ...) are accepted and ignored.

Chat message ``content`` is a string or a list of text parts (``[{"type": "text", "text": ...}]``,
joined with newlines as vLLM does); other part types (images, audio, files) are refused.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..tokenizer import SPECIAL_TOKENS


class StreamOptions(BaseModel):
    include_usage: bool = False


#: Parameters we cannot honour, with the values that mean "not used" (anything else is refused
#: with a 400 naming the parameter), and what to do instead.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((None, 1), "send one request per completion"),
    "best_of": ((None, 1), "send one request per completion"),
    "logprobs": ((None, False), "this server returns no log probabilities"),
    "top_logprobs": ((None, 0), "this server returns no log probabilities"),
    "echo": ((None, False), "prepend the prompt yourself"),
    "suffix": ((None, ""), "this server does not fill in the middle"),
    "logit_bias": ((None, {}), "this server does not bias logits"),
    "presence_penalty": ((None, 0, 0.0), "this server applies no penalties"),
    "frequency_penalty": ((None, 0, 0.0), "this server applies no penalties"),
    "repetition_penalty": ((None, 1, 1.0), "this server applies no penalties"),
    "tools": ((None, []), "this model cannot call tools"),
    "tool_choice": ((None, "none"), "this model cannot call tools"),
    "functions": ((None, []), "this model cannot call functions"),
    "function_call": ((None, "none"), "this model cannot call functions"),
    "response_format": ((None, {"type": "text"}), "this server only writes free text"),
    "modalities": ((None, ["text"]), "this model only writes text"),
    "audio": ((None,), "this model only writes text"),
    "prediction": ((None,), "this server does not use predicted outputs"),
}


class CommonParams(BaseModel):
    """The parameters completions and chat share."""
    # Unknown fields are kept (``model_extra``) so :meth:`unsupported` can name the ones that
    # matter; the others (``user``, ``metadata`` ...) change nothing in the reply.
    model_config = ConfigDict(extra="allow")

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
    user: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """``(parameter, message)`` for the first parameter set to a value we cannot honour."""
        given = self.model_extra or {}
        for name, (unused, instead) in UNSUPPORTED.items():
            if name in given and not any(given[name] == u for u in unused):
                shown = repr(given[name])
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                return name, (f"the parameter '{name}' is not supported by this server (got "
                              f"{shown}): {instead}; remove it from the request")
        return None

    def token_limit(self) -> int | None:
        """The most tokens to generate: ``max_tokens`` (chat overrides it)."""
        return self.max_tokens

    def token_limit_name(self) -> str:
        return "max_tokens"

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

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("send one prompt per request (a list of several is not supported)")
            return v[0]
        return v


#: The content part types a chat message may hold here.
SUPPORTED_PARTS = ("text",)


class ChatMessage(BaseModel):
    # "developer" is OpenAI's newer name for the system role.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        """The message's text: the string, or its text parts joined with newlines (as vLLM
        joins them). Raises ValueError naming any other part type."""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            kind = part.get("type")
            if kind not in SUPPORTED_PARTS or not isinstance(part.get("text"), str):
                shown = str(kind)[:40]
                raise ValueError(f"content parts of type '{shown}' are not supported; this "
                                 f"model reads text only: send a string or parts of type "
                                 f"{', '.join(repr(t) for t in SUPPORTED_PARTS)} with a 'text' string")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatRequest(CommonParams):
    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's current name for the cap on generated tokens; preferred over max_tokens.
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def token_limit_name(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

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
    system = "".join(m.text() + "\n" for m in messages if m.role in ("system", "developer"))
    parts: list[str] = []
    for m in messages:
        if m.role == "user":
            parts.append(f"{TICKET}{system}{m.text()}\n{TRIAGE}")
            system = ""
        elif m.role == "assistant":
            parts.append(f"{m.text()}\n{END}")
    return "".join(parts)


#: :func:`chat_prompt` as a Jinja chat template, for ``export-hf``'s tokenizer_config.json:
#: ``transformers``' ``apply_chat_template`` then gives the prompt ids our server uses (a test
#: checks it). The user turn already ends with the assistant's cue (``<|triage|>``), so
#: ``add_generation_prompt`` changes nothing.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}{{ part['text'] }}{%- if not loop.last -%}{{ '\\n' }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}{%- if m['role'] in ['system', 'developer'] -%}"
    "{%- set ns.system = ns.system ~ text(m['content']) ~ '\\n' -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}"
    "{{ '" + TICKET + "' ~ ns.system ~ text(m['content']) ~ '\\n" + TRIAGE + "' }}"
    "{%- set ns.system = '' -%}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{ text(m['content']) ~ '\\n" + END + "' }}"
    "{%- endif -%}"
    "{%- endfor -%}")


def context_window_message(window: int, prompt_tokens: int, max_tokens: int,
                           name: str = "max_tokens") -> str:
    """The 400 for a request past the context window; ``generate`` refuses with the same."""
    return (f"this model's context window is {window} tokens; the prompt has {prompt_tokens} "
            f"tokens and {name} is {max_tokens} ({prompt_tokens + max_tokens} in all); "
            f"shorten the prompt or lower {name}")


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

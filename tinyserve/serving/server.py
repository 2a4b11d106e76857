"""An OpenAI-compatible HTTP server over the continuous-batching engine.

``python -m tinyserve serve`` starts it on 127.0.0.1:8000. Endpoints:

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed over server-sent
  events with ``"stream": true`` (one chunk per generated token, then ``data: [DONE]``);
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

The path of one request: the handler validates the body and tokenizes the prompt, checks
prompt + ``max_tokens`` against the context window (400 naming both), and submits it to the
:class:`~tinyserve.serving.async_engine.AsyncEngine`. It then waits for the *first* token before
answering, so a request refused after queueing (queue full, deadline passed: 429 with
``Retry-After``) still gets a proper status code instead of a stream that breaks. Tokens are
detokenized incrementally (a multi-byte character may span two tokens) and checked against
stop strings; a client that disconnects cancels its request, and its KV blocks are free before
the engine's next step. Every response carries token usage and the request's timings.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import api_schema as api
from .async_engine import AsyncEngine, QueueFullError, RequestStream, ShuttingDownError
from ..engine import Engine, EngineConfig
from ..generate import PromptError
from ..metrics import RequestTrace
from ..model import TinyLlama
from ..sampling import SamplingParams
from .server_metrics import ServerMetrics
from ..tokenizer import TinyTokenizer


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers


def _timings(trace: RequestTrace | None) -> dict[str, float] | None:
    """Per-request timings in milliseconds, measured from the request's arrival."""
    if trace is None or not trace.token_times:
        return None
    ms = lambda t: round(1e3 * (t - trace.arrival), 3)  # noqa: E731
    out = {"queue_ms": ms(trace.admitted), "ttft_ms": ms(trace.token_times[0]),
           "e2e_ms": ms(trace.token_times[-1])}
    if trace.prefill_start is not None and trace.prefill_end is not None:
        out["prefill_ms"] = round(1e3 * (trace.prefill_end - trace.prefill_start), 3)
    if len(trace.token_times) > 1:
        out["tpot_ms"] = round(1e3 * (trace.token_times[-1] - trace.token_times[0])
                               / (len(trace.token_times) - 1), 3)
    return out


class _TextStream:
    """Incremental detokenization with stop strings.

    Text is decoded from *all* tokens so far and only the new suffix is emitted: one token
    can be half a UTF-8 character. The last ``len(longest stop) - 1`` characters are held
    back until it is clear they do not begin a stop string."""

    def __init__(self, tok: TinyTokenizer, stops: list[str]) -> None:
        self.tok, self.stops = tok, stops
        self.ids: list[int] = []
        self.sent = 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.stopped = False

    def push(self, token_id: int, final: bool) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special=True)
        for stop in self.stops:
            at = text.find(stop)
            if at != -1:
                self.stopped = True
                text, final = text[:at], True
        if not final and text.endswith("\ufffd"):
            return ""
        upto = len(text) if final else max(self.sent, len(text) - self.hold)
        piece, self.sent = text[self.sent:upto], upto
        return piece


def create_app(model_name: str = "target", *, model: TinyLlama | None = None,
               tokenizer: TinyTokenizer | None = None, engine_config: EngineConfig | None = None,
               max_waiting: int = 64, queue_timeout_s: float | None = 30.0,
               drain_timeout_s: float = 10.0) -> FastAPI:
    """The app; the engine thread starts with the app's lifespan and drains at shutdown."""
    if model is None:
        from ..checkpoint import load_model
        model = load_model(model_name)
    if tokenizer is None:
        from ..tokenizer import load_tokenizer
        tokenizer = load_tokenizer()
    tok: TinyTokenizer = tokenizer
    window = model.config.max_position_embeddings
    config = engine_config or EngineConfig(num_blocks=1024, block_size=16, max_num_seqs=16,
                                           max_num_batched_tokens=256)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = AsyncEngine(Engine(model, config), max_waiting=max_waiting,
                             queue_timeout_s=queue_timeout_s)
        metrics = ServerMetrics(engine.stats)
        engine.listeners.append(lambda req, event, trace: metrics.observe(trace))
        state.update(engine=engine, metrics=metrics)
        yield
        await engine.shutdown(drain_timeout_s)

    app = FastAPI(title="tinyserve", lifespan=lifespan,
                  description="OpenAI-compatible completions over the course's engine")
    app.state.tinyserve = state

    # ---- errors in OpenAI's shape -----------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _count(request, exc.status)
        return JSONResponse(api.error_body(exc.message, exc.kind, exc.param, exc.code),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            status, message = 400, "the request body is not valid JSON: " + "; ".join(
                str(e.get("ctx", {}).get("error", e.get("msg"))) for e in errors)
        else:
            status = 422
            message = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: "
                f"{str(e['msg']).removeprefix('Value error, ')}" for e in errors)
        _count(request, status)
        return JSONResponse(api.error_body(message, "invalid_request_error"), status_code=status)

    def _count(request: Request, status: int) -> None:
        if "metrics" in state:
            state["metrics"].requests.labels(request.url.path, str(status)).inc()

    # ---- the shared path of both endpoints ----------------------------------------------------
    def _check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{model_name}' (see GET /v1/models)", "not_found_error",
                           "model", "model_not_found")

    def _tokens(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "the prompt is empty; send at least one character", param="prompt")
            return tok.encode(prompt)
        if not prompt:
            raise APIError(400, "the prompt is an empty list of token ids", param="prompt")
        bad = [t for t in prompt if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {tok.vocab_size}); got {bad[:5]}",
                           param="prompt")
        return list(prompt)

    async def _start(request: Request, body: api._Common, ids: list[int], max_tokens: int | None,
                     arrival: float) -> tuple[RequestStream, Any]:
        if max_tokens is None:
            max_tokens = window - len(ids)
        if len(ids) + max_tokens > window:
            raise APIError(400, f"this model's context window is {window} tokens; the prompt has "
                                f"{len(ids)} tokens and max_tokens is {max_tokens} "
                                f"({len(ids) + max_tokens} in all); shorten the prompt or lower "
                                f"max_tokens", param="max_tokens", code="context_length_exceeded")
        try:
            body.stop_strings()              # validated here, applied by _TextStream
        except ValueError as e:
            raise APIError(400, str(e), param="stop") from None
        sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k,
                                  top_p=body.top_p if body.top_p < 1 else None, seed=body.seed)
        eos = () if body.ignore_eos else (tok.eos_id,)
        stop_ids = (*eos, *(body.stop_token_ids or ()))
        engine: AsyncEngine = state["engine"]
        try:
            stream = engine.submit(ids, max_tokens, sampling=sampling, stop_ids=stop_ids,
                                   arrival=arrival)
        except ShuttingDownError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        first = await _first_or_disconnect(request, stream)
        return stream, first

    async def _first_or_disconnect(request: Request, stream: RequestStream) -> Any:
        """The first token, or the refusal as an HTTP error; a client that leaves while its
        request is queued cancels it."""
        next_token = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({next_token}, timeout=0.25)
                if done:
                    return next_token.result()
                if await request.is_disconnected():
                    next_token.cancel()
                    stream.cancel()
                    raise APIError(499, "the client closed the connection", "client_closed")
        except PromptError as e:
            raise APIError(400, str(e), param="prompt") from None
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_error", code="server_overloaded",
                           headers={"Retry-After": str(int(e.retry_after_s + 0.999))}) from None
        except ShuttingDownError as e:
            raise APIError(503, str(e), "service_unavailable") from None

    async def _respond(request: Request, body: api._Common, ids: list[int],
                       max_tokens: int | None, chat: bool, arrival: float) -> Response:
        stream, first = await _start(request, body, ids, max_tokens, arrival)
        rid = ("chatcmpl-" if chat else "cmpl-") + stream.request_id.split("-")[-1]
        text = _TextStream(tok, body.stop_strings())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(stream, first, text, rid, body.model, chat, include_usage, len(ids)),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        pieces, n, event, finish = [], 0, first, None
        try:
            while True:
                n += 1
                pieces.append(text.push(event.token_id, event.finished))
                if text.stopped or event.finished:
                    finish = "stop" if text.stopped else _finish_reason(event.finish_reason)
                    break
                event = await stream.__anext__()
        finally:
            stream.cancel()
        use = api.usage(len(ids), n)
        make = api.chat_body if chat else api.completion_body
        _count(request, 200)
        timings = _timings(stream.trace)
        return JSONResponse(make(rid, body.model, "".join(pieces), finish, use, timings),
                            headers={"x-tinyserve-timings": json.dumps(timings or {})})

    async def _sse(stream: RequestStream, first: Any, text: _TextStream, rid: str, model_id: str,
                   chat: bool, include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
        n, event = 0, first
        try:
            while True:
                n += 1
                piece = text.push(event.token_id, event.finished)
                done = text.stopped or event.finished
                finish = ("stop" if text.stopped else _finish_reason(event.finish_reason)) if done else None
                if chat:
                    delta = {"role": "assistant", "content": piece} if n == 1 else {"content": piece}
                    chunk = api.chat_chunk(rid, model_id, delta, finish)
                else:
                    chunk = api.completion_chunk(rid, model_id, piece, finish)
                yield f"data: {json.dumps(chunk)}\n\n"
                if done:
                    break
                event = await stream.__anext__()
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield "data: " + json.dumps(api.usage_chunk(
                    rid, model_id, obj, api.usage(prompt_tokens, n), _timings(stream.trace))) + "\n\n"
            yield "data: [DONE]\n\n"
            if "metrics" in state:
                state["metrics"].requests.labels(
                    "/v1/chat/completions" if chat else "/v1/completions", "200").inc()
        finally:
            stream.cancel()   # a no-op when finished; on a disconnect it frees the blocks

    # ---- endpoints ----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        _check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        ids = _tokens(body.prompt)  # type: ignore[arg-type]
        return await _respond(request, body, ids, body.max_tokens, False, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        _check_model(body.model)
        ids = _tokens(api.chat_prompt(body.messages))
        return await _respond(request, body, ids, body.max_tokens, True, arrival)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "tinyserve",
                                            "max_model_len": window}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        engine: AsyncEngine | None = state.get("engine")
        if engine is None or not engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok", **engine.stats()})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state["metrics"].render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _finish_reason(engine_reason: str | None) -> str:
    # The engine's "window" (context full) is OpenAI's "length"; "stop" and "length" map as is.
    return "stop" if engine_reason == "stop" else "length"


def serve(host: str = "127.0.0.1", port: int = 8000, **kwargs: Any) -> None:
    """Run the server until interrupted (Ctrl-C drains in-flight requests, then exits)."""
    import uvicorn
    uvicorn.run(create_app(**kwargs), host=host, port=port, log_level="info",
                timeout_graceful_shutdown=int(kwargs.get("drain_timeout_s", 10)) + 5)

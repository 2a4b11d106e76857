"""An OpenAI-compatible HTTP server over the continuous-batching engine.

``python -m tinyserve serve`` starts it on 127.0.0.1:8000. Endpoints:

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed over server-sent
  events with ``"stream": true`` (one chunk per generated token, then ``data: [DONE]``);
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

The path of one request: the handler validates the body (a parameter it cannot honour gets a
400 naming it), turns chat messages into a prompt with the chat template and tokenizes it,
checks prompt + ``max_tokens`` (or chat's ``max_completion_tokens``) against the context
window (400 naming both), and submits it to the
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
from dataclasses import dataclass, field
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
from .api_schema import context_window_message
from .options import ServeOptions
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


@dataclass
class ServerState:
    """What the handler serves with: the model and its limits, fixed at start, and the live
    engine and metrics, which exist between the app's start and its shutdown."""
    model_name: str
    model: TinyLlama
    tokenizer: TinyTokenizer
    engine_config: EngineConfig
    max_waiting: int = 64
    queue_timeout_s: float | None = 30.0
    drain_timeout_s: float = 10.0
    engine: AsyncEngine | None = field(default=None, repr=False)
    metrics: ServerMetrics | None = field(default=None, repr=False)

    @property
    def window(self) -> int:
        return self.model.config.max_position_embeddings


@dataclass
class _Reply:
    """One request's reply as it is produced: the text pieces, the tokens counted, and the
    finish reason once known. Streamed and non-streamed replies both advance it with
    :meth:`OpenAIServer._advance`, so they finish and count the same way."""
    rid: str
    chat: bool
    prompt_tokens: int
    text: _TextStream
    tokens: int = 0
    finish: str | None = None


class OpenAIServer:
    """The endpoints' handlers over one :class:`ServerState`; :func:`create_app` routes to them."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    @property
    def engine(self) -> AsyncEngine:
        """The live engine (between the app's start and its shutdown)."""
        if self.state.engine is None:
            raise RuntimeError("the server has not started: enter the app's lifespan first")
        return self.state.engine

    # ---- lifespan -------------------------------------------------------------------------------
    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Start the engine thread with the app; drain in-flight requests at shutdown."""
        st = self.state
        inner = Engine(st.model, st.engine_config)
        if st.engine_config.fast:
            # Before the first request: a compile on a CPU (graphs on CUDA are made with the
            # engine). The largest step serves every smaller one (Engine.prepare).
            inner.prepare(rows=(st.engine_config.max_num_seqs,), progress=True)
        engine = AsyncEngine(inner, max_waiting=st.max_waiting,
                             queue_timeout_s=st.queue_timeout_s)
        metrics = ServerMetrics(engine.stats)
        engine.listeners.append(lambda req, event, trace: metrics.observe(trace))
        st.engine, st.metrics = engine, metrics
        yield
        await engine.shutdown(st.drain_timeout_s)

    # ---- endpoints ------------------------------------------------------------------------------
    async def completions(self, body: api.CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check_request(body)
        ids = self._tokens(body.prompt)  # type: ignore[arg-type]
        return await self._respond(request, body, ids, False, arrival)

    async def chat(self, body: api.ChatRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check_request(body)
        try:
            prompt = api.chat_prompt(body.messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        return await self._respond(request, body, self._tokens(prompt), True, arrival)

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.state.model_name, "object": "model",
                                            "created": 0, "owned_by": "tinyserve",
                                            "max_model_len": self.state.window}]}

    async def health(self) -> JSONResponse:
        engine = self.state.engine
        if engine is None or not engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok", **engine.stats()})

    async def metrics(self) -> Response:
        if self.state.metrics is None:
            raise APIError(503, "the server is starting; metrics come with the engine",
                           "service_unavailable")
        return Response(self.state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- errors in OpenAI's shape ----------------------------------------------------------------
    async def api_error(self, request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        self.count(request.url.path, exc.status)
        return JSONResponse(api.error_body(exc.message, exc.kind, exc.param, exc.code),
                            status_code=exc.status, headers=exc.headers)

    async def invalid(self, request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            status, message = 400, "the request body is not valid JSON: " + "; ".join(
                str(e.get("ctx", {}).get("error", e.get("msg"))) for e in errors)
        else:
            status = 422
            message = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: "
                f"{str(e['msg']).removeprefix('Value error, ')}" for e in errors)
        self.count(request.url.path, status)
        return JSONResponse(api.error_body(message, "invalid_request_error"), status_code=status)

    def count(self, path: str, status: int) -> None:
        """One answered request in ``/metrics``, by endpoint and status code."""
        if self.state.metrics is not None:
            self.state.metrics.requests.labels(path, str(status)).inc()

    # ---- the shared path of both endpoints ------------------------------------------------------
    def _check_request(self, body: api.CommonParams) -> None:
        """404 for another model, 400 naming a parameter we cannot honour."""
        if body.model != self.state.model_name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves "
                                f"'{self.state.model_name}' (see GET /v1/models)",
                           "not_found_error", "model", "model_not_found")
        refused = body.unsupported()
        if refused is not None:
            raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        tok = self.state.tokenizer
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

    async def _start(self, request: Request, body: api.CommonParams, ids: list[int],
                     arrival: float) -> tuple[RequestStream, Any]:
        """Submit the request and wait for its first token (or its refusal, as an HTTP error)."""
        window, max_tokens, name = self.state.window, body.token_limit(), body.token_limit_name()
        if max_tokens is None:
            max_tokens = window - len(ids)
        if len(ids) + max_tokens > window:
            raise APIError(400, context_window_message(window, len(ids), max_tokens, name),
                           param=name, code="context_length_exceeded")
        try:
            body.stop_strings()              # validated here, applied by _TextStream
        except ValueError as e:
            raise APIError(400, str(e), param="stop") from None
        sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k,
                                  top_p=body.top_p if body.top_p < 1 else None, seed=body.seed)
        eos = () if body.ignore_eos else (self.state.tokenizer.eos_id,)
        stop_ids = (*eos, *(body.stop_token_ids or ()))
        try:
            stream = self.engine.submit(ids, max_tokens, sampling=sampling, stop_ids=stop_ids,
                                        arrival=arrival)
        except ShuttingDownError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        return stream, await self._first_or_disconnect(request, stream)

    @staticmethod
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

    async def _respond(self, request: Request, body: api.CommonParams, ids: list[int],
                       chat: bool, arrival: float) -> Response:
        stream, first = await self._start(request, body, ids, arrival)
        reply = _Reply(rid=("chatcmpl-" if chat else "cmpl-") + stream.request_id.split("-")[-1],
                       chat=chat, prompt_tokens=len(ids),
                       text=_TextStream(self.state.tokenizer, body.stop_strings()))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.sse(stream, first, reply, body.model, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        pieces, event = [], first
        try:
            while True:
                pieces.append(self._advance(reply, event))
                if reply.finish is not None:
                    break
                event = await stream.__anext__()
        finally:
            stream.cancel()
        self.count(request.url.path, 200)
        timings = _timings(stream.trace)
        make = api.chat_body if chat else api.completion_body
        use = api.usage(reply.prompt_tokens, reply.tokens)
        return JSONResponse(make(reply.rid, body.model, "".join(pieces), reply.finish, use, timings),
                            headers={"x-tinyserve-timings": json.dumps(timings or {})})

    @staticmethod
    def _advance(reply: _Reply, event: Any) -> str:
        """Take one token event into the reply: its text piece; ``reply.finish`` is set when
        this token ends the reply (a stop string, a stop token, ``max_tokens`` or the window)."""
        reply.tokens += 1
        piece = reply.text.push(event.token_id, event.finished)
        if reply.text.stopped:
            reply.finish = "stop"
        elif event.finished:
            reply.finish = _finish_reason(event.finish_reason)
        return piece

    async def sse(self, stream: RequestStream, first: Any, reply: _Reply, model_id: str,
                  include_usage: bool) -> AsyncIterator[str]:
        """The server-sent events of a streamed reply: one chunk per token, usage, ``[DONE]``."""
        event = first
        try:
            while True:
                piece = self._advance(reply, event)
                if reply.chat:
                    delta = ({"role": "assistant", "content": piece} if reply.tokens == 1
                             else {"content": piece})
                    chunk = api.chat_chunk(reply.rid, model_id, delta, reply.finish)
                else:
                    chunk = api.completion_chunk(reply.rid, model_id, piece, reply.finish)
                yield f"data: {json.dumps(chunk)}\n\n"
                if reply.finish is not None:
                    break
                event = await stream.__anext__()
            if include_usage:
                obj = "chat.completion.chunk" if reply.chat else "text_completion"
                use = api.usage(reply.prompt_tokens, reply.tokens)
                yield "data: " + json.dumps(api.usage_chunk(
                    reply.rid, model_id, obj, use, _timings(stream.trace))) + "\n\n"
            yield "data: [DONE]\n\n"
            self.count("/v1/chat/completions" if reply.chat else "/v1/completions", 200)
        finally:
            stream.cancel()   # a no-op when finished; on a disconnect it frees the blocks


def create_app(model_name: str = "target", *, model: TinyLlama | None = None,
               tokenizer: TinyTokenizer | None = None, engine_config: EngineConfig | None = None,
               max_waiting: int = 64, queue_timeout_s: float | None = 30.0,
               drain_timeout_s: float = 10.0) -> FastAPI:
    """The app: routes to an :class:`OpenAIServer` (``app.state.server``), whose engine thread
    starts with the app's lifespan and drains at shutdown."""
    if model is None:
        from ..checkpoint import load_model
        model = load_model(model_name)
    if tokenizer is None:
        from ..tokenizer import load_tokenizer
        tokenizer = load_tokenizer()
    server = OpenAIServer(ServerState(
        model_name, model, tokenizer, engine_config or EngineConfig(**ServeOptions().engine_sizes()),
        max_waiting=max_waiting, queue_timeout_s=queue_timeout_s, drain_timeout_s=drain_timeout_s))
    app = FastAPI(title="tinyserve", lifespan=server.lifespan,
                  description="OpenAI-compatible completions over the course's engine")
    app.state.server = server
    app.add_exception_handler(APIError, server.api_error)
    app.add_exception_handler(RequestValidationError, server.invalid)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    return app


def _finish_reason(engine_reason: str | None) -> str:
    # The engine's "window" (context full) is OpenAI's "length"; "stop" and "length" map as is.
    return "stop" if engine_reason == "stop" else "length"


def serve(host: str = "127.0.0.1", port: int = 8000, **kwargs: Any) -> None:
    """Run the server until interrupted (Ctrl-C drains in-flight requests, then exits)."""
    import uvicorn
    uvicorn.run(create_app(**kwargs), host=host, port=port, log_level="info",
                timeout_graceful_shutdown=int(kwargs.get("drain_timeout_s", 10)) + 5)

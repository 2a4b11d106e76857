"""The engine behind a web server: its step loop on its own thread, requests as async streams.

A forward pass is blocking work (milliseconds of matrix multiplies), and the web server's
event loop must stay free to accept connections and write tokens to sockets. So the engine
runs on one background thread that owns it completely; nothing else touches the engine.
Requests talk to that thread through a command queue (``add``, ``abort``), and the thread
hands each new token back to the event loop with ``call_soon_threadsafe`` into the request's
own ``asyncio.Queue``. Between two steps the thread applies every pending command, so a
cancelled request's blocks are free before the next step is scheduled.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..engine import Engine, StepEvent
from ..generate import PromptError
from ..metrics import RequestTrace
from ..sampling import SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit: the caller should retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueTimeoutError(QueueFullError):
    """The request waited past its queue deadline without being admitted (HTTP 429)."""


class ShuttingDownError(RuntimeError):
    """The server is draining and takes no new requests (HTTP 503)."""


@dataclass
class TokenEvent:
    token_id: int
    finished: bool
    finish_reason: str | None


@dataclass
class _Request:
    seq_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: tuple[int, ...]
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float
    queue_timeout_s: float | None
    trace: RequestTrace | None = None


class AsyncEngine:
    """Owns an :class:`Engine` on a background thread; ``generate`` streams one request."""

    def __init__(self, engine: Engine, *, max_waiting: int = 64,
                 queue_timeout_s: float | None = 30.0, idle_poll_s: float = 0.05) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._requests: dict[str, _Request] = {}
        self._accepting = True
        self._stop = threading.Event()
        self._ids = 0
        self._id_lock = threading.Lock()
        # Called on the engine thread as a request ends, (request, event, trace): before its
        # last token is delivered when it finishes; after its error, with event None, when it
        # is aborted or expires in the queue.
        self.listeners: list[Any] = []
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- called from the event loop -------------------------------------------------------
    def _new_id(self) -> str:
        with self._id_lock:
            self._ids += 1
            return f"cmpl-{self._ids}"

    def submit(self, prompt_ids: list[int], max_tokens: int, *,
               sampling: SamplingParams = SamplingParams(), stop_ids: tuple[int, ...] = (),
               arrival: float | None = None) -> "RequestStream":
        """Queue a request; iterate the returned stream for its tokens. The first
        ``__anext__`` raises ``PromptError``, ``QueueFullError`` (queue full or deadline
        passed) or ``ShuttingDownError`` if the request is refused. Call ``cancel()`` when
        you stop reading early (a disconnect, a stop string): its blocks return at once."""
        if not self._accepting:
            raise ShuttingDownError("the server is shutting down; retry on another replica")
        req = _Request(self._new_id(), prompt_ids, max_tokens, sampling, stop_ids,
                       asyncio.Queue(), asyncio.get_running_loop(),
                       arrival if arrival is not None else time.perf_counter(),
                       self.queue_timeout_s)
        self._commands.put(("add", req))
        return RequestStream(self, req)

    @property
    def accepting(self) -> bool:
        """False once shutdown has begun: new requests are refused (HTTP 503)."""
        return self._accepting

    def stats(self) -> dict[str, float]:
        """A snapshot for /metrics and /health (read without locking: numbers may be one step
        stale, never torn, since each is a single attribute read)."""
        blocks = self.engine.blocks
        return {"running": self.engine.num_running, "waiting": self.engine.num_waiting,
                "kv_blocks_used": blocks.num_used_blocks, "kv_blocks_total": blocks.num_blocks,
                "prefix_cache_hit_rate": blocks.prefix_hit_rate}

    async def shutdown(self, drain_timeout_s: float = 10.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``drain_timeout_s``,
        then cancel the rest and stop the thread."""
        self._accepting = False
        deadline = time.perf_counter() + drain_timeout_s
        while self._requests and time.perf_counter() < deadline:
            await asyncio.sleep(0.02)
        self._commands.put(("abort_all", None))
        self._stop.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)

    # ---- the engine thread ----------------------------------------------------------------
    def _deliver(self, req: _Request, item: Any) -> None:
        req.loop.call_soon_threadsafe(req.out.put_nowait, item)

    def _apply(self, kind: str, arg: Any) -> None:
        if kind == "add":
            req: _Request = arg
            if self.engine.num_waiting >= self.max_waiting:
                self._deliver(req, QueueFullError(
                    f"the server is at capacity: {self.engine.num_waiting} requests are already "
                    f"waiting (limit {self.max_waiting}); retry after a few seconds",
                    retry_after_s=self._retry_after()))
                return
            try:
                seq = self.engine.add_request(req.prompt_ids, req.max_tokens,
                                              sampling=req.sampling, stop_ids=req.stop_ids,
                                              request_id=req.seq_id, arrival=req.submitted)
            except PromptError as e:
                self._deliver(req, e)
                return
            req.trace = seq.trace
            self._requests[req.seq_id] = req
        elif kind == "abort":
            if arg in self._requests:
                self.engine.abort(arg)
                self._finish(self._requests[arg], None)
        elif kind == "abort_all":
            for seq_id in list(self._requests):
                self.engine.abort(seq_id)
                self._deliver(self._requests[seq_id],
                              ShuttingDownError("the server shut down before this request finished"))
                self._finish(self._requests[seq_id], None)

    def _retry_after(self) -> float:
        # A rough wait: the queue ahead drains at about one running batch per typical request.
        return max(1.0, round(self.engine.num_waiting / max(1, self.engine.num_running), 1))

    def _expire_queued(self) -> None:
        now = time.perf_counter()
        for req in list(self._requests.values()):
            seq = self.engine.seqs.get(req.seq_id)
            if (req.queue_timeout_s is not None and seq is not None and seq.trace.admitted is None
                    and now - req.submitted > req.queue_timeout_s):
                self.engine.abort(req.seq_id)
                self._deliver(req, QueueTimeoutError(
                    f"the request waited {now - req.submitted:.1f} s in the queue without "
                    f"starting (deadline {req.queue_timeout_s:g} s); the server is overloaded, "
                    f"retry later", retry_after_s=self._retry_after()))
                self._finish(req, None)

    def _finish(self, req: _Request, event: StepEvent | None) -> None:
        self._requests.pop(req.seq_id, None)
        for listener in self.listeners:
            listener(req, event, req.trace)
        self.engine.seqs.pop(req.seq_id, None)   # keep the engine's table small on long runs

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                block = not self.engine.has_unfinished()
                kind, arg = self._commands.get(block=block, timeout=self._idle_poll_s if block else None)
                self._apply(kind, arg)
                continue     # drain every pending command before the next step
            except queue.Empty:
                pass
            self._expire_queued()
            if not self.engine.has_unfinished():
                continue
            for event in self.engine.step():
                req = self._requests.get(event.seq_id)
                if req is None:
                    continue
                token = TokenEvent(event.token_id, event.finished, event.finish_reason)
                if not event.finished:
                    self._deliver(req, token)
                    continue
                # The listeners first: a client that has read its last token (chapter 9 reads
                # the server's trace right after) must find the request's trace recorded.
                try:
                    self._finish(req, event)
                finally:
                    self._deliver(req, token)
        # Leave nothing hanging: whatever is still queued is refused.
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._deliver(arg, ShuttingDownError("the server is shutting down"))


class RequestStream:
    """One request's tokens as an async iterator, with ``cancel`` and its ``trace``."""

    def __init__(self, owner: AsyncEngine, req: _Request) -> None:
        self._owner, self._req, self._done = owner, req, False

    @property
    def request_id(self) -> str:
        return self._req.seq_id

    @property
    def trace(self) -> RequestTrace | None:
        """The request's timeline (set once the engine has accepted it)."""
        return self._req.trace

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        item = await self._req.out.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._owner._commands.put(("abort", self._req.seq_id))

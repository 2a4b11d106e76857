"""A load generator for any OpenAI-compatible endpoint: ``python -m tinyserve loadgen``.

It plays a workload against a server the way users would, and measures what *they* see: each
request is a streamed completion (``"stream": true``), and every server-sent event is
timestamped on arrival at the client. From those timestamps come the standard serving
figures (the definitions of :mod:`tinyserve.metrics`, as in vLLM's benchmark):

- **TTFT** first chunk - send time; **ITL** every gap between chunks (pooled over requests);
  **TPOT** (E2E - TTFT) / (output tokens - 1) per request; **E2E** last chunk - send time.
  The *send time* is when the request's first bytes go out (httpcore's
  ``send_request_headers`` trace event): after a connection was taken from the pool (or
  opened) and the request built, so waiting for a free connection or building the body is
  not counted as the server's latency (guidellm's HTTP backend starts its clock at the same
  event);
- **request / output throughput** completed requests and output tokens per second of the
  run (first send to last finish); **goodput** completed requests per second that met every
  SLO given (TTFT, TPOT, E2E limits in ms); failed or refused requests (429) count for nothing.

Arrivals are Poisson or bursty at a rate (:func:`tinyserve.workload.arrival_times`), or
everything at once with a concurrency cap (a fixed number of users, each sending its next
request as soon as the last one finished). Prompts come from :mod:`tinyserve.loadgen.prompts`.

Endpoints: ``endpoint="completions"`` posts the prompt text to ``/v1/completions``;
``endpoint="chat"`` posts it as one user message to ``/v1/chat/completions`` (the server
applies its chat template, so the prompt tokens come from the usage chunk) with the cap as
``max_completion_tokens``. A streamed chunk counts as a token unless it is a control chunk
without text: a role-only first chunk, or an empty last chunk that only carries the finish
reason when the usage chunk shows it is not a token (``transformers serve`` 5.24 sends both
after its tokens; ours puts the role and the finish reason on token chunks), so TTFT and the
gaps are those of tokens on either server.

Output lengths: by default a request stops at ``<|end|>``, so its ``max_tokens`` is a cap, and
the report uses the *real* output lengths from the final usage chunk. ``ignore_eos=True``
sends vLLM's flag, which our server honours too, to force exact lengths.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .prompts import Prompt
from ..metrics import SLO, summarize
from ..workload import arrival_times


@dataclass
class Result:
    """What the client saw of one request. Times are ``time.perf_counter()`` seconds."""

    prompt_tokens: int
    start: float                                  # when the request was sent
    chunk_times: list[float] = field(default_factory=list)   # arrival of each token chunk
    end: float | None = None                      # arrival of the last chunk
    output_tokens: int = 0                        # from the usage chunk (else: chunk count)
    ok: bool = False
    status: int | None = None
    error: str = ""
    text: str = ""
    finish_reason: str | None = None
    server_timings: dict[str, float] | None = None   # the server's own view (tinyserve only)
    replica: int = 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        assert self.end is not None
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def check_endpoint(endpoint: str) -> None:
    """A clear error for an unknown endpoint, before any request is sent."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")


def request_body(model: str, prompt: Prompt, endpoint: str = "completions",
                 ignore_eos: bool = False) -> dict[str, Any]:
    """The JSON body of one streamed request (greedy, usage in the last chunk)."""
    check_endpoint(endpoint)
    body: dict[str, Any] = {"model": model, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
        body["max_completion_tokens"] = prompt.max_tokens
    else:
        body["prompt"] = prompt.text
        body["max_tokens"] = prompt.max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _token_text(choice: dict[str, Any], chat: bool) -> str | None:
    """The text a streamed choice carries, or None when the chunk is no token: a chat chunk
    with a role and no content (the first chunk some servers send). An empty text is a
    token (one whose bytes do not yet make a character, or a stop token), except in an empty
    chunk that only carries the finish reason: :func:`send` counts that one only when the
    usage says a token is missing (some servers send it after the last token, others put the
    stop token there)."""
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if not text and (text is None or "role" in delta) and not choice.get("finish_reason"):
            return None
        return text or ""
    return choice.get("text") or ""


def _is_finish_only(choice: dict[str, Any], chat: bool) -> bool:
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return not text and bool(choice.get("finish_reason"))


async def send(client: Any, base_url: str, model: str, prompt: Prompt, *,
               ignore_eos: bool = False, replica: int = 0,
               endpoint: str = "completions") -> Result:
    """One streamed completion (or chat completion); every token chunk is timestamped as it
    arrives."""
    body = request_body(model, prompt, endpoint, ignore_eos)
    chat = endpoint == "chat"
    res = Result(prompt.prompt_tokens, time.perf_counter(), replica=replica)

    sent = False

    async def on_send(event: str, info: dict[str, Any]) -> None:
        # The clock starts as the request's headers first go out (see the module docstring);
        # a proxy's CONNECT is not the request.
        nonlocal sent
        request = info.get("request")
        if sent or not event.endswith("send_request_headers.started") or \
                (request is not None and request.method == b"CONNECT"):
            return
        sent = True
        res.start = time.perf_counter()

    finish_time: float | None = None     # arrival of an empty finish-only chunk, if any
    try:
        async with client.stream("POST", base_url.rstrip("/") + ENDPOINTS[endpoint],
                                 json=body, extensions={"trace": on_send}) as r:
            res.status = r.status_code
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                try:
                    res.error = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    res.error = raw[:200]
                res.end = time.perf_counter()
                return res
            pieces: list[str] = []
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                    text = _token_text(choice, chat)
                    if _is_finish_only(choice, chat):
                        finish_time = now      # a token only if the usage is short of one
                    elif text is not None:
                        res.chunk_times.append(now)
                        pieces.append(text)
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.server_timings = chunk.get("timings")
            res.text = "".join(pieces)
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        res.error = f"{type(e).__name__}: {e}"
        res.end = time.perf_counter()
        return res
    if finish_time is not None and res.output_tokens > len(res.chunk_times):
        res.chunk_times.append(finish_time)
    res.end = res.chunk_times[-1] if res.chunk_times else time.perf_counter()
    res.output_tokens = res.output_tokens or len(res.chunk_times)
    res.ok = bool(res.chunk_times)
    if not res.ok:
        res.error = res.error or "the stream ended without a token"
    return res


# A router picks a replica for a prompt, given how many requests each one has in flight.
Router = Callable[[Prompt, Sequence[int]], int]


async def _run(urls: Sequence[str], model: str, prompts: Sequence[Prompt], rate: float,
               burstiness: float, concurrency: int | None, seed: int, router: Router | None,
               ignore_eos: bool, timeout_s: float,
               endpoint: str = "completions") -> tuple[list[Result], float]:
    import httpx
    times = arrival_times(len(prompts), rate, np.random.default_rng(seed), burstiness)
    in_flight = [0] * len(urls)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    limits = httpx.Limits(max_connections=max(100, len(prompts)), max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def one(i: int) -> Result:
            if gate is not None:
                await gate.acquire()
            try:
                k = router(prompts[i], in_flight) if router else i % len(urls)
                in_flight[k] += 1
                try:
                    return await send(client, urls[k], model, prompts[i], ignore_eos=ignore_eos,
                                      replica=k, endpoint=endpoint)
                finally:
                    in_flight[k] -= 1
            finally:
                if gate is not None:
                    gate.release()

        t0 = time.perf_counter()
        tasks = []
        for i, t in enumerate(times):
            delay = t0 + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        results = list(await asyncio.gather(*tasks))
    return results, t0


def run_load(urls: str | Sequence[str], model: str, prompts: Sequence[Prompt], *,
             rate: float = float("inf"), burstiness: float = 1.0, concurrency: int | None = None,
             seed: int = 0, router: Router | None = None, ignore_eos: bool = False,
             timeout_s: float = 300.0, endpoint: str = "completions") -> list[Result]:
    """Send ``prompts`` at ``rate`` requests/s (``inf``: all at once, capped by
    ``concurrency``) to one or several base URLs (``router`` picks; round-robin by default),
    as completions or, with ``endpoint="chat"``, chat completions.
    Works from plain scripts and from a notebook (whose event loop is already running)."""
    check_endpoint(endpoint)
    if isinstance(urls, str):
        urls = [urls]
    if not prompts:
        raise ValueError("no prompts to send; give at least one")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    coro = lambda: _run(list(urls), model, prompts, rate, burstiness, concurrency, seed,  # noqa: E731
                        router, ignore_eos, timeout_s, endpoint)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro())[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:   # inside Jupyter's running loop
        return pool.submit(lambda: asyncio.run(coro())).result()[0]


def run_metrics(results: Sequence[Result], slo: SLO | None = None,
                price_per_hour: float | None = None, input_weight: float = 1.0) -> dict[str, float]:
    """The figures of one run: throughput over the run (first send to last answer), goodput
    against ``slo`` (failed requests count for nothing and against the attainment), cost,
    and :func:`tinyserve.metrics.summarize`'s latency figures of the completed requests
    (``p99_ttft_ms``, ``mean_itl_ms`` ...: vLLM's names).

    Cost: with ``price_per_hour`` (the machine's, any currency), the hour is split between
    input and output tokens in proportion to ``tokens * weight`` (input tokens weigh
    ``input_weight``, output tokens 1; 1.0 charges every token alike, 0.25 mimics price sheets
    where prompt tokens cost a quarter), and each side's share is divided by the tokens served
    per hour at this operating point."""
    ok = [r for r in results if r.ok]
    if not ok:
        errors = sorted({r.error for r in results})[:3]
        raise RuntimeError(f"no request completed ({len(results)} sent); errors: {errors}")
    start = min(r.start for r in results)
    duration = max(r.end or r.start for r in results) - start
    latency = summarize(ok)
    n_in, n_out = latency["total_input_tokens"], latency["total_output_tokens"]
    good = sum((slo or SLO()).met(r) for r in ok)
    out: dict[str, float] = {
        "failed": len(results) - len(ok), "duration_s": duration,
        "mean_output_tokens": n_out / len(ok),
        "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
        "input_throughput": n_in / duration,
        "goodput": good / duration, "slo_attainment": good / len(results), **latency,
    }
    if price_per_hour is not None:
        weighted = input_weight * n_in + n_out
        per_hour = 3600 / duration            # runs of this run's length in an hour
        unit = price_per_hour / (weighted * per_hour)   # price of one weighted token
        out["cost_per_m_input_tokens"] = unit * input_weight * 1e6
        out["cost_per_m_output_tokens"] = unit * 1e6
    return out


def sweep(urls: str | Sequence[str], model: str, prompts: Sequence[Prompt],
          rates: Sequence[float], *, slo: SLO | None = None,
          price_per_hour: float | None = None, input_weight: float = 1.0,
          burstiness: float = 1.0, seed: int = 0, router: Router | None = None,
          on_point: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One run per offered rate (same prompts, same seed): the curve that shows the knee."""
    points = []
    for rate in rates:
        results = run_load(urls, model, prompts, rate=rate, burstiness=burstiness, seed=seed,
                           router=router)
        point = {"rate": rate, "metrics": run_metrics(results, slo, price_per_hour, input_weight),
                 "errors": sorted({r.error for r in results if not r.ok})[:3]}
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points


def knee(points: Sequence[dict[str, Any]]) -> int:
    """Index of the operating point with the most goodput (the lowest rate among ties): past
    it, more offered load buys queueing, not served-on-time requests."""
    best = max(p["metrics"]["goodput"] for p in points)
    return next(i for i, p in enumerate(points) if p["metrics"]["goodput"] >= 0.98 * best)


TABLE_COLUMNS = ("rate", "req/s", "out tok/s", "goodput", "TTFT p50", "TTFT p99", "TPOT p50",
                 "ITL p99", "E2E p99", "failed")


def table_rows(points: Sequence[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for p in points:
        m = p["metrics"]
        rows.append([f"{p['rate']:g}", m["request_throughput"], m["output_throughput"],
                     m["goodput"], m["p50_ttft_ms"], m["p99_ttft_ms"], m.get("p50_tpot_ms", "-"),
                     m.get("p99_itl_ms", "-"), m["p99_e2el_ms"], m["failed"]])
    return rows

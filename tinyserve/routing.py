"""Routing requests across replicas: round-robin, least-loaded, and by workload shape.

When one engine is not enough, the cheapest next step is a second copy of it (a *replica*)
behind a router. How the router picks matters for tail latency:

- **round-robin** ignores load: a replica that drew two long prompts in a row still gets the
  next request, which queues behind them;
- **least-loaded** sends each request where the fewest are in flight (what a load balancer's
  "least connections" does); it sees counts, not sizes;
- **by shape** gives long prompts replicas of their own, so a short chat request never waits
  behind a long prefill; the price is that the long replicas' share of the fleet is fixed.

The same policies drive the simulator (:func:`simulate`: several simulated engines, each on
its own virtual clock, advanced together in time order) and the load generator against real
server processes (:func:`server_processes`, passed as ``router=`` to
:func:`tinyserve.loadgen.run_load`). A policy is called as ``policy(prompt_len, in_flight)``
and returns a replica index; in-flight counts are the router's own bookkeeping.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .engine import Engine, EngineConfig
from .sequence import Sequence as Seq
from .simulator import CostModel, simulated_engine
from .workload import RequestSpec, prompt_ids

POLICIES = ("round-robin", "least-loaded", "shape")


class RoundRobin:
    def __init__(self) -> None:
        self.next = 0

    def __call__(self, prompt_len: int, in_flight: Sequence[int]) -> int:
        k = self.next % len(in_flight)
        self.next += 1
        return k


class LeastLoaded:
    def __call__(self, prompt_len: int, in_flight: Sequence[int]) -> int:
        return min(range(len(in_flight)), key=lambda k: in_flight[k])   # lowest index on ties


class ByShape:
    """Prompts of ``long_prompt`` tokens or more go to the first ``long_replicas`` replicas,
    the rest to the others; least-loaded within each group."""

    def __init__(self, long_prompt: int = 256, long_replicas: int = 1) -> None:
        self.long_prompt, self.long_replicas = long_prompt, long_replicas

    def __call__(self, prompt_len: int, in_flight: Sequence[int]) -> int:
        if len(in_flight) <= self.long_replicas:
            raise ValueError(f"shape routing keeps {self.long_replicas} replica(s) for long "
                             f"prompts and needs at least one more; got {len(in_flight)}")
        group = (range(self.long_replicas) if prompt_len >= self.long_prompt
                 else range(self.long_replicas, len(in_flight)))
        return min(group, key=lambda k: in_flight[k])


def make_router(name: str, long_prompt: int = 256, long_replicas: int = 1) -> Any:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "shape":
        return ByShape(long_prompt, long_replicas)
    raise ValueError(f"unknown routing policy {name!r}; choose one of: {', '.join(POLICIES)}")


def prompt_router(policy: Any) -> Any:
    """Adapt a policy to the load generator's ``router(prompt, in_flight)`` signature."""
    return lambda prompt, in_flight: policy(prompt.prompt_tokens, in_flight)


def simulate(specs: Sequence[RequestSpec], policy: Any, replicas: int, config: EngineConfig,
             cost: CostModel | None = None, vocab_size: int = 4096,
             seed: int = 0) -> tuple[list[Seq], list[int]]:
    """Serve ``specs`` on ``replicas`` simulated engines behind ``policy``.

    Before each arrival, every engine is stepped until its virtual clock reaches the arrival
    time (an idle one jumps to it), so the router sees each replica's load as it is at that
    moment. Returns the sequences (in spec order) and the replica each request went to."""
    if replicas < 1:
        raise ValueError(f"need at least one replica, got {replicas}")
    engines = [simulated_engine(config, cost) for _ in range(replicas)]
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival)
    seqs: list[Seq | None] = [None] * len(specs)
    where = [0] * len(specs)
    for i in order:
        t = specs[i].arrival
        for e in engines:
            _advance(e, t)
        k = policy(specs[i].prompt_len, [e.num_running + e.num_waiting for e in engines])
        where[i] = k
        seqs[i] = engines[k].add_request(prompt_ids(specs[i], i, vocab_size, seed),
                                         specs[i].output_len, request_id=f"r{i}", arrival=t)
    for e in engines:
        while e.has_unfinished():
            e.step()
    return [s for s in seqs if s is not None], where


def _advance(engine: Engine, t: float) -> None:
    while engine.has_unfinished() and engine.now() < t:
        engine.step()
    if not engine.has_unfinished():
        engine.executor.wait_until(t)


# ---- real replicas: server processes on loopback -------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with code {proc.returncode} "
                               f"before it became healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server at {url} did not answer /health within {timeout_s:g} s")


@contextmanager
def server_processes(n: int = 1, args: Sequence[str] = (), threads: int = 1,
                     timeout_s: float = 120.0) -> Iterator[list[str]]:
    """Start ``n`` ``python -m tinyserve serve`` processes on free loopback ports (each with
    ``threads`` torch threads), yield their base URLs, stop them at the end (SIGTERM: they
    drain, then exit)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    procs, urls = [], []
    try:
        for _ in range(n):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tinyserve", "serve", "--port", str(port), *args],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs):
            wait_healthy(url, timeout_s, proc)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def local_server(model_name: str = "target", **app_kwargs: Any) -> Iterator[tuple[str, Any]]:
    """Our server in a thread of this process on a free loopback port: yields ``(url, app)``
    (``app.state.tinyserve["engine"]`` is the live engine) and shuts it down at the end.
    Handy in a notebook or a test; for measurements prefer :func:`server_processes`, where
    the client does not share the interpreter with the engine."""
    import threading

    import uvicorn

    from .server import create_app
    app = create_app(model_name, **app_kwargs)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="tinyserve-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server thread did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        if thread.is_alive():
            raise RuntimeError("the server thread did not shut down within 30 s")

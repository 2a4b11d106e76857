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
server processes (:func:`tinyserve.serving.local_servers.server_processes`, passed as ``router=``
to :func:`tinyserve.loadgen.generator.run_load`). A policy is called as ``policy(prompt_len, in_flight)``
and returns a replica index; in-flight counts are the router's own bookkeeping.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..engine import Engine, EngineConfig
from ..sequence import Sequence as Seq
from ..simulator import CostModel, simulated_engine
from ..workload import RequestSpec, prompt_ids

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

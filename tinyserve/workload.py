"""Request workloads: when requests arrive and how long their prompts and outputs are.

Arrivals are **Poisson** (independent requests at a mean rate: exponential gaps) or
**bursty** (gamma gaps with the same mean but a shape below 1, so requests bunch together,
as they do behind a shared front end or a batch job); ``burstiness`` is the gamma shape, 1
being Poisson. Lengths come from small distribution objects (fixed, uniform, log-normal, a
mixture such as "mostly chat, a few very long documents"). Everything is drawn from one
seeded ``numpy`` generator, so a workload is the same list every time.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestSpec:
    arrival: float        # seconds after the start of the run
    prompt_len: int
    output_len: int
    prefix_group: int | None = None   # requests of one group share their first prefix_len tokens
    prefix_len: int = 0


class Lengths:
    """A length distribution; ``sample(rng, n)`` returns n ints >= 1."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class Fixed(Lengths):
    value: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value)


@dataclass(frozen=True)
class Uniform(Lengths):
    low: int
    high: int   # inclusive

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n)


@dataclass(frozen=True)
class LogNormal(Lengths):
    """Long-tailed lengths around ``median``, clipped to [low, high]."""

    median: float
    sigma: float
    low: int = 1
    high: int = 1 << 20

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.lognormal(np.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(x), self.low, self.high).astype(int)


@dataclass(frozen=True)
class Mixture(Lengths):
    """With probability ``weights[i]`` a length from ``parts[i]``."""

    parts: tuple[Lengths, ...]
    weights: tuple[float, ...]

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        w = np.asarray(self.weights, dtype=float)
        which = rng.choice(len(self.parts), size=n, p=w / w.sum())
        draws = [p.sample(rng, n) for p in self.parts]
        return np.choose(which, draws)


def arrival_times(n: int, rate: float, rng: np.random.Generator, burstiness: float = 1.0,
                  ) -> np.ndarray:
    """n arrival times (s) at ``rate`` requests/s; ``rate = inf`` puts them all at t = 0."""
    if n < 0 or rate <= 0 or burstiness <= 0:
        raise ValueError("need n >= 0, rate > 0 and burstiness > 0")
    if np.isinf(rate):
        return np.zeros(n)
    # Gamma gaps with shape k and scale 1/(k*rate): mean 1/rate, CV 1/sqrt(k).
    gaps = rng.gamma(burstiness, 1.0 / (burstiness * rate), size=n)
    return np.cumsum(gaps) - gaps[0] if n else gaps


def make_workload(n: int, rate: float, prompt: Lengths, output: Lengths, *, seed: int = 0,
                  burstiness: float = 1.0, prefix_len: int = 0, prefix_groups: int = 1,
                  ) -> list[RequestSpec]:
    """``n`` requests; with ``prefix_len`` > 0 each belongs to one of ``prefix_groups``
    groups sharing that many leading tokens (a system prompt), before its own prompt."""
    rng = np.random.default_rng(seed)
    times = arrival_times(n, rate, rng, burstiness)
    p, o = prompt.sample(rng, n), output.sample(rng, n)
    groups = rng.integers(0, prefix_groups, size=n) if prefix_len else [None] * n
    return [RequestSpec(float(t), int(pl) + prefix_len, int(ol),
                        None if g is None else int(g), prefix_len)
            for t, pl, ol, g in zip(times, p, o, groups)]


def prompt_ids(spec: RequestSpec, index: int, vocab_size: int, seed: int = 0) -> list[int]:
    """Deterministic token ids for a request: its group's shared prefix, then its own tokens.

    Ids 0-5 are the tokenizer's special tokens, so they are avoided."""
    low = 6 if vocab_size > 16 else 0
    own = np.random.default_rng([seed, index]).integers(low, vocab_size,
                                                        spec.prompt_len - spec.prefix_len)
    if spec.prefix_group is None:
        return own.tolist()
    shared = np.random.default_rng([seed, 1 << 30, spec.prefix_group]).integers(
        low, vocab_size, spec.prefix_len)
    return shared.tolist() + own.tolist()


def describe(specs: Sequence[RequestSpec]) -> str:
    """One line: count, duration, offered rate, prompt and output length ranges."""
    if not specs:
        return "no requests"
    span = specs[-1].arrival - specs[0].arrival
    p = [s.prompt_len for s in specs]
    o = [s.output_len for s in specs]
    rate = f"{(len(specs) - 1) / span:.1f} req/s" if span > 0 else "all at once"
    return (f"{len(specs)} requests over {span:.1f} s ({rate}); prompts {min(p)}-{max(p)} "
            f"(median {int(np.median(p))}), outputs {min(o)}-{max(o)} (median {int(np.median(o))})")

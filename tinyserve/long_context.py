"""Decode at long context: where a step's KV-cache reads reach and pass its weight reads.

A batch-1 decode step reads every weight once and every cached key and value of its row once.
The weights are fixed; the cache grows by ``2 x layers x kv_heads x head_dim`` numbers a token
(:func:`~tinyserve.kv_cache.kv_bytes_per_token`), so past some context the cache, not the
weights, is most of what a step reads: the *crossover*
(:func:`~tinyserve.kv_cache.kv_crossover_tokens`), weight bytes over KV bytes a token. Past
it, the KV reads set a step's time (Sun et al., TriForce, arXiv:2404.11912: the weights and
the KV cache are decode's two memory bottlenecks, and the KV cache's grows with
the context). The two levers the course teaches cut that term: fewer KV heads (multi-query
and grouped-query attention; Pope et al., arXiv:2211.05102: multi-query attention's smaller
cache allowed up to 32x longer contexts) and fewer bytes a number (an int8 KV cache, which
saves reads only where attention reads the int8 values itself: vLLM's and SGLang's
quantized-KV-cache pages say an unfused dequantization brings no latency gain or a loss).

Timing a step at 50k tokens needs a cache holding 50k tokens, not a 50k-token prefill:
:func:`fill_cache` writes given keys and values into a cache as a prefill would leave them
(the row lengths set, every slot visible), and :func:`fill_random` writes seeded random ones.
A step's time does not depend on what the keys hold (attention reads every slot whatever
their values), so random ones time the same step; tests/test_kv_regime.py checks that a
cache filled with a real prefill's keys gives that prefill's decode logits.

Measured steps at several contexts fit a line, ``time = fixed + context x per_token``
(:func:`fit_context_steps`): the fixed part is the step at no context (the weights, and what a
step pays once), the slope what each cached token adds (its KV reads). Their quotient is the
*measured* crossover, the context where the KV part of the step equals the fixed part; over
the predicted one it is the rate the step reads its KV cache at over the rate it reads its
weights at (:class:`ContextFit`). ``bench scale_long_context`` measures both.
"""
from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import ModelConfig
from .kv_cache import KVCache

#: Tokens a block of random keys covers; longer caches repeat it (writing is a copy, where
#: drawing 50k tokens' worth of random numbers would cost seconds on one thread).
FILL_BLOCK = 2048


def cache_bytes_per_token(cache: KVCache) -> float:
    """Bytes a cached token takes in ``cache`` (int8 values and their scales, for an int8
    cache): what a step reads per token of its row."""
    return cache.nbytes / (cache.batch_size * cache.max_seq)


def _check_fill(cache: KVCache, keys: Tensor, values: Tensor) -> int:
    want = (cache.config.num_hidden_layers, cache.batch_size, cache.config.num_key_value_heads)
    if keys.shape != values.shape or tuple(keys.shape[:3]) != want \
            or keys.shape[-1] != cache.config.head_dim:
        raise ValueError(f"keys and values must both be (layers, batch, kv_heads, context, "
                         f"head_dim) = ({', '.join(map(str, want))}, n, "
                         f"{cache.config.head_dim}); got {tuple(keys.shape)} and "
                         f"{tuple(values.shape)}")
    context = keys.shape[3]
    if not 1 <= context <= cache.max_seq - 1:
        raise ValueError(f"a cache of {cache.max_seq} slots holds at most {cache.max_seq - 1} "
                         f"tokens with room for one decode step; got {context}. Make the cache "
                         f"longer (max_seq) or fill fewer tokens.")
    return context


def _write(cache: KVCache, start: int, keys: Tensor, values: Tensor) -> None:
    """Keys and values (layers, B, kv, T, head_dim) into slots start..start+T, stored as the
    cache's own ``update`` stores them (an int8 cache quantizes each token's head vector)."""
    end = start + keys.shape[3]
    if hasattr(cache, "k_scale"):          # tinyserve.quant.Int8KVCache: int8 + a scale each
        from .quant import quantize_rows
        for store, scales, x in ((cache.k, cache.k_scale, keys), (cache.v, cache.v_scale, values)):
            q, s = quantize_rows(x)
            store[:, :, :, start:end] = q
            scales[:, :, :, start:end] = s
    else:
        cache.k[:, :, :, start:end] = keys
        cache.v[:, :, :, start:end] = values


def _set_lengths(cache: KVCache, context: int) -> None:
    # The public bookkeeping a prefill leaves: every row holds ``context`` tokens. rewind()
    # checks the lengths and rebuilds each slot's position from them.
    cache.lengths = [context] * cache.batch_size
    cache.rewind(cache.lengths)


@torch.inference_mode()
def fill_cache(cache: KVCache, keys: Tensor, values: Tensor) -> None:
    """Write ``keys`` and ``values`` (layers, batch, kv_heads, n, head_dim), already rotated
    as the model caches them, into slots 0..n-1 of every row, and set each row's length to n:
    the state a prefill of n tokens leaves, without running one."""
    context = _check_fill(cache, keys, values)
    _write(cache, 0, keys.to(cache.k.device), values.to(cache.k.device))
    _set_lengths(cache, context)


@torch.inference_mode()
def fill_random(cache: KVCache, context: int, seed: int = 0) -> None:
    """Fill every row with ``context`` tokens of seeded random keys and values (a standard
    normal, the scale of the model's normalised activations), no prefill run: a block of
    :data:`FILL_BLOCK` tokens drawn once and repeated along the row."""
    if not 1 <= context <= cache.max_seq - 1:
        raise ValueError(f"a cache of {cache.max_seq} slots holds at most {cache.max_seq - 1} "
                         f"tokens with room for one decode step; got {context}. Make the cache "
                         f"longer (max_seq) or fill fewer tokens.")
    cfg = cache.config
    dtype = cache.dtype if hasattr(cache, "k_scale") else cache.k.dtype
    shape = (cfg.num_hidden_layers, cache.batch_size, cfg.num_key_value_heads,
             min(context, FILL_BLOCK), cfg.head_dim)
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(shape, generator=gen).to(cache.k.device, dtype)
    values = torch.randn(shape, generator=gen).to(cache.k.device, dtype)
    for start in range(0, context, FILL_BLOCK):
        width = min(FILL_BLOCK, context - start)
        _write(cache, start, keys[:, :, :, :width], values[:, :, :, :width])
    _set_lengths(cache, context)


def token_bytes_of(cfg: ModelConfig, cache_cls: type[KVCache] = KVCache,
                   dtype: torch.dtype = torch.float32) -> float:
    """Bytes a cached token takes in a ``cache_cls`` cache for ``cfg`` whose attention works in
    ``dtype``: ``dtype``'s size a number in a float cache, 1 byte and a share of a 4-byte scale
    in the int8 one (read off a one-slot cache, so any cache class answers for itself)."""
    return cache_bytes_per_token(cache_cls(cfg, 1, 1, dtype=dtype))


@dataclass(frozen=True)
class StepCase:
    """One thing to time: ``model``'s batch-1 decode step with ``context`` tokens cached in a
    ``cache_cls`` cache (filled directly)."""
    model: torch.nn.Module
    context: int
    cache_cls: type[KVCache] = KVCache


def prepared_cache(case: StepCase, n: int = 1, seed: int = 0) -> KVCache:
    """A cache for ``case``: room for ``n`` steps past its context, filled directly with
    seeded random keys and values up to the context (:func:`fill_random`)."""
    window = case.model.config.max_position_embeddings
    if case.context + n > window:
        raise ValueError(f"{case.context} cached tokens + {n} steps do not fit the context "
                         f"window of {window}; use a long-context model "
                         f"(load_model(\"bandwidth-long\")) or a shorter context.")
    cache = case.cache_cls.for_model(case.model, 1, case.context + n)
    fill_random(cache, case.context, seed)
    return cache


@torch.no_grad()
def steps_in_turns(cases: dict[str, StepCase], n: int = 4, rounds: int = 3,
                   seed: int = 0) -> dict[str, float]:
    """Seconds per decode step of each case: every case's cache filled directly once, then
    ``n`` eager steps a run (each step's greedy token fed to the next, the cache rewound to
    its context first), the cases in turns for ``rounds`` rounds after one untimed round
    (:func:`tinyserve.device.in_turns`: a busy spell hits every case alike), the fastest run
    of each kept (other programs only ever slow a run down)."""
    from .device import clock, in_turns
    from .generate import decode_step
    caches = {name: prepared_cache(case, n, seed) for name, case in cases.items()}

    def run(name: str) -> float:
        case, cache = cases[name], caches[name]
        cache.rewind([case.context])
        tokens = torch.zeros(1, dtype=torch.long, device=case.model.device)
        start = clock(tokens.device)
        for _ in range(n):
            tokens = decode_step(case.model, tokens, None, cache).argmax(-1)
        return (clock(tokens.device) - start) / n

    runs = in_turns({name: (lambda name=name: run(name)) for name in cases}, rounds)
    return {name: min(seconds) for name, seconds in runs.items()}


def context_steps(model: torch.nn.Module, contexts: list[int], *,
                  cache_cls: type[KVCache] = KVCache, n: int = 4, rounds: int = 3,
                  seed: int = 0) -> dict[int, float]:
    """Seconds per batch-1 decode step of ``model`` at each of ``contexts``
    (:func:`steps_in_turns`), by context."""
    cases = {str(c): StepCase(model, c, cache_cls) for c in contexts}
    return {int(c): s for c, s in steps_in_turns(cases, n, rounds, seed).items()}


@dataclass(frozen=True)
class ContextFit:
    """``time = fixed_s + context x per_token_s``, fitted to decode steps at several contexts.

    ``fixed_s`` is what a step costs with nothing cached (reading the weights, and dispatch);
    ``per_token_s`` what each cached token adds (reading its keys and values, and its share of
    the attention arithmetic)."""
    fixed_s: float
    per_token_s: float

    @property
    def crossover(self) -> float:
        """The context where the KV part (``context x per_token_s``) equals the fixed part."""
        return self.fixed_s / self.per_token_s if self.per_token_s > 0 else float("inf")

    def kv_s(self, context: int) -> float:
        """The KV part of a step at ``context`` by the fit."""
        return context * self.per_token_s

    def read_rates(self, weight_bytes: float, kv_token_bytes: float) -> tuple[float, float]:
        """Bytes per second of the weights (over the fixed part) and of the KV cache (over the
        per-token part). Their ratio, KV over weights, is measured crossover / predicted."""
        return weight_bytes / self.fixed_s, kv_token_bytes / self.per_token_s


def fit_context_steps(steps: dict[int, float]) -> ContextFit:
    """The line through step seconds by context (at least two contexts): the slope is the
    median of the slopes between every pair of points and the intercept the median of what
    each point leaves (Theil-Sen), so one point slowed by another program cannot bend it."""
    if len(steps) < 2:
        raise ValueError(f"a fit needs steps at two contexts or more, got {sorted(steps)}")
    slope = statistics.median((steps[b] - steps[a]) / (b - a)
                              for a, b in itertools.combinations(sorted(steps), 2))
    fixed = statistics.median(s - slope * n for n, s in steps.items())
    return ContextFit(fixed, slope)

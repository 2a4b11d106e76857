"""The measurements chapters 2 and 3 take at both scales: the shipped target and the
bandwidth-scale model (:mod:`tinyserve.scale`), side by side, against this machine's own
ceilings.

Each sweep returns plain numbers (seconds, rows); the chapters print them, draw them and name
the regime from them with :func:`regime` (the course's one rule, from
:mod:`tinyserve.workbook.roofline_lab`, re-exported here with :func:`describe_regime`).
Timings are the fastest of a few runs of :func:`tinyserve.device.timings`, for the reason
:func:`tinyserve.roofline.memory_bandwidth` gives: other programs only ever slow a run down.
Tests (``tests/test_scale_sweeps.py``) check shapes and invariants at a small size, never a time.
"""
from __future__ import annotations

from dataclasses import dataclass
import math

import torch
import torch.nn.functional as F

from .. import roofline
from ..config import ModelConfig
from ..device import timings
from ..generate import decode_step, prefill
from ..kv_cache import KVCache
from ..roofline import CEILING_MATMUL_N  # noqa: F401 - the chapters read it from here too
from ..roofline import decode_cost, flop_ceiling, matmul_flops, read_bandwidth
from .roofline_lab import cache_bytes
from .roofline_lab import describe_regime, regime  # noqa: F401 - chapters 2 and 3 import them here


def ceiling_ways(device: torch.device | str, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """The FLOP ceiling's matmul timed each way torch offers (:func:`~tinyserve.roofline.
    matmul_ways` at :data:`CEILING_MATMUL_N` for ``device``): :func:`flop_ceiling` is the fastest
    of these. Chapter 1 prints each: on some CPUs MKL's ``a @ b``, which eager ``F.linear``
    calls, runs at less than half oneDNN's rate, and an eager prefill's regime then names a
    kernel slower than the machine's best."""
    device = torch.device(device)
    return roofline.matmul_ways(device, dtype, CEILING_MATMUL_N.get(device.type, 1024))


@dataclass(frozen=True)
class Ceilings:
    """What this machine can move and multiply, measured now on one device, and on how many
    torch threads: on a CPU both ceilings (and so the ridge) move with the thread count."""
    bandwidth: float       # bytes/s: the fastest way of reading a buffer far beyond the cache
    way: str               # which way that was (sum, copy or matvec; roofline.ReadBandwidth)
    flop_rate: float       # FLOP/s of a large square matmul in the model's dtype
    threads: int = 0       # torch threads when measured (0: not recorded)

    @property
    def ridge(self) -> float:
        """FLOPs the machine can do in the time it reads one byte: below this arithmetic
        intensity a kernel is memory-bound, above it compute-bound."""
        return self.flop_rate / self.bandwidth

    def describe(self) -> str:
        """The two ceilings and the ridge, with the thread count they hold for."""
        threads = f" on {self.threads} torch thread{'s' if self.threads != 1 else ''}" \
            if self.threads else ""
        return (f"read {self.bandwidth / 1e9:.1f} GB/s ({self.way}), matmul "
                f"{self.flop_rate / 1e9:,.0f} GFLOP/s: ridge {self.ridge:.1f} FLOP/byte{threads}")


def measure_ceilings(device: torch.device | str, dtype: torch.dtype = torch.float32,
                     nbytes: int | None = None, n: int | None = None) -> Ceilings:
    """:class:`Ceilings` on ``device``: the read bandwidth over ``nbytes`` (by default, as in
    chapter 1, 8x the last-level cache and at least 256 MiB on a CPU; 1 GiB on a GPU, far past
    its L2) and the FLOP rate of an ``n x n`` matmul in ``dtype`` (by default
    :func:`flop_ceiling`'s), on the calling process's torch threads."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    nbytes = nbytes or (2**30 if gpu else max(256 * 2**20, 8 * cache_bytes(device)[0]))
    read = read_bandwidth(device, nbytes)
    rate = matmul_flops(device, dtype, n) if n else flop_ceiling(device, dtype)
    return Ceilings(read.best, read.fastest_way, rate, torch.get_num_threads())


def recompute_flops(cfg: ModelConfig, context: int) -> float:
    """FLOPs of a forward pass over ``context + 1`` tokens (the step at position ``context``
    without a cache): token ``i`` attends over ``i`` earlier positions."""
    return float(sum(cfg.flops_per_token(i) for i in range(context + 1)))


@dataclass(frozen=True)
class CacheTiming:
    """One decode step at a context length, with and without the KV cache (seconds)."""
    context: int
    recompute_s: float     # a full forward over context + 1 tokens
    cached_s: float        # one decode_step against a cache holding `context` tokens

    @property
    def ratio(self) -> float:
        return self.recompute_s / self.cached_s


@torch.inference_mode()
def cache_vs_recompute(model: torch.nn.Module, contexts: list[int], repeats: int = 3,
                       seed: int = 0) -> list[CacheTiming]:
    """The step at each of ``contexts`` timed both ways, fastest of ``repeats`` each.

    One prefill of the longest context fills the cache (it also warms the model up); the
    shorter ones rewind it, longest first, since a rewind only forgets."""
    contexts = sorted(set(contexts), reverse=True)
    cfg, device = model.config, model.device
    longest = contexts[0]
    if longest + 1 > cfg.max_position_embeddings:
        raise ValueError(f"context {longest} + 1 token exceeds the model's window "
                         f"({cfg.max_position_embeddings}); pass shorter contexts")
    ids = torch.randint(0, cfg.vocab_size, (1, longest + 1),
                        generator=torch.Generator().manual_seed(seed)).to(device)
    cache = KVCache.for_model(model, 1, longest + 1)
    prefill(model, ids[:, :longest], cache)
    out = []
    for n in contexts:
        recompute = min(timings(lambda: model(ids[:, :n + 1]), device, repeats, warmup=0))
        position = torch.tensor([n], device=device)
        cached = min(timings(lambda: decode_step(model, ids[:, n], position, cache), device,
                             repeats, warmup=0, setup=lambda: cache.rewind([n])))
        out.append(CacheTiming(n, recompute, cached))
    return out[::-1]


def step_floors(model: torch.nn.Module, ceilings: Ceilings, context: int, batch: int = 1,
                cache: int | None = None) -> tuple[float, float]:
    """(memory, compute) floors in seconds of one cached decode step of ``batch`` rows with
    ``context`` cached tokens each. The memory floor is 0 when the step's bytes fit in the
    last-level cache (``cache`` bytes, e.g. from
    :func:`tinyserve.workbook.roofline_lab.cache_bytes`): the reads then need not reach memory."""
    cost = decode_cost(model, batch, context)
    fits = cache is not None and cost.bytes <= cache
    return (0.0 if fits else cost.bytes / ceilings.bandwidth), cost.flops / ceilings.flop_rate


def recompute_floors(model: torch.nn.Module, ceilings: Ceilings, context: int,
                     cache: int | None = None) -> tuple[float, float]:
    """(memory, compute) floors in seconds of a forward over ``context + 1`` tokens: the
    weights are read once for all the tokens (0 when they fit in ``cache`` bytes), and
    every token does its own FLOPs (:func:`recompute_flops`)."""
    weights = decode_cost(model, 1, 0).weight_bytes
    fits = cache is not None and weights <= cache
    return ((0.0 if fits else weights / ceilings.bandwidth),
            recompute_flops(model.config, context) / ceilings.flop_rate)


def row_sweep(model: torch.nn.Module, rows: list[int], context: int = 16, steps: int = 4,
              repeats: int = 3, seed: int = 0) -> dict[int, float]:
    """Seconds per eager decode step at each batch size in ``rows`` (each row with
    ``context`` seeded random prompt tokens): :func:`tinyserve.roofline.row_sweep`, ``steps``
    steps a run, the fastest of ``repeats`` runs."""
    ids = torch.randint(6, model.config.vocab_size, (max(rows), context),
                        generator=torch.Generator().manual_seed(seed)).to(model.device)
    sweep = roofline.row_sweep(model, ids, rows, n=steps, repeats=repeats)
    return {B: point.eager_s for B, point in sweep.items()}


@torch.inference_mode()
def linear_seconds(rows: list[int], out_features: int = 16384, in_features: int = 4096,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   repeats: int = 5, seed: int = 0) -> dict[int, float]:
    """Seconds of one eager ``F.linear`` of ``r`` rows through one ``(out, in)`` weight, for
    each ``r`` in ``rows``: the fastest of ``repeats`` after a warm-up. The default weight is
    256 MiB in fp32, far past a laptop's last-level cache, so every call reads it from memory;
    the FLOPs of a few rows are small next to that read, so an ideal kernel costs about the
    same at 1 and at 2 rows."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g).to(device=device, dtype=dtype)
    out = {}
    for r in rows:
        x = torch.randn(r, in_features, generator=g).to(device=device, dtype=dtype)
        out[r] = min(timings(lambda: F.linear(x, weight), device, repeats))   # after a warm-up
    return out


@dataclass(frozen=True)
class LinearRates:
    """One ``(out, in)`` weight multiplied by a few rows, each way this torch offers (``eager``:
    ``F.linear``, MKL's ``sgemm`` on x86 CPUs; ``onednn``: oneDNN's linear over the weight
    packed once, where available), seconds by rows. Two costs in one table: the one-row time
    (the weight's read, plus any per-call copy) and the slope past it, each added row's FLOPs
    at the rate the library's kernel reaches for this shape (:meth:`per_row_flops`)."""
    out_features: int
    in_features: int
    seconds: dict[str, dict[int, float]]

    def per_row_flops(self, way: str, lo: int, hi: int) -> float:
        """FLOP/s of the rows from ``lo`` to ``hi``: their extra FLOPs over their extra time
        (``inf`` if the time did not grow)."""
        t = self.seconds[way]
        extra = t[hi] - t[lo]
        flops = 2 * (hi - lo) * self.out_features * self.in_features
        return math.inf if extra <= 0 else flops / extra


@torch.inference_mode()
def linear_rates(rows: list[int], out_features: int = 16384, in_features: int = 4096,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 repeats: int = 5, seed: int = 0) -> LinearRates:
    """:func:`linear_seconds` each way (eager ``F.linear``, and on a CPU whose torch has it
    oneDNN's linear over the weight packed once, :mod:`tinyserve.backends.packed`), the same
    weight and inputs, the fastest of ``repeats`` after a warm-up."""
    from ..backends import packed
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g).to(device=device, dtype=dtype)
    xs = {r: torch.randn(r, in_features, generator=g).to(device=device, dtype=dtype)
          for r in rows}
    ways = {"eager": lambda x: F.linear(x, weight)}
    if device.type == "cpu" and dtype == torch.float32 and packed.available():
        laid_out = packed.pack(weight, max(rows))
        ways["onednn"] = lambda x: packed.linear(x, laid_out)
    seconds = {name: {r: min(timings(lambda: fn(xs[r]), device, repeats)) for r in rows}
               for name, fn in ways.items()}
    return LinearRates(out_features, in_features, seconds)


@dataclass(frozen=True)
class Datasheet:
    """A GPU's peak figures as its maker's datasheet lists them (not measured here)."""
    name: str
    bf16_flops: float      # dense BF16 tensor-core FLOP/s (listed x2 "with sparsity")
    bandwidth: float       # HBM bytes/s

    @property
    def ridge(self) -> float:
        return self.bf16_flops / self.bandwidth


#: NVIDIA's H100 and H200 datasheets, SXM boards: 1,979 BF16 tensor TFLOPS with 2:4
#: sparsity (989 dense), HBM3 at 3.35 TB/s and HBM3e at 4.8 TB/s.
GPU_DATASHEETS = (Datasheet("H100 SXM", 989e12, 3.35e12),
                  Datasheet("H200 SXM", 989e12, 4.8e12))

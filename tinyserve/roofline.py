"""The decode roofline: what one decode step must read and compute, against what the machine can
move and multiply. One measurement module, shared by the bench suites and the chapters.

A decode step reads every weight once, whatever the batch, plus each row's cached keys and
values; it does about 2 FLOPs per weight per row. So at batch ``B`` and context ``n``:

    max(bytes / bandwidth, flops / flop_rate) <= time ~ bytes / bandwidth + flops / flop_rate

The max is the roofline of Williams et al. (CACM 2009): the bound of a step whose reads and
arithmetic overlap perfectly. The sum is the bound with no overlap at all, each waiting for the
other. A GPU with many warps in flight hides one behind the other and comes close to the max
(Pope et al., arXiv:2211.05102); a CPU core running one GEMM after another follows the sum
more closely. :func:`bounds_seconds` returns both, and every chapter prints both beside a
measurement and says which the machine followed (:func:`nearer_bound`).

The memory bound is flat in ``B`` until the KV reads grow; the compute bound grows linearly
with ``B``. Where they cross is the batch at which decode stops being memory-bound. A step
far above both is either *kernel-bound* (its GEMMs alone run below the roof: a ceiling
problem) or *overhead-bound* (Python, dispatch, kernel launches outside the kernels' useful
work); :func:`tinyserve.workbook.roofline_lab.regime` tells them apart with a probe of the
step's kernels.

Both machine figures are *measured* here, not taken from a datasheet: the bandwidth as the
fastest of several ways to read a buffer far larger than the cache (:func:`read_bandwidth`: a
reduction, a copy counted read + write, a matrix-vector product; :func:`memory_bandwidth` is
the copy alone) and a large matmul for the FLOP rate (:func:`flop_ceiling`: one size per
device type, the fastest of the ways torch multiplies it there, :func:`matmul_ways`). The
course divides by one bandwidth everywhere, ``read_bandwidth(...).best``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
import math
from typing import Any

import torch
from torch import Tensor

from .backends.fast import compile_settings  # noqa: F401 - one definition, the loops' and the bench's
from .config import ModelConfig, parameter_count  # noqa: F401 - the chapters read it here too
from .device import timings


def memory_bandwidth(device: torch.device | str, nbytes: int = 512 * 2**20,
                     repeats: int = 7) -> float:
    """Bytes per second of a large copy, counted as STREAM counts it (``nbytes`` read plus
    ``nbytes`` written; write-allocate traffic not counted): the fastest of ``repeats``
    copies, on the calling process's torch threads. What these threads can copy, not the
    memory system's peak; the course's bandwidth reference is :func:`read_bandwidth`'s best.

    ``nbytes`` should be well above the last-level cache, or the figure is the cache's.
    The best run, not the median: on a shared machine other processes only ever slow a
    copy down, so the fastest one is the closest to what the memory can do, and two suites
    that measure a minute apart get the same figure."""
    device = torch.device(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / min(timings(lambda: dst.copy_(src), device, repeats))


def matmul_ways(device: torch.device | str, dtype: torch.dtype = torch.float32,
                n: int = 1024, repeats: int = 5) -> dict[str, float]:
    """FLOP/s of an ``n x n`` by ``n x n`` matmul (2 n^3 FLOPs) in ``dtype``, each way torch
    offers to multiply them here: ``aten`` (``a @ b``: MKL's ``sgemm`` in PyTorch's x86
    builds, cuBLAS on a GPU) and, for fp32 on a CPU whose torch has it, ``onednn`` (oneDNN's linear over
    ``b`` laid out once for its kernel, :mod:`~tinyserve.backends.packed`: what the fast
    path's eager passes run). Each the fastest of ``repeats``, for the reason
    :func:`memory_bandwidth` gives (load only slows a run down).

    Why two ways: the libraries are not equally fast on every CPU. On some, MKL's ``a @ b``
    runs at well under half of oneDNN's rate at every size; a ceiling from ``a @ b`` alone
    would there put the ridge at less than half its place and call a kernel "at the FLOP
    rate" that runs far below what the machine does. The returned dict holds both, so any
    machine shows its own gap (``bench scale`` prints the ceiling it takes)."""
    from .backends import packed
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ways = {"aten": 2 * n**3 / min(timings(lambda: a @ b, device, repeats))}
    if device.type == "cpu" and dtype == torch.float32 and packed.available():
        laid_out = packed.pack(b.t(), n)
        ways["onednn"] = 2 * n**3 / min(timings(lambda: packed.linear(a, laid_out), device,
                                                repeats))
    return ways


def matmul_flops(device: torch.device | str, dtype: torch.dtype = torch.float32,
                 n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n`` matmul in ``dtype``: the fastest of :func:`matmul_ways`, as the
    read bandwidth is the fastest of its ways (a kernel that beats it shows the reference was
    too slow, not the machine beaten)."""
    return max(matmul_ways(device, dtype, n, repeats).values())


#: The side of the square matmul that measures the FLOP ceiling, by device type: one way for
#: every chapter and suite (issue 38). On a CPU 1024 (2 GFLOP: tens of milliseconds on one
#: thread, past the size where the BLAS kernel reaches its rate); on a GPU 8192 (1.1 TFLOP),
#: since a smaller matmul is too short to fill every multiprocessor and reads below the peak.
CEILING_MATMUL_N = {"cpu": 1024, "cuda": 8192}


def flop_ceiling(device: torch.device | str, dtype: torch.dtype = torch.float32) -> float:
    """The FLOP ceiling every chapter and suite divides by: :func:`matmul_flops` of a
    :data:`CEILING_MATMUL_N` matmul on ``device``, in ``dtype``, on the calling threads (the
    fastest of :func:`matmul_ways`)."""
    device = torch.device(device)
    return matmul_flops(device, dtype, CEILING_MATMUL_N.get(device.type, 1024))


@dataclass(frozen=True)
class ReadBandwidth:
    """Bytes per second of several ways to read a buffer far larger than the cache.

    ``ways`` maps each way to its rate: ``sum`` (a reduction: reads each byte once),
    ``copy`` (each byte read once and written once, both counted: STREAM's convention, twice
    a ``bcopy`` count; a CPU that write-allocates also reads each destination line first,
    which no count here includes) and ``matvec`` (an fp32
    matrix-vector product: what a batch-1 decode step does with each weight). The machine
    can read at least as fast as the fastest of them; a decode step measured faster than
    ``best`` (an MBU above 1) means every reference here was too slow, not that the step
    beat the memory."""
    ways: dict[str, float]

    @property
    def best(self) -> float:
        return max(self.ways.values())

    @property
    def fastest_way(self) -> str:
        return max(self.ways, key=self.ways.__getitem__)


def read_bandwidth(device: torch.device | str, nbytes: int = 512 * 2**20,
                   repeats: int = 5) -> ReadBandwidth:
    """:class:`ReadBandwidth` over an ``nbytes`` fp32 buffer on ``device``: the fastest of
    ``repeats`` runs of each way (see :func:`memory_bandwidth` for why the fastest)."""
    device = torch.device(device)
    n = nbytes // 4
    buffer = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    ways = {"sum": nbytes / min(timings(buffer.sum, device, repeats))}
    dst = torch.empty_like(buffer)
    ways["copy"] = 2 * nbytes / min(timings(lambda: dst.copy_(buffer), device, repeats))
    del dst
    cols = 4096                              # long rows stream well (see model.fused_linear)
    matrix = buffer[: n - n % cols].view(-1, cols)
    vector = torch.ones(cols, dtype=torch.float32, device=device)
    ways["matvec"] = matrix.numel() * 4 / min(timings(lambda: matrix @ vector, device, repeats))
    return ReadBandwidth(ways)


@dataclass(frozen=True)
class DecodeCost:
    """Bytes and FLOPs of one decode step of a model at a batch size and context length."""
    weight_bytes: int
    kv_bytes: int          # every row's cached keys and values, read once
    flops: float

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes



def decode_cost_for(cfg: ModelConfig, weight_bytes: float, kv_element_bytes: float,
                    batch: int, context: int) -> DecodeCost:
    """One decode step of ``batch`` rows with ``context`` cached tokens each: the weights are
    read once whatever the batch, each row reads its own keys and values, and each row costs
    :meth:`ModelConfig.flops_per_token` (2 per matmul weight, plus attention)."""
    # K and V, per layer, per cached token, per KV head: head_dim numbers each
    kv = batch * 2 * cfg.num_hidden_layers * context * cfg.num_key_value_heads * cfg.head_dim \
        * kv_element_bytes
    return DecodeCost(int(weight_bytes), int(kv), float(batch * cfg.flops_per_token(context)))


def decode_cost(model: torch.nn.Module, batch: int, context: int) -> DecodeCost:
    """:func:`decode_cost_for` with a real model's bytes (int8 weights count as 1 byte, the
    tied embedding once) and its dtype for the cache."""
    from .quant import weight_bytes
    return decode_cost_for(model.config, weight_bytes(model), model.dtype.itemsize, batch, context)


def bounds_seconds(cost: DecodeCost, bandwidth: float, flop_rate: float) -> dict[str, float]:
    """The memory bound, the compute bound, the roofline (the larger: the bound with perfect
    overlap of reads and arithmetic) and the no-overlap bound (their sum), in seconds."""
    memory, compute = cost.bytes / bandwidth, cost.flops / flop_rate
    return {"memory_s": memory, "compute_s": compute, "roofline_s": max(memory, compute),
            "no_overlap_s": memory + compute}


#: The two bounds' keys in :func:`bounds_seconds`, by what they assume.
OVERLAP_KEYS = {"perfect overlap (max)": "roofline_s", "no overlap (sum)": "no_overlap_s"}


def nearer_bound(measured: float, perfect: float, none: float) -> str:
    """Which bound a measured figure follows: "perfect overlap (max)" or "no overlap (sum)",
    the nearer of ``perfect`` and ``none`` as a ratio (a time, or a ratio of two times)."""
    if min(measured, perfect, none) <= 0:
        raise ValueError(f"figures must be positive; got {measured!r}, {perfect!r}, {none!r}")
    off = {name: abs(math.log(measured / value))
           for name, value in (("perfect overlap (max)", perfect), ("no overlap (sum)", none))}
    return min(off, key=off.__getitem__)


def two_bounds(what: str, measured: float, perfect: float, none: float,
               fmt: str = "{:.2f}") -> str:
    """One line with a measured figure and both bounds' predictions of it, and the one this
    machine followed, e.g. "4 rows / 1: measured 1.25; perfect overlap (max) 1.00, no overlap
    (sum) 1.21: this machine followed the no-overlap sum"."""
    follows = nearer_bound(measured, perfect, none)
    word = "the no-overlap sum" if follows.startswith("no") else "the perfect-overlap max"
    return (f"{what}: measured {fmt.format(measured)}; perfect overlap (max) "
            f"{fmt.format(perfect)}, no overlap (sum) {fmt.format(none)}: this machine "
            f"followed {word}")


def crossover_batch(cfg: ModelConfig, weight_bytes: float, kv_element_bytes: float,
                    context: int, bandwidth: float, flop_rate: float) -> float:
    """The batch at which the compute bound overtakes the memory bound (``inf`` if never:
    when each row's KV reads cost more time than its FLOPs, decode stays memory-bound).

    compute(B) = B F / rate and memory(B) = (W + B kv) / bandwidth meet at
    B = (W / bandwidth) / (F / rate - kv / bandwidth)."""
    one = decode_cost_for(cfg, weight_bytes, kv_element_bytes, 1, context)
    per_row = one.flops / flop_rate - one.kv_bytes / bandwidth
    return math.inf if per_row <= 0 else (weight_bytes / bandwidth) / per_row


def roofline_knee(cfg: ModelConfig, weight_bytes: float, kv_element_bytes: float,
                  context: int, bandwidth: float, flop_rate: float,
                  factor: float = 1.5, overlap: bool = True) -> float:
    """The rows at which the bound's step time first reaches ``factor`` times one row's:
    the knee a learner predicts before sweeping the batch (``inf`` if never).

    With ``overlap`` the bound is the roofline, max(memory(B), compute(B)), both straight
    lines in B; it reaches the target where the first of them does. Without, it is the
    no-overlap sum, W / bandwidth + B (kv / bandwidth + F / rate): one straight line."""
    one = decode_cost_for(cfg, weight_bytes, kv_element_bytes, 1, context)
    if not overlap:
        per_row = one.kv_bytes / bandwidth + one.flops / flop_rate
        target = factor * bounds_seconds(one, bandwidth, flop_rate)["no_overlap_s"]
        return max(1.0, (target - weight_bytes / bandwidth) / per_row)
    target = factor * max(bounds_seconds(one, bandwidth, flop_rate)["roofline_s"], 0.0)
    crossings = [target * flop_rate / one.flops]                       # compute(B) = target
    if one.kv_bytes:
        crossings.append((target * bandwidth - weight_bytes) / one.kv_bytes)  # memory(B)
    return max(1.0, min(crossings))


def measured_knee(step_seconds: dict[int, float], factor: float = 1.5) -> float:
    """The fewest measured rows whose step costs ``factor`` times the one-row step or more,
    interpolated linearly between the two measured batch sizes around it (``inf`` if no
    measured batch gets there). ``step_seconds`` maps rows to seconds and must include 1."""
    if 1 not in step_seconds:
        raise ValueError("step_seconds needs the one-row step (key 1) to compare against")
    target = factor * step_seconds[1]
    rows = sorted(step_seconds)
    for lo, hi in zip(rows, rows[1:]):
        if step_seconds[hi] >= target:
            t_lo, t_hi = step_seconds[lo], step_seconds[hi]
            return hi if t_hi == t_lo else lo + (hi - lo) * (target - t_lo) / (t_hi - t_lo)
    return math.inf


def tp_bandwidth_bound(read_speedup: float, whole_bytes: float, shard_bytes: float,
                       ranks: int = 2) -> float:
    """The speed-up a memory-bound decode step split over ``ranks`` tensor-parallel ranks can
    reach, the course's one definition (chapter 7, ``bench scale``'s
    ``scale_tp2_vs_bandwidth_bound``): what the ranks read together against one process
    alone (``read_speedup``) times the share of the bytes the split saves, ``whole_bytes`` /
    (``ranks`` x ``shard_bytes``), below 1 where each rank keeps a whole replicated part (the
    embedding and LM head)."""
    if min(read_speedup, whole_bytes, shard_bytes) <= 0 or ranks < 1:
        raise ValueError("the read speed-up and both byte counts must be positive, ranks >= 1")
    return read_speedup * whole_bytes / (ranks * shard_bytes)


def mbu(cost: DecodeCost, bandwidth: float, step_seconds: float) -> float:
    """Model bandwidth utilisation: the memory bound / the measured step time.

    ``bandwidth`` is the course's one reference: :attr:`ReadBandwidth.best`, the fastest of
    the ways :func:`read_bandwidth` reads a buffer far past the cache, on the threads the step
    runs on. 1.0 = the step reads its bytes as fast as the fastest plain read; above 1, that
    reference was read too slowly (a busy moment), not the memory beaten."""
    return cost.bytes / bandwidth / step_seconds


# --- measured decode steps ----------------------------------------------------------------
Step = Callable[[Tensor, Tensor], Tensor]


def per_token_seconds(step: Step, first: Tensor, position: int, n: int, repeats: int,
                      reset: Callable[[], None]) -> float:
    """Time per step of ``n`` decode steps from ``position``, each step's greedy token fed to
    the next (a step cannot start before its input exists): the fastest of ``repeats`` runs
    (:func:`tinyserve.device.timings`, after one untimed run), ``reset`` before each.

    The fastest, as for the machine's ceilings (:func:`memory_bandwidth`): other programs
    only ever slow a run down, and a bound measured at the machine's best divided by a step
    measured at its median would understate the step's utilisation by however busy the
    machine happened to be."""
    def run() -> None:
        tokens, pos = first, torch.full_like(first, position)
        for _ in range(n):
            tokens = step(tokens, pos).argmax(-1)
            pos = pos + 1
    return min(timings(run, first.device, repeats, setup=reset)) / n


@torch.no_grad()
def eager_step_seconds(model: torch.nn.Module, prompts: Tensor, n: int = 16,
                       repeats: int = 3) -> float:
    """Seconds per eager decode step on the plain KV cache after prompts (B, T), as the loops
    run it: positions from the cache's host lengths (nothing read back from the device), the
    greedy token fed back, the fastest of ``repeats`` runs of ``n`` steps, the cache rewound
    before each (:func:`per_token_seconds`)."""
    from .generate import decode_step, prefill
    from .kv_cache import KVCache
    B, T = prompts.shape
    cache = KVCache.for_model(model, B, T + n)
    first = prefill(model, prompts, cache)[:, -1].argmax(-1)
    step: Step = lambda tokens, _pos: decode_step(model, tokens, None, cache)  # noqa: E731
    return per_token_seconds(step, first, T, n, repeats, lambda: cache.rewind([T] * B))


@torch.no_grad()
def compiled_step_seconds(model: torch.nn.Module, prompts: Tensor, n: int = 16,
                          repeats: int = 3, backend: str = "inductor", *,
                          mode: str | None = None, freezing: bool = False,
                          tokens: int | None = None) -> tuple[float, float]:
    """Seconds per compiled decode step after prompts (B, T), B a bucket size, the greedy
    token fed back, and the seconds its first call took (compiling, unless this bucket was
    compiled before). ``backend`` and ``mode`` are ``torch.compile``'s, ``freezing`` as in
    :func:`~tinyserve.backends.fast.compile_settings`; the decoder's window holds ``tokens`` positions per row (by
    default T + n; more leaves room for a later pass on the same decoder, which
    :func:`~tinyserve.backends.compiled.compiled_decoder` hands back when asked again)."""
    from .backends.compiled import compiled_decoder
    from .paths import cache_dir
    B, T = prompts.shape
    with compile_settings(freezing, B):         # as the loops compile B rows
        decoder = compiled_decoder(model, B, mode=mode, backend=backend,
                                   tokens=tokens or T + n, cache=cache_dir())
        if decoder.cache.batch_size != B:
            raise ValueError(f"time the compiled step at a bucket size, not {B}")
        first = decoder.prefill(prompts)[:, -1].argmax(-1)
        decoder.step(first, torch.full_like(first, T))   # compiles, if not yet
        seconds = per_token_seconds(decoder.step, first, T, n, repeats, lambda: None)
    return seconds, float(decoder.compile_seconds or 0.0)


@dataclass(frozen=True)
class RowPoint:
    """One batch size of :func:`row_sweep`: seconds per eager decode step, and given compile
    options the compiled step's seconds and its first call's (the compile)."""
    rows: int
    eager_s: float
    compiled_s: float | None = None
    compile_s: float | None = None


def row_sweep(model: torch.nn.Module, prompts: Tensor, rows: Iterable[int], n: int = 16,
              repeats: int = 3, *, compiled: dict[str, Any] | None = None,
              after: Callable[[RowPoint], None] | None = None) -> dict[int, RowPoint]:
    """A decode step against the rows in it: for each ``B`` in ``rows``, the first ``B`` rows
    of ``prompts`` (at least max(rows), T) timed eagerly (:func:`eager_step_seconds`) and,
    given ``compiled`` (:func:`compiled_step_seconds`'s options: ``backend``, ``mode``,
    ``freezing``, ``tokens``; each B a bucket size), compiled; ``n`` steps a run, the fastest
    of ``repeats`` runs. ``after(point)`` runs once each B is measured (a report line, dropping
    the compiled graphs before the next bucket). The one sweep the chapters and the bench
    suites run."""
    out = {}
    for B in rows:
        point = RowPoint(B, eager_step_seconds(model, prompts[:B], n, repeats))
        if compiled is not None:
            seconds, compile_s = compiled_step_seconds(model, prompts[:B], n, repeats,
                                                       **compiled)
            point = RowPoint(B, point.eager_s, seconds, compile_s)
        out[B] = point
        if after is not None:
            after(out[B])
    return out

"""Timing tensor- and pipeline-parallel runs: what each rank runs for ``bench parallel`` and
chapter 7's measurements.

Communication cost is only visible side by side with the work it accompanies, on a machine
whose load may change from second to second. So the single-process baseline and the split
runs take turns inside one launch (rank 0 runs the whole model while the others wait at a
barrier, then every rank runs its shard), and the pipeline's micro-batch counts take turns
within each repeat: whatever the load does, it falls on every variant alike.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..generate import clock, prefill
from ..kv_cache import KVCache
from .launch import launch, rank_device
from ..model import TinyLlama
from .tensor import CountingAllReduce, dist_all_reduce, shard_model
from .pipeline import Stage, Timeline, pipeline_forward, split_micro_batches


def phase_runners(model: torch.nn.Module, cache: KVCache,
                  ids: Tensor) -> dict[str, Callable[[], None]]:
    """Two timeable calls: a prefill over ``ids[:, :-1]``, and one decode step of the last
    token after it (run the prefill first). Each leaves the cache as it found it."""
    P = ids.shape[1] - 1

    def run_prefill() -> None:
        cache.reset()
        prefill(model, ids[:, :P], cache)

    @torch.inference_mode()
    def run_decode() -> None:
        # positions=None: the cache's own (host-side) lengths place the token at P, so the
        # step reads nothing back from the device (decode_step's explicit positions would)
        model(ids[:, P:], None, cache)
        cache.rewind([P])  # forget the step, so every repeat decodes at position P

    return {"prefill": run_prefill, "decode": run_decode}


def _seconds(fn: Callable[[], None], device: torch.device) -> float:
    start = clock(device)
    fn()
    return clock(device) - start


def _median_ms(seconds: list[float]) -> float:
    return 1e3 * sorted(seconds)[len(seconds) // 2]


@torch.no_grad()
def tp_bench_worker(rank: int, world_size: int, model: TinyLlama, ids: Tensor, repeats: int,
                    threads: int = 1) -> dict[str, float]:
    """One rank of the TP bench: median ms of a prefill over ``ids[:, :-1]`` and of a decode
    step after it, split over the ranks, and the share of that time inside all-reduces.

    Rank 0 also times the whole model alone (``single_*``), *interleaved* with the split runs:
    in each repeat it runs the whole model while the other ranks wait at a barrier, then all
    ranks run their shards. On a machine shared with other jobs the load changes from second
    to second; interleaving exposes both figures to the same moments. Last, the cost of one
    bare all-reduce of a decode step's hidden state (1 x 1 x hidden numbers).
    """
    torch.set_num_threads(threads)
    device = rank_device(rank)
    counter = CountingAllReduce()
    shard = shard_model(model, rank, world_size, counter).to(device)
    ids = ids.to(device)
    runs = {"split": phase_runners(shard, shard.new_cache(1, ids.shape[1]), ids)}
    if rank == 0:  # this process's own copy of the model: moving it changes nothing elsewhere
        whole = model.to(device)
        runs["single"] = phase_runners(whole, KVCache.for_model(whole, 1, ids.shape[1]), ids)
    out: dict[str, float] = {}
    for phase in ("prefill", "decode"):
        for run in runs.values():  # warm-up; the prefill leaves the prompt in the cache
            run["prefill"]()
            run[phase]()
        split, single, comm = [], [], 0.0
        for _ in range(repeats):
            dist.barrier()
            if rank == 0:
                single.append(_seconds(runs["single"][phase], device))
            dist.barrier()
            counter.reset()
            split.append(_seconds(runs["split"][phase], device))
            comm += counter.seconds
        out[f"{phase}_ms"] = _median_ms(split)
        out[f"{phase}_allreduce_share"] = comm / sum(split)
        if single:
            out[f"single_{phase}_ms"] = _median_ms(single)
    x = torch.zeros(1, 1, model.config.hidden_size, device=device)
    bare = []
    for _ in range(10 * repeats):
        dist.barrier()  # start together, so the figure is the transfer, not a peer's lag
        bare.append(_seconds(lambda: dist_all_reduce(x), device))
    out["allreduce_ms"] = _median_ms(bare)
    return out


@torch.no_grad()
def pp_bench_worker(rank: int, stages: int, model: TinyLlama, ids: Tensor,
                    micro_batch_counts: list[int], repeats: int,
                    threads: int = 1) -> dict[int, list[Timeline]]:
    """One stage of the bench: the timeline of every repeat, for each micro-batch count.
    The counts take turns within each repeat, so a shared machine's changing load falls on
    all of them alike."""
    torch.set_num_threads(threads)
    stage = Stage(model, rank, stages).to(rank_device(rank))
    chunks = {m: split_micro_batches(ids, m) for m in micro_batch_counts}
    out: dict[int, list[Timeline]] = {m: [] for m in micro_batch_counts}
    for m in micro_batch_counts:
        pipeline_forward(stage, chunks[m])  # warm-up
    for _ in range(repeats):
        for m in micro_batch_counts:
            dist.barrier()  # every stage starts the pass together
            out[m].append(pipeline_forward(stage, chunks[m])[1])
    return out


# ---------------------------------------------------------------------------- at scale

#: Each process's buffer for :func:`parallel_read_bandwidth`: far above any CPU's last-level
#: cache (tens of MB), so every pass comes from memory.
PARALLEL_READ_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ParallelBandwidth:
    """Read bandwidth of one process alone against ``processes`` reading at once, bytes/s.

    ``per_process[r]`` is what rank r read while all read together; ``aggregate`` is every
    rank's bytes over the span from the first start to the last end (so a rank that started
    late cannot inflate it). ``speedup`` (aggregate / single) bounds what splitting a
    memory-bound step's bytes across the processes can gain."""
    nbytes: int                  # each process's buffer
    way: str                     # "matvec" (what a decode step's linears do) or "sum"
    single: float
    per_process: tuple[float, ...]
    aggregate: float

    @property
    def processes(self) -> int:
        return len(self.per_process)

    @property
    def speedup(self) -> float:
        return self.aggregate / self.single


def _reader(buffer: Tensor, way: str) -> Callable[[], object]:
    if way == "sum":
        return buffer.sum
    if way == "matvec":  # as roofline.read_bandwidth: rows of 4096 numbers stream well
        cols = 4096
        matrix = buffer[: buffer.numel() - buffer.numel() % cols].view(-1, cols)
        vector = torch.ones(cols, dtype=buffer.dtype, device=buffer.device)
        return lambda: matrix @ vector
    raise ValueError(f"way must be 'matvec' or 'sum', got {way!r}")


@torch.no_grad()
def read_bandwidth_worker(rank: int, world_size: int, nbytes: int, way: str, repeats: int,
                          threads: int = 1) -> dict[str, list[float]]:
    """One rank of :func:`parallel_read_bandwidth`: per repeat, rank 0 reads its buffer alone
    (the others wait at a barrier), then every rank reads its own buffer, all started by one
    barrier. Returns ``perf_counter`` (start, end) pairs: one clock for every process of a
    machine (CLOCK_MONOTONIC on Linux), so the parent can line the ranks up."""
    torch.set_num_threads(threads)
    device = rank_device(rank)
    buffer = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    read = _reader(buffer, way)
    read()  # warm-up: page the buffer in, pick the kernel
    alone, together = [], []
    for _ in range(repeats):
        dist.barrier()
        if rank == 0:
            start = clock(device)
            read()
            alone.append((start, clock(device)))
        dist.barrier()
        start = clock(device)
        read()
        together.append((start, clock(device)))
    return {"alone": alone, "together": together}


def parallel_read_bandwidth(processes: int = 2, nbytes: int = PARALLEL_READ_BYTES,
                            way: str = "matvec", repeats: int = 5,
                            timeout_s: float = 120.0) -> ParallelBandwidth:
    """How much more a machine reads when ``processes`` processes read at once, each its own
    ``nbytes`` buffer on one torch thread: the ceiling on what splitting a memory-bound step's
    bytes over that many processes can gain. Fastest of ``repeats`` for each figure.

    On a CPU the processes share one memory bus: if one core nearly saturates it, two read
    hardly more than one. Under nccl (a GPU per rank) each rank reads its own device memory."""
    _reader(torch.empty(0), way)  # a bad ``way`` fails here, not in every rank
    ranks = launch(read_bandwidth_worker, processes, nbytes, way, repeats, timeout_s=timeout_s)
    single = max(nbytes / (end - start) for start, end in ranks[0]["alone"])
    best: tuple[float, tuple[float, ...]] = (0.0, ())
    for i in range(repeats):
        spans = [rank["together"][i] for rank in ranks]
        wall = max(end for _, end in spans) - min(start for start, _ in spans)
        aggregate = processes * nbytes / wall
        if aggregate > best[0]:
            best = (aggregate, tuple(nbytes / (end - start) for start, end in spans))
    return ParallelBandwidth(nbytes, way, single, best[1], best[0])


@dataclass(frozen=True)
class TPDecodeTiming:
    """One decode step of a model in one process against split over ``world_size`` ranks,
    each rank holding its shard only (rank 0 also the whole model, for the one-process runs).
    Times in seconds, one per repeat, taken in turns; ``speedup`` compares the fastest."""
    world_size: int
    single_s: tuple[float, ...]
    split_s: tuple[float, ...]
    allreduce_share: float       # of the split step's time, inside all-reduces (incl. waiting)
    whole_bytes: int             # the model's weights
    shard_bytes: int             # one rank's weights (the replicated embedding/LM head included)

    @property
    def speedup(self) -> float:
        return min(self.single_s) / min(self.split_s)


def _weight_bytes(module: torch.nn.Module) -> int:
    unique = {id(p): p for p in module.parameters()}.values()  # tied weights count once
    return sum(p.numel() * p.element_size() for p in unique)


@torch.no_grad()
def tp_scale_worker(rank: int, world_size: int, preset: str, layers: int | None,
                    context: int, repeats: int, threads: int = 1) -> dict[str, object]:
    """One rank of :func:`tp_decode_speedup`: build the preset here, from its seed (hundreds
    of MB: cheaper to create in each rank than to pickle across), keep this rank's shard and
    free the rest (rank 0 keeps the whole model for the one-process runs), prefill
    ``context`` tokens, then time decode steps at that position, in turns as
    :func:`tp_bench_worker` does."""
    from ..checkpoint import load_model
    torch.set_num_threads(threads)
    device = rank_device(rank)
    model = load_model(preset, device=device, layers=layers)
    counter = CountingAllReduce()
    shard = shard_model(model, rank, world_size, counter)
    whole_bytes, shard_bytes = _weight_bytes(model), _weight_bytes(shard)
    if rank != 0:
        del model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shard.config.vocab_size, (1, context + 1), generator=gen).to(device)
    runs = {"split": phase_runners(shard, shard.new_cache(1, context + 1), ids)}
    if rank == 0:
        runs["single"] = phase_runners(model, KVCache.for_model(model, 1, context + 1), ids)
    for run in runs.values():  # warm-up; the prefill leaves the prompt in the cache
        run["prefill"]()
        run["decode"]()
    single, split, comm = [], [], 0.0
    for _ in range(repeats):
        dist.barrier()
        if rank == 0:
            single.append(_seconds(runs["single"]["decode"], device))
        dist.barrier()
        counter.reset()
        split.append(_seconds(runs["split"]["decode"], device))
        comm += counter.seconds
    return {"single_s": single, "split_s": split, "allreduce_share": comm / sum(split),
            "whole_bytes": whole_bytes, "shard_bytes": shard_bytes}


def tp_decode_speedup(world_size: int = 2, preset: str = "bandwidth", layers: int | None = None,
                      context: int = 32, repeats: int = 10,
                      timeout_s: float = 180.0) -> TPDecodeTiming:
    """A decode step of the scale model (``load_model(preset, layers=layers)``) in one
    process against split over ``world_size`` ranks (gloo on the CPU, nccl with a GPU per
    rank), one torch thread per process; the figures of rank 0."""
    out = launch(tp_scale_worker, world_size, preset, layers, context, repeats,
                 timeout_s=timeout_s)[0]
    return TPDecodeTiming(world_size, tuple(out["single_s"]), tuple(out["split_s"]),
                          out["allreduce_share"], out["whole_bytes"], out["shard_bytes"])

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

import torch
import torch.distributed as dist
from torch import Tensor

from ..generate import clock, decode_step, prefill
from ..kv_cache import KVCache
from .launch import rank_device
from ..model import TinyLlama
from .tensor import CountingAllReduce, dist_all_reduce, shard_model
from .pipeline import Stage, Timeline, pipeline_forward, split_micro_batches


def phase_runners(model: torch.nn.Module, cache: KVCache,
                  ids: Tensor) -> dict[str, Callable[[], None]]:
    """Two timeable calls: a prefill over ``ids[:, :-1]``, and one decode step of the last
    token after it (run the prefill first). Each leaves the cache as it found it."""
    P = ids.shape[1] - 1
    position = torch.tensor([P], device=ids.device)

    def run_prefill() -> None:
        cache.reset()
        prefill(model, ids[:, :P], cache)

    def run_decode() -> None:
        decode_step(model, ids[:, P], position, cache)
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

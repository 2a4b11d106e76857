"""Tensor and pipeline parallelism on 2 ranks, measured against one process in one run.

- **tensor parallel (TP), 2 ranks vs 1 process**: median time of a prefill (128-token
  prompt) and of one cached decode step after it, batch 1. Each rank does half the matmul
  work, then pays two all-reduces per block. ``tp2_speedup_prefill`` and
  ``tp2_speedup_decode`` are one-process time / 2-rank time (below 1: the split is slower);
  ``tp2_allreduce_share`` is the fraction of a 2-rank decode step spent inside all-reduces
  (``tp2_allreduce_share_prefill`` the same for the prefill). The bare cost of one
  all-reduce of a decode step's hidden state is reported next to them.
- **pipeline parallel (PP), 2 stages**: a batch of 8 sequences of 64 tokens cut into 1, 2,
  4 and 8 micro-batches; the measured idle share of the stages (the bubble) next to the
  formula (p - 1) / (m + p - 1). ``pp_bubble_measured`` / ``pp_bubble_formula`` are at
  m = 4 (both are fractions; smaller is better).

Conditions: the shipped target, fp32, one torch thread per process (two ranks, a core
each on a machine with two or more, against one process on one core), gloo over loopback on
the CPU. The one-process figures are taken by rank 0 alone, taking turns with the 2-rank runs inside one
launch, so both see the same moments of a shared machine's load (which the report records). A GPU
machine with one GPU per rank would use nccl; with fewer GPUs than ranks the ranks run on
the CPU, as here. ``--quick`` runs a tiny random model with few repeats: its figures only
check the report's shape.
"""
from __future__ import annotations

from dataclasses import replace

import os
import statistics
from typing import Any

import torch

from tinyserve.parallel.launch import choose_backend, launch
from tinyserve.model import TinyLlama
from tinyserve.parallel.timing import pp_bench_worker, tp_bench_worker
from tinyserve.parallel.pipeline import bubble_formula, measured_bubble

from ..common import QUICK_CONFIG as COMMON_QUICK
from ..common import load_bench_model, report, table, write_json

WORLD = 2
#: Cores a run keeps busy (two ranks): the load average after it is judged less these.
OWN_THREADS = WORLD
# Heads of 16 numbers: the tiny model split over 2 ranks still has whole heads on each.
QUICK_CONFIG = replace(COMMON_QUICK, hidden_size=64, intermediate_size=128)


def _model(quick: bool) -> tuple[TinyLlama, str]:
    return load_bench_model(quick, quick_config=QUICK_CONFIG)


def both_schemes_worker(rank: int, world_size: int, model: TinyLlama, tp_ids: torch.Tensor,
                        pp_ids: torch.Tensor, counts: list[int], repeats: int) -> dict[str, Any]:
    """Each rank runs the TP bench, then the PP bench: one launch pays the start-up once."""
    return {"tp": tp_bench_worker(rank, world_size, model, tp_ids, repeats),
            "pp": pp_bench_worker(rank, world_size, model, pp_ids, counts, repeats)}


def _pp_rows(ranks: list[dict[str, Any]], counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for m in counts:
        runs = list(zip(*(r["pp"][m] for r in ranks)))  # per repeat: one timeline per stage
        bubbles = [measured_bubble(list(tls)) for tls in runs]
        spans = [max(e for tl in tls for _, e in tl) - min(s for tl in tls for s, _ in tl)
                 for tls in runs]
        stage_ms = [1e3 * statistics.median(e - s for tl in r["pp"][m] for s, e in tl)
                    for r in ranks]
        rows.append({"micro_batches": m, "bubble_measured": statistics.median(bubbles),
                     "bubble_formula": bubble_formula(WORLD, m),
                     "pass_ms": 1e3 * statistics.median(spans),
                     "stage_ms_per_micro_batch": stage_ms})
    return rows


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    model, name = _model(quick)
    vocab = model.config.vocab_size
    prompt, batch, tokens = (16, 4, 8) if quick else (128, 8, 64)
    counts = [1, 2, 4] if quick else [1, 2, 4, 8]
    repeats = 3 if quick else 15
    g = torch.Generator().manual_seed(0)
    tp_ids = torch.randint(0, vocab, (1, prompt + 1), generator=g)
    pp_ids = torch.randint(0, vocab, (batch, tokens), generator=g)
    backend = choose_backend(WORLD)
    load = os.getloadavg()[0]
    print(f"bench parallel: {name}, fp32, {WORLD} ranks over {backend} vs 1 process, "
          f"1 thread each", flush=True)

    # The one-process baseline is timed by rank 0, on one thread like each rank, taking turns
    # with the split runs (see tinyserve.parallel.timing).
    ranks = launch(both_schemes_worker, WORLD, model, tp_ids, pp_ids, counts, repeats,
                   timeout_s=120 if quick else 600, backend=backend)
    tp = ranks[0]["tp"]
    single = {f"{ph}_ms": tp[f"single_{ph}_ms"] for ph in ("prefill", "decode")}

    print(f"\ntensor parallel: prefill of {prompt} tokens, then one decode step (batch 1, "
          f"median of {repeats})")
    print(table(["phase", "1 process ms", f"{WORLD} ranks ms", "speed-up", "all-reduce share"],
                [[ph, single[f"{ph}_ms"], tp[f"{ph}_ms"], single[f"{ph}_ms"] / tp[f"{ph}_ms"],
                  tp[f"{ph}_allreduce_share"]] for ph in ("prefill", "decode")]))
    layers = model.config.num_hidden_layers
    print(f"{2 * layers} all-reduces per forward pass (2 per block x {layers} blocks); one "
          f"all-reduce of {model.config.hidden_size} floats alone: {tp['allreduce_ms']:.3f} ms")

    pp = _pp_rows(ranks, counts)
    print(f"\npipeline parallel: {WORLD} stages, batch {batch} x {tokens} tokens cut into m "
          f"micro-batches (median of {repeats})")
    print(table(["m", "bubble measured", "bubble formula", "pass ms", "stage 0 ms/mb",
                 "stage 1 ms/mb"],
                [[r["micro_batches"], r["bubble_measured"], r["bubble_formula"], r["pass_ms"],
                  *r["stage_ms_per_micro_batch"]] for r in pp]))
    at4 = next(r for r in pp if r["micro_batches"] == 4)
    data = report(
        "parallel",
        ratios={"tp2_speedup_prefill": single["prefill_ms"] / tp["prefill_ms"],
                "tp2_speedup_decode": single["decode_ms"] / tp["decode_ms"],
                "tp2_allreduce_share": tp["decode_allreduce_share"],
                "tp2_allreduce_share_prefill": tp["prefill_allreduce_share"],
                "pp_bubble_measured": at4["bubble_measured"],
                "pp_bubble_formula": at4["bubble_formula"]},
        measurements={"tp": {"single_process": single, "ranks": [r["tp"] for r in ranks],
                             "all_reduces_per_forward": 2 * layers},
                      "pp": pp},
        conditions={"model": name, "dtype": "float32", "world_size": WORLD, "backend": backend,
                    "device": "cuda" if backend == "nccl" else "cpu", "threads_per_process": 1,
                    "tp_prompt_tokens": prompt, "tp_batch": 1, "pp_batch": batch,
                    "pp_tokens": tokens, "repeats": repeats,
                    # Other jobs on a shared machine inflate the all-reduce share: a rank
                    # descheduled mid-pass makes its peer wait inside the all-reduce.
                    "load_average_1min_at_start": load},
        quick=quick)
    write_json(data, json_path)
    return data

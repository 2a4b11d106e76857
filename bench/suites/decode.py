"""Decode against its roofline: eager and compiled, batch 1 and a batch sweep.

Per-token time of a decode step (the sampled token fed back, as in generation), measured
for the eager model (:func:`~tinyserve.generate.decode_step` on the contiguous KV cache) and
for the compiled step (:mod:`tinyserve.backends.compiled`), next to the bounds of
:mod:`tinyserve.roofline`: the bytes a step must read over the measured read bandwidth (the fastest of three ways,
:func:`~tinyserve.roofline.read_bandwidth`: the course's one reference), and its FLOPs over
the FLOP ceiling (:func:`~tinyserve.roofline.flop_ceiling`).

Ratios:

- ``decode_mbu_b1_eager`` / ``decode_mbu_b1_compiled``: memory bound / measured per-token
  time at batch 1 (1.0 = as fast as the fastest plain read). Runs before issue 38 divided
  by a copy's figure, never faster than the best read, so their MBUs read as high or higher;
- ``compiled_vs_eager_b1``: eager / compiled per-token time (greater than 1: compiled faster);
- ``compile_s``: seconds the first compiled step took (tracing and code generation, with
  inductor's on-disk caches off: the cold compile a first user waits for).

Both paths are checked to produce the same greedy tokens before anything is timed (fp32;
in bf16 on a GPU, fused kernels round differently, so equality is reported, not required).
The sweep times a step at batch 1 to 64 for eager and compiled: where the measured time
leaves the flat memory bound is where the step stops being overhead- or memory-bound.
Last, the serving engine's own decode step (paged KV, 16 to 64 rows) is timed against the
calibrated cost model the simulator uses (``measured_over_model``; 1.0: the model is exact).
``--quick`` runs the same code on a tiny random model; its figures mean nothing.
"""
from __future__ import annotations

from typing import Any

import torch

from tinyserve.backends.compiled import compiled_decoder
from tinyserve.generate import generate_compiled
from tinyserve.corpus import example_prompts
from tinyserve.device import default_device, default_dtype
from tinyserve.generate import generate_batch
from tinyserve.model import TinyLlama
from tinyserve.roofline import (bounds_seconds, decode_cost, flop_ceiling, matmul_flops, mbu,
                                read_bandwidth, row_sweep)
from tinyserve.tokenizer import load_tokenizer

from ..common import cold_compiles, load_bench_model, report, table, write_json

def _prompts(model: TinyLlama, batch: int, length: int) -> list[list[int]]:
    """``batch`` sample tickets of exactly ``length`` tokens (a short one is repeated)."""
    tok = load_tokenizer()
    vocab = model.config.vocab_size
    rows = []
    for text in example_prompts(batch):
        ids = tok.encode(text)
        rows.append([t % vocab for t in (ids * (length // len(ids) + 1))[:length]])
    return rows


def engine_vs_cost_model(model: TinyLlama, rows_list: tuple[int, ...], context: int,
                         repeats: int = 5) -> list[dict[str, float]]:
    """The serving engine's decode step (paged cache, block tables, sampling: exactly what
    :class:`~tinyserve.engine.ModelExecutor` runs) at each row count, every row at
    ``context`` cached tokens, against the calibrated cost model's prediction for that
    step. Timed by the calibration's own :func:`~tinyserve.simulator.measure_steps` (the
    fastest of ``repeats``, the repeats going round the row counts)."""
    from tinyserve.simulator import CostModel, measure_steps

    cost = CostModel.load()
    records = measure_steps(model, repeats=repeats,
                            shapes=[[(context, 1)] * rows for rows in rows_list])
    out = []
    for rows, r in zip(rows_list, records):
        predicted = cost.seconds(r.num_tokens, r.num_rows, r.attention_pairs, r.decode_kv_tokens)
        out.append({"rows": rows, "measured_ms": r.seconds * 1e3,
                    "cost_model_ms": predicted * 1e3, "measured_over_model": r.seconds / predicted})
    return out


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    # compile_s is what a first user waits: the caches are off for a full run (cold_compiles).
    return cold_compiles(_run, json_path, quick)


def _run(json_path: str | None, quick: bool) -> dict[str, Any]:
    device = default_device()
    dtype = default_dtype(device)
    model, name = load_bench_model(quick, device)
    model = model.to(dtype)
    prompt_len, n_new, repeats = (8, 8, 2) if quick else (64, 64, 5)
    batches = (1, 2) if quick else (1, 8, 64)
    # --quick on a CPU only traces the step (code generation takes a minute there); the
    # compiled kernels themselves are checked by tests/test_compile.py.
    backend = "eager" if quick and device.type == "cpu" else "inductor"

    # Equal tokens first: a fast path that computes something else is not faster.
    one = _prompts(model, 1, prompt_len)
    eager_tokens = generate_batch(model, one, n_new)
    compiled_tokens = generate_compiled(model, one, n_new, backend=backend)
    tokens_equal = eager_tokens == compiled_tokens
    if dtype == torch.float32 and not tokens_equal:
        raise RuntimeError("compiled greedy tokens differ from eager ones in fp32")

    reads = read_bandwidth(device, (16 if quick else 512) * 2**20)
    bandwidth = reads.best                 # the course's one reference (roofline.mbu)
    flop_rate = matmul_flops(device, dtype, 256) if quick else flop_ceiling(device, dtype)
    context = prompt_len + n_new // 2
    rows, sweep = [], []
    compile_s: dict[str, float] = {}
    prompts = torch.tensor(_prompts(model, max(batches), prompt_len), device=device)
    points = row_sweep(model, prompts, batches, n_new, repeats, compiled={"backend": backend})
    for batch, point in points.items():
        eager, compiled = point.eager_s, point.compiled_s
        compile_s[str(batch)] = point.compile_s
        cost = decode_cost(model, batch, context)
        bound = bounds_seconds(cost, bandwidth, flop_rate)
        sweep.append({"batch": batch, "eager_ms": eager * 1e3, "compiled_ms": compiled * 1e3,
                      "memory_bound_ms": bound["memory_s"] * 1e3,
                      "compute_bound_ms": bound["compute_s"] * 1e3,
                      "bytes": cost.bytes, "flops": cost.flops,
                      "mbu_eager": mbu(cost, bandwidth, eager),
                      "mbu_compiled": mbu(cost, bandwidth, compiled)})
        rows.append([batch, eager * 1e3, compiled * 1e3, bound["memory_s"] * 1e3,
                     bound["compute_s"] * 1e3, eager / compiled])
    b1 = sweep[0]
    ratios = {"decode_mbu_b1_eager": b1["mbu_eager"], "decode_mbu_b1_compiled": b1["mbu_compiled"],
              "compiled_vs_eager_b1": b1["eager_ms"] / b1["compiled_ms"],
              "compile_s": compile_s["1"]}
    print(f"decode step, {prompt_len}-token prompts, {n_new} steps ({name}, {device}, "
          f"{str(dtype).removeprefix('torch.')}, fastest of {repeats} runs); bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s, matmul {flop_rate / 1e9:.1f} GFLOP/s")
    print(table(["batch", "eager ms", "compiled ms", "memory bound ms", "compute bound ms",
                 "eager/compiled"], rows))
    print(f"\nbatch 1: eager at {b1['mbu_eager']:.0%} of the memory bound, compiled at "
          f"{b1['mbu_compiled']:.0%}; first compiled step took {compile_s['1']:.1f} s; "
          f"greedy tokens equal: {tokens_equal}", flush=True)
    window = model.config.max_position_embeddings
    engine = engine_vs_cost_model(model, (2, 4) if quick else (16, 32, 64), window // 4,
                                  2 if quick else 20)
    print(f"\nengine decode step (paged, {window // 4} cached tokens per row) vs the calibrated "
          f"cost model (tinyserve/assets/cost_model.json)")
    print(table(["rows", "measured ms", "cost model ms", "measured / model"],
                [[e["rows"], e["measured_ms"], e["cost_model_ms"], e["measured_over_model"]]
                 for e in engine]), flush=True)
    data = report("decode", ratios=ratios,
                  measurements={"engine_vs_cost_model": engine,
                                "bandwidth_gb_per_s": bandwidth / 1e9, "bandwidth_way": reads.fastest_way,
                                "matmul_gflop_per_s": flop_rate / 1e9, "context": context,
                                "tokens_equal": tokens_equal, "compile_s": compile_s,
                                "sweep": sweep},
                  conditions={"model": name, "device": str(device), "dtype": str(dtype),
                              "prompt_tokens": prompt_len, "steps": n_new, "repeats": repeats,
                              "compile_backend": backend,
                              "compile_mode": compiled_decoder(model, 1, backend=backend).mode},
                  quick=quick)
    write_json(data, json_path)
    return data

"""Static vs continuous batching on the real model, and the throughput/latency frontier.

The same mixed-length workload (every request queued at t = 0, output lengths long-tailed:
most replies are short, a few are long) runs through the same engine twice with the same
limit of ``max_num_seqs`` running sequences:

- **static**: a batch is admitted only when the previous one has finished entirely, so a
  slot whose request ended early sits idle until the longest request of its batch is done
  (finished rows are dropped from the step, not computed as padding);
- **continuous**: a finished request's slot is refilled at the next step.

``continuous_vs_static_throughput`` is output tokens/s continuous / static at
``max_num_seqs`` 16 with 96 requests (six static batches). Until December 2026 it was
measured at 8 with 48 requests (also six batches; ``at_8_seqs`` in the JSON, still run):
there continuous batching fills 1.95x as many rows per step as static, and that occupancy ratio
is the ceiling of the throughput ratio, reached only where a step costs the same for 3 rows as
for 7; on a CPU thread a 7-row step costs more (the matrix multiplies grow with the rows), so
at 8 slots the throughput ratio fell short of the occupancy ratio (both in the report's
``at_8_seqs``). Why 16: vLLM's default limit is 256 running sequences on most GPUs, 1024 on
GPUs of 70 GiB or more (not A100s) and 128 on a CPU (``EngineArgs.get_batch_defaults`` in
``vllm/engine/arg_utils.py``), so 8 understated how many requests a static batch holds, and the
longest of 16 long-tailed replies holds its batch longer than the longest of 8. The request
count follows the slots (six batches' worth) so the backlog is the same length as before,
measured in batches. Prompt and output distributions are unchanged.

Then the frontier: continuous batching with ``max_num_seqs`` 1, 2, 4, 8, 16, each point's
output throughput against its median TPOT (what each user feels per token): more sequences
per step buy throughput with per-user latency. Greedy, fp32, one thread; tokens are asserted
identical between static and continuous runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tinyserve.engine import EngineConfig
from tinyserve.workload import LogNormal, Uniform, describe, make_workload

from ..common import report, table, write_json
from ._engine_runs import bench_model, figures, run_engine, threads_note


def static_vs_continuous(model: Any, specs: list[Any], slots: int,
                         blocks: int) -> tuple[dict[str, dict[str, Any]], float, float]:
    """Both batching modes on ``specs`` at ``slots`` running sequences: each run's figures,
    the throughput ratio continuous / static and the occupancy ratio (rows per step)."""
    window = model.config.max_position_embeddings
    runs = {}
    for mode in ("static", "continuous"):
        config = EngineConfig(num_blocks=blocks, block_size=16, max_num_seqs=slots,
                              max_num_batched_tokens=window, static=mode == "static")
        seqs, engine = run_engine(model, config, specs)
        runs[mode] = (seqs, figures(seqs, engine=engine))
    same = [s.output_ids for s in runs["static"][0]] == [s.output_ids for s in runs["continuous"][0]]
    if not same:
        raise AssertionError("static and continuous batching produced different tokens")
    ratio = runs["continuous"][1]["output_throughput"] / runs["static"][1]["output_throughput"]
    # Slot occupancy: what the ratio would approach where a decode step costs the same for 1
    # or max_num_seqs rows (a GPU at small batch); on a CPU more rows cost more time.
    occupancy = (runs["continuous"][1]["mean_rows_per_step"]
                 / runs["static"][1]["mean_rows_per_step"])
    return {m: r[1] for m, r in runs.items()}, ratio, occupancy


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    model, label = bench_model(quick)
    window = model.config.max_position_embeddings
    n, slots = (8, 4) if quick else (6 * 16, 16)     # six static batches' worth
    outputs = LogNormal(24, 1.0, 4, 16 if quick else 256)
    specs = make_workload(n, float("inf"), Uniform(16, window // 4), outputs, seed=0)
    blocks = n * window // 16 + 1
    runs, ratio, occupancy = static_vs_continuous(model, specs, slots, blocks)
    before = None
    if not quick:    # the setting this ratio was measured at until December 2026
        old = make_workload(6 * 8, float("inf"), Uniform(16, window // 4), outputs, seed=0)
        _, old_ratio, old_occupancy = static_vs_continuous(model, old, 8, blocks)
        before = {"max_num_seqs": 8, "requests": len(old), "continuous_vs_static_throughput":
                  old_ratio, "occupancy_ratio": old_occupancy}

    frontier = []
    for limit in ((1, 4) if quick else (1, 2, 4, 8, 16)):
        config = EngineConfig(num_blocks=blocks, block_size=16, max_num_seqs=limit,
                              max_num_batched_tokens=window)
        f = figures(run_engine(model, config, specs)[0])
        frontier.append({"max_num_seqs": limit, "output_throughput": f["output_throughput"],
                         "median_tpot_ms": f["median_tpot_ms"], "p50_e2el_ms": f["median_e2el_ms"],
                         "p99_ttft_ms": f["p99_ttft_ms"]})

    rows = [[m, runs[m]["output_throughput"], runs[m]["median_e2el_ms"],
             runs[m]["median_tpot_ms"]] for m in ("static", "continuous")]
    print(f"{describe(specs)}; max {slots} running sequences; {label}, {threads_note()}")
    print(table(["batching", "output tok/s", "p50 E2E ms", "p50 TPOT ms"], rows))
    print(f"continuous / static throughput: {ratio:.2f}x (identical tokens); sequences per "
          f"step {runs['continuous']['mean_rows_per_step']:.1f} vs "
          f"{runs['static']['mean_rows_per_step']:.1f} ({occupancy:.2f}x)")
    if before:
        print(f"at max {before['max_num_seqs']} running sequences: "
              f"{before['continuous_vs_static_throughput']:.2f}x throughput, "
              f"{before['occupancy_ratio']:.2f}x sequences per step")
    print()
    print(table(["max_num_seqs", "output tok/s", "p50 TPOT ms", "p99 TTFT ms"],
                [[p["max_num_seqs"], p["output_throughput"], p["median_tpot_ms"],
                  p["p99_ttft_ms"]] for p in frontier]))
    data = report("batching", {"continuous_vs_static_throughput": ratio},
                  {"static": runs["static"], "continuous": runs["continuous"],
                   "occupancy_ratio": occupancy, "at_8_seqs": before, "frontier": frontier},
                  {"model": label, "workload": describe(specs), "max_num_seqs": slots,
                   "threads": threads_note(), "greedy": True}, quick)
    write_json(data, json_path)
    if json_path:
        _plot(frontier, Path(json_path).with_suffix(".png"))
    return data


def _plot(frontier: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    x = [p["median_tpot_ms"] for p in frontier]
    y = [p["output_throughput"] for p in frontier]
    ax.plot(x, y, "o-")
    for p, xi, yi in zip(frontier, x, y):
        ax.annotate(f"{p['max_num_seqs']} seqs", (xi, yi), textcoords="offset points", xytext=(4, -10))
    ax.set_xlabel("median time per output token (ms), what each user feels")
    ax.set_ylabel("output throughput (tokens/s), all users")
    ax.set_title("Continuous batching: throughput vs per-user latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

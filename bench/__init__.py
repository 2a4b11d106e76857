"""Benchmark suites: ``python -m tinyserve bench SUITE [--json PATH] [--quick]``.

Each suite measures an optimisation side by side with its plain reference *in the same run*
and reports ratios (greater than 1 means the optimised path is faster), next to the raw
medians, the machine, the commit and the load around the run. Tests run every suite with
``--quick`` and check the report's shape, never its timings.

Around the suites (:mod:`bench.cli`): ``bench all`` runs every CPU suite into
bench/results/ (:mod:`bench.run_all`, ``make bench``), ``bench ledger`` renders the README's
table from those reports (:mod:`bench.ledger`, declared in :mod:`bench.headlines`), and
``bench compare`` marks the ratios that moved the wrong way (:mod:`bench.compare`).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

from .machine_load import busy_warning, load_average, stamp

SUITES = {
    "batching": "static vs continuous batching throughput on the real model; throughput/latency frontier",
    "paged": "KV slots reserved vs used, contiguous vs paged; concurrency in the same memory",
    "prefix": "TTFT with and without a prefix-cache hit on a shared system prompt",
    "chunked": "p99 ITL with and without chunked prefill (real model); size-aware vs FCFS p99 TTFT (simulator)",
    "kv": "cached vs uncached decode: per-token cost by position, speed-up at 256 and 512",
    "decode": "decode step vs its roofline: eager and compiled, batch 1 to 64, bandwidth and FLOP bounds",
    "hf": "our cached greedy loop vs transformers generate() (batch 1 and 8), decode roofline",
    "quant": "int8 weights / KV cache and bf16 vs fp32: memory, decode speed, quality",
    "parallel": "tensor parallel on 2 ranks vs 1 process (prefill, decode, all-reduce share), pipeline bubble vs formula",
    "spec": "speculative decoding (draft model, n-gram lookup) vs plain greedy: acceptance, passes/token, speed-up, batch sweep",
    "serve": "load generator against our server: rate sweep, latency percentiles, goodput knee, cost; routing across replicas",
    "scale": "the memory wall on the bandwidth-scale model: MBU, rows sweep and knee, int8, verify pass, speculation, TP, cache and prefill vs its measured roofline",
    "peers": "our load generator vs guidellm, our server vs transformers serve (make peers installs them)",
}


#: Suites whose ``run`` takes ``compile`` (our side timed with the compiled decode step).
COMPILABLE = ("hf",)

#: Cores a suite keeps busy, where more than its one torch thread (parallel and scale run two
#: ranks): the load average after a run counts them, so it is judged less these.
OWN_THREADS = {"parallel": 2, "scale": 2}


def run_suite(name: str, json_path: str | None = None, quick: bool = False,
              compile: bool = False) -> dict[str, Any]:
    if name not in SUITES:
        raise ValueError(f"unknown bench suite {name!r}; choose one of: {', '.join(SUITES)}")
    # One torch thread per process (the house rule): ratios taken side by side on a shared
    # machine mean something only if neither side can borrow a core the other lacks.
    # The parallel suite sets its own threads in each rank.
    import torch
    if compile and name not in COMPILABLE:
        raise ValueError(f"bench {name} has no --compile variant; it exists for: "
                         f"{', '.join(COMPILABLE)} (bench decode always times both)")
    module = importlib.import_module(f"bench.{name}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    before = load_average()
    try:
        if compile:
            data = module.run(json_path=json_path, quick=quick, compile=True)
        else:
            data = module.run(json_path=json_path, quick=quick)
    finally:
        torch.set_num_threads(threads)   # a caller (a test session) keeps its own setting
    return stamp_report(data, name, before, json_path)


def stamp_report(data: dict[str, Any], name: str, load_before: float,
                 json_path: str | None) -> dict[str, Any]:
    """Add what the ledger needs to judge a run (the load around it, whether the tree was
    clean) to a suite's report, warn if the machine was busy, and rewrite its JSON."""
    from .common import write_json   # here: bench.common imports torch; `import bench` must not
    data["load"] = stamp(load_before, load_average(), own_threads=OWN_THREADS.get(name, 1))
    commit = data.get("git_commit") or ""
    data["clean"] = bool(commit) and not commit.endswith("-dirty")
    warning = busy_warning(data["load"], f"bench {name}")
    if warning:
        print(warning, file=sys.stderr, flush=True)
    write_json(data, json_path, announce=False)   # the suite announced the file already
    return data

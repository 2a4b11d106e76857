"""Benchmark suites: ``python -m tinyserve bench SUITE [--json PATH] [--quick]``.

Each suite measures an optimisation side by side with its plain reference *in the same run*
and reports ratios (greater than 1 means the optimised path is faster), next to the raw
medians, the machine and the commit. Tests run every suite with ``--quick`` and check the
report's shape, never its timings.
"""
from __future__ import annotations

import importlib
from typing import Any

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
    "peers": "our load generator vs guidellm, our server vs transformers serve (make peers installs them)",
}


#: Suites whose ``run`` takes ``compile`` (our side timed with the compiled decode step).
COMPILABLE = ("hf",)


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
    try:
        if compile:
            return module.run(json_path=json_path, quick=quick, compile=True)
        return module.run(json_path=json_path, quick=quick)
    finally:
        torch.set_num_threads(threads)   # a caller (a test session) keeps its own setting

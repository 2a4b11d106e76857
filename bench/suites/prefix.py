"""TTFT with and without a prefix-cache hit, for requests sharing a long system prompt.

Every request is a shared system prompt followed by its own user turn. They are served one
at a time (no queueing, so TTFT is admission + prefill), once with prefix caching off and
once on. With caching on, the first request computes the system prompt's blocks and
publishes them; every later one finds them and prefills only its own tokens (plus the part
of the system prompt past its last full block). ``prefix_ttft_speedup`` is the median TTFT
off / on over the requests after the first; the ideal is total / uncached tokens. Tokens are
asserted identical with and without the cache (a hit must equal a miss). fp32, greedy, one
thread on CPU.
"""
from __future__ import annotations

import statistics
from typing import Any

from tinyserve.engine import Engine, EngineConfig
from tinyserve.workload import Uniform, make_workload, prompt_ids

from ..common import report, table, write_json
from ._engine_runs import bench_model, threads_note


def _serve_one_by_one(model, prompts: list[list[int]], caching: bool, max_tokens: int):
    engine = Engine(model, EngineConfig(num_blocks=len(prompts) * 40 + 64, block_size=16,
                                        enable_prefix_caching=caching,
                                        max_num_batched_tokens=model.config.max_position_embeddings))
    warm = engine.add_request([5 + i % 7 for i in range(40)], 2)   # first-call costs, no overlap
    engine.run()
    seqs = []
    for p in prompts:
        seqs.append(engine.add_request(p, max_tokens))
        engine.run()
    del warm
    return seqs, engine.blocks.prefix_hit_rate


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    model, label = bench_model(quick)
    window = model.config.max_position_embeddings
    shared = window * 3 // 4                      # 384 of 512 tokens on the target
    n = 4 if quick else 16
    own = Uniform(max(2, window // 32), window // 10)      # 16-51 own tokens on the target
    specs = make_workload(n, 1.0, own, Uniform(8, 8), seed=0, prefix_len=shared)
    prompts = [prompt_ids(s, i, model.config.vocab_size) for i, s in enumerate(specs)]
    results = {}
    for caching in (False, True):
        seqs, hit_rate = _serve_one_by_one(model, prompts, caching, max_tokens=8)
        ttfts = [1e3 * (s.trace.token_times[0] - s.trace.arrival) for s in seqs[1:]]
        results[caching] = {"seqs": seqs, "median_ttft_ms": statistics.median(ttfts),
                            "ttft_ms": ttfts, "hit_rate": hit_rate,
                            "cached_tokens": [s.cached_tokens for s in seqs]}
    if [s.output_ids for s in results[False]["seqs"]] != [s.output_ids for s in results[True]["seqs"]]:
        raise AssertionError("a prefix hit produced different tokens from a miss")
    speedup = results[False]["median_ttft_ms"] / results[True]["median_ttft_ms"]
    mean_total = statistics.mean(len(p) for p in prompts[1:])
    mean_cached = statistics.mean(results[True]["cached_tokens"][1:])
    ideal = mean_total / (mean_total - mean_cached)
    print(f"{n} requests: a {shared}-token system prompt + {own.low}-{own.high} own tokens, 8 new tokens each; "
          f"{label}, {threads_note()}")
    print(table(["prefix caching", "median TTFT ms", "cached tokens/request", "hit rate"],
                [["off", results[False]["median_ttft_ms"], 0, "0%"],
                 ["on", results[True]["median_ttft_ms"], mean_cached,
                  f"{results[True]['hit_rate']:.0%}"]]))
    print(f"TTFT speed-up {speedup:.2f}x; if prefill cost were proportional to the tokens "
          f"computed: {ideal:.2f}x")
    data = report("prefix", {"prefix_ttft_speedup": speedup},
                  {k: {"median_ttft_ms": v["median_ttft_ms"], "ttft_ms": v["ttft_ms"],
                       "prefix_hit_rate": v["hit_rate"], "cached_tokens": v["cached_tokens"]}
                   for k, v in (("off", results[False]), ("on", results[True]))}
                  | {"ideal_speedup": ideal, "mean_prompt_tokens": mean_total},
                  {"model": label, "shared_prefix_tokens": shared, "requests": n,
                   "block_size": 16, "threads": threads_note()}, quick)
    write_json(data, json_path)
    return data

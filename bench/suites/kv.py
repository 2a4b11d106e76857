"""Cached vs uncached decode, measured side by side in one run.

Two views of the same effect:

- **per-token cost by position**: one decode step at position p. With the cache it is one
  token's matmuls plus attention over p cached keys; without, a forward pass over p + 1
  tokens. The uncached cost grows with p, the cached one barely.
- **whole generations**: the time to generate N tokens from a one-token prompt, with and
  without the cache (same code, ``use_cache`` flipped). ``cache_speedup_N`` is
  uncached / cached time, asserted on identical greedy tokens. The context window is 512,
  so "512" means the generation that fills it: 1 prompt token + 511 generated.

Conditions: fp32 on the default device (CPU unless CUDA is present), greedy, no stop token,
medians of a few repeats. Also measured: prefill time against prompt length and decode time
against output length (read off the 512 run's token timestamps), for the phase-cost plot
written next to the JSON. ``--quick`` runs the same code on a tiny random model with a
64-token window, to check the report's shape in seconds; its figures mean nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tinyserve.device import default_device
from tinyserve.generate import decode_step, generate, prefill
from tinyserve.kv_cache import KVCache
from tinyserve.model import TinyLlama

from ..common import load_bench_model, median_seconds, report, table, write_json

def _model(quick: bool, device: torch.device) -> tuple[TinyLlama, str]:
    return load_bench_model(quick, device)


@torch.no_grad()
def step_costs(model: TinyLlama, positions: list[int], repeats: int) -> list[dict[str, Any]]:
    """Seconds for one decode step at each position, cached and recomputed."""
    device, vocab = model.device, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for p in positions:
        ids = torch.randint(0, vocab, (1, p + 1), generator=g).to(device)
        cache = KVCache.for_model(model, 1, p + 1)
        prefill(model, ids[:, :p], cache)
        token, pos = ids[:, p], torch.tensor([p], device=device)

        def cached() -> None:
            decode_step(model, token, pos, cache)
            cache.rewind([p])  # forget the step, so every repeat measures position p

        def uncached() -> None:
            model(ids)[:, -1]

        rows.append({"position": p,
                     "cached_ms": 1e3 * median_seconds(cached, device, repeats),
                     "uncached_ms": 1e3 * median_seconds(uncached, device, repeats)})
    return rows


def generation_speedup(model: TinyLlama, n_tokens: int, repeats: int,
                       checkpoints: list[int]) -> dict[str, Any]:
    """Generate from a one-token prompt until n_tokens positions are used (or the window).

    The traces also give the decode curve for free: the decode time of the first n output
    tokens is ``token_times[n - 1] - token_times[0]``, read at each of ``checkpoints``.
    """
    prompt = [model.config.bos_token_id]
    generated = min(n_tokens, model.config.max_position_embeddings - len(prompt))
    device = model.device
    runs, tokens, traces = {}, {}, {True: [], False: []}  # type: ignore[var-annotated]
    for use_cache in (True, False):
        def once() -> None:
            trace = generate(model, prompt, generated, use_cache=use_cache)
            tokens[use_cache] = trace.tokens
            traces[use_cache].append(trace)
        # The uncached long runs take seconds each: no warm-up needed to amortise start-up.
        runs[use_cache] = median_seconds(once, device, repeats, warmup=1 if use_cache else 0)
        print(f"  {generated} tokens, {'cached' if use_cache else 'uncached'}: "
              f"{runs[use_cache]:.3f} s", flush=True)
    if tokens[True] != tokens[False]:
        raise RuntimeError("cached and uncached greedy tokens differ; the cache is wrong")
    decode_ms = {}
    for use_cache, key in ((True, "cached"), (False, "uncached")):
        points = []
        for n in [c for c in checkpoints if c <= generated] + [generated]:
            ms = sorted(1e3 * (t.token_times[n - 1] - t.token_times[0])
                        for t in traces[use_cache][-repeats:])
            points.append([n, ms[len(ms) // 2]])
        decode_ms[key] = points
    return {"target_positions": n_tokens, "prompt_tokens": len(prompt), "generated": generated,
            "cached_s": runs[True], "uncached_s": runs[False],
            "speedup": runs[False] / runs[True], "decode_ms_by_output_tokens": decode_ms}


def prefill_costs(model: TinyLlama, prompt_lengths: list[int], repeats: int) -> list[list[float]]:
    """[prompt tokens, prefill milliseconds] for each length (one pass, cache written)."""
    device, vocab = model.device, model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    out = []
    for n in prompt_lengths:
        ids = torch.randint(0, vocab, (1, n), generator=g).to(device)

        def once() -> None:
            prefill(model, ids, KVCache.for_model(model, 1, n))
        out.append([n, 1e3 * median_seconds(once, device, repeats)])
    return out


def _save_plot(costs: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from tinyserve.workbook.plots import phase_costs as draw
    fig = draw({"prefill (same with or without cache)": [tuple(p) for p in costs["prefill"]]},
               {"KV cache": [tuple(p) for p in costs["decode"]["cached"]],
                "no cache": [tuple(p) for p in costs["decode"]["uncached"]]})
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    device = default_device()
    model, name = _model(quick, device)
    window = model.config.max_position_embeddings
    if quick:
        positions, lengths, repeats, gen_repeats = [1, 16, 63], {"256": 16, "512": 64}, 3, 1
        prompt_lengths, checkpoints = [4, 32], [4, 16]
    else:
        positions = [1, 64, 128, 256, 384, 511]
        lengths, repeats, gen_repeats = {"256": 256, "512": 512}, 5, 3
        prompt_lengths, checkpoints = [16, 64, 128, 256, 496], [16, 64, 128, 256, 384]
    print(f"bench kv: {name} on {device}, fp32, batch 1, greedy", flush=True)
    steps = step_costs(model, positions, repeats)
    print(f"decode step cost by position (median of {repeats})")
    print(table(["position", "cached ms", "uncached ms", "uncached/cached"],
                [[r["position"], r["cached_ms"], r["uncached_ms"],
                  r["uncached_ms"] / r["cached_ms"]] for r in steps]), flush=True)
    gens = {key: generation_speedup(model, n, gen_repeats, checkpoints)
            for key, n in lengths.items()}
    print(f"\nwhole generation from a 1-token prompt (median of {gen_repeats}; window {window})")
    print(table(["positions", "generated", "cached s", "uncached s", "speed-up"],
                [[g["target_positions"], g["generated"], g["cached_s"], g["uncached_s"],
                  g["speedup"]] for g in gens.values()]), flush=True)
    decode = gens["512"].pop("decode_ms_by_output_tokens")
    gens["256"].pop("decode_ms_by_output_tokens")
    costs = {"prefill": prefill_costs(model, prompt_lengths, repeats), "decode": decode}
    print("\nphase costs: prefill ms by prompt length; decode ms (first token to n-th) by "
          "output length")
    print(table(["prompt tokens", "prefill ms"], costs["prefill"]))
    print(table(["output tokens", "decode ms, cache", "decode ms, no cache"],
                [[c[0], c[1], u[1]] for c, u in zip(decode["cached"], decode["uncached"])]))
    data = report(
        "kv",
        ratios={f"cache_speedup_{key}": g["speedup"] for key, g in gens.items()},
        measurements={"step_cost": steps, "generation": gens, "phase_costs": costs},
        conditions={"model": name, "device": str(device), "dtype": "float32", "batch": 1,
                    "sampling": "greedy", "repeats": repeats, "generation_repeats": gen_repeats,
                    "context_window": window},
        quick=quick)
    write_json(data, json_path)
    if json_path:
        _save_plot(costs, Path(json_path).with_suffix(".png"))
    return data

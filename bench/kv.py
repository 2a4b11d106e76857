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
against output length (the phase-cost plot, written next to the JSON). ``--quick`` runs the same code on a tiny random model with a
64-token window, to check the report's shape in seconds; its figures mean nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tinyserve.config import ModelConfig
from tinyserve.device import default_device
from tinyserve.generate import decode_step, generate, prefill
from tinyserve.kv_cache import KVCache
from tinyserve.model import TinyLlama

from .common import median_seconds, report, table, write_json

QUICK_CONFIG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64)


def _model(quick: bool, device: torch.device) -> tuple[TinyLlama, str]:
    if quick:
        torch.manual_seed(0)
        model = TinyLlama(QUICK_CONFIG).eval()
        with torch.no_grad():  # away from the near-uniform init, so greedy has no near-ties
            for p in model.parameters():
                p.mul_(3)
        return model.to(device), "random tiny (quick)"
    from tinyserve.checkpoint import load_model
    return load_model("target", device=device, dtype=torch.float32), "target"


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


def generation_speedup(model: TinyLlama, n_tokens: int, repeats: int) -> dict[str, Any]:
    """Generate from a one-token prompt until n_tokens positions are used (or the window)."""
    prompt = [model.config.bos_token_id]
    generated = min(n_tokens, model.config.max_position_embeddings - len(prompt))
    device = model.device
    runs = {}
    tokens = {}
    for use_cache in (True, False):
        def once() -> None:
            tokens[use_cache] = generate(model, prompt, generated, use_cache=use_cache).tokens
        # The uncached long runs take seconds each: no warm-up needed to amortise start-up.
        runs[use_cache] = median_seconds(once, device, repeats, warmup=1 if use_cache else 0)
    if tokens[True] != tokens[False]:
        raise RuntimeError("cached and uncached greedy tokens differ; the cache is wrong")
    return {"target_positions": n_tokens, "prompt_tokens": len(prompt), "generated": generated,
            "cached_s": runs[True], "uncached_s": runs[False],
            "speedup": runs[False] / runs[True]}


def phase_costs(model: TinyLlama, prompt_lengths: list[int], output_lengths: list[int],
                repeats: int) -> dict[str, list[list[float]]]:
    """Prefill milliseconds against prompt length, and decode milliseconds (E2E - TTFT)
    against output length with and without the cache: the data of the phase-cost plot."""
    device, vocab = model.device, model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    out: dict[str, list[list[float]]] = {"prefill": [], "decode_cached": [], "decode_uncached": []}
    for n in prompt_lengths:
        ids = torch.randint(0, vocab, (1, n), generator=g).to(device)

        def once() -> None:
            prefill(model, ids, KVCache.for_model(model, 1, n))
        out["prefill"].append([n, 1e3 * median_seconds(once, device, repeats)])
    prompt = torch.randint(0, vocab, (16,), generator=g).tolist()
    for n in output_lengths:
        for use_cache in (True, False):
            decode_ms = []
            for _ in range(repeats):
                t = generate(model, prompt, n, use_cache=use_cache)
                decode_ms.append(1e3 * (t.finish - t.token_times[0]))  # type: ignore[operator]
            key = "decode_cached" if use_cache else "decode_uncached"
            out[key].append([n, sorted(decode_ms)[len(decode_ms) // 2]])
    return out


def _save_plot(costs: dict[str, list[list[float]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from tinyserve.plots import phase_costs as draw
    fig = draw({"prefill (same with or without cache)": [tuple(p) for p in costs["prefill"]]},
               {"KV cache": [tuple(p) for p in costs["decode_cached"]],
                "no cache": [tuple(p) for p in costs["decode_uncached"]]})
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    device = default_device()
    model, name = _model(quick, device)
    window = model.config.max_position_embeddings
    if quick:
        positions, lengths, repeats, gen_repeats = [1, 16, 63], {"256": 16, "512": 64}, 3, 1
        prompt_lengths, output_lengths = [4, 32], [4, 16]
    else:
        positions = [1, 64, 128, 256, 384, 511]
        lengths, repeats, gen_repeats = {"256": 256, "512": 512}, 7, 3
        prompt_lengths, output_lengths = [16, 64, 128, 256, 496], [16, 64, 128, 256]
    steps = step_costs(model, positions, repeats)
    print(f"decode step cost by position ({name}, {device}, fp32, batch 1, median of {repeats})")
    print(table(["position", "cached ms", "uncached ms", "uncached/cached"],
                [[r["position"], r["cached_ms"], r["uncached_ms"],
                  r["uncached_ms"] / r["cached_ms"]] for r in steps]))
    gens = {key: generation_speedup(model, n, gen_repeats) for key, n in lengths.items()}
    print(f"\nwhole generation from a 1-token prompt (median of {gen_repeats}; window {window})")
    print(table(["positions", "generated", "cached s", "uncached s", "speed-up"],
                [[g["target_positions"], g["generated"], g["cached_s"], g["uncached_s"],
                  g["speedup"]] for g in gens.values()]))
    costs = phase_costs(model, prompt_lengths, output_lengths, gen_repeats)
    print("\nphase costs: prefill ms by prompt length; decode ms (E2E - TTFT) by output length")
    print(table(["prompt tokens", "prefill ms"], costs["prefill"]))
    print(table(["output tokens", "decode ms, cache", "decode ms, no cache"],
                [[c[0], c[1], u[1]] for c, u in zip(costs["decode_cached"],
                                                    costs["decode_uncached"])]))
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

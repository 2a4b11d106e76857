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
medians of a few repeats. ``--quick`` runs the same code on a tiny random model with a
64-token window, to check the report's shape in seconds; its figures mean nothing.
"""
from __future__ import annotations

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


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    device = default_device()
    model, name = _model(quick, device)
    window = model.config.max_position_embeddings
    if quick:
        positions, lengths, repeats, gen_repeats = [1, 16, 63], {"256": 16, "512": 64}, 3, 1
    else:
        positions = [1, 64, 128, 256, 384, 511]
        lengths, repeats, gen_repeats = {"256": 256, "512": 512}, 7, 3
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
    data = report(
        "kv",
        ratios={f"cache_speedup_{key}": g["speedup"] for key, g in gens.items()},
        measurements={"step_cost": steps, "generation": gens},
        conditions={"model": name, "device": str(device), "dtype": "float32", "batch": 1,
                    "sampling": "greedy", "repeats": repeats, "generation_repeats": gen_repeats,
                    "context_window": window},
        quick=quick)
    write_json(data, json_path)
    return data

"""The KV-bound regime (issue 52): batch-1 decode on the long-context scale model around the context where its KV cache's bytes equal its weights', and the two levers there.

The model is ``load_model("bandwidth-long")`` (:mod:`tinyserve.scale`): the bandwidth target,
the same seeded weights, with a window past 2.5x its crossover context (weight bytes over KV
bytes a token, :func:`tinyserve.long_context.kv_crossover_tokens`). A cache of 50k tokens is
filled directly (:func:`tinyserve.long_context.fill_random`), not by a prefill; the steps at
every context run in turns (:func:`tinyserve.long_context.steps_in_turns`), the fastest run of
each kept, and a line ``time = fixed + context x per_token`` is fitted through them
(Theil-Sen: :func:`tinyserve.long_context.fit_context_steps`).

Ratios (goals in :mod:`bench.headlines`, issue 52):

- ``scale_long_context_mbu``: the step at twice the predicted crossover (two thirds of its
  bytes KV), its bytes (weights plus KV) over the fastest read of the run
  (:func:`~tinyserve.roofline.read_bandwidth`, before and after, each way's faster kept) over
  its time;
- ``scale_kv_crossover_measured_vs_predicted``: the fitted crossover (the context where the
  KV part equals the fixed part) over the bytes' crossover, which is the rate the step reads
  its KV cache at over the rate it reads its weights at.

Beside them (reported, not judged): at the predicted crossover context, the model with as
many KV heads as query heads (multi-head), with its own, with one (multi-query), and with its
own over :class:`tinyserve.quant.Int8KVCache`, in turns, with each step's bytes. A separate suite from
``bench scale`` so this part runs alone (under two minutes) and keeps its own report
(``bench/results/scale_long_context.json``). One torch thread. ``--quick`` runs the same code
on a tiny random model: its figures mean nothing and the report says so.
"""
from __future__ import annotations

from typing import Any

import torch

from tinyserve.device import default_device, default_dtype
from tinyserve.long_context import (StepCase, context_steps, fit_context_steps,
                                    kv_bytes_per_token, kv_crossover_tokens, steps_in_turns,
                                    token_bytes_of)
from tinyserve.kv_cache import KVCache
from tinyserve.model import TinyLlama
from tinyserve.quant import Int8KVCache, weight_bytes
from tinyserve.roofline import ReadBandwidth, read_bandwidth
from tinyserve.scale import long_context_config
from tinyserve.workbook.kv_regime import SHORT, lever_lines, rate_lines, split_lines

from ..common import QUICK_CONFIG, report, table, write_json

#: Contexts timed, as multiples of the predicted crossover (and a short one: the weights alone).
MULTIPLES = (0.5, 1.0, 1.5, 2.0)
#: Steps a run, rounds in turns (the contexts; then the levers).
STEPS, ROUNDS, LEVER_ROUNDS = 4, 5, 3


def _model(quick: bool, device: torch.device, dtype: torch.dtype,
           kv_heads: int | None = None) -> TinyLlama:
    if quick:
        torch.manual_seed(0)
        return TinyLlama(long_context_config(QUICK_CONFIG, kv_heads)).eval().to(device, dtype)
    from tinyserve.scale import build_scale_model
    return build_scale_model("bandwidth-long", device, dtype, kv_heads=kv_heads)


def levers(model: TinyLlama, context: int, quick: bool, rounds: int) -> dict[str, Any]:
    """The model's own step at ``context`` against its multi-head and multi-query twins and
    its own heads over an int8 cache, in turns: each one's seconds and bytes a step."""
    device, dtype, cfg = model.device, model.dtype, model.config
    variants = {"kv_heads_own": (model, KVCache), "int8_kv": (model, Int8KVCache)}
    for kv in (cfg.num_attention_heads, 1):
        if kv != cfg.num_key_value_heads:
            variants[f"kv_heads_{kv}"] = (_model(quick, device, dtype, kv), KVCache)
    cases = {name: StepCase(m, context, cls) for name, (m, cls) in variants.items()}
    seconds = steps_in_turns(cases, STEPS, rounds)
    out = {}
    for name, case in cases.items():
        c = case.model.config
        token = token_bytes_of(c, case.cache_cls, dtype)
        out[name] = {"kv_heads": c.num_key_value_heads, "cache": case.cache_cls.__name__,
                     "seconds": seconds[name], "weight_bytes": weight_bytes(case.model),
                     "kv_token_bytes": token,
                     "bytes": weight_bytes(case.model) + context * token}
    return out


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    device = default_device()
    dtype = default_dtype(device)
    probe = (16 if quick else 512) * 2**20
    before = read_bandwidth(device, probe)
    model = _model(quick, device, dtype)
    cfg = model.config
    weights = weight_bytes(model)
    token = kv_bytes_per_token(cfg, dtype.itemsize)
    predicted = kv_crossover_tokens(cfg, weights, dtype.itemsize)
    contexts = [SHORT, *(round(m * predicted) for m in MULTIPLES)]
    print(f"bench scale_long_context: {'tiny random (quick)' if quick else 'bandwidth-long'} "
          f"on {device}, {str(dtype).removeprefix('torch.')}: {weights / 1e6:.0f} MB of "
          f"weights, {token:,.0f} B of KV a token, crossover by bytes {predicted:,.0f} tokens, "
          f"window {cfg.max_position_embeddings:,}", flush=True)
    steps = context_steps(model, contexts, n=STEPS, rounds=2 if quick else ROUNDS)
    at = round(predicted)
    lever = levers(model, at, quick, 1 if quick else LEVER_ROUNDS)
    after = read_bandwidth(device, probe)
    reads = ReadBandwidth({w: max(r, after.ways[w]) for w, r in before.ways.items()})
    fit = fit_context_steps(steps)
    longest = contexts[-1]
    long_bytes = weights + longest * token
    ratios = {"scale_long_context_mbu": long_bytes / reads.best / steps[longest],
              "scale_kv_crossover_measured_vs_predicted": fit.crossover / predicted}
    weights_rate, kv_rate = fit.read_rates(weights, token)
    m = {"read_bandwidth": reads.ways, "bandwidth": reads.best, "fastest_read": reads.fastest_way,
         "weight_bytes": weights, "kv_token_bytes": token, "predicted_crossover": predicted,
         "contexts": contexts, "step_s": {str(c): s for c, s in steps.items()},
         "fit": {"fixed_s": fit.fixed_s, "per_token_s": fit.per_token_s,
                 "crossover": fit.crossover, "weights_rate": weights_rate, "kv_rate": kv_rate},
         "long_context": {"context": longest, "bytes": long_bytes, "seconds": steps[longest]},
         "levers_context": at, "levers": lever}
    notes = explain(ratios, m)
    print_summary(ratios, m, notes)
    data = report("scale_long_context", ratios=ratios, measurements=m,
                  conditions={"model": "tiny random (quick)" if quick else "bandwidth-long",
                              "device": str(device), "dtype": str(dtype),
                              "config": cfg.to_dict(), "steps": STEPS,
                              "rounds": 2 if quick else ROUNDS, "multiples": list(MULTIPLES),
                              "cache": "filled directly with seeded random keys and values",
                              "figures": "meaningless (--quick: a tiny random model)"
                              if quick else "timings on this machine; the text is noise"},
                  quick=quick)
    data["notes"] = notes
    write_json(data, json_path)
    return data


def explain(ratios: dict[str, float], m: dict[str, Any]) -> dict[str, str]:
    """What the run's own figures say where a goal is missed (the two read rates)."""
    from ..headlines import headline
    fit, bw = m["fit"], m["bandwidth"]
    rates = (f"the weights read at {fit['weights_rate'] / 1e9:.1f} GB/s "
             f"({fit['weights_rate'] / bw:.2f} of the fastest read, {bw / 1e9:.1f} GB/s), the KV "
             f"cache at {fit['kv_rate'] / 1e9:.1f} GB/s ({fit['kv_rate'] / bw:.2f})")
    notes = {}
    for name, value in ratios.items():
        h = headline("scale_long_context", name)
        if h is None or h.goal is None or h.goal.met(value):
            continue
        notes[name] = (f"{rates}: attention reads the cache below the rate the matmuls read the "
                       f"weights, so the step is KV-bound from a shorter context than the bytes "
                       f"say and runs below the roof at long context (kernel-bound: SDPA's "
                       f"one-query kernel, not the memory, sets the KV part's time)"
                       if fit["kv_rate"] < fit["weights_rate"] else rates)
    return notes


def print_summary(ratios: dict[str, float], m: dict[str, Any], notes: dict[str, str]) -> None:
    from ..headlines import headline
    from tinyserve.long_context import ContextFit
    fit = ContextFit(m["fit"]["fixed_s"], m["fit"]["per_token_s"])
    steps = {int(c): s for c, s in m["step_s"].items()}
    print()
    for line in split_lines(steps, fit, m["weight_bytes"], m["kv_token_bytes"], m["bandwidth"]):
        print(line)
    for line in rate_lines(fit, m["weight_bytes"], m["kv_token_bytes"], m["bandwidth"],
                           m["predicted_crossover"]):
        print(line)
    print(f"\nat {m['levers_context']:,} cached tokens:")
    for line in lever_lines({name: (v["bytes"], v["seconds"]) for name, v in m["levers"].items()},
                            "kv_heads_own"):
        print(f"  {line}")
    rows = []
    for name, value in ratios.items():
        h = headline("scale_long_context", name)
        goal = h.goal.text(h.fmt) if h is not None and h.goal else "-"
        met = "-" if h is None or h.goal is None else ("yes" if h.goal.met(value) else "no")
        rows.append([name, value, goal, met])
    print()
    print(table(["ratio", "value", "goal", "met"], rows))
    for name, text in notes.items():
        print(f"note, {name}: {text}")

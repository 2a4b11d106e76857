"""The KV-bound regime (issue 52): batch-1 decode on the long-context scale model around the context where its KV cache's bytes equal its weights', and the two levers there.

The model is ``load_model("bandwidth-long")`` (:mod:`tinyserve.scale`): the bandwidth target,
the same seeded weights, with a window past 2.5x its crossover context (weight bytes over KV
bytes a token, :func:`tinyserve.kv_cache.kv_crossover_tokens`). A cache of 50k tokens is
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
own over :class:`tinyserve.quant.Int8KVCache`, in turns, with each step's bytes (the int8
cache dequantizes every slot before attention, so it also reports the bytes that moves a
token); and a one-op probe, attention alone at the longest context
(:func:`tinyserve.workbook.kv_regime.attention_seconds`), against the fit's KV part there:
where the goals are missed the note names the step kernel-bound only when the probe explains
the KV part (the rule's share, :data:`tinyserve.workbook.roofline_lab.KERNEL_SHARE`). A
separate suite from ``bench scale`` so this part runs alone (a few minutes) and keeps its own report
(``bench/results/scale_long_context.json``). One torch thread. ``--quick`` runs the same code
on a tiny random model: its figures mean nothing and the report says so.
"""
from __future__ import annotations

from typing import Any

import torch

from tinyserve.device import default_device, default_dtype
from tinyserve.kv_cache import kv_bytes_per_token, kv_crossover_tokens
from tinyserve.long_context import context_steps, fit_context_steps
from tinyserve.model import TinyLlama
from tinyserve.quant import weight_bytes
from tinyserve.roofline import ReadBandwidth, read_bandwidth
from tinyserve.scale import long_context_config
from tinyserve.workbook.kv_regime import (SHORT, attention_seconds, int8_traffic, lever_table,
                                          levers, probe_line, rate_lines, split_lines)

from ..common import QUICK_CONFIG, report, write_json

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


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    device = default_device()
    dtype = default_dtype(device)
    buffer = (16 if quick else 512) * 2**20
    before = read_bandwidth(device, buffer)
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
    lever = levers(model, at, lambda kv: _model(quick, device, dtype, kv), STEPS,
                   1 if quick else LEVER_ROUNDS)
    longest = contexts[-1]
    attention_s = attention_seconds(model, longest, repeats=1 if quick else 3)
    after = read_bandwidth(device, buffer)
    reads = ReadBandwidth({w: max(r, after.ways[w]) for w, r in before.ways.items()})
    fit = fit_context_steps(steps)
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
         "levers_context": at, "levers": lever, "int8_kv_traffic": int8_traffic(cfg, dtype.itemsize),
         "attention_probe": {"context": longest, "seconds": attention_s,
                             "kv_part_s": fit.kv_s(longest)}}
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
    from ..headlines import missed_goals
    fit, bw = m["fit"], m["bandwidth"]
    rates = (f"the weights read at {fit['weights_rate'] / 1e9:.1f} GB/s "
             f"({fit['weights_rate'] / bw:.2f} of the fastest read, {bw / 1e9:.1f} GB/s), the KV "
             f"cache at {fit['kv_rate'] / 1e9:.1f} GB/s ({fit['kv_rate'] / bw:.2f})")
    missed = missed_goals("scale_long_context", ratios)
    return {name: _why(rates, m) for name in ratios if name in missed}


def _why(rates: str, m: dict[str, Any]) -> str:
    """The read rates, and the probe's verdict where the KV cache reads slower: the attention
    kernel alone explains the KV part (kernel-bound, below the roof) or it does not."""
    from tinyserve.workbook.roofline_lab import KERNEL_SHARE
    fit, probe = m["fit"], m["attention_probe"]
    if not 0 < fit["kv_rate"] < fit["weights_rate"] or probe["kv_part_s"] <= 0:
        return rates
    share = probe["seconds"] / probe["kv_part_s"]
    head = (f"{rates}: the step reads its KV cache below the rate it reads its weights, so it "
            f"turns KV-bound at a shorter context than the bytes say and runs below the roof "
            f"at long context; attention alone (one SDPA call a layer at "
            f"{probe['context']:,} tokens) takes {share:.0%} of the fit's KV part")
    if share >= KERNEL_SHARE:
        return head + ": kernel-bound (the one-query attention kernel, not the memory, sets it)"
    return head + ": less than the rule's share, so not the kernel alone"


def print_summary(ratios: dict[str, float], m: dict[str, Any], notes: dict[str, str]) -> None:
    from ..headlines import goals_table
    from tinyserve.long_context import ContextFit
    fit = ContextFit(m["fit"]["fixed_s"], m["fit"]["per_token_s"])
    steps = {int(c): s for c, s in m["step_s"].items()}
    print()
    for line in split_lines(steps, fit, m["weight_bytes"], m["kv_token_bytes"], m["bandwidth"]):
        print(line)
    for line in rate_lines(fit, m["weight_bytes"], m["kv_token_bytes"], m["bandwidth"],
                           m["predicted_crossover"]):
        print(line)
    probe = m["attention_probe"]
    print(probe_line(probe["seconds"], fit, probe["context"], m["kv_token_bytes"]))
    print(f"\nat {m['levers_context']:,} cached tokens:")
    for line in lever_table(m["levers"]):
        print(f"  {line}")
    t = m["int8_kv_traffic"]
    print(f"  the int8 cache stores {t['stored']:,.0f} B a token against {t['float']:,.0f}, but "
          f"dequantizes every slot before attention: {t['moved']:,.0f} B moved a token a step")
    print()
    print(goals_table("scale_long_context", ratios))
    for name, text in notes.items():
        print(f"note, {name}: {text}")

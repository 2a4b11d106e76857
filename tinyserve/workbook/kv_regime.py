"""Chapter 6b's long-context section: the plan of what it times, and the lines it prints.

The measuring is :mod:`tinyserve.long_context` (caches filled directly, steps in turns, the
fit); this module chooses the contexts (fewer in quick mode, :func:`tinyserve.workbook.
fast_lab.quick`), times the two levers (:func:`levers`) and attention alone (:func:`attention_
seconds`, the one-op probe the regime rule asks for before it calls a step kernel-bound), and
writes each printed line and the plot from the figures, so the notebook's cells stay a few
lines each and ``bench scale_long_context`` prints the same split.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..kv_cache import KVCache, kv_bytes_per_token
from ..long_context import ContextFit, StepCase, prepared_cache, steps_in_turns, token_bytes_of

#: A context short enough that its KV reads are a rounding error: the step's weights alone.
SHORT = 64


@dataclass(frozen=True)
class Plan:
    """Contexts as multiples of the predicted crossover (plus :data:`SHORT`), steps a run,
    rounds in turns, and rounds for the levers."""
    multiples: tuple[float, ...]
    n: int
    rounds: int
    lever_rounds: int


FULL = Plan((0.5, 1.0, 1.5, 2.0), n=4, rounds=3, lever_rounds=2)
# Quick mode (the chapter tests): the crossover and twice it, one timed round, two steps a run.
QUICK = Plan((1.0, 2.0), n=2, rounds=1, lever_rounds=1)


def plan(quick: bool) -> Plan:
    return QUICK if quick else FULL


def contexts(crossover: float, chosen: Plan) -> list[int]:
    """:data:`SHORT` and the plan's multiples of ``crossover``, in cached tokens."""
    return [SHORT, *(round(m * crossover) for m in chosen.multiples)]


def split_lines(steps: dict[int, float], fit: ContextFit, weight_bytes: float,
                kv_token_bytes: float, bandwidth: float) -> list[str]:
    """One line per context: the step's time, its weights part (the fit's fixed part) and its
    KV part (the rest), each beside the time its bytes take at ``bandwidth``, and the MBU."""
    lines = [f"{'context':>8s} {'step':>9s} {'weights part':>13s} {'(floor)':>9s} "
             f"{'KV part':>9s} {'(floor)':>9s} {'KV share of bytes':>18s} {'MBU':>5s}"]
    for context, seconds in sorted(steps.items()):
        kv_bytes = context * kv_token_bytes
        kv_part = seconds - fit.fixed_s
        mbu = (weight_bytes + kv_bytes) / bandwidth / seconds
        lines.append(f"{context:8,d} {seconds * 1e3:7.1f}ms {fit.fixed_s * 1e3:11.1f}ms "
                     f"{weight_bytes / bandwidth * 1e3:7.1f}ms {kv_part * 1e3:7.1f}ms "
                     f"{kv_bytes / bandwidth * 1e3:7.1f}ms "
                     f"{kv_bytes / (weight_bytes + kv_bytes):17.0%} {mbu:5.2f}")
    return lines


def rate_lines(fit: ContextFit, weight_bytes: float, kv_token_bytes: float,
               bandwidth: float, predicted: float) -> list[str]:
    """The two read rates the fit implies, against ``bandwidth``, and the two crossovers."""
    weights_rate, kv_rate = fit.read_rates(weight_bytes, kv_token_bytes)
    return [f"weights read at {weights_rate / 1e9:5.1f} GB/s "
            f"({weights_rate / bandwidth:.2f} of the fastest read, {bandwidth / 1e9:.1f} GB/s)",
            f"KV cache read at {kv_rate / 1e9:5.1f} GB/s ({kv_rate / bandwidth:.2f} of it)",
            f"crossover by bytes: {predicted:,.0f} tokens; measured (where the KV part equals "
            f"the weights part): {fit.crossover:,.0f} tokens, {fit.crossover / predicted:.2f}x "
            f"the bytes' (= the KV rate over the weights' rate)"]


def lever_lines(levers: dict[str, tuple[float, float]], base: str) -> list[str]:
    """``levers`` maps a name to (bytes a step reads, seconds a step): a line each with both,
    and each as a multiple of ``base``'s."""
    base_bytes, base_s = levers[base]
    return [f"{name:30s} {nbytes / 1e6:6,.0f} MB a step ({nbytes / base_bytes:4.2f}x the "
            f"bytes), {seconds * 1e3:7.1f} ms ({seconds / base_s:4.2f}x the time)"
            for name, (nbytes, seconds) in levers.items()]


def levers(model: torch.nn.Module, context: int, build: Callable[[int], torch.nn.Module],
           n: int = 4, rounds: int = 2) -> dict[str, dict[str, Any]]:
    """The two levers at ``context`` cached tokens, in turns: ``model``'s own step
    (``kv_heads_own``), the same over an int8 cache (``int8_kv``), and ``build(kv_heads)``'s
    steps with as many KV heads as query heads (multi-head) and with one (multi-query). Each
    with its seconds a step, its KV heads, its cache, and the bytes it stores: weights plus
    ``context`` tokens of cache (for the int8 cache: int8 values and their scales)."""
    cfg = model.config
    variants = {"kv_heads_own": (model, KVCache)}
    from ..quant import Int8KVCache
    variants["int8_kv"] = (model, Int8KVCache)
    for kv in (cfg.num_attention_heads, 1):
        if kv != cfg.num_key_value_heads:
            variants[f"kv_heads_{kv}"] = (build(kv), KVCache)
    cases = {name: StepCase(m, context, cls) for name, (m, cls) in variants.items()}
    seconds = steps_in_turns(cases, n, rounds)
    from ..quant import weight_bytes
    out = {}
    for name, case in cases.items():
        c, weights = case.model.config, weight_bytes(case.model)
        token = token_bytes_of(c, case.cache_cls, model.dtype)
        out[name] = {"kv_heads": c.num_key_value_heads, "cache": case.cache_cls.__name__,
                     "seconds": seconds[name], "weight_bytes": weights, "kv_token_bytes": token,
                     "bytes": weights + context * token}
    return out


def lever_table(result: dict[str, dict[str, Any]]) -> list[str]:
    """:func:`lever_lines` for :func:`levers`' result, each named by its KV heads and cache,
    against the model's own step."""
    names = {name: f"{v['kv_heads']:2d} KV head{'s' if v['kv_heads'] != 1 else ''}, "
                   f"{'int8' if v['cache'] != 'KVCache' else 'float'} cache"
             for name, v in result.items()}
    order = sorted(result, key=lambda k: (result[k]["cache"] != "KVCache", -result[k]["kv_heads"]))
    return lever_lines({names[k]: (result[k]["bytes"], result[k]["seconds"]) for k in order},
                       names["kv_heads_own"])


def int8_traffic(cfg: Any, element_bytes: int = 4) -> dict[str, float]:
    """Bytes a cached token moves per step in our int8 cache (:class:`tinyserve.quant.
    Int8KVCache`), which dequantizes every slot before attention: the int8 values and their
    scales read, the float copy written, and that copy read again by attention; against the
    float cache's one read. ``stored`` is what the int8 cache holds a token."""
    from ..quant import Int8KVCache
    stored = token_bytes_of(cfg, Int8KVCache)
    fp = kv_bytes_per_token(cfg, element_bytes)
    return {"stored": stored, "float": fp, "moved": stored + 2 * fp}


@torch.no_grad()
def attention_seconds(model: torch.nn.Module, context: int, repeats: int = 3,
                      seed: int = 0) -> float:
    """A one-op probe: the step's attention alone at ``context`` cached tokens, on a cache
    filled as the step's is: for every layer one ``scaled_dot_product_attention`` call, the
    query heads that share a KV head as rows of it over that layer's keys and values with an
    all-visible mask (the call :class:`tinyserve.model.Attention` makes), back to back; the
    fastest of ``repeats`` after a warm-up. No matmuls, norms or Python between: held against
    the fit's KV part, it says whether attention's kernel is what the KV part costs."""
    import torch.nn.functional as F
    from ..device import timings
    cfg = model.config
    cache = prepared_cache(StepCase(model, context), 1, seed)
    n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, cfg.num_key_value_heads, n_rep, cfg.head_dim,
                    generator=g).to(cache.k.device, cache.k.dtype)
    mask = torch.ones(1, 1, n_rep, context, dtype=torch.bool, device=cache.k.device)
    layers = [(cache.k[i, :, :, :context], cache.v[i, :, :, :context])
              for i in range(cfg.num_hidden_layers)]

    def run() -> None:
        for k, v in layers:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return min(timings(run, cache.k.device, repeats))


def probe_line(probe_s: float, fit: ContextFit, context: int, kv_token_bytes: float) -> str:
    """The probe beside the fit's KV part at ``context``, and the rate attention read at."""
    kv_s = fit.kv_s(context)
    return (f"attention alone at {context:,} tokens (one SDPA call a layer): "
            f"{probe_s * 1e3:.1f} ms, reading the cache at "
            f"{context * kv_token_bytes / probe_s / 1e9:.1f} GB/s; the fit's KV part there: "
            f"{kv_s * 1e3:.1f} ms, so the attention kernel alone is {probe_s / kv_s:.0%} of it")


def plot_steps(ax: Any, steps: dict[int, float], fit: ContextFit, weight_bytes: float,
               kv_token_bytes: float, bandwidth: float, predicted: float) -> None:
    """Step time by context on ``ax``: the measured steps, the fitted line, the floor (weights
    plus KV bytes over ``bandwidth``), and the two crossovers (bytes' and fit's)."""
    top = max(steps)
    xs = [0, top]
    ax.plot(list(steps), [s * 1e3 for s in steps.values()], "o", color="tab:blue",
            label="decode step (measured)")
    ax.plot(xs, [(fit.fixed_s + fit.kv_s(x)) * 1e3 for x in xs], "-", color="tab:blue",
            alpha=0.5, label="fit: weights part + context x per-token part")
    ax.plot(xs, [(weight_bytes + x * kv_token_bytes) / bandwidth * 1e3 for x in xs], "--",
            color="black", label="memory floor: (weights + KV bytes) / bandwidth")
    ax.axvline(predicted, color="tab:green", ls=":", label="crossover by bytes")
    if 0 < fit.crossover < 2 * top:
        ax.axvline(fit.crossover, color="tab:red", ls=":", label="crossover measured (fit)")
    ax.set_xlabel("cached tokens (context)")
    ax.set_ylabel("time per decode step (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")

"""int8 (and bf16) against fp32: weight and KV memory, decode speed and quality, in one run.

Variants of the shipped target, each against the fp32 model with the fp32 cache:

- **bf16**: weights and cache in bfloat16 (half the bytes, float arithmetic);
- **int8 weights**: :func:`tinyserve.quant.quantize_model` (per-channel int8, tied matrix
  included), three kernels: ``scale_after`` (the default), ``reference`` (dequantize, then
  matmul) and ``int8pack`` (PyTorch's fused CPU kernel; CPU only);
- **int8 weights, fp32 embedding**: the tied embedding / LM head left in float;
- **int8 KV**: fp32 weights, :class:`tinyserve.quant.Int8KVCache`;
- **int8 weights + KV**: both.

Memory is counted from tensor bytes (weights: each storage once; KV: one sequence filling
the 512-token window). Decode speed: batch 1, greedy, ms per decode step after a short
(16-token) and a long (384-token) prompt, mean over 32 steps, median of 7 rounds in which
the variants take turns (so another process's load hits them alike); speed-ups are fp32 time
/ variant time. Quality: :func:`tinyserve.quant.quality` on the first held-out validation
windows (teacher-forced): logit error, greedy agreement and the relative change of
validation loss. ``--quick`` runs a tiny random model on random tokens: shape only.
"""
from __future__ import annotations

import copy
import functools
import statistics
import time
from typing import Any

import torch

from tinyserve.device import default_device
from tinyserve.generate import decode_step, prefill
from tinyserve.kv_cache import KVCache
from tinyserve.model import TinyLlama
from tinyserve.quant import Int8KVCache, quality, quantize_model, validation_windows, weight_bytes

from ..common import QUICK_CONFIG, in_turns, load_bench_model, report, sync, table, write_json

def _base(quick: bool, device: torch.device) -> tuple[TinyLlama, str]:
    return load_bench_model(quick, device)


@torch.no_grad()
def decode_step_seconds(model: TinyLlama, cache_cls: type[KVCache], prompt_len: int,
                        new_tokens: int) -> float:
    """Mean time of one greedy decode step after a ``prompt_len`` prompt (prefill untimed)."""
    device = model.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (1, prompt_len), generator=g).to(device)
    cache = cache_cls.for_model(model, 1, prompt_len + new_tokens)
    token = prefill(model, ids, cache)[:, -1].argmax(-1)
    sync(device)
    start = time.perf_counter()
    for pos in range(prompt_len, prompt_len + new_tokens):
        token = decode_step(model, token, torch.tensor([pos], device=device), cache).argmax(-1)
    sync(device)
    return (time.perf_counter() - start) / new_tokens


def decode_ms(variants: dict[str, tuple[TinyLlama, type[KVCache]]], prompt_len: int,
              new_tokens: int, repeats: int) -> dict[str, float]:
    """Median ms per decode step of every variant. Variants take turns within each round, so
    a burst of load from another process slows them all alike instead of one of them."""
    runs = in_turns({label: functools.partial(decode_step_seconds, model, cache_cls, prompt_len,
                                             new_tokens)
                     for label, (model, cache_cls) in variants.items()}, repeats)
    return {k: 1e3 * statistics.median(v) for k, v in runs.items()}


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    device = default_device()
    fp32, name = _base(quick, device)
    window = fp32.config.max_position_embeddings
    if quick:
        g = torch.Generator().manual_seed(0)
        windows = torch.randint(0, QUICK_CONFIG.vocab_size, (1, 33), generator=g)
        prompts, new_tokens, repeats = {"short": 4, "long": 32}, 8, 1
    else:
        windows = validation_windows(8)
        prompts, new_tokens, repeats = {"short": 16, "long": 384}, 32, 7
    kind = "random" if quick else "held-out"
    print(f"bench quant: {name} on {device}, batch 1, greedy; quality on "
          f"{windows[:, 1:].numel():,} {kind} tokens", flush=True)

    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)  # .to() is in place: copy first
    int8 = quantize_model(fp32)
    variants: dict[str, tuple[TinyLlama, type[KVCache]]] = {
        "fp32": (fp32, KVCache),
        "bf16": (bf16, KVCache),
        "int8 weights": (int8, KVCache),
        "int8 weights, fp32 embedding": (quantize_model(fp32, embeddings=False), KVCache),
        "int8 weights, reference kernel": (quantize_model(fp32, kernel="reference"), KVCache),
        "int8 KV": (fp32, Int8KVCache),
        "int8 weights + KV": (int8, Int8KVCache),
    }
    if device.type == "cpu":
        variants["int8 weights, int8pack kernel"] = (quantize_model(fp32, kernel="int8pack"),
                                                     KVCache)
    same_quality = {"int8 weights, reference kernel", "int8 weights, int8pack kernel"}

    rows: dict[str, dict[str, Any]] = {}
    for label, (model, cache_cls) in variants.items():
        kv = cache_cls.for_model(model, 1, window).nbytes
        row: dict[str, Any] = {"weight_bytes": weight_bytes(model), "kv_bytes_full_window": kv,
                               "kv_bytes_per_token": kv // window}
        if label != "fp32" and label not in same_quality:  # kernels are tested equal instead
            cache = cache_cls if cache_cls is not KVCache else None
            row["quality"] = quality(fp32, model, windows, cache_cls=cache)
        rows[label] = row
        print(f"  {label}: memory and quality measured", flush=True)

    for key, n in prompts.items():
        print(f"  timing decode after a {n}-token prompt", flush=True)
        for label, ms in decode_ms(variants, n, new_tokens, repeats).items():
            rows[label][f"decode_ms_{key}"] = ms
    base = rows["fp32"]
    print(f"\nmemory and decode speed (ms per decode step, prompts of {prompts['short']} and "
          f"{prompts['long']} tokens; x = fp32 time / this time)")
    print(table(["variant", "weights MiB", "KV KiB/token", "short ms", "x", "long ms", "x"],
                [[k, r["weight_bytes"] / 2**20, r["kv_bytes_per_token"] / 1024,
                  r["decode_ms_short"], base["decode_ms_short"] / r["decode_ms_short"],
                  r["decode_ms_long"], base["decode_ms_long"] / r["decode_ms_long"]]
                 for k, r in rows.items()]))
    print("\nquality against fp32 (teacher-forced on held-out windows)")
    print(table(["variant", "max |dlogit|", "rel RMS err", "greedy agree", "val loss",
                 "val loss change"],
                [[k, q["max_abs_logit_error"], q["rel_rms_logit_error"], q["greedy_agreement"],
                  q["val_loss"], f"{100 * q['val_loss_delta']:+.3f}%"]
                 for k, r in rows.items() if (q := r.get("quality"))]), flush=True)

    w8, kv8 = rows["int8 weights"], rows["int8 KV"]
    data = report(
        "quant",
        ratios={
            "int8_weight_memory_ratio": base["weight_bytes"] / w8["weight_bytes"],
            "int8_kv_memory_ratio": base["kv_bytes_full_window"] / kv8["kv_bytes_full_window"],
            "int8_val_loss_delta": w8["quality"]["val_loss_delta"],
            "int8_kv_val_loss_delta": kv8["quality"]["val_loss_delta"],
            "int8_decode_speedup": base["decode_ms_short"] / w8["decode_ms_short"],
            "int8_kv_decode_speedup_long": base["decode_ms_long"] / kv8["decode_ms_long"],
            "bf16_decode_speedup": base["decode_ms_short"] / rows["bf16"]["decode_ms_short"],
        },
        measurements={"variants": rows, "fp32_val_loss":
                      w8["quality"]["reference_val_loss"]},
        conditions={"model": name, "device": str(device), "batch": 1, "sampling": "greedy",
                    "prompt_tokens": prompts, "new_tokens": new_tokens, "repeats": repeats,
                    "quality_tokens": int(windows[:, 1:].numel()),
                    "torch_threads": torch.get_num_threads()},
        quick=quick)
    write_json(data, json_path)
    return data

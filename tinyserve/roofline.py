"""The decode roofline: what one decode step must read and compute, against what the machine can
move and multiply. One measurement module, shared by the bench suites and the chapters.

A decode step reads every weight once, whatever the batch, plus each row's cached keys and
values; it does about 2 FLOPs per weight per row. So at batch ``B`` and context ``n``:

    time >= max(bytes(B, n) / bandwidth, flops(B, n) / flop_rate)

The first bound (memory) is flat in ``B`` until the KV reads grow; the second (compute)
grows linearly with ``B``. Where they cross is the batch at which decode stops being
memory-bound. A measured step far above both bounds is overhead-bound: Python, kernel
launches and small-tensor bookkeeping, which the bounds do not count.

Both machine figures are *measured* here, not taken from a datasheet: a large copy for the
bandwidth (it reads and writes each byte once) and a large matmul for the FLOP rate.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import statistics
import time
from typing import Any

import torch

from .workbook.capacity import kv_bytes_for_config


def _median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and lazy kernel loading are not bandwidth
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth(device: torch.device | str, nbytes: int = 512 * 2**20,
                     repeats: int = 5) -> float:
    """Bytes per second of a large copy (it reads ``nbytes`` and writes ``nbytes``).

    ``nbytes`` should be well above the last-level cache, or the figure is the cache's."""
    device = torch.device(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), device, repeats)


def matmul_flops(device: torch.device | str, dtype: torch.dtype = torch.float32,
                 n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` matmul (2 n^3 FLOPs) in ``dtype``."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _median_seconds(lambda: a @ b, device, repeats)


@dataclass(frozen=True)
class DecodeCost:
    """Bytes and FLOPs of one decode step of a model at a batch size and context length."""
    weight_bytes: int
    kv_bytes: int          # every row's cached keys and values, read once
    flops: float

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def decode_cost(model: torch.nn.Module, batch: int, context: int) -> DecodeCost:
    """What one decode step of ``model`` reads and computes for ``batch`` rows of ``context``
    cached tokens each. Weights count once (the tied embedding too: the step reads it once,
    as the LM head); FLOPs are 2 per weight per row plus attention's 4 per cached key and
    head dimension per query head."""
    cfg = model.config
    params = {id(p): p for p in model.parameters()}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    dtype = next(iter(params)).dtype
    kv = batch * kv_bytes_for_config(cfg, context, dtype)
    n_weights = sum(p.numel() for p in params) - cfg.vocab_size * cfg.hidden_size * (
        0 if cfg.tie_word_embeddings else 1)  # an embedding lookup is a read, not a matmul
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context
    return DecodeCost(weight_bytes, kv, batch * (2 * n_weights + attention))


def bounds_seconds(cost: DecodeCost, bandwidth: float, flop_rate: float) -> dict[str, float]:
    """The memory bound, the compute bound and the roofline (the larger), in seconds."""
    memory, compute = cost.bytes / bandwidth, cost.flops / flop_rate
    return {"memory_s": memory, "compute_s": compute, "roofline_s": max(memory, compute)}


def mbu(cost: DecodeCost, bandwidth: float, step_seconds: float) -> float:
    """Model bandwidth utilisation: the memory bound / the measured step time (1.0 = the
    step moves bytes as fast as a plain copy does)."""
    return cost.bytes / bandwidth / step_seconds

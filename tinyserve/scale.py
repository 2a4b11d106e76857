"""The bandwidth-scale model: the same ``TinyLlama`` at a size where decode meets the memory wall.

The shipped target (5.2M parameters, 21 MB in fp32) fits in a 32 MiB last-level cache, common
on server CPUs (many laptop CPUs have 12-18 MB of L3, where part of it streams from memory),
and in a GPU's L2, so its decode steps are bound by dispatch (Python and kernel launches),
not by memory. The lessons that depend on the regime (batching is nearly free up to the
compute ridge, int8 weights speed decode up, a verify pass costs about one step, tensor
parallelism splits the bytes) need a model whose weights must come from DRAM or HBM on every
step. This module makes one: a *configuration* of the one model class, with seeded random
weights created at load time on the target device in the dtype asked for. Nothing is written
to disk or downloaded; creating it takes seconds.

Its text is noise (the weights are random), so it is for timing only: quality and acceptance
rates stay measured on the shipped, trained models.

Sizes:

- **CPU** (``bandwidth``): hidden 2048, MLP 5504, 16 query / 4 KV heads, vocab 4096 (the
  shipped tokenizer's), wide and shallow so that the matmul weights dominate a step's bytes.
  The number of layers is the smallest that puts the weights at **8x the last-level cache**
  or more (read from the OS; :data:`FALLBACK_LLC_BYTES` when it cannot be read), capped at
  :data:`CPU_CAP_BYTES` (~1 GB in fp32) so a laptop can hold it next to a notebook.
- **CUDA**: the GPU timing preset (hidden 4096, MLP 11008, 8 layers, 32 / 8 heads: ~1.4B
  parameters, ~2.9 GB in bf16), far above any GPU's L2.
- ``bandwidth-long``: the ``bandwidth`` target (the same weights from the same seed: only the
  window differs) with a context window long enough that one row's KV cache outgrows the
  weights: :data:`LONG_WINDOW_MULTIPLE` times the context where the two are equal
  (:func:`tinyserve.kv_cache.kv_crossover_tokens`), rounded up to a power of two. Chapter
  6b and ``bench scale_long_context`` time decode there with the cache filled directly;
  ``kv_heads=`` builds it with more or fewer KV heads (grouped-query attention's lever).
- ``bandwidth-draft``: a matching small draft for speculative decoding (same vocabulary,
  19 MB in fp32 on the CPU: 1/20 of a 2-layer target, the size a 32 MiB cache gives, and
  small enough to sit in such a cache itself; ~1/54 of the bytes on a GPU), as random as the
  target.
"""
from __future__ import annotations

from dataclasses import replace
import math
import os
from pathlib import Path

import torch

from .config import ModelConfig
from .device import resolve

#: Presets this module builds; :func:`tinyserve.load_model` accepts them by name.
SCALE_PRESETS = ("bandwidth", "bandwidth-draft", "bandwidth-long")
#: Used when the OS does not say how big the last-level cache is (an L3 common on servers;
#: a smaller cache only puts the model further past it).
FALLBACK_LLC_BYTES = 32 * 2**20
#: How many last-level caches the CPU model's weights must span at least.
LLC_MULTIPLE = 8
#: The CPU model's weights stay at or below this (fp32), whatever the cache.
CPU_CAP_BYTES = 2**30
#: The long preset's window spans at least this many times its KV crossover context, so a
#: chapter can time steps on both sides of it.
LONG_WINDOW_MULTIPLE = 2.5
#: The seed every scale model is drawn from (the same weights each time, on one device).
SEED = 0

_CPU_LAYER = ModelConfig(vocab_size=4096, hidden_size=2048, intermediate_size=5504,
                         num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=4,
                         max_position_embeddings=1024)
_CPU_DRAFT = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024)
_GPU_TARGET = ModelConfig(vocab_size=4096, hidden_size=4096, intermediate_size=11008,
                          num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                          max_position_embeddings=2048)
_GPU_DRAFT = ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=2048)


SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(sysfs: Path = SYSFS_CACHE) -> tuple[int, str]:
    """The CPU's largest data cache in bytes and where the figure came from ("sysfs",
    "sysconf" or "fallback")."""
    best = 0
    for index in sysfs.glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            best = max(best, _parse_size((index / "size").read_text().strip()))
        except (OSError, ValueError):
            continue
    if best:
        return best, "sysfs"
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if size and size > 0:
            return int(size), "sysconf"
    return FALLBACK_LLC_BYTES, "fallback"


def _parse_size(text: str) -> int:
    """``'32768K'`` -> bytes (sysfs writes K, sometimes M)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if text and text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


def weight_bytes_of(cfg: ModelConfig, element_bytes: int = 4) -> int:
    """Bytes of a config's weights (norm gains included, the tied embedding once)."""
    from .config import parameter_count
    return parameter_count(cfg) * element_bytes


def cpu_layers(llc_bytes: int) -> int:
    """Layers of the CPU preset: the fewest whose fp32 weights reach ``LLC_MULTIPLE`` times
    ``llc_bytes``, but no more than fit under :data:`CPU_CAP_BYTES`."""
    layers, cap = 1, CPU_CAP_BYTES
    while (weight_bytes_of(replace(_CPU_LAYER, num_hidden_layers=layers)) < LLC_MULTIPLE * llc_bytes
           and weight_bytes_of(replace(_CPU_LAYER, num_hidden_layers=layers + 1)) <= cap):
        layers += 1
    return layers


def scale_config(name: str = "bandwidth", device: torch.device | str = "cpu",
                 layers: int | None = None, *, kv_heads: int | None = None) -> ModelConfig:
    """The configuration of a scale preset on ``device`` (``layers`` overrides the target's
    depth, e.g. for a fast test of the same code path; ``kv_heads`` the long preset's number of
    KV heads, a divisor of its query heads)."""
    if name not in SCALE_PRESETS:
        raise ValueError(f"unknown scale preset {name!r}; choose one of: {', '.join(SCALE_PRESETS)}")
    gpu = torch.device(device).type == "cuda"
    if name == "bandwidth-draft":
        cfg = _GPU_DRAFT if gpu else _CPU_DRAFT
    elif gpu:
        cfg = _GPU_TARGET
    else:
        cfg = replace(_CPU_LAYER, num_hidden_layers=cpu_layers(last_level_cache_bytes()[0]))
    if layers is not None:
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ValueError(f"layers must be a positive whole number, not {layers!r}")
        cfg = replace(cfg, num_hidden_layers=layers)
    if kv_heads is not None and name != "bandwidth-long":
        raise ValueError(f"kv_heads= sizes the 'bandwidth-long' preset, not {name!r}")
    if name == "bandwidth-long":
        cfg = long_context_config(cfg, kv_heads)
    return cfg


def long_context_config(cfg: ModelConfig, kv_heads: int | None = None) -> ModelConfig:
    """``cfg`` with a window of :data:`LONG_WINDOW_MULTIPLE` times its KV crossover context,
    rounded up to a power of two (weights and cache in one element size: the ratio has none),
    and ``kv_heads`` KV heads (default: its own). The window is its own heads' in either case,
    so variants with other heads are timed at the same contexts."""
    from .kv_cache import kv_crossover_tokens
    crossover = kv_crossover_tokens(cfg, weight_bytes_of(cfg, 4), 4)
    window = 1 << math.ceil(math.log2(LONG_WINDOW_MULTIPLE * crossover))
    cfg = replace(cfg, max_position_embeddings=max(window, cfg.max_position_embeddings))
    heads = cfg.num_attention_heads
    if kv_heads is not None:
        if (not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads < 1
                or heads % kv_heads):
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(f"kv_heads must divide the {heads} query heads: one of "
                             f"{divisors}, not {kv_heads!r}")
        cfg = replace(cfg, num_key_value_heads=kv_heads)
    return cfg


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device`` (``None`` if the OS does not say)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


#: Peak bytes while building, per byte of weights in the target dtype: the weights, the
#: stacked copy inference keeps for its fused matmuls (:func:`tinyserve.model.fused_linear`),
#: and headroom for activations and the caches of a chapter.
FOOTPRINT = 2.5


def build_scale_model(name: str = "bandwidth", device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None, *, layers: int | None = None,
                      kv_heads: int | None = None, seed: int = SEED) -> "TinyLlama":  # noqa: F821 (forward reference)
    """A scale preset with seeded random weights, created on ``device`` in ``dtype`` (defaults
    as for the shipped models: CUDA in bf16 when present, else the CPU in fp32), in eval mode.

    Raises ``ValueError`` naming the limit when the model would not fit in the memory the
    device has free."""
    from .model import TinyLlama
    dev, dt = resolve(device, dtype)
    cfg = scale_config(name, dev, layers, kv_heads=kv_heads)
    need = int(FOOTPRINT * weight_bytes_of(cfg, dt.itemsize))
    free = available_memory(dev)
    if free is not None and need > free:
        raise ValueError(
            f"the {name!r} model with {cfg.num_hidden_layers} layers needs about "
            f"{need / 2**30:.1f} GiB on {dev} ({dt}), but only {free / 2**30:.1f} GiB is free; "
            f"pass fewer layers (layers=N) or close other programs.")
    devices = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(dev):
            model = TinyLlama(cfg)
    model.scale_preset = name   # so reports can say which model they timed
    return model.to(dtype=dt).eval()

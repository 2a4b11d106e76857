"""How much memory the KV cache needs, and how many sequences fit.

Every token stores one key and one value vector per layer per KV head:

    KV bytes per sequence = 2 (K and V) x layers x tokens x KV heads x head_dim x bytes/elem

It grows linearly with the tokens held, which is why long contexts and many concurrent
requests run out of memory long before the weights do.

Two units are kept apart on purpose: a GB is 10^9 bytes, a GiB is 2^30 bytes. Both appear in
a capacity review (``nvidia-smi`` prints MiB, data sheets and dashboards may print GB), so
every figure carries its unit and no sum mixes the two: they differ by 7.4%, enough to turn
"it fits" into an out-of-memory error. What a device can really hold is what it reports free
(``torch.cuda.mem_get_info``) after the runtime's own share, not a conversion of its label.

Architectures change the formula's factors, not its shape: grouped-query attention shrinks
the KV heads; sliding-window attention caps the tokens a windowed layer keeps
(:func:`kv_bytes_sliding_window`); multi-head latent attention caches one compressed vector per
token and layer instead of K and V per head (:func:`kv_bytes_mla`).
"""
from __future__ import annotations

import torch

from ..config import ModelConfig

GB = 10**9
GiB = 2**30

_BYTES_PER_ELEMENT = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2,
                      "bfloat16": 2, "fp8": 1, "int8": 1}


def bytes_per_element(dtype: torch.dtype | str) -> int:
    """Bytes of one cached number: a torch dtype or a name such as "fp16" or "int8"."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    try:
        return _BYTES_PER_ELEMENT[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of "
                         f"{', '.join(sorted(_BYTES_PER_ELEMENT))} or a torch dtype") from None


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype | str) -> int:
    """Bytes one token adds to the cache: 2 x layers x KV heads x head_dim x bytes/elem."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element(dtype)


def kv_bytes_per_sequence(num_layers: int, tokens: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype | str) -> int:
    """2 x layers x tokens x KV heads x head_dim x bytes/elem."""
    return tokens * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)


def kv_bytes_sliding_window(num_layers: int, tokens: int, num_kv_heads: int, head_dim: int,
                            dtype: torch.dtype | str, window: int, full_layers: int = 0) -> int:
    """KV bytes of one sequence when every layer but ``full_layers`` attends only to the last
    ``window`` tokens (sliding-window attention: Mistral 7B windows every layer at 4,096;
    models such as Gemma 2 alternate windowed and full layers). A windowed layer never keeps
    more than ``window`` tokens, so past the window the cache stops growing there."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a whole number of tokens >= 1, got {window!r}")
    if not 0 <= full_layers <= num_layers:
        raise ValueError(f"full_layers must be between 0 and num_layers ({num_layers}), "
                         f"got {full_layers}")
    per_layer_token = kv_bytes_per_token(1, num_kv_heads, head_dim, dtype)
    kept = full_layers * tokens + (num_layers - full_layers) * min(tokens, window)
    return per_layer_token * kept


def kv_bytes_mla(num_layers: int, tokens: int, latent_dim: int, rope_dim: int,
                 dtype: torch.dtype | str) -> int:
    """KV bytes of one sequence under multi-head latent attention (MLA, DeepSeek-V2/V3).

    Each layer caches, per token, one compressed latent of ``latent_dim`` numbers (keys and
    values of every head are rebuilt from it) plus one rotary key part of ``rope_dim`` shared
    by all heads: no factor 2, no head count. DeepSeek-V2 uses 512 + 64 = 576 numbers, as
    much as a GQA cache with 2.25 KV heads of 128."""
    if latent_dim < 1 or rope_dim < 0:
        raise ValueError(f"latent_dim must be >= 1 and rope_dim >= 0, got {latent_dim}, {rope_dim}")
    return num_layers * tokens * (latent_dim + rope_dim) * bytes_per_element(dtype)


def kv_bytes_for_config(config: ModelConfig, tokens: int, dtype: torch.dtype | str) -> int:
    """The formula with a model's own shape."""
    return kv_bytes_per_sequence(config.num_hidden_layers, tokens, config.num_key_value_heads,
                                 config.head_dim, dtype)


def to_gb(nbytes: float) -> float:
    """Bytes in GB (10^9)."""
    return nbytes / GB


def to_gib(nbytes: float) -> float:
    """Bytes in GiB (2^30)."""
    return nbytes / GiB


def max_sequences(free_bytes: float, bytes_per_sequence: int) -> int:
    """How many sequences fit in ``free_bytes`` if each reserves ``bytes_per_sequence``
    (a contiguous cache reserves its whole ``max_seq``, used or not)."""
    if bytes_per_sequence <= 0:
        raise ValueError(f"bytes_per_sequence must be positive, got {bytes_per_sequence}")
    return int(free_bytes // bytes_per_sequence)


def max_tokens_in_cache(free_bytes: float, config: ModelConfig, dtype: torch.dtype | str) -> int:
    """How many tokens, over all sequences, the free memory can cache."""
    return int(free_bytes // kv_bytes_for_config(config, 1, dtype))

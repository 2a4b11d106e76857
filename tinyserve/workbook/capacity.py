"""How much memory the KV cache needs, and how many sequences fit.

Every token stores one key and one value vector per layer per KV head:

    KV bytes per sequence = 2 (K and V) x layers x tokens x KV heads x head_dim x bytes/elem

It grows linearly with the tokens held, which is why long contexts and many concurrent
requests run out of memory long before the weights do.

Two units are kept apart on purpose: a GB is 10^9 bytes (what vendors print on a GPU's box
and what many dashboards show), a GiB is 2^30 bytes (what ``nvidia-smi`` and most allocators
count). They differ by 7.4%, enough to turn "it fits" into an out-of-memory error.
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

"""KV capacity: the formula, GB vs GiB, and the formula against the bytes the cache allocates."""
from __future__ import annotations

import pytest
import torch

from tinyserve.workbook.capacity import (GB, GiB, bytes_per_element, kv_bytes_for_config, kv_bytes_mla,
                                kv_bytes_sliding_window,
                                kv_bytes_per_sequence, kv_bytes_per_token, max_sequences, to_gb,
                                to_gib)
from tinyserve.config import PRESETS, ModelConfig
from tinyserve.kv_cache import KVCache


def test_formula_on_a_large_model() -> None:
    # 80 layers, 8 KV heads of 128 dims, fp16, 4096 tokens: 2*80*4096*8*128*2 bytes.
    n = kv_bytes_per_sequence(80, 4096, 8, 128, "fp16")
    assert n == 1_342_177_280
    assert to_gib(n) == pytest.approx(1.25) and to_gb(n) == pytest.approx(1.342177280)
    assert kv_bytes_per_token(80, 8, 128, torch.float16) == 327_680


def test_gb_and_gib_are_different_units() -> None:
    assert GB == 1_000_000_000 and GiB == 1_073_741_824
    assert to_gb(GiB) == pytest.approx(1.073741824)
    assert to_gib(GB) == pytest.approx(0.9313225746)


def test_fewer_kv_heads_shrink_the_cache_in_proportion() -> None:
    assert kv_bytes_per_sequence(80, 4096, 8, 128, "fp16") == \
        4 * kv_bytes_per_sequence(80, 4096, 2, 128, "fp16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [PRESETS["target"], PRESETS["draft"],
                                 ModelConfig(vocab_size=50, hidden_size=48, num_hidden_layers=3,
                                             num_attention_heads=6, num_key_value_heads=3,
                                             max_position_embeddings=40)])
def test_formula_equals_the_bytes_the_cache_allocates(cfg: ModelConfig, dtype: torch.dtype) -> None:
    tokens = 37
    cache = KVCache(cfg, batch_size=2, max_seq=tokens, dtype=dtype)
    assert cache.nbytes == 2 * kv_bytes_for_config(cfg, tokens, dtype)
    assert cache.k.element_size() == bytes_per_element(dtype)


def test_how_many_sequences_fit() -> None:
    per_seq = kv_bytes_per_sequence(80, 4096, 8, 128, "fp16")  # 1.25 GiB
    assert max_sequences(10 * GiB, per_seq) == 8
    assert max_sequences(10 * GB, per_seq) == 7  # the 7% between the units costs a sequence
    with pytest.raises(ValueError, match="unknown dtype 'fp5'"):
        bytes_per_element("fp5")


# --- sliding-window attention and latent-compressed caches -----------------------------------

def test_sliding_window_caps_the_windowed_layers() -> None:
    # Mistral-7B-like: 32 layers, 8 KV heads of 128, fp16, a 4,096-token window everywhere.
    gqa = kv_bytes_per_sequence(32, 4096, 8, 128, "fp16")
    assert kv_bytes_sliding_window(32, 2048, 8, 128, "fp16", window=4096) == gqa // 2
    assert kv_bytes_sliding_window(32, 32_768, 8, 128, "fp16", window=4096) == gqa  # stops growing
    # The plain reference: sum each layer's kept tokens one by one.
    tokens, window, full = 10_000, 1024, 6
    per_token_layer = 2 * 8 * 128 * 2
    reference = sum(per_token_layer * (tokens if layer < full else min(tokens, window))
                    for layer in range(32))
    assert kv_bytes_sliding_window(32, tokens, 8, 128, "fp16", window, full_layers=full) == reference
    # Every layer full: the GQA formula again.
    assert kv_bytes_sliding_window(32, tokens, 8, 128, "fp16", window, full_layers=32) == \
        kv_bytes_per_sequence(32, tokens, 8, 128, "fp16")
    with pytest.raises(ValueError, match="window"):
        kv_bytes_sliding_window(32, tokens, 8, 128, "fp16", window=0)
    with pytest.raises(ValueError, match="full_layers"):
        kv_bytes_sliding_window(32, tokens, 8, 128, "fp16", window, full_layers=33)


def test_mla_caches_one_latent_per_token_and_layer() -> None:
    # DeepSeek-V2's shapes: a 512-number latent plus a 64-number rotary key, 576 per token and
    # layer, the same as a GQA cache with 2 x 9 heads x 32 numbers (2.25 heads of 128).
    assert kv_bytes_mla(60, 8192, 512, 64, "bf16") == 60 * 8192 * 576 * 2
    assert kv_bytes_mla(60, 8192, 512, 64, "bf16") == kv_bytes_per_sequence(60, 8192, 9, 32, "bf16")
    # Against 8 KV heads of 128 in the same 60 layers: 2 x 8 x 128 = 2,048 numbers, 3.6x more.
    ratio = kv_bytes_per_sequence(60, 8192, 8, 128, "bf16") / kv_bytes_mla(60, 8192, 512, 64, "bf16")
    assert ratio == pytest.approx(2048 / 576)
    with pytest.raises(ValueError, match="latent_dim"):
        kv_bytes_mla(60, 8192, 0, 64, "bf16")

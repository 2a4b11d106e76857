"""The KV cache equals recompute: same logits at every step, same greedy tokens, for every
prompt length up to one that fills the context window exactly; clear errors at the limit."""
from __future__ import annotations

import pytest
import torch

from tinyserve.config import ModelConfig
from tinyserve.generate import decode_step, generate_ids, generate_stream, prefill
from tinyserve.kv_cache import CacheFullError, KVCache
from tinyserve.model import TinyLlama

from conftest import random_prompt, sharp_model

# GQA 4:2 so a cache sized by query heads would have the wrong shape; a short window so the
# "fills the window exactly" case is cheap.
SMALL = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48)


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return sharp_model(SMALL, seed=0)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return random_prompt(SMALL.vocab_size, n, seed)


def test_cache_is_sized_by_kv_heads_and_follows_the_model() -> None:
    cache = KVCache(SMALL, batch_size=3, max_seq=10)
    L, kv, hd = SMALL.num_hidden_layers, SMALL.num_key_value_heads, SMALL.head_dim
    assert cache.k.shape == cache.v.shape == (L, 3, kv, 10, hd)
    assert cache.nbytes == 2 * L * 3 * kv * 10 * hd * 4
    half = TinyLlama(SMALL).to(torch.bfloat16)
    assert KVCache.for_model(half).k.dtype == torch.bfloat16
    assert KVCache.for_model(half).max_seq == SMALL.max_position_embeddings


@pytest.mark.parametrize("prompt_len", [1, 2, 7, 20, 47])
def test_cached_logits_equal_recompute_at_every_step(model: TinyLlama, prompt_len: int) -> None:
    # 47 + 1 generated = 48 = max_position_embeddings: the last step fills the window.
    window = SMALL.max_position_embeddings
    ids = torch.tensor([_prompt(prompt_len, seed=prompt_len)])
    cache = KVCache.for_model(model, 1)
    logits = prefill(model, ids, cache)
    torch.testing.assert_close(logits, model(ids), rtol=1e-4, atol=1e-4)
    logits = logits[:, -1]
    while True:
        token = logits.argmax(-1)
        reference = model(ids)[:, -1]                      # full recompute
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
        assert cache.lengths == [ids.shape[1]]
        ids = torch.cat([ids, token[:, None]], dim=1)
        if ids.shape[1] == window:
            break
        logits = decode_step(model, token, torch.tensor([ids.shape[1] - 1]), cache)
    assert ids.shape[1] == window


@pytest.mark.parametrize("prompt_len", [1, 5, 30, 47])
def test_streamed_greedy_tokens_identical_with_and_without_cache(model: TinyLlama,
                                                                 prompt_len: int) -> None:
    prompt = _prompt(prompt_len, seed=100 + prompt_len)
    n = SMALL.max_position_embeddings - prompt_len        # prompt + output fills the window
    reference = list(generate_ids(model, prompt, n))
    cached = list(generate_stream(model, prompt, n, use_cache=True))
    uncached = list(generate_stream(model, prompt, n, use_cache=False))
    assert cached == uncached == reference
    assert len(cached) == n


def test_ragged_batch_matches_each_row_alone(model: TinyLlama) -> None:
    # Rows of lengths 3, 9 and 5: right-padded prefill, rewind, then decode at 3 positions.
    prompts = [_prompt(n, seed=n) for n in (3, 9, 5)]
    cache = KVCache.for_model(model, 3, 20)
    width = max(map(len, prompts))
    padded = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    rows, last = torch.arange(3), torch.tensor([len(p) - 1 for p in prompts])
    logits = prefill(model, padded, cache)[rows, last]
    cache.rewind([len(p) for p in prompts])
    seqs = [list(p) for p in prompts]
    for _ in range(6):
        for b, seq in enumerate(seqs):
            alone = model(torch.tensor([seq]))[0, -1]
            torch.testing.assert_close(logits[b], alone, rtol=1e-4, atol=1e-4)
        tokens = logits.argmax(-1)
        for seq, t in zip(seqs, tokens.tolist()):
            seq.append(t)
        last = last + 1
        logits = decode_step(model, tokens, last, cache)
    assert cache.lengths == [len(s) for s in seqs]  # the last token fed is cached


def test_unwritten_and_rewound_slots_are_invisible(model: TinyLlama) -> None:
    cache = KVCache(SMALL, batch_size=2, max_seq=8)
    k = torch.randn(2, SMALL.num_key_value_heads, 4, SMALL.head_dim)
    _, _, k_pos = cache.update(0, k, k, torch.arange(4).expand(2, 4))
    assert k_pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    cache.rewind([2, 4])
    k1 = torch.randn(2, SMALL.num_key_value_heads, 1, SMALL.head_dim)
    keys, _, k_pos = cache.update(0, k1, k1, torch.tensor([[2], [4]]))
    assert k_pos.tolist() == [[0, 1, 2, -1, -1], [0, 1, 2, 3, 4]]
    torch.testing.assert_close(keys[0, :, 2], k1[0, :, 0])   # the rewound slot is rewritten
    torch.testing.assert_close(keys[1, :, 4], k1[1, :, 0])
    assert cache.lengths == [3, 5]


def test_writing_past_the_cache_names_the_limit(model: TinyLlama) -> None:
    cache = KVCache.for_model(model, 1, max_seq=6)
    prefill(model, torch.tensor([_prompt(6)]), cache)
    with pytest.raises(CacheFullError, match="holds 6 tokens"):
        decode_step(model, torch.tensor([1]), torch.tensor([6]), cache)


def test_past_the_context_window_is_a_clear_error(model: TinyLlama) -> None:
    window = SMALL.max_position_embeddings
    cache = KVCache.for_model(model, 1)
    prefill(model, torch.tensor([_prompt(window)]), cache)
    with pytest.raises(ValueError, match=f"context window of {window}"):
        decode_step(model, torch.tensor([1]), torch.tensor([window]), cache)
    with pytest.raises(ValueError, match=f"context window \\({window}\\)"):
        KVCache(SMALL, max_seq=window + 1)


def test_gaps_and_wrong_batch_are_rejected(model: TinyLlama) -> None:
    cache = KVCache.for_model(model, 1, 10)
    with pytest.raises(ValueError, match="must start at position 0"):
        decode_step(model, torch.tensor([1]), torch.tensor([3]), cache)
    with pytest.raises(ValueError, match="holds 1 sequences"):
        prefill(model, torch.tensor([_prompt(3), _prompt(3)]), cache)


def test_reset_empties_the_cache_for_reuse(model: TinyLlama) -> None:
    cache = KVCache.for_model(model, 1, 16)
    first = prefill(model, torch.tensor([_prompt(5, 1)]), cache)
    cache.reset()
    assert cache.lengths == [0] and cache.used_bytes == 0
    again = prefill(model, torch.tensor([_prompt(5, 1)]), cache)
    torch.testing.assert_close(first, again)


@pytest.mark.gpu
def test_cache_on_cuda_follows_the_model_and_equals_recompute(model: TinyLlama) -> None:
    gpu = TinyLlama(SMALL).eval()
    gpu.load_state_dict(model.state_dict())
    gpu = gpu.to("cuda")
    prompt = _prompt(9, 7)
    n = SMALL.max_position_embeddings - len(prompt)
    assert list(generate_stream(gpu, prompt, n)) == list(generate_ids(gpu, prompt, n))
    half = gpu.to(torch.bfloat16)
    cache = KVCache.for_model(half, 2)
    assert cache.k.device.type == "cuda" and cache.k.dtype == torch.bfloat16
    assert len(list(generate_stream(half, prompt, 5))) == 5


def test_an_appending_decode_step_needs_no_mask_and_others_do(model: TinyLlama) -> None:
    """``None`` key positions (no mask) only when every row appends at one shared position;
    a step after a ragged rewind, or one that overwrites, still gets its positions."""
    kv, hd = SMALL.num_key_value_heads, SMALL.head_dim
    cache = KVCache(SMALL, batch_size=2, max_seq=8)
    k = torch.randn(2, kv, 3, hd)
    cache.update(0, k, k, torch.arange(3).expand(2, 3))
    k1 = torch.randn(2, kv, 1, hd)
    keys, _, k_pos = cache.update(0, k1, k1, torch.tensor([[3], [3]]))
    assert k_pos is None and keys.shape[2] == 4             # all four slots, all visible
    torch.testing.assert_close(keys[:, :, 3], k1[:, :, 0])
    cache.rewind([2, 4])
    _, _, k_pos = cache.update(0, k1, k1, torch.tensor([[2], [4]]))
    assert k_pos.tolist() == [[0, 1, 2, -1, -1], [0, 1, 2, 3, 4]]
    cache.rewind([3, 3])
    _, _, k_pos = cache.update(0, k1, k1, torch.tensor([[1], [1]]))  # an overwrite, not an append
    assert k_pos.tolist() == [[0, 1, 2], [0, 1, 2]]


def test_a_maskless_batched_decode_step_equals_recompute(model: TinyLlama) -> None:
    """Two rows appending at one position take the no-mask path; their logits are those of
    re-running each whole sequence."""
    prompts = torch.tensor([_prompt(6, 1), _prompt(6, 2)])
    cache = KVCache.for_model(model, 2, 12)
    prefill(model, prompts, cache)
    tokens = torch.tensor([3, 4])
    fast = decode_step(model, tokens, torch.tensor([6, 6]), cache)
    with torch.no_grad():
        slow = model(torch.cat([prompts, tokens[:, None]], 1))[:, -1]
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)


def test_a_planned_multi_token_step_writes_a_slice_equal_to_the_indexed_write(
        model: TinyLlama) -> None:
    """A verify pass (several tokens, every row at the same length, positions from the
    cache's plan) is copied into a slice of slots; explicit positions take the indexed
    write. Both leave the same keys and values and give the same logits."""
    from tinyserve.generate import extend
    ids = torch.tensor([_prompt(9, seed=3), _prompt(9, seed=4)])
    planned, explicit = KVCache.for_model(model, 2, 16), KVCache.for_model(model, 2, 16)
    for cache in (planned, explicit):
        prefill(model, ids[:, :4], cache)
    a = extend(model, ids[:, 4:], None, planned)
    assert isinstance(planned._write, slice) and planned._write == slice(4, 9)
    b = extend(model, ids[:, 4:], torch.arange(4, 9).expand(2, 5), explicit)
    assert not isinstance(explicit._write, slice)
    assert torch.equal(planned.k, explicit.k) and torch.equal(planned.v, explicit.v)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert planned.lengths == explicit.lengths == [9, 9]

"""Facts the course states about the libraries it runs on, held where a test can hold them
(issue 27): if a new PyTorch changes one, the sentence that states it fails here first."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tinyserve import load_model
from tinyserve.generate import decode_step, prefill
from tinyserve.kv_cache import KVCache
from tinyserve.loadgen.generator import _token_text


def test_mixed_integer_and_tensor_index_keeps_dimension_order() -> None:
    # build_kv_cache's indexing tip: in PyTorch, k[layer, :, positions] is (heads, T, d);
    # NumPy would put the positions first.
    k = torch.zeros(4, 2, 10, 5)
    positions = torch.tensor([1, 2, 7])
    assert k[1, :, positions].shape == (2, 3, 5) == k[1][:, positions].shape


def test_sdpa_returns_zeros_for_a_row_that_reads_nothing() -> None:
    # build_batching's mask rule: SDPA gives zeros (not NaN) for an empty row since 2.5, while
    # a hand-written softmax gives NaN, which the next layer spreads through 0 x NaN.
    q = k = v = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(0))
    real = torch.tensor([False, True, True])
    mask = torch.ones(3, 3, dtype=torch.bool).tril() & real[None, :]     # the pad's row is empty
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[0, 0, 0], torch.zeros(4)) and not out.isnan().any()
    scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    by_hand = scores.softmax(-1) @ v
    assert by_hand[0, 0, 0].isnan().all() and not by_hand[0, 0, 1:].isnan().any()
    again = (by_hand @ by_hand.transpose(-1, -2)).masked_fill(~mask, float("-inf")).softmax(-1) @ by_hand
    assert again.isnan().all()                  # a masked weight of 0 times the pad's NaN value


def test_a_decode_step_dispatches_a_few_hundred_operations() -> None:
    # Chapters 1, 3, 6, 6b and 8: "a few hundred small operations", "a few dozen per layer".
    model = load_model("target", device="cpu", dtype=torch.float32).eval()
    ids = torch.randint(4, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(model, 1, 17)
    with torch.no_grad():
        token = prefill(model, ids, cache)[:, -1].argmax(-1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode_step(model, token, torch.tensor([16]), cache)
    ops = sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))
    assert 150 <= ops <= 500
    assert 24 <= ops / model.config.num_hidden_layers <= 72


def test_a_role_only_opening_chunk_is_no_token() -> None:
    # The serving exercise's counting rule and the load generator's agree on vLLM's first chunk.
    assert _token_text({"index": 0, "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None}, chat=True) is None
    assert _token_text({"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                        "finish_reason": None}, chat=True) == "Hi"
    assert _token_text({"index": 0, "delta": {"content": ""}, "finish_reason": None},
                       chat=True) == ""

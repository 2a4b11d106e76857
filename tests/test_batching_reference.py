"""tinyserve.batching: the references build_batching's tests feed a later part (checked here
on their own, so a wrong reference cannot hide behind the exercise's tests)."""
from __future__ import annotations

import pytest
import torch

from tinyserve.batching import decode_slots, pad_left, padded_mask, prefill_slot


def test_pad_left_puts_each_rows_newest_token_last_and_counts_real_positions() -> None:
    ids, positions, real = pad_left([[5, 6, 7], [9]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]      # the lone token is at 0, as alone
    assert real.tolist() == [[True, True, True], [False, False, True]]


def test_pad_left_refuses_an_empty_batch_or_prompt() -> None:
    for prompts in ([], [[1], []]):
        with pytest.raises(ValueError, match="at least one prompt"):
            pad_left(prompts, pad_id=0, device="cpu")


def test_padded_mask_is_causal_hides_pads_and_leaves_no_row_empty() -> None:
    _, _, real = pad_left([[5, 6, 7], [9]], pad_id=0, device="cpu")
    mask = padded_mask(real)
    assert mask[0].tolist() == torch.ones(3, 3, dtype=torch.bool).tril().tolist()
    # Row 2: pads read only themselves; the real token reads itself, never a pad.
    assert mask[1].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    assert mask.any(dim=-1).all()


class _Cache:
    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths


def _recording_forward(calls: list):
    """A slot forward that records its inputs, raises each slot's length as the model's would,
    and returns logits whose every entry is the token id (B, T, 3)."""
    def forward(ids, positions, slots, weights, cfg, cache):
        calls.append((ids.tolist(), positions.tolist(), list(slots)))
        for b, s in enumerate(slots):
            cache.lengths[s] = max(cache.lengths[s], int(positions[b, -1]) + 1)
        return ids[..., None].float().expand(*ids.shape, 3)
    return forward


WEIGHTS = {"model.embed_tokens.weight": torch.zeros(1)}


def test_slot_steps_restart_a_slot_and_decode_each_at_its_own_position() -> None:
    calls: list = []
    cache = _Cache([5, 9, 0])
    last = prefill_slot([7, 8], 1, WEIGHTS, {}, cache, _recording_forward(calls))
    assert calls[-1] == ([[7, 8]], [[0, 1]], [1]) and last.tolist() == [8.0] * 3
    assert cache.lengths == [5, 2, 0]                           # the longer request is forgotten
    out = decode_slots([4, 6], [1, 0], WEIGHTS, {}, cache, _recording_forward(calls))
    assert calls[-1] == ([[4], [6]], [[2], [5]], [1, 0]) and out.shape == (2, 3)


def test_slot_steps_refuse_a_slot_the_cache_lacks() -> None:
    cache, forward = _Cache([0, 0]), _recording_forward([])
    for slot in (2, -1):
        with pytest.raises(ValueError, match=r"0 to 1 \(it holds 2 slots\)"):
            prefill_slot([1], slot, WEIGHTS, {}, cache, forward)
    with pytest.raises(ValueError, match="distinct"):
        decode_slots([1, 2], [0, 0], WEIGHTS, {}, cache, forward)
    with pytest.raises(ValueError, match="one token per slot"):
        decode_slots([1], [0, 1], WEIGHTS, {}, cache, forward)
    with pytest.raises(ValueError, match="one token or more"):
        prefill_slot([], 0, WEIGHTS, {}, cache, forward)

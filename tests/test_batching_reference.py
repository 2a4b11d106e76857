"""tinyserve.batching: the references build_batching's tests feed a later part (checked here
on their own, so a wrong reference cannot hide behind the exercise's tests)."""
from __future__ import annotations

import pytest
import torch

from tinyserve.batching import pad_left, padded_mask


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

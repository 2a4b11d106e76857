"""Batching as plain functions over token lists and tensors: static batching with left padding
(the padded ids, each row's own positions, the mask) and the two slot steps of a
continuous-batching loop (a request's prefill into a slot, one decode step for many slots).

The engine does the same work its own way (``engine``, ``scheduler``, ``kv_cache``); these are
the small references build_batching's tests feed a later part, so that part is judged on its
own and not on the learner's earlier ones.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def pad_left(prompts: Sequence[Sequence[int]], pad_id: int,
             device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    """Left-pad token lists into (ids, positions, real), each (B, T): a decoder appends at the
    last column, so every row's newest token must be there; a row's positions count its real
    tokens only (from 0, as when it runs alone), and ``real`` is False at the pads."""
    if not prompts or not all(len(p) for p in prompts):
        raise ValueError("pad_left needs at least one prompt, each of one token or more")
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (T - len(p)) + list(p) for p in prompts], device=device)
    real = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in prompts], device=device)
    positions = (real.cumsum(dim=1) - 1).clamp(min=0)
    return ids, positions, real


def padded_mask(real: Tensor) -> Tensor:
    """(B, T, T) bool, True where query i may read key j: j <= i and j is a real token. A pad
    reads itself, so no row is all False (its softmax would be NaN and spread through 0 x NaN)."""
    T = real.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=real.device).tril()
    return (causal & real[:, None, :]) | torch.eye(T, dtype=torch.bool, device=real.device)


# forward(ids (B, T), positions (B, T), slots, weights, cfg, cache) -> logits (B, T, vocab)
SlotForward = Callable[..., Tensor]


def prefill_slot(prompt: Sequence[int], slot: int, weights: dict, cfg: dict, cache,
                 forward: SlotForward) -> Tensor:
    """A new request's prompt into ``slot`` at positions 0..T-1 in one ``forward`` call; the
    logits of its last token (vocab,). The slot may have held a longer request: its length
    starts again from 0 (``forward`` only raises lengths)."""
    if not prompt:
        raise ValueError("prefill_slot needs a prompt of one token or more")
    _check_slots([slot], cache)
    device = weights["model.embed_tokens.weight"].device
    cache.lengths[slot] = 0
    ids = torch.tensor([list(prompt)], device=device)
    return forward(ids, torch.arange(len(prompt), device=device)[None], [slot], weights, cfg, cache)[0, -1]


def decode_slots(tokens: Sequence[int], slots: Sequence[int], weights: dict, cfg: dict, cache,
                 forward: SlotForward) -> Tensor:
    """One decode step: tokens[b] at slot slots[b]'s own next position, cache.lengths[slot];
    logits (B, vocab)."""
    if not tokens or len(tokens) != len(slots):
        raise ValueError(f"decode_slots takes one token per slot, at least one: got "
                         f"{len(tokens)} tokens for {len(slots)} slots")
    _check_slots(slots, cache)
    device = weights["model.embed_tokens.weight"].device
    ids = torch.tensor(list(tokens), device=device)[:, None]
    positions = torch.tensor([[cache.lengths[s]] for s in slots], device=device)
    return forward(ids, positions, list(slots), weights, cfg, cache)[:, 0]


def _check_slots(slots: Sequence[int], cache) -> None:
    """Each slot an index into the cache's rows, each at most once (one write per row a step)."""
    n = len(cache.lengths)
    try:
        rows = [operator.index(s) for s in slots]     # an int, or a 0-d integer tensor
    except TypeError:
        rows = [-1]
    if not all(0 <= s < n for s in rows) or len(set(rows)) != len(rows):
        raise ValueError(f"slots must be distinct row indices of the cache, 0 to {n - 1} "
                         f"(it holds {n} slots); got {list(slots)}")

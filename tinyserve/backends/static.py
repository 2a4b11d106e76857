"""What every static decode step shares: a KV cache of fixed shapes, its window, its buckets.

A step that is compiled (:mod:`~tinyserve.backends.compiled`) or captured as a CUDA graph
(:mod:`~tinyserve.backends.cuda_graph`, :mod:`~tinyserve.backends.spec_graphs`) must see
the same shapes at every call. So its batch is padded up to a *bucket* (:func:`bucket_for`:
1, 2, 4, 8, then steps of 16, nano-vllm's sizes) and its cache holds a *window*
(:func:`window_for`: the request's positions rounded up to a power of two from 64), in a
:class:`StaticKVCache` whose tensors never change shape and which keeps no lengths on the
host. One graph per (bucket, window) then serves every request that fits it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..config import ModelConfig

__all__ = ["MAX_BATCH", "SMALLEST_WINDOW", "buckets", "bucket_for", "window_for",
           "StaticKVCache"]

#: The largest batch a static step is made for (nano-vllm's default ``max_num_seqs``).
MAX_BATCH = 512
#: The shortest cache window: a request of up to 64 positions gets 64 slots per row.
SMALLEST_WINDOW = 64


def buckets(max_batch: int = MAX_BATCH) -> tuple[int, ...]:
    """The batch sizes static steps are made for: 1, 2, 4, 8, then every multiple of 16 up
    to ``max_batch``. Small batches are common and cheap to pad; past 8 a step's cost
    grows slowly with its rows, so steps of 16 waste at most 15 padded rows."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    small = [b for b in (1, 2, 4, 8) if b <= max_batch]
    return tuple(small + list(range(16, max_batch + 1, 16)))


def bucket_for(batch: int, max_batch: int = MAX_BATCH) -> int:
    """The smallest bucket of :func:`buckets` (``max_batch``) that holds ``batch`` rows."""
    if batch < 1:
        raise ValueError(f"a batch has at least one row, got {batch}")
    for b in buckets(max_batch):
        if batch <= b:
            return b
    raise ValueError(f"a static decode step (CUDA graph or compiled) takes at most {max_batch} "
                     f"rows, got {batch}; split the batch, or decode it eagerly "
                     f"(path=\"eager\", or without --compile)")


def window_for(tokens: int, context_window: int) -> int:
    """The cache length for requests of up to ``tokens`` positions (prompt + output): the
    smallest power of two from :data:`SMALLEST_WINDOW` that holds them, at most the model's
    ``context_window``."""
    if tokens > context_window:
        raise ValueError(f"{tokens} positions do not fit the context window of "
                         f"{context_window}; shorten the prompt or lower max_tokens")
    window = SMALLEST_WINDOW
    while window < tokens:
        window *= 2
    return min(window, context_window)


class StaticKVCache:
    """Keys and values for ``batch_size`` rows of ``max_seq`` slots (default: the model's
    context window), fixed shapes.

    Implements the model's ``KVStore`` protocol like :class:`~tinyserve.kv_cache.KVCache`, but
    keeps no lengths on the host: it returns all ``max_seq`` slots every step, each with
    position ``s`` if the row has reached it (``s <= `` the row's current position) and
    ``-1`` otherwise. Stale slots from a longer earlier request are therefore invisible
    until overwritten, and a row's tokens must be written in order from position 0.

    Layout: one tensor per layer for K and one for V, each ``(batch, max_seq, n_kv_heads,
    head_dim)``; viewed as ``(batch * max_seq)`` rows it lets a step write every row's new
    token with one in-place ``index_copy_`` at row ``b * max_seq + position``. Both choices
    avoid a whole-cache copy per step in the compiled graph: an indexed assignment into the
    head-first layout, or a write into one layer of a tensor stacking all layers, is
    traced as "copy the cache (or the layer), then write" (seen in inductor's generated
    code: one copy per layer of the bucket's whole window, which made batch 8 and 64 slower
    compiled than eager). Attention reads it through a transposed view, no copy.
    """

    def __init__(self, config: ModelConfig, batch_size: int, *, device: torch.device | str,
                 dtype: torch.dtype, max_seq: int | None = None) -> None:
        self.config, self.batch_size = config, batch_size
        self.max_seq = max_seq or config.max_position_embeddings
        shape = (batch_size, self.max_seq, config.num_key_value_heads, config.head_dim)
        layers = range(config.num_hidden_layers)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]
        self.slots = torch.arange(self.max_seq, device=device)
        self.row_starts = torch.arange(batch_size, device=device) * self.max_seq

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    def mark_static(self) -> None:
        """Tell ``torch.compile`` the buffers keep their addresses: the CUDA graph that
        mode ``"reduce-overhead"`` records then reads and writes these very tensors instead
        of copying them in at every replay. (The hand-captured graphs of
        :mod:`tinyserve.backends.cuda_graph` need no marker: they replay whatever addresses
        they saw.)"""
        for t in (*self.k, *self.v, self.slots, self.row_starts):
            torch._dynamo.mark_static_address(t)

    def update(self, layer: int, k: Tensor, v: Tensor,
               positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write keys and values (B, n_kv, T, head_dim) at ``positions`` (B, T); return the
        whole window (B, n_kv, max_seq, head_dim) and each slot's position (B, max_seq),
        -1 for slots not yet reached."""
        B, n_kv, T, hd = k.shape
        index = (self.row_starts[:, None] + positions).reshape(B * T)
        for cache, new in ((self.k[layer], k), (self.v[layer], v)):
            cache.view(B * self.max_seq, n_kv, hd).index_copy_(
                0, index, new.transpose(1, 2).reshape(B * T, n_kv, hd))
        reached = positions.max(dim=1, keepdim=True).values             # (B, 1)
        k_positions = torch.where(self.slots[None, :] <= reached, self.slots, -1)
        return self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2), k_positions

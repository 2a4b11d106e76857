"""Speculative decoding's passes on static buffers, replayed as CUDA graphs on a GPU.

A speculative step is a handful of small passes: the draft model's catch-up (1 or 2
tokens) and k - 1 one-token steps, then the target's verify pass over k + 1 tokens. On a
GPU each is a few hundred kernel launches from Python, so at batch 1 the launches set the
step's time, as in plain decoding (:mod:`tinyserve.backends.cuda_graph`). The fix is the same:
record each pass once as a CUDA graph and replay it.

What changes from the decode graph is the *width*: a pass feeds ``w`` tokens of one row.
:class:`StaticPasses` keeps, per width it is asked for, a static token buffer (1, w) and a
static positions buffer (1, w), and one graph per width, all reading and writing one
static KV cache (:class:`~tinyserve.backends.static.StaticKVCache`: the whole window every pass,
which slots a query sees computed on the device from the positions). So:

- a pass copies its tokens and positions into the width's buffers and replays (on a CPU,
  or with ``capture=False``, runs the same forward pass eagerly on the same buffers);
- a *rewind* (rejected drafts dropped) is the host's length only: the slots past it are
  hidden by the causal mask until the next pass, which starts at that length, writes them;
- every width is captured once, up front, parked at the window's last slots, before the
  request's prompt is written (a capture runs the pass for real; anything it writes is
  overwritten in order before any real query can see it).

The pass is the model's own forward pass, the one plain decoding runs
(``model(tokens, None, cache)``: positions from the cache's ``step_positions``); only the
buffers are static. :class:`~tinyserve.speculative.ModelDrafter` and
:class:`~tinyserve.speculative.SpeculativeDecoder` use it by default on CUDA and with
``path="graph"`` elsewhere, and give the plain path's tokens.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from ..config import ModelConfig
from ..device import upload
from ..kv_cache import CacheFullError
from ..model import TinyLlama
from .cuda_graph import record, weight_addresses
from .decoder_cache import DecoderCache
from .static import StaticKVCache, window_for

__all__ = ["WidthKVCache", "StaticPasses", "static_passes", "MAX_PASSES"]


class WidthKVCache(StaticKVCache):
    """A one-row :class:`~tinyserve.backends.static.StaticKVCache` whose passes take their
    positions from a static buffer per width: ``positions[w]`` (1, w), filled by the caller.
    ``prefilling`` announces one pass at 0..T-1 (the prompt: known on the host)."""

    def __init__(self, config: ModelConfig, widths: Sequence[int], *,
                 device: torch.device | str, dtype: torch.dtype, max_seq: int) -> None:
        super().__init__(config, 1, device=device, dtype=dtype, max_seq=max_seq)
        self.positions = {w: torch.zeros(1, w, dtype=torch.long, device=device)
                          for w in widths}
        self.prefilling = False

    def step_positions(self, batch: int, tokens: int) -> Tensor:
        if batch != 1:
            raise ValueError(f"speculative passes feed one row, got {batch}")
        if self.prefilling:
            self.prefilling = False
            return torch.arange(tokens, device=self.slots.device)[None]
        if tokens not in self.positions:
            raise ValueError(f"no static buffers for a pass of {tokens} tokens; this cache "
                             f"has widths {sorted(self.positions)}")
        return self.positions[tokens]


class StaticPasses:
    """One row's cached passes of the widths ``widths`` on static buffers, up to ``window``
    positions; on CUDA (``capture`` default) each width's pass is captured once and
    replayed. ``length``, on the host, is how many positions the cache holds."""

    def __init__(self, model: TinyLlama, window: int, widths: Sequence[int], *,
                 capture: bool | None = None) -> None:
        self.model, self.device = model, model.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {self.device}")
        self.widths = tuple(sorted(set(widths)))
        if not self.widths or self.widths[0] < 1 or self.widths[-1] > window:
            raise ValueError(f"pass widths must lie in 1..{window}, got {list(widths)}")
        self.cache = WidthKVCache(model.config, self.widths, device=self.device,
                                  dtype=model.dtype, max_seq=window)
        self.window = window
        pad = model.config.pad_token_id
        self.tokens = {w: torch.full((1, w), pad, dtype=torch.long, device=self.device)
                       for w in self.widths}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outs: dict[int, Tensor] = {}   # each graph's logits (its pool's memory)
        self._captured_from: tuple | None = None
        self.captures = 0                    # graphs captured (all widths, every time)
        self.capture_seconds: float | None = None
        self.length = 0
        self.in_use = False

    def _forward(self, w: int) -> Tensor:
        """The pass itself: the width's static tokens at its static positions (w, vocab)."""
        return self.model(self.tokens[w], None, self.cache)[0]

    def _capture_all(self) -> None:
        """Record every width's pass into the device's shared pool, parked at the window's
        last slots (nothing real is there yet: this runs before the prompt is written)."""
        start = time.perf_counter()
        self.graphs, self._outs = {}, {}
        for w in self.widths:
            self.tokens[w].fill_(self.model.config.pad_token_id)
            self.cache.positions[w].copy_(torch.arange(self.window - w, self.window)[None])
            self.graphs[w], self._outs[w] = record(functools.partial(self._forward, w),
                                                   self.device)
            self.captures += 1
        # The weights' addresses the graphs read, as the decode graph checks them.
        self._captured_from = weight_addresses(self.model)
        self.capture_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def reset(self) -> None:
        """A new request: the cache empty (length 0). The first one, and one after the
        model's weights moved, captures every width first (on CUDA)."""
        if self.capture and (not self.graphs or
                             self._captured_from != weight_addresses(self.model)):
            self._capture_all()
        self.length = 0

    @torch.inference_mode()
    def prefill(self, ids: Tensor) -> Tensor:
        """Write the prompt ``ids`` (1, T) at 0..T-1 of the emptied cache, eagerly (call
        :meth:`reset` first); return its last position's logits (1, vocab)."""
        if ids.dim() != 2 or ids.shape[0] != 1 or not 1 <= ids.shape[1] <= self.window:
            raise CacheFullError(f"need one prompt of 1 to {self.window} tokens, got "
                                 f"ids of shape {tuple(ids.shape)}")
        if self.length:
            raise ValueError(f"the cache already holds {self.length} positions: reset() first")
        self.cache.prefilling = True
        try:
            last = torch.tensor([ids.shape[1] - 1], device=self.device)
            logits = self.model(ids, None, self.cache, logits_at=last)[:, -1]
        finally:
            self.cache.prefilling = False
        self.length = ids.shape[1]
        return logits

    @torch.inference_mode()
    def feed(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens`` (1, w) (or (w,)) right after the ``length`` positions held; return
        their logits (w, vocab), a tensor of the caller's. Positions: the host's count."""
        w = tokens.shape[-1]
        if w not in self.tokens:
            raise ValueError(f"no static buffers for a pass of {w} tokens (widths "
                             f"{list(self.widths)})")
        if self.length + w > self.window:
            raise CacheFullError(f"positions {self.length}..{self.length + w - 1} do not fit "
                                 f"the static cache of {self.window} slots")
        self.tokens[w].copy_(tokens.reshape(1, w))
        self.cache.positions[w].copy_(upload(list(range(self.length, self.length + w)),
                                             self.device)[None])
        self.length += w
        if w not in self.graphs:
            return self._forward(w)
        self.graphs[w].replay()
        # A copy at once: the logits live in the pool, which the next replay reuses.
        return self._outs[w].clone()

    def rewind(self, length: int) -> None:
        """Forget the positions at and past ``length``: the host's count only (the masks are
        computed from the positions on the device)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"the cache holds {self.length} positions; cannot rewind to "
                             f"{length}")
        self.length = length

    def release(self) -> None:
        """The request is done: another may use these buffers (and graphs)."""
        self.in_use = False


#: How many :class:`StaticPasses` are kept (idle ones beyond it are freed, least recently
#: used first): each holds a static KV cache of its window and, on CUDA, a graph per width.
MAX_PASSES = 8
_PASSES: DecoderCache[StaticPasses] = DecoderCache(MAX_PASSES)


def static_passes(model: TinyLlama, tokens: int, widths: Sequence[int], *,
                  capture: bool | None = None) -> StaticPasses:
    """A free :class:`StaticPasses` for ``model`` holding ``tokens`` positions (rounded up
    to a power of two from 64, as the decode graphs are) and passes of ``widths``, marked in
    use until :meth:`StaticPasses.release`. Kept per model and reused, graphs and all (at
    most :data:`MAX_PASSES`: see :mod:`tinyserve.backends.decoder_cache`)."""
    window = window_for(tokens, model.config.max_position_embeddings)
    capture = model.device.type == "cuda" if capture is None else capture
    key = (window, tuple(sorted(set(widths))), capture, model.device, model.dtype)
    passes = _PASSES.get(model, key,
                         lambda: StaticPasses(model, window, key[1], capture=capture))
    passes.in_use = True
    return passes

"""A contiguous KV cache: every sequence gets ``max_seq`` slots, allocated up front.

Without a cache, decode step t re-runs the whole sequence, so it recomputes keys and values
for t positions that have not changed (rotary keys depend only on their own position). The
cache keeps them: prefill writes the prompt's keys and values in one pass, then each decode
step computes K and V for the one new token and appends it.

Layout ``(layers, batch, n_kv_heads, max_seq, head_dim)``, one tensor for K and one for V.
It is sized by *KV* heads: with grouped-query attention several query heads read the same
KV head, so the cache is ``num_attention_heads / num_key_value_heads`` times smaller than
one sized by query heads.

Slot ``s`` of a row holds the token at position ``s``. That makes the cache's bookkeeping
one number per row, its length, and keeps the model's mask unchanged: ``update`` returns
the position of every slot it hands back (``-1`` for a slot not yet written), and the model
already hides keys with a negative position and keys in a query's future.

The price of "contiguous" is memory: every row reserves ``max_seq`` slots whether it uses
them or not. Paged caches (chapter 4) allocate blocks on demand instead.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .config import ModelConfig
from .device import upload


class CacheFullError(ValueError):
    """A write past the cache's ``max_seq`` slots; the message names the limit."""


class KVCache:
    """Preallocated keys and values for ``batch_size`` sequences of up to ``max_seq`` tokens.

    Implements the model's ``KVStore`` protocol: pass it as ``model(ids, positions, cache)``.
    """

    def __init__(self, config: ModelConfig, batch_size: int = 1, max_seq: int | None = None,
                 *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        window = config.max_position_embeddings
        max_seq = window if max_seq is None else max_seq
        if not 1 <= max_seq <= window:
            raise ValueError(f"max_seq must be between 1 and the context window ({window}), "
                             f"got {max_seq}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.config = config
        self.batch_size = batch_size
        self.max_seq = max_seq
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, max_seq,
                 config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # Lengths live on the host: the host decides what to feed next, and reading them
        # never waits for the device.
        self.lengths: list[int] = [0] * batch_size
        # Set once per forward pass (at layer 0) and shared by every layer:
        self._k_positions: Tensor | None = None  # (B, Tk) position of each returned slot,
        self._n_visible = 0                      # or None when all Tk = _n_visible are visible
        self._write: tuple[Tensor, Tensor] | slice = slice(0)  # where this step's tokens go
        # The positions handed out by step_positions, with each row's first one: update()
        # recognises that tensor and takes its values from here instead of reading it back.
        self._planned: tuple[Tensor, list[int]] | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int = 1,
                  max_seq: int | None = None) -> "KVCache":
        """A cache on the model's device, in the model's dtype."""
        return cls(model.config, batch_size, max_seq, device=model.device, dtype=model.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V (all slots, used or not)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots that hold a token: what a cache without reservations would need."""
        per_slot = self.nbytes // (self.batch_size * self.max_seq)
        return per_slot * sum(self.lengths)

    def update(self, layer: int, k: Tensor, v: Tensor,
               positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write this step's keys and values (B, n_kv_heads, T, head_dim) at slots
        ``positions`` (B, T) and return all keys and values up to the longest row, with
        each slot's position (B, Tk) (``-1`` where a row has nothing written), or ``None``
        in place of the positions when every row has just appended one token at the same
        position: then every returned slot is visible to every query."""
        B, _, T, _ = k.shape
        if B != self.batch_size:
            raise ValueError(f"the cache holds {self.batch_size} sequences, got a batch of {B}")
        if layer == 0:  # every layer sees the same positions: do the bookkeeping once
            self._advance(positions)
        if isinstance(self._write, slice):  # every row writes the same slot: a plain copy
            start = self._write.start
            self.k[layer].narrow(2, start, T).copy_(k)
            self.v[layer].narrow(2, start, T).copy_(v)
        else:
            rows, slots = self._write
            # Advanced indices (rows, slots) around a slice put (B, T) first: (B, T, n_kv, hd).
            self.k[layer][rows, :, slots] = k.transpose(1, 2)
            self.v[layer][rows, :, slots] = v.transpose(1, 2)
        n = self._n_visible
        return self.k[layer].narrow(2, 0, n), self.v[layer].narrow(2, 0, n), self._k_positions

    def step_positions(self, batch: int, tokens: int) -> Tensor:
        """Positions (B, T) of a step that appends ``tokens`` tokens to every row: row b's
        go at ``lengths[b], lengths[b] + 1, ...``.

        The model asks for them when it is called with ``positions=None``. They come from
        the lengths the host already holds, so the step checks and plans its writes with
        no value read back from the device (explicit positions must be read: they may
        overwrite, or be wrong). The window check happens here, before anything runs.
        """
        if batch != self.batch_size:
            raise ValueError(f"the cache holds {self.batch_size} sequences, got a batch of "
                             f"{batch}")
        if tokens < 1:
            raise ValueError("nothing to write: the step has no tokens")
        self._check_fits(max(self.lengths) + tokens - 1)
        device, first = self.k.device, list(self.lengths)
        steps = torch.arange(tokens, device=device)
        if len(set(first)) == 1:     # every row at one length: no per-row values to send
            positions = (steps + first[0]).expand(batch, tokens)
        else:
            positions = upload(first, device)[:, None] + steps
        self._planned = (positions, first)
        return positions

    def _check_fits(self, position: int) -> None:
        if position >= self.max_seq:
            window = self.config.max_position_embeddings
            where = (f"outside the context window of {window} tokens" if position >= window
                     else f"past the KV cache, which holds {self.max_seq} tokens per sequence "
                          f"(the context window is {window})")
            raise CacheFullError(
                f"position {position} does not fit: it is {where}; shorten the prompt or "
                f"lower max_tokens so prompt + output <= {self.max_seq}.")

    def _advance(self, positions: Tensor) -> None:
        if positions.numel() == 0:
            raise ValueError("nothing to write: the step has no tokens")
        B, T = positions.shape
        planned, self._planned = self._planned, None
        from_plan = planned is not None and planned[0] is positions
        if from_plan:
            first = planned[1]                        # known on the host: nothing to read
            last = [lo + T - 1 for lo in first]
        else:   # positions from the caller: one read for both ends of every row
            lo, hi = positions.aminmax(dim=1)
            first, last = torch.stack((lo, hi)).tolist()
        self._check_fits(max(last))
        if min(first) < 0:
            raise ValueError("positions must be >= 0; padding belongs after a row's tokens "
                             "and is forgotten with rewind()")
        for b, lo in enumerate(first):
            if lo > self.lengths[b]:
                # A gap would leave unwritten slots that the mask treats as real tokens.
                raise ValueError(f"row {b} holds {self.lengths[b]} tokens, so its next write "
                                 f"must start at position {self.lengths[b]}, not {lo}")
        # The common decode step: one new token per row, every row appending at the same
        # position. Then every slot a row has written is visible to its one query, so no
        # mask is needed and the slot positions need not be built (about a dozen small
        # tensor operations per step saved; the model reads ``None`` as "all visible").
        appending = T == 1 and len(set(first)) == 1 and all(n == first[0] for n in self.lengths)
        self.lengths = [max(n, hi + 1) for n, hi in zip(self.lengths, last)]
        # Every row writes the same run of slots (one token, or planned positions, which are
        # consecutive): a plain copy into a slice instead of an indexed write.
        if (T == 1 or from_plan) and len(set(first)) == 1:
            self._write = slice(first[0], first[0] + T)
        else:
            self._write = (torch.arange(B, device=positions.device)[:, None].expand(B, T),
                           positions)
        if appending:
            self._k_positions, self._n_visible = None, first[0] + 1
        else:
            self._refresh_positions()

    def _refresh_positions(self) -> None:
        n = max(self.lengths)
        slots = torch.arange(n, device=self.k.device)
        lengths = upload(self.lengths, self.k.device)
        self._k_positions = torch.where(slots[None, :] < lengths[:, None], slots, -1)
        self._n_visible = n

    def rewind(self, lengths: Sequence[int]) -> None:
        """Forget everything at or past ``lengths[b]`` in row ``b``.

        Used after a padded prefill (rows of different prompt lengths are right-padded to
        one tensor; the pads' slots are forgotten and later overwritten), and by speculative
        decoding to drop rejected draft tokens. Nothing is erased: a forgotten slot gets
        position -1, so no query can see it until it is written again.
        """
        if len(lengths) != self.batch_size:
            raise ValueError(f"need one length per row ({self.batch_size}), got {len(lengths)}")
        for b, n in enumerate(lengths):
            if not 0 <= n <= self.lengths[b]:
                raise ValueError(f"row {b} holds {self.lengths[b]} tokens; cannot rewind to {n}")
        self.lengths = list(lengths)
        self._planned = None
        self._refresh_positions()

    def reset(self) -> None:
        """Empty every row (the memory stays allocated for the next request)."""
        self.rewind([0] * self.batch_size)

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, max_seq={self.max_seq}, "
                f"lengths={self.lengths}, nbytes={self.nbytes:,})")


def kv_bytes_per_token(cfg: ModelConfig, element_bytes: float = 4) -> float:
    """Bytes one cached token adds to a row: a key and a value per layer and KV head."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element_bytes


def kv_crossover_tokens(cfg: ModelConfig, weight_bytes: float,
                        kv_element_bytes: float = 4) -> float:
    """Context (cached tokens) at which one row's KV bytes equal the weights' bytes."""
    return weight_bytes / kv_bytes_per_token(cfg, kv_element_bytes)

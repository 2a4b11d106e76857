"""Paged KV storage and the attention that reads it through block tables.

Keys and values for every layer live in one pool of slots, ``(layers, num_blocks *
block_size, n_kv_heads, head_dim)``; :class:`~tinyserve.block_manager.BlockManager` decides
which slots a sequence owns. A step of the continuous-batching engine runs *one* forward pass
over a flat list of new tokens from several sequences (a prefill chunk of one, the single
decode token of others), so the model sees ``(1, N)`` tokens. Everything that is per token
(embeddings, projections, MLP) works on that flat list unchanged; only attention needs to
know which sequence a token belongs to, and that is this module's job, the way an attention
*backend* does it in vLLM:

1. write each new token's key and value into its slot (the slot mapping);
2. gather each sequence's keys and values, in position order, through its block table;
3. attend: decode rows together as one padded batch (one query each), prefill chunks one
   by one with a causal mask offset by the tokens already cached.

:class:`StepLayout` holds what the engine knows about a step (per row: new-token slots, the
slots of the whole context, positions); it is built once per step and shared by all layers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from .config import ModelConfig


@dataclass(frozen=True)
class RowSpec:
    """One sequence's part of a step (slots as lists or 1-D integer tensors)."""

    new_slots: Sequence[int] | Tensor       # slot of each new token, in order
    context_slots: Sequence[int] | Tensor   # slot of every token the row attends to, in order
    start: int                              # position of the first new token
    # The row's block table, when its context slots are whole blocks in table order
    # (``block * block_size + offset``): a decode row is then gathered a block at a time.
    block_table: Sequence[int] | None = None


class StepLayout:
    """Index tensors for one step, computed once and read by every layer."""

    def __init__(self, rows: Sequence[RowSpec], device: torch.device,
                 block_size: int | None = None) -> None:
        as_long = lambda x: torch.as_tensor(x, dtype=torch.long)  # noqa: E731
        new = [as_long(r.new_slots) for r in rows]
        ctx = [as_long(r.context_slots) for r in rows]
        sizes = [len(x) for x in new]
        self.num_tokens = sum(sizes)
        self.write_slots = torch.cat(new).to(device)
        # Where each row's new tokens sit in the flat token list.
        offsets = [0] * len(rows)
        for i in range(1, len(rows)):
            offsets[i] = offsets[i - 1] + sizes[i - 1]
        self.decode_rows = [i for i, n in enumerate(sizes) if n == 1]
        self.prefill_rows = [i for i, n in enumerate(sizes) if n > 1]
        if self.decode_rows:
            lengths = torch.tensor([len(ctx[i]) for i in self.decode_rows])
            # Decode rows are gathered into one padded batch. By whole blocks when every row
            # has its block table: one index per block_size slots, each a contiguous chunk of
            # the pool, instead of one per slot (the gather is most of a large decode step).
            # Padding points at block or slot 0 and is hidden by the mask.
            self.decode_by_block = block_size is not None and all(
                rows[i].block_table is not None for i in self.decode_rows)
            if self.decode_by_block:
                gather = pad_sequence([as_long(rows[i].block_table) for i in self.decode_rows],
                                      batch_first=True)                # (D, max_blocks)
                width = gather.shape[1] * block_size                   # type: ignore[operator]
            else:
                gather = pad_sequence([ctx[i] for i in self.decode_rows], batch_first=True)
                width = gather.shape[1]
            visible = torch.arange(width)[None, :] < lengths[:, None]
            self.decode_tokens = torch.tensor([offsets[i] for i in self.decode_rows], device=device)
            self.decode_gather = gather.to(device)
            self.decode_mask = visible[:, None, None, :].to(device)      # (D, 1, 1, width)
        self.prefill_meta = []
        for i in self.prefill_rows:
            n, width = sizes[i], len(ctx[i])
            q_pos = torch.arange(rows[i].start, rows[i].start + n, device=device)
            k_pos = torch.arange(width, device=device)
            mask = (k_pos[None, :] <= q_pos[:, None])[None, None]       # (1, 1, n, ctx)
            self.prefill_meta.append((offsets[i], n, ctx[i].to(device), mask))


class PagedKVCache:
    """The slot pool for every layer; implements the model's attention-backend hook.

    Pass it to the model as ``model(ids, positions, cache)`` after :meth:`prepare`. A row's
    slots come from the block manager: ``block_table[pos // block_size] * block_size +
    pos % block_size``.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (config.num_hidden_layers, num_blocks * block_size, config.num_key_value_heads,
                 config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.layout: StepLayout | None = None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def prepare(self, rows: Sequence[RowSpec]) -> StepLayout:
        self.layout = StepLayout(rows, self.k.device, self.block_size)
        return self.layout

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write the step's keys/values and return attention output ``(1, heads, N, hd)``.

        ``q`` is ``(1, heads, N, head_dim)``, ``k`` and ``v`` ``(1, n_kv, N, head_dim)``,
        already rotated; N is the step's flat token count.
        """
        lay = self.layout
        if lay is None or q.shape[2] != lay.num_tokens:
            raise ValueError("call prepare() with this step's rows before the forward pass")
        k_pool, v_pool = self.k[layer], self.v[layer]              # (slots, n_kv, hd)
        k_pool[lay.write_slots] = k[0].transpose(0, 1)
        v_pool[lay.write_slots] = v[0].transpose(0, 1)
        out = torch.empty_like(q)
        if lay.decode_rows:
            qd = q[0, :, lay.decode_tokens].transpose(0, 1)[:, :, None]  # (D, heads, 1, hd)
            if lay.decode_by_block:   # the pool as blocks: (num_blocks, block_size, n_kv, hd)
                n, n_kv, hd = lay.decode_gather.shape[0], k_pool.shape[1], k_pool.shape[2]
                blocked = (-1, self.block_size, n_kv, hd)
                kd = k_pool.view(blocked)[lay.decode_gather].view(n, -1, n_kv, hd)
                vd = v_pool.view(blocked)[lay.decode_gather].view(n, -1, n_kv, hd)
            else:
                kd, vd = k_pool[lay.decode_gather], v_pool[lay.decode_gather]
            kd, vd = kd.permute(0, 2, 1, 3), vd.permute(0, 2, 1, 3)  # (D, n_kv, width, hd)
            # Grouped-query attention as in the model: the n_rep query heads sharing a KV
            # head become n_rep query rows of it, the (D, 1, 1, width) mask broadcasting
            # (2.7x faster than enable_gqa=True at 64 rows in a one-thread micro-benchmark).
            D, heads, _, hd = qd.shape
            od = F.scaled_dot_product_attention(qd.reshape(D, kd.shape[1], -1, hd), kd, vd,
                                                attn_mask=lay.decode_mask)
            out[0, :, lay.decode_tokens] = od.reshape(D, heads, hd).transpose(0, 1)
        for offset, n, gather, mask in lay.prefill_meta:
            kp = k_pool[gather].permute(1, 0, 2)[None]              # (1, n_kv, ctx, hd)
            vp = v_pool[gather].permute(1, 0, 2)[None]
            out[:, :, offset:offset + n] = F.scaled_dot_product_attention(
                q[:, :, offset:offset + n], kp, vp, attn_mask=mask, enable_gqa=True)
        return out

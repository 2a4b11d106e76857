"""Paged KV storage and the attention that reads it through block tables.

Keys and values live in one pool of slots, a tensor per layer of ``(num_blocks * block_size,
n_kv_heads, head_dim)``; :class:`~tinyserve.block_manager.BlockManager` decides
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

A *pure-decode* step (every row feeds one token) can instead read :class:`DecodeBuffers`,
static tensors filled in place each step, through a :class:`DecodeLayout`: every row
gathers all the blocks of a fixed window and is masked by its length on the device, so the
step has one shape per (rows, window) and reads nothing from the host. That is what a CUDA
graph needs (:class:`tinyserve.backends.cuda_graph.EngineGraphs`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import ModelConfig
from .device import upload


@dataclass(frozen=True)
class RowSpec:
    """One sequence's part of a step (slots as lists or 1-D integer tensors).

    A row attends to positions ``0 .. start + len(new_slots) - 1``. Their slots are
    ``context_slots``, or, when that is ``None``, ``block_table[p // block_size] *
    block_size + p % block_size`` (the engine passes only the table: listing every slot
    of every row each step would cost more than the attention it feeds).
    """

    new_slots: Sequence[int] | Tensor       # slot of each new token, in order
    context_slots: Sequence[int] | Tensor | None   # slot of every token the row attends to
    start: int                              # position of the first new token
    # The row's block table, when its context slots are whole blocks in table order
    # (``block * block_size + offset``): a decode row is then gathered a block at a time.
    block_table: Sequence[int] | None = None
    # What the engine adds, so that the step's inputs travel with its indices (one copy):
    token_ids: Sequence[int] | None = None  # the new tokens' ids
    sample: bool = False                    # the row's last token gets logits (it samples)

    @property
    def length(self) -> int:
        """Tokens the row attends to: those cached before the step and its new ones."""
        return self.start + len(self.new_slots)


def _ints(values: Sequence[int] | Tensor) -> list[int]:
    return values.tolist() if isinstance(values, Tensor) else list(values)


class _Staging:
    """Integer lists gathered into one host buffer, sent to the device in one copy.

    A step needs seven or eight small index tensors; made one by one, each would be its own
    host-to-device copy, and on CUDA a copy from ordinary (pageable) memory waits for the
    device to finish everything queued before it. One buffer makes one copy, from pinned
    memory, queued without waiting (:func:`tinyserve.device.upload`)."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.spans: list[tuple[int, int]] = []

    def add(self, values: Sequence[int]) -> int:
        """Stage ``values``; returns the index of its tensor in :meth:`upload`'s list."""
        start = len(self.values)
        self.values.extend(values)
        self.spans.append((start, len(self.values)))
        return len(self.spans) - 1

    def upload(self, device: torch.device) -> list[Tensor]:
        flat = upload(self.values, device)
        return [flat[a:b] for a, b in self.spans]


class StepLayout:
    """Index tensors for one step, computed once and read by every layer.

    Everything is known on the host (slots, positions, lengths: the block manager's
    bookkeeping), so the layout is built from Python ints and sent to the device in one
    copy; masks are then made on the device from the lengths. ``input_ids`` (1, N) and
    ``logits_at`` are set when the rows carry ``token_ids`` and ``sample`` flags.
    """

    workspace: Tensor | None = None   # decode rows gather into the cache's own buffer

    def __init__(self, rows: Sequence[RowSpec], device: torch.device,
                 block_size: int | None = None) -> None:
        for r in rows:
            if r.context_slots is None and (r.block_table is None or block_size is None):
                raise ValueError("a row without context_slots needs its block_table and the "
                                 "cache's block_size to find its slots")
        sizes = [len(r.new_slots) for r in rows]
        self.num_tokens = sum(sizes)
        self.max_position = max((r.length - 1 for r in rows), default=-1)
        stage = _Staging()
        write = stage.add([s for r in rows for s in _ints(r.new_slots)])
        positions = stage.add([p for r, n in zip(rows, sizes) for p in range(r.start, r.start + n)])
        with_ids = all(r.token_ids is not None for r in rows)
        ids = stage.add([t for r in rows for t in r.token_ids or ()]) if with_ids else None
        # Where each row's new tokens sit in the flat token list.
        offsets = [0] * len(rows)
        for i in range(1, len(rows)):
            offsets[i] = offsets[i - 1] + sizes[i - 1]
        at = stage.add([offsets[i] + n - 1 for i, (r, n) in enumerate(zip(rows, sizes))
                        if r.sample])
        self.decode_rows = [i for i, n in enumerate(sizes) if n == 1]
        self.prefill_rows = [i for i, n in enumerate(sizes) if n > 1]
        decode = self._stage_decode(rows, offsets, block_size, stage) if self.decode_rows else None
        prefill = [stage.add(_context_slots(rows[i], block_size))
                   for i in self.prefill_rows]

        tensors = stage.upload(device)           # the step's one host-to-device copy
        self.write_slots = tensors[write]
        self.positions = tensors[positions]                          # (N,)
        self.input_ids = tensors[ids][None] if ids is not None else None   # (1, N)
        self.logits_at = tensors[at]
        if decode is not None:
            gather, lengths, tokens, width = decode
            self.decode_gather = tensors[gather]
            # No mask when every row sees the whole padded width (rows of one length).
            self.decode_mask = None if lengths is None else (
                torch.arange(width, device=device)[None, :] < tensors[lengths][:, None]
            )[:, None, None, :]                                     # (D, 1, 1, width)
            self.decode_tokens = tensors[tokens]
        self.prefill_meta = []
        for i, ctx in zip(self.prefill_rows, prefill):
            n, width = sizes[i], rows[i].length
            q_pos = torch.arange(rows[i].start, rows[i].start + n, device=device)
            k_pos = torch.arange(width, device=device)
            mask = (k_pos[None, :] <= q_pos[:, None])[None, None]       # (1, 1, n, ctx)
            self.prefill_meta.append((offsets[i], n, tensors[ctx], mask))

    def _stage_decode(self, rows: Sequence[RowSpec], offsets: list[int],
                      block_size: int | None, stage: _Staging) -> tuple:
        """Stage the decode rows' gather: one padded batch of ``decode_width`` keys per row.
        Returns the staged parts (gather, lengths or None, tokens) and the padded width."""
        picked = [rows[i] for i in self.decode_rows]
        lengths = [r.length for r in picked]
        # By whole blocks when every row has its block table: one index per block_size
        # slots, each a contiguous chunk of the pool, instead of one per slot (the gather is
        # most of a large decode step). Padding points at block or slot 0, hidden by the mask.
        self.decode_by_block = block_size is not None and all(
            r.block_table is not None for r in picked)
        if self.decode_by_block:
            unit = block_size
            need = [-(-n // unit) for n in lengths]                 # blocks each row reads
            per_row = [list(r.block_table[:k]) for r, k in zip(picked, need)]  # type: ignore[index]
        else:
            unit = 1
            per_row = [_context_slots(r, block_size) for r in picked]
        most = max(len(p) for p in per_row)
        self.decode_unit = unit                                     # slots per gathered index
        gather = stage.add([x for p in per_row for x in p + [0] * (most - len(p))])
        width = most * unit
        lengths_part = None if min(lengths) == width else stage.add(lengths)
        # The engine schedules decodes first: their tokens then open the flat list and are
        # read and written as a slice, not through an index.
        self.decode_prefix = self.decode_rows == list(range(len(picked)))
        tokens = stage.add([offsets[i] for i in self.decode_rows])
        return gather, lengths_part, tokens, width


def _context_slots(row: RowSpec, block_size: int | None) -> list[int]:
    """Slot of every position the row attends to, from its list or its block table."""
    if row.context_slots is not None:
        return _ints(row.context_slots)
    assert row.block_table is not None and block_size is not None
    table = row.block_table[:-(-row.length // block_size)]
    return [b * block_size + o for b in table for o in range(block_size)][:row.length]


class PagedKVCache:
    """The slot pool for every layer; implements the model's attention-backend hook.

    Pass it to the model as ``model(ids, positions, cache)`` after :meth:`prepare`. A row's
    slots come from the block manager: ``block_table[pos // block_size] * block_size +
    pos % block_size``.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 scratch: bool = False) -> None:
        self.config = config
        self.num_blocks, self.block_size = num_blocks, block_size
        # With ``scratch``, one block past the block manager's ``num_blocks``: the padding
        # rows of a static decode step write and read only there (DecodeBuffers).
        self.scratch_block = num_blocks if scratch else None
        shape = ((num_blocks + scratch) * block_size, config.num_key_value_heads,
                 config.head_dim)
        # One tensor per layer (slots, n_kv, hd), not views of one (layers, ...) tensor: a
        # compiled step (the CPU fast path) that writes a layer's new keys into a view of a
        # larger input has inductor copy that whole input back, every layer of every step (a
        # large share of the scale model's batch-1 engine step, profiled), where a tensor of
        # its own is written in place, as the compiled loops' static cache is. bench scale
        # times that step (scale_engine_mbu_b1); tests/test_fast_path.py checks the write-back.
        layers = range(config.num_hidden_layers)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]
        self.layout: StepLayout | None = None
        # Where decode rows' keys and values are gathered, reused by every layer and step:
        # a fresh multi-megabyte tensor per gather came from the OS each time, and its page
        # faults cost many times the copy itself (64 rows of 384 tokens).
        self._gathered = torch.empty(0, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // (self.k[0].shape[0] // self.block_size)

    def prepare(self, rows: Sequence[RowSpec]) -> StepLayout:
        layout = StepLayout(rows, self.device, self.block_size)
        window = self.config.max_position_embeddings
        if layout.max_position >= window:
            raise ValueError(
                f"position {layout.max_position} is outside the context window of {window} "
                f"tokens; shorten the prompt or lower max_tokens so prompt + output <= "
                f"{window}.")
        self.layout = layout
        return layout

    def prepare_decode(self, buffers: "DecodeBuffers", rows: int, blocks: int) -> "DecodeLayout":
        """Set up a pure-decode step read from ``buffers``: ``rows`` rows (a bucket, padding
        included), each gathering ``blocks`` blocks. Device work only: a CUDA graph records
        it with the step, and every replay recomputes it from the refilled buffers."""
        self.layout = DecodeLayout(buffers, rows, blocks)
        return self.layout

    def step_positions(self, batch: int, tokens: int) -> Tensor:
        """The prepared step's positions, (1, N): the model's default when it is called
        with ``positions=None`` (known on the host, checked against the window in
        :meth:`prepare`, so nothing is read back)."""
        lay = self.layout
        if lay is None or batch != 1 or tokens != lay.num_tokens:
            raise ValueError("call prepare() with this step's rows before the forward pass")
        return lay.positions[None]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write the step's keys/values and return attention output ``(1, heads, N, hd)``.

        ``q`` is ``(1, heads, N, head_dim)``, ``k`` and ``v`` ``(1, n_kv, N, head_dim)``,
        already rotated; N is the step's flat token count.
        """
        lay = self.layout
        if lay is None or q.shape[2] != lay.num_tokens:
            raise ValueError("call prepare() with this step's rows before the forward pass")
        k_pool, v_pool = self.k[layer], self.v[layer]              # (slots, n_kv, hd)
        # index_copy_/index_select rather than pool[index]: the same result, and the
        # advanced-indexing kernel was several times slower for these row copies (one
        # thread, 64 rows).
        k_pool.index_copy_(0, lay.write_slots, k[0].transpose(0, 1))
        v_pool.index_copy_(0, lay.write_slots, v[0].transpose(0, 1))
        if lay.decode_rows:
            od = self._attend_decode(lay, q, k_pool, v_pool)       # (1, heads, D, hd)
            if not lay.prefill_rows and lay.decode_prefix:
                return od                                           # nothing else to place
        out = torch.empty_like(q)
        if lay.decode_rows:
            if lay.decode_prefix:
                out[:, :, :od.shape[2]] = od
            else:
                out[0].index_copy_(1, lay.decode_tokens, od[0])
        for offset, n, gather, mask in lay.prefill_meta:
            kp = k_pool.index_select(0, gather).permute(1, 0, 2)[None]   # (1, n_kv, ctx, hd)
            vp = v_pool.index_select(0, gather).permute(1, 0, 2)[None]
            out[:, :, offset:offset + n] = F.scaled_dot_product_attention(
                q[:, :, offset:offset + n], kp, vp, attn_mask=mask, enable_gqa=True)
        return out

    def _attend_decode(self, lay: StepLayout, q: Tensor, k_pool: Tensor,
                       v_pool: Tensor) -> Tensor:
        """Attention of the step's decode rows, one query each: ``(1, heads, D, hd)``."""
        D = len(lay.decode_rows)
        _, heads, _, hd = q.shape
        n_kv = k_pool.shape[1]
        qd = q[0, :, :D] if lay.decode_prefix else q[0].index_select(1, lay.decode_tokens)
        # Gather whole units (blocks, or single slots) of the pool: (D, width, n_kv, hd).
        units = (-1, lay.decode_unit * n_kv * hd)
        # out= records no autograd history, and a compiled step (the CPU fast path) that
        # writes into a slice of the shared buffer has inductor copy the whole buffer back
        # (much of the scale model's batch-1 engine step, profiled): both gather into a
        # fresh tensor, inductor placing it.
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            kd = k_pool.reshape(units).index_select(0, lay.decode_gather)
            vd = v_pool.reshape(units).index_select(0, lay.decode_gather)
        else:   # an eager or captured static step gathers into its own buffer (fixed address)
            kd, vd = lay.workspace if lay.workspace is not None else \
                self._workspace(2 * len(lay.decode_gather) * units[1]).view(2, -1, units[1])
            torch.index_select(k_pool.reshape(units), 0, lay.decode_gather, out=kd)
            torch.index_select(v_pool.reshape(units), 0, lay.decode_gather, out=vd)
        kd, vd = kd.view(D, -1, n_kv, hd), vd.view(D, -1, n_kv, hd)
        kd, vd = kd.permute(0, 2, 1, 3), vd.permute(0, 2, 1, 3)   # (D, n_kv, width, hd)
        # Grouped-query attention as in the model: the n_rep query heads sharing a KV
        # head become n_rep query rows of it, the (D, 1, 1, width) mask broadcasting
        # (faster than enable_gqa=True at 64 rows in a one-thread micro-benchmark).
        qd = qd.transpose(0, 1).reshape(D, n_kv, heads // n_kv, hd)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=lay.decode_mask)
        return od.reshape(D, heads, hd).transpose(0, 1)[None]

    def _workspace(self, numel: int) -> Tensor:
        """``numel`` elements of the reused gather buffer (grown, never shrunk)."""
        if self._gathered.numel() < numel:
            self._gathered = torch.empty(numel, device=self.device, dtype=self.dtype)
        return self._gathered[:numel]


def _copy_in(dst: Tensor, values: list[int]) -> None:
    """``values`` into ``dst`` (contiguous, int64) in one copy: on CUDA from pinned memory,
    queued without waiting (torch's pinned-memory cache keeps the source until it ran)."""
    if dst.device.type != "cuda":
        dst.copy_(torch.tensor(values, dtype=dst.dtype).view(dst.shape))
        return
    src = torch.tensor(values, dtype=dst.dtype, pin_memory=True).view(dst.shape)
    dst.copy_(src, non_blocking=True)


class DecodeBuffers:
    """The static inputs of the engine's pure-decode steps, for up to ``max_rows`` rows of
    up to ``max_blocks`` blocks each: made once, refilled in place every step, so a CUDA
    graph recorded on them finds each step's values at the addresses it recorded.

    One int64 tensor ``packed`` (max_rows, 4 + max_blocks) holds per row its token id,
    position, write slot, context length and block table; the host writes a step's rows
    with one copy (:meth:`fill`). A row's table is padded with the cache's scratch block,
    and rows past the step's real ones are *padding rows*: the pad token at position 0,
    writing the scratch slot and seeing only it (length 1). No real row reads the scratch
    block (the mask stops each at its length), so padding never changes a real row.
    ``gathered`` is where every layer gathers the rows' keys and values.
    """

    def __init__(self, cache: PagedKVCache, max_rows: int, max_blocks: int) -> None:
        if cache.scratch_block is None:
            raise ValueError("static decode steps need a cache made with scratch=True "
                             "(a block the padding rows may write)")
        cfg, device = cache.config, cache.device
        self.cache, self.max_rows, self.max_blocks = cache, max_rows, max_blocks
        self.block_size, self.scratch = cache.block_size, cache.scratch_block
        self.packed = torch.zeros(max_rows, 4 + max_blocks, dtype=torch.long, device=device)
        self.token_ids, self.positions, self.write_slots, self.lengths = self.packed.unbind(1)[:4]
        self.block_tables = self.packed[:, 4:]
        unit = self.block_size * cfg.num_key_value_heads * cfg.head_dim
        self.gathered = torch.empty(2, max_rows * max_blocks, unit, device=device,
                                    dtype=cache.dtype)
        self._padding = [cfg.pad_token_id, 0, self.scratch * self.block_size, 1] + \
            [self.scratch] * max_blocks
        self.park()

    def park(self) -> None:
        """Every row a padding row (what a graph is warmed up and captured on)."""
        _copy_in(self.packed, self._padding * self.max_rows)

    def fill(self, token_ids: Sequence[int], positions: Sequence[int],
             tables: Sequence[Sequence[int]], rows: int) -> None:
        """Write the step's real rows (one token each, at ``positions``, in the sequences
        whose block tables are ``tables``) and padding up to ``rows``, in one copy."""
        bs, most = self.block_size, self.max_blocks
        values: list[int] = []
        for token, pos, table in zip(token_ids, positions, tables):
            need = pos // bs + 1                           # blocks holding 0..pos
            if need > most:
                raise ValueError(f"position {pos} needs {need} blocks; these buffers hold "
                                 f"{most} per row (the context window)")
            values += [token, pos, table[pos // bs] * bs + pos % bs, pos + 1]
            values += list(table[:need]) + [self.scratch] * (most - need)
        values += self._padding * (rows - len(positions))
        _copy_in(self.packed[:rows], values)


class DecodeLayout:
    """What :meth:`PagedKVCache.attend` reads for a pure-decode step of ``rows`` rows that
    gather ``blocks`` blocks each, taken from :class:`DecodeBuffers`: views of the buffers
    and device operations, static shapes, no value read back to the host.

    Each row gathers all ``blocks`` entries of its table (its unused ones point at the
    scratch block) and attends under a mask made on the device from its length, where the
    per-step :class:`StepLayout` gathers only up to the longest row and lists lengths on
    the host."""

    prefill_rows: tuple = ()
    prefill_meta: tuple = ()
    decode_prefix = True
    decode_by_block = True
    logits_at = None

    def __init__(self, buffers: DecodeBuffers, rows: int, blocks: int) -> None:
        device = buffers.packed.device
        self.num_tokens = rows
        self.max_position = -1          # checked on the host by the caller (fill)
        self.decode_rows = range(rows)
        self.input_ids = buffers.token_ids[:rows][None]              # (1, rows)
        self.positions = buffers.positions[:rows]
        self.write_slots = buffers.write_slots[:rows]
        self.decode_unit = buffers.block_size
        self.decode_gather = buffers.block_tables[:rows, :blocks].reshape(-1)
        width = blocks * buffers.block_size
        self.decode_mask = (torch.arange(width, device=device)[None, :]
                            < buffers.lengths[:rows, None])[:, None, None, :]
        self.workspace = buffers.gathered[:, :rows * blocks]

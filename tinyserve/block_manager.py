"""KV blocks as a shared pool: allocation on demand, reference counts, prefix caching.

A contiguous cache reserves ``max_seq`` slots per sequence up front, most of which a short
request never touches. A paged cache cuts KV memory into fixed-size **blocks** of
``block_size`` token slots and gives each sequence a **block table**: the list of block ids
holding its tokens in order (token ``i`` lives in block ``table[i // block_size]`` at offset
``i % block_size``). A sequence takes a new block only when its last one is full, so at most
``block_size - 1`` slots per sequence are ever reserved and unused.

**Prefix caching.** A block that is full is identified by a hash chained over its tokens and
the hash of the block before it, so equal hashes mean equal *prefixes*, not just equal
blocks (the same 16 tokens after a different history have different keys and values). A new
request walks its prompt block by block and reuses every block whose hash is cached: those
tokens need no prefill. A block can therefore be in several block tables at once; its
**reference count** says how many. When the count drops to zero the block is free again but
keeps its contents and its hash, so a later request can still hit it; free blocks are handed
out least-recently-freed first, and handing out a cached block **evicts** its hash.

The vocabulary (``can_allocate``, ``allocate``, ``can_append``, ``append``, ``free``) is
vLLM's, so the real thing reads the same. This module only counts blocks; the tensors they
stand for live in :mod:`tinyserve.paged`.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


class OutOfBlocksError(RuntimeError):
    """The pool has no free block; the scheduler should have checked ``can_*`` first."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None     # set once the block is full and registered
    token_ids: tuple[int, ...] = ()   # kept to rule out hash collisions on a hit


@dataclass
class BlockTable:
    """One sequence's blocks, and how many of its leading tokens came from the prefix cache."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0          # token slots in use
    num_cached_tokens: int = 0   # leading tokens whose KV was found in the prefix cache
    last_hash: int | None = None  # chain hash of the last registered (full) block


def chain_hash(prev: int | None, tokens: Sequence[int]) -> int:
    """Hash of a full block given the hash of the block before it (None for the first)."""
    return hash((prev, tuple(tokens)))


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` slots, shared by every running sequence."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got "
                             f"num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in the order they were freed: pop from the front = least recently used.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}          # chain hash -> block id
        self.tables: dict[str, BlockTable] = {}
        self.prefix_hits = 0      # tokens served from the cache, over the pool's life
        self.prefix_queries = 0   # prompt tokens looked up

    # ---- capacity -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached contents included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix, in order (full blocks only).

        The last prompt token is never served from the cache: its forward pass is what
        produces the logits of the first output token.
        """
        if not self.enable_prefix_caching:
            return []
        hits, prev = [], None
        for start in range(0, len(token_ids) - 1 - self.block_size + 1, self.block_size):
            chunk = tuple(token_ids[start:start + self.block_size])
            h = chain_hash(prev, chunk)
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            prev = h
        return hits

    def can_allocate(self, token_ids: Sequence[int], reserve: int = 0) -> bool:
        """Whether a sequence with this prompt fits, keeping ``reserve`` blocks spare."""
        hits = self._cached_prefix(token_ids)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # free now, taken
        fresh = self.blocks_needed(len(token_ids)) - len(hits)
        return fresh + revived + reserve <= self.num_free_blocks

    # ---- allocation ---------------------------------------------------------------------
    def _take_free(self) -> int:
        if not self._free:
            raise OutOfBlocksError(f"all {self.num_blocks} KV blocks are in use")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its contents are about to be overwritten
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def allocate(self, seq_id: str, token_ids: Sequence[int]) -> BlockTable:
        """Give ``seq_id`` blocks for its prompt, reusing cached prefix blocks.

        Returns its block table; ``num_cached_tokens`` says how many leading tokens need no
        prefill."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if not self.can_allocate(token_ids):
            raise OutOfBlocksError(
                f"a {len(token_ids)}-token prompt needs {self.blocks_needed(len(token_ids))} "
                f"blocks of {self.block_size}; only {self.num_free_blocks} are free")
        hits = self._cached_prefix(token_ids)
        table = BlockTable()
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]   # a cached block comes back to life
            block.ref_count += 1
            table.blocks.append(block_id)
            table.last_hash = block.block_hash
        for _ in range(self.blocks_needed(len(token_ids)) - len(hits)):
            table.blocks.append(self._take_free())
        table.num_tokens = len(token_ids)
        table.num_cached_tokens = len(hits) * self.block_size
        self.prefix_hits += table.num_cached_tokens
        self.prefix_queries += len(token_ids)
        self.tables[seq_id] = table
        return table

    def can_append(self, seq_id: str, n: int = 1) -> bool:
        """Whether ``seq_id`` can grow by ``n`` tokens (a new block only at a boundary)."""
        table = self.tables[seq_id]
        return self.blocks_needed(table.num_tokens + n) - len(table.blocks) <= self.num_free_blocks

    def append(self, seq_id: str, n: int = 1) -> None:
        """Make room for ``n`` more tokens of ``seq_id`` (decode: one per step)."""
        table = self.tables[seq_id]
        if not self.can_append(seq_id, n):
            raise OutOfBlocksError(f"no free KV block for sequence {seq_id!r} to grow into")
        while len(table.blocks) < self.blocks_needed(table.num_tokens + n):
            table.blocks.append(self._take_free())
        table.num_tokens += n

    def register_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Publish ``seq_id``'s blocks that are full *and computed* to the prefix cache.

        ``token_ids`` is the whole sequence so far; ``num_computed`` how many of its tokens
        have their KV written. Only then may another request reuse the block.
        """
        if not self.enable_prefix_caching:
            return
        table = self.tables[seq_id]
        bs = self.block_size
        first = 0 if table.last_hash is None else self._registered_count(table)
        for i in range(first, num_computed // bs):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(table.last_hash, chunk)
            block = self.blocks[table.blocks[i]]
            if block.block_hash is None:
                block.block_hash, block.token_ids = h, chunk
                self._cached.setdefault(h, block.block_id)
            table.last_hash = h

    def _registered_count(self, table: BlockTable) -> int:
        # Blocks are registered in order, so the count is the run of hashed leading blocks.
        n = 0
        for block_id in table.blocks:
            if self.blocks[block_id].block_hash is None:
                break
            n += 1
        return n

    def free(self, seq_id: str) -> None:
        """Return every block of ``seq_id`` (finished, cancelled or preempted).

        Blocks go to the back of the free list in reverse order, so a sequence's tail is
        evicted before its head: the head is the part other requests are likeliest to share.
        """
        table = self.tables.pop(seq_id)
        for block_id in reversed(table.blocks):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {block_id} freed more often than allocated")
            if block.ref_count == 0:
                self._free[block_id] = None

    # ---- views --------------------------------------------------------------------------
    def block_table(self, seq_id: str) -> list[int]:
        return list(self.tables[seq_id].blocks)

    def slot(self, seq_id: str, position: int) -> int:
        """The flat slot (block id * block_size + offset) holding token ``position``."""
        table = self.tables[seq_id]
        if not 0 <= position < table.num_tokens:
            raise IndexError(f"position {position} is outside sequence {seq_id!r} "
                             f"({table.num_tokens} tokens)")
        return table.blocks[position // self.block_size] * self.block_size + position % self.block_size

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def check_invariants(self) -> None:
        """Reference counts equal the number of tables holding each block; free == unowned."""
        owners = [0] * self.num_blocks
        for table in self.tables.values():
            for block_id in table.blocks:
                owners[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == owners[block.block_id], (block, owners[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self._free), block
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == h

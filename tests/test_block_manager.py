"""Block accounting: allocation, growth, sharing through the prefix cache, eviction, and the
invariant that every interleaving of admits, growth and frees returns every block."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.block_manager import BlockManager, OutOfBlocksError


def test_blocks_are_taken_on_demand_and_returned() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    table = bm.allocate("a", list(range(5)))            # 5 tokens -> 2 blocks
    assert len(table.blocks) == 2 and bm.num_free_blocks == 6
    bm.append("a", 3)                                    # 8 tokens: still 2 blocks
    assert len(bm.block_table("a")) == 2
    bm.append("a")                                       # 9th token opens a third block
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 5
    assert bm.slot("a", 8) == bm.block_table("a")[2] * 4
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_out_of_blocks_names_the_limit() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(list(range(9)))
    with pytest.raises(OutOfBlocksError, match="needs 3 blocks of 4; only 2 are free"):
        bm.allocate("a", list(range(9)))
    assert bm.num_free_blocks == 2                       # nothing was taken


def test_prefix_hit_shares_full_blocks_only() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 110))                       # 10 shared tokens: 2 full blocks + 2
    a = system + [1, 2, 3]
    bm.allocate("a", a)
    bm.register_full_blocks("a", a, num_computed=len(a))
    b = system + [7, 8]
    table_b = bm.allocate("b", b)
    assert table_b.num_cached_tokens == 8                # the two full blocks of the prefix
    assert table_b.blocks[:2] == bm.block_table("a")[:2]
    assert table_b.blocks[2] != bm.block_table("a")[2]   # the partial block is never shared
    assert [bm.blocks[i].ref_count for i in table_b.blocks[:2]] == [2, 2]
    bm.check_invariants()


def test_same_block_after_a_different_prefix_is_a_miss() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    bm.allocate("a", a)
    bm.register_full_blocks("a", a, len(a))
    b = [0, 0, 0, 0, 5, 6, 7, 8, 9]                      # block 2 equal, block 1 not
    assert bm.allocate("b", b).num_cached_tokens == 0


def test_last_prompt_token_is_always_computed() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = list(range(8))                                   # exactly two full blocks
    bm.allocate("a", a)
    bm.register_full_blocks("a", a, len(a))
    assert bm.allocate("b", list(a)).num_cached_tokens == 4   # not 8: the last token's logits


def test_freed_cached_blocks_are_reused_then_evicted_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = [1, 2, 3, 4, 5]
    bm.allocate("a", a)
    bm.register_full_blocks("a", a, len(a))
    bm.free("a")
    assert bm.num_free_blocks == 4                       # free, but still cached
    assert bm.allocate("b", [1, 2, 3, 4, 9]).num_cached_tokens == 4   # a hit after free
    bm.free("b")
    bm.allocate("c", [7, 7, 7, 7, 7, 7, 7, 7])          # needs all 4 blocks: evicts the cache
    bm.free("c")
    assert bm.allocate("d", [1, 2, 3, 4, 9]).num_cached_tokens == 0
    bm.check_invariants()


def test_registering_only_counts_computed_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = list(range(12))
    bm.allocate("a", a)
    bm.register_full_blocks("a", a, num_computed=5)      # a chunked prefill, part way
    assert bm.allocate("b", a + [99]).num_cached_tokens == 4


ops = st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free", "register"]),
                         st.integers(0, 5), st.integers(1, 20), st.integers(0, 3)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, caching=st.booleans())
def test_any_interleaving_returns_every_block(ops, caching: bool) -> None:
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=caching)
    live: dict[str, list[int]] = {}
    for op, who, n, variant in ops:
        seq = f"s{who}"
        if op == "alloc" and seq not in live:
            tokens = [variant] * 4 + list(range(n))      # few variants: prefixes collide often
            if bm.can_allocate(tokens):
                bm.allocate(seq, tokens)
                live[seq] = tokens
        elif op == "grow" and seq in live:
            if bm.can_append(seq, 1 + n % 5):
                bm.append(seq, 1 + n % 5)
                live[seq] += [n] * (1 + n % 5)
        elif op == "register" and seq in live:
            bm.register_full_blocks(seq, live[seq], len(live[seq]))
        elif op == "free" and seq in live:
            bm.free(seq)
            del live[seq]
        bm.check_invariants()
        # No block belongs to two live sequences unless shared through a cached prefix.
        owners: dict[int, list[str]] = {}
        for s in live:
            for b in bm.block_table(s):
                owners.setdefault(b, []).append(s)
        for b, who_ in owners.items():
            if len(who_) > 1:
                assert bm.blocks[b].block_hash is not None, (b, who_)
    for seq in list(live):
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()

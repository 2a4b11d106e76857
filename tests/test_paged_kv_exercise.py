"""The paged KV exercises (chapter 4): a valid nbgrader source whose solution passes every
visible and hidden test (hidden ones include long random interleavings of allocate, append
and free checked block by block against the specification), a blank release that earns
nothing, and messages that name the classic mistakes (rounding blocks down, a freed block
put at the front, a refusal that has already taken blocks, a slot without the block size...).

The checks every graded exercise shares live in exercise_checks.
"""
from __future__ import annotations

import pytest

from exercise_checks import (check_manual_answers_blank, check_named_mistakes,
                             check_points_and_answers, check_rubrics_above_answers,
                             check_sandboxed_grading, exercise_paths, is_test, meta, needs_sandbox,
                             run_blank_release, run_probe, source_fixture)

NAME = "paged_kv"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

TEST_POINTS = {"test_allocate": 2, "test_append_free": 2, "test_full": 1, "test_random": 2,
               "test_slot": 2, "test_paged_attention": 3, "test_waste": 2, "test_choice_refcount": 1,
               "test_choice_block_size": 1}
MANUAL_POINTS = {"written_chain_hash": 3}
ANSWER_CELLS = {"allocator", "slot", "paged_attention", "waste", "choice_refcount", "choice_block_size"}


def _answer(source, grade_id: str) -> str:
    return next(c.source for c in source.cells if meta(c).get("grade_id") == grade_id)


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    first = next(c for c in source.cells if c.cell_type == "code")
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    assert "class OutOfBlocks" in first.source   # defined before any submitted code runs
    tests, manual = check_points_and_answers(source, TEST_POINTS, MANUAL_POINTS, ANSWER_CELLS)
    check_rubrics_above_answers(source)
    for cell in source.cells:
        if is_test(cell):
            assert "### BEGIN HIDDEN TESTS" in cell.source, meta(cell)["grade_id"]
            if meta(cell)["grade_id"].startswith("test_choice"):
                assert "check_equal" not in cell.source.split("### BEGIN HIDDEN TESTS")[0]
    # The allocator's skeleton (constructor, free list, num_free) is given; three bodies are not.
    assert _answer(source, "allocator").count("### BEGIN SOLUTION") == 3
    assert f"({sum(tests.values()) + sum(manual.values())} points)" in source.cells[0].source


PROBE = """
def _paged_equals_contiguous():
    # Keys of 37 tokens scattered over blocks 6, 1, 4 of 16 slots; the rest of the pool is stale.
    k_pool, v_pool = torch.randn(8, 2, 16, 32) * 5, torch.randn(8, 2, 16, 32) * 5
    k, v = torch.randn(2, 37, 32), torch.randn(2, 37, 32)
    for i, b in enumerate([6, 1, 4]):
        n = min(16, 37 - 16 * i)
        k_pool[b, :, :n], v_pool[b, :, :n] = k[:, 16 * i:16 * i + n], v[:, 16 * i:16 * i + n]
    q = torch.randn(8, 32)
    want = torch.nn.functional.scaled_dot_product_attention(q[:, None], k, v, enable_gqa=True)[:, 0]
    return bool(torch.allclose(paged_attention(q, k_pool, v_pool, [6, 1, 4], 16, 37), want, atol=1e-5))


pool = BlockAllocator(8, 4)
pool.allocate("a", 5); pool.allocate("b", 4); pool.append("a", 4); pool.free("b")
print("PROBE " + json.dumps({"table": pool.tables["a"], "free": list(pool.free_list),
                             "slot": slot([7, 2, 5], 4, 9),
                             "waste": waste_fractions([160, 20, 100], 512, 16),
                             "paged_equals_contiguous": _paged_equals_contiguous()}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    got = run_probe(source, SOURCE_DIR, "import json\n" + PROBE)
    assert got["table"] == [0, 1, 3] and got["free"] == [4, 5, 6, 7, 2]
    assert got["slot"] == 5 * 4 + 1                     # position 9: block table[9 // 4] = 5, offset 1
    assert got["waste"] == pytest.approx([1 - 280 / 1536, 1 - 280 / 304])
    assert got["paged_equals_contiguous"] is True


def test_solution_allocator_matches_the_engines_block_manager(source):
    """The exercise's allocator and tinyserve's BlockManager (prefix caching off) hand out the
    same number of blocks for the same random operations, and refuse the same requests."""
    import random
    from collections import deque
    from tinyserve.block_manager import BlockManager, OutOfBlocksError

    class OutOfBlocks(RuntimeError):
        pass

    scope = {"deque": deque, "OutOfBlocks": OutOfBlocks}
    exec(_answer(source, "allocator"), scope)
    gen = random.Random(0)
    pool, manager = scope["BlockAllocator"](20, 4), BlockManager(20, 4, enable_prefix_caching=False)
    live = []
    for i in range(500):
        op = gen.choice(["allocate", "append", "free"]) if live else "allocate"
        if op == "allocate":
            n = gen.randint(1, 12)
            ok = manager.can_allocate([9] * n)
            try:
                pool.allocate(f"s{i}", n)
                assert ok
                manager.allocate(f"s{i}", [9] * n)
                live.append(f"s{i}")
            except OutOfBlocks:
                assert not ok
        elif op == "append":
            sid, n = gen.choice(live), gen.randint(1, 5)
            ok = manager.can_append(sid, n)
            try:
                pool.append(sid, n)
                assert ok
                manager.append(sid, n)
            except OutOfBlocks:
                assert not ok
                with pytest.raises(OutOfBlocksError):
                    manager.append(sid, n)
        else:
            sid = live.pop(gen.randrange(len(live)))
            pool.free(sid)
            manager.free(sid)
        assert pool.num_free == manager.num_free_blocks
        assert {s: len(t) for s, t in pool.tables.items()} == \
               {s: len(manager.block_table(s)) for s in live}
        manager.check_invariants()


# ------------------------------------------------------------------ the blank release

def test_blank_release_earns_nothing_and_leaks_nothing(source):
    nb, errors = run_blank_release(RELEASED, source, SOURCE_DIR)
    assert errors == {gid: ("NameError" if gid.startswith("test_choice") else "NotImplementedError")
                      for gid in TEST_POINTS}
    check_manual_answers_blank(nb, MANUAL_POINTS)


# ------------------------------------------------------------------ the classic mistakes, named

# Allocator mistakes are written as edits of the solution's class: (old text, new text).
ALLOC = [
    ("test_allocate", [("need = -(-num_tokens // self.block_size)", "need = num_tokens // self.block_size")],
     "round UP"),
    ("test_allocate", [("need = -(-num_tokens // self.block_size)", "need = num_tokens")],
     "one block per TOKEN"),
    ("test_append_free", [("need = -(-(self.lengths[seq_id] + n) // self.block_size) - len(table)",
                           "need = n")], "take a new block only when it is full"),
    ("test_append_free", [("self.free_list.extend(self.tables.pop(seq_id))",
                           "self.free_list.extendleft(reversed(self.tables.pop(seq_id)))")],
     "to the back of the free list"),
    ("test_full", [("        if need > len(self.free_list):\n"
                    "            raise OutOfBlocks(f\"{num_tokens} tokens need {need} blocks; "
                    "{self.num_free} are free\")\n"
                    "        self.tables[seq_id] = [self.free_list.popleft() for _ in range(need)]",
                    "        self.tables[seq_id] = []\n"
                    "        for _ in range(need):\n"
                    "            if not self.free_list:\n"
                    "                raise OutOfBlocks(f'need {need}, 0 free')\n"
                    "            self.tables[seq_id].append(self.free_list.popleft())")],
     "changed the pool before refusing"),
    ("test_full", [("        if need > len(self.free_list):\n"
                    "            raise OutOfBlocks(f\"{num_tokens} tokens need {need} blocks; "
                    "{self.num_free} are free\")\n", "")],
     "raised IndexError"),
    ("test_random", [("self.free_list.extend(self.tables.pop(seq_id))", "self.tables.pop(seq_id)")],
     "do not add up"),
]
SLOT = "def slot(table, block_size, position):\n    return {body}"
PAGED = ("def paged_attention(q, k_pool, v_pool, table, block_size, length):\n"
         "    b = torch.tensor({order})\n"
         "    k = k_pool[b].transpose(0, 1).reshape(k_pool.shape[1], -1, k_pool.shape[-1]){keep}\n"
         "    v = v_pool[b].transpose(0, 1).reshape(k_pool.shape[1], -1, k_pool.shape[-1]){keep}\n"
         "    g = q.shape[0] // k.shape[0]\n"
         "    k, v = k.{rep}, v.{rep}\n"
         "    w = torch.softmax((k @ q[:, :, None]).squeeze(-1) / math.sqrt(q.shape[-1]), dim=-1)\n"
         "    return (w[:, None] @ v).squeeze(1)")
GOOD_PAGED = dict(order="table", keep="[:, :length]", rep="repeat_interleave(g, dim=0)")
WASTE = ("def waste_fractions(lengths, max_seq, block_size):\n"
         "    used = sum(lengths)\n"
         "    contiguous = len(lengths) * {seq}\n"
         "    paged = sum({blocks} for n in lengths) * block_size\n"
         "    return {ret}")
GOOD_WASTE = dict(seq="max_seq", blocks="-(-n // block_size)",
                  ret="1 - used / contiguous, 1 - used / paged")
OTHER = [
    ("test_slot", SLOT.format(body="table[position // block_size] + position % block_size"),
     "not multiplied by block_size"),
    ("test_slot", SLOT.format(body="position"), "the position itself"),
    ("test_slot", SLOT.format(body="table[position % block_size] * block_size + position // block_size"),
     "swapped"),
    ("test_paged_attention", PAGED.format(**dict(GOOD_PAGED, order="sorted(table)")), "TABLE order"),
    ("test_paged_attention", PAGED.format(**dict(GOOD_PAGED, keep="")), "stale slots"),
    ("test_paged_attention", PAGED.format(**dict(GOOD_PAGED, rep="repeat(g, 1, 1)")), "repeat_interleave"),
    ("test_waste", WASTE.format(**dict(GOOD_WASTE, blocks="n // block_size")), "round the blocks UP"),
    ("test_waste", WASTE.format(**dict(GOOD_WASTE, seq="max(lengths)")), "reserves max_seq"),
    ("test_waste", WASTE.format(**dict(GOOD_WASTE, ret="contiguous / used - 1, paged / used - 1")),
     "divide by the RESERVED slots"),
    ("test_choice_refcount", 'ANSWER_REFCOUNT = "B"', "one lowercase letter"),
    ("test_choice_refcount", 'ANSWER_REFCOUNT = "d"', "several block tables"),
    ("test_choice_block_size", 'ANSWER_BLOCK_SIZE = "b"', "longer tables"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel;
    the correct solution runs first, so each mistake is the only thing wrong in its cell."""
    allocator = _answer(source, "allocator")
    mistakes = []
    for test_id, edits, fragment in ALLOC:
        wrong = allocator
        for old, new in edits:
            assert old in wrong, old
            wrong = wrong.replace(old, new)
        mistakes.append((test_id, wrong, fragment))
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, mistakes + OTHER)


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, MANUAL_POINTS, tmp_path)

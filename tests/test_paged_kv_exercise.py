"""The paged KV exercises (chapter 4): a valid nbgrader source whose solution passes every
visible and hidden test (hidden ones include long random interleavings of allocate, append
and free checked block by block against the specification), a blank release that earns
nothing, and messages that name the classic mistakes (rounding blocks down, a freed block
put at the front, a refusal that has already taken blocks, a slot without the block size...).

Helpers come from the kv_cache_basics exercise's tests.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from test_grading_pipeline import needs_sandbox
from test_harbor_worksheet import MARKERS, _errors, _execute, _is_test, _meta
from test_kv_cache_basics import _copy, _with_source_tests

ROOT = Path(__file__).resolve().parents[1]
NAME = "paged_kv"
SOURCE_DIR = ROOT / "solutions" / NAME
SOURCE = SOURCE_DIR / f"{NAME}.ipynb"
RELEASED = ROOT / "exercises" / NAME / f"{NAME}.ipynb"

TEST_POINTS = {"test_allocate": 2, "test_append_free": 2, "test_full": 1, "test_random": 2,
               "test_slot": 2, "test_waste": 2, "test_choice_refcount": 1,
               "test_choice_block_size": 1}
MANUAL_POINTS = {"written_chain_hash": 3}
ANSWER_CELLS = {"allocator", "slot", "waste", "choice_refcount", "choice_block_size"}


@pytest.fixture(scope="module")
def source():
    return nbformat.read(SOURCE, as_version=4)


def _answer(source, grade_id: str) -> str:
    return next(c.source for c in source.cells if _meta(c).get("grade_id") == grade_id)


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    first = next(c for c in source.cells if c.cell_type == "code")
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    assert "class OutOfBlocks" in first.source   # defined before any submitted code runs
    tests = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells if _is_test(c)}
    manual = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells
              if _meta(c).get("grade") and _meta(c).get("solution")}
    assert tests == TEST_POINTS and manual == MANUAL_POINTS
    answers = {_meta(c)["grade_id"] for c in source.cells
               if _meta(c).get("solution") and not _meta(c).get("grade")}
    assert answers == ANSWER_CELLS
    for cell in source.cells:
        if _meta(cell).get("grade") and _meta(cell).get("solution"):
            assert "Rubric" not in cell.source, "the rubric sits above the answer"
        if _is_test(cell):
            assert "### BEGIN HIDDEN TESTS" in cell.source, _meta(cell)["grade_id"]
            if _meta(cell)["grade_id"].startswith("test_choice"):
                assert "check_equal" not in cell.source.split("### BEGIN HIDDEN TESTS")[0]
    # The allocator's skeleton (constructor, free list, num_free) is given; three bodies are not.
    assert _answer(source, "allocator").count("### BEGIN SOLUTION") == 3
    assert f"({sum(tests.values()) + sum(manual.values())} points)" in source.cells[0].source


PROBE = """
pool = BlockAllocator(8, 4)
pool.allocate("a", 5); pool.allocate("b", 4); pool.append("a", 4); pool.free("b")
print("PROBE " + json.dumps({"table": pool.tables["a"], "free": list(pool.free_list),
                             "slot": slot([7, 2, 5], 4, 9),
                             "waste": waste_fractions([160, 20, 100], 512, 16)}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    nb = _copy(source)
    nb.cells.append(nbformat.v4.new_code_cell("import json\n" + PROBE))
    _execute(nb, SOURCE_DIR, allow_errors=False)  # any failing check raises
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    got = json.loads(text.split("PROBE ", 1)[1])
    assert got["table"] == [0, 1, 3] and got["free"] == [4, 5, 6, 7, 2]
    assert got["slot"] == 5 * 4 + 1                     # position 9: block table[9 // 4] = 5, offset 1
    assert got["waste"] == pytest.approx([1 - 280 / 1536, 1 - 280 / 304])


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
    text = RELEASED.read_text()
    for marker in MARKERS:
        assert marker not in text
    nb = _with_source_tests(nbformat.read(RELEASED, as_version=4), source)
    _execute(nb, SOURCE_DIR, allow_errors=True)
    errors = {gid: out["ename"] for gid, out in _errors(nb).items()}
    assert errors == {gid: ("NameError" if gid.startswith("test_choice") else "NotImplementedError")
                      for gid in TEST_POINTS}
    manual = [c for c in nb.cells if _meta(c).get("grade_id") in MANUAL_POINTS]
    assert [c.source.strip() for c in manual] == ["YOUR ANSWER HERE"]


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
    by_id = {_meta(c)["grade_id"]: c for c in source.cells if _meta(c)}
    allocator = _answer(source, "allocator")
    mistakes = []
    for test_id, edits, fragment in ALLOC:
        wrong = allocator
        for old, new in edits:
            assert old in wrong, old
            wrong = wrong.replace(old, new)
        mistakes.append((test_id, wrong, fragment))
    mistakes += OTHER
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.source) for c in source.cells
                if c.cell_type == "code" and not _is_test(c)]
    answers = [c.source for c in source.cells
               if c.cell_type == "code" and _meta(c).get("grade_id") in ANSWER_CELLS]
    wanted = []
    for test_id, wrong, fragment in mistakes:
        nb.cells.extend(nbformat.v4.new_code_cell(text) for text in (*answers, wrong))
        cell_id = f"{test_id}_{len(wanted)}"
        test_cell = nbformat.v4.new_code_cell(by_id[test_id].source)
        test_cell.metadata = {"nbgrader": dict(_meta(by_id[test_id]), grade_id=cell_id)}
        nb.cells.append(test_cell)
        wanted.append((cell_id, fragment))
    _execute(nb, SOURCE_DIR, allow_errors=True)
    errors = _errors(nb)
    for cell_id, fragment in wanted:
        assert cell_id in errors, f"{cell_id}: the wrong answer passed"
        assert errors[cell_id]["ename"] == "AssertionError", (cell_id, errors[cell_id])
        assert fragment in errors[cell_id]["evalue"], (cell_id, errors[cell_id]["evalue"])


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    from autograder.course import Course, release
    from autograder.grade import autograde
    course = Course(tmp_path)
    shutil.copytree(SOURCE_DIR, course.source / NAME)
    release(course, NAME)
    for who, notebook in (("solution", SOURCE), ("blank", course.release / NAME / f"{NAME}.ipynb")):
        dest = course.submitted / who / NAME
        dest.mkdir(parents=True)
        shutil.copy(notebook, dest / f"{NAME}.ipynb")
    results = {r["student"]: r for r in autograde(course, NAME, workers=2, progress=False)}
    for who, score in (("solution", sum(TEST_POINTS.values())), ("blank", 0)):
        r = results[who]
        detail = json.dumps({k: r[k] for k in ("status", "score", "reasons", "flags", "notebooks")})
        assert r["status"] == "graded" and r["score"] == score, detail
        assert r["max_score"] == sum(TEST_POINTS.values()) + sum(MANUAL_POINTS.values()), detail
        tests = {t["grade_id"]: t for t in r["notebooks"][NAME]["tests"]}
        for gid, points in TEST_POINTS.items():
            assert tests[gid]["points"] == (points if who == "solution" else 0), (who, gid, tests[gid])

"""The parallelism exercises (chapter 7): a valid nbgrader source whose solution passes every
visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes.

Everything in the notebook runs in one process (the ranks are list entries, the all-reduce a
sum), so a kernel run takes about 3 s on 2 cores, mostly importing torch. The checks every
graded exercise shares live in exercise_checks.
"""
from __future__ import annotations

import pytest

from exercise_checks import (check_manual_answers_blank, check_named_mistakes,
                             check_points_and_answers, check_sandboxed_grading, exercise_paths,
                             is_test, meta, needs_sandbox, run_blank_release, run_probe,
                             source_fixture)

NAME = "parallelism"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

TEST_POINTS = {"test_column_split": 1, "test_row_split": 1, "test_parallel_mlp": 3,
               "test_allreduce_count": 1, "test_allreduce_bytes": 2, "test_bubble": 2,
               "test_micro_batches": 1, "test_choice_oproj": 1, "test_choice_second_gpu": 1}
MANUAL_POINTS = {"written_replicas": 3}
ANSWER_CELLS = {"splits", "parallel_mlp", "allreduce_count", "allreduce_bytes", "bubble",
                "micro_batches", "choice_oproj", "choice_second_gpu"}


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    first = next(c for c in source.cells if c.cell_type == "code")
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    assert "allclose as _allclose" in first.source and "silu as _silu" in first.source
    tests, manual = check_points_and_answers(source, TEST_POINTS, MANUAL_POINTS, ANSWER_CELLS)
    # Every autograded part has hidden checks beyond the visible ones.
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in source.cells if is_test(c))
    # The rubric sits above the written answer, and the intro states the totals.
    by_id = {meta(c)["grade_id"]: c for c in source.cells if meta(c)}
    assert "Rubric" in by_id["part5_intro"].source
    assert "Rubric" not in by_id["written_replicas"].source
    assert "(16 points)" in source.cells[0].source
    assert sum(tests.values()) == 13 and sum(manual.values()) == 3


PROBE = """
import json
print("PROBE " + json.dumps({"count": ALLREDUCES_TARGET, "m": MICRO_BATCHES_10PCT,
                             "bytes": allreduce_bytes(6, 1, 1, 256, 4),
                             "bubble": bubble(2, 4)}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    got = run_probe(source, SOURCE_DIR, PROBE)
    # 2 per block x 6 blocks; (4 - 1) / (27 + 4 - 1) = 0.1; 12 all-reduces of 256 fp32 numbers.
    assert got == {"count": 12, "m": 27, "bytes": 12_288, "bubble": pytest.approx(0.2)}


def test_the_solution_agrees_with_the_engine():
    """The notebook's formulas are the ones tinyserve implements and its tests measure."""
    from tinyserve.parallel.pipeline import bubble_formula
    assert bubble_formula(4, 27) <= 0.10 < bubble_formula(4, 26)
    assert bubble_formula(2, 4) == pytest.approx(0.2)


# ------------------------------------------------------------------ the blank release

def test_blank_release_earns_nothing_and_leaks_nothing(source):
    nb, errors = run_blank_release(RELEASED, source, SOURCE_DIR)
    # Blank functions raise when a test calls them; blank variables raise in their own cell,
    # and then the test finds no answer. Either way every autograded cell fails.
    variables = ("test_allreduce_count", "test_micro_batches", "test_choice_oproj",
                 "test_choice_second_gpu")
    assert errors == {gid: ("NameError" if gid in variables else "NotImplementedError")
                      for gid in TEST_POINTS}
    check_manual_answers_blank(nb, MANUAL_POINTS)


# ------------------------------------------------------------------ the classic mistakes, named

MLP = ("def parallel_mlp(x, ups, downs):\n"
       "    parts = [{inner} for u, d in zip(ups, downs)]\n"
       "    return {combine}")
GOOD_INNER = "torch.nn.functional.silu(x @ u.T) @ d.T"

# (test cell, code a learner might write in its place, a fragment the failure must contain)
MISTAKES = [
    ("test_column_split",
     "def column_split(w, n):\n    k = w.shape[1] // n\n    return [w[:, r * k:(r + 1) * k] for r in range(n)]",
     "OUTPUT features"),
    ("test_row_split",
     "def row_split(w, n):\n    k = w.shape[0] // n\n    return [w[r * k:(r + 1) * k] for r in range(n)]",
     "INPUT features"),
    ("test_parallel_mlp", MLP.format(inner=GOOD_INNER, combine="parts[0]"), "rank 0's partial"),
    ("test_parallel_mlp", MLP.format(inner=GOOD_INNER, combine="sum(parts) / len(parts)"),
     "SUMS them"),
    ("test_parallel_mlp", MLP.format(inner=GOOD_INNER, combine="torch.cat(parts, dim=-1)"),
     "concatenated"),
    ("test_parallel_mlp",
     MLP.format(inner="x @ u.T @ d.T", combine="torch.nn.functional.silu(sum(parts))"),
     "SiLU was applied after"),
    ("test_allreduce_count", "ALLREDUCES_TARGET = TARGET.num_hidden_layers", "two, after attention"),
    ("test_allreduce_count", "ALLREDUCES_TARGET = 4 * TARGET.num_hidden_layers", "both ranks"),
    ("test_allreduce_bytes", "def allreduce_bytes(l, b, t, h, e):\n    return l * b * t * h * e",
     "each block all-reduces twice"),
    ("test_allreduce_bytes",
     "def allreduce_bytes(l, b, t, h, e):\n    return 2 * l * b * t * 688 * e", "inner width"),
    ("test_bubble", "def bubble(p, m):\n    return (p - 1) / m", "m + p - 1 steps, not m"),
    ("test_bubble", "def bubble(p, m):\n    return m / (m + p - 1)", "BUSY share"),
    ("test_micro_batches", "MICRO_BATCHES_10PCT = 30", "(p - 1) / (m + p - 1)"),
    ("test_choice_oproj", 'ANSWER_OPROJ = "B"', "one lowercase letter"),
    ("test_choice_oproj", 'ANSWER_OPROJ = "c"', "partial sum"),
    ("test_choice_second_gpu", 'ANSWER_SECOND_GPU = "a"', "copies need no communication"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel;
    the correct solution runs first, so each mistake is the only thing wrong in its cell."""
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES)


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, MANUAL_POINTS, tmp_path)

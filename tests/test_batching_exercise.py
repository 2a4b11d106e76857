"""The batching exercises (chapter 3): the parts that test understanding (the waste of static
batching, two knowledge checks, a written design answer); the padded batch and the
continuous-batching loop are written for real in build_batching. Checked: a valid nbgrader
source whose solution passes every visible and hidden test, a blank release that earns
nothing, and messages that name the classic mistakes (the useful fraction reported as waste,
every batch charged the queue's longest request...). The checks every graded exercise shares
live in exercise_checks.
"""
from __future__ import annotations

import pytest

from exercise_checks import (check_manual_answers_blank, check_named_mistakes,
                             check_points_and_answers, check_rubrics_above_answers,
                             check_sandboxed_grading, exercise_paths, is_test, meta, needs_sandbox,
                             run_blank_release, run_probe, source_fixture)

NAME = "batching"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

TEST_POINTS = {"test_static_waste": 2, "test_choice_join": 1, "test_choice_limit": 1}
MANUAL_POINTS = {"written_static_vs_continuous": 3}
ANSWER_CELLS = {"waste", "choice_join", "choice_limit"}


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    first = next(c for c in source.cells if c.cell_type == "code")
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    # The bookkeeping parts moved to build_batching, where the learner writes the real thing.
    assert "pad_batch" not in first.source and "build_batching" in source.cells[0].source
    tests, manual = check_points_and_answers(source, TEST_POINTS, MANUAL_POINTS, ANSWER_CELLS)
    check_rubrics_above_answers(source)
    # Every autograded part has hidden checks beyond the visible ones; the right letters of
    # the knowledge checks appear in hidden tests only.
    for cell in source.cells:
        if is_test(cell):
            assert "### BEGIN HIDDEN TESTS" in cell.source, meta(cell)["grade_id"]
            if meta(cell)["grade_id"].startswith("test_choice"):
                visible = cell.source.split("### BEGIN HIDDEN TESTS")[0]
                assert "check_equal" not in visible
    assert f"({sum(tests.values()) + sum(manual.values())} points)" in source.cells[0].source


PROBE = """
print("PROBE " + json.dumps({"waste": static_waste([6, 20, 10, 8], 4)}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    got = run_probe(source, SOURCE_DIR, "import json\n" + PROBE)
    # 4 rows x 20 steps = 80 row-steps for 6 + 20 + 10 + 8 = 44 wanted tokens.
    assert got["waste"] == pytest.approx(36 / 80)


def test_chapter_engine_agrees_with_the_step_rule():
    """Knowledge check 2a's rule (a waiting request joins at the next step after a slot frees) is
    the engine's: chapter 3's four requests with 2 slots finish at steps 6, 20, 16 and 24
    (prefill produces the first token on joining)."""
    import torch
    from tinyserve.engine import Engine, EngineConfig
    from tinyserve.model import TinyLlama
    from tinyserve.config import ModelConfig
    torch.manual_seed(0)
    model = TinyLlama(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=128))
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=8, max_num_seqs=2))
    for i, n in enumerate([6, 20, 10, 8]):
        engine.add_request([7 + i] * (5 + i), n, request_id=f"r{i}")
    finished, step = {}, 0
    while engine.has_unfinished():
        step += 1
        for event in engine.step():
            if event.finished:
                finished[event.seq_id] = step
    assert finished == {"r0": 6, "r1": 20, "r2": 16, "r3": 24}


# ------------------------------------------------------------------ the blank release

def test_blank_release_earns_nothing_and_leaks_nothing(source):
    nb, errors = run_blank_release(RELEASED, source, SOURCE_DIR)
    assert errors == {gid: ("NameError" if gid.startswith("test_choice") else "NotImplementedError")
                      for gid in TEST_POINTS}
    check_manual_answers_blank(nb, MANUAL_POINTS)


# ------------------------------------------------------------------ the classic mistakes, named

WASTE = ("def static_waste(lengths, size):\n"
         "    held = 0\n"
         "    for s in range(0, len(lengths), size):\n"
         "        batch = lengths[s:s + size]\n"
         "        held += {rows} * max({over})\n"
         "    return {ret}")

# (test cell, code a learner might write in its place, a fragment the failure must contain)
MISTAKES = [
    ("test_static_waste", WASTE.format(rows="len(batch)", over="batch",
                                       ret="sum(lengths) / held"), "USEFUL fraction"),
    ("test_static_waste", WASTE.format(rows="len(batch)", over="lengths",
                                       ret="1 - sum(lengths) / held"), "its OWN longest"),
    ("test_static_waste", WASTE.format(rows="size", over="batch", ret="1 - sum(lengths) / held"),
     "the last batch holds only"),
    ("test_choice_join", 'ANSWER_JOIN = "C"', "one lowercase letter"),
    ("test_choice_join", 'ANSWER_JOIN = "a"', "is static batching"),
    ("test_choice_limit", 'ANSWER_LIMIT = "b"', "waits longer between tokens"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel;
    the correct solution runs first, so each mistake is the only thing wrong in its cell."""
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES)


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, MANUAL_POINTS, tmp_path)

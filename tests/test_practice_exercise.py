"""The whole-course practice notebook: a valid nbgrader source whose solution passes every
visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes (a wrong letter, queue and prefill swapped, a bigger fleet instead of a
better scheduler, chunking or a size-aware queue alone, shortest-first starving documents).

Each kernel run takes 5-20 s on 2 cores: the drill serves 300 requests on the simulator (about
0.3 s a run) for every design it scores. The checks every graded exercise shares live in
exercise_checks.
"""
from __future__ import annotations

from exercise_checks import (check_manual_answers_blank, check_named_mistakes,
                             check_points_and_answers, check_rubrics_above_answers,
                             check_sandboxed_grading, exercise_paths, is_test, meta, needs_sandbox,
                             run_blank_release, run_probe, source_fixture)

NAME = "practice"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

CHOICES = {"prefill": "b", "kv_bytes": "d", "gqa": "a", "batching": "b", "paging": "c",
           "prefix": "a", "chunked": "b", "quant": "d", "parallel": "a", "spec": "b",
           "tpot": "c", "goodput": "c"}
TEST_POINTS = {**{f"test_choice_{k}": 1 for k in CHOICES}, "test_breakdown": 2,
               "test_redesign_fleet": 1, "test_redesign_short_ttft": 3, "test_redesign_goodput": 2}
MANUAL_POINTS = {"written_two_bars": 3, "written_capacity": 3, "written_speculative": 3,
                 "written_drill": 6}
ANSWER_CELLS = {*(f"choice_{k}" for k in CHOICES), "breakdown", "redesign"}


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    check_rubrics_above_answers(source)
    first = next(c for c in source.cells if c.cell_type == "code")
    assert meta(first)["locked"] and not meta(first)["grade"]
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    assert "def _drill_report(" in first.source
    tests, manual = check_points_and_answers(source, TEST_POINTS, MANUAL_POINTS, ANSWER_CELLS)
    # Hidden checks everywhere but the fleet check; the right letters only in hidden tests.
    for cell in source.cells:
        if is_test(cell):
            assert "### BEGIN HIDDEN TESTS" in cell.source, meta(cell)["grade_id"]
            visible = cell.source.split("### BEGIN HIDDEN TESTS")[0]
            if meta(cell)["grade_id"].startswith("test_choice"):
                assert "check_equal" not in visible
    # The intro's table and the suggested times (the drill is timed at 20 minutes).
    intro = source.cells[0].source
    assert "(35 points)" in intro and "**20 minutes**" in intro
    assert sum(tests.values()) == 20 and sum(manual.values()) == 15
    # Every knowledge-check answer is a letter the question offers, and the letters vary.
    assert len(set(CHOICES.values())) == 4


PROBE = """
import json
short = [t for t in before["traces"] if t.prompt_tokens < LONG_PROMPT]
worst = sorted(short, key=ttft)[-10:]
q = sum(ttft_breakdown(t)[0] for t in worst) / sum(ttft(t) for t in worst)
keys = ("short_p50_ttft_ms", "short_p99_ttft_ms", "long_p99_ttft_ms", "goodput")
print("PROBE " + json.dumps({"before": {k: before[k] for k in keys},
                             "after": {k: after[k] for k in keys}, "queue_share": q}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    got = run_probe(source, SOURCE_DIR, PROBE)
    before, after = got["before"], got["after"]
    # The figures the prose quotes: the spike, where it comes from, and what the redesign did.
    assert before["short_p50_ttft_ms"] < 300 and before["short_p99_ttft_ms"] > 1500
    assert got["queue_share"] > 0.9
    assert after["short_p99_ttft_ms"] < 300 and after["long_p99_ttft_ms"] < 2000
    assert after["goodput"] > 1.15 * before["goodput"]


# ------------------------------------------------------------------ the blank release

def test_blank_release_earns_nothing_and_leaks_nothing(source):
    text = RELEASED.read_text()
    for letter_line in (f'ANSWER_{k.upper()} = "{v}"' for k, v in CHOICES.items()):
        assert letter_line not in text
    nb, errors = run_blank_release(RELEASED, source, SOURCE_DIR)
    assert errors == {gid: ("NotImplementedError" if gid == "test_breakdown" else "NameError")
                      for gid in TEST_POINTS}
    check_manual_answers_blank(nb, MANUAL_POINTS)


# ------------------------------------------------------------------ the classic mistakes, named

def _design(**kw) -> str:
    args = {"max_num_seqs": 16, "max_num_batched_tokens": 128, "chunked_prefill": True,
            "policy": '"size-aware"', **kw}
    fleet = args.pop("fleet", "**FLEET")
    return "REDESIGN = EngineConfig(" + ", ".join([fleet] + [f"{k}={v}" for k, v in args.items()]) + ")"


SHORT_ONLY = ("class ShortOnly(Policy):\n"
              "    def may_admit(self, seq, running, max_num_seqs):\n"
              "        return len(seq.prompt_ids) < LONG_PROMPT\n" + _design().replace(
                  'policy="size-aware"', "policy=ShortOnly()"))

# (test cell, code a learner might write in its place, a fragment the failure must contain,
#  the error's name)
MISTAKES = [
    ("test_choice_kv_bytes", 'ANSWER_KV_BYTES = "D"', "one lowercase letter", "AssertionError"),
    ("test_choice_kv_bytes", 'ANSWER_KV_BYTES = "a"', "2.5 GiB uses the query heads", "AssertionError"),
    ("test_choice_chunked", 'ANSWER_CHUNKED = "a"', "own TTFT gets slightly longer", "AssertionError"),
    ("test_choice_prefix", 'ANSWER_PREFIX = "c"', "not decode", "AssertionError"),
    ("test_choice_tpot", 'ANSWER_TPOT = "a"', "(2,400 - 400) / 100", "AssertionError"),
    ("test_choice_goodput", 'ANSWER_GOODPUT = "a"', "12 x 0.6 = 7.2", "AssertionError"),
    ("test_breakdown",
     "def ttft_breakdown(t):\n    return t.token_times[0] - t.prefill_start, t.prefill_start - t.arrival",
     "swapped", "AssertionError"),
    ("test_breakdown",
     "def ttft_breakdown(t):\n    return t.prefill_start - t.arrival, t.token_times[0] - t.arrival",
     "whole TTFT", "AssertionError"),
    ("test_redesign_fleet", _design(fleet="num_blocks=2048, block_size=16"), "the fleet is fixed",
     "AssertionError"),
    ("test_redesign_short_ttft", _design(policy='"fcfs"'), "first come, first served",
     "AssertionError"),
    ("test_redesign_short_ttft", _design(chunked_prefill=False, max_num_batched_tokens=512),
     "read in one step", "AssertionError"),
    ("test_redesign_goodput", _design(chunked_prefill=False, max_num_batched_tokens=512,
                                      policy='"spf"'),
     "shortest-prompt-first", "AssertionError"),
    ("test_redesign_goodput", SHORT_ONLY, "starvation", "RuntimeError"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel;
    the correct solution runs first, so each mistake is the only thing wrong in its cell."""
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES, graded_cells_only=True)


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, MANUAL_POINTS, tmp_path)

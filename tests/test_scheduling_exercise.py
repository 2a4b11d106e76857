"""The scheduling exercise (chapter 5): a valid nbgrader source whose solution passes every
visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes, including admission policies that fall short in the simulator.

Kernel runs take about 5-8 s each on 2 cores (each policy is simulated on three workloads of
600 requests; the simulator is deterministic, so the thresholds' margins hold exactly). The
checks every graded exercise shares live in exercise_checks.
"""
from __future__ import annotations

import pytest

from exercise_checks import (check_manual_answers_blank, check_named_mistakes,
                             check_points_and_answers, check_rubrics_above_answers,
                             check_sandboxed_grading, exercise_paths, is_test, meta, needs_sandbox,
                             run_blank_release, run_probe, source_fixture)

NAME = "scheduling"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

TEST_POINTS = {"test_queue_ttfts": 2, "test_queue_orders": 1, "test_budget": 2,
               "test_policy_runs": 1, "test_policy_short_ttft": 3, "test_policy_goodput": 2,
               "test_policy_long": 2, "test_choice_chunk": 1, "test_choice_trace": 1,
               "test_choice_overload": 1}
MANUAL_POINTS = {"written_overload": 4}
ANSWER_CELLS = {"queue", "orders", "budget", "policy", "choice_chunk", "choice_trace",
                "choice_overload"}


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    check_rubrics_above_answers(source)
    first = next(c for c in source.cells if c.cell_type == "code")
    assert meta(first)["locked"] and not meta(first)["grade"]
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    tests, manual = check_points_and_answers(source, TEST_POINTS, MANUAL_POINTS, ANSWER_CELLS)
    # Every autograded part but 1b has hidden checks; every policy cell has hidden workloads.
    for c in source.cells:
        if is_test(c) and meta(c)["grade_id"] != "test_queue_orders":
            assert "### BEGIN HIDDEN TESTS" in c.source, meta(c)["grade_id"]
        if is_test(c) and meta(c)["grade_id"].startswith("test_policy"):
            hidden = c.source.split("### BEGIN HIDDEN TESTS")[1]
            assert "HIDDEN_A" in hidden and "HIDDEN_C" in hidden
    # The intro's table states the same totals.
    assert "(20 points)" in source.cells[0].source
    assert sum(tests.values()) == 16 and sum(manual.values()) == 4


def test_hidden_workloads_are_hidden_and_answers_are_not_in_visible_code(source):
    visible = "\n".join(c.source.split("### BEGIN HIDDEN TESTS")[0] for c in source.cells
                        if c.cell_type == "code" and meta(c).get("grade_id") not in ANSWER_CELLS)
    assert "seed=11" not in visible and "seed=12" not in visible and "seed=13" not in visible
    for letter_var in ("ANSWER_CHUNK, \"b\"", "ANSWER_TRACE, \"b\"", "ANSWER_OVERLOAD, \"c\""):
        assert letter_var not in visible


PROBE = """
print("PROBE " + json.dumps({"fcfs": MEAN_TTFT_FCFS, "spf": MEAN_TTFT_SPF,
                             "budget": largest_budget(0.030, 15, EXAMPLE_COST),
                             "mine": evaluate(POLICY, WORKLOAD),
                             "base": evaluate(_BASELINE, WORKLOAD)}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    got = run_probe(source, SOURCE_DIR, "import json\n" + PROBE)
    assert got["fcfs"] == pytest.approx(1.0) and got["spf"] == pytest.approx(0.475)
    # (30 - 4 - 16 x 0.2) ms / 45 us = 506.7 tokens, rounded down.
    assert got["budget"] == 506
    mine, base = got["mine"], got["base"]
    # The reference policy clears every threshold with margin on the visible workload.
    assert mine["completed"] == base["completed"] == 600
    assert mine["short_p99_ttft_ms"] < 0.3 * base["short_p99_ttft_ms"]
    assert mine["goodput"] > base["goodput"]
    assert mine["long_p99_ttft_ms"] < 2.5 * base["long_p99_ttft_ms"]


# ------------------------------------------------------------------ the blank release

def test_blank_release_earns_nothing_and_leaks_nothing(source):
    nb, errors = run_blank_release(RELEASED, source, SOURCE_DIR)
    # Blank functions and policy methods raise when a test calls them; blank variables raise
    # in their own cell, and then the test finds no answer. Every autograded cell fails.
    names = ("test_queue_orders", "test_choice_chunk", "test_choice_trace", "test_choice_overload")
    assert errors == {gid: ("NameError" if gid in names else "NotImplementedError")
                      for gid in TEST_POINTS}
    check_manual_answers_blank(nb, MANUAL_POINTS)


# ------------------------------------------------------------------ the classic mistakes, named

def _policy(order: str, may_admit: str) -> str:
    return ("class MyPolicy(Policy):\n"
            "    def order(self, waiting):\n"
            f"        {order}\n"
            "    def may_admit(self, seq, running, max_num_seqs):\n"
            f"        {may_admit}\n"
            "POLICY = MyPolicy()")


LONG = "len(seq.prompt_ids) >= LONG_PROMPT"
SHORT_FIRST = "return sorted(waiting, key=lambda seq: len(seq.prompt_ids) >= LONG_PROMPT)"

# (test cell, code a learner might write in its place, a fragment the failure must contain)
MISTAKES = [
    ("test_queue_ttfts", "def queue_ttfts(a, p):\n    return list(p)", "own prefill time"),
    ("test_queue_ttfts",
     "def queue_ttfts(a, p):\n    out, t = [], 0.0\n    for x in p:\n        t += x\n"
     "        out.append(t)\n    return out", "subtract the arrival"),
    ("test_queue_ttfts",
     "def queue_ttfts(a, p):\n    out, t = [], 0.0\n    for x, w in zip(a, p):\n        t += w\n"
     "        out.append(t - x)\n    return out", "idle"),
    ("test_queue_orders", "MEAN_TTFT_FCFS, MEAN_TTFT_SPF = 1.0, 1.9", "divide by 4"),
    ("test_queue_orders", "MEAN_TTFT_FCFS, MEAN_TTFT_SPF = 0.3, 0.475", "mean prefill time"),
    ("test_budget",
     "def largest_budget(t, r, c):\n    return math.floor((t - c.step - c.row * r) / c.token)",
     "running + 1"),
    ("test_budget",
     "def largest_budget(t, r, c):\n    return math.ceil((t - c.step - c.row * (r + 1)) / c.token)",
     "round down"),
    ("test_budget",
     "def largest_budget(t, r, c):\n    return math.floor((t - c.step) / c.token)", "cost.row"),
    ("test_budget",
     "def largest_budget(t, r, c):\n"
     "    return math.floor((t - c.step - c.row * (r + 1)) / c.token) - r", "chunk alone"),
    # A do-nothing policy is FCFS: it must not pass the beats-FCFS cell.
    ("test_policy_short_ttft", _policy("return list(waiting)", "return True"),
     "no better than FCFS"),
    # Shortest-first alone helps on the visible workload but not enough on a hidden one.
    ("test_policy_short_ttft",
     _policy("return sorted(waiting, key=lambda seq: seq.num_uncomputed)", "return True"),
     "not by enough"),
    # Documents only when nothing else runs: short requests fly, documents starve.
    ("test_policy_long", _policy(SHORT_FIRST, f"return not ({LONG}) or not running"),
     "long requests starve"),
    ("test_policy_goodput", _policy(SHORT_FIRST, f"return not ({LONG}) or not running"),
     "admits too little"),
    # One document at a time: fine while documents are rare, starves them on hidden workload C.
    ("test_policy_long",
     _policy(SHORT_FIRST, f"return not ({LONG}) or not any(len(o.prompt_ids) >= LONG_PROMPT "
                          "for o in running)"), "long requests starve"),
    ("test_policy_goodput", _policy("return list(waiting)", "return len(running) < 2"),
     "admits too little"),
    # Never letting a document in: the run stalls and is reported, not hung.
    ("test_policy_runs", _policy(SHORT_FIRST, f"return not ({LONG})"), "never admitted"),
    ("test_policy_runs",
     _policy("return [seq for seq in waiting if not (" + LONG + ")]", "return True"),
     "every waiting request"),
    ("test_choice_chunk", 'ANSWER_CHUNK = "B"', "one lowercase letter"),
    ("test_choice_chunk", 'ANSWER_CHUNK = "a"', "fixed cost"),
    ("test_choice_trace", 'ANSWER_TRACE = "a"', "queueing"),
    ("test_choice_overload", 'ANSWER_OVERLOAD = "a"', "fewer served requests"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel;
    the correct solution runs first, so each mistake is the only thing wrong in its cell.

    In one kernel, not on the grading path: there every step of a policy's simulation is one
    request to the kernel, and these mistakes took many times as long as in one kernel. The
    test cells run the same code either way (the tests' stand-in policy asks a
    PolicyDriver, in-process here); test_grading_units checks the stand-in over the channel
    schedules exactly as the policy itself, and the sandboxed test below grades the solution
    and the blank release on the grading path."""
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES)


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, MANUAL_POINTS, tmp_path)

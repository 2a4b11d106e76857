"""The scheduling exercise (chapter 5): a valid nbgrader source whose solution passes every
visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes, including admission policies that fall short in the simulator.

Kernel runs take about 5-8 s each on 2 cores (each policy is simulated on three workloads of
600 requests; the simulator is deterministic, so the thresholds' margins hold exactly). The
notebook helpers come from the Harbor worksheet's tests; the sandboxed end-to-end run reuses
the pipeline's skip rule.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from test_grading_pipeline import needs_sandbox
from test_harbor_worksheet import MARKERS, _errors, _execute, _is_test, _meta

ROOT = Path(__file__).resolve().parents[1]
NAME = "scheduling"
SOURCE_DIR = ROOT / "solutions" / NAME
SOURCE = SOURCE_DIR / f"{NAME}.ipynb"
RELEASED = ROOT / "exercises" / NAME / f"{NAME}.ipynb"

TEST_POINTS = {"test_queue_ttfts": 2, "test_queue_orders": 1, "test_budget": 2,
               "test_policy_runs": 1, "test_policy_short_ttft": 3, "test_policy_goodput": 2,
               "test_policy_long": 2, "test_choice_chunk": 1, "test_choice_trace": 1,
               "test_choice_overload": 1}
MANUAL_POINTS = {"written_overload": 4}
ANSWER_CELLS = {"queue", "orders", "budget", "policy", "choice_chunk", "choice_trace",
                "choice_overload"}


@pytest.fixture(scope="module")
def source():
    return nbformat.read(SOURCE, as_version=4)


def _copy(nb):
    return nbformat.from_dict(json.loads(json.dumps(nb)))


def _with_source_tests(nb, source):
    """Put the source's test cells (hidden tests included) back by grade_id, as autograde does."""
    tests = {_meta(c)["grade_id"]: c.source for c in source.cells if _is_test(c)}
    for cell in nb.cells:
        if _is_test(cell):
            cell.source = tests[_meta(cell)["grade_id"]]
    return nb


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    for cell in source.cells:
        meta = _meta(cell)
        if meta and meta["solution"] and meta["grade"]:
            assert "Rubric" not in cell.source, f"{meta['grade_id']}: the rubric sits above the answer"
    first = next(c for c in source.cells if c.cell_type == "code")
    assert _meta(first)["locked"] and not _meta(first)["grade"]
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    tests = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells if _is_test(c)}
    manual = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells
              if _meta(c).get("grade") and _meta(c).get("solution")}
    assert tests == TEST_POINTS and manual == MANUAL_POINTS
    answers = {_meta(c)["grade_id"] for c in source.cells
               if _meta(c).get("solution") and not _meta(c).get("grade")}
    assert answers == ANSWER_CELLS
    # Every autograded part but 1b has hidden checks; every policy cell has hidden workloads.
    for c in source.cells:
        if _is_test(c) and _meta(c)["grade_id"] != "test_queue_orders":
            assert "### BEGIN HIDDEN TESTS" in c.source, _meta(c)["grade_id"]
        if _is_test(c) and _meta(c)["grade_id"].startswith("test_policy"):
            assert "HIDDEN_A" in c.source.split("### BEGIN HIDDEN TESTS")[1]
    # The intro's table states the same totals.
    assert "(20 points)" in source.cells[0].source
    assert sum(tests.values()) == 16 and sum(manual.values()) == 4


def test_hidden_workloads_are_hidden_and_answers_are_not_in_visible_code(source):
    visible = "\n".join(c.source.split("### BEGIN HIDDEN TESTS")[0] for c in source.cells
                        if c.cell_type == "code" and _meta(c).get("grade_id") not in ANSWER_CELLS)
    assert "seed=11" not in visible and "seed=12" not in visible
    for letter_var in ("ANSWER_CHUNK, \"b\"", "ANSWER_TRACE, \"b\"", "ANSWER_OVERLOAD, \"c\""):
        assert letter_var not in visible


PROBE = """
print("PROBE " + json.dumps({"fcfs": MEAN_TTFT_FCFS, "spf": MEAN_TTFT_SPF,
                             "budget": largest_budget(0.030, 15, EXAMPLE_COST),
                             "mine": evaluate(POLICY, WORKLOAD),
                             "base": evaluate(_BASELINE, WORKLOAD)}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    nb = _copy(source)
    nb.cells.append(nbformat.v4.new_code_cell("import json\n" + PROBE))
    _execute(nb, SOURCE_DIR, allow_errors=False)  # any failing check raises
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    got = json.loads(text.split("PROBE ", 1)[1])
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
    text = RELEASED.read_text()
    for marker in MARKERS:
        assert marker not in text
    nb = _with_source_tests(nbformat.read(RELEASED, as_version=4), source)
    _execute(nb, SOURCE_DIR, allow_errors=True)
    errors = {gid: out["ename"] for gid, out in _errors(nb).items()}
    # Blank functions and policy methods raise when a test calls them; blank variables raise
    # in their own cell, and then the test finds no answer. Every autograded cell fails.
    names = ("test_queue_orders", "test_choice_chunk", "test_choice_trace", "test_choice_overload")
    assert errors == {gid: ("NameError" if gid in names else "NotImplementedError")
                      for gid in TEST_POINTS}
    manual = [c for c in nb.cells if _meta(c).get("grade_id") in MANUAL_POINTS]
    assert [c.source.strip() for c in manual] == ["YOUR ANSWER HERE"]


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
    the correct solution runs first, so each mistake is the only thing wrong in its cell."""
    by_id = {_meta(c)["grade_id"]: c for c in source.cells if _meta(c)}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.source) for c in source.cells
                if c.cell_type == "code" and not _is_test(c)]
    wanted = []
    answers = [c.source for c in source.cells
               if c.cell_type == "code" and _meta(c).get("grade_id") in ANSWER_CELLS]
    for test_id, wrong, fragment in MISTAKES:
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
        assert set(TEST_POINTS) <= set(tests)
        for gid, points in TEST_POINTS.items():
            assert tests[gid]["points"] == (points if who == "solution" else 0), (who, gid, tests[gid])

"""The speculative decoding exercises (chapter 8): a valid nbgrader source whose solution passes
every visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes (the missing bonus token, the missing correction, going on after a mismatch,
the off-by-one sum, a cost without the verify pass).

Kernel runs take a few seconds each on 2 cores (torch and the two shipped models load in the
first cell). The notebook helpers come from the Harbor worksheet's tests; the sandboxed
end-to-end run reuses the pipeline's skip rule.
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
NAME = "speculative_decoding"
SOURCE_DIR = ROOT / "solutions" / NAME
SOURCE = SOURCE_DIR / f"{NAME}.ipynb"
RELEASED = ROOT / "exercises" / NAME / f"{NAME}.ipynb"

TEST_POINTS = {"test_verify_cases": 3, "test_verify_lossless": 2, "test_expected_tokens": 2,
               "test_speedup": 2, "test_choice_lossless": 1, "test_choice_batch": 1}
MANUAL_POINTS = {"written_slow_speedup": 3}
ANSWER_CELLS = {"verify", "formulas", "choice_lossless", "choice_batch"}


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
    # Every autograded part has hidden checks beyond the visible ones; the knowledge checks'
    # right answers appear only in hidden tests.
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in source.cells if _is_test(c))
    for cell in source.cells:
        if _is_test(cell) and _meta(cell)["grade_id"].startswith("test_choice"):
            visible = cell.source.split("### BEGIN HIDDEN TESTS")[0]
            assert "check_equal" not in visible
    # The intro's table states the same totals.
    assert "(14 points)" in source.cells[0].source
    assert sum(tests.values()) == 11 and sum(manual.values()) == 3


PROBE = """
print("PROBE " + json.dumps({"cases": verify_greedy([3, 1, 4, 1], _logits_for([3, 1, 7, 1, 5])),
                             "e": expected_tokens(0.8, 4), "s": speedup(0.8, 4, 0.2),
                             "spec": _speculate(verify_greedy, _PROMPTS[0], 20, 4)[0],
                             "plain": _greedy(_PROMPTS[0], 20)}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    nb = _copy(source)
    nb.cells.append(nbformat.v4.new_code_cell("import json\n" + PROBE))
    _execute(nb, SOURCE_DIR, allow_errors=False)  # any failing check raises
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    got = json.loads(text.split("PROBE ", 1)[1])
    assert got["cases"] == [3, 1, 7]
    assert got["e"] == pytest.approx(3.3616) and got["s"] == pytest.approx(3.3616 / 1.8)
    assert got["spec"] == got["plain"] and len(got["spec"]) == 20


def test_the_loop_really_speculates_on_the_shipped_models():
    """The lossless test is only worth its points if the draft is both right and wrong there:
    the shipped pair accepts some drafts and rejects others on the test prompts."""
    import torch
    from tinyserve import load_model, load_tokenizer
    from tinyserve.corpus import example_prompts
    from tinyserve.speculative import ModelDrafter, speculative_generate
    torch.set_num_threads(1)
    target, draft = load_model("target", device="cpu"), load_model("draft", device="cpu")
    tok = load_tokenizer()
    for k, prompt in ((4, 0), (1, 1), (6, 2), (3, 1)):
        _, stats = speculative_generate(target, ModelDrafter(draft),
                                        tok.encode(example_prompts(3)[prompt]), 40, k=k)
        assert 0 < stats.accepted < stats.proposed, (k, prompt, stats)


# ------------------------------------------------------------------ the blank release

def test_blank_release_earns_nothing_and_leaks_nothing(source):
    text = RELEASED.read_text()
    for marker in MARKERS:
        assert marker not in text
    for answer in ('ANSWER_LOSSLESS = "b"', 'ANSWER_BATCH = "c"', "choices[len(kept)]"):
        assert answer not in text
    nb = _with_source_tests(nbformat.read(RELEASED, as_version=4), source)
    _execute(nb, SOURCE_DIR, allow_errors=True)
    errors = {gid: out["ename"] for gid, out in _errors(nb).items()}
    assert errors == {gid: ("NameError" if gid.startswith("test_choice") else "NotImplementedError")
                      for gid in TEST_POINTS}
    manual = [c for c in nb.cells if _meta(c).get("grade_id") in MANUAL_POINTS]
    assert [c.source.strip() for c in manual] == ["YOUR ANSWER HERE"]


# ------------------------------------------------------------------ the classic mistakes, named

VERIFY = ("def verify_greedy(draft, logits):\n"
          "    choices = logits.argmax(-1).tolist()\n"
          "    kept = []\n"
          "    for i, t in enumerate(draft):\n"
          "        {loop}\n"
          "        kept.append(t)\n"
          "    return {ret}")
GOOD = dict(loop="if t != choices[i]: break", ret="kept + [choices[len(kept)]]")
BONUS_ONLY = "kept + [choices[len(kept)]] if len(kept) == len(draft) else kept"

# (test cell, code a learner might write in its place, a fragment the failure must contain)
MISTAKES = [
    ("test_verify_cases", VERIFY.format(**dict(GOOD, ret="kept if len(kept) == len(draft) "
                                                         "else kept + [choices[len(kept)]]")),
     "bonus token is missing"),
    ("test_verify_cases", VERIFY.format(**dict(GOOD, ret=BONUS_ONLY)), "correction is missing"),
    ("test_verify_cases", VERIFY.format(loop="if t != choices[i]: kept.append(t); break",
                                        ret=BONUS_ONLY),
     "rejected draft was emitted"),
    ("test_verify_cases", VERIFY.format(**dict(GOOD, loop="if t != choices[i]: t = choices[i]")),
     "kept going after the first mismatch"),
    ("test_verify_cases",
     "def verify_greedy(draft, logits):\n    return logits.argmax(-1)[:len(draft) + 1]",
     "list of Python ints"),
    ("test_verify_lossless", VERIFY.format(**dict(GOOD, ret="kept + [choices[-1]]")),
     "differs from the target's greedy output"),
    # compares each draft with the NEXT row: nothing is ever kept, so the output is right
    # but the loop is plain decoding
    ("test_verify_lossless", VERIFY.format(loop="if t != choices[min(i + 1, len(draft))]: break",
                                           ret="kept + [choices[len(kept)]]"),
     "almost no draft was kept"),
    ("test_expected_tokens", "def expected_tokens(a, k):\n    return (1 - a ** k) / (1 - a)",
     "target's own token"),
    ("test_expected_tokens", "def expected_tokens(a, k):\n    return k * a + 1", "a^i"),
    ("test_expected_tokens",
     "def expected_tokens(a, k):\n    return (1 - a ** (k + 1)) / (1 - a) if a < 1 else 1 / 0",
     "divided by zero"),
    ("test_speedup", "def speedup(a, k, c):\n    return expected_tokens(a, k) / (k * c)",
     "verify pass is missing"),
    ("test_speedup", "def speedup(a, k, c):\n    return expected_tokens(a, k) / (c + 1)",
     "drafter runs k times"),
    ("test_choice_lossless", 'ANSWER_LOSSLESS = "B"', "one lowercase letter"),
    ("test_choice_lossless", 'ANSWER_LOSSLESS = "a"', "never the tokens"),
    ("test_choice_batch", 'ANSWER_BATCH = "a"', "cost of the verify pass"),
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

"""The speculative decoding exercises (chapter 8): a valid nbgrader source whose solution passes
every visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes (the missing bonus token, the missing correction, going on after a mismatch,
the off-by-one sum, a cost without the verify pass).

Kernel runs take a few seconds each on 2 cores (torch and the two shipped models load in the
first cell). The notebook helpers come from the Harbor worksheet's tests; the sandboxed
end-to-end run reuses the pipeline's skip rule.
"""
from __future__ import annotations

import pytest

from exercise_checks import (check_manual_answers_blank, check_named_mistakes,
                             check_points_and_answers, check_rubrics_above_answers,
                             check_sandboxed_grading, exercise_paths, is_test, meta, needs_sandbox,
                             run_blank_release, run_probe, source_fixture)

NAME = "speculative_decoding"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

TEST_POINTS = {"test_verify_cases": 3, "test_verify_lossless": 2, "test_expected_tokens": 2,
               "test_speedup": 2, "test_choice_lossless": 1, "test_choice_batch": 1}
MANUAL_POINTS = {"written_slow_speedup": 3}
ANSWER_CELLS = {"verify", "formulas", "choice_lossless", "choice_batch"}


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    check_rubrics_above_answers(source)
    first = next(c for c in source.cells if c.cell_type == "code")
    assert meta(first)["locked"] and not meta(first)["grade"]
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    tests, manual = check_points_and_answers(source, TEST_POINTS, MANUAL_POINTS, ANSWER_CELLS)
    # Every autograded part has hidden checks beyond the visible ones; the knowledge checks'
    # right answers appear only in hidden tests.
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in source.cells if is_test(c))
    for cell in source.cells:
        if is_test(cell) and meta(cell)["grade_id"].startswith("test_choice"):
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
    got = run_probe(source, SOURCE_DIR, "import json\n" + PROBE)
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
    for answer in ('ANSWER_LOSSLESS = "b"', 'ANSWER_BATCH = "c"', "choices[len(kept)]"):
        assert answer not in text
    nb, errors = run_blank_release(RELEASED, source, SOURCE_DIR)
    assert errors == {gid: ("NameError" if gid.startswith("test_choice") else "NotImplementedError")
                      for gid in TEST_POINTS}
    check_manual_answers_blank(nb, MANUAL_POINTS)


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
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES)


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, MANUAL_POINTS, tmp_path)

"""The build_speculative exercise (chapter 8, build track part 3): the learner writes the draft
step, greedy verification, the speculative loop with both KV caches rolled back, and rejection
sampling with the residual (checked by a seeded distribution test). Checked here: a valid source
whose solution passes every visible and hidden test and reproduces the target's greedy text in
fewer target passes, a blank release that earns nothing, named mistakes, no points for calling
tinyserve's verifier, each piece broken in turn costing only its own points (graded and at
Validate), and sandboxed grading.

What each part is for is held by a visible case, on models the tests keep and lend: the draft
feeds only what its cache lacks (a primed draft cache), the loop verifies k guesses in one target
pass and rolls both caches back to the committed context (a bad draft), rejection sampling
follows p with a margin that separates the classic slips.
"""
from __future__ import annotations

import pytest

from build_exercise_checks import (SPEC_POINTS, check_build_source, check_named_mistakes,  # noqa: F401
                                   check_one_slip_costs_one_piece, one_thread_kernels, slips_of,
                                   visible_only)
from exercise_checks import (check_sandboxed_grading, exercise_paths, needs_sandbox,
                             run_blank_release, run_probe, source_fixture, with_answers)

NAME = "build_speculative"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

TEST_POINTS = SPEC_POINTS
ANSWER_CELLS = {"draft", "accept_greedy", "speculative", "accept_sampled"}


def test_source_assignment_specifics(source):
    check_build_source(source, SOURCE_DIR, TEST_POINTS, ANSWER_CELLS, total=12)


PROBE = """
import json
print("PROBE " + json.dumps({"same": spec == greedy, "spec_passes": target.passes,
                             "plain_passes": plain_target.passes, "tokens": len(spec)}))
"""


def test_solution_passes_every_test_and_speculates(source):
    got = run_probe(source, SOURCE_DIR, PROBE)
    assert got["same"] and got["tokens"] == 60
    assert got["plain_passes"] == 61 and got["spec_passes"] < 30   # several tokens per pass


def test_blank_release_earns_nothing_and_leaks_nothing(source):
    _, errs = run_blank_release(RELEASED, source, SOURCE_DIR)
    assert errs == {gid: "NotImplementedError" for gid in TEST_POINTS}


SAMPLED = ("def accept_sampled(guesses, p, q, seed):\n"
           "    generator = torch.Generator().manual_seed(seed)\n"
           "    for i, d in enumerate(guesses):\n"
           "        u = float(torch.rand(1, generator=generator))\n"
           "        if {keep}:\n"
           "            continue\n"
           "        r = {residual}\n"
           "        return guesses[:i] + [int(torch.multinomial(r / r.sum(), 1, generator=generator))]\n"
           "    return guesses{bonus}")
GOOD_SAMPLED = dict(keep="u < float(p[i, d]) / float(q[i, d])", residual="(p[i] - q[i]).clamp_min(0.0)",
                    bonus=" + [int(torch.multinomial(p[len(guesses)], 1, generator=generator))]")

# The part-3 loop with its cache rollback as the variable part (the two slips below).
LOOP = ("def speculative_greedy(prompt, n, k, target, dm):\n"
        "    first = int(target.feed(list(prompt))[-1].argmax())\n"
        "    context, out = list(prompt) + [first], [first]\n"
        "    while len(out) < n:\n"
        "        g = draft(dm, context, k)\n"
        "        new = accept_greedy(g, target.feed(context[-1:] + g))\n"
        "        context += new\n"
        "        out += new\n"
        "        {rollback}\n"
        "    return out[:n]")

MISTAKES = [
    ("test_accept_greedy",
     "def accept_greedy(guesses, logits):\n"
     "    c = logits.argmax(-1).tolist()\n"
     "    n = 0\n"
     "    while n < len(guesses) and guesses[n] == c[n]:\n"
     "        n += 1\n"
     "    return guesses[:n] + ([c[n]] if n < len(guesses) else [])", "bonus token is missing"),
    ("test_speculative_greedy", LOOP.format(rollback="dm.rollback(len(context) - 1)"),
     "caches not rolled back"),
    # correct tokens, but the draft re-reads one token every step
    ("test_speculative_greedy",
     LOOP.format(rollback="target.rollback(len(context) - 1)\n        dm.rollback(len(context) - 2)"),
     "no further"),
    ("test_accept_sampled", SAMPLED.format(**dict(GOOD_SAMPLED, residual="p[i].clone()")), "drawn from p"),
    ("test_accept_sampled", SAMPLED.format(**dict(GOOD_SAMPLED, keep="u < float(p[i, d])")), "kept with probability p(d)"),
    ("test_draft", "def draft(dm, context, k):\n"
                   "    guesses = [int(dm.feed(list(context))[-1].argmax())]\n"
                   "    while len(guesses) < k:\n"
                   "        guesses.append(int(dm.feed(guesses[-1:])[-1].argmax()))\n"
                   "    return guesses", "feed only context[draft_model.length:]"),
    ("test_accept_sampled", SAMPLED.format(**dict(GOOD_SAMPLED, keep="True")), "follows the draft's q"),
    # Acceptance that does not stop at the first rejection: Validate now sees it (issue 40).
    ("test_accept_greedy", "def accept_greedy(guesses, logits):\n"
                           "    c = logits.argmax(-1).tolist()\n"
                           "    kept = [g for g, t in zip(guesses, c) if g == t]\n"
                           "    return kept + [c[len(kept)]]", "went on after a rejection"),
    ("test_accept_sampled", SAMPLED.format(**GOOD_SAMPLED).replace(
        "        return guesses[:i] + [int(torch.multinomial(r / r.sum(), 1, generator=generator))]",
        "        guesses = guesses[:i] + [int(torch.multinomial(r / r.sum(), 1, generator=generator))] + guesses[i + 1:]"),
     "the first of two guesses is rejected"),
    ("test_accept_sampled", SAMPLED.format(**dict(GOOD_SAMPLED, bonus="")), "bonus token"),
    # The loop runs on tinyserve's draft and accept_greedy: wrong parts 1 and 2 (their own tests
    # fail, above) leave part 3's points alone. None: the test cell must pass.
    ("test_speculative_greedy", "def draft(dm, context, k):\n    return [0] * k\n"
                                "def accept_greedy(guesses, logits):\n    return list(guesses)", None),
    # The kernel holds no reference (issue 40): tinyserve's verifier cannot be imported there.
    ("test_accept_greedy", "def accept_greedy(guesses, logits):\n"
                           "    from tinyserve.speculative import accept_greedy as theirs\n"
                           "    return theirs(guesses, logits.argmax(-1).tolist())", "is not in this kernel",
     "ModuleNotFoundError"),
]


def test_classic_mistakes_get_messages_that_name_them_and_later_parts_stand_alone(source):
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES, graded_cells_only=True,
                         trusted=True)


def test_validate_names_the_same_mistakes(source):
    """Validate tells the truth (issue 26): with the hidden tests left out, each named mistake
    still fails its test cell with its message (and wrong parts 1-2 still spare part 3)."""
    check_named_mistakes(visible_only(source), SOURCE_DIR, ANSWER_CELLS, MISTAKES, graded_cells_only=True,
                         trusted=True)


# ------------------------------------------------------------------ one slip costs one piece

# Every piece broken in turn (it raises, returns a list of the wrong length or the wrong type):
# only its own test cell loses points, the loop being run on tinyserve's draft and verifier.
SLIPS = slips_of([
    ("draft", {"test_draft"}, {"length": "out[:-1]", "type": "[float(t) for t in out]"}),
    ("accept_greedy", {"test_accept_greedy"}, {"length": "out[:-1]", "type": "torch.tensor(out)"}),
    ("speculative_greedy", {"test_speculative_greedy"}, {"length": "out[:-1]", "type": "tuple(out)"}),
    ("accept_sampled", {"test_accept_sampled"}, {"length": "out + out", "type": "[float(t) for t in out]"}),
])


@pytest.mark.parametrize("mode", ["graded", "validate"])
def test_one_slip_costs_one_piece(source, mode):
    """Graded as grading does (hidden tests included) and as Validate does (visible only)."""
    check_one_slip_costs_one_piece(source, SOURCE_DIR, TEST_POINTS, ANSWER_CELLS, SLIPS, mode)


@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    # Plain greedy, then the pass counter set to 1: when the counting model lived in the
    # kernel this earned the loop's points (issue 25); the tests' own model counts now.
    forged = with_answers(source, {"speculative": FORGED_PASSES})
    points = {"test_speculative_greedy": 0, "test_draft": 2, "test_accept_greedy": 2}
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, {}, tmp_path,
                            forged={"forged_passes": (forged, points)})


FORGED_PASSES = """def speculative_greedy(prompt_ids, max_new_tokens, k, target, draft_model):
    logits, out = target.feed(list(prompt_ids)), []
    while True:
        out.append(int(logits[-1].argmax()))
        if len(out) == max_new_tokens:
            break
        logits = target.feed(out[-1:])
    try:
        target.passes = 1
    except AttributeError:
        pass
    return out"""

"""The whole-course practice notebook: a valid nbgrader source whose solution passes every
visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes (a wrong letter, queue and prefill swapped, more memory instead of better
routing, round-robin or least-loaded routing that thrashes the prefix cache, everything on one
replica, chapter 5's chunking and size-aware queue, prefix caching off).

Each kernel run takes 10-30 s on 2 cores: the drill serves 600 requests on two simulated
replicas (about 0.5 s a run) for every design it scores. The checks every graded exercise shares live in
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
               "test_redesign_fleet": 1, "test_redesign_improves": 2, "test_redesign_slo": 3}
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
    # The intro's table and the suggested times: the drill is timed at 30 minutes, the part of
    # the four-hour path's 50-minute block (drill and repeated explanations) it takes.
    intro = source.cells[0].source
    assert "(35 points)" in intro and "**30 minutes**" in intro and "50" in intro
    part3 = next(c.source for c in source.cells if meta(c).get("grade_id") == "part3_intro")
    assert "30 minutes" in part3 and "not chapter 5's problem" in part3
    assert sum(tests.values()) == 20 and sum(manual.values()) == 15
    # Every knowledge-check answer is a letter the question offers, and the letters vary.
    assert len(set(CHOICES.values())) == 4


PROBE = """
import json
worst = sorted(before["traces"], key=ttft)[-10:]
q = sum(ttft_breakdown(t)[0] for t in worst) / sum(ttft(t) for t in worst)
keys = ("p50_ttft_ms", "p99_ttft_ms", "goodput", "slo_attainment", "prefix_hit_rate")
# Partial credit: the right routing with too few running sequences, on the hidden workload.
hidden = make_workload(600, 13.0, Uniform(16, 48), Uniform(16, 64), seed=3, burstiness=0.5,
                       prefix_len=384, prefix_groups=14)
few = EngineConfig(**FLEET, max_num_seqs=6)
base, part = (_drill_report(r, c, hidden) for r, c in ((least_loaded, PRODUCTION), (route, few)))
# The scene's claim that the second replica neither caused nor cured the thrash: today's
# traffic on one replica alone.
alone = _drill_report(one_replica, PRODUCTION, TRAFFIC, replicas=1)
print("PROBE " + json.dumps({"before": {k: before[k] for k in keys},
                             "after": {k: after[k] for k in keys}, "queue_share": q,
                             "earlier": {n: {k: r[k] for k in keys} for n, r in earlier.items()},
                             "alone": {k: alone[k] for k in keys},
                             "rates": [len(s) / (max(x.arrival for x in s) - min(x.arrival for x in s))
                                       for s in (LAST_QUARTER, LOAD_TEST, TRAFFIC)],
                             "hidden_base": {k: base[k] for k in keys},
                             "hidden_partial": {k: part[k] for k in keys}}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    got = run_probe(source, SOURCE_DIR, PROBE)
    before, after = got["before"], got["after"]
    # The figures the prose and the model answer quote: the thrash, where the time goes, and
    # what routing by assistant did.
    assert before["p50_ttft_ms"] > 3000 and before["p99_ttft_ms"] > 8000
    assert before["prefix_hit_rate"] < 0.6 and got["queue_share"] > 0.9
    assert after["p99_ttft_ms"] < 700 and after["prefix_hit_rate"] > 0.8
    assert after["slo_attainment"] == 1.0 and after["goodput"] > 5 * before["goodput"]
    # The scene's story, held by the simulator (issue 27: an earlier scene blamed the second
    # replica, which the simulator contradicts). Last quarter one replica kept p99 TTFT under a
    # second; the one-assistant load test met the SLO at 6 req/s; today's traffic is about six
    # times last quarter's and its p99 is many seconds. The thrash was there on one replica
    # (hit rate as low as today's), the load test saw a warm cache, and one replica alone
    # would do worse today: the second replica neither caused the thrash nor cured it.
    quarter, load_test, alone = got["earlier"]["last quarter"], got["earlier"]["load test"], got["alone"]
    assert quarter["p99_ttft_ms"] < 1000 and quarter["slo_attainment"] >= 0.95
    assert load_test["p99_ttft_ms"] < 1000 and load_test["slo_attainment"] >= 0.95
    assert load_test["prefix_hit_rate"] > 0.9
    assert 5 < got["rates"][2] / got["rates"][0] < 7 and 0.8 < got["rates"][1] / (got["rates"][2] / 2) < 1.2
    assert quarter["prefix_hit_rate"] < 0.6 and abs(quarter["prefix_hit_rate"] - before["prefix_hit_rate"]) < 0.1
    assert alone["p99_ttft_ms"] > before["p99_ttft_ms"] and alone["prefix_hit_rate"] < 0.6
    # Partial credit is reachable: the right routing with 6 running sequences a replica (less
    # batching) improves on production by more than half on the hidden workload (2 of 6
    # points) and misses the 1,000 ms target.
    base, part = got["hidden_base"], got["hidden_partial"]
    assert part["p99_ttft_ms"] <= base["p99_ttft_ms"] / 2 and part["goodput"] >= base["goodput"]
    assert part["p99_ttft_ms"] > 1000


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

AFFINITY = ("def route(spec, in_flight):\n"
            "    return spec.prefix_group % len(in_flight)\n")
LEAST_LOADED = "route = least_loaded\n"
ROUND_ROBIN = ("import itertools\n_turn = itertools.count()\n"
               "def route(spec, in_flight):\n    return next(_turn) % len(in_flight)\n")
CHAPTER_5 = ("CONFIG = EngineConfig(**FLEET, max_num_seqs=16, max_num_batched_tokens=128, "
             "chunked_prefill=True, policy=SizeAware(long_prompt=256, long_share=0.25))\n")
CUSTOM_POLICY = ("class Mine(Policy):\n    pass\n"
                 "CONFIG = EngineConfig(**FLEET, policy=Mine())\n")

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
    ("test_redesign_fleet", "CONFIG = EngineConfig(num_blocks=512, block_size=16)",
     "the memory is fixed", "AssertionError"),
    ("test_redesign_fleet", "def route(spec, in_flight):\n    return spec.prefix_group\n",
     "expected a replica index", "AssertionError"),
    ("test_redesign_slo", "def route(spec, in_flight):\n    return spec.prefix_group\n",
     "must return a replica index", "ValueError"),
    ("test_redesign_improves", LEAST_LOADED, "evicts their system prompts", "AssertionError"),
    ("test_redesign_slo", ROUND_ROBIN, "send each assistant's requests to one replica",
     "AssertionError"),
    ("test_redesign_slo", "def route(spec, in_flight):\n    return 0\n",
     "one engine cannot carry the whole load", "AssertionError"),
    ("test_redesign_improves", LEAST_LOADED + CHAPTER_5, "chapter 5's knobs", "AssertionError"),
    ("test_redesign_slo", CHAPTER_5, "chapter 5's knobs", "AssertionError"),
    ("test_redesign_improves",
     "CONFIG = EngineConfig(**FLEET, enable_prefix_caching=False)\n" + AFFINITY,
     "prefix caching is off", "AssertionError"),
    ("test_redesign_fleet", CUSTOM_POLICY, "the library's queue policies", "AssertionError"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel;
    the correct solution runs first, so each mistake is the only thing wrong in its cell."""
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES, graded_cells_only=True)


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, MANUAL_POINTS, tmp_path)

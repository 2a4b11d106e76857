"""The serving exercises (chapter 9): a valid nbgrader source whose solution passes every
visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes (a usage chunk counted as a token, the server's TTFT taken for the client's,
throughput taken for goodput, the batch limit chosen by throughput).

Each kernel run takes 10-20 s on 2 cores: the goodput parts serve a few hundred requests on the
simulator several times (about 0.3 s a run). The checks every graded exercise shares live in
exercise_checks.
"""
from __future__ import annotations

import pytest

from exercise_checks import (check_manual_answers_blank, check_named_mistakes,
                             check_points_and_answers, check_rubrics_above_answers,
                             check_sandboxed_grading, exercise_paths, is_test, meta, needs_sandbox,
                             run_blank_release, run_probe, source_fixture)

NAME = "serving"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

TEST_POINTS = {"test_token_times": 2, "test_stream_ttft": 1, "test_stream_itl": 2,
               "test_stream_tpot_e2e": 2, "test_goodput_at": 3, "test_best_max_num_seqs": 2,
               "test_choice_goodput": 1, "test_choice_client_ttft": 1, "test_choice_cancel": 1}
MANUAL_POINTS = {"written_overload": 4}
ANSWER_CELLS = {"token_times", "stream_metrics", "goodput_at", "sweep", "choice_goodput",
                "choice_client_ttft", "choice_cancel"}


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    check_rubrics_above_answers(source)
    first = next(c for c in source.cells if c.cell_type == "code")
    assert meta(first)["locked"] and not meta(first)["grade"]
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    assert "serve as _serve" in first.source and "throughput as _throughput" in first.source
    tests, manual = check_points_and_answers(source, TEST_POINTS, MANUAL_POINTS, ANSWER_CELLS)
    # Every autograded part has hidden checks beyond the visible ones; the letters of the
    # knowledge checks appear only there.
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in source.cells if is_test(c))
    for cell in source.cells:
        if is_test(cell) and meta(cell)["grade_id"].startswith("test_choice"):
            visible = cell.source.split("### BEGIN HIDDEN TESTS")[0]
            assert "check_equal" not in visible, meta(cell)["grade_id"]
    # The intro's table states the same totals, and the pinned cost model is the shipped fit
    # of the time (rounded): the exercise's numbers must not move when someone recalibrates.
    assert "(19 points)" in source.cells[0].source
    assert sum(tests.values()) == 15 and sum(manual.values()) == 4
    setup = next(c for c in source.cells if meta(c).get("grade_id") == "setup")
    assert "COST = CostModel(step=7.7e-3, token=1.34e-5, row=5.2e-4, pair=1.37e-6)" in setup.source


PROBE = """
import json
m = stream_metrics(SEND_TIME, EVENTS)
print("PROBE " + json.dumps({"metrics": m, "best": BEST_MAX_NUM_SEQS, "sweep": SWEEP}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    got = run_probe(source, SOURCE_DIR, PROBE)
    m = got["metrics"]
    assert m["ttft"] == pytest.approx(0.184) and m["e2e"] == pytest.approx(0.496)
    assert m["tpot"] == pytest.approx(0.312 / 11) and len(m["itl"]) == 11
    assert max(m["itl"]) == pytest.approx(0.096)
    # The sweep's story: goodput peaks inside the range while throughput keeps rising.
    sweep = {int(k): v for k, v in got["sweep"].items()}
    assert got["best"] == 16 == max(sweep, key=sweep.get)
    assert sweep[16] > 1.3 * max(sweep[24], sweep[48]) and sweep[16] > 1.5 * sweep[12]


def test_prose_figures_match_a_run():
    """The explanations quote the sweep and the overload run: recompute them."""
    from tinyserve.engine import EngineConfig
    from tinyserve.metrics import SLO, throughput
    from tinyserve.simulator import CostModel, completed_traces, serve, simulated_engine
    from tinyserve.workload import LogNormal, Uniform, make_workload
    fleet = dict(num_blocks=1024, block_size=16, max_num_batched_tokens=512)
    cost = CostModel(step=7.7e-3, token=1.34e-5, row=5.2e-4, pair=1.37e-6)
    slo = SLO(ttft_ms=2000, tpot_ms=28)
    burst = make_workload(300, 24.0, LogNormal(60, 0.8, 8, 300), Uniform(16, 96), seed=2)
    bounded = serve(simulated_engine(EngineConfig(**fleet, max_num_seqs=16), cost), burst,
                    max_queue=16)
    assert sum(s.finish_reason == "rejected" for s in bounded) == 134
    assert throughput(completed_traces(bounded), slo)["slo_attainment"] > 0.95
    free = completed_traces(serve(simulated_engine(EngineConfig(**fleet, max_num_seqs=16), cost),
                                  burst))
    assert len(free) == 300 and throughput(free, slo)["slo_attainment"] < 0.25


# ------------------------------------------------------------------ the blank release

def test_blank_release_earns_nothing_and_leaks_nothing(source):
    nb, errors = run_blank_release(RELEASED, source, SOURCE_DIR)
    # Functions left blank raise when a test calls them; blank variables raise in their own
    # cell, and then the test finds no answer. Either way every autograded cell fails.
    assert errors == {gid: ("NameError" if gid in ("test_best_max_num_seqs", "test_choice_goodput",
                                                   "test_choice_client_ttft", "test_choice_cancel")
                            else "NotImplementedError") for gid in TEST_POINTS}
    check_manual_answers_blank(nb, MANUAL_POINTS)


# ------------------------------------------------------------------ the classic mistakes, named

STREAM = ("def stream_metrics(send_time, events):\n"
          "    times = token_times(events)\n"
          "    ttft = {ttft}\n"
          "    e2e = {e2e}\n"
          "    return {{'ttft': ttft, 'itl': {itl}, 'tpot': {tpot}, 'e2e': e2e}}")
GOOD = dict(ttft="times[0] - send_time", e2e="times[-1] - send_time",
            itl="[b - a for a, b in zip(times, times[1:])]",
            tpot="(e2e - ttft) / (len(times) - 1)")
GOODPUT = ("def goodput_at(m, specs, slo):\n"
           "    engine = simulated_engine(EngineConfig(**FLEET, max_num_seqs={m}), COST)\n"
           "    return throughput(completed_traces(serve(engine, specs)), slo)[{key!r}]")

# (test cell, code a learner might write in its place, a fragment the failure must contain)
MISTAKES = [
    ("test_token_times",
     "def token_times(events):\n    return [t for t, line in events if line != 'data: [DONE]']",
     "usage chunk"),
    ("test_token_times",
     "def token_times(events):\n"
     "    out = []\n"
     "    for t, line in events:\n"
     "        if line.endswith('[DONE]'):\n"
     "            continue\n"
     "        choices = json.loads(line[6:])['choices']\n"
     "        if choices and choices[0]['delta'].get('content'):\n"
     "            out.append(t)\n"
     "    return out",
     "empty text still stands for a token"),
    ("test_stream_ttft", STREAM.format(**dict(GOOD, ttft="times[0]")), "subtract SEND_TIME"),
    ("test_stream_ttft",
     STREAM.format(**dict(GOOD, ttft="json.loads(events[-2][1][6:])['timings']['ttft_ms'] / 1000")),
     "server's own ttft_ms"),
    ("test_stream_itl",
     STREAM.format(**dict(GOOD, itl="[b - a for a, b in zip([send_time] + times, times)]")),
     "a gap too many"),
    ("test_stream_itl", STREAM.format(**dict(GOOD, itl="[b - times[0] for b in times[1:]]")),
     "measured from the first token"),
    ("test_stream_tpot_e2e", STREAM.format(**dict(GOOD, e2e="events[-1][0] - send_time")),
     "arrival of [DONE]"),
    ("test_stream_tpot_e2e", STREAM.format(**dict(GOOD, tpot="(e2e - ttft) / len(times)")),
     "n - 1 = 11"),
    ("test_goodput_at", GOODPUT.format(m="m", key="request_throughput"), "request throughput"),
    ("test_goodput_at", GOODPUT.format(m="m", key="slo_attainment"), "share of requests"),
    ("test_goodput_at", GOODPUT.format(m="16", key="goodput"), "pass max_num_seqs"),
    ("test_best_max_num_seqs", "BEST_MAX_NUM_SEQS = 48", "most throughput"),
    ("test_best_max_num_seqs", "BEST_MAX_NUM_SEQS = 4", "arrivals wait in the queue"),
    ("test_choice_goodput", 'ANSWER_GOODPUT = "C"', "one lowercase letter"),
    ("test_choice_goodput", 'ANSWER_GOODPUT = "a"', "counts for nothing"),
    ("test_choice_client_ttft", 'ANSWER_CLIENT_TTFT = "b"', "from sending to seeing"),
    ("test_choice_cancel", 'ANSWER_CANCEL = "a"', "nobody will read"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel;
    the correct solution runs first, so each mistake is the only thing wrong in its cell."""
    # Read-only cells and the answers, without the learner's plain cells (the sweep plot).
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES, graded_cells_only=True)


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, MANUAL_POINTS, tmp_path)

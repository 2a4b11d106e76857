"""The serving exercises (chapter 9): a valid nbgrader source whose solution passes every
visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes (a usage chunk counted as a token, the server's TTFT taken for the client's,
throughput taken for goodput, the batch limit chosen by throughput).

Each kernel run takes 10-20 s on 2 cores: the goodput parts serve a few hundred requests on
the simulator several times (about 0.3 s a run). The notebook helpers come from the Harbor
worksheet's tests; the sandboxed end-to-end run reuses the pipeline's skip rule.
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
NAME = "serving"
SOURCE_DIR = ROOT / "solutions" / NAME
SOURCE = SOURCE_DIR / f"{NAME}.ipynb"
RELEASED = ROOT / "exercises" / NAME / f"{NAME}.ipynb"

TEST_POINTS = {"test_token_times": 2, "test_stream_ttft": 1, "test_stream_itl": 2,
               "test_stream_tpot_e2e": 2, "test_goodput_at": 3, "test_best_max_num_seqs": 2,
               "test_choice_goodput": 1, "test_choice_client_ttft": 1, "test_choice_cancel": 1}
MANUAL_POINTS = {"written_overload": 4}
ANSWER_CELLS = {"token_times", "stream_metrics", "goodput_at", "sweep", "choice_goodput",
                "choice_client_ttft", "choice_cancel"}


@pytest.fixture(scope="module")
def source():
    return nbformat.read(SOURCE, as_version=4)


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
    assert "serve as _serve" in first.source and "throughput as _throughput" in first.source
    tests = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells if _is_test(c)}
    manual = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells
              if _meta(c).get("grade") and _meta(c).get("solution")}
    assert tests == TEST_POINTS and manual == MANUAL_POINTS
    answers = {_meta(c)["grade_id"] for c in source.cells
               if _meta(c).get("solution") and not _meta(c).get("grade")}
    assert answers == ANSWER_CELLS
    # Every autograded part has hidden checks beyond the visible ones; the letters of the
    # knowledge checks appear only there.
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in source.cells if _is_test(c))
    for cell in source.cells:
        if _is_test(cell) and _meta(cell)["grade_id"].startswith("test_choice"):
            visible = cell.source.split("### BEGIN HIDDEN TESTS")[0]
            assert "check_equal" not in visible, _meta(cell)["grade_id"]
    # The intro's table states the same totals, and the pinned cost model is the shipped fit
    # of the time (rounded): the exercise's numbers must not move when someone recalibrates.
    assert "(19 points)" in source.cells[0].source
    assert sum(tests.values()) == 15 and sum(manual.values()) == 4
    setup = next(c for c in source.cells if _meta(c).get("grade_id") == "setup")
    assert "COST = CostModel(step=7.7e-3, token=1.34e-5, row=5.2e-4, pair=1.37e-6)" in setup.source


PROBE = """
import json
m = stream_metrics(SEND_TIME, EVENTS)
print("PROBE " + json.dumps({"metrics": m, "best": BEST_MAX_NUM_SEQS, "sweep": SWEEP}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    nb = nbformat.from_dict(json.loads(json.dumps(source)))
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    _execute(nb, SOURCE_DIR, allow_errors=False)  # any failing check raises
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    got = json.loads(text.split("PROBE ", 1)[1])
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
    text = RELEASED.read_text()
    for marker in MARKERS:
        assert marker not in text
    nb = _with_source_tests(nbformat.read(RELEASED, as_version=4), source)
    _execute(nb, SOURCE_DIR, allow_errors=True)
    errors = {gid: out["ename"] for gid, out in _errors(nb).items()}
    # Functions left blank raise when a test calls them; blank variables raise in their own
    # cell, and then the test finds no answer. Either way every autograded cell fails.
    assert errors == {gid: ("NameError" if gid in ("test_best_max_num_seqs", "test_choice_goodput",
                                                   "test_choice_client_ttft", "test_choice_cancel")
                            else "NotImplementedError") for gid in TEST_POINTS}
    manual = [c for c in nb.cells if _meta(c).get("grade_id") in MANUAL_POINTS]
    assert [c.source.strip() for c in manual] == ["YOUR ANSWER HERE"]


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
    by_id = {_meta(c)["grade_id"]: c for c in source.cells if _meta(c)}
    nb = nbformat.v4.new_notebook()
    # Read-only cells and the answers, without the learner's plain cells (the sweep plot).
    nb.cells = [nbformat.v4.new_code_cell(c.source) for c in source.cells
                if c.cell_type == "code" and _meta(c) and not _is_test(c)]
    answers = [c.source for c in source.cells
               if c.cell_type == "code" and _meta(c).get("grade_id") in ANSWER_CELLS
               and _meta(c)["grade_id"] != "sweep"]
    wanted = []
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

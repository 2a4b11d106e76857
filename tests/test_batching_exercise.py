"""The batching exercises (chapter 3): a valid nbgrader source whose solution passes every
visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes (left padding, reading logits at a pad, refilling slots only when the batch
is empty, the useful fraction reported as waste...).

The notebook loads the shipped target model, so each kernel run takes a few seconds on 2
cores. Helpers come from the kv_cache_basics exercise's tests.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from test_grading_pipeline import needs_sandbox
from test_harbor_worksheet import MARKERS, _errors, _execute, _is_test, _meta
from test_kv_cache_basics import _copy, _with_source_tests

ROOT = Path(__file__).resolve().parents[1]
NAME = "batching"
SOURCE_DIR = ROOT / "solutions" / NAME
SOURCE = SOURCE_DIR / f"{NAME}.ipynb"
RELEASED = ROOT / "exercises" / NAME / f"{NAME}.ipynb"

TEST_POINTS = {"test_pad_ids": 2, "test_pad_model": 2, "test_step": 2, "test_step_run": 2,
               "test_static_waste": 2, "test_choice_join": 1, "test_choice_limit": 1}
MANUAL_POINTS = {"written_static_vs_continuous": 3}
ANSWER_CELLS = {"pad_batch", "step", "waste", "choice_join", "choice_limit"}


@pytest.fixture(scope="module")
def source():
    return nbformat.read(SOURCE, as_version=4)


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    first = next(c for c in source.cells if c.cell_type == "code")
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    assert "allclose as _allclose" in first.source
    tests = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells if _is_test(c)}
    manual = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells
              if _meta(c).get("grade") and _meta(c).get("solution")}
    assert tests == TEST_POINTS and manual == MANUAL_POINTS
    answers = {_meta(c)["grade_id"] for c in source.cells
               if _meta(c).get("solution") and not _meta(c).get("grade")}
    assert answers == ANSWER_CELLS
    for cell in source.cells:
        if _meta(cell).get("grade") and _meta(cell).get("solution"):
            assert "Rubric" not in cell.source, "the rubric sits above the answer"
    # Every autograded part has hidden checks beyond the visible ones; the right letters of
    # the knowledge checks appear in hidden tests only.
    for cell in source.cells:
        if _is_test(cell):
            assert "### BEGIN HIDDEN TESTS" in cell.source, _meta(cell)["grade_id"]
            if _meta(cell)["grade_id"].startswith("test_choice"):
                visible = cell.source.split("### BEGIN HIDDEN TESTS")[0]
                assert "check_equal" not in visible
    assert f"({sum(tests.values()) + sum(manual.values())} points)" in source.cells[0].source


PROBE = """
print("PROBE " + json.dumps({"waste": static_waste([6, 20, 10, 8], 4),
                             "run": run_all([6, 20, 10, 8], 2),
                             "last": pad_batch([[1, 2], [3]], 0)[2].tolist()}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    nb = _copy(source)
    nb.cells.append(nbformat.v4.new_code_cell("import json\n" + PROBE))
    _execute(nb, SOURCE_DIR, allow_errors=False)  # any failing check raises
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    got = json.loads(text.split("PROBE ", 1)[1])
    # 4 rows x 20 steps = 80 row-steps for 6 + 20 + 10 + 8 = 44 wanted tokens.
    assert got["waste"] == pytest.approx(36 / 80)
    # The same finish steps chapter 3's real engine printed for these requests and 2 slots.
    assert got["run"] == {"r0": 6, "r1": 20, "r2": 16, "r3": 24}
    assert got["last"] == [1, 0]


def test_chapter_engine_agrees_with_the_step_rule():
    """The exercise's step rule is the engine's: the same four requests, 2 slots, finish at
    the steps the solution's run_all gives (prefill produces the first token on joining)."""
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
    text = RELEASED.read_text()
    for marker in MARKERS:
        assert marker not in text
    nb = _with_source_tests(nbformat.read(RELEASED, as_version=4), source)
    _execute(nb, SOURCE_DIR, allow_errors=True)
    errors = {gid: out["ename"] for gid, out in _errors(nb).items()}
    assert errors == {gid: ("NameError" if gid.startswith("test_choice") else "NotImplementedError")
                      for gid in TEST_POINTS}
    manual = [c for c in nb.cells if _meta(c).get("grade_id") in MANUAL_POINTS]
    assert [c.source.strip() for c in manual] == ["YOUR ANSWER HERE"]


# ------------------------------------------------------------------ the classic mistakes, named

PAD = ("def pad_batch(prompts, pad_id):\n"
       "    T = max(len(p) for p in prompts)\n"
       "    ids = torch.tensor([{row} for p in prompts])\n"
       "    pos = torch.arange({start}, T + {start}).expand(len(prompts), T).clone()\n"
       "    return ids, pos, {last}")
RIGHT = "p + [pad_id] * (T - len(p))"
GOOD_LAST = "torch.tensor([len(p) - 1 for p in prompts])"
STEP = ("def continuous_step(running, waiting, limit):\n"
        "    free = limit - len(running)\n"
        "    after = {{r: n - {dec} for r, n in running.items()}}\n"
        "    done = [r for r, n in after.items() if n <= {end}]\n"
        "    keep = {{r: n for r, n in after.items() if n > {end}}}\n"
        "    queue = list(waiting)\n"
        "    admit = {gate}\n"
        "    while queue and {room} and admit:\n"
        "        r, n = queue.pop({at})\n"
        "        keep[r] = n\n"
        "        free -= 1\n"
        "    return keep, queue, done")
OK_STEP = dict(dec=1, end=0, room="len(keep) < limit", gate="True", at=0)
MUTATE = ("def continuous_step(running, waiting, limit):\n"
          "    done = []\n"
          "    for r in list(running):\n"
          "        running[r] -= 1\n"
          "        if running[r] == 0:\n"
          "            del running[r]\n"
          "            done.append(r)\n"
          "    while waiting and len(running) < limit:\n"
          "        r, n = waiting.pop(0)\n"
          "        running[r] = n\n"
          "    return running, waiting, done")
WASTE = ("def static_waste(lengths, size):\n"
         "    held = 0\n"
         "    for s in range(0, len(lengths), size):\n"
         "        batch = lengths[s:s + size]\n"
         "        held += {rows} * max({over})\n"
         "    return {ret}")

# (test cell, code a learner might write in its place, a fragment the failure must contain)
MISTAKES = [
    ("test_pad_ids", PAD.format(row="[pad_id] * (T - len(p)) + p", start=0,
                                last="torch.full((len(prompts),), T - 1)"), "left padding"),
    ("test_pad_model", PAD.format(row="[pad_id] * (T - len(p)) + p", start=0,
                                  last="torch.full((len(prompts),), T - 1)"),
     "differ from each prompt run alone"),
    ("test_pad_ids", PAD.format(row=RIGHT, start=0, last="torch.full((len(prompts),), T - 1)"),
     "column T - 1 is a pad"),
    ("test_pad_model", PAD.format(row=RIGHT, start=0, last="torch.full((len(prompts),), T - 1)"),
     "differ from each prompt run alone"),
    ("test_pad_ids", PAD.format(row=RIGHT, start=0, last="torch.tensor([len(p) for p in prompts])"),
     "off by one"),
    ("test_pad_ids", PAD.format(row=RIGHT, start=1, last=GOOD_LAST), "start at 0"),
    ("test_step", STEP.format(**dict(OK_STEP, room="free > 0")), "in the SAME step"),
    ("test_step", STEP.format(**dict(OK_STEP, at="")), "first come, first served"),
    ("test_step", STEP.format(**dict(OK_STEP, dec=0, end=1)), "did not produce its token"),
    ("test_step", STEP.format(**dict(OK_STEP, end=-1)), "no tokens left is still running"),
    ("test_step", MUTATE, "changed the running dict"),
    ("test_step_run", STEP.format(**dict(OK_STEP, gate="not keep")), "static batching"),
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
    by_id = {_meta(c)["grade_id"]: c for c in source.cells if _meta(c)}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.source) for c in source.cells
                if c.cell_type == "code" and not _is_test(c)]
    answers = [c.source for c in source.cells
               if c.cell_type == "code" and _meta(c).get("grade_id") in ANSWER_CELLS]
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
        for gid, points in TEST_POINTS.items():
            assert tests[gid]["points"] == (points if who == "solution" else 0), (who, gid, tests[gid])

"""The quantization exercises (chapter 6): a valid nbgrader source whose solution passes every
visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes (one scale per matrix, dividing by 128, truncating, a zero row dividing by
zero, scales applied per column, scales forgotten, KV scales forgotten).

Kernel runs take about 4-6 s each on 2 cores (torch, and the target's weights in Part 2).
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
NAME = "quantization"
SOURCE_DIR = ROOT / "solutions" / NAME
SOURCE = SOURCE_DIR / f"{NAME}.ipynb"
RELEASED = ROOT / "exercises" / NAME / f"{NAME}.ipynb"

TEST_POINTS = {"test_quantize_values": 2, "test_quantize_edges": 2, "test_dequantize": 2,
               "test_int8_linear": 2, "test_int8_linear_target": 1, "test_linear_bytes": 1,
               "test_kv_int8": 2, "test_choice_scale": 1, "test_choice_speed": 1}
MANUAL_POINTS = {"written_int8_claim": 3}
ANSWER_CELLS = {"quantizer", "int8_linear", "linear_bytes", "kv_int8", "choice_scale",
                "choice_speed"}
VARIABLE_TESTS = {"test_kv_int8", "test_choice_scale", "test_choice_speed"}


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
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    assert "allclose as _allclose" in first.source
    tests = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells if _is_test(c)}
    manual = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells
              if _meta(c).get("grade") and _meta(c).get("solution")}
    assert tests == TEST_POINTS and manual == MANUAL_POINTS
    answers = {_meta(c)["grade_id"] for c in source.cells
               if _meta(c).get("solution") and not _meta(c).get("grade")}
    assert answers == ANSWER_CELLS
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in source.cells if _is_test(c))
    # The knowledge checks' right answers live only in hidden tests.
    for gid, var in (("test_choice_scale", "ANSWER_SCALE"), ("test_choice_speed", "ANSWER_SPEED")):
        cell = next(c for c in source.cells if _meta(c).get("grade_id") == gid)
        visible = cell.source.split("### BEGIN HIDDEN TESTS")[0]
        assert "check_equal" not in visible and var in visible
    assert "(17 points)" in source.cells[0].source
    assert sum(tests.values()) == 14 and sum(manual.values()) == 3


PROBE = """
import json
_q, _s = quantize_per_channel(torch.tensor([[0.0, 0.0], [1.0, -0.5]]))
print("PROBE " + json.dumps({"kv": KV_INT8_BYTES_PER_TOKEN, "bytes": int8_linear_bytes(688, 256),
                             "q": _q.tolist(), "s": _s.tolist()}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    nb = _copy(source)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    _execute(nb, SOURCE_DIR, allow_errors=False)  # any failing check raises
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    got = json.loads(text.split("PROBE ", 1)[1])
    # 2 (K, V) x 6 layers x 2 KV heads x (32 int8 numbers + a 4-byte scale).
    assert got["kv"] == 864
    assert got["bytes"] == 688 * 256 + 4 * 688
    assert got["q"] == [[0, 0], [127, -64]] and got["s"] == pytest.approx([1.0, 1 / 127])


def test_the_library_quantizer_is_the_one_the_exercise_asks_for(source):
    """The exercise's solution and tinyserve.quant give the same int8 values and scales."""
    import torch

    from tinyserve.quant import dequantize_rows, quantize_rows
    scope: dict = {"torch": torch}
    cell = next(c for c in source.cells if _meta(c).get("grade_id") == "quantizer")
    exec(cell.source, scope)  # noqa: S102 - our own source notebook
    w = torch.randn(33, 17, generator=torch.Generator().manual_seed(0))
    w[3] = 0
    q, s = scope["quantize_per_channel"](w)
    q_lib, s_lib = quantize_rows(w)
    assert torch.equal(q, q_lib) and torch.equal(s, s_lib)
    assert torch.equal(scope["dequantize"](q, s), dequantize_rows(q_lib, s_lib))


# ------------------------------------------------------------------ the blank release

def test_blank_release_earns_nothing_and_leaks_nothing(source):
    text = RELEASED.read_text()
    for marker in MARKERS:
        assert marker not in text
    assert 'ANSWER_SCALE = "b"' not in text and 'ANSWER_SPEED = "c"' not in text
    nb = _with_source_tests(nbformat.read(RELEASED, as_version=4), source)
    _execute(nb, SOURCE_DIR, allow_errors=True)
    errors = {gid: out["ename"] for gid, out in _errors(nb).items()}
    assert errors == {gid: ("NameError" if gid in VARIABLE_TESTS else "NotImplementedError")
                      for gid in TEST_POINTS}
    raised = {_meta(c)["grade_id"] for c in nb.cells
              if _meta(c).get("grade_id") in ANSWER_CELLS
              and any(o.get("ename") == "NotImplementedError" for o in c.get("outputs", []))}
    assert raised == {"kv_int8", "choice_scale", "choice_speed"}
    manual = [c for c in nb.cells if _meta(c).get("grade_id") in MANUAL_POINTS]
    assert [c.source.strip() for c in manual] == ["YOUR ANSWER HERE"]


# ------------------------------------------------------------------ the classic mistakes, named

QUANT = ("def quantize_per_channel(w):\n"
         "    w = w.float()\n"
         "    amax = {amax}\n"
         "    scale = torch.where(amax > 0, amax / {div}, torch.ones_like(amax))\n"
         "    q = {rnd}(w / scale[:, None]).clamp(-127, 127).to(torch.int8)\n"
         "    return q, scale")
GOOD = dict(amax="w.abs().amax(dim=1)", div="127", rnd="torch.round")
DEQ = "def dequantize(q, scale):\n    return {expr}"

# (test cell, code a learner might write in its place, a fragment the failure must contain)
MISTAKES = [
    ("test_quantize_values",
     QUANT.format(**dict(GOOD, amax="w.abs().amax().expand(w.shape[0])")), "per-tensor"),
    ("test_quantize_values",
     "def quantize_per_channel(w):\n    s = w.abs().max() / 127\n"
     "    return torch.round(w / s).to(torch.int8), s", "needs its own"),
    ("test_quantize_values", QUANT.format(**dict(GOOD, div="128")), "divided by 128 or 255"),
    ("test_quantize_values", QUANT.format(**dict(GOOD, amax="w.amax(dim=1)")), "max(row)"),
    ("test_quantize_values", QUANT.format(**dict(GOOD, rnd="torch.trunc")), "torch.round"),
    ("test_quantize_values",
     QUANT.format(**GOOD).replace(".to(torch.int8)", ""), "torch.int8"),
    ("test_quantize_edges",
     "def quantize_per_channel(w):\n    w = w.float()\n    scale = w.abs().amax(dim=1) / 127\n"
     "    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)\n"
     "    return q, scale", "divides by zero"),
    ("test_quantize_edges",
     "def quantize_per_channel(w):\n    w = w.float()\n    amax = w.abs().amax(dim=1)\n"
     "    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))\n"
     "    q = torch.round(w / scale[:, None] - 0.5).clamp(-128, 127).to(torch.int8)\n"
     "    return q, scale", "never -128"),
    ("test_dequantize", DEQ.format(expr="q.float() * scale[None, :]"), "per column"),
    ("test_dequantize", DEQ.format(expr="q.float() / scale[:, None]"), "divided by the scale"),
    ("test_int8_linear", "def int8_linear(x, q, scale):\n    return x @ q.float().T",
     "scales are missing"),
    ("test_linear_bytes", "def int8_linear_bytes(o, i):\n    return o * i", "4 bytes of scale"),
    ("test_linear_bytes", "def int8_linear_bytes(o, i):\n    return 5 * o * i", "one scale per weight"),
    ("test_kv_int8",
     "KV_INT8_BYTES_PER_TOKEN = 2 * TARGET.num_hidden_layers * TARGET.num_key_value_heads * TARGET.head_dim",
     "4-byte scale"),
    ("test_kv_int8",
     "KV_INT8_BYTES_PER_TOKEN = 2 * TARGET.num_hidden_layers * TARGET.num_attention_heads * (TARGET.head_dim + 4)",
     "KV heads belong"),
    ("test_choice_scale", 'ANSWER_SCALE = "B"', "one lowercase letter"),
    ("test_choice_scale", 'ANSWER_SCALE = "d"', "loud row"),
    ("test_choice_speed", 'ANSWER_SPEED = "a"', "overheads"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel;
    the correct answers run first, so each mistake is the only thing wrong in its cell."""
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
        assert set(TEST_POINTS) <= set(tests)
        for gid, points in TEST_POINTS.items():
            assert tests[gid]["points"] == (points if who == "solution" else 0), (who, gid, tests[gid])

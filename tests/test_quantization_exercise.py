"""The quantization exercises (chapter 6): a valid nbgrader source whose solution passes every
visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes (one scale per matrix, dividing by 128, truncating, a zero row dividing by
zero, scales applied per column, scales forgotten, KV scales forgotten).

Kernel runs take about 4-6 s each on 2 cores (torch, and the target's weights in Part 2).
"""
from __future__ import annotations

import pytest

from exercise_checks import (check_manual_answers_blank, check_named_mistakes,
                             check_points_and_answers, check_rubrics_above_answers,
                             check_sandboxed_grading, exercise_paths, is_test, meta, needs_sandbox,
                             run_blank_release, run_probe, source_fixture)

NAME = "quantization"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

TEST_POINTS = {"test_quantize_values": 2, "test_quantize_edges": 2, "test_dequantize": 2,
               "test_int8_linear": 2, "test_int8_linear_target": 1, "test_linear_bytes": 1,
               "test_kv_int8": 2, "test_choice_scale": 1, "test_choice_speed": 1}
MANUAL_POINTS = {"written_int8_claim": 3}
ANSWER_CELLS = {"quantizer", "int8_linear", "linear_bytes", "kv_int8", "choice_scale",
                "choice_speed"}
VARIABLE_TESTS = {"test_kv_int8", "test_choice_scale", "test_choice_speed"}


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    check_rubrics_above_answers(source)
    first = next(c for c in source.cells if c.cell_type == "code")
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    assert "allclose as _allclose" in first.source
    tests, manual = check_points_and_answers(source, TEST_POINTS, MANUAL_POINTS, ANSWER_CELLS)
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in source.cells if is_test(c))
    # The knowledge checks' right answers live only in hidden tests.
    for gid, var in (("test_choice_scale", "ANSWER_SCALE"), ("test_choice_speed", "ANSWER_SPEED")):
        cell = next(c for c in source.cells if meta(c).get("grade_id") == gid)
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
    got = run_probe(source, SOURCE_DIR, PROBE)
    # 2 (K, V) x 6 layers x 2 KV heads x (32 int8 numbers + a 4-byte scale).
    assert got["kv"] == 864
    assert got["bytes"] == 688 * 256 + 4 * 688
    assert got["q"] == [[0, 0], [127, -64]] and got["s"] == pytest.approx([1.0, 1 / 127])


def test_the_library_quantizer_is_the_one_the_exercise_asks_for(source):
    """The exercise's solution and tinyserve.quant give the same int8 values and scales."""
    import torch

    from tinyserve.quant import dequantize_rows, quantize_rows
    scope: dict = {"torch": torch}
    cell = next(c for c in source.cells if meta(c).get("grade_id") == "quantizer")
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
    assert 'ANSWER_SCALE = "b"' not in text and 'ANSWER_SPEED = "c"' not in text
    nb, errors = run_blank_release(RELEASED, source, SOURCE_DIR)
    assert errors == {gid: ("NameError" if gid in VARIABLE_TESTS else "NotImplementedError")
                      for gid in TEST_POINTS}
    raised = {meta(c)["grade_id"] for c in nb.cells
              if meta(c).get("grade_id") in ANSWER_CELLS
              and any(o.get("ename") == "NotImplementedError" for o in c.get("outputs", []))}
    assert raised == {"kv_int8", "choice_scale", "choice_speed"}
    check_manual_answers_blank(nb, MANUAL_POINTS)


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
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES)


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, MANUAL_POINTS, tmp_path)

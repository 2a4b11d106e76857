"""The KV cache basics exercises (chapters 0-2): a valid nbgrader source whose solution passes
every visible and hidden test, a blank release that earns nothing, and messages that name the
classic mistakes.

Kernel runs take about 4 s each on 2 cores (torch and the target's config load in the first
cells). The checks every graded exercise shares live in exercise_checks.
"""
from __future__ import annotations

import pytest

from exercise_checks import (check_manual_answers_blank, check_named_mistakes,
                             check_points_and_answers, check_rubrics_above_answers,
                             check_sandboxed_grading, exercise_paths, is_test, meta, needs_sandbox,
                             run_blank_release, run_probe, source_fixture)

NAME = "kv_cache_basics"
SOURCE_DIR, SOURCE, RELEASED = exercise_paths(NAME)
source = source_fixture(SOURCE)

TEST_POINTS = {"test_kv_bytes": 2, "test_target_kv": 2, "test_ttft": 1, "test_itl": 2,
               "test_tpot": 2, "test_attend_mha": 3, "test_attend_gqa": 2,
               "test_choice_ttft": 1, "test_choice_decode": 1}
MANUAL_POINTS = {"written_double_context": 3, "written_throughput_latency": 3}
ANSWER_CELLS = {"kv_bytes", "target_kv", "latency", "attend", "choice_ttft", "choice_decode"}


# ------------------------------------------------------------------ the source notebook

def test_source_assignment_specifics(source):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    check_rubrics_above_answers(source)
    first = next(c for c in source.cells if c.cell_type == "code")
    assert meta(first)["locked"] and not meta(first)["grade"]
    assert "from autograder.testkit import check, check_close, check_equal" in first.source
    assert "allclose as _allclose" in first.source
    tests, manual = check_points_and_answers(source, TEST_POINTS, MANUAL_POINTS, ANSWER_CELLS)
    # Every autograded part has hidden checks beyond the visible ones.
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in source.cells
               if is_test(c) and meta(c)["grade_id"] != "test_target_kv")
    # The intro's table states the same totals.
    assert "(22 points)" in source.cells[0].source
    assert sum(tests.values()) == 16 and sum(manual.values()) == 6


def test_notebook_reads_the_shipped_target_config():
    """The notebook reads config.json alone (the sandbox need not read the weights); it must be
    the config load_model gives."""
    import tinyserve
    from tinyserve.checkpoint import model_dir
    cfg = tinyserve.ModelConfig.load(model_dir("target") / "config.json")
    assert cfg == tinyserve.load_model("target", device="cpu").config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads,
            cfg.head_dim, cfg.max_position_embeddings) == (6, 2, 8, 32, 512)


PROBE = """
print("PROBE " + json.dumps({"target": TARGET_KV_BYTES, "ttft": ttft(ARRIVAL, TOKEN_TIMES),
                             "tpot": tpot(ARRIVAL, TOKEN_TIMES),
                             "itl": inter_token_latencies(TOKEN_TIMES)}))
"""


def test_solution_passes_every_visible_and_hidden_test(source):
    got = run_probe(source, SOURCE_DIR, "import json\n" + PROBE)
    # 2 x 6 layers x 512 tokens x 2 KV heads x 32 x 4 bytes: the shipped target, full window.
    assert got["target"] == 1_572_864
    assert got["ttft"] == pytest.approx(0.35) and got["tpot"] == pytest.approx(0.066)
    assert got["itl"] == pytest.approx([0.05, 0.06, 0.05, 0.12, 0.05])


# ------------------------------------------------------------------ the blank release

def test_blank_release_earns_nothing_and_leaks_nothing(source):
    nb, errors = run_blank_release(RELEASED, source, SOURCE_DIR)
    # Functions left blank raise when a test calls them; blank variables raise in their own
    # cell, and then the test finds no answer. Either way every autograded cell fails.
    assert errors == {gid: ("NameError" if gid in ("test_target_kv", "test_choice_ttft",
                                                   "test_choice_decode")
                            else "NotImplementedError") for gid in TEST_POINTS}
    raised = {meta(c)["grade_id"] for c in nb.cells
              if meta(c).get("grade_id") in ANSWER_CELLS
              and any(o.get("ename") == "NotImplementedError" for o in c.get("outputs", []))}
    assert raised == {"target_kv", "choice_ttft", "choice_decode"}
    check_manual_answers_blank(nb, MANUAL_POINTS)


# ------------------------------------------------------------------ the classic mistakes, named

ATTEND = ("def attend_one(q, k, v):\n"
          "    g = q.shape[0] // k.shape[0]\n"
          "    k, v = k.{rep}(g, {args}), v.{rep}(g, {args})\n"
          "    s = (k @ q.unsqueeze(-1)).squeeze(-1){scale}\n"
          "    return (torch.softmax(s, dim=-1).unsqueeze(1) @ v).squeeze(1)")
GOOD = dict(rep="repeat_interleave", args="dim=0", scale=" / math.sqrt(q.shape[-1])")

# (test cell, code a learner might write in its place, a fragment the failure must contain)
MISTAKES = [
    ("test_kv_bytes", "def kv_bytes(l, t, h, d, b):\n    return l * t * h * d * b", "factor 2"),
    ("test_kv_bytes", "def kv_bytes(l, t, h, d, b):\n    return 2 * l * t * h * d * b * 8", "bits"),
    ("test_target_kv",
     "TARGET_KV_BYTES = kv_bytes(TARGET.num_hidden_layers, TARGET.max_position_embeddings,\n"
     "                           TARGET.num_attention_heads, TARGET.head_dim, FP32_BYTES)",
     "query heads"),
    ("test_target_kv",
     "TARGET_KV_BYTES = kv_bytes(TARGET.num_hidden_layers, TARGET.max_position_embeddings,\n"
     "                           TARGET.num_key_value_heads, TARGET.head_dim, 2)",
     "fp32, 4 bytes"),
    ("test_ttft", "def ttft(a, t):\n    return t[0]", "subtract the arrival"),
    ("test_itl", "def inter_token_latencies(t):\n    return [0.35] + [b - a for a, b in zip(t, t[1:])]",
     "TTFT, not an ITL"),
    ("test_tpot", "def tpot(a, t):\n    return (t[-1] - t[0]) / len(t)", "n - 1 = 5"),
    ("test_tpot", "def tpot(a, t):\n    return (t[-1] - a) / len(t)", "E2E / n"),
    ("test_attend_mha", ATTEND.format(**dict(GOOD, scale="")), "WITHOUT the scale"),
    ("test_attend_mha",
     "def attend_one(q, k, v):\n"
     "    s = (k[:, :-1] @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(q.shape[-1])\n"
     "    return (torch.softmax(s, dim=-1).unsqueeze(1) @ v[:, :-1]).squeeze(1)",
     "attend to itself"),
    ("test_attend_gqa", ATTEND.format(**dict(GOOD, rep="repeat", args="1, 1")), "h // group"),
    ("test_attend_gqa",
     "def attend_one(q, k, v):\n"
     "    s = (k @ q[:k.shape[0]].unsqueeze(-1)).squeeze(-1) / math.sqrt(q.shape[-1])\n"
     "    return (torch.softmax(s, dim=-1).unsqueeze(1) @ v).squeeze(1)",
     "one output per QUERY head"),
    ("test_choice_ttft", 'ANSWER_TTFT = "B"', "one lowercase letter"),
    ("test_choice_ttft", 'ANSWER_TTFT = "a"', "only the work before it counts"),
    ("test_choice_decode", 'ANSWER_DECODE = "b"', "one step at a time"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel;
    the correct solution runs first, so each mistake is the only thing wrong in its cell."""
    check_named_mistakes(source, SOURCE_DIR, ANSWER_CELLS, MISTAKES)


# ------------------------------------------------------------------ end to end, sandboxed

@needs_sandbox
def test_sandboxed_grading_gives_full_marks_and_zero(source, tmp_path):
    check_sandboxed_grading(NAME, SOURCE_DIR, TEST_POINTS, MANUAL_POINTS, tmp_path)

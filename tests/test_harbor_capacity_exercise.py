"""The Harbor capacity worksheet: a valid nbgrader source, correct numbers, named mistakes.

Three notebook runs (about 2 s each on 2 cores): the source with its hidden tests, the release
form left blank, and the typical wrong submission with the hidden tests merged back in the way
nbgrader's autograde restores test cells (by grade_id).
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

# The notebook helpers live in exercise_checks (test_speculative_decoding_exercise still imports them
# from here under these names).
from exercise_checks import MARKERS
from exercise_checks import errors as _errors, execute as _execute
from exercise_checks import is_test as _is_test, meta as _meta

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIR = ROOT / "solutions" / "harbor_capacity"
SOURCE = SOURCE_DIR / "harbor_capacity.ipynb"
FIXTURES = ROOT / "tests" / "fixtures" / "harbor"
TICKETS = ROOT / "harbor_project" / "fixtures" / "tickets.jsonl"
TICKET_FIELDS = {"id": str, "workspace": str, "category": str, "prompt_tokens": int,
                 "output_tokens": int, "subject": str}


def _release(nb):
    """The learner's copy, made with nbgrader's own preprocessors (as `release` does)."""
    from nbgrader.preprocessors import (CheckCellMetadata, ClearHiddenTests, ClearOutput,
                                        ClearSolutions, ComputeChecksums, LockCells)
    resources: dict = {}
    for pp in (LockCells, ClearSolutions, ClearOutput, CheckCellMetadata, ComputeChecksums,
               ClearHiddenTests, ComputeChecksums, CheckCellMetadata):
        nb, resources = pp().preprocess(nb, resources)
    return nb


@pytest.fixture(scope="module")
def source():
    return nbformat.read(SOURCE, as_version=4)


@pytest.fixture(scope="module")
def expected():
    return json.loads((FIXTURES / "expected.json").read_text())


# ------------------------------------------------------------------ the source notebook

def test_source_points_match_the_pipeline_fixture(source, expected):
    # The general nbgrader rules are checked for every assignment in test_solutions_valid.py.
    tests = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells if _is_test(c)}
    manual = {_meta(c)["grade_id"]: _meta(c)["points"] for c in source.cells
              if _meta(c).get("grade") and _meta(c).get("solution")}
    assert tests == expected["test_cells"] and manual == expected["manual_cells"]
    assert sum(tests.values()) == expected["autograded_max"] == 27
    assert sum(manual.values()) == expected["manual_max"] == 10


# Appended to the executed source: the numbers the seed's sample artifact and brief state.
PROBE = """
print("PROBE " + json.dumps({
    "worked": WORKED_EXAMPLE_BYTES,
    "gb": bytes_to_gb(WORKED_EXAMPLE_BYTES), "gib": bytes_to_gib(WORKED_EXAMPLE_BYTES),
    "table": {str(c): [bytes_to_gib(kv_bytes_for(c, n)) for n in (1, 16)] for c in (4096, 8192, 16384)},
    "demand": phase_demand(20, 1500, 200),
    "ratios": [DOUBLE_CONTEXT_RATIO, TWO_KV_HEADS_RATIO],
    "long_16k_gib": bytes_to_gib(kv_bytes_for(16384, 1)),
}))
"""


def test_solution_runs_clean_and_matches_the_sample_artifact(source):
    nb = nbformat.from_dict(json.loads(json.dumps(source)))  # a copy
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    _execute(nb, SOURCE_DIR, allow_errors=False)  # any failing visible or hidden test raises
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    got = json.loads(text.split("PROBE ", 1)[1])
    assert got["worked"] == 1_073_741_824
    assert got["gib"] == 1.0 and got["gb"] == pytest.approx(1.0737, abs=1e-4)
    assert got["table"] == {"4096": [0.5, 8.0], "8192": [1.0, 16.0], "16384": [2.0, 32.0]}
    assert got["demand"]["prefill_tokens_per_s"] == pytest.approx(500.0)
    assert got["demand"]["decode_tokens_per_s"] == pytest.approx(66.7, abs=0.05)
    assert got["ratios"] == [2.0, 0.25]
    assert got["long_16k_gib"] == 2.0


def test_blank_release_fails_every_test_cell_and_leaks_nothing(source, tmp_path):
    nb = _release(nbformat.from_dict(json.loads(json.dumps(source))))
    text = nbformat.writes(nb)
    for marker in MARKERS:
        assert marker not in text
    shutil.copy(SOURCE_DIR / "tickets.jsonl", tmp_path)
    _execute(nb, tmp_path, allow_errors=True)
    n_tests = sum(1 for c in nb.cells if _is_test(c))
    assert set(_errors(nb)) == {_meta(c)["grade_id"] for c in nb.cells if _is_test(c)}
    assert n_tests == 15


# ------------------------------------------------------------------ fixtures

def test_ticket_fixtures_parse_with_documented_fields():
    rows = [json.loads(line) for line in TICKETS.read_text().splitlines()]
    assert len(rows) == 200
    readme = (TICKETS.parent / "README.md").read_text()
    for name in TICKET_FIELDS:
        assert f"`{name}`" in readme, f"README documents {name}"
    for row in rows:
        assert set(row) == set(TICKET_FIELDS)
        for name, kind in TICKET_FIELDS.items():
            assert type(row[name]) is kind, (row["id"], name)
        assert row["prompt_tokens"] > 0 and row["output_tokens"] > 0
    assert len({r["id"] for r in rows}) == 200
    long = [r for r in rows if r["prompt_tokens"] > 15_000]
    assert 3 <= len(long) <= 8, "a few long tickets, no more"
    mean_prompt = sum(r["prompt_tokens"] for r in rows) / len(rows)
    mean_output = sum(r["output_tokens"] for r in rows) / len(rows)
    assert 1_400 < mean_prompt < 1_600 and 180 < mean_output < 220, "near the brief's 1,500 / 200"
    # The notebook's copy is the same file, and the generator reproduces it.
    assert (SOURCE_DIR / "tickets.jsonl").read_bytes() == TICKETS.read_bytes()
    sys.path.insert(0, str(ROOT / "harbor_project" / "tools"))
    try:
        import make_tickets
    finally:
        sys.path.pop(0)
    import random
    assert make_tickets.render(make_tickets.make_tickets(random.Random(make_tickets.SEED))) \
        == TICKETS.read_text()


# ------------------------------------------------------------------ the typical wrong submission

def test_typical_wrong_fails_exactly_the_expected_cells(source, expected, tmp_path):
    nb = nbformat.read(FIXTURES / "typical_wrong.ipynb", as_version=4)
    text = nbformat.writes(nb)
    for marker in MARKERS:
        assert marker not in text, "the fixture is a release-form submission"
    # Restore the test cells from the source, hidden tests included, as autograde does.
    source_tests = {_meta(c)["grade_id"]: c.source for c in source.cells if _is_test(c)}
    for cell in nb.cells:
        if _is_test(cell):
            cell.source = source_tests[_meta(cell)["grade_id"]]
    shutil.copy(SOURCE_DIR / "tickets.jsonl", tmp_path)
    _execute(nb, tmp_path, allow_errors=True)

    errors = _errors(nb)
    want = expected["submissions"]["typical_wrong"]
    score = 0
    for gid, outcome in want["tests"].items():
        if outcome["passes"]:
            assert gid not in errors, f"{gid} should pass: {errors.get(gid, {}).get('evalue')}"
            score += expected["test_cells"][gid]
        else:
            assert gid in errors, f"{gid} should fail"
            assert errors[gid]["ename"] == outcome["error"]
            for fragment in outcome["message_contains"]:
                assert fragment in errors[gid]["evalue"], (gid, errors[gid]["evalue"])
    assert score == want["autograded_score"] == 20


# ------------------------------------------------------------------ the classic mistakes, named

# (test cell, code a learner might write in its place, a fragment the failure must contain)
MISTAKES = [
    ("test_kv_formula", "def kv_bytes_per_sequence(l, t, h, d, b):\n    return l * t * h * d * b",
     "factor 2"),
    ("test_kv_formula", "def kv_bytes_per_sequence(l, t, h, d, b):\n    return 2 * l * t * h * d * b * 8",
     "bits"),
    ("test_worked_example", "WORKED_EXAMPLE_BYTES = 2 * 32 * 8192 * 4096 * 2", "hidden width"),
    ("test_units", "def bytes_to_gib(n):\n    return n / 10**9", "GB and GiB mixed up"),
    ("test_units", "def bytes_to_gib(n):\n    return n / 2**30\ndef bytes_to_gb(n):\n    return n / 2**30",
     "GB and GiB mixed up"),
    ("test_kv_worksheet",
     "def kv_bytes_for(c, n, model, b=2):\n"
     "    return 2 * n * model['num_hidden_layers'] * c * model['num_attention_heads'] * model['head_dim'] * b",
     "query heads"),
    ("test_kv_worksheet",
     "def kv_bytes_for(c, n, model, b=2):\n"
     "    return 2 * n * model['num_hidden_layers'] * c * model['hidden_size'] * b",
     "hidden width"),
    ("test_phase_demand",
     "def phase_demand(r, i, o):\n    return {'prefill_tokens_per_s': r * i, 'decode_tokens_per_s': r * o}",
     "per minute"),
    ("test_admit_boundaries",
     "def admit(q, s, b):\n"
     "    need = q['prompt_tokens'] * b['kv_bytes_per_token']\n"
     "    if q['prompt_tokens'] + q['max_output_tokens'] > b['max_context_tokens']:\n"
     "        return 'reject'\n"
     "    return 'queue' if s['reserved_bytes'] + need > b['kv_bytes'] else 'admit'",
     "must include max_output_tokens"),
    ("test_admit_boundaries",
     "def admit(q, s, b):\n"
     "    t = q['prompt_tokens'] + q['max_output_tokens']\n"
     "    if t > b['max_context_tokens']:\n"
     "        return 'reject'\n"
     "    return 'queue' if s['reserved_bytes'] + t * b['kv_bytes_per_token'] > b['kv_bytes'] else 'admit'",
     "wait forever"),
    # round() passes every case whose fraction is below one half; the hidden 5,000-token
    # case (78.9 sequences) is there to catch it.
    ("test_max_concurrency",
     "def kv_bytes_for(c, n, m, b=2):\n"
     "    return 2 * n * m['num_hidden_layers'] * c * m['num_key_value_heads'] * m['head_dim'] * b\n"
     "KV_BUDGET_BYTES = 51_705_032_704\n"
     "def max_concurrency(c, m):\n"
     "    return round(KV_BUDGET_BYTES / kv_bytes_for(c, 1, m))",
     "rounded to the nearest"),
]


def test_classic_mistakes_get_messages_that_name_them(source):
    """Each wrong answer runs against the real test cell (hidden tests included) in one kernel."""
    by_id = {_meta(c)["grade_id"]: c for c in source.cells if _meta(c)}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(by_id[g].source) for g in ("imports", "model_config")]
    wanted = []
    for test_id, wrong, fragment in MISTAKES:
        nb.cells.append(nbformat.v4.new_code_cell(wrong))
        test_cell = nbformat.v4.new_code_cell(by_id[test_id].source)
        test_cell.metadata = {"nbgrader": dict(_meta(by_id[test_id]),
                                               grade_id=f"{test_id}_{len(wanted)}")}
        nb.cells.append(test_cell)
        wanted.append((f"{test_id}_{len(wanted)}", fragment))
    _execute(nb, SOURCE_DIR, allow_errors=True)
    errors = _errors(nb)
    for cell_id, fragment in wanted:
        assert cell_id in errors, f"{cell_id}: the wrong answer passed"
        assert fragment in errors[cell_id]["evalue"], (cell_id, errors[cell_id]["evalue"])


# ------------------------------------------------ issue 38, finding 25: what the prose gives

def _checked_values(nb) -> set:
    """The answers the test cells (hidden ones included) compare with: each check_close or
    check_equal's second argument that is a literal number (whole-number floats aside: those
    are the brief's inputs and plain ratios the text teaches, 2.0 or 500.0)."""
    import ast
    wants = set()
    for cell in nb.cells:
        if not _is_test(cell):
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
                    "check_close", "check_equal") and len(node.args) >= 2:
                try:
                    value = ast.literal_eval(node.args[1])
                except ValueError:
                    continue
                if isinstance(value, int) and not isinstance(value, bool) and value >= 20:
                    wants.add(value)
                elif isinstance(value, float) and not value.is_integer():
                    wants.add(value)
    return wants


def _renderings(value) -> set[str]:
    if isinstance(value, float):
        return {f"{value:.2f}", f"{value:.1f}"}
    forms = {f"{value:,}", str(value)}
    if value >= 2**27:                               # a byte count, as the prose would say it
        forms |= {f"{value / 2**30:.2f} GiB", f"{value / 1e9:.2f} GB"}
    return forms


# Checked values the learner is told on purpose: the fixture's size, where it is introduced.
GIVEN = {200}


def test_the_prose_names_what_the_tests_read_and_gives_no_answer(source):
    # The committed release (tests/test_autograder_release.py keeps it equal to a fresh one):
    # the learner's text, mark schemes cut.
    released = nbformat.read(ROOT / "exercises" / "harbor_capacity" / SOURCE.name, as_version=4)
    markdown = "\n".join(c.source for c in released.cells if c.cell_type == "markdown")
    given = sorted({form for value in _checked_values(source) - GIVEN
                    for form in _renderings(value)
                    if re.search(rf"(?<![\d.,]){re.escape(form)}(?![\d])", markdown)})
    assert not given, f"the learner's prose states answers the tests check: {given}"
    # 4a's tests read five names its template never binds: the task names each of them.
    by_id = {c.get("id"): c for c in released.cells}
    task = by_id["part4-intro"].source
    tested = set(re.findall(r"check_close\((\w+),", by_id["test-device-constants"].source))
    assert tested and all(f"`{name}`" in task for name in tested), (tested, task[-400:])

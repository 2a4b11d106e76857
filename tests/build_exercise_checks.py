"""What the build track's exercise tests add to exercise_checks: named mistakes where some
wrong answers must be *passed* by a later part's test cell (a later part is judged on its own,
not on the learner's earlier parts), in the same single run as the mistakes that must fail;
and every piece broken in turn (raising, NaN, the wrong shape, dtype, type or length), each
graded as a whole submission, so one slip costs one piece (issue 26)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest

import exercise_checks
from exercise_checks import ROOT, check_points_and_answers, errors, is_test, meta

_PASSED = "<the test cell passed>"

# Each build exercise's graded test cells and their points (checked against the source
# notebook by check_points_and_answers), one table for every test that grades them.
MODEL_POINTS = {"test_rms_norm": 3, "test_rope_tables": 2, "test_apply_rotary": 3,
                "test_attention_causal": 4, "test_attention_gqa": 3, "test_swiglu": 2,
                "test_decoder_block": 4, "test_forward": 4, "test_generate": 3}
KV_POINTS = {"test_cache_bytes": 2, "test_cache_alloc": 2, "test_cache_write": 3,
             "test_forward_cached": 5, "test_prefill": 2, "test_decode_step": 3,
             "test_generate_cached": 3}
BATCH_POINTS = {"test_pad_left": 3, "test_padded_mask": 3, "test_generate_static": 4,
                "test_prefill_slot": 2, "test_decode_slots": 3, "test_serve": 5}
SPEC_POINTS = {"test_draft": 2, "test_accept_greedy": 2, "test_speculative_greedy": 4,
               "test_accept_sampled": 4}
#: build_model's decoder_block written right, as a learner would (tests derive slips from it).
RIGHT_BLOCK = ("def decoder_block(x, positions, w, cfg):\n"
               "    T, H, K, d = x.shape[0], cfg['num_attention_heads'], cfg['num_key_value_heads'], cfg['head_dim']\n"
               "    n = rms_norm(x, w['input_layernorm.weight'], cfg['rms_norm_eps'])\n"
               "    q = (n @ w['self_attn.q_proj.weight'].T).view(T, H, d).transpose(0, 1)\n"
               "    k = (n @ w['self_attn.k_proj.weight'].T).view(T, K, d).transpose(0, 1)\n"
               "    v = (n @ w['self_attn.v_proj.weight'].T).view(T, K, d).transpose(0, 1)\n"
               "    cos, sin = rope_tables(positions, d, cfg['rope_theta'])\n"
               "    a = attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, positions, positions)\n"
               "    h = x + a.transpose(0, 1).reshape(T, H * d) @ w['self_attn.o_proj.weight'].T\n"
               "    n = rms_norm(h, w['post_attention_layernorm.weight'], cfg['rms_norm_eps'])\n"
               "    return h + swiglu_mlp(n, w['mlp.gate_proj.weight'], w['mlp.up_proj.weight'], w['mlp.down_proj.weight'])")


def check_named_mistakes(source, source_dir: Path, answer_cells: set[str],
                         mistakes: Sequence[tuple], **options) -> None:
    """exercise_checks.check_named_mistakes, where a fragment of None means: with this wrong
    answer (an earlier part's) the test cell passes, it keeps its points. One run for all."""
    # exercise_checks names the test cell of mistake i "{grade_id}_{i}".
    must_pass = {f"{m[0]}_{i}" for i, m in enumerate(mistakes) if m[2] is None}
    cases = [(m[0], m[1], _PASSED) if m[2] is None else m for m in mistakes]
    errors = exercise_checks.errors

    def errors_or_passed(nb) -> dict[str, dict]:
        found = errors(nb)
        lost = {cell: found[cell].get("evalue", "")[:300] for cell in sorted(must_pass) if cell in found}
        assert not lost, f"a later part lost points for an earlier part's mistake: {lost}"
        return found | {cell: {"ename": "AssertionError", "evalue": _PASSED} for cell in must_pass}
    exercise_checks.errors = errors_or_passed
    try:
        exercise_checks.check_named_mistakes(source, source_dir, answer_cells, cases, **options)
    finally:
        exercise_checks.errors = errors


def visible_only(source):
    """A copy of ``source`` whose test cells keep their visible checks only (the hidden ones
    removed as a release removes them): what Validate and a test cell run by the learner see."""
    import re
    nb = exercise_checks.copy_notebook(source)
    for cell in nb.cells:
        if is_test(cell):
            cell.source = re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS\n?", "", cell.source,
                                 flags=re.S)
    return nb


@pytest.fixture(autouse=True)
def one_thread_kernels(monkeypatch):
    """Imported by each build test module: the kernels its tests start run one torch thread,
    as the grading sandbox does (two per kernel oversubscribe a shared 2-core machine)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def check_build_source(source, source_dir: Path, test_points: dict[str, int],
                       answer_cells: set[str], total: int) -> None:
    """What every build notebook's source holds: the checks imported read-only in the first
    code cell (one shared copy, none beside the notebook), the points and answer cells, hidden
    tests in every test cell, the total in the intro, and a device picked by the template."""
    first = next(c for c in source.cells if c.cell_type == "code")
    assert meta(first)["locked"] and not meta(first)["grade"]
    assert "import autograder.build_checks as _build_checks" in first.source
    released = ROOT / "exercises" / source_dir.name
    assert not list(source_dir.glob("*.py")) and not list(released.glob("*.py"))
    tests, _ = check_points_and_answers(source, test_points, {}, answer_cells)
    assert all("### BEGIN HIDDEN TESTS" in c.source for c in source.cells if is_test(c))
    assert f"({total} points)" in source.cells[0].source and sum(tests.values()) == total
    text = "\n".join(c.source for c in source.cells)
    assert "tinyserve.default_device()" in text and ".cuda()" not in text


# ------------------------------------------------------------------ one slip costs one piece

NAN = "torch.full_like(out, float('nan'))"


def raises(piece: str) -> str:
    """A learner's ``piece`` that raises (unfinished, or a shape error inside it)."""
    return f"def {piece}(*args, **kwargs):\n    raise RuntimeError('{piece} is not finished')"


def returns(piece: str, result: str) -> str:
    """A learner's ``piece`` that does the solution's work, side effects included, and returns
    ``result``, an expression of ``out`` (the solution's result): NaN, the wrong shape, dtype,
    type or length. Only what it returns is wrong."""
    return (f"_solution_{piece} = {piece}\n"
            f"def {piece}(*args, **kwargs):\n"
            f"    out = _solution_{piece}(*args, **kwargs)\n"
            f"    return {result}")


def slips_of(pieces: Sequence[tuple[str, set[str], dict[str, str]]]) -> list[tuple]:
    """The slips of ``pieces``, (piece, the test cells it must fail, {how: what it returns}):
    each piece raising, then returning each wrong result, as check_one_slip_costs_one_piece
    takes them."""
    return [(piece, how, code, failing) for piece, failing, results in pieces
            for how, code in (("raises", raises(piece)),
                              *((how, returns(piece, result)) for how, result in results.items()))]


def _answer_index(source, answer_cells: set[str], piece: str) -> int:
    """Index in ``source`` of the answer cell that defines ``piece``."""
    for i, cell in enumerate(source.cells):
        if meta(cell).get("grade_id") in answer_cells and (
                f"def {piece}(" in cell.source or f"class {piece}" in cell.source):
            return i
    raise ValueError(f"no answer cell defines {piece}")


def check_one_slip_costs_one_piece(source, source_dir: Path, test_points: dict[str, int],
                                   answer_cells: set[str], slips: Sequence[tuple],
                                   mode: str = "graded") -> dict[tuple[str, str], int]:
    """Grade each slip, (piece, how it is broken, wrong code, the test cells it must fail), as
    a submission: the solution's answers with the wrong code after them, then every test cell
    below the piece's answer cell (the ones above it ran before the piece existed). Only the
    piece's own test cells may fail: every later one keeps its points (judged on the reference
    in place of the broken piece where it calls it). Returns {(piece, how): points lost}.

    One kernel for all: the solution's graded non-test cells run once, then per slip every
    answer cell again (so each slip is the only thing wrong), the wrong code and the test
    cells, renamed ``{grade_id}__{slip number}``. ``mode``: "graded" runs it as grading does
    (exercise_checks.execute_trusted, hidden tests included), "validate" as the learner's
    Validate does (the visible tests, in the kernel)."""
    import nbformat

    from exercise_checks import execute, execute_trusted
    if mode not in ("graded", "validate"):
        raise ValueError(f"mode {mode!r}: expected 'graded' or 'validate'")
    trusted = mode == "graded"
    source = source if trusted else visible_only(source)

    def read_only(c) -> bool:
        return trusted and meta(c).get("locked") and not meta(c).get("solution")
    code = [c for c in source.cells if c.cell_type == "code" and meta(c)]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.source, metadata=c.metadata if read_only(c) else {})
                for c in code if not is_test(c)]
    answers = [c.source for c in code if meta(c).get("grade_id") in answer_cells]
    ran: list[list[str]] = []
    for n, (piece, _, wrong, _) in enumerate(slips):
        nb.cells.extend(nbformat.v4.new_code_cell(text) for text in (*answers, wrong))
        below = source.cells[_answer_index(source, answer_cells, piece):]
        ran.append([meta(c)["grade_id"] for c in below if is_test(c)])
        for cell in (c for c in below if is_test(c)):
            test = nbformat.v4.new_code_cell(cell.source)
            test.metadata = {"nbgrader": dict(meta(cell), grade_id=f"{meta(cell)['grade_id']}__{n}")}
            nb.cells.append(test)
    execute_trusted(nb, source_dir) if trusted else execute(nb, source_dir, allow_errors=True)
    found = errors(nb)
    lost, wrong_verdicts = {}, []
    for n, (piece, how, _, failing) in enumerate(slips):
        failed = {gid for gid in ran[n] if f"{gid}__{n}" in found}
        lost[(piece, how)] = sum(test_points[gid] for gid in failed)
        if failed != set(failing):
            wrong_verdicts.append((piece, how, {
                gid: (found[f"{gid}__{n}"]["evalue"][:300] if gid in failed else "passed")
                for gid in failed ^ set(failing)}))
    assert not wrong_verdicts, f"a slip cost other pieces, or not its own: {wrong_verdicts}"
    return lost

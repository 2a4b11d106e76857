"""What a learner reads as failure stays out of a chapter's output (issue 51): the profiler's
native log lines, held answers that point only at a widget, and the roofline lab's answer
drawn before the guess."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tinyserve.config import ModelConfig
from tinyserve.workbook.predict import Prediction
from tinyserve.workbook.roofline_lab import RooflineCase, RooflineLab

ROOT = Path(__file__).resolve().parents[1]
COURSE = ROOT / "course"

PROFILED = """
import os, torch
from torch.profiler import ProfilerActivity, profile
from tinyserve.workbook.roofline_lab import quiet_profiler
QUIET
    torch.ones(3) + 1
    os.write(2, b"a native line of its own\\n")
    os.write(2, b"USDT: a line shaped like the profiler's own\\n")
print("done")
"""


@pytest.mark.parametrize("quiet", [True, False])
def test_the_profilers_native_lines_are_dropped_and_nothing_else(quiet: bool) -> None:
    opening = ("with quiet_profiler(), profile(activities=[ProfilerActivity.CPU]):" if quiet
               else "with profile(activities=[ProfilerActivity.CPU]):")
    done = subprocess.run([sys.executable, "-c", PROFILED.replace("QUIET", opening)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    assert "a native line of its own" in done.stderr
    # A USDT-shaped line is written inside the block either way, so the filter is tested on a
    # torch whose profiler logs none of its own.
    if quiet:
        assert "USDT" not in done.stderr and "profiler_st" not in done.stderr
    else:
        assert "USDT: a line shaped like the profiler's own" in done.stderr


def test_every_chapter_that_profiles_keeps_the_profiler_quiet() -> None:
    for path in sorted(COURSE.glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and "with profile(" in source.replace("quiet_profiler(), ", ""):
                assert "quiet_profiler(), profile(" in source, f"{path.name}: {source[:200]}"


def test_a_held_answer_says_how_to_commit_without_widgets(capsys: pytest.CaptureFixture) -> None:
    import __main__
    guess = Prediction("How many?", "ms")
    __main__.chapter_guess = guess
    try:
        with guess.hold():
            print("the answer: 42 ms")
    finally:
        del __main__.chapter_guess
    printed = capsys.readouterr().out
    assert "42" not in printed and printed.rstrip().endswith(Prediction.HELD)
    assert "`chapter_guess.commit(YOUR_GUESS)`" in printed and "`chapter_guess.skip()`" in printed
    guess.commit(40)                       # as a learner without widgets would
    with guess.hold():
        print("the answer: 42 ms")
    assert "the answer: 42 ms" in capsys.readouterr().out


def test_the_roofline_lab_holds_its_crossover_until_the_guess(capsys: pytest.CaptureFixture) -> None:
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    lab = RooflineLab(RooflineCase("a case", config, 4, 20e9, 200e9, context=40))
    assert lab.shown() is False
    assert "drawn once you commit a guess" in capsys.readouterr().out
    lab.set_guess("8")
    assert lab.commit() and lab.shown() is True and capsys.readouterr().out == ""


def test_chapter_6b_draws_and_prints_the_crossover_only_once_committed() -> None:
    cells = json.loads((COURSE / "06b_decode_roofline.ipynb").read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    lab_at = next(i for i, s in enumerate(code) if "RooflineLab(" in s)
    for source in code[lab_at + 1:]:
        if "crossover()" in source or "compute bound (FLOPs / FLOP rate)" in source:
            assert "lab.shown()" in source or "lab.committed" in source, source[:300]


def test_quick_mode_is_offered_only_where_it_changes_what_is_prepared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tinyserve.workbook import fast_lab
    monkeypatch.delenv(fast_lab.QUICK_ENV, raising=False)
    assert fast_lab.mode_line(None) == ""                 # chapters 1 and 6b: one shape either way
    offer = fast_lab.mode_line("rows")
    assert "full mode" in offer and "`%env TINYSERVE_QUICK=1`" in offer and "1, 4 instead of" in offer
    monkeypatch.setenv(fast_lab.QUICK_ENV, "1")
    assert fast_lab.mode_line("k").startswith("quick mode (TINYSERVE_QUICK=1: k = 1 draft")
    # in the chapters: only the cells whose shapes follow the mode say it
    for path in sorted(COURSE.glob("*.ipynb")):
        calls = [line for cell in json.loads(path.read_text())["cells"]
                 for line in "".join(cell["source"]).splitlines() if "= prepare_for_chapter(" in line]
        for call in calls:
            follows = "FAST_ROWS[1:]" in call or "verify_set" in call
            assert ("quick=" in call) is follows, f"{path.name}: {call}"


def test_start_here_speaks_to_every_front_end() -> None:
    text = "".join("".join(c["source"]) for c in json.loads((ROOT / "START_HERE.ipynb").read_text())["cells"]
                   if c["cell_type"] == "markdown")
    for said in ("*Run > Run All Cells*", "*Runtime > Run all*", "*Cell > Run All*",
                 "`python -m autograder check NAME`", "`NAME.commit(YOUR_GUESS)`", "`NAME.skip()`",
                 "install cell"):
        assert said in text, said

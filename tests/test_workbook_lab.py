"""The predict-first lab: no answer before a committed guess, the right answer after."""
from __future__ import annotations

import pytest

from tinyserve.workbook.lab import KVCacheLab, KVCase, growth_chart_png

DEFAULT_BYTES = 2 * 80 * 4096 * 8 * 128 * 2  # the lab's default case: 1,342,177,280 bytes


def test_default_case_is_the_80_layer_fp16_4k_case() -> None:
    case = KVCacheLab().case
    assert (case.layers, case.kv_heads, case.head_dim, case.dtype, case.tokens,
            case.concurrency) == (80, 8, 128, "fp16", 4096, 1)
    assert case.total_bytes == DEFAULT_BYTES == 1_342_177_280


def test_answer_hidden_until_a_guess_is_committed() -> None:
    lab = KVCacheLab()
    for text in (lab.revealed_text(),):
        assert "1,342,177,280" not in text and "1.25" not in text and "1.342" not in text
    assert not lab.commit()                       # no guess yet: refused
    assert lab.revealed_text() == KVCacheLab.HIDDEN
    assert "guess" in lab.message.lower()
    lab.set_guess("1")
    assert lab.revealed_text() == KVCacheLab.HIDDEN  # typed but not committed
    assert lab.commit()
    text = lab.revealed_text()
    assert "1,342,177,280 bytes" in text
    assert "1.342 GB" in text and "1.250 GiB" in text
    assert "2 x 80 x 4,096 x 8 x 128 x 2" in text
    assert "within 1.5x" in text


@pytest.mark.parametrize("bad", ["", "abc", "-3", "0", "nan"])
def test_a_bad_guess_cannot_be_committed(bad: str) -> None:
    lab = KVCacheLab()
    lab.set_guess(bad)
    assert not lab.commit()
    assert lab.revealed_text() == KVCacheLab.HIDDEN
    assert lab.message  # says what to type


def test_verdict_names_the_factor() -> None:
    lab = KVCacheLab()
    lab.set_guess(134.2)            # 100x too high
    lab.commit()
    assert "100.0x too high" in lab.revealed_text()
    assert "more than 10x" in lab.revealed_text()


def test_changing_the_case_hides_the_answer_and_locks_the_old_guess() -> None:
    lab = KVCacheLab()
    lab.set_guess(1)
    lab.commit()
    lab.set_guess(1.342)            # editing a committed guess is refused
    assert lab.guess_gb == 1
    lab.set_case(kv_heads=2)
    assert lab.revealed_text() == KVCacheLab.HIDDEN and lab.guess_gb is None
    lab.set_guess(0.3)
    lab.commit()
    assert f"{DEFAULT_BYTES // 4:,} bytes" in lab.revealed_text()   # 8 -> 2 KV heads: a quarter


def test_worked_example_and_concurrency() -> None:
    assert KVCase(layers=32, tokens=8192).total_bytes == 2**30
    lab = KVCacheLab(layers=32, tokens=8192, concurrency=16)
    lab.set_guess(16)
    lab.commit()
    text = lab.revealed_text()
    assert "17,179,869,184 bytes" in text and "16.000 GiB" in text and "17.180 GB" in text
    with pytest.raises(ValueError, match="kv_heads"):
        KVCase(kv_heads=0)
    with pytest.raises(ValueError, match="dtype"):
        KVCase(dtype="fp12")


def test_the_widgets_drive_the_same_logic() -> None:
    lab = KVCacheLab()
    box = lab.ui()
    controls = lab._ui
    assert "1,342,177,280" not in controls.answer.value
    controls.commit_button.click()                 # nothing typed: refused
    assert not lab.committed and "1,342,177,280" not in controls.answer.value
    controls.guess.value = "2"
    assert "1,342,177,280" not in controls.answer.value
    controls.commit_button.click()
    assert lab.committed and "1,342,177,280 bytes" in controls.answer.value
    assert controls.guess.disabled
    controls.inputs["tokens"].value = 8192         # a new case: hidden again, guess cleared
    assert not lab.committed and controls.guess.value == "" and not controls.guess.disabled
    assert "1,342,177,280" not in controls.answer.value
    assert "changed" in controls.status.value
    controls.guess.value = "3"
    controls.commit_button.click()
    assert "2,684,354,560 bytes" in controls.answer.value
    assert box.children  # the box a notebook displays


# --- Prediction: the generic predict-first cell every chapter uses ----------------------------

from tinyserve.workbook.predict import Prediction, how_far  # noqa: E402


def test_prediction_hides_the_measurement_until_a_guess_is_committed() -> None:
    p = Prediction("How many ms does one decode step take?", "ms")
    assert p.revealed_text() == Prediction.HIDDEN
    assert p.record(3.25) == Prediction.NO_GUESS          # measured, nothing committed
    assert "3.25" not in p.revealed_text() and "3.25" not in Prediction.NO_GUESS
    p.set_guess("2")
    assert p.revealed_text() == Prediction.HIDDEN          # typed, not committed
    assert p.commit()
    text = p.revealed_text()
    assert "your guess 2 ms" in text and "measured 3.25 ms" in text and "1.6x too low" in text


def test_prediction_commit_before_measurement_and_locking() -> None:
    p = Prediction("ratio?", "x")
    assert not p.commit() and "first" in p.message         # nothing typed: refused
    assert p.commit("20")
    assert p.revealed_text().startswith("Committed: your guess 20 x")
    p.set_guess(1)                                         # locked after commit
    assert p.guess == 20 and "locked" in p.message
    assert "within 1.5x" in p.record(18)


@pytest.mark.parametrize("bad", ["", "abc", "-1", "0", "inf"])
def test_prediction_refuses_a_bad_guess(bad: str) -> None:
    p = Prediction("q", "ms")
    p.set_guess(bad)
    assert not p.commit() and p.message
    with pytest.raises(ValueError, match="positive"):
        p.record(float("nan"))


def test_how_far_names_direction_and_scale() -> None:
    assert how_far(1.2, 1.0).startswith("within 1.5x")
    assert how_far(30, 1.0) == "30.0x too high (off by more than 10x)"
    assert how_far(0.25, 1.0) == "4.0x too low (same order of magnitude)"


def test_prediction_widgets_drive_the_same_logic() -> None:
    p = Prediction("q", "ms")
    p.ui()
    ui = p._ui
    ui["commit"].click()
    assert not p.committed
    ui["guess"].value = "5"
    p.record(10)
    assert "10" not in ui["answer"].value                  # still hidden
    ui["commit"].click()
    assert p.committed and ui["guess"].disabled
    assert "measured 10 ms" in ui["answer"].value and "2.0x too low" in ui["answer"].value


def test_a_sliding_window_caps_the_case_and_its_chart() -> None:
    lab = KVCacheLab(window=1024)
    assert lab.case.kept_tokens == 1024
    assert lab.case.total_bytes == DEFAULT_BYTES // 4          # 4,096 tokens, 1,024 kept
    lab.set_guess(0.3)
    lab.commit()
    text = lab.revealed_text()
    assert "2 x 80 x 1,024 x 8 x 128 x 2" in text and "min(4,096, 1,024) = 1,024" in text
    assert KVCase(window=8192).total_bytes == DEFAULT_BYTES       # a window longer than the context
    with pytest.raises(ValueError, match="window"):
        KVCase(window=-1)
    assert growth_chart_png(lab.case, 0.3).startswith(b"\x89PNG")
    lab.set_case(window=0)                                        # a new case: hidden again
    assert lab.revealed_text() == KVCacheLab.HIDDEN


def test_a_latent_cache_is_sized_next_to_gqa() -> None:
    """MLA (DeepSeek-V2's 512 + 64): layers x tokens x 576 x 2 bytes, no K/V pair and no
    heads, shown next to the GQA figure of the same shape; hidden until a guess is committed."""
    lab = KVCacheLab(latent_dim=512, rope_dim=64)
    mla = 80 * 4096 * (512 + 64) * 2
    assert lab.case.total_bytes == mla == 377_487_360
    assert lab.revealed_text() == KVCacheLab.HIDDEN
    lab.set_guess("0.4")
    lab.commit()
    text = lab.revealed_text()
    assert "80 x 4,096 x (512 + 64) x 2" in text and "377,487,360 bytes" in text
    assert "next to GQA with 8 KV heads of 128: 1.342 GB, 3.56x the latent cache" in text
    assert "within 1.5x" in text
    assert KVCase(latent_dim=512, rope_dim=64, concurrency=4).total_bytes == 4 * mla
    assert growth_chart_png(lab.case, 0.4).startswith(b"\x89PNG")
    # One design at a time, refused with the reason; the old case and its answer stay.
    assert not lab.set_case(window=1024)
    assert "not both" in lab.message and lab.case.total_bytes == mla and lab.committed
    with pytest.raises(ValueError, match="latent_dim"):
        KVCase(latent_dim=-1)
    # The widget: a latent dim set by hand hides the answer; an impossible one snaps back.
    lab = KVCacheLab()
    controls = lab._ui or (lab.ui(), lab._ui)[1]
    controls.inputs["latent_dim"].value = 512
    controls.inputs["rope_dim"].value = 64
    controls.guess.value = "0.4"
    controls.commit_button.click()
    assert "377,487,360 bytes" in controls.answer.value
    controls.inputs["window"].value = 1024
    assert controls.inputs["window"].value == 0 and "not both" in controls.status.value
    assert lab.committed and "377,487,360 bytes" in controls.answer.value


def test_a_held_measurement_shows_nothing_of_its_answer_before_a_commit(capsys) -> None:
    # Issue 27: the measurement cell printed its value whether or not a guess was committed.
    p = Prediction("How many ms?", "ms", discussion="On this CPU the step is mostly overhead.")
    with p.hold():
        print("one decode step: 3.25 ms")
        p.record(3.25)
    out = capsys.readouterr().out
    assert out.strip() == f"{p.without_widgets()}\n{Prediction.HELD}" and "3.25" not in out
    assert "`prediction.commit(YOUR_GUESS)`" in out      # no notebook variable names it here
    assert p.answer_text() == Prediction.HIDDEN and "3.25" not in p.answer_text()
    assert not p.shown() and capsys.readouterr().out.strip() == Prediction.HELD_PLOT
    assert p.commit(2)                          # committing reveals it in the widget's box...
    assert "one decode step: 3.25 ms" in p.answer_text() and "too low" in p.answer_text()
    assert "mostly overhead" in p.answer_text()
    with p.hold():                              # ...and running the cell again prints it
        print("one decode step: 3.25 ms")
        p.record(3.25)
    out = capsys.readouterr().out
    assert "3.25 ms" in out and "your guess 2 ms" in out and "mostly overhead" in out
    assert p.shown()


def test_skipping_shows_the_answer_without_a_comparison(capsys) -> None:
    p = Prediction("ratio?", "x")
    p.skip()
    assert p.revealed and not p.committed
    with p.hold():
        print("ratio 4.2")
        p.record(4.2)
    out = capsys.readouterr().out
    assert "ratio 4.2" in out and "No guess (skipped)" in out and "too" not in out


def test_a_held_block_closes_the_figures_it_drew() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    p = Prediction("q", "x")
    before = set(plt.get_fignums())
    with p.hold():
        plt.figure()
    assert set(plt.get_fignums()) == before
    p.skip()
    with p.hold():
        fig = plt.figure()
    assert fig.number in plt.get_fignums()
    plt.close(fig)


def test_several_cells_can_hold_parts_of_one_answer(capsys) -> None:
    p = Prediction("ratio?", "x")
    with p.hold("prefill"):
        print("prefill 0.2 ms per token")
    with p.hold("decode"):
        print("decode 4.0 ms per token")
    with p.hold("prefill"):                    # run again: replaces its own part only
        print("prefill 0.25 ms per token")
    with p.hold():
        p.record(16.0)
    assert "0.25" not in capsys.readouterr().out
    p.commit(10)
    text = p.answer_text()
    assert text.index("prefill 0.25") < text.index("decode 4.0") and "0.2 ms" not in text
    assert "measured 16 x" in text


def test_every_predict_first_box_parses_a_guess_with_one_parser() -> None:
    # issue 39: predict.parse_guess is the one parser (Prediction, the KV-cache lab, the roofline lab)
    from tinyserve.workbook.predict import parse_guess
    assert parse_guess(" 1,000 ", "rows") == (1000.0, "")
    assert parse_guess("", "rows") == (None, "")
    assert parse_guess("0.5", "rows", at_least=1)[0] is None
    assert "at least 1" in parse_guess("0.5", "rows", at_least=1)[1]
    assert "such as 4 or 300" in parse_guess("x", "rows", example="4 or 300")[1]
    lab = KVCacheLab()
    lab.set_guess("abc")
    assert lab.message == parse_guess("abc", "GB", example="0.5 or 20")[1]


def test_a_knee_past_the_rows_timed_grades_the_guess_against_a_lower_limit() -> None:
    # Issue 52, I8: chapter 3's quick mode times 1 and 4 rows; a knee past them is not "4".
    from tinyserve.workbook.predict import Prediction
    high = Prediction("knee?", "rows")
    high.commit(16)
    text = high.record_past(4)
    assert "past the 4 rows timed" in text and "consistent" in text and "too high" not in text
    low = Prediction("knee?", "rows")
    low.commit(2)
    assert "too low: the answer lies past 4 rows" in low.record_past(4)
    low.record(3)                                 # a later, in-range measurement clears it
    assert "past" not in low.revealed_text()

"""The chapters' fast-path helpers (tinyserve/workbook/fast_lab.py): quick mode read from the
environment, the shapes each chapter prepares in the shared window, and the timers running on
the fast path's own decoders and passes. The fast path is traced only here (its one knob,
``fast.CPU_RECIPE``), so nothing compiles: shapes and plumbing, never a time."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinyserve.backends import fast
from tinyserve.config import ModelConfig
from tinyserve.roofline import RowPoint
from tinyserve.workbook import fast_lab

from conftest import sharp_model

# 128 positions: the shared window (fast_lab.TOKENS) must fit the model's context.
TINY = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)



@pytest.mark.parametrize("value, expected", [("1", True), (" 1 ", True), ("0", False),
                                             ("", False), ("yes", False)])
def test_quick_mode_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str,
                                                 expected: bool) -> None:
    monkeypatch.setenv(fast_lab.QUICK_ENV, value)
    assert fast_lab.quick() is expected
    assert fast_lab.rows() == (fast_lab.QUICK_ROWS if expected else fast_lab.FULL_ROWS)
    assert fast_lab.spec_k() == (fast_lab.QUICK_K if expected else fast_lab.FULL_K)


def test_quick_mode_is_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fast_lab.QUICK_ENV, raising=False)
    assert not fast_lab.quick()


def test_quick_shapes_are_a_subset_of_the_full_ones() -> None:
    assert set(fast_lab.QUICK_ROWS) <= set(fast_lab.FULL_ROWS)
    assert fast_lab.QUICK_ROWS[0] == fast_lab.FULL_ROWS[0] == 1   # the knee is against 1 row
    assert fast_lab.QUICK_K < fast_lab.FULL_K


def test_every_chapter_shape_is_in_the_shared_window() -> None:
    verify, draft = fast_lab.spec_shapes(2)
    assert verify == fast.verify_shape(2, fast_lab.TOKENS) and verify.widths == (1, 2, 3)
    assert draft == fast.draft_shape(fast_lab.TOKENS) and draft.widths == (1, 2)
    assert fast_lab.decode_shapes([1, 4]) == [fast.Shape(fast_lab.TOKENS, 1),
                                              fast.Shape(fast_lab.TOKENS, 4)]
    assert fast_lab.describe_shapes([*fast_lab.decode_shapes([1]), verify, draft]) == \
        "decode batch 1, passes of 1-3 tokens, passes of 1 and 2 tokens"
    # chapter 8's scale run: the longest prompt (89 tokens) and 32 tokens fit one window
    assert fast_lab.PROMPT + 16 <= fast_lab.TOKENS and 89 + 32 + fast_lab.FULL_K + 1 <= 128


def test_prepare_for_chapter_says_the_mode_and_splits_a_pass_set(
        traced: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv(fast_lab.QUICK_ENV, "1")
    model = sharp_model(TINY, seed=1)
    verify, _ = fast_lab.spec_shapes(2)
    first = fast_lab.prepare_for_chapter(model, [verify], "tiny", only=[1], progress=False,
                                         quick="k")       # as chapter 8's verify cells say
    out = capsys.readouterr().out
    assert "quick mode (TINYSERVE_QUICK=1: k = 1 draft" in out and "tiny, window 128" in out and "now the widths 1" in out
    # the prefill's weights are packed with the first cell's widths, once
    assert [c.label for c in first] == ["pass width 1 x window 128", fast.PACK_LABEL]
    assert all(c.compiled for c in first)
    rest = fast_lab.prepare_for_chapter(model, [verify], "tiny", only=[1, 2, 3], progress=False)
    assert [c.compiled for c in rest] == [False, True, True, False]   # width 1 held, packed
    held = fast_lab.prepare_for_chapter(model, [verify], "tiny", progress=False)
    assert [c.compiled for c in held] == [False, False, False, False]
    capsys.readouterr()
    # chapter 8's last split cell with quick mode's k = 1: no width of its own, nothing run
    assert fast_lab.prepare_for_chapter(model, [fast_lab.spec_shapes(1)[0]], "tiny",
                                        only=[3], progress=False) == []
    assert "nothing left to prepare in this cell" in capsys.readouterr().out
    decode = fast_lab.prepare_for_chapter(model, fast_lab.decode_shapes([1]), progress=False)
    assert [c.label for c in decode] == ["decode batch 1 x window 128", fast.PACK_LABEL]
    monkeypatch.setenv(fast_lab.QUICK_ENV, "0")
    fast_lab.prepare_for_chapter(model, fast_lab.decode_shapes([1]), progress=False)
    said = capsys.readouterr().out                      # batch 1 is prepared in either mode
    assert "full mode" not in said and "quick mode" not in said and "TINYSERVE_QUICK" not in said
    fast_lab.prepare_for_chapter(model, fast_lab.decode_shapes([1]), progress=False, quick="rows")
    assert "full mode (for batch sizes 1, 4 instead of" in capsys.readouterr().out


def test_the_timers_run_the_fast_paths_own_decoders_and_passes(traced: Path) -> None:
    model = sharp_model(TINY, seed=2)
    prompts = torch.randint(4, TINY.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0))
    assert fast_lab.fast_step_seconds(model, prompts[:1], n=3, repeats=1) > 0
    sweep = fast_lab.fast_row_sweep(model, prompts, [1, 4], n=2, repeats=1)
    assert list(sweep) == [1, 4] and all(isinstance(p, RowPoint) for p in sweep.values())
    assert all(p.eager_s > 0 and p.compiled_s > 0 for p in sweep.values())
    passes = fast_lab.fast_pass_seconds(model, (1, 2, 3), [1, 3], context=10, repeats=2)
    assert sorted(passes) == [1, 3] and min(passes.values()) > 0
    with pytest.raises(ValueError, match="window"):
        fast_lab.fast_step_seconds(model, prompts[:1, :8], n=fast_lab.TOKENS)
    with pytest.raises(ValueError, match="bucket"):
        fast_lab.fast_step_seconds(model, prompts[:3], n=2, repeats=1)

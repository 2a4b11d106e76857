"""Training is seeded and reports what it did; the learning-rate schedule is as documented."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tinyserve.train import TRAIN_PRESETS, TrainConfig, lr_at, train


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == 1e-4
    assert lr_at(9, cfg) == 1e-3
    assert abs(lr_at(100, cfg) - 1e-4) < 1e-12
    lrs = [lr_at(s, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])), "cosine decay must not increase"


def test_a_short_run_is_reproducible_and_reports_its_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Validation on 8 windows, not the preset's 128: the same code path, and equal losses
    # over two runs still prove the seeding (the full-size evaluation is the model card's).
    monkeypatch.setitem(TRAIN_PRESETS, "draft",
                        dataclasses.replace(TRAIN_PRESETS["draft"], eval_tokens=8 * 512))
    a = train("draft", steps=2, save=False, plot_path=tmp_path / "a.png")
    b = train("draft", steps=2, save=False, plot_path=tmp_path / "b.png")
    assert a["final_train_loss"] == b["final_train_loss"]
    assert a["val_loss"] == b["val_loss"]
    assert a["parameters"] > 0 and a["train_tokens_seen"] == 2 * 4 * 512
    assert a["val_tokens"] == 8 * 512  # the patched validation set was used
    assert (tmp_path / "a.png").stat().st_size > 1000
    assert TRAIN_PRESETS["target"].seed == TRAIN_PRESETS["draft"].seed == 0

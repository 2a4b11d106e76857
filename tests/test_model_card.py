"""The README's model card is what `python -m tinyserve model-card` computes today, and the
shipped models meet the foundation's targets."""
from __future__ import annotations

from pathlib import Path

import pytest

from tinyserve.workbook.model_card import card_in_readme, model_card

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def card() -> dict:
    return model_card()


def test_readme_quotes_the_recomputed_card(card: dict) -> None:
    assert card_in_readme(ROOT / "README.md") == card["markdown"].strip(), (
        "README.md's model card is stale: run "
        "`python -m tinyserve model-card --update-readme README.md`")


def test_shipped_models_meet_their_targets(card: dict) -> None:
    target, draft = card["figures"]["target"], card["figures"]["draft"]
    assert 5_000_000 <= target["parameters"] <= 10_000_000
    assert card["figures"]["flops_ratio_target_over_draft"] >= 7
    # A trained model, far below the uniform-guess loss ln(4096) = 8.3 nats.
    assert target["val_loss"] < 1.0 and draft["val_loss"] < 1.5
    assert target["val_loss"] < draft["val_loss"], "the target should beat its draft"
    # Speculative decoding lives on this figure.
    assert draft["greedy_agreement_with_target"] > 0.5

"""workbook.engine_lab (chapters 6 and 9: requests served at once through the engine): the run's
figures are consistent, and a fast run finds the step prepare_at_once compiled. The fast path
runs traced only (its one knob), so this takes seconds; figures, not times, are checked."""
from __future__ import annotations

from pathlib import Path

import pytest

from tinyserve.config import ModelConfig
from tinyserve.workbook.engine_lab import prepare_at_once, serve_at_once

from conftest import sharp_model

SMALL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)



def test_a_run_counts_every_requests_tokens_and_its_decode_steps(traced: Path) -> None:
    model = sharp_model(SMALL, seed=3)
    run = serve_at_once(model, 3, prompt=10, tokens=6, progress=False)
    assert (run.concurrency, run.prompt, run.tokens, run.path) == (3, 10, 6, "eager")
    assert run.seconds > 0 and run.decode_step_s > 0 and run.prepare_s == 0
    assert run.tokens_per_s == pytest.approx(3 * 6 / run.seconds)
    assert "eager  3 at once" in run.describe()


def test_a_fast_run_uses_the_prepared_step(traced: Path) -> None:
    model = sharp_model(SMALL, seed=4)
    assert prepare_at_once(model, 2, prompt=10, tokens=6, progress=False) > 0
    run = serve_at_once(model, 2, prompt=10, tokens=6, path="fast", progress=False)
    assert run.path == "fast" and run.prepare_s == 0                      # held: nothing compiled again
    with pytest.raises(ValueError, match="at least 1 request"):
        serve_at_once(model, 0)

"""The fast path's eager passes (tinyserve/backends/packed.py, fast.eager_passes): linears over
weights packed once for oneDNN give the plain ``F.linear``'s logits and tokens, serve every
projection of a prefill that has two rows or more, pack a weight again when it changes in place,
leave autograd and int8 models alone, and run only where they measured faster (or the recipe
says so). No time is asserted: the measured choice is tested from given timings."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tinyserve.backends import fast, packed
from tinyserve.config import ModelConfig
from tinyserve.engine import EngineConfig, generate_many
from tinyserve.generate import generate, generate_batch
from tinyserve.quant import quantize_model
from tinyserve.speculative import ModelDrafter, speculative_generate

from conftest import random_prompt, sharp_model

pytestmark = pytest.mark.skipif(not packed.available(),
                                reason="this torch has no oneDNN packed linear")

SMALL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _prefill(model, ids, mode=None):
    last = torch.tensor([ids.shape[1] - 1])
    with torch.inference_mode():
        if mode is None:
            return model(ids, logits_at=last)
        with mode:
            return model(ids, logits_at=last)


def test_a_prefill_on_packed_weights_gives_the_plain_logits_and_packs_each_projection() -> None:
    model = sharp_model(SMALL, seed=3)
    ids = torch.tensor([random_prompt(96, 12, seed=4)])
    mode = packed.PackedLinears()
    assert torch.allclose(_prefill(model, ids, mode), _prefill(model, ids), atol=1e-5, rtol=1e-5)
    # layer 0: q/k/v stacked (x @ w), o_proj, gate/up stacked (x @ w), down_proj; layer 1:
    # q/k/v and o_proj. Its MLP and the LM head serve the one kept row: left plain.
    assert mode.packed == 6
    _prefill(model, ids, mode)
    assert mode.packed == 6                                     # kept, not packed again
    one = packed.PackedLinears()
    _prefill(model, ids[:, :1], one)                            # a one-token prompt: one row
    assert one.packed == 0


def test_a_weight_changed_in_place_is_packed_again() -> None:
    model = sharp_model(SMALL, seed=5)
    ids = torch.tensor([random_prompt(96, 9, seed=6)])
    mode = packed.PackedLinears()
    before = _prefill(model, ids, mode)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.mul_(-1.5)
    after = _prefill(model, ids, mode)
    assert not torch.allclose(after, before, atol=1e-3)
    assert torch.allclose(after, _prefill(model, ids), atol=1e-5, rtol=1e-5)


def test_autograd_runs_the_plain_linears() -> None:
    model = sharp_model(SMALL, seed=7)
    ids = torch.tensor([random_prompt(96, 8, seed=8)])
    mode = packed.PackedLinears()
    with mode:
        loss = model(ids).logsumexp(-1).sum()
    loss.backward()                                 # oneDNN's op has no backward: not used
    assert mode.packed == 0 and model.model.layers[0].mlp.down_proj.weight.grad is not None


@pytest.mark.parametrize("winner", ["packed", "plain"])
def test_the_measured_choice_decides_what_the_loops_hold(
        traced: Path, monkeypatch: pytest.MonkeyPatch, winner: str) -> None:
    monkeypatch.setattr(fast, "CPU_RECIPE", fast.Recipe((), False, "eager", "measured"))
    times = packed.KernelTimes(plain_ms=2.0 if winner == "packed" else 1.0, packed_ms=1.5,
                               shape="64 x 32 -> 64")
    monkeypatch.setattr(packed, "measure", lambda weight, *a, **k: times)
    monkeypatch.setattr(fast, "_EAGER_KERNELS", {})
    model = sharp_model(SMALL, seed=9)
    held = fast.eager_passes(model)
    assert isinstance(held, packed.PackedLinears) == (winner == "packed")
    said: list[str] = []
    cost = fast.prepare_eager(model, say=said.append)
    kernel = "oneDNN's linear over weights packed once" if winner == "packed" else "F.linear"
    assert len(said) == 1 and kernel in said[0] and "64 x 32 -> 64" in said[0]
    assert (cost is not None and cost.label == fast.PACK_LABEL) == (winner == "packed")
    prompt = random_prompt(96, 10, seed=10)
    assert generate(model, prompt, 12, fast=True).tokens == \
        generate(model, prompt, 12, graph=False).tokens


def test_the_fast_loops_prefill_on_packed_weights_with_eager_tokens(traced: Path) -> None:
    model = sharp_model(SMALL, seed=11)
    prompts = [random_prompt(96, n, seed=n) for n in (6, 11, 3)]
    assert generate_batch(model, prompts, 10, fast=True) == generate_batch(model, prompts, 10)
    assert fast._PACKED_MODES[model].packed >= 6               # the prefill ran packed
    served = sharp_model(SMALL, seed=14)                       # the engine's prefill steps
    config = EngineConfig(num_blocks=40, block_size=4, max_num_seqs=4)
    assert generate_many(served, prompts, 8, replace(config, fast=True)) == \
        generate_many(served, prompts, 8, config)
    assert fast._PACKED_MODES[served].packed >= 6
    target, draft = sharp_model(SMALL, seed=15), sharp_model(SMALL, seed=16)
    want, _ = speculative_generate(target, ModelDrafter(draft), prompts[1], 12, k=2,
                                   graph=False)
    got, _ = speculative_generate(target, ModelDrafter(draft, fast=True), prompts[1], 12, k=2,
                                  fast=True)
    assert got == want
    assert fast._PACKED_MODES[target].packed >= 6 and fast._PACKED_MODES[draft].packed >= 6


def test_int8_models_and_plain_recipes_hold_nothing(traced: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    int8 = quantize_model(sharp_model(SMALL, seed=12))
    assert not isinstance(fast.eager_passes(int8), packed.PackedLinears)
    assert fast.prepare_eager(int8) is None
    monkeypatch.setattr(fast, "CPU_RECIPE", fast.Recipe((), False, "eager", "plain"))
    assert not isinstance(fast.eager_passes(sharp_model(SMALL, seed=13)), packed.PackedLinears)
    with pytest.raises(ValueError, match="eager_linears must be one of measured, packed, plain"):
        fast.Recipe((), False, "eager", "onednn")


def test_measure_times_both_kernels_on_the_weight_it_is_given() -> None:
    times = packed.measure(torch.randn(48, 32), rows=4, repeats=2)
    assert times.shape == "4 x 32 -> 48" and times.plain_ms > 0 and times.packed_ms > 0
    assert times.winner == ("packed" if times.packed_ms < times.plain_ms else "plain")

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


def test_packed_passes_start_where_they_win_at_every_larger_size() -> None:
    def times(packed_ms):
        return packed.PassTimes((4, 16, 64), (2.0, 4.0, 8.0), packed_ms, "2 layers")
    assert times((3.0, 3.0, 5.0)).from_rows == 16       # loses at 4 tokens, wins from 16
    assert times((1.0, 3.0, 5.0)).from_rows == 4
    assert times((1.0, 3.0, 9.0)).from_rows is None     # loses at the largest: never
    assert times((3.0, 5.0, 9.0)).from_rows is None
    said = times((3.0, 3.0, 5.0)).sentence()
    assert "packed once from 16 tokens a pass" in said and "4 tokens 3.0 against 2.0 ms" in said
    assert "plain F.linear at every size" in times((3.0, 5.0, 9.0)).sentence()


@pytest.mark.parametrize("start", [16, None], ids=["from 16 tokens", "never"])
def test_the_measured_pass_sizes_decide_what_the_loops_hold(
        traced: Path, monkeypatch: pytest.MonkeyPatch, start: int | None) -> None:
    monkeypatch.setattr(fast, "CPU_RECIPE", fast.Recipe((), False, "eager", "measured"))
    wins = (5.0, 3.0, 5.0) if start else (5.0, 5.0, 9.0)
    times = packed.PassTimes((4, 16, 64), (4.0, 4.0, 8.0), wins, "2 layers")
    monkeypatch.setattr(packed, "measure", lambda model, *a, **k: times)
    monkeypatch.setattr(fast, "_EAGER_KERNELS", {})
    model = sharp_model(SMALL, seed=9)
    assert not isinstance(fast.eager_passes(model, 15), packed.PackedLinears)
    assert isinstance(fast.eager_passes(model, 16), packed.PackedLinears) == bool(start)
    said: list[str] = []
    cost = fast.prepare_eager(model, say=said.append)
    # The wait is said before it starts (what it does, an estimate), then what it measured.
    assert said[0].startswith("timing the eager passes") and f"{fast.PACK_ESTIMATE_S} s" in said[0]
    assert said[1:] == [times.sentence()]
    assert (cost is not None and cost.label == fast.PACK_LABEL) == bool(start)
    for n in (6, 20):                                           # a prompt each side of 16
        prompt = random_prompt(96, n, seed=n)
        assert generate(model, prompt, 12, path="fast").tokens == \
            generate(model, prompt, 12, path="eager").tokens


def test_the_fast_loops_prefill_on_packed_weights_with_eager_tokens(traced: Path) -> None:
    model = sharp_model(SMALL, seed=11)
    prompts = [random_prompt(96, n, seed=n) for n in (6, 11, 3)]
    assert generate_batch(model, prompts, 10, path="fast") == generate_batch(model, prompts, 10)
    assert fast._PACKED_MODES[model].packed >= 6               # the prefill ran packed
    served = sharp_model(SMALL, seed=14)                       # the engine's prefill steps
    config = EngineConfig(num_blocks=40, block_size=4, max_num_seqs=4)
    assert generate_many(served, prompts, 8, replace(config, path="fast")) == \
        generate_many(served, prompts, 8, config)
    assert fast._PACKED_MODES[served].packed >= 6
    target, draft = sharp_model(SMALL, seed=15), sharp_model(SMALL, seed=16)
    want, _ = speculative_generate(target, ModelDrafter(draft), prompts[1], 12, k=2,
                                   path="eager")
    got, _ = speculative_generate(target, ModelDrafter(draft, path="fast"), prompts[1], 12, k=2,
                                  path="fast")
    assert got == want
    assert fast._PACKED_MODES[target].packed >= 6 and fast._PACKED_MODES[draft].packed >= 6


def test_int8_models_and_plain_recipes_hold_nothing(traced: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    int8 = quantize_model(sharp_model(SMALL, seed=12))
    assert not isinstance(fast.eager_passes(int8, 64), packed.PackedLinears)
    assert fast.prepare_eager(int8) is None
    monkeypatch.setattr(fast, "CPU_RECIPE", fast.Recipe((), False, "eager", "plain"))
    assert not isinstance(fast.eager_passes(sharp_model(SMALL, seed=13), 64),
                          packed.PackedLinears)
    with pytest.raises(ValueError, match="eager_linears must be one of measured, packed, plain"):
        fast.Recipe((), False, "eager", "onednn")


def test_measure_times_whole_passes_both_ways_and_keeps_the_copies() -> None:
    model = sharp_model(SMALL, seed=17)
    mode = packed.PackedLinears()
    times = packed.measure(model, rows=(2, 8), repeats=1, mode=mode)
    assert times.rows == (2, 8) and len(times.plain_ms) == len(times.packed_ms) == 2
    assert all(t > 0 for t in (*times.plain_ms, *times.packed_ms))
    assert times.shape == "2 layers, up_proj 32 -> 64" and mode.packed == 6


def test_the_measurement_is_kept_for_the_next_process_on_this_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = sharp_model(SMALL, seed=18)
    calls: list[int] = []
    times = packed.PassTimes((4, 16, 64), (4.0, 4.0, 8.0), (5.0, 3.0, 5.0), "2 layers")

    def timed(m, *a, **k):
        calls.append(1)
        return times
    monkeypatch.setattr(packed, "measure", timed)
    assert packed.measure_kept(model, tmp_path) == times and len(calls) == 1
    assert (tmp_path / packed.KEPT_FILE).is_file()
    assert packed.measure_kept(model, tmp_path) == times and len(calls) == 1   # read back
    other = sharp_model(replace(SMALL, num_hidden_layers=1), seed=18)            # its own
    packed.measure_kept(other, tmp_path)
    assert len(calls) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)                     # another run
    packed.measure_kept(model, tmp_path)
    assert len(calls) == 3
    (tmp_path / packed.KEPT_FILE).write_text("{not json")                        # measured over
    assert packed.measure_kept(model, tmp_path) == times and len(calls) == 4
    assert packed.measure_kept(model, None) == times and len(calls) == 5          # not kept
    with pytest.warns(UserWarning, match="could not keep the eager passes' measurement"):
        assert packed.measure_kept(model, tmp_path / "missing" / "folder") == times

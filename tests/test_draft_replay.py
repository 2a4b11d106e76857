"""The replay drafter: output always equals plain greedy decoding, a=1 keeps every guess,
a=0 none, the measured acceptance tracks a, and each step pays the draft model's real passes."""
from __future__ import annotations

import pytest
import torch

from tinyserve.config import ModelConfig
from tinyserve.draft_replay import ReplayDrafter, ScriptDiverged, greedy_script
from tinyserve.model import TinyLlama
from tinyserve.sampling import SamplingParams
from tinyserve.speculative import speculative_generate

from conftest import random_prompt, sharp_model

TARGET = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256)
DRAFT = ModelConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)


@pytest.fixture(scope="module")
def target() -> TinyLlama:
    return sharp_model(TARGET, seed=1)


@pytest.fixture(scope="module")
def draft() -> TinyLlama:
    torch.manual_seed(2)
    return TinyLlama(DRAFT).eval()


def _run(target, draft, a, *, n=24, k=4, seed=0, prompt_seed=0):
    prompt = random_prompt(TARGET.vocab_size, 7, seed=prompt_seed)
    script = greedy_script(target, prompt, n)
    out, stats = speculative_generate(target, ReplayDrafter(draft, script, a, seed=seed),
                                      prompt, n, k=k)
    return out, stats, script


@pytest.mark.parametrize("k", [1, 4])
def test_a1_keeps_every_guess_and_equals_greedy(target, draft, k):
    out, stats, script = _run(target, draft, 1.0, k=k)
    assert out == script
    assert stats.proposed > 0 and stats.accepted == stats.proposed and stats.rejected == 0
    # every full pass emits k + 1 tokens (the last one may be cut by the budget)
    assert all(e == k + 1 for e in stats.emitted[:-1])


def test_a0_keeps_none_and_equals_greedy(target, draft):
    out, stats, script = _run(target, draft, 0.0)
    assert out == script
    # every pass that checked a guess rejected it (the last may draft none: the budget)
    assert stats.accepted == 0 and stats.rejected >= stats.target_passes - 1
    assert stats.tokens_per_pass == 1.0


@pytest.mark.parametrize("a,seed", [(0.3, 0), (0.8, 1)])
def test_measured_acceptance_tracks_a(target, draft, a, seed):
    out, stats, script = _run(target, draft, a, n=160, seed=seed, prompt_seed=seed)
    assert out == script
    checked = stats.accepted + stats.rejected
    tolerance = 4 * (a * (1 - a) / checked) ** 0.5   # four binomial standard errors
    assert abs(stats.acceptance_prob - a) < tolerance, (stats.acceptance_prob, a, checked)


def test_seeded_runs_repeat(target, draft):
    _, first, _ = _run(target, draft, 0.5, seed=7)
    _, again, _ = _run(target, draft, 0.5, seed=7)
    assert first.emitted == again.emitted


def test_each_step_pays_the_draft_models_passes(target, draft):
    """k draft passes per step (one catch-up, k - 1 decode steps), as ModelDrafter runs."""
    calls: list[int] = []
    hook = draft.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[1]))
    try:
        _, stats, _ = _run(target, draft, 0.5, n=30, k=4)
    finally:
        hook.remove()
    prefill_calls = 1  # the draft's prompt prefill (all but the last prompt token)
    assert len(calls) - prefill_calls == stats.proposed  # one pass per guess
    assert all(t in (1, 2) for t in calls[prefill_calls:])


def test_sampling_is_refused(target, draft):
    prompt = random_prompt(TARGET.vocab_size, 5)
    drafter = ReplayDrafter(draft, greedy_script(target, prompt, 8), 0.5)
    with pytest.raises(ValueError, match="temperature 0"):
        speculative_generate(target, drafter, prompt, 8,
                             sampling=SamplingParams(temperature=0.8, seed=0))


def test_bad_arguments(draft):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ReplayDrafter(draft, [1, 2], 1.5)
    with pytest.raises(ValueError, match="empty"):
        ReplayDrafter(draft, [], 0.5)


def test_short_script_is_named(target, draft):
    prompt = random_prompt(TARGET.vocab_size, 5)
    drafter = ReplayDrafter(draft, greedy_script(target, prompt, 4), 1.0)
    with pytest.raises(ValueError, match="greedy_script"):
        speculative_generate(target, drafter, prompt, 20)


def test_divergence_raises_or_is_recorded(target, draft):
    prompt = random_prompt(TARGET.vocab_size, 5)
    script = greedy_script(target, prompt, 20)
    wrong = script[:3] + [(script[3] + 1) % TARGET.vocab_size] + script[4:]
    with pytest.raises(ScriptDiverged, match="output token 3"):
        speculative_generate(target, ReplayDrafter(draft, wrong, 1.0), prompt, 20)
    lenient = ReplayDrafter(draft, wrong, 1.0, strict=False)
    out, _ = speculative_generate(target, lenient, prompt, 20)
    assert out == script and lenient.diverged_at == 3


def test_on_static_buffers_the_replay_pays_the_same_passes_for_the_same_output(target, draft):
    """path="graph" (the CUDA default, eager on a CPU): the draft's catch-up and steps on the
    static buffers a CUDA graph replays, the same widths per step, the same tokens and
    acceptance as on the plain cache."""
    prompt = random_prompt(TARGET.vocab_size, 7, seed=0)
    script = greedy_script(target, prompt, 30)
    runs = []
    for graph in (False, True):
        calls: list[int] = []
        hook = draft.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[1]))
        try:
            out, stats = speculative_generate(
                target, ReplayDrafter(draft, script, 0.6, seed=3, path=("graph" if graph else "auto" if graph is None else "eager")), prompt, 30,
                k=4, path=("graph" if graph else "auto" if graph is None else "eager"))
        finally:
            hook.remove()
        runs.append((out, stats.emitted, calls[1:]))   # the first call: the draft's prefill
    assert runs[0] == runs[1] and runs[0][0] == script

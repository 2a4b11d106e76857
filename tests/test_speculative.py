"""Speculative decoding is lossless: greedy output is token for token the target's greedy
output (any drafter, any k, stop tokens, the context window), sampled output follows the
target's distribution (chi-square tests with fixed seeds), and after every step both KV
caches equal caches rebuilt from scratch over the committed tokens."""
from __future__ import annotations

import pytest
import torch

from tinyserve.config import ModelConfig
from tinyserve.generate import PromptError, generate, generate_ids, prefill
from tinyserve.kv_cache import KVCache
from tinyserve.model import TinyLlama
from tinyserve.sampling import SamplingParams
from tinyserve.speculative import (ModelDrafter, NGramDrafter, SpeculativeDecoder,
                                   accept_greedy, accept_greedy_logits, accept_sampled,
                                   draft_greedy, expected_tokens_per_pass, predicted_speedup,
                                   probs_for, speculative_generate)

from conftest import random_prompt, sharp_model

SMALL = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=48)
DRAFT = ModelConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=48)


@pytest.fixture(scope="module")
def target() -> TinyLlama:
    return sharp_model(SMALL, seed=1)


def _noisy_copy(model: TinyLlama, scale: float, seed: int) -> TinyLlama:
    """The target plus weight noise: a drafter that agrees often but not always."""
    copy = TinyLlama(model.config).eval()
    copy.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return copy


@pytest.fixture(scope="module")
def drafters(target: TinyLlama) -> dict[str, object]:
    return {"unrelated model": lambda: ModelDrafter(sharp_model(DRAFT, seed=7)),
            "noisy copy": lambda: ModelDrafter(_noisy_copy(target, 0.005, seed=3)),
            "the target itself": lambda: ModelDrafter(target),
            "ngram": lambda: NGramDrafter(max_n=3, min_n=1)}


def _prompt(n: int, seed: int) -> list[int]:
    return random_prompt(SMALL.vocab_size, n, seed)


# ------------------------------------------------------------------ greedy is lossless

@pytest.mark.parametrize("k", [1, 2, 4, 6])
@pytest.mark.parametrize("which", ["unrelated model", "noisy copy", "the target itself", "ngram"])
def test_greedy_output_is_the_targets_greedy_output(target, drafters, which, k) -> None:
    for seed in range(4):
        prompt = _prompt(3 + 2 * seed, seed)
        want = generate(target, prompt, 20).tokens
        got, stats = speculative_generate(target, drafters[which](), prompt, 20, k=k)
        assert got == want, (which, k, seed)
        assert stats.accepted <= stats.proposed and stats.target_passes >= 1
    if which == "the target itself":  # a perfect drafter: every draft accepted
        assert stats.acceptance_rate == 1.0


def test_greedy_matches_the_plain_recompute_loop(target, drafters) -> None:
    prompt = _prompt(5, 11)
    want = list(generate_ids(target, prompt, 16))
    for which in ("noisy copy", "ngram"):
        assert speculative_generate(target, drafters[which](), prompt, 16, k=3)[0] == want


def test_both_verification_outcomes_happen(target, drafters) -> None:
    """The noisy drafter gets some drafts rejected and some accepted: both paths are tested."""
    _, stats = speculative_generate(target, drafters["noisy copy"](), _prompt(4, 2), 30, k=4)
    assert 0 < stats.accepted < stats.proposed
    _, stats = speculative_generate(target, drafters["unrelated model"](), _prompt(4, 2), 30, k=4)
    assert stats.accepted < stats.proposed


@pytest.mark.parametrize("which", ["noisy copy", "the target itself", "ngram"])
def test_stop_token_ends_the_output_like_generate(target, drafters, which) -> None:
    prompt = _prompt(6, 5)
    full = generate(target, prompt, 30).tokens
    stop = full[7]  # a token the target emits mid-way (maybe earlier too)
    want = generate(target, prompt, 30, stop_ids=(stop,)).tokens
    assert want[-1] == stop and len(want) < 30
    for k in (1, 3, 5):
        got, _ = speculative_generate(target, drafters[which](), prompt, 30, k=k,
                                      stop_ids=(stop,))
        assert got == want, (which, k)


@pytest.mark.parametrize("k", [1, 4, 6])
def test_fills_the_context_window_exactly(target, drafters, k) -> None:
    window = SMALL.max_position_embeddings
    prompt = _prompt(window - 13, 9)
    want = generate(target, prompt, 100).tokens
    assert len(want) == 13
    for which in ("the target itself", "noisy copy", "ngram"):
        got, _ = speculative_generate(target, drafters[which](), prompt, 100, k=k)
        assert got == want, (which, k)
    # and a budget that ends one token short of a full step
    assert speculative_generate(target, drafters["the target itself"](), prompt, 6, k=4)[0] \
        == want[:6]


def test_bad_input_names_the_limit(target, drafters) -> None:
    with pytest.raises(PromptError, match="context window"):
        speculative_generate(target, drafters["ngram"](), _prompt(48, 0), 4)
    with pytest.raises(ValueError, match="at least 1"):
        speculative_generate(target, drafters["ngram"](), _prompt(4, 0), 4, k=0)
    with pytest.raises(ValueError, match="min_n"):
        NGramDrafter(max_n=1, min_n=2)


# ------------------------------------------------------------------ caches after rejection

def _rebuilt(model: TinyLlama, tokens: list[int], max_seq: int) -> KVCache:
    cache = KVCache.for_model(model, 1, max_seq)
    prefill(model, torch.tensor([tokens]), cache)
    return cache


def _assert_same_cache(got: KVCache, want: KVCache) -> None:
    n = want.lengths[0]
    assert got.lengths == want.lengths
    torch.testing.assert_close(got.k[:, :, :, :n], want.k[:, :, :, :n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.v[:, :, :, :n], want.v[:, :, :, :n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_after_every_step_equal_caches_built_by_recompute(target, temperature) -> None:
    draft_model = _noisy_copy(target, 0.005, seed=3)
    drafter = ModelDrafter(draft_model)
    dec = SpeculativeDecoder(target, drafter, 4, SamplingParams(temperature, seed=0))
    prompt = _prompt(5, 4)
    dec.prefill(prompt, 40)
    rejections = 0
    while len(dec.context) < 34:
        new = dec.step(4)
        rejections += len(new) < 5
        committed = dec.context[:-1]  # the invariant: every committed token but the last
        _assert_same_cache(dec.cache, _rebuilt(target, committed, 40))
        # The draft cache may lag by the bonus step's last draft; what it holds is right.
        n = drafter.cache.lengths[0]
        assert len(committed) - 1 <= n <= len(committed)
        _assert_same_cache(drafter.cache, _rebuilt(draft_model, dec.context[:n], 40))
    assert rejections > 0


# ------------------------------------------------------------------ sampling is lossless

def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over cells with expected count >= 5 (the rest pooled)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


# 99.9th percentiles of chi-square: a correct sampler fails one seed in a thousand, and
# the seeds are fixed, so the test is deterministic.
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 15: 37.70}


def _chi2_limit(dof: int) -> float:
    if dof in CHI2_999:
        return CHI2_999[dof]
    # Wilson-Hilferty approximation of the 99.9th percentile (z = 3.09)
    return dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3


@pytest.mark.parametrize("deterministic_drafter", [False, True])
def test_rejection_sampling_emits_tokens_distributed_as_p(deterministic_drafter) -> None:
    """Toy distributions over 6 tokens where the drafter over-proposes some tokens and
    never proposes others: the first emitted token must still follow p."""
    p = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.07, 0.03], [0.1] * 5 + [0.5]])
    q = torch.tensor([[0.05, 0.05, 0.50, 0.40, 0.0, 0.0]])
    g = torch.Generator().manual_seed(123)
    n = 20_000
    counts = torch.zeros(6)
    accepted = 0
    for _ in range(n):
        if deterministic_drafter:
            draft = [3]
            out = accept_sampled(draft, p, None, g)
        else:
            draft = [int(torch.multinomial(q[0], 1, generator=g))]
            out = accept_sampled(draft, p, q, g)
        counts[out[0]] += 1
        accepted += len(out) == 2
    stat, dof = _chi_square(counts, p[0])
    assert stat < _chi2_limit(dof), (stat, dof, counts / n)
    # The acceptance rate is sum(min(p, q)): 0.05+0.05+0.2+0.15 (or p(3) = 0.15 when one-hot).
    want = 0.15 if deterministic_drafter else 0.45
    assert abs(accepted / n - want) < 4 * (want * (1 - want) / n) ** 0.5


def _exact_joint(model: TinyLlama, prompt: list[int], n: int, sampling: SamplingParams):
    """Exact probability of every n-token continuation (vocab^n of them)."""
    V = model.config.vocab_size
    joint = torch.ones(1)
    seqs = [prompt]
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor(seqs))[:, -1]
        probs = probs_for(logits, sampling)               # (len(seqs), V)
        joint = (joint[:, None] * probs).reshape(-1)
        seqs = [s + [t] for s in seqs for t in range(V)]
    return joint


@pytest.mark.parametrize("which", ["model", "ngram"])
def test_sampled_output_follows_the_targets_distribution(which) -> None:
    """A 4-token vocabulary, so all 64 three-token outputs can be enumerated exactly. The
    first token comes from prefill, the next two from one verification pass (a draft
    accepted plus the bonus token, or the correction and then the next step's token)."""
    cfg = ModelConfig(vocab_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(0)
    target = TinyLlama(cfg).eval()
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(2)  # spread: about 24 of the 64 outputs have probability > 1%
    torch.manual_seed(1)
    draft = TinyLlama(cfg).eval()
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(2)
    sampling = SamplingParams(temperature=1.0, seed=2024)
    prompt = [0, 1, 2, 1, 0, 1]
    exact = _exact_joint(target, prompt, 3, sampling)
    drafter = ModelDrafter(draft) if which == "model" else NGramDrafter(max_n=2, min_n=1)
    dec_counts = torch.zeros(64)
    n, proposed, accepted = 1500, 0, 0
    g = torch.Generator().manual_seed(7)
    for i in range(n):
        seed = int(torch.randint(0, 2**31, (1,), generator=g))
        out, stats = speculative_generate(target, drafter, prompt, 3, k=2,
                                          sampling=SamplingParams(1.0, seed=seed))
        dec_counts[out[0] * 16 + out[1] * 4 + out[2]] += 1
        proposed, accepted = proposed + stats.proposed, accepted + stats.accepted
    stat, dof = _chi_square(dec_counts, exact)
    assert stat < _chi2_limit(dof), (stat, dof)
    assert 0 < accepted < proposed  # both accept and reject paths were exercised


# ------------------------------------------------------------------ pieces and formulas

def test_accept_greedy_keeps_the_agreeing_prefix_plus_one() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]   # all + bonus
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]         # correction at 2nd
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]            # first rejected
    assert accept_greedy([], [4]) == [4]                            # plain decode step


class _CountingModel:
    """A draft model with its own "cache" (the tokens fed so far) whose logits put the most
    weight on (last token + 1) % 8: its greedy guesses are known."""
    def __init__(self) -> None:
        self.fed: list[int] = []

    @property
    def length(self) -> int:
        return len(self.fed)

    def feed(self, tokens: list[int]) -> torch.Tensor:
        self.fed += tokens
        return torch.nn.functional.one_hot(torch.tensor([(t + 1) % 8 for t in tokens]), 8).float()


def test_the_greedy_references_build_speculative_grades_its_loop_on() -> None:
    # build_speculative's loop is graded on these two, not on the learner's own parts 1 and 2.
    model = _CountingModel()
    model.fed = [3, 4]                                              # a cached prefix
    assert draft_greedy(model, [3, 4, 5, 6], 3) == [7, 0, 1]
    assert model.fed == [3, 4, 5, 6, 7, 0]                          # only what it lacked; k-1 guesses
    logits = torch.nn.functional.one_hot(torch.tensor([7, 0, 2, 5]), 8).float()
    assert accept_greedy_logits([7, 0, 1], logits) == [7, 0, 2]    # correction at the third


def test_the_greedy_references_name_a_learners_mistake() -> None:
    with pytest.raises(ValueError, match="1 or more; got 0"):
        draft_greedy(_CountingModel(), [1, 2], 0)
    stale = _CountingModel()
    stale.fed = [1, 2, 3, 4]                                        # rejected guesses kept
    with pytest.raises(ValueError, match=r"holds 4 positions .* roll it back to len\(context\) - 1"):
        draft_greedy(stale, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="len\\(draft\\) \\+ 1 = 4 positions"):
        accept_greedy_logits([7, 0, 1], torch.zeros(3, 8))          # the guesses' logits only


def test_ngram_drafter_proposes_what_followed_the_latest_match() -> None:
    d = NGramDrafter(max_n=3, min_n=1)
    d.start([], 100)
    ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2]
    draft, q = d.propose(ctx, 3, SamplingParams(), None)
    assert q is None and draft == [3, 5, 7]  # "1 2" last followed by "3 5 7"
    assert d.propose([8, 8, 6], 2, SamplingParams(), None)[0] == []   # no match: no draft
    corpus = NGramDrafter(max_n=2, min_n=2, corpus=[[4, 6, 1, 2, 3]])
    corpus.start([], 100)
    assert corpus.propose([9, 4, 6], 2, SamplingParams(), None)[0] == [1, 2]


def test_expected_tokens_formula() -> None:
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1.75)
    assert predicted_speedup(0.5, 2, draft_cost=0.0) == pytest.approx(1.75)
    assert predicted_speedup(0.0, 3, draft_cost=0.5) == pytest.approx(1 / 2.5)
    with pytest.raises(ValueError):
        expected_tokens_per_pass(1.5, 2)


def test_stats_count_checked_drafts(target) -> None:
    drafter = ModelDrafter(_noisy_copy(target, 0.005, seed=3))
    out, st = speculative_generate(target, drafter, _prompt(4, 2), 30, k=4)
    assert st.target_passes == len(st.emitted) and sum(st.emitted) == len(out) - 1
    # every pass emits its accepted drafts plus one target token
    assert st.accepted == sum(st.emitted) - st.target_passes
    assert 0 < st.rejected <= st.target_passes
    assert st.acceptance_prob == st.accepted / (st.accepted + st.rejected)
    assert st.acceptance_prob >= st.acceptance_rate


def test_measured_tokens_per_pass_follows_the_formula_for_iid_acceptance() -> None:
    """Simulate verification with each draft matching with probability a: the mean of
    accept_greedy's output length is (1 - a^(k+1)) / (1 - a)."""
    g = torch.Generator().manual_seed(0)
    a, k, n = 0.7, 4, 20_000
    total = 0
    for _ in range(n):
        match = (torch.rand(k, generator=g) < a).tolist()
        target = [1] * (k + 1)
        draft = [1 if m else 2 for m in match]
        total += len(accept_greedy(draft, target))
    assert total / n == pytest.approx(expected_tokens_per_pass(a, k), abs=0.03)


# ------------------------------------------------------------------ on plain decoding's step code

def _recording(model: TinyLlama, name: str, log: list[tuple[str, int, bool, int]]) -> TinyLlama:
    """``model`` with each forward pass logged: (name, tokens fed per row, whether inference
    mode was on, positions scored)."""
    forward = model.forward

    def logged(*args, **kwargs):
        logits = forward(*args, **kwargs)
        log.append((name, args[0].shape[1], torch.is_inference_mode_enabled(), logits.shape[1]))
        return logits
    model.forward = logged  # an instance attribute: nn.Module.__call__ finds it first
    return model


def test_a_step_is_k_draft_passes_and_one_verify_pass_on_the_decode_step_code(target) -> None:
    """What the cost model prices is what runs: per step, k draft passes (the first catching
    up on at most 2 tokens, the rest one token each) and one target pass over the last token
    and the k guesses, every one in inference mode like plain decoding; each prefill scores
    one position, not the whole prompt. The tokens are the plain greedy tokens."""
    log: list[tuple[str, int, bool, int]] = []
    tgt = _recording(_noisy_copy(target, 0.0, seed=0), "target", log)
    drafter = ModelDrafter(_recording(_noisy_copy(target, 0.005, seed=3), "draft", log))
    prompt, k = _prompt(6, 4), 4
    want = generate(target, prompt, 30).tokens
    got, stats = speculative_generate(tgt, drafter, prompt, 30, k=k)
    assert got == want
    assert all(inference for _, _, inference, _ in log)
    assert [(who, scored) for who, _, _, scored in log[:2]] == [("draft", 1), ("target", 1)]
    steps, drafted = [], []                  # per step: the draft passes' widths, then the verify's
    for who, fed, _, _ in log[2:]:
        if who == "draft":
            drafted.append(fed)
        else:
            steps.append((drafted, fed))
            drafted = []
    assert drafted == [] and len(steps) == stats.target_passes > 1
    for n, (widths, verified) in enumerate(steps):
        budget = 30 - (1 + sum(stats.emitted[:n])) - 1      # what speculative_generate asks for
        assert len(widths) == min(k, budget)
        assert widths[:1] in ([], [1], [2]) and widths[1:] == [1] * (len(widths[1:]))
        assert verified == len(widths) + 1                  # the last token and the guesses


# ------------------------------------------------------------------ static buffers (CUDA graphs)

def _static_pair(target: TinyLlama) -> tuple[ModelDrafter, ModelDrafter]:
    """The same noisy-copy draft model, drafting on the plain cache and on static buffers."""
    draft = _noisy_copy(target, 0.005, seed=3)
    return ModelDrafter(draft, path="eager"), ModelDrafter(draft, path="graph")


@pytest.mark.parametrize("k", [1, 4])
def test_static_buffer_passes_give_the_plain_paths_tokens(target, k) -> None:
    """path="graph" on a CPU: the draft steps and the verify pass run eagerly on the static
    buffers a CUDA graph replays (tinyserve/backends/spec_graphs.py); greedy tokens are the target's
    greedy tokens, seeded sampled tokens those of the plain speculative path, stop tokens and
    the window end as on the plain path, for a draft model and an n-gram drafter."""
    plain, static = _static_pair(target)
    for seed in range(3):
        prompt = _prompt(3 + 4 * seed, seed)
        want = generate(target, prompt, 24).tokens
        for drafter in (static, NGramDrafter(max_n=3, min_n=1)):
            got, _ = speculative_generate(target, drafter, prompt, 24, k=k, path="graph")
            assert got == want, (seed, type(drafter).__name__)
        sampled = SamplingParams(temperature=1.0, seed=seed)
        assert speculative_generate(target, static, prompt, 24, k=k, sampling=sampled,
                                    path="graph")[0] == \
            speculative_generate(target, plain, prompt, 24, k=k, sampling=sampled,
                                 path="eager")[0]
    stop = want[5]
    assert speculative_generate(target, static, prompt, 24, k=k, stop_ids=(stop,),
                                path="graph")[0] == generate(target, prompt, 24,
                                                           stop_ids=(stop,)).tokens
    window = SMALL.max_position_embeddings
    prompt = _prompt(window - 9, 9)
    assert speculative_generate(target, static, prompt, 100, k=k, path="graph")[0] == \
        generate(target, prompt, 100).tokens


def test_static_buffers_are_reused_and_a_rewind_is_the_hosts_count(target) -> None:
    """One set of buffers per model and shape, handed back after each request and reused
    (the graphs with them); a rejected draft is dropped by the host's length alone, and
    the next pass overwrites its slot before any query sees it."""
    from tinyserve.backends.spec_graphs import static_passes
    drafter = ModelDrafter(_noisy_copy(target, 0.03, seed=3), path="graph")  # often wrong
    prompt = _prompt(7, 3)
    dec = SpeculativeDecoder(target, drafter, 4, path="graph")
    dec.prefill(prompt, 40)
    passes, draft_passes = dec.passes, drafter.passes
    addresses = [t.data_ptr() for t in (*passes.cache.k, *passes.tokens.values(),
                                        *passes.cache.positions.values())]
    while len(dec.context) < 30:
        dec.step(4)
        assert passes.length == len(dec.context) - 1            # all but the last token
        assert draft_passes.length <= len(dec.context) - 1
    assert dec.stats.rejected > 0 and dec.stats.accepted > 0     # both paths ran
    assert dec.context[len(prompt):] == generate(target, prompt, 30).tokens[:len(dec.context)
                                                                           - len(prompt)]
    dec.release()
    assert not passes.in_use
    again = static_passes(target, 40, range(1, 6), capture=False)
    assert again is passes                                      # handed back, reused
    again.release()
    speculative_generate(target, drafter, prompt, 20, k=4, path="graph")
    assert drafter.passes is None and not passes.in_use and not draft_passes.in_use   # both
    again = static_passes(drafter.model, 40, ModelDrafter.WIDTHS, capture=False)  # handed back
    assert again is draft_passes
    again.release()
    assert addresses == [t.data_ptr() for t in (*passes.cache.k, *passes.tokens.values(),
                                                *passes.cache.positions.values())]
    with pytest.raises(ValueError, match="at most k=4"):
        dec = SpeculativeDecoder(target, drafter, 4, path="graph")
        dec.prefill(prompt, 40)
        dec.step(5)
    dec.release()


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(1.0, seed=5)],
                         ids=["greedy", "seeded"])
def test_on_cuda_draft_and_verify_passes_replay_graphs_with_the_eager_tokens(target,
                                                                           sampling) -> None:
    """The default on CUDA: the draft's passes (widths 1, 2) and the verify pass (widths
    1..k+1) captured once and replayed; greedy tokens are the eager path's, and a second
    request replays without capturing again."""
    gpu_target = _noisy_copy(target, 0.0, seed=0).to("cuda")
    draft = _noisy_copy(target, 0.005, seed=3).to("cuda")
    prompt = _prompt(9, 2)
    eager, _ = speculative_generate(gpu_target, ModelDrafter(draft, path="eager"), prompt, 30,
                                    k=4, sampling=sampling, path="eager")
    drafter = ModelDrafter(draft)                              # graph by default on CUDA
    got, _ = speculative_generate(gpu_target, drafter, prompt, 30, k=4, sampling=sampling)
    if sampling.temperature == 0:
        assert got == eager == generate(gpu_target, prompt, 30, path="eager").tokens
    else:   # the same seeded draws; a float near-tie could differ between the two paths
        assert len(got) == len(eager)
    assert set(drafter.passes.graphs) == {1, 2} and drafter.passes.captures == 2
    dec = SpeculativeDecoder(gpu_target, drafter, 4)
    dec.prefill(prompt, len(prompt) + 30)
    assert set(dec.passes.graphs) == {1, 2, 3, 4, 5} and dec.passes.captures == 5
    dec.release()
    speculative_generate(gpu_target, drafter, prompt, 30, k=4, sampling=sampling)
    assert drafter.passes.captures == 2                       # replayed, not captured again

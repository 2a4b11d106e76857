"""No host read inside a step: a cached forward pass reads nothing back from the device, an
engine step reads once (its sampled tokens), and so does a step of generate_stream and
generate_batch; a speculative step reads its drafts and its verdicts (stated maxima below). Counted on the CPU with :mod:`host_reads`: the
code path is the one a GPU runs, so the counts hold there too. Each fast path is also held
equal to its plain reference (explicit positions, per-row CPU sampling)."""
from __future__ import annotations

import pytest
import torch

from tinyserve.config import ModelConfig
from tinyserve.engine import Engine, EngineConfig
from tinyserve.generate import decode_step, prefill
from tinyserve.kv_cache import CacheFullError, KVCache
from tinyserve.model import TinyLlama
from tinyserve.paged import PagedKVCache, RowSpec
from tinyserve.quant import Int8KVCache
from tinyserve.sampling import SamplingParams

from conftest import random_prompt, sharp_model
from host_reads import HostReads, count_reads

CFG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48)


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return sharp_model(CFG, seed=3)


def _prompts(*lengths: int) -> list[list[int]]:
    return [random_prompt(CFG.vocab_size, n, seed=10 + n) for n in lengths]


def test_the_counter_sees_every_kind_of_read() -> None:
    t = torch.arange(6)
    for mode in (torch.no_grad, torch.inference_mode):   # .item() skips dispatch in the latter
        with mode(), HostReads() as reads:
            t.sum() + 1                                    # device work only: no read
            int(t.max()), t[0].item(), bool(t[1] > 0), float(t.float().mean())
            t.tolist(), t.cpu(), t.numpy()
            torch.multinomial(torch.ones(1, 4), 1)         # checks its probabilities
        assert reads.count == 8, reads.where


@pytest.mark.parametrize("cache_cls", [KVCache, Int8KVCache])
def test_a_cached_step_with_the_caches_positions_reads_nothing(model, cache_cls) -> None:
    """Prefill, uniform decode, a ragged decode after rewind, a (k+1)-token extend: 0 reads,
    and the logits and lengths of the explicit-positions path (which reads) at every step."""
    prompts = torch.tensor(_prompts(7, 7))
    fast, slow = cache_cls.for_model(model, 2, 24), cache_cls.for_model(model, 2, 24)
    steps = [prompts, torch.tensor([[5], [6]]), "rewind", torch.tensor([[7], [8]]),
             torch.tensor([[1, 2, 3], [4, 5, 6]])]
    for ids in steps:
        if isinstance(ids, str):
            fast.rewind([4, 6])
            slow.rewind([4, 6])
            continue
        want_pos = torch.tensor(slow.lengths)[:, None] + torch.arange(ids.shape[1])
        with torch.inference_mode():
            want = model(ids, want_pos, slow)
        got, reads = count_reads(model, ids, None, fast)
        assert reads.count == 0, reads.where
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert fast.lengths == slow.lengths


def test_explicit_positions_read_once_for_the_window_and_once_for_the_cache(model) -> None:
    cache = KVCache.for_model(model, 1, 16)
    prefill(model, torch.tensor(_prompts(5)), cache)
    _, reads = count_reads(decode_step, model, torch.tensor([3]), torch.tensor([5]), cache)
    assert reads.count == 2, reads.where   # issue 24 counted 3 (the cache read twice)


def test_the_caches_positions_stop_at_its_limits_before_anything_runs(model) -> None:
    cache = KVCache.for_model(model, 1, 6)
    prefill(model, torch.tensor(_prompts(6)), cache)
    with pytest.raises(CacheFullError, match="holds 6 tokens"):
        model(torch.tensor([[1]]), None, cache)
    window = CFG.max_position_embeddings
    cache = KVCache.for_model(model, 1)
    prefill(model, torch.tensor(_prompts(window)), cache)
    with pytest.raises(ValueError, match=f"context window of {window}"):
        model(torch.tensor([[1]]), None, cache)
    assert cache.lengths == [window]
    with pytest.raises(ValueError, match=f"context window of {window}"):
        model(torch.tensor([[1] * (window + 1)]))          # no cache: 0..T-1, checked on the host
    paged = PagedKVCache(CFG, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match=f"position {window} is outside the context window"):
        paged.prepare([RowSpec([0], list(range(window + 1)), window)])


def _engine_run(model, prompts, sampling, **config):
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, **config))
    seqs = [engine.add_request(p, 12, sampling=s) for p, s in zip(prompts, sampling)]
    per_step = []
    while engine.has_unfinished():
        with torch.no_grad(), HostReads() as reads:
            events = engine.step()
        per_step.append((reads.count, len(events), reads.where))
    return [s.output_ids for s in seqs], per_step


def test_an_engine_step_reads_once_and_only_when_it_samples(model) -> None:
    """Greedy, seeded top-k / top-p and unseeded rows in one batch, chunked prefill (steps
    where no row reaches its end): at most one read per step, none when nothing samples."""
    prompts = _prompts(30, 21, 9, 3)   # the first steps: chunks of the 30-token prompt
    sampling = [SamplingParams(), SamplingParams(temperature=0.8, top_k=10, seed=1),
                SamplingParams(temperature=1.2, top_p=0.8, seed=2), SamplingParams(temperature=0.7)]
    _, per_step = _engine_run(model, prompts, sampling, max_num_batched_tokens=8)
    for reads, events, where in per_step:
        assert reads == (1 if events else 0), where
    assert any(events == 0 for _, events, _ in per_step)   # a prefill chunk that samples nothing


def test_engine_tokens_equal_the_per_row_reference_sampler(model) -> None:
    """The batched on-device draw gives every request the tokens of the plain loop that draws
    row by row on the CPU (``generate``'s ``sample_with``): greedy and seeded rows."""
    from tinyserve.generate import generate
    prompts = _prompts(4, 11, 6)
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=5),
                SamplingParams(temperature=1.1, top_k=30, top_p=0.85, seed=6)]
    got, _ = _engine_run(model, prompts, sampling, max_num_batched_tokens=10)
    assert got == [generate(model, p, 12, sampling=s).tokens for p, s in zip(prompts, sampling)]


@pytest.mark.gpu
def test_on_cuda_a_seeded_engine_run_repeats_and_steps_still_read_once(model) -> None:
    """The seeded generators move to the device (one per request, made before its first
    draw): the same seeds give the same tokens twice, and no step reads more than once."""
    gpu = sharp_model(CFG, seed=3).to("cuda")
    prompts = _prompts(5, 13)
    sampling = [SamplingParams(temperature=0.9, top_k=20, seed=1),
                SamplingParams(temperature=1.1, top_p=0.8, seed=2)]
    first, per_step = _engine_run(gpu, prompts, sampling)
    again, _ = _engine_run(gpu, prompts, sampling)
    assert first == again and all(len(t) == 12 for t in first)
    assert all(reads <= 1 for reads, _, _ in per_step)


# ------------------------------------------------------------------ the decoding loops
# Stated maxima, per step (prefill included in the first): what the host must know to go on.
STREAM_READS = 1        # the sampled token (to yield it and to check for a stop)
BATCH_READS = 1         # the rows' sampled tokens, one list
SPEC_GREEDY_READS = 2   # the draft's k guesses, once; the verify pass's k + 1 argmaxes, once
SPEC_NGRAM_READS = 1    # n-gram guesses are host lists: only the verify pass's argmaxes
# Sampled speculative decoding keeps the reference acceptance (Leviathan et al.'s rejection
# sampling on the CPU, seeded, the same on any device): per step each guess's distribution
# q and the verify pass's p go to the host (k + 1 device reads), and the draws and the
# accept test read host tensors (free on any device, but counted: at most k + 5 of them).
def spec_sampled_device_reads(k: int) -> int:
    return k + 1


@pytest.mark.parametrize("sampling", [SamplingParams(),
                                      SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=4)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("graph", [False, True], ids=["cache", "static-buffers"])
def test_a_generate_stream_step_reads_the_sampled_token_only(model, sampling, graph) -> None:
    from tinyserve.generate import generate, generate_stream
    prompt = _prompts(9)[0]
    stream = generate_stream(model, prompt, 12, sampling=sampling, path=("graph" if graph else "auto" if graph is None else "eager"))
    tokens = []
    while True:
        with torch.no_grad(), HostReads() as reads:
            token = next(stream, None)
        if token is None:
            break
        tokens.append(token)
        assert reads.count <= STREAM_READS, reads.where
    # the same tokens as recompute, which passes no cache (and reads whatever it likes)
    assert tokens == generate(model, prompt, 12, sampling=sampling, use_cache=False).tokens


def test_a_generate_batch_step_reads_the_rows_tokens_once(model) -> None:
    from tinyserve.generate import generate_batch
    prompts = _prompts(3, 11, 6)
    for graph in (False, True):
        out, reads = count_reads(generate_batch, model, prompts, 10, path=("graph" if graph else "auto" if graph is None else "eager"))
        steps = max(len(o) for o in out)
        assert reads.count <= BATCH_READS * steps, reads.where
        assert out == generate_batch(model, prompts, 10, use_cache=False)


def _spec_step_reads(model, drafter, k=4, steps=6, path="auto"):
    from tinyserve.speculative import SpeculativeDecoder
    dec = SpeculativeDecoder(model, drafter, k, path=path)
    prompt = _prompts(8)[0] * 2                      # repeats: the n-gram drafter finds them
    dec.prefill(prompt, len(prompt) + steps * (k + 1) + 2)
    counts = []
    for _ in range(steps):
        _, reads = count_reads(dec.step, k)
        counts.append((reads.count, reads.where))
    return dec.context[len(prompt):], counts


def test_a_speculative_step_reads_the_drafts_and_the_verdicts_once_each(model) -> None:
    from tinyserve.generate import generate
    from tinyserve.speculative import ModelDrafter, NGramDrafter
    draft = sharp_model(CFG, seed=4)
    for drafter, most in ((ModelDrafter(draft), SPEC_GREEDY_READS),
                          (NGramDrafter(max_n=3, min_n=1), SPEC_NGRAM_READS)):
        tokens, counts = _spec_step_reads(model, drafter)
        for reads, where in counts:
            assert reads <= most, where
        prompt = _prompts(8)[0] * 2
        assert tokens == generate(model, prompt, len(tokens), use_cache=False).tokens


def test_a_sampled_speculative_step_moves_each_distribution_to_the_host_once(model) -> None:
    from tinyserve.speculative import ModelDrafter, NGramDrafter, SpeculativeDecoder
    k = 4
    for drafter, q_reads in ((ModelDrafter(sharp_model(CFG, seed=4)), k),
                             (NGramDrafter(max_n=3, min_n=1), 0)):
        dec = SpeculativeDecoder(model, drafter, k, SamplingParams(temperature=0.9, seed=3))
        prompt = _prompts(8)[0] * 2
        dec.prefill(prompt, len(prompt) + 6 * (k + 1) + 2)
        for _ in range(6):
            _, reads = count_reads(dec.step, k)
            to_host = [w for w in reads.where if w.startswith("Tensor.cpu")]
            assert len(to_host) <= q_reads + 1, reads.where     # the q's and p
            assert len(to_host) <= spec_sampled_device_reads(k)
            assert reads.count <= 2 * k + 6, reads.where


def test_a_speculative_step_on_static_buffers_reads_as_the_plain_one(model) -> None:
    """The draft and verify passes on the static buffers a CUDA graph replays (run eagerly
    here, path="graph"): positions copied in from the host's count, a rewind the host's count
    only, so a step reads what the plain step reads, and gives its tokens."""
    from tinyserve.generate import generate
    from tinyserve.speculative import ModelDrafter, NGramDrafter
    draft = sharp_model(CFG, seed=4)
    for drafter, most in ((ModelDrafter(draft, path="graph"), SPEC_GREEDY_READS),
                          (NGramDrafter(max_n=3, min_n=1), SPEC_NGRAM_READS)):
        tokens, counts = _spec_step_reads(model, drafter, path="graph")
        for reads, where in counts:
            assert reads <= most, where
        prompt = _prompts(8)[0] * 2
        assert tokens == generate(model, prompt, len(tokens), use_cache=False).tokens

"""CUDA-graph decode (tinyserve/backends/cuda_graph.py): buckets, padding to the bucket, buffers and
decoders reused, and the same tokens as the plain KV-cache step. On the CPU the decoder runs
its static-buffer step eagerly (no capture): everything but the capture itself is tested
here; the capture is tested by the gpu-marked tests (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from tinyserve.config import ModelConfig
from tinyserve.backends.cuda_graph import GraphDecoder, graph_decoder
from tinyserve.backends.static import bucket_for, buckets
from tinyserve.generate import generate, generate_batch, generate_stream
from tinyserve.kv_cache import CacheFullError
from tinyserve.model import TinyLlama
from tinyserve.sampling import SamplingParams

from conftest import random_prompt, sharp_model
from host_reads import HostReads

CFG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96)
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=4)


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return sharp_model(CFG, seed=5)


def _prompts(*lengths: int) -> list[list[int]]:
    return [random_prompt(CFG.vocab_size, n, seed=20 + n) for n in lengths]


def test_buckets_are_1_2_4_8_then_steps_of_16() -> None:
    assert buckets()[:7] == (1, 2, 4, 8, 16, 32, 48) and buckets()[-1] == 512
    assert buckets(40) == (1, 2, 4, 8, 16, 32) and buckets(3) == (1, 2)
    assert [bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 500)] == \
        [1, 2, 4, 8, 8, 16, 16, 32, 48, 512]
    with pytest.raises(ValueError, match="at most 512 rows"):
        bucket_for(513)
    with pytest.raises(ValueError, match="at least one row"):
        bucket_for(0)


@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_the_static_buffer_step_gives_the_plain_steps_tokens(model, sampling) -> None:
    """One request and a ragged batch (3 rows padded to the bucket of 4): the static-buffer
    step (eager here, the code a graph records) equals the KV-cache step and recompute."""
    prompt = _prompts(9)[0]
    plain = generate(model, prompt, 30, sampling=sampling, path="eager").tokens
    assert generate(model, prompt, 30, sampling=sampling, path="graph").tokens == plain
    assert generate(model, prompt, 30, sampling=sampling, use_cache=False).tokens == plain
    prompts = _prompts(3, 11, 6)
    plain = generate_batch(model, prompts, 20, sampling=sampling, path="eager")
    assert generate_batch(model, prompts, 20, sampling=sampling, path="graph") == plain
    assert generate_batch(model, prompts, 20, sampling=sampling, use_cache=False) == plain


def test_an_int8_model_takes_the_static_buffer_step_too(model) -> None:
    from tinyserve.quant import quantize_model
    int8 = quantize_model(model)
    prompts = _prompts(4, 9)
    assert generate_batch(int8, prompts, 12, path="graph") == \
        generate_batch(int8, prompts, 12, path="eager")


def test_stops_and_the_window_end_as_the_plain_loop(model) -> None:
    prompt = _prompts(5)[0]
    plain = generate(model, prompt, 20, path="eager")
    stop = plain.tokens[6]
    for graph in (False, True):
        trace = generate(model, prompt, 20, stop_ids=(stop,), path=("graph" if graph else "auto" if graph is None else "eager"))
        assert trace.tokens == plain.tokens[:plain.tokens.index(stop) + 1]
        assert trace.finish_reason == "stop"
    near = _prompts(CFG.max_position_embeddings - 4)[0]    # 4 tokens to the window's end
    trace = generate(model, near, 50, path="graph")
    assert trace.tokens == generate(model, near, 50, path="eager").tokens
    assert len(trace.tokens) == 4 and trace.finish_reason == "window"


def test_a_batch_is_padded_to_its_bucket_and_the_decoder_is_reused(model) -> None:
    first = graph_decoder(model, 3, tokens=40)
    assert first.batch_size == 4 and first.cache.batch_size == 4 and first.window == 64
    assert first.in_use
    other = graph_decoder(model, 4, tokens=40)          # the first is busy: a second one
    assert other is not first and other.batch_size == 4
    first.release()
    other.release()
    assert graph_decoder(model, 3, tokens=40) is first  # free again: the same buffers
    first.release()
    assert graph_decoder(model, 3, tokens=90).window == CFG.max_position_embeddings
    graph_decoder(model, 3, tokens=90).release()


def test_buffers_keep_their_addresses_and_padding_rows_touch_no_real_row(model) -> None:
    """A graph replays reads and writes of fixed addresses: every step must go through the
    same tensors. Padding rows write only the last slot of their own rows."""
    decoder = GraphDecoder(model, 4, 64, capture=False)
    prompts = _prompts(7, 4)
    ids = torch.tensor([p + [0] * (7 - len(p)) for p in prompts])
    addresses = [t.data_ptr() for t in (decoder.tokens, decoder.cache.positions,
                                        *decoder.cache.k, *decoder.cache.v)]
    logits = decoder.prefill(ids, [7, 4])
    assert logits.shape == (2, CFG.vocab_size)
    pad_rows = [k[2:].clone() for k in decoder.cache.k]
    positions = [7, 4]
    for _ in range(5):
        token = logits.argmax(-1)
        logits = decoder.step(token, positions)
        positions = [p + 1 for p in positions]
    assert addresses == [t.data_ptr() for t in (decoder.tokens, decoder.cache.positions,
                                                *decoder.cache.k, *decoder.cache.v)]
    assert decoder.cache.positions[:, 0].tolist() == [11, 8, 63, 63]
    for before, k in zip(pad_rows, decoder.cache.k):
        assert torch.equal(before[:, :63], k[2:, :63])    # only slot 63 written
    assert decoder.graph is None and decoder.captures == 0   # no capture on a CPU


def test_two_streams_at_once_get_a_decoder_each(model) -> None:
    a, b = _prompts(5, 8)
    want_a = generate(model, a, 12, path="eager").tokens
    want_b = generate(model, b, 12, path="eager").tokens
    sa, sb = generate_stream(model, a, 12, path="graph"), generate_stream(model, b, 12, path="graph")
    got_a, got_b = [], []
    for ta, tb in zip(sa, sb):                            # interleaved, step by step
        got_a.append(ta)
        got_b.append(tb)
    assert (got_a, got_b) == (want_a, want_b)


def test_a_graph_step_reads_only_the_sampled_token(model) -> None:
    """The static-buffer step reads nothing back (a read during capture is an error): each
    step of generate_stream reads once, its sampled token; prefill included."""
    for sampling in (SamplingParams(), SEEDED):
        stream = generate_stream(model, _prompts(6)[0], 10, sampling=sampling, path="graph")
        while True:
            with torch.no_grad(), HostReads() as reads:
                token = next(stream, None)
            if token is None:
                break
            assert reads.count == 1, reads.where


def test_wrong_uses_are_refused_with_a_message(model) -> None:
    with pytest.raises(ValueError, match="need a CUDA device"):
        GraphDecoder(model, 1, 64, capture=True)
    decoder = GraphDecoder(model, 2, 64, capture=False)
    with pytest.raises(ValueError, match="1 to 2 rows"):
        decoder.prefill(torch.zeros(3, 4, dtype=torch.long), [4, 4, 4])
    decoder.prefill(torch.zeros(1, 4, dtype=torch.long), [4])
    with pytest.raises(CacheFullError, match="64 slots"):
        decoder.step(torch.tensor([1]), [64])
    with pytest.raises(ValueError, match="needs the KV cache"):
        next(generate_stream(model, [1, 2], 3, use_cache=False, path="graph"))


# ------------------------------------------------------------------ the capture (CUDA only)

@pytest.fixture(scope="module")
def gpu_model() -> TinyLlama:
    return sharp_model(CFG, seed=5).to("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_on_cuda_the_replayed_graph_gives_the_eager_tokens(gpu_model, sampling) -> None:
    prompt = _prompts(9)[0]
    eager = generate(gpu_model, prompt, 30, sampling=sampling, path="eager").tokens
    assert generate(gpu_model, prompt, 30, sampling=sampling).tokens == eager   # the default
    prompts = _prompts(3, 11, 6)
    assert generate_batch(gpu_model, prompts, 20, sampling=sampling) == \
        generate_batch(gpu_model, prompts, 20, sampling=sampling, path="eager")


@pytest.mark.gpu
def test_on_cuda_a_graph_is_captured_once_and_again_when_weights_move(gpu_model) -> None:
    prompt = _prompts(7)[0]
    generate(gpu_model, prompt, 8)
    decoder = graph_decoder(gpu_model, 1, tokens=len(prompt) + 8)
    decoder.release()
    assert decoder.graph is not None and decoder.captures == 1
    generate(gpu_model, prompt, 8)
    assert decoder.captures == 1                         # replayed, not captured again
    model = sharp_model(CFG, seed=6).to("cuda")
    generate(model, prompt, 8)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(0.5)  # the stacked copy is rebuilt
    want = generate(model, prompt, 8, path="eager").tokens
    assert generate(model, prompt, 8).tokens == want
    decoder = graph_decoder(model, 1, tokens=len(prompt) + 8)
    decoder.release()
    assert decoder.captures == 2


@pytest.mark.gpu
def test_on_cuda_buckets_share_one_pool_and_each_keeps_its_logits(gpu_model) -> None:
    """Two buckets captured into the shared pool, replayed in turn: each step's logits are
    the caller's copy, equal to the eager step's."""
    one, four = graph_decoder(gpu_model, 1, tokens=40), graph_decoder(gpu_model, 4, tokens=40)
    try:
        p1 = torch.tensor(_prompts(6), device="cuda")
        p4 = torch.tensor(_prompts(6) * 4, device="cuda")
        l1, l4 = one.prefill(p1, [6]), four.prefill(p4, [6] * 4)
        assert one.graph is not None and four.graph is not None
        s1 = one.step(l1.argmax(-1), [6])
        s4 = four.step(l4.argmax(-1), [6] * 4)
        torch.testing.assert_close(s4[0], s1[0], rtol=1e-3, atol=1e-3)
        again = one.step(s1.argmax(-1), [7])
        assert not torch.equal(again, s1) and torch.isfinite(s4).all()
    finally:
        one.release()
        four.release()


def test_the_comparison_reports_both_steps_and_runs_as_a_command(model, tmp_path) -> None:
    """``python -m tinyserve.graph_check`` (gpu-check's graph-decode step): on a CPU the graph
    side is the same step run eagerly (no capture), so only the report's shape is checked."""
    import json
    from tinyserve import graph_check
    row = graph_check.compare(model, batch=2, prompt=12, n=4, repeats=1, bandwidth=1e9)
    assert row["eager_step_s"] > 0 and row["graph_step_s"] > 0 and row["captured"] == 0.0
    assert row["graph_vs_eager"] == row["eager_step_s"] / row["graph_step_s"]
    assert row["eager_mbu"] > 0 and row["graph_mbu"] > 0
    out = tmp_path / "graph.json"
    assert graph_check.main(["--models", "draft", "--prompt", "8", "--steps", "2",
                            "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["ratios"]) == {"graph_vs_eager_draft"}
    assert set(report["measurements"]["draft"]) >= {"eager_step_s", "graph_step_s", "capture_s"}

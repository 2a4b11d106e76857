"""The compiled decode path (tinyserve/backends/compiled.py) against the eager reference: the
static cache gives the same logits as the contiguous one, and compiled generation the same
greedy tokens as :func:`generate_batch`, traced only (seconds) and with real code generation."""
from __future__ import annotations

import pytest
import torch

from tinyserve.backends.compiled import MAX_COMPILED_BATCH, CompiledDecoder, compiled_decoder
from tinyserve.backends.static import StaticKVCache, bucket_for, window_for
from tinyserve.config import ModelConfig
from tinyserve.__main__ import main
from tinyserve.generate import (decode_step, generate_batch, generate_compiled, generate_stream,
                                prefill)
from tinyserve.kv_cache import KVCache

from conftest import random_prompt, sharp_model

SMALL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48)
#: One layer: the fewest kernels for the test that really generates code (a minute of
#: compiling on a busy 2-core machine for SMALL, a fraction of it for this).
ONE_LAYER = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)


@torch.no_grad()
def test_static_cache_gives_the_contiguous_caches_logits() -> None:
    model = sharp_model(SMALL, seed=1)
    prompts = torch.tensor([random_prompt(96, 7, seed=2), random_prompt(96, 7, seed=3)])
    ref, static = KVCache.for_model(model, 2, 20), StaticKVCache(model.config, 2, device="cpu",
                                                                 dtype=torch.float32)
    positions = torch.arange(7).expand(2, 7)
    torch.testing.assert_close(model(prompts, positions, static), prefill(model, prompts, ref))
    tokens, pos = torch.tensor([5, 9]), torch.tensor([7, 7])
    for _ in range(4):   # decode steps: one row's history, its own position
        want = decode_step(model, tokens, pos, ref)
        got = model(tokens[:, None], pos[:, None], static)[:, -1]
        torch.testing.assert_close(got, want)
        tokens, pos = want.argmax(-1), pos + 1


def test_traced_step_gives_eager_tokens_for_ragged_prompts_in_a_padded_bucket() -> None:
    model = sharp_model(SMALL, seed=4)
    prompts = [random_prompt(96, n, seed=n) for n in (3, 9, 5)]   # bucket 4: one dummy row
    want = generate_batch(model, prompts, 12, stop_ids=(7,))
    assert generate_compiled(model, prompts, 12, stop_ids=(7,), backend="eager") == want
    decoder = compiled_decoder(model, 3, backend="eager")
    assert decoder.cache.batch_size == 4 and decoder.compile_seconds is not None
    # the same decoder serves the next batch of that bucket: nothing leaks between requests
    again = [random_prompt(96, 6, seed=40 + i) for i in range(4)]
    assert generate_compiled(model, again, 8, backend="eager") == generate_batch(model, again, 8)


@torch.no_grad()
def test_a_process_compiles_more_decoders_than_dynamos_recompile_limit() -> None:
    """Every decoder compiles the same method for another self and shape: past TorchDynamo's
    recompile limit (8) the ninth failed its fullgraph compile (CI, a worker that had run
    other files' compiles first; a chapter's batch sweep would too). Each still decodes as
    the eager step does."""
    from tinyserve.backends.compiled import CompiledDecoder
    model = sharp_model(SMALL, seed=6)
    tokens, positions = torch.tensor([5]), torch.tensor([0])
    want = model(tokens[:, None], positions[:, None], KVCache.for_model(model, 1, 4))[:, -1]
    for window in range(8, 18):            # ten static shapes: ten compiles of one method
        decoder = CompiledDecoder(model, 1, backend="eager", window=window)
        assert torch.allclose(decoder.step(tokens, positions), want, atol=1e-5)


def test_a_traced_step_follows_weights_changed_after_it_was_traced() -> None:
    # The step reads the stacked weight copies the eager prefill refreshes; a weight changed
    # in place after tracing (fine-tuning, loading a checkpoint) must reach the next request.
    model = sharp_model(SMALL, seed=4)
    prompts = [random_prompt(96, 6, seed=1)]
    before = generate_batch(model, prompts, 10)
    assert generate_compiled(model, prompts, 10, backend="eager") == before
    # The reference: a model that never ran, changed the same way (no copies to go stale).
    fresh = sharp_model(SMALL, seed=4)
    with torch.no_grad():
        for m in (model, fresh):
            m.model.layers[0].mlp.up_proj.weight.mul_(-3)
            m.lm_head.weight.mul_(0.5)
    changed = generate_batch(fresh, prompts, 10)
    assert changed != before           # else stale weights would pass unseen
    assert generate_compiled(model, prompts, 10, backend="eager") == changed


def test_compiled_kernels_give_eager_tokens() -> None:
    # Real code generation (inductor: C++ on a CPU, Triton and CUDA graphs on a GPU).
    model = sharp_model(ONE_LAYER, seed=5)
    prompt = random_prompt(64, 5, seed=6)
    want = generate_batch(model, [prompt], 20)
    assert generate_compiled(model, [prompt], 20) == want
    assert compiled_decoder(model, 1).mode == "default"
    # generate_stream(path="compiled"), what `generate --compile` runs, reuses that decoder
    assert list(generate_stream(model, prompt, 20, path="compiled")) == want[0]


def test_a_token_passed_as_a_view_does_not_recompile_the_step() -> None:
    # A compiled function guards on strides: a token column of a (1, T) tensor (stride T)
    # after a first step with a fresh token (stride 1) would recompile the step, and a
    # recompile runs without the settings held around the first one (the fast path's
    # freezing): slower, silently. CompiledDecoder.step gives its inputs fresh strides.
    model = sharp_model(ONE_LAYER, seed=7)
    decoder = CompiledDecoder(model, 1, backend="eager")
    ids = torch.tensor([random_prompt(64, 12, seed=8)])
    with torch.no_grad():
        decoder.prefill(ids[:, :8])
        first = decoder.step(torch.full((1,), 3), torch.tensor([8]))
        with torch._dynamo.config.patch(error_on_recompile=True):
            later = decoder.step(ids[:, 8], torch.tensor([9]))   # stride 12: a view
    assert ids[:, 8].stride() != torch.full((1,), 3).stride()
    assert first.shape == later.shape == (1, model.config.vocab_size)


def test_buckets_and_the_limit_are_named() -> None:
    # One bucket_for for every static step: the compiled one stops at MAX_COMPILED_BATCH.
    limit = MAX_COMPILED_BATCH
    assert [bucket_for(n, limit) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 48, 64]
    with pytest.raises(ValueError, match=f"at most {limit} rows, got 65.*without --compile"):
        bucket_for(65, limit)
    with pytest.raises(ValueError, match=f"at most {limit} rows, got 65"):
        compiled_decoder(sharp_model(SMALL, seed=0), 65, backend="eager")


def test_windows_are_powers_of_two_up_to_the_context_window() -> None:
    # A static graph attends over every slot of its cache: a short request gets a short one.
    assert [window_for(n, 512) for n in (1, 64, 65, 128, 129, 300, 512)] == \
        [64, 64, 128, 128, 256, 512, 512]
    assert window_for(40, 48) == 48          # never longer than the model's window
    with pytest.raises(ValueError, match="do not fit the context window of 512"):
        window_for(513, 512)
    wide = ModelConfig(**{**SMALL.to_dict(), "max_position_embeddings": 256})
    model = sharp_model(wide, seed=8)
    prompts = [random_prompt(96, 10, seed=9)]
    assert generate_compiled(model, prompts, 20, backend="eager") == generate_batch(model, prompts, 20)
    assert compiled_decoder(model, 1, backend="eager", tokens=30).cache.max_seq == 64
    assert compiled_decoder(model, 1, backend="eager", tokens=200).cache.max_seq == 256


def test_compile_flags_name_what_they_need(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "hi", "--compile", "--no-cache"]) == 2
    assert "path='compiled' needs the KV cache" in capsys.readouterr().err
    assert main(["bench", "kv", "--quick", "--compile"]) == 2
    assert "bench kv has no --compile variant" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_graphs_give_eager_tokens_on_cuda() -> None:
    model = sharp_model(SMALL, seed=7).to("cuda")
    prompts = [random_prompt(96, n, seed=n) for n in (4, 6)]
    want = generate_batch(model, prompts, 16)
    assert generate_compiled(model, prompts, 16) == want
    decoder = compiled_decoder(model, 2)
    assert decoder.mode == "reduce-overhead" and decoder.cache.k[0].is_cuda


@torch.no_grad()
def test_engine_with_compiled_mlps_gives_eager_tokens() -> None:
    # What `serve --compile` runs: the engine's token-wise layers compiled for a dynamic
    # token count (inductor), attention eager; ragged prompts, chunked prefill and decode.
    from tinyserve.engine import EngineConfig, generate_many
    prompts = [random_prompt(64, n, seed=n) for n in (3, 9, 5)]
    sizes = dict(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    want = generate_many(sharp_model(ONE_LAYER, seed=5), prompts, 10, EngineConfig(**sizes))
    compiled = sharp_model(ONE_LAYER, seed=5)
    got = generate_many(compiled, prompts, 10, EngineConfig(**sizes, path="compiled"))
    assert got == want and all(len(t) == 10 for t in got)
    assert all(k.startswith(("model.", "lm_head")) for k in compiled.state_dict())  # names kept


@torch.no_grad()
def test_compiled_mlps_follow_weights_changed_after_compiling() -> None:
    # A model used eagerly first holds stacked gate/up copies; its compiled MLPs must still
    # read the weights as they are now (traced only: backend="eager", seconds).
    from tinyserve.backends.compiled import compile_token_layers
    from tinyserve.engine import EngineConfig, generate_many
    prompts = [random_prompt(64, n, seed=n) for n in (3, 9)]
    config = EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    model = sharp_model(ONE_LAYER, seed=5)
    generate_many(model, prompts, 6, config)              # eager: makes the stacked copies
    compile_token_layers(model, backend="eager")
    model.model.layers[0].mlp.up_proj.weight.mul_(-3)
    reference = sharp_model(ONE_LAYER, seed=5)
    reference.model.layers[0].mlp.up_proj.weight.mul_(-3)
    assert generate_many(model, prompts, 6, config) == generate_many(reference, prompts, 6, config)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch):
    """``serve`` stubbed: the keyword arguments the CLI passed it, and a free port."""
    import socket
    import tinyserve.serving.server as server
    seen: dict = {}
    monkeypatch.setattr(server, "serve", lambda host, port, **kw: seen.update(kw))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return seen, str(port)


def test_serve_compile_flag_reaches_the_engine(served) -> None:
    seen, port = served
    assert main(["serve", "--port", port, "--compile"]) == 0
    assert seen["engine_config"].path == "compiled"
    assert main(["serve", "--port", port]) == 0
    assert seen["engine_config"].path == "auto"


def test_serve_fast_flag_reaches_the_engine_and_excludes_compile(
        served, capsys: pytest.CaptureFixture) -> None:
    seen, port = served
    assert main(["serve", "--port", port, "--fast"]) == 0
    assert seen["engine_config"].fast is True and seen["engine_config"].path == "fast"
    assert main(["serve", "--port", port, "--fast", "--compile"]) == 2
    assert "--fast and --compile both choose the decode path" in capsys.readouterr().err


def test_a_fast_server_prepares_its_largest_step_before_it_serves(traced) -> None:
    # Traced only (the fast path's one knob): the plumbing, in seconds.
    from fastapi.testclient import TestClient
    from tinyserve.engine import EngineConfig
    from tinyserve.serving.server import create_app
    config = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4, path="fast")
    app = create_app(engine_config=config)
    with TestClient(app) as client:
        graphs = app.state.server.engine.engine.executor.graphs
        assert list(graphs.graphs) == [(4, graphs.max_blocks)]       # made at start-up
        reply = client.post("/v1/completions", json={"model": "target", "prompt": "Hello",
                                                     "max_tokens": 5})
        assert reply.status_code == 200, reply.text
        assert list(graphs.graphs) == [(4, graphs.max_blocks)] and graphs.steps > 0

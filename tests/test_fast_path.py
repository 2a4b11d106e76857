"""The fast path (tinyserve/backends/fast.py) against the eager reference: ``path="fast"`` gives
the eager path's tokens in generate, generate_batch, speculative decoding and the engine
(greedy and seeded sampling; requests joining mid-flight), keeps its compiled kernels in the persistent cache (or the user's
TORCHINDUCTOR_CACHE_DIR), and names contradictory switches.

Most tests run the fast path's plumbing on a traced-only recipe (``backend="eager"``: the
same static buffers, decoders and dispatch, seconds instead of minutes per shape); one
compiles for real with the fastest settings, on the smallest model and shape, and one compiles a
group-wise int8 model for real."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
import torch

from tinyserve.backends import fast
from tinyserve.config import ModelConfig
from tinyserve.draft_replay import ReplayDrafter, greedy_script
from tinyserve.engine import Engine, EngineConfig, generate_many
from tinyserve.generate import generate, generate_batch, prepare
from tinyserve.paths import CHECKOUT, cache_dir
from tinyserve.quant import quantize_model
from tinyserve.sampling import SamplingParams
from tinyserve.speculative import ModelDrafter, SpeculativeDecoder, speculative_generate

from conftest import random_prompt, sharp_model

SMALL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
ONE_LAYER = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=11)



@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_fast_generate_gives_eager_tokens(traced: Path, sampling: SamplingParams) -> None:
    model = sharp_model(SMALL, seed=1)
    prompt = random_prompt(96, 7, seed=2)
    want = generate(model, prompt, 24, sampling=sampling, path="eager").tokens
    assert generate(model, prompt, 24, sampling=sampling, path="fast").tokens == want
    assert generate(model, prompt, 24, sampling=sampling, path="fast").tokens == want  # reused


@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_fast_generate_batch_gives_eager_tokens_for_uneven_prompts(
        traced: Path, sampling: SamplingParams) -> None:
    model = sharp_model(SMALL, seed=4)
    prompts = [random_prompt(96, n, seed=n) for n in (3, 9, 5)]    # bucket 4: one dummy row
    want = generate_batch(model, prompts, 14, sampling=sampling, stop_ids=(7,))
    assert generate_batch(model, prompts, 14, sampling=sampling, stop_ids=(7,), path="fast") == want


@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_fast_speculation_gives_eager_tokens(traced: Path, sampling: SamplingParams) -> None:
    target, draft = sharp_model(SMALL, seed=5), sharp_model(SMALL, seed=6)
    prompt = random_prompt(96, 6, seed=7)
    want, stats = speculative_generate(target, ModelDrafter(draft), prompt, 20, k=3,
                                       sampling=sampling)
    got, fast_stats = speculative_generate(target, ModelDrafter(draft, path="fast"), prompt, 20,
                                           k=3, sampling=sampling, path="fast")
    assert got == want and fast_stats.emitted == stats.emitted


def test_fast_replay_drafter_gives_the_targets_greedy_tokens(traced: Path) -> None:
    target, draft = sharp_model(SMALL, seed=5), sharp_model(SMALL, seed=6)
    prompt = random_prompt(96, 6, seed=8)
    script = greedy_script(target, prompt, 16)
    drafter = ReplayDrafter(draft, script, 0.7, path="fast")
    out, stats = speculative_generate(target, drafter, prompt, 16, k=4, path="fast")
    assert out == script and stats.accepted > 0


def test_a_finished_request_hands_back_the_drafters_passes_too(traced: Path) -> None:
    # A drafter made per request (as the bench and chapter 8 make replay drafters): once its
    # request is done, its pass set is free, so kept sets do not pile up in use and crowd out
    # the target's (each rebuilt set would compile again).
    from tinyserve.backends.fast import _PASSES
    target, draft = sharp_model(SMALL, seed=5), sharp_model(SMALL, seed=6)
    prompt = random_prompt(96, 6, seed=8)
    script = greedy_script(target, prompt, 12)
    for seed in range(6):                  # more requests than the kept sets (MAX_PASSES)
        drafter = ReplayDrafter(draft, script, 0.7, seed=seed, path="fast")
        assert speculative_generate(target, drafter, prompt, 12, k=2, path="fast")[0] == script
        assert drafter.inner.passes is None
    assert not any(p.in_use for m in (target, draft) for p in _PASSES.decoders(m))
    assert len(_PASSES.decoders(target)) == 1 and len(_PASSES.decoders(draft)) == 1


def test_each_compiled_function_is_told_the_rows_its_matmuls_serve(
        traced: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Whether a step packs its frozen weights depends on its rows (fast.PREPACK_FROM_ROWS), so
    # its compile must know them: the loops' decode buckets, each verify and draft width, the
    # engine's buckets.
    import contextlib
    rows: list[int] = []

    def recorded(freezing: bool = False, n: int | None = None, **_: object):
        rows.append(n)
        return contextlib.nullcontext()
    # every step compiled (a timed choice could keep one eager, which never compiles)
    monkeypatch.setattr(fast, "CPU_RECIPE", fast.Recipe((), True, "eager", decode_steps="compiled"))
    monkeypatch.setattr(fast, "compile_settings", recorded)
    target, draft = sharp_model(SMALL, seed=21), sharp_model(SMALL, seed=22)
    generate(target, random_prompt(96, 5, seed=1), 4, path="fast")
    generate_batch(target, [random_prompt(96, n, seed=n) for n in (3, 4, 5)], 4, path="fast")
    assert rows == [1, 4]
    rows.clear()
    speculative_generate(target, ModelDrafter(draft, path="fast"), random_prompt(96, 6, seed=2),
                         8, k=2, path="fast")
    assert sorted(rows) == [1, 1, 2, 2, 3]          # the target's 1..3, the draft's 1 and 2
    rows.clear()
    engine = Engine(target, EngineConfig(max_num_seqs=4, path="fast"))
    engine.prepare(rows=(1, 4), tokens=16, progress=False)
    assert sorted(set(rows)) == [1, 4]


def test_a_step_packs_its_weights_from_prepack_from_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.config as inductor_config

    def seen() -> dict[int | None, tuple[bool, bool]]:
        out = {}
        for rows in (None, 1, 2, 5):
            with fast.compile_settings(True, rows):
                out[rows] = (inductor_config.freezing, inductor_config.cpp.weight_prepack)
        return out
    assert fast.PREPACK_FROM_ROWS == 1                       # today every step packs
    assert seen() == {None: (True, True), 1: (True, True), 2: (True, True), 5: (True, True)}
    monkeypatch.setattr(fast, "PREPACK_FROM_ROWS", 2)        # a machine where plain one-row wins
    assert seen() == {None: (True, True), 1: (True, False), 2: (True, True), 5: (True, True)}
    assert inductor_config.cpp.weight_prepack and not inductor_config.freezing   # put back


def test_prepare_compiles_the_shapes_a_run_needs_once(traced: Path) -> None:
    model = sharp_model(SMALL, seed=9)
    shapes = [fast.Shape(20, batch=3), fast.verify_shape(2, 20)]
    first = prepare(model, shapes, progress=False)
    assert [c.label for c in first] == ["decode batch 3 x window 64", "pass width 1 x window 64",
                                        "pass width 2 x window 64", "pass width 3 x window 64",
                                        fast.PACK_LABEL]     # the prefill's weights, packed
    assert all(c.compiled and c.seconds > 0 for c in first)
    assert not any(c.compiled for c in prepare(model, shapes, progress=False))   # held
    # the loops find what was prepared: the prepared decoder serves a batch of 3
    prompts = [random_prompt(96, n, seed=n) for n in (4, 6, 2)]
    assert generate_batch(model, prompts, 10, path="fast") == generate_batch(model, prompts, 10)


def test_a_weight_changed_in_place_gets_a_new_fast_decoder(traced: Path) -> None:
    # Frozen weights (the real recipe) are a copy: a decoder is kept per weight version, so
    # the next request compiles again rather than reading stale weights.
    model = sharp_model(ONE_LAYER, seed=5)
    prompt = random_prompt(64, 5, seed=6)
    before = fast.fast_decoder(model, 1, 16)
    assert fast.fast_decoder(model, 1, 16) is before
    generate(model, prompt, 8, path="fast")
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    assert fast.fast_decoder(model, 1, 16) is not before
    fresh = sharp_model(ONE_LAYER, seed=5)
    with torch.no_grad():
        fresh.lm_head.weight.mul_(-1)
    assert generate(model, prompt, 8, path="fast").tokens == generate(fresh, prompt, 8).tokens


def test_an_int8_weight_changed_in_place_gets_a_new_fast_decoder(traced: Path) -> None:
    # An int8 model keeps its weights in buffers (quant.Int8Linear), not parameters.
    model = quantize_model(sharp_model(ONE_LAYER, seed=5), group_size=8)
    before = fast.fast_decoder(model, 1, 16)
    assert fast.fast_decoder(model, 1, 16) is before
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.scale.mul_(2)
    assert fast.fast_decoder(model, 1, 16) is not before


def test_a_grouped_int8_model_compiles_to_the_fused_reduction_with_eager_tokens(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The real recipe, freezing included: its constant folding could turn each int8 weight
    # into a float copy (dequantizing a constant is itself constant), which would read 4 bytes
    # a weight again. The generated code shows what the step reads.
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model = quantize_model(sharp_model(ONE_LAYER, seed=8), group_size=8)
    prompt = random_prompt(64, 6, seed=9)
    want = generate(model, prompt, 16, path="eager").tokens
    got, codes = run_and_get_code(lambda: generate(model, prompt, 16, path="fast").tokens)
    assert got == want
    code = "\n".join(codes)
    assert "const int8_t*" in code                 # a kernel loads the int8 weights itself
    frozen = re.findall(r"_frozen_param\d+ = None  # device\(type='cpu'\) torch\.(\w+) \(([\d, ]*)\)",
                        code)
    numel = {dtype: sum(math.prod(int(n) for n in shape.split(",") if n.strip())
                        for d, shape in frozen if d == dtype) for dtype in ("int8", "float32")}
    weights = sum(b.numel() for name, b in model.named_buffers() if name.endswith("qweight"))
    weights -= model.lm_head.qweight.numel()        # tied: the LM head is the embedding's table
    # Every int8 weight stays int8; the float constants are scales, norms and rope tables.
    assert numel["int8"] >= weights and numel["float32"] < weights / 2, numel


def test_one_switch_names_what_it_takes_in_every_loop(traced: Path) -> None:
    # One argument for one choice (tinyserve.step_path): a path a loop does not take, or one
    # that needs the KV cache without it, is an error that names what is allowed.
    model = sharp_model(ONE_LAYER, seed=2)
    prompt = [1, 2, 3]
    with pytest.raises(ValueError, match="generate: path='fastest' is not one of 'auto', "
                                         "'eager', 'graph', 'compiled', 'fast'"):
        generate(model, prompt, 4, path="fastest")
    with pytest.raises(ValueError, match="path='fast' needs the KV cache; without it .* pass path='eager'"):
        generate(model, prompt, 4, path="fast", use_cache=False)
    with pytest.raises(ValueError, match="generate_batch: path='compiled' is not one of 'auto', "
                                         "'eager', 'graph', 'fast'"):
        generate_batch(model, [prompt], 4, path="compiled")
    with pytest.raises(ValueError, match="SpeculativeDecoder: path='compiled'"):
        SpeculativeDecoder(model, ModelDrafter(model), 2, path="compiled")
    with pytest.raises(ValueError, match="ModelDrafter: path='on'"):
        ModelDrafter(model, path="on")
    with pytest.raises(TypeError):                       # the old switches are gone
        generate(model, prompt, 4, fast=True)
    assert generate(model, prompt, 4, path="eager").tokens == generate(model, prompt, 4).tokens


def test_the_cache_folder_is_ours_unless_the_user_chose_one(
        traced: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cache_dir() == traced
    monkeypatch.delenv("TINYSERVE_CACHE_DIR")
    if CHECKOUT is not None:
        assert cache_dir() == CHECKOUT / ".cache"
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(traced))
    user = tmp_path / "users-own"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(user))
    generate(sharp_model(ONE_LAYER, seed=3), [1, 2, 3], 4, path="fast")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(user)
    assert not (traced / "inductor").exists()


def test_the_fastest_settings_compile_eager_tokens_into_the_persistent_cache(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Real code generation with the real recipe (max-autotune, freezing, the C++ GEMM
    # template), the smallest model and shape: tens of seconds on a busy 2-core machine.
    import torch._inductor.config as inductor_config
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert fast.CPU_RECIPE is fast.FASTEST
    model = sharp_model(ONE_LAYER, seed=5)
    prompt = random_prompt(64, 5, seed=6)
    want = generate(model, prompt, 20, path="eager").tokens
    costs = prepare(model, [fast.Shape(25)], progress=False)
    assert costs[0].label == "decode batch 1 x window 32" and costs[0].compiled
    # then the prefill's packed weights, where a packed pass measured faster here
    assert [c.label for c in costs[1:]] in ([], [fast.PACK_LABEL])
    assert generate(model, prompt, 20, path="fast").tokens == want
    folder = tmp_path / "inductor" / fast.INDUCTOR_FOLDER
    assert any(p.is_file() for p in folder.rglob("*"))           # the kernels, kept on disk
    assert inductor_config.freezing is False                      # the patch did not leak


def test_the_autotuner_times_cpu_kernels_cold_only_while_a_step_compiles() -> None:
    # Inductor's CPU loop times a kernel back to back, its weights left in the last-level
    # cache; held around a fast compile, each timed call comes after a flush, and the
    # benchmarker is inductor's own again afterwards.
    from torch._inductor.runtime.benchmarking import benchmarker
    calls = []
    with fast.compile_settings(True):
        ms = benchmarker.benchmark_cpu(lambda: calls.append(1))
    assert len(calls) == 1 + fast.COLD_REPEATS and ms >= 0
    assert "benchmark_cpu" not in vars(benchmarker)
    calls.clear()
    benchmarker.benchmark_cpu(lambda: calls.append(1), warmup=0, rep=0)
    assert 0 < len(calls) <= 2                      # inductor's loop: a warm-up, one timed call


def test_the_cold_timer_works_when_a_compile_starts_in_inference_mode() -> None:
    # Chapter 8's speculative graphs compile on their first pass, inside inference mode, and
    # the autotuner then times its choices outside it (CI, a fresh cache: every choice failed
    # with "inplace update to inference tensor", and the compile with no choice left).
    from torch._inductor.runtime.benchmarking import benchmarker
    calls = []
    with torch.inference_mode(), fast.compile_settings(True):
        with torch.inference_mode(False):
            ms = benchmarker.benchmark_cpu(lambda: calls.append(1))
        ms_inside = benchmarker.benchmark_cpu(lambda: calls.append(1))
    assert len(calls) == 2 * (1 + fast.COLD_REPEATS) and ms >= 0 and ms_inside >= 0


@pytest.fixture
def packed_steps(traced: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """:func:`traced`, with every decode step of two rows or more run eagerly over the packed
    weights (``decode_steps="packed"``) and the prefills plain, so any packed copy the model
    holds afterwards was made by a decode step."""
    monkeypatch.setattr(fast, "CPU_RECIPE", fast.Recipe((), False, "eager", "plain", "packed"))
    return traced


def test_batched_decode_steps_over_packed_weights_give_eager_tokens(packed_steps: Path) -> None:
    model = sharp_model(SMALL, seed=4)
    prompts = [random_prompt(96, n, seed=n) for n in (3, 9, 5)]    # bucket 4: one dummy row
    want = generate_batch(model, prompts, 14, stop_ids=(7,))
    assert generate_batch(model, prompts, 14, stop_ids=(7,), path="fast") == want
    from tinyserve.backends.compiled import DECODERS
    held = DECODERS.decoders(model)
    assert held and all(d.choice is not None and d.choice.kernel == "packed" for d in held)
    assert fast._mode(model).packed > 0


def test_the_engine_runs_its_batched_steps_over_packed_weights(packed_steps: Path) -> None:
    model = sharp_model(SMALL, seed=12)
    prompts = [random_prompt(96, n, seed=20 + n) for n in (3, 11, 6, 17, 2)]
    config = dict(num_blocks=48, block_size=4, max_num_seqs=8)
    want, _ = _engine_run(model, prompts, EngineConfig(**config), joins=2)
    got, engine = _engine_run(model, prompts, EngineConfig(**config, path="fast"), joins=2)
    assert got == want
    kernels = {rows: g.choice.kernel for (rows, _), g in engine.executor.graphs.graphs.items()}
    assert kernels and all(k == ("compiled" if rows == 1 else "packed")
                           for rows, k in kernels.items())
    assert any(rows > 1 for rows in kernels) and fast._mode(model).packed > 0


def test_the_measured_choice_keeps_the_fastest_way_with_eager_as_its_floor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A clock that only the steps move: each "takes" the seconds given, so the choice is the
    # arithmetic of the timings, not of this machine.
    now = [0.0]
    monkeypatch.setattr(fast.time, "perf_counter", lambda: now[0])

    def taking(seconds: float):
        return lambda: now.__setitem__(0, now[0] + seconds)

    def ways(model, rows, compiled, eager):
        return fast.step_ways(model, rows, taking(compiled), taking(eager))
    model = sharp_model(SMALL, seed=3)
    # 8 rows: three ways; packed runs ``eager`` under the mode, so it takes eager's time
    slow_compiled = fast.choose_step(model, 8, ways(model, 8, 0.03, 0.02), "measured")
    assert slow_compiled.kernel == "packed"              # eager and packed tie: packed first
    assert dict(slow_compiled.seconds) == {"compiled": pytest.approx(0.03),
                                           "packed": pytest.approx(0.02),
                                           "eager": pytest.approx(0.02)}
    assert "compiled 30.0 ms, packed 20.0 ms, eager 20.0 ms" in slow_compiled.sentence()
    assert fast.choose_step(model, 4, ways(model, 4, 0.01, 0.02), "measured").kernel == "compiled"
    # one row: no packed way (the packed linear leaves one row plain), and eager is the floor
    one_row = fast.choose_step(model, 1, ways(model, 1, 0.03, 0.02), "measured")
    assert one_row.kernel == "eager" and [w for w, _ in one_row.seconds] == ["compiled", "eager"]
    q8 = quantize_model(model, group_size=16)           # int8: nothing to pack once
    assert set(fast.step_ways(q8, 8, taking(0), taking(0))) == {"compiled", "eager"}
    assert fast.choose_step(model, 8, ways(model, 8, 0.0, 0.03), "packed").kernel == "packed"
    assert fast.choose_step(model, 1, ways(model, 1, 0.0, 0.03), "packed").kernel == "compiled"
    assert fast.choose_step(model, 1, ways(model, 1, 0.0, 0.03), "eager").kernel == "eager"
    with pytest.raises(ValueError, match="decode_steps must be one of measured, compiled, packed, eager"):
        fast.Recipe((), False, decode_steps="fastest")
    with pytest.raises(ValueError, match="how must be one of measured, compiled, packed, eager"):
        fast.choose_step(model, 8, ways(model, 8, 0.0, 0.0), "fastest")


def _engine_run(model, prompts, config: EngineConfig, sampling=(), joins: int = 0):
    """Every prompt's tokens through one engine; the last ``joins`` prompts join after a few
    steps (continuous batching: rows join and leave the static decode step)."""
    engine = Engine(model, config)
    sampling = list(sampling) or [SamplingParams()] * len(prompts)
    first = len(prompts) - joins
    seqs = [engine.add_request(p, 12, sampling=s, stop_ids=(7,))
            for p, s in zip(prompts[:first], sampling)]
    for _ in range(4):
        engine.step()
    seqs += [engine.add_request(p, 12, sampling=s) for p, s in zip(prompts[first:], sampling[first:])]
    engine.run()
    return [s.output_ids for s in seqs], engine


@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_the_fast_engine_gives_the_eager_engines_tokens(traced: Path,
                                                         sampling: SamplingParams) -> None:
    model = sharp_model(SMALL, seed=12)
    prompts = [random_prompt(96, n, seed=20 + n) for n in (3, 11, 6, 17, 2)]
    params = [SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k,
                             seed=None if sampling.seed is None else sampling.seed + i)
              for i in range(len(prompts))]
    config = dict(num_blocks=48, block_size=4, max_num_seqs=8)
    want, _ = _engine_run(model, prompts, EngineConfig(**config), params, joins=2)
    got, engine = _engine_run(model, prompts, EngineConfig(**config, path="fast"), params, joins=2)
    assert got == want
    graphs = engine.executor.graphs
    assert graphs.compiler is not None and graphs.steps > 0        # decode ran compiled
    assert all(isinstance(g, fast.CompiledStep) for g in graphs.graphs.values())


def test_the_compiled_engine_step_writes_back_no_more_than_a_layer(traced: Path,
                                                                    monkeypatch) -> None:
    # A compiled function that writes into its inputs returns each written input whole, to be
    # copied back (AOTAutograd's functionalization; inductor then writes in place what it
    # can). A step that wrote a layer's keys into a view of one (layers, ...) pool, or
    # gathered into a slice of the shared buffer, wrote back the whole pool or buffer every
    # step, which made the scale model's batch-1 engine step take far longer (profiled).
    # Captured here after functionalization.
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    monkeypatch.setattr(fast, "CPU_RECIPE", fast.Recipe((), False, aot_autograd(fw_compiler=keep)))
    model = sharp_model(SMALL, seed=14)
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=2, path="fast"))
    engine.prepare(rows=(1,), tokens=20, progress=False)
    layer = engine.executor.cache.k[0]
    gather = engine.executor.graphs.buffers.gathered
    [step] = graphs
    out = [n for n in step.graph.nodes if n.op == "output"][0].args[0]
    shapes = [tuple(a.meta["val"].shape) for a in out]
    assert shapes.count(tuple(layer.shape)) == 2 * SMALL.num_hidden_layers   # k and v, in place
    assert max(a.meta["val"].numel() for a in out) <= layer.numel(), shapes
    assert tuple(gather.shape) not in shapes, shapes


def test_the_fast_engine_prepares_its_shapes_once_and_runs_on_them(traced: Path) -> None:
    model = sharp_model(SMALL, seed=13)
    engine = Engine(model, EngineConfig(num_blocks=48, block_size=4, max_num_seqs=8, path="fast"))
    assert engine.executor.graphs.graphs == {}          # nothing compiled at start-up on a CPU
    costs = engine.prepare(rows=(1, 3, 4), tokens=40, progress=False)
    assert [c.label for c in costs] == ["engine decode 1 rows x 16 blocks",
                                        "engine decode 4 rows x 16 blocks", fast.PACK_LABEL]
    assert all(c.compiled and c.seconds > 0 for c in costs)
    again = engine.prepare(rows=(1,), tokens=40, progress=False)
    assert [(c.seconds, c.compiled) for c in again] == [(0.0, False), (0.0, False)]
    made = engine.executor.graphs.captures
    prompts = [random_prompt(96, n, seed=n) for n in (5, 9, 4)]
    seqs = [engine.add_request(p, 10) for p in prompts]
    engine.run()
    assert engine.executor.graphs.captures == made      # no compile while serving
    assert [s.output_ids for s in seqs] == generate_many(
        model, prompts, 10, EngineConfig(num_blocks=48, block_size=4))
    with pytest.raises(ValueError, match="1 to 64 positions"):
        engine.prepare(rows=(1,), tokens=65)


def test_the_fast_engine_compiles_again_after_a_weight_changes_in_place(traced: Path) -> None:
    # A compiled step holds the weights frozen (a copy): it must be compiled again. (Prefix
    # caching is off: cached keys and values of the old weights would be reused.)
    model, fresh = sharp_model(ONE_LAYER, seed=14), sharp_model(ONE_LAYER, seed=14)
    config = dict(num_blocks=24, block_size=4, enable_prefix_caching=False)
    engine = Engine(model, EngineConfig(**config, path="fast"))
    prompt = random_prompt(64, 5, seed=3)
    engine.add_request(prompt, 6)
    engine.run()
    made = engine.executor.graphs.captures
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
        fresh.lm_head.weight.mul_(-1)
    seq = engine.add_request(prompt, 6)
    engine.run()
    assert engine.executor.graphs.captures == made + 1
    assert seq.output_ids == generate_many(fresh, [prompt], 6, EngineConfig(**config))[0]


def test_a_new_fast_engine_reuses_the_compiled_steps_of_one_that_is_gone(traced: Path) -> None:
    model = sharp_model(SMALL, seed=15)
    config = EngineConfig(num_blocks=40, block_size=4, max_num_seqs=4, path="fast")
    prompts = [random_prompt(96, n, seed=n) for n in (4, 7)]
    first = Engine(model, config)
    first.prepare(rows=(2,), tokens=30, progress=False)
    steps = first.executor.graphs
    alive = Engine(model, config)                        # the first is still held: its own
    assert alive.executor.graphs is not steps and alive.executor.graphs.graphs == {}
    want = [s.output_ids for s in [first.add_request(p, 9) for p in prompts]]
    first.run()
    del first, alive
    again = Engine(model, config)                        # gone: its compiled steps are lent
    assert again.executor.graphs is steps
    # the step and the prefill's packed weights: both held
    assert [c.compiled for c in again.prepare(rows=(2,), tokens=30, progress=False)] == \
        [False, False]
    seqs = [again.add_request(p, 9) for p in prompts]
    again.run()
    assert [s.output_ids for s in seqs] == want and steps.captures == 1


def test_the_engine_takes_the_same_switch(traced: Path) -> None:
    with pytest.raises(ValueError, match="EngineConfig: path='faster' is not one of 'auto', "
                                         "'eager', 'graph', 'compiled', 'fast'"):
        EngineConfig(path="faster")
    assert EngineConfig(path="fast").fast and not EngineConfig().fast
    assert EngineConfig(path="fast").decode_path(torch.device("cpu")) == (True, True, False)
    assert EngineConfig(path="graph").decode_path(torch.device("cpu")) == (True, False, False)
    assert EngineConfig().decode_path(torch.device("cpu")) == (False, False, False)


@pytest.mark.gpu
def test_fast_is_the_cuda_graphs_on_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    model, draft = sharp_model(SMALL, seed=7).to("cuda"), sharp_model(SMALL, seed=8).to("cuda")
    prompts = [random_prompt(96, n, seed=n) for n in (4, 6)]
    assert generate_batch(model, prompts, 16, path="fast") == generate_batch(model, prompts, 16,
                                                                             path="eager")
    assert generate(model, prompts[0], 16, path="fast").tokens == \
        generate(model, prompts[0], 16, path="eager").tokens
    costs = prepare(model, [fast.Shape(30, batch=2), fast.verify_shape(2, 30)], progress=False)
    assert len(costs) == 4
    want, _ = speculative_generate(model, ModelDrafter(draft, path="eager"), prompts[0], 16, k=2,
                                   path="eager")
    got, _ = speculative_generate(model, ModelDrafter(draft, path="fast"), prompts[0], 16, k=2,
                                  path="fast")
    assert got == want
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=4, path="fast"))
    assert engine.executor.graphs.capture and engine.executor.graphs.compiler is None
    assert generate_many(model, prompts, 12, EngineConfig(num_blocks=32, block_size=4,
                                                          path="fast")) == \
        generate_many(model, prompts, 12, EngineConfig(num_blocks=32, block_size=4, path="eager"))

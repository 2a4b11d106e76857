"""The KV-bound regime's measuring (issue 52): a cache filled directly decodes exactly as one
filled by a prefill (float and int8), the long-context preset is the bandwidth model with a
longer window, the crossover is the config's arithmetic, and the fit's split and crossover are
what its line says. Nothing here is timed: the suite's quick run checks the report's shape."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tinyserve import load_model, scale
from tinyserve.config import ModelConfig, parameter_count
from tinyserve.generate import decode_step, prefill
from tinyserve.kv_cache import KVCache, kv_bytes_per_token, kv_crossover_tokens
from tinyserve.long_context import (FILL_BLOCK, ContextFit, StepCase, cache_bytes_per_token,
                                    context_steps, fill_cache, fill_random, fit_context_steps,
                                    steps_in_turns, token_bytes_of)
from tinyserve.model import TinyLlama
from tinyserve.quant import Int8KVCache, dequantize_rows
from tinyserve.workbook import kv_regime

TINY = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _tiny(seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    model = TinyLlama(TINY).eval()
    with torch.no_grad():        # away from the near-uniform init: no near-ties in the argmax
        for p in model.parameters():
            p.mul_(3)
    return model


def _greedy(model: TinyLlama, cache: KVCache, token: torch.Tensor, steps: int) -> torch.Tensor:
    logits = []
    with torch.inference_mode():
        for _ in range(steps):
            out = decode_step(model, token, None, cache)
            logits.append(out)
            token = out.argmax(-1)
    return torch.stack(logits)


def test_a_directly_filled_cache_decodes_as_the_prefilled_one() -> None:
    model = _tiny()
    ids = torch.randint(0, TINY.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    prefilled = KVCache.for_model(model, 1, 32)
    with torch.inference_mode():
        first = prefill(model, ids, prefilled)[:, -1].argmax(-1)
    filled = KVCache.for_model(model, 1, 32)
    fill_cache(filled, prefilled.k[:, :, :, :20].clone(), prefilled.v[:, :, :, :20].clone())
    assert filled.lengths == prefilled.lengths == [20]
    # Several greedy steps: the filled cache's bookkeeping carries on as the prefilled one's.
    want, got = _greedy(model, prefilled, first, 5), _greedy(model, filled, first, 5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_directly_filled_int8_cache_stores_and_decodes_as_the_prefilled_one() -> None:
    """The int8 cache's prefill quantizes each layer's keys as it writes them (and its later
    layers see the rounding), so its own keys, read back, are what a direct fill is given:
    the fill quantizes them to the same int8 values."""
    model = _tiny()
    ids = torch.randint(0, TINY.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    prefilled = Int8KVCache.for_model(model, 1, 32)
    with torch.inference_mode():
        first = prefill(model, ids, prefilled)[:, -1].argmax(-1)
    keys, values = (dequantize_rows(q[:, :, :, :20], s[:, :, :, :20]) for q, s in
                    ((prefilled.k, prefilled.k_scale), (prefilled.v, prefilled.v_scale)))
    filled = Int8KVCache.for_model(model, 1, 32)
    fill_cache(filled, keys, values)
    assert filled.lengths == [20] and torch.equal(filled.k, prefilled.k) \
        and torch.equal(filled.v, prefilled.v)
    torch.testing.assert_close(filled.k_scale, prefilled.k_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(_greedy(model, filled, first, 5),
                               _greedy(model, prefilled, first, 5), rtol=1e-5, atol=1e-5)


def test_the_long_preset_decodes_a_filled_cache_as_a_prefill_leaves_it() -> None:
    """The same on the long-context preset itself (one layer: the code path, in seconds)."""
    model = scale.build_scale_model("bandwidth-long", "cpu", torch.float32, layers=1)
    ids = torch.randint(0, model.config.vocab_size, (1, 12),
                        generator=torch.Generator().manual_seed(2))
    prefilled, filled = KVCache.for_model(model, 1, 16), KVCache.for_model(model, 1, 16)
    with torch.inference_mode():
        first = prefill(model, ids, prefilled)[:, -1].argmax(-1)
    fill_cache(filled, prefilled.k[:, :, :, :12].clone(), prefilled.v[:, :, :, :12].clone())
    torch.testing.assert_close(_greedy(model, filled, first, 2),
                               _greedy(model, prefilled, first, 2), rtol=0, atol=0)


def test_fill_random_is_seeded_sets_the_lengths_and_leaves_the_rest_empty() -> None:
    context = FILL_BLOCK + 37                       # past one block: the repeat is exercised
    window = replace(TINY, max_position_embeddings=4096)
    a, b = KVCache(window, 1, context + 4), KVCache(window, 1, context + 4)
    fill_random(a, context, seed=3)
    fill_random(b, context, seed=3)
    assert a.lengths == [context] and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert a.k[:, :, :, context - 1].any() and a.v[:, :, :, context - 1].any()  # the repeat too
    assert not a.k[:, :, :, context:].any()
    q = Int8KVCache(TINY, 1, 40)
    fill_random(q, 30)
    assert q.lengths == [30] and q.k.dtype == torch.int8 and q.k[:, :, :, :30].any()
    assert not torch.equal(q.k_scale[:, :, :, :30], torch.ones_like(q.k_scale[:, :, :, :30]))


def test_fills_name_the_limit() -> None:
    cache = KVCache(TINY, 1, 16)
    with pytest.raises(ValueError, match="holds at most 15 tokens with room for one decode step"):
        fill_random(cache, 16)
    with pytest.raises(ValueError, match=r"\(layers, batch, kv_heads, context, head_dim\)"):
        fill_cache(cache, torch.zeros(2, 1, 3, 4, 16), torch.zeros(2, 1, 3, 4, 16))
    with pytest.raises(ValueError, match="do not fit the context window of 64"):
        context_steps(_tiny(), [62], n=4)


def test_kv_bytes_and_the_crossover_are_the_configs_arithmetic() -> None:
    cfg = scale.scale_config("bandwidth-long", "cpu")
    # A key and a value per layer and KV head, head_dim fp32 numbers each.
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert kv_bytes_per_token(cfg) == per_token
    weights = parameter_count(cfg) * 4
    assert kv_crossover_tokens(cfg, weights) == pytest.approx(weights / per_token)
    # Four times the KV heads: four times the bytes a token, a crossover under a quarter
    # (the weights grow too: wider k and v projections).
    mha = scale.scale_config("bandwidth-long", "cpu", kv_heads=cfg.num_attention_heads)
    mha_weights = parameter_count(mha) * 4
    assert mha_weights > weights
    assert kv_crossover_tokens(mha, mha_weights) == pytest.approx(
        mha_weights / (per_token * cfg.num_attention_heads / cfg.num_key_value_heads))
    # An int8 cache: 1 byte a number and a 4-byte scale per head vector.
    int8 = token_bytes_of(cfg, Int8KVCache)
    assert int8 == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.head_dim + 4)
    assert token_bytes_of(cfg) == per_token == cache_bytes_per_token(KVCache(cfg, 1, 3))


def test_the_long_preset_is_the_bandwidth_model_with_a_window_past_its_crossover() -> None:
    for device in ("cpu", "cuda"):
        base = scale.scale_config("bandwidth", device)
        long = scale.scale_config("bandwidth-long", device)
        assert replace(long, max_position_embeddings=base.max_position_embeddings) == base
        window = long.max_position_embeddings
        crossover = kv_crossover_tokens(long, scale.weight_bytes_of(long))
        assert window & (window - 1) == 0 and window >= scale.LONG_WINDOW_MULTIPLE * crossover
        assert window < 2 * scale.LONG_WINDOW_MULTIPLE * crossover   # the next power of two
        # Other KV heads keep the window: the levers are timed at the same contexts.
        assert scale.scale_config("bandwidth-long", device, kv_heads=1).max_position_embeddings \
            == window
    a = load_model("bandwidth", device="cpu", layers=1)
    b = load_model("bandwidth-long", device="cpu", layers=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                   b.state_dict().values()))
    with pytest.raises(ValueError, match=r"kv_heads must divide the 16 query heads: one of \[1, 2, 4, 8, 16\]"):
        scale.scale_config("bandwidth-long", kv_heads=3)
    with pytest.raises(ValueError, match="kv_heads= sizes the 'bandwidth-long' preset"):
        scale.scale_config("bandwidth", kv_heads=2)


def test_the_fit_recovers_a_line_and_ignores_one_disturbed_point() -> None:
    fixed, per_token = 0.040, 2.5e-6
    steps = {n: fixed + n * per_token for n in (64, 20_000, 40_000, 60_000, 80_000)}
    fit = fit_context_steps(steps)
    assert fit.fixed_s == pytest.approx(fixed) and fit.per_token_s == pytest.approx(per_token)
    assert fit.crossover == pytest.approx(fixed / per_token)
    assert fit.kv_s(40_000) == pytest.approx(0.1)
    steps[40_000] *= 3                              # another program slowed one point down
    assert fit_context_steps(steps).per_token_s == pytest.approx(per_token)
    with pytest.raises(ValueError, match="two contexts or more"):
        fit_context_steps({64: 0.04})
    assert ContextFit(0.04, 0.0).crossover == float("inf")


def test_measured_over_predicted_crossover_is_the_kv_rate_over_the_weights_rate() -> None:
    weights, token = 388e6, 8192.0
    fit = ContextFit(0.030, 1.2e-6)
    weights_rate, kv_rate = fit.read_rates(weights, token)
    assert weights_rate == pytest.approx(weights / 0.030) and kv_rate == pytest.approx(token / 1.2e-6)
    assert fit.crossover / (weights / token) == pytest.approx(kv_rate / weights_rate)


def test_the_printed_split_adds_up() -> None:
    fit = ContextFit(0.030, 1.0e-6)
    steps = {64: 0.030064, 40_000: 0.070}
    lines = kv_regime.split_lines(steps, fit, 400e6, 10_000.0, 20e9)
    row = lines[2].split()
    # the step = the weights part + the KV part; each floor is its bytes over the bandwidth
    assert row[:6] == ["40,000", "70.0ms", "30.0ms", "20.0ms", "40.0ms", "20.0ms"]
    assert row[6] == "50%" and row[7] == f"{800e6 / 20e9 / 0.070:.2f}"
    text = "\n".join(kv_regime.rate_lines(fit, 400e6, 10_000.0, 20e9, 40_000))
    assert "crossover by bytes: 40,000 tokens" in text and "30,000 tokens, 0.75x" in text
    levers = kv_regime.lever_lines({"own": (800e6, 0.08), "mqa": (500e6, 0.04)}, "own")
    assert "0.62x the bytes" in levers[1] and "0.50x the time" in levers[1]
    assert kv_regime.contexts(40_000, kv_regime.QUICK) == [kv_regime.SHORT, 40_000, 80_000]


def test_steps_in_turns_times_every_case_and_leaves_each_cache_at_its_context() -> None:
    model = _tiny()
    cases = {"short": StepCase(model, 8), "long": StepCase(model, 40),
             "int8": StepCase(model, 40, Int8KVCache)}
    seconds = steps_in_turns(cases, n=2, rounds=1)
    assert set(seconds) == set(cases) and all(s > 0 for s in seconds.values())
    assert set(context_steps(model, [8, 16], n=2, rounds=1)) == {8, 16}


def test_bench_scale_long_context_quick_writes_its_report(tmp_path: Path) -> None:
    import bench
    out = tmp_path / "long.json"
    bench.run_suite("scale_long_context", json_path=str(out), quick=True)
    data = json.loads(out.read_text())
    assert data["quick"] and data["suite"] == "scale_long_context"
    assert set(data["ratios"]) == {"scale_long_context_mbu",
                                   "scale_kv_crossover_measured_vs_predicted"}
    m = data["measurements"]
    assert m["contexts"][0] == kv_regime.SHORT and len(m["step_s"]) == len(m["contexts"])
    assert set(m["levers"]) == {"kv_heads_own", "int8_kv", "kv_heads_4", "kv_heads_1"}
    assert m["levers"]["int8_kv"]["kv_token_bytes"] < m["levers"]["kv_heads_own"]["kv_token_bytes"]
    probe = m["attention_probe"]
    assert probe["context"] == m["contexts"][-1] and probe["seconds"] > 0
    assert m["int8_kv_traffic"]["moved"] > m["int8_kv_traffic"]["float"] \
        > m["int8_kv_traffic"]["stored"]


# ---------------------------------------------------------------- chapter 6b's section 9

def test_the_levers_time_each_variant_and_count_its_bytes() -> None:
    model = _tiny()
    built = []

    def build(kv: int) -> TinyLlama:
        built.append(kv)
        torch.manual_seed(0)
        return TinyLlama(replace(TINY, num_key_value_heads=kv)).eval()

    out = kv_regime.levers(model, 40, build, n=1, rounds=1)
    # Multi-head (a KV head per query head) and multi-query twins, the model's own heads over
    # the float and the int8 cache.
    assert built == [TINY.num_attention_heads, 1]
    assert set(out) == {"kv_heads_own", "int8_kv", "kv_heads_4", "kv_heads_1"}
    for v in out.values():
        assert v["seconds"] > 0 and v["bytes"] == v["weight_bytes"] + 40 * v["kv_token_bytes"]
    assert out["kv_heads_own"]["kv_token_bytes"] == kv_bytes_per_token(TINY)
    assert out["kv_heads_4"]["kv_token_bytes"] == 2 * out["kv_heads_own"]["kv_token_bytes"]
    assert out["kv_heads_1"]["kv_token_bytes"] == out["kv_heads_own"]["kv_token_bytes"] / 2
    assert out["int8_kv"]["kv_token_bytes"] == token_bytes_of(TINY, Int8KVCache)
    assert out["int8_kv"]["cache"] == "Int8KVCache" and out["kv_heads_4"]["cache"] == "KVCache"
    # The printed table: most KV heads first, the int8 cache last, each against the own step.
    lines = kv_regime.lever_table(out)
    assert [line.split(",")[0].strip() for line in lines] == \
        ["4 KV heads", "2 KV heads", "1 KV head", "2 KV heads"]
    assert "int8 cache" in lines[-1] and "1.00x the bytes" in lines[1] \
        and "1.00x the time" in lines[1]


def test_the_int8_cache_dequantizes_every_slot_before_attention_as_the_chapter_says() -> None:
    """Chapter 6b's section 9 says our int8 cache stores fewer bytes but moves more: attention
    gets float copies of every visible slot, not the int8 values. If attention ever reads the
    int8 values itself, this fails and the chapter's prose (and int8_traffic) must change."""
    cache = Int8KVCache(TINY, 1, 16)
    fill_random(cache, 10)
    k = torch.randn(1, TINY.num_key_value_heads, 1, TINY.head_dim)
    keys, values, _ = cache.update(0, k, k.clone(), torch.tensor([[10]]))
    assert keys.dtype == values.dtype == torch.float32 and keys.shape[2] == 11
    t = kv_regime.int8_traffic(TINY)
    assert t["stored"] == token_bytes_of(TINY, Int8KVCache) < t["float"] == kv_bytes_per_token(TINY)
    # read the int8 values and scales, write a float copy, attention reads the copy
    assert t["moved"] == t["stored"] + 2 * t["float"] > t["float"]


def test_the_attention_probe_times_the_steps_attention_alone() -> None:
    model = _tiny()
    seconds = kv_regime.attention_seconds(model, 40, repeats=1)
    assert seconds > 0
    with pytest.raises(ValueError, match="do not fit the context window of 64"):
        kv_regime.attention_seconds(model, 64)
    fit = ContextFit(0.030, 1.0e-6)                   # a KV part of 40 ms at 40,000 tokens
    line = kv_regime.probe_line(0.030, fit, 40_000, 10_000.0)
    assert "30.0 ms" in line and "40.0 ms" in line and "75% of it" in line
    assert "13.3 GB/s" in line                        # 400 MB of cache in 30 ms


def test_the_plot_draws_the_steps_the_fit_the_floor_and_both_crossovers() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    fit = ContextFit(0.030, 1.0e-6)
    steps = {64: 0.030064, 20_000: 0.050, 40_000: 0.070}
    kv_regime.plot_steps(ax, steps, fit, 400e6, 10_000.0, 20e9, 40_000)
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["decode step (measured)", "fit: weights part + context x per-token part",
                      "memory floor: (weights + KV bytes) / bandwidth", "crossover by bytes",
                      "crossover measured (fit)"]
    assert ax.get_lines()[4].get_xdata()[0] == pytest.approx(30_000)
    assert ax.get_xlabel() and ax.get_ylabel()
    plt.close(fig)


def test_the_quick_plan_is_small_on_the_long_preset() -> None:
    """Chapter 6b's quick mode (the chapter tests) times the crossover and twice it, one round
    of two steps: its caches take at most three times the weights' memory at once, and the
    full plan times both sides of the crossover."""
    cfg = scale.scale_config("bandwidth-long", "cpu")
    weights = scale.weight_bytes_of(cfg, 4)
    crossover = kv_crossover_tokens(cfg, weights)
    quick = kv_regime.contexts(crossover, kv_regime.QUICK)
    assert sum(quick) * kv_bytes_per_token(cfg) <= 3.01 * weights
    assert kv_regime.QUICK.n <= 2 and kv_regime.QUICK.rounds == kv_regime.QUICK.lever_rounds == 1
    assert max(quick) < cfg.max_position_embeddings
    full = kv_regime.contexts(crossover, kv_regime.FULL)
    assert min(full[1:]) < crossover < max(full) < cfg.max_position_embeddings


CHAPTER = Path(__file__).resolve().parents[1] / "course" / "06b_decode_roofline.ipynb"


def _section_9() -> list:
    import nbformat
    from tinyserve.workbook.study_time import section
    return section(nbformat.read(CHAPTER, as_version=4).cells, "## 9.")


def test_the_chapter_predicts_the_crossover_before_it_measures_it() -> None:
    cells = _section_9()
    code = [c.source for c in cells if c.cell_type == "code"]
    guess = next(i for i, s in enumerate(code) if "Prediction(" in s and ".ui()" in s)
    measured = next(i for i, s in enumerate(code) if ".record(" in s)
    assert guess < measured
    # The measurement is held, records the fitted crossover, and runs the plan of the mode.
    assert "crossover_guess.hold()" in code[measured] \
        and "crossover_guess.record(fit.crossover)" in code[measured]
    assert "kv_regime.plan(quick())" in code[measured] and "context_steps(" in code[measured]
    # The probe's printout (the fit's two parts give the answer) waits for the guess too.
    probe = next(s for s in code if "attention_seconds(" in s)
    assert "crossover_guess.shown()" in probe and "regime_of(" in probe
    assert any("kv_regime.levers(" in s for s in code)


def test_the_chapter_quotes_no_measured_figure_and_says_what_int8_does() -> None:
    text = "\n".join(c.source for c in _section_9() if c.cell_type == "markdown")
    # No run's figure (a rate, a time, a crossover count, a ratio) in the prose: they print.
    assert not re.search(r"\d+(\.\d+)?\s*(GB/s|ms)\b", text)
    assert not re.search(r"\b\d{1,3},\d{3} tokens", text)
    assert not re.search(r"\b0\.\d\dx?\b", text)
    # The int8 cache's honesty: it dequantizes before attention and saves memory, not reads.
    assert "dequantizes every" in text and "not reads" in text
    assert "vLLM" in text and "SGLang" in text
    assert "kernel-bound" in text and "on this machine" in text


def test_the_suites_note_names_kernel_bound_only_when_attention_explains_the_kv_part() -> None:
    from bench.suites.scale_long_context import _why
    from tinyserve.workbook.roofline_lab import KERNEL_SHARE
    m = {"fit": {"weights_rate": 12e9, "kv_rate": 4e9},
         "attention_probe": {"context": 90_000, "seconds": 0.15, "kv_part_s": 0.16}}
    assert _why("rates", m).endswith("kernel-bound (the one-query attention kernel, not the "
                                     "memory, sets it)")
    m["attention_probe"]["seconds"] = 0.16 * KERNEL_SHARE * 0.9
    assert "not the kernel alone" in _why("rates", m) and "kernel-bound" not in _why("rates", m)
    m["fit"]["kv_rate"] = 13e9                      # the cache read as fast as the weights
    assert _why("rates", m) == "rates"

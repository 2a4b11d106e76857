"""The sweeps chapters 2 and 3 run at both scales (tinyserve.workbook.scale_sweeps): shapes,
floors and regime names, at a small size. Nothing here checks a time."""
from __future__ import annotations

import math

import pytest
import torch

from tinyserve import load_model
from tinyserve.roofline import decode_cost, roofline_knee
from tinyserve.scale import scale_config, weight_bytes_of
from tinyserve.workbook import roofline_lab
from tinyserve.workbook.scale_sweeps import (GPU_DATASHEETS, Ceilings, cache_vs_recompute,
                                             describe_regime, linear_seconds,
                                             measure_ceilings, recompute_flops,
                                             recompute_floors, regime, row_sweep, step_floors)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return load_model("target", device="cpu", dtype=torch.float32)


def test_ceilings_are_positive_and_the_ridge_is_their_ratio() -> None:
    c = measure_ceilings("cpu", nbytes=4 * 2**20, n=64)
    assert c.bandwidth > 0 and c.flop_rate > 0 and c.way in ("sum", "copy", "matvec")
    assert c.ridge == pytest.approx(c.flop_rate / c.bandwidth)


def test_recompute_flops_sum_each_tokens_attention(target) -> None:
    cfg = target.config
    assert recompute_flops(cfg, 0) == cfg.flops_per_token(0)
    # n + 1 tokens of matmuls, plus attention over 0 + 1 + ... + n earlier positions
    n = 10
    attention = cfg.flops_per_token(1) - cfg.flops_per_token(0)
    expected = (n + 1) * cfg.flops_per_token(0) + attention * n * (n + 1) // 2
    assert recompute_flops(cfg, n) == expected


def test_cache_vs_recompute_times_each_context_in_order(target) -> None:
    rows = cache_vs_recompute(target, [8, 2, 4], repeats=1)
    assert [r.context for r in rows] == [2, 4, 8]
    assert all(r.recompute_s > 0 and r.cached_s > 0 and r.ratio > 0 for r in rows)
    with pytest.raises(ValueError, match="window"):
        cache_vs_recompute(target, [target.config.max_position_embeddings])


def test_floors_drop_the_memory_read_when_the_bytes_fit_in_the_cache(target) -> None:
    c = Ceilings(bandwidth=10e9, way="sum", flop_rate=50e9)
    cost = decode_cost(target, 1, 16)
    assert step_floors(target, c, 16) == (cost.bytes / 10e9, cost.flops / 50e9)
    assert step_floors(target, c, 16, cache=2**30)[0] == 0.0
    memory, compute = recompute_floors(target, c, 16)
    assert memory == cost.weight_bytes / 10e9
    assert compute == recompute_flops(target.config, 16) / 50e9
    assert recompute_floors(target, c, 16, cache=2**30)[0] == 0.0


def test_regime_names_the_larger_floor_or_overhead() -> None:
    # the course's one rule (issue 37): the chapters import it from here and from roofline_lab
    assert regime is roofline_lab.regime and describe_regime is roofline_lab.describe_regime
    assert regime(1.2, memory_s=1.0, compute_s=0.1).name == "memory-bound"
    assert regime(1.2, memory_s=0.1, compute_s=1.0).name == "compute-bound"
    assert regime(2.5, memory_s=1.0, compute_s=0.1).name == "overhead-bound"  # past NEAR (2x)
    assert regime(2.5, memory_s=1.0, compute_s=0.1, near=3.0).name == "memory-bound"
    assert regime(0.5, memory_s=0.0, compute_s=0.1).name == "overhead-bound"  # bytes in the cache
    assert f"{regime(1.2, 1.0, 0.1):15s}|" == "memory-bound   |"    # a table cell: its name
    text = describe_regime(1.5, 1.0, 0.1)
    assert text.startswith("memory-bound (1.5x the time to read its bytes") and "bytes)" in text
    assert describe_regime(0.2, 0.0, 0.1) == ("compute-bound (2.0x the time of its FLOPs, its "
                                              "bytes fit in the last-level cache: it waits for "
                                              "arithmetic)")
    over = describe_regime(3.0, 1.0, 0.1)
    assert "per-operation costs" in over and "no probe of its kernels ran" in over


def test_row_sweep_times_every_batch_size(target) -> None:
    step = row_sweep(target, [1, 2], context=4, steps=1, repeats=1)
    assert sorted(step) == [1, 2] and all(s > 0 for s in step.values())


def test_linear_seconds_times_each_row_count() -> None:
    out = linear_seconds([1, 2], out_features=64, in_features=32, repeats=1)
    assert sorted(out) == [1, 2] and all(s > 0 for s in out.values())


def test_a_gpu_ridge_is_hundreds_of_flops_per_byte_and_so_is_its_knee() -> None:
    # The chapter's datasheet figures: the ridge sits at hundreds of FLOPs per byte, and bf16
    # decode does about 1 FLOP per weight byte per row, so the knee is at hundreds of rows.
    gpu = scale_config("bandwidth", "cuda")       # the GPU preset's shape; nothing allocated
    for sheet in GPU_DATASHEETS:
        assert 150 < sheet.ridge < 400
        knee = roofline_knee(gpu, weight_bytes_of(gpu, 2), 2, 16, sheet.bandwidth, sheet.bf16_flops)
        assert 150 < knee < 600 and math.isfinite(knee)


def test_linear_rates_times_each_way_and_gives_the_per_row_slope() -> None:
    # Issue 52, M2: the per-call cost and the per-row rate, each library's, from one table.
    from tinyserve.backends import packed
    from tinyserve.workbook.scale_sweeps import LinearRates, linear_rates
    r = linear_rates([1, 2, 8], out_features=64, in_features=32, repeats=1)
    assert set(r.seconds) == ({"eager", "onednn"} if packed.available() else {"eager"})
    assert all(sorted(t) == [1, 2, 8] and min(t.values()) > 0 for t in r.seconds.values())
    made = LinearRates(100, 10, {"eager": {2: 1.0, 32: 4.0}})
    assert made.per_row_flops("eager", 2, 32) == pytest.approx(2 * 30 * 100 * 10 / 3.0)
    assert made.per_row_flops("eager", 32, 2) == float("inf")      # no time added: no rate

"""The decode roofline (tinyserve/roofline.py) and its predict-first lab: byte and FLOP counts
against the model itself, the bounds' crossover, and the measured-step helpers on a tiny model."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tinyserve import roofline
from tinyserve.backends import packed
from tinyserve.config import ModelConfig
from tinyserve.model import TinyLlama
from tinyserve.quant import quantize_model
from tinyserve.roofline import (bounds_seconds, crossover_batch, decode_cost, decode_cost_for,
                                eager_step_seconds, matmul_flops, mbu, measured_knee,
                                memory_bandwidth, parameter_count, read_bandwidth, roofline_knee,
                                row_sweep)
from tinyserve.workbook.capacity import kv_bytes_for_config
from tinyserve.workbook.roofline_lab import RooflineCase, RooflineLab

SMALL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48)


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_from_the_config_matches_the_model(tied: bool) -> None:
    cfg = replace(SMALL, tie_word_embeddings=tied)
    assert parameter_count(cfg) == TinyLlama(cfg).num_parameters()


def test_decode_cost_reads_weights_once_and_each_rows_cache() -> None:
    model = TinyLlama(SMALL).eval()
    one, eight = decode_cost(model, 1, 20), decode_cost(model, 8, 20)
    assert one.weight_bytes == eight.weight_bytes == model.num_parameters() * 4
    assert one.kv_bytes == kv_bytes_for_config(SMALL, 20, torch.float32)
    assert eight.kv_bytes == 8 * one.kv_bytes
    assert eight.flops == 8 * one.flops == 8 * SMALL.flops_per_token(20)
    # int8 weights: a quarter of the bytes (norm gains and scales stay in float)
    assert decode_cost(quantize_model(model), 1, 20).weight_bytes < one.weight_bytes / 3


def test_bounds_meet_at_the_crossover_batch() -> None:
    bandwidth, rate = 20e9, 50e9
    weights = parameter_count(SMALL) * 4
    b = crossover_batch(SMALL, weights, 4, 16, bandwidth, rate)
    assert 1 < b < 1000
    cost = decode_cost_for(SMALL, weights, 4, b, 16)   # a fractional batch is fine for the algebra
    bounds = bounds_seconds(cost, bandwidth, rate)
    assert math.isclose(bounds["memory_s"], bounds["compute_s"], rel_tol=1e-3)
    assert bounds["roofline_s"] == max(bounds["memory_s"], bounds["compute_s"])
    # a cache so long that each row reads more than it computes: memory-bound at any batch
    assert crossover_batch(SMALL, weights, 4, 10**7, bandwidth, 1e15) == math.inf
    assert mbu(cost, bandwidth, bounds["memory_s"]) == pytest.approx(1.0)


def test_machine_measurements_and_a_measured_step_are_positive() -> None:
    assert memory_bandwidth("cpu", 4 * 2**20, repeats=2) > 1e8       # > 0.1 GB/s
    assert matmul_flops("cpu", n=64, repeats=2) > 1e6
    torch.manual_seed(0)
    model = TinyLlama(SMALL).eval()
    assert eager_step_seconds(model, torch.randint(0, 96, (2, 5)), n=2, repeats=1) > 0


def test_the_flop_ceiling_is_the_fastest_way_torch_multiplies_here(monkeypatch) -> None:
    # On some CPUs MKL's a @ b runs at well under half of oneDNN's linear: a ceiling from one
    # library alone would put the ridge at less than half its place.
    ways = roofline.matmul_ways("cpu", n=64, repeats=2)
    assert set(ways) == ({"aten", "onednn"} if packed.available() else {"aten"})
    assert all(rate > 1e6 for rate in ways.values())
    assert set(roofline.matmul_ways("cpu", torch.bfloat16, n=64, repeats=1)) == {"aten"}
    if packed.available():             # the oneDNN way computes the same product as a @ b
        a, b = torch.randn(64, 64), torch.randn(64, 64)
        torch.testing.assert_close(packed.linear(a, packed.pack(b.t(), 64)), a @ b,
                                   rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(roofline, "matmul_ways", lambda *a, **k: {"aten": 1e9, "onednn": 3e9})
    assert roofline.matmul_flops("cpu") == roofline.flop_ceiling("cpu") == 3e9


def test_one_row_sweep_times_eager_and_compiled_steps_and_reports_each_batch() -> None:
    # issue 39: the chapters' sweep, bench decode's and bench scale's are this one
    torch.manual_seed(0)
    model = TinyLlama(SMALL).eval()
    seen: list[int] = []
    sweep = row_sweep(model, torch.randint(0, 96, (2, 5)), [1, 2], n=2, repeats=1,
                      compiled={"backend": "eager"}, after=lambda p: seen.append(p.rows))
    assert seen == [1, 2] and sorted(sweep) == [1, 2]
    for B, point in sweep.items():
        assert point.rows == B and point.eager_s > 0 and point.compiled_s > 0
        assert point.compile_s >= 0
    assert row_sweep(model, torch.randint(0, 96, (1, 5)), [1], n=1, repeats=1)[1].compiled_s is None


def test_graph_check_times_the_eager_step_with_roofline_s() -> None:
    from tinyserve import graph_check, roofline
    assert graph_check.eager_step_seconds is roofline.eager_step_seconds


def test_the_lab_hides_the_answer_until_a_guess_is_committed_then_locks_it() -> None:
    case = RooflineCase("tiny on a laptop", SMALL, 4, bandwidth=20e9, flop_rate=50e9, context=16)
    assert 1 < case.crossover() < 1000
    lab = RooflineLab(case)
    assert lab.revealed_text() == RooflineLab.HIDDEN and not lab.commit()
    lab.set_guess("lots")
    assert lab.guess is None and "not a number" in lab.message
    lab.set_guess("0.5")
    assert lab.guess is None and "at least 1" in lab.message
    lab.set_guess(str(round(case.crossover())))
    assert lab.commit() and "within 2x" in lab.revealed_text()
    assert f"{case.crossover():,.0f}" in lab.revealed_text()
    lab.set_guess("1000")                       # locked: the committed guess stands
    assert lab.guess == round(case.crossover()) and "committed" in lab.message
    far = RooflineLab(case)
    far.set_guess(case.crossover() * 50)
    far.commit()
    assert "too high" in far.revealed_text()
    assert lab.ui() is lab.ui()                 # the widgets are built once


def test_read_bandwidth_reports_each_way_and_the_fastest() -> None:
    r = read_bandwidth("cpu", 4 * 2**20, repeats=2)
    assert set(r.ways) == {"sum", "copy", "matvec"}
    assert r.best == max(r.ways.values()) == r.ways[r.fastest_way] > 1e8


def test_roofline_knee_is_where_the_roofline_reaches_one_and_a_half_rows() -> None:
    weights, rate, bandwidth = 4 * parameter_count(SMALL), 1e11, 1e10
    knee = roofline_knee(SMALL, weights, 4, 16, bandwidth, rate)
    one = bounds_seconds(decode_cost_for(SMALL, weights, 4, 1, 16), bandwidth, rate)["roofline_s"]
    at = bounds_seconds(decode_cost_for(SMALL, weights, 4, knee, 16), bandwidth, rate)["roofline_s"]
    assert knee > 1
    # no KV reads: the memory bound is flat, so the knee is 1.5 times the crossover
    no_kv = roofline_knee(SMALL, weights, 4, 0, bandwidth, rate)
    assert no_kv == pytest.approx(1.5 * crossover_batch(SMALL, weights, 4, 0, bandwidth, rate))
    assert at == pytest.approx(1.5 * one, rel=1e-3)
    # compute-bound from the first row: the knee is 1.5 rows
    assert roofline_knee(SMALL, weights, 4, 16, 1e15, 1e6) == pytest.approx(1.5, rel=1e-3)


def test_measured_knee_interpolates_between_measured_rows() -> None:
    assert measured_knee({1: 1.0, 2: 1.2, 4: 1.4, 8: 2.0}) == pytest.approx(4 + 4 * 0.1 / 0.6)
    assert measured_knee({1: 1.0, 2: 1.6}) == pytest.approx(2 - 0.1 / 0.6)
    assert measured_knee({1: 1.0, 8: 1.1}) == math.inf
    with pytest.raises(ValueError, match="one-row step"):
        measured_knee({2: 1.0, 4: 2.0})


# --- issue 52: the two bounds (M4) and one name per cause (M1) ------------------------------

def test_bounds_hold_the_perfect_overlap_max_and_the_no_overlap_sum() -> None:
    cost = decode_cost_for(SMALL, 4 * parameter_count(SMALL), 4, 4, 16)
    b = bounds_seconds(cost, 1e10, 1e11)
    assert b["roofline_s"] == max(b["memory_s"], b["compute_s"])
    assert b["no_overlap_s"] == pytest.approx(b["memory_s"] + b["compute_s"])
    assert set(roofline.OVERLAP_KEYS.values()) == {"roofline_s", "no_overlap_s"}


def test_the_two_bounds_are_printed_together_with_the_one_followed() -> None:
    # the course's own runs: 4 rows / 1 measured 1.25, 1.21 by the sum, 1.00 by the max
    line = roofline.two_bounds("4 rows / 1", 1.25, 1.00, 1.21)
    assert "measured 1.25" in line and "perfect overlap (max) 1.00" in line
    assert "no overlap (sum) 1.21" in line and line.endswith("followed the no-overlap sum")
    assert roofline.nearer_bound(1.02, 1.00, 1.28) == "perfect overlap (max)"
    assert roofline.nearer_bound(8.0, 20.3, 8.3) == "no overlap (sum)"      # the knee, in rows
    with pytest.raises(ValueError, match="positive"):
        roofline.nearer_bound(0.0, 1.0, 1.2)


def test_the_no_overlap_knee_is_where_the_sum_reaches_one_and_a_half_rows() -> None:
    weights, rate, bandwidth = 4 * parameter_count(SMALL), 1e11, 1e10
    knee = roofline_knee(SMALL, weights, 4, 16, bandwidth, rate, overlap=False)
    one = bounds_seconds(decode_cost_for(SMALL, weights, 4, 1, 16), bandwidth, rate)
    at = bounds_seconds(decode_cost_for(SMALL, weights, 4, knee, 16), bandwidth, rate)
    assert at["no_overlap_s"] == pytest.approx(1.5 * one["no_overlap_s"], rel=1e-4)
    # the sum grows from a higher start at every row: its knee comes sooner than the max's
    assert 1 < knee < roofline_knee(SMALL, weights, 4, 16, bandwidth, rate)


def test_the_rule_names_a_kernel_below_the_roof_apart_from_dispatch() -> None:
    from tinyserve.workbook.roofline_lab import KERNEL_SHARE, REGIMES, regime
    # 4.2x the roofline; the kernels alone explain most of the gap: below the roof
    below = regime(4.2, 1.0, 0.1, kernel_s=3.9)
    assert below.name == "kernel-bound" and "below the roof" in below.reason
    # the kernels alone run near the roofline: the gap is outside them
    over = regime(4.2, 1.0, 0.1, kernel_s=1.1)
    assert over.name == "overhead-bound" and "outside the kernels" in over.reason
    edge = 1.0 + KERNEL_SHARE * (4.2 - 1.0)
    assert regime(4.2, 1.0, 0.1, kernel_s=edge).name == "kernel-bound"
    assert regime(4.2, 1.0, 0.1, kernel_s=edge * 0.99).name == "overhead-bound"
    # near the roofline the probe changes nothing; without one, the reason says it is unknown
    assert regime(1.5, 1.0, 0.1, kernel_s=1.4).name == "memory-bound"
    assert "no probe" in regime(4.2, 1.0, 0.1).reason
    assert set(REGIMES) == {"memory-bound", "compute-bound", "kernel-bound", "overhead-bound"}
    with pytest.raises(ValueError, match="kernels timed alone"):
        regime(4.2, 1.0, 0.1, kernel_s=0.0)


def test_the_kernel_probe_times_every_linear_once() -> None:
    from tinyserve.workbook.roofline_lab import kernel_probe_seconds
    torch.manual_seed(0)
    model = TinyLlama(SMALL).eval()
    assert kernel_probe_seconds(model, 2, repeats=1) > 0
    with pytest.raises(ValueError, match="no nn.Linear"):
        kernel_probe_seconds(torch.nn.Sequential(torch.nn.ReLU()), 1)


def test_one_tp_bandwidth_bound_the_read_gain_times_the_bytes_saved() -> None:
    # Issue 52, I3: chapter 7 and bench scale's scale_tp2_vs_bandwidth_bound divide by this one.
    assert roofline.tp_bandwidth_bound(1.2, 100, 50) == pytest.approx(1.2)
    assert roofline.tp_bandwidth_bound(1.2, 100, 60) == pytest.approx(1.0)   # replicated head
    assert roofline.tp_bandwidth_bound(2.0, 90, 30, ranks=3) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="positive"):
        roofline.tp_bandwidth_bound(0.0, 100, 50)

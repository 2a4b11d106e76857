"""bench scale's fast-path parts (issue 37 item 5) without running them: the ratios read from
a report's measurements, the notes a missed goal gets, the quick recipe put back, and a
preparing process that overruns its deadline killed. (The whole suite runs, quick, in
tests/test_bench.py.)"""
from __future__ import annotations

import subprocess

import pytest

from bench.suites import _prepare_repeat, scale
from tinyserve.backends import fast


def measurements(**parts: dict) -> dict:
    """A report's measurements with made-up figures: every part measured unless ``parts``
    replaces it (``{"skipped": ...}``)."""
    sweep = [{"rows": r, "eager_ms": 2.0 * r, "compiled_ms": 1.0 + 0.1 * r,
              "fastest_ms": 1.0 + 0.1 * r, "fastest_path": "compiled", "bytes": 10**8,
              "memory_bound_ms": 0.9, "compute_bound_ms": 0.1} for r in (1, 4)]
    spec = {"measured_speedup": 1.5, "measured_vs_predicted": 0.7, "predicted_speedup": 2.1,
            "acceptance_prob": 0.8, "tokens_per_pass_measured": 3.4, "spec_tokens_per_s": 30.0,
            "plain_tokens_per_s": 20.0, "verify_cost": 1.3, "draft_cost": 0.2,
            "spec_pass_ms": 9.0, "formula_pass_ms": 7.0, "plain_s": 0.4, "tokens": 100,
            "pass_costs_ms": {"decode_ms": 3.0, "verify_ms": 3.9, "draft_step_ms": 0.6}}
    m = {"sweep": sweep, "mbu_b1": {"eager": 0.5, "compiled": 0.8},
         "bandwidth_gb_per_s": 40.0, "bandwidth_way": "sum",
         "read_bandwidth_gb_per_s": {"sum": 40.0}, "matmul_gflop_per_s": 100.0,
         "ridge_flop_per_byte": 2.5,
         "verify_vs_step": {"compiled_verify_ms": 1.4, "eager_verify_ms": 3.0,
                            "compiled_step_ms": 1.1, "eager_step_ms": 2.0},
         "long_context": {"tokens": 512, "recompute_step_ms": 50.0, "cached_step_ms": 2.0,
                          "prefill_ms": 40.0},
         "knee": {"measured_fastest": 8.0, "measured_eager": 2.0, "roofline": 10.0},
         "int8": {"skipped": "no kernel"},
         "speculative": {**spec, "measured_speedup": 1.1},          # the eager run
         "speculative_fast": spec,
         "engine_fast": {"throughput_4_vs_1": 2.5, "one_tokens_per_s": 20.0,
                         "four_tokens_per_s": 50.0, "mbu_b1": {"mbu": 0.6, "bytes": 10**8,
                                                               "memory_bound_ms": 2.5},
                         "steps": {"1": {"decode_step_ms": 4.0, "decode_steps": 31,
                                         "other_steps_s": 0.01, "step_s": 0.14},
                                   "4": {"decode_step_ms": 5.0, "decode_steps": 31,
                                         "other_steps_s": 0.04, "step_s": 0.2}}},
         "tensor_parallel": {"skipped": "one core"},
         "prepare_repeat": {"first_s": 60.0, "second_s": 20.0, "trace_s": 6.0}}
    m.update(parts)
    return m


def test_the_fast_parts_give_their_ratios_and_the_spec_ratios_read_the_fast_run() -> None:
    ratios = scale.scale_ratios(measurements())
    assert ratios["scale_spec_speedup_fast"] == 1.5                 # not the eager run's 1.1
    assert ratios["scale_spec_measured_vs_predicted"] == 0.7
    assert ratios["scale_engine_mbu_b1"] == 0.6
    assert ratios["scale_engine_throughput_4_vs_1"] == 2.5
    assert ratios["scale_prepare_repeat_s"] == 20.0                 # the second process's
    assert "scale_tp2_decode_speedup" not in ratios and "scale_int8_decode_speedup" not in ratios


def test_a_skipped_fast_part_gives_no_ratio() -> None:
    skipped = {"skipped": "failed"}
    ratios = scale.scale_ratios(measurements(speculative_fast=skipped, engine_fast=skipped,
                                             prepare_repeat=skipped))
    assert not {"scale_spec_speedup_fast", "scale_spec_measured_vs_predicted",
                "scale_engine_mbu_b1", "scale_engine_throughput_4_vs_1",
                "scale_prepare_repeat_s"} & set(ratios)


def test_each_missed_fast_goal_has_a_note_naming_the_measurements_beside_it() -> None:
    m = measurements()
    notes = scale.explain(scale.scale_ratios(m), m)
    assert "0.20x the target's" in notes["scale_spec_speedup_fast"]       # draft / target step
    assert "(1.30x)" in notes["scale_spec_measured_vs_predicted"]         # verify / step
    assert "4.00 ms a token" in notes["scale_spec_measured_vs_predicted"]  # plain, as run
    assert "4.00 ms" in notes["scale_engine_mbu_b1"]
    assert "1.25x" in notes["scale_engine_throughput_4_vs_1"]             # 4-row / 1-row step
    assert "FX graph cache is bypassed" in notes["scale_prepare_repeat_s"]
    assert "14.0 s of it is beyond the trace" in notes["scale_prepare_repeat_s"]


def test_quick_traces_the_fast_path_and_puts_the_recipe_back() -> None:
    before = fast.CPU_RECIPE
    with scale.fast_recipe(quick=True):
        assert fast.CPU_RECIPE.backend == "eager" and not fast.CPU_RECIPE.freezing
    assert fast.CPU_RECIPE is before
    with scale.fast_recipe(quick=False):
        assert fast.CPU_RECIPE is before


def test_a_preparing_process_past_its_deadline_is_killed(tmp_path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        _prepare_repeat._prepare_process("traced", "bandwidth", 32, str(tmp_path), limit=0.2)

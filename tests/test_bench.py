"""Every benchmark suite runs end to end (``--quick``: tiny sizes) and writes a report of the
agreed shape. Timings are never asserted here: they live in the reports."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinyserve.__main__ import main

EXPECTED_RATIOS = {
    "batching": {"continuous_vs_static_throughput"},
    "paged": {"paged_waste_fraction", "contiguous_waste_fraction"},
    "prefix": {"prefix_ttft_speedup"},
    "chunked": {"chunked_p99_itl_improvement", "size_aware_p99_ttft_improvement"},
    "kv": {"cache_speedup_256", "cache_speedup_512"},
    "decode": {"decode_mbu_b1_eager", "decode_mbu_b1_compiled", "compiled_vs_eager_b1", "compile_s"},
    "hf": {"vs_hf_generate_b1", "vs_hf_generate_b8", "decode_roofline_fraction",
           "plain_loop_vs_ours_b1", "plain_loop_vs_ours_b8"},
    "quant": {"int8_weight_memory_ratio", "int8_kv_memory_ratio", "int8_val_loss_delta",
              "int8_kv_val_loss_delta", "int8_decode_speedup", "int8_kv_decode_speedup_long",
              "bf16_decode_speedup"},
    "parallel": {"tp2_speedup_prefill", "tp2_speedup_decode", "tp2_allreduce_share",
                 "tp2_allreduce_share_prefill", "pp_bubble_measured", "pp_bubble_formula"},
    "spec": {"spec_speedup_k2", "spec_speedup_k4", "spec_speedup_k6", "spec_acceptance_k4",
             "ngram_speedup_k2", "ngram_speedup_k4", "ngram_speedup_k6", "ngram_acceptance_k4",
             "spec_measured_vs_predicted_k4", "ngram_measured_vs_predicted_k4"},
    "serve": {"goodput_knee_vs_overload", "sim_shape_routing_p99_ttft_improvement",
              "sim_least_loaded_p99_ttft_improvement"},
}


def _check_report(data: dict, suite: str) -> None:
    assert {"suite", "ratios", "measurements", "machine", "git_commit", "date",
            "conditions", "quick", "load", "clean"} <= set(data)
    assert {"before", "after", "busy_above", "busy"} <= set(data["load"])
    assert data["suite"] == suite and data["quick"] is True
    assert set(data["ratios"]) == EXPECTED_RATIOS[suite]
    # A "_delta" is a signed relative change (quality), not a speed ratio: any finite float.
    assert all(isinstance(v, float) and (v > 0 or k.endswith("_delta"))
               for k, v in data["ratios"].items())
    assert data["machine"]["torch"] and data["machine"]["cpu_count"]
    assert data["machine"]["torch_threads"] == 1     # one torch thread per process in bench
    assert {"cpu_model", "cpu_isa", "torch_cpu_capability"} <= set(data["machine"])  # issue 50
    assert data["date"][:2] == "20"


@pytest.mark.parametrize("suite", ["batching", "paged", "prefix", "chunked", "kv", "decode", "hf", "quant",
                                   "parallel", "spec", "serve"])
def test_suite_writes_its_report(suite: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / f"{suite}.json"
    assert main(["bench", suite, "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    _check_report(data, suite)
    assert "-----" in printed  # a table for people next to the JSON for machines
    if suite == "kv":
        assert out.with_suffix(".png").stat().st_size > 0  # and a plot
    if suite == "batching":   # a frontier point per slot limit, and its plot
        assert [p["max_num_seqs"] for p in data["measurements"]["frontier"]] == [1, 4]
        assert out.with_suffix(".png").stat().st_size > 0
    elif suite == "paged":    # accounting, not timing: the same on every machine
        m = data["measurements"]
        assert m["pool_bytes"] == m["formula_bytes"]
        assert data["ratios"]["paged_waste_fraction"] < data["ratios"]["contiguous_waste_fraction"]
        assert m["concurrency_same_memory"]["paged_peak"] > m["concurrency_same_memory"]["contiguous"]
    elif suite == "prefix":   # every request after the first hit the whole shared prompt
        assert data["measurements"]["on"]["cached_tokens"][1:] == [48, 48, 48]
        assert data["measurements"]["off"]["cached_tokens"] == [0, 0, 0, 0]
    elif suite == "chunked":
        assert set(data["measurements"]["chunked_prefill"]["runs"]) == {"one-shot", "chunked"}
    if suite == "kv":
        steps = data["measurements"]["step_cost"]
        assert [s["position"] for s in steps] == sorted(s["position"] for s in steps)
        assert data["measurements"]["generation"]["512"]["generated"] == 63  # fills the window
    elif suite == "decode":   # both paths ran at every batch, with their bounds
        m = data["measurements"]
        assert m["tokens_equal"] is True and [r["batch"] for r in m["sweep"]] == [1, 2]
        assert all(r["memory_bound_ms"] > 0 and r["compute_bound_ms"] > 0 for r in m["sweep"])
        assert [e["rows"] for e in m["engine_vs_cost_model"]] == [2, 4]
        assert all(e["measured_ms"] > 0 and e["cost_model_ms"] > 0 for e in m["engine_vs_cost_model"])
    elif suite == "hf":
        roof = data["measurements"]["roofline"]
        assert roof["floor_ms_per_token"] > 0 and roof["bandwidth_gb_per_s"] > 0
        assert all(data["measurements"][b]["plain_loop_s"] > 0 for b in ("b1", "b8"))
        rounds = data["measurements"]["b8"]["rounds_s"]     # the runs the ratios came from
        assert set(rounds) == {"ours", "generate", "plain"}
        assert all(len(times) == data["conditions"]["repeats"] for times in rounds.values())
    elif suite == "parallel":  # two ranks ran: 2 all-reduces per block, a share of the time
        assert data["measurements"]["tp"]["all_reduces_per_forward"] == 4
        assert 0 < data["ratios"]["tp2_allreduce_share"] < 1
        assert data["ratios"]["pp_bubble_formula"] == 0.2  # (p - 1) / (m + p - 1), p=2, m=4
    elif suite == "spec":  # every k of both drafters ran, checked against plain decode
        assert set(data["measurements"]["runs"]) == {f"{d}_k{k}" for d in ("spec", "ngram")
                                                     for k in (2, 4, 6)}
        assert 0 < data["ratios"]["spec_acceptance_k4"] <= 1
    elif suite == "quant":  # the int8 variants really hold fewer bytes than fp32
        v = data["measurements"]["variants"]
        assert v["int8 weights"]["weight_bytes"] < v["bf16"]["weight_bytes"] < v["fp32"]["weight_bytes"]
        assert v["int8 KV"]["kv_bytes_full_window"] < v["fp32"]["kv_bytes_full_window"]
    elif suite == "serve":  # the load generator's figures at the knee, and its plot
        assert {"p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_itl_ms", "p99_e2el_ms",
                "request_throughput", "output_throughput", "goodput"} <= set(data["metrics"])
        assert out.with_suffix(".png").stat().st_size > 0


def test_interleaved_timer_takes_turns_and_pairs_rounds() -> None:
    """Each round runs every function once, the first to run rotating, and a ratio pairs
    the times of one round (a drift between rounds cancels)."""
    import torch

    from bench.common import in_turns, interleaved_seconds, median_ratio
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = interleaved_seconds(fns, torch.device("cpu"), rounds=4, warmup=1)
    assert calls == ["a", "b", "c",                       # warm-up, untimed
                     "a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for v in times.values() for t in v)
    # in_turns keeps what each call returned (quant and spec time inside their functions).
    counter = iter(range(100))
    got = in_turns({"x": lambda: next(counter), "y": lambda: next(counter)}, rounds=3, warmup=0)
    assert got == {"x": [0, 3, 4], "y": [1, 2, 5]}
    with pytest.raises(ValueError, match="at least one"):
        in_turns({}, rounds=3)
    # The machine twice as slow in later rounds, one function 2x the other in each round.
    slow = [1.0, 1.0, 2.0, 2.0]
    assert median_ratio([2 * s for s in slow], slow) == 2.0
    assert median_ratio([3.0, 1.0, 10.0], [1.0, 1.0, 1.0]) == 3.0   # the middle round's
    with pytest.raises(ValueError):
        median_ratio([1.0, 2.0], [1.0])


def test_unknown_suite_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    import bench
    assert "unknown bench suite 'nope'" in err
    assert "choose one of: " + ", ".join(bench.SUITES) in err


def test_bench_all_runs_each_suite_in_its_own_process_and_compares_before_replacing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`make bench`'s loop on the quickest suite: a progress line, the report with its load
    and clean flag, and on the second run the compare against the report it replaces."""
    for run in (1, 2):
        assert main(["bench", "all", "--quick", "--suites", "paged", "--out", str(tmp_path)]) == 0
        printed = capsys.readouterr().out
        assert "[1/1] bench paged: done in" in printed
        assert ("moved the wrong way" in printed) == (run == 2)
    data = json.loads((tmp_path / "paged.json").read_text())
    _check_report(data, "paged")
    assert "contiguous" in (tmp_path / "paged.txt").read_text()   # the printed tables kept


#: bench scale's ratios (issue 30, issue 37 item 5); the int8, speculative, engine,
#: tensor-parallel and repeat-preparation ones are measured wherever their kernel or module is
#: available (the report says why otherwise).
SCALE_CORE = {"scale_decode_mbu_b1", "scale_step_rows4_vs_rows1",
              "scale_knee_measured_vs_predicted", "scale_verify_k4_vs_step",
              "scale_cache_speedup_512", "scale_prefill_tokens_per_step"}
SCALE_OPTIONAL = {"int8": {"scale_int8_decode_speedup"},
                  "fast_vs_eager": {"scale_fast_vs_eager_b1"},
                  "speculative_fast": {"scale_spec_speedup_fast",
                                       "scale_spec_measured_vs_predicted"},
                  "engine_fast": {"scale_engine_mbu_b1", "scale_engine_throughput_4_vs_1",
                                  "scale_engine_fast_vs_eager_b1"},
                  "tensor_parallel": {"scale_tp2_decode_speedup", "scale_tp2_vs_bandwidth_bound"},
                  "prepare_repeat": {"scale_prepare_repeat_s"}}


def test_scale_suite_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench scale --quick: every part ran on tiny models and the report has issue 30's
    ratios, the sweep eager and compiled at each row count with its compile time, and a
    note for each ratio that misses its declared goal (quick figures miss most)."""
    from bench.headlines import BY_SUITE
    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--quick", "--json", str(out)]) == 0
    assert "-----" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {"suite", "ratios", "measurements", "machine", "git_commit", "date",
            "conditions", "quick", "load", "clean", "notes"} <= set(data)
    assert data["suite"] == "scale" and data["quick"] is True
    assert data["machine"]["torch_threads"] == 1
    m = data["measurements"]
    expected = set(SCALE_CORE)
    if m["knee"]["measured_fastest"] == float("inf"):   # never 1.5x one row: said in a note
        expected.discard("scale_knee_measured_vs_predicted")
        assert "scale_knee_measured_vs_predicted" in data["notes"]
    for part, names in SCALE_OPTIONAL.items():
        if "skipped" not in m[part]:
            expected |= names
    assert set(data["ratios"]) == expected
    assert all(isinstance(v, float) and v > 0 for v in data["ratios"].values())
    assert [r["rows"] for r in m["sweep"]] == data["conditions"]["rows"]
    assert all(r["eager_ms"] > 0 and r["compiled_ms"] > 0 and r["compile_s"] >= 0
               and r["fastest_ms"] == min(t for t in (r["eager_ms"], r["compiled_ms"],
                                                      r["packed_ms"]) if t is not None)
               and (r["packed_ms"] is None) == (r["rows"] == 1) for r in m["sweep"])
    assert set(m["read_bandwidth_gb_per_s"]) == {"sum", "copy", "matvec"}
    assert m["verify_vs_step"]["compiled_verify_ms"] > 0 and m["long_context"]["prefill_ms"] > 0
    # The eager speculative run is kept beside the fast one the ratios read; both sides of
    # the fast one report tokens/s; the repeat preparation ran in two processes.
    assert "measured_speedup" in m["speculative"] or "skipped" in m["speculative"]
    if "skipped" not in m["speculative_fast"]:
        assert m["speculative_fast"]["fast"] is True
        assert min(m["speculative_fast"]["spec_tokens_per_s"],
                   m["speculative_fast"]["plain_tokens_per_s"]) > 0
    if "skipped" not in m["prepare_repeat"]:
        assert min(m["prepare_repeat"]["first_s"], m["prepare_repeat"]["trace_s"]) > 0
    if "skipped" not in m["engine_fast"]:
        assert {"1", "4"} <= set(m["engine_fast"]["steps"])
    # Issue 50: every fast shape the suite prepared says what it runs here and why; the
    # fast-against-eager ratios carry their note, goal met or not.
    shapes = {(c["part"], c["model"], c["shape"]) for c in m["fast_choices"]}
    assert ("loops", "target", "decode 1 rows x window 64") in shapes
    assert all(c["kernel"] in ("compiled", "packed", "eager") and c["sentence"]
               for c in m["fast_choices"])
    if "skipped" not in m["prepare_repeat"]:
        assert m["prepare_repeat"]["second_choice"]["why"] == "kept"
        assert not m["prepare_repeat"]["compiled_a_kept_loser"]
    for name in ("scale_fast_vs_eager_b1", "scale_engine_fast_vs_eager_b1"):
        assert name not in data["ratios"] or "its shape (" in data["notes"][name]
    # Every ratio is declared in the ledger, and each missed goal has its note.
    declared = {h.name: h for h in BY_SUITE["scale"].headlines}
    assert set(data["ratios"]) <= set(declared)
    missed = {k for k, v in data["ratios"].items()
              if declared[k].goal is not None and not declared[k].goal.met(v)}
    assert missed <= set(data["notes"]) and all(data["notes"][k] for k in missed)

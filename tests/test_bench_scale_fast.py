"""bench scale's fast-path parts (issue 37 item 5, issue 50) without running them: the ratios
read from a report's measurements (the fast steps against eager, in turns, among them), the
notes a missed goal gets, the per-shape choices the report lists, the quick recipe put back,
and a preparing process that overruns its deadline killed. (The whole suite runs, quick, in
tests/test_bench.py.)"""
from __future__ import annotations

import subprocess

import pytest

from bench.suites import (_fast_choices, _fast_vs_eager, _linear_rows, _loops_step,
                          _prepare_repeat, scale)
from tinyserve.backends import fast
from tinyserve.backends.choices import StepChoice


def choice(part: str, shape: str, kernel: str, why: str = "timed", model: str = "target",
           **seconds: float) -> dict:
    rows = int(shape.split(" rows")[0].split()[-1]) if " rows" in shape else 1
    made = StepChoice(rows, kernel, tuple(seconds.items()), why)
    return _fast_choices.choice_entry(part, model, shape, made)


#: The loops' step in turns with the probe: a busy second round slows the step and the probe.
LOOPS_ROUNDS = {"fast_1": [2e-3, 4e-3, 2e-3], "fast_4": [3.4e-3, 6.8e-3, 3.2e-3],
                "eager_1": [4e-3, 8e-3, 4e-3], "probe": [40e9, 20e9, 40e9]}


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
                         "four_tokens_per_s": 50.0,
                         "mbu_b1": {"mbu": 0.6, "bytes": 10**8, "memory_bound_ms": 2.5,
                                    "mbu_rounds": [0.5, 0.6, 0.7], "roof_gb_per_s": 40.0,
                                    "decode_step_ms": 4.0},
                         "steps": {"1": {"decode_step_ms": 4.0, "decode_steps": 31,
                                         "other_steps_s": 0.01, "step_s": 0.14},
                                   "4": {"decode_step_ms": 5.0, "decode_steps": 31,
                                         "other_steps_s": 0.04, "step_s": 0.2}}},
         "loops_step": {"rounds": {k: list(v) for k, v in LOOPS_ROUNDS.items()},
                        **_loops_step.paired_figures(LOOPS_ROUNDS, 6 * 10**7)},
         "tensor_parallel": {"skipped": "one core"},
         "prepare_repeat": {"first_s": 60.0, "second_s": 20.0, "trace_s": 6.0},
         # Issue 50: the loops' batch-1 step fast and eager in turns (a busy second round
         # slows both), and the engine's; the shapes' choices.
         "fast_vs_eager": {**_fast_vs_eager.in_turns_figures([9e-3, 18e-3, 10e-3],
                                                             [12e-3, 24e-3, 10e-3]),
                           "tokens_equal": True, "prompt_tokens": 64, "new_tokens": 32,
                           "rounds": 3},
         "fast_choices": [
             choice("loops", "decode 1 rows x window 128", "compiled", compiled=9e-3,
                    eager=12e-3),
             choice("engine", "engine decode 1 rows x 8 blocks", "eager", compiled=13e-3,
                    eager=11e-3)]}
    m["engine_fast"]["fast_vs_eager_b1"] = _fast_vs_eager.in_turns_figures(
        [11e-3, 11e-3, 12e-3], [10e-3, 11e-3, 10e-3])
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


def test_the_loops_step_ratios_hold_each_round_against_the_runs_fastest_read() -> None:
    """60 MB a step, the probe reading 40 GB/s in two rounds and 20 in a busy one whose step
    took twice as long: each round against the fastest read (40) gives 0.75, 0.375, 0.75, and
    the median sets the busy round aside."""
    ratios = scale.scale_ratios(measurements())
    assert ratios["scale_decode_mbu_b1"] == pytest.approx(0.75)
    assert ratios["scale_step_rows4_vs_rows1"] == pytest.approx(1.7)   # 1.7, 1.7, 1.6
    p = measurements()["loops_step"]
    assert p["mbu_fast_rounds"] == pytest.approx([0.75, 0.375, 0.75])
    assert p["mbu_eager"] == pytest.approx(0.375)
    assert p["roof_gb_per_s"] == pytest.approx(40.0)
    assert p["probe_gb_per_s"] == {"median": 40.0, "min": 20.0, "max": 40.0}


def test_a_probe_that_reads_slower_than_a_step_never_puts_the_step_above_the_memory() -> None:
    """The engine's rounds' probe read 21 GB/s while its step streamed its bytes at 24 GB/s:
    against that round's probe the MBU would be 1.14. The run's fastest read (the ceilings'
    25, the loops' rounds' 27) is the roof for both paths: 24 / 27."""
    import torch

    from tinyserve.model import TinyLlama
    from tinyserve.roofline import decode_cost
    torch.manual_seed(0)
    model = TinyLlama(scale.QUICK_CONFIG).eval()
    step_ms = 1e3 * decode_cost(model, 1, 8).bytes / 24e9            # 24 GB/s
    m = measurements()
    m["bandwidth_gb_per_s"] = 25.0
    m["loops_step"] = {**m["loops_step"], "rounds": {**LOOPS_ROUNDS, "probe": [26e9, 27e9, 25e9]}}
    m["engine_fast"]["rounds"] = {"one_decode_step_ms": [step_ms] * 3,
                                  "probe_gb_per_s": [21.0, 20.5, 21.5]}
    roof = scale.run_roof(m)
    assert roof == pytest.approx(27e9)
    out = scale.engine_mbu(model, {**m["engine_fast"], "context": 8}, roof)
    assert out["mbu_rounds"] == pytest.approx([24 / 27] * 3)
    assert out["roof_gb_per_s"] == pytest.approx(27.0)
    assert out["probe_gb_per_s"] == {"median": 21.0, "min": 20.5, "max": 21.5}
    engine_gone = measurements(engine_fast={"skipped": "failed"})
    assert scale.run_roof(engine_gone) == pytest.approx(40e9)        # the loops' probe, 40


def test_the_loops_step_is_timed_in_turns_with_the_probe(monkeypatch) -> None:
    """loops_step_in_turns calls the fast steps, the eager step and the probe once a round,
    after one untimed round, on the quick model (the fast path only traced)."""
    import torch

    from tinyserve.model import TinyLlama
    calls = []
    monkeypatch.setattr(_loops_step, "read_bandwidth",
                        lambda device, nbytes, repeats: calls.append(nbytes) or
                        type("R", (), {"best": 1e10})())
    torch.manual_seed(0)
    model = TinyLlama(scale.QUICK_CONFIG).eval()
    with scale.fast_recipe(quick=True):
        out = _loops_step.loops_step_in_turns(model, scale._prompts(model, 4, 8), 4, 2,
                                              probe_bytes=2**20)
    scale.forget_compiled(model)
    assert calls == [2**20] * 3                                       # warm-up + 2 rounds
    assert {k: len(v) for k, v in out["rounds"].items()} == {
        "fast_1": 2, "fast_4": 2, "eager_1": 2, "probe": 2}
    assert out["context"] == 8 + 2 and out["bytes"] > 0
    assert len(out["mbu_fast_rounds"]) == 2 and out["mbu_fast"] > 0


def test_one_projection_is_timed_at_each_rows_on_both_paths_in_turns() -> None:
    """linear_rows on the quick model (the fast path only traced): every projection, path
    and rows count timed once a round, and the ratio of the last rows to the first."""
    import torch

    from tinyserve.model import TinyLlama
    torch.manual_seed(0)
    model = TinyLlama(scale.QUICK_CONFIG).eval()
    with scale.fast_recipe(quick=True):
        k = _linear_rows.linear_rows(model, (1, 5), 3, flush_bytes=2**20)
    scale.forget_compiled(model)
    assert set(k["ms"]) == {f"{n}/{p}/{r}" for n in ("down_proj", "up_proj")
                            for p in ("eager", "compiled") for r in (1, 5)}
    assert set(k["ratio"]) == {"down_proj/eager", "down_proj/compiled", "up_proj/eager",
                               "up_proj/compiled"}
    cfg = scale.QUICK_CONFIG
    assert k["weight_bytes"]["down_proj"] == 4 * cfg.hidden_size * cfg.intermediate_size
    assert all(v > 0 for v in k["gb_per_s"].values())


def test_a_missed_few_row_goal_names_the_kernel_alone() -> None:
    k = {"rows": [1, 5], "weight_bytes": {"down_proj": 45 * 10**6},
         "ratio": {"down_proj/compiled": 1.8, "down_proj/eager": 2.6},
         "gb_per_s": {"down_proj/compiled/1": 11.0, "down_proj/compiled/5": 6.1,
                      "down_proj/eager/1": 12.0, "down_proj/eager/5": 4.6}}
    m = measurements(linear_rows=k)
    notes = scale.explain(scale.scale_ratios(m), m)
    clause = "one down_proj alone (45 MB, caches flushed) costs at 5 rows, against 1: compiled 1.80x"
    for name in ("scale_step_rows4_vs_rows1", "scale_spec_speedup_fast",
                 "scale_engine_throughput_4_vs_1"):
        assert clause in notes[name]
    assert "(11.0 against 6.1 GB/s), eager 2.60x" in notes["scale_step_rows4_vs_rows1"]
    assert "kernel itself does not stream its weight" in notes["scale_step_rows4_vs_rows1"]
    # a kernel that serves the rows at about one row's cost: the note says it, not the opposite
    k["ratio"]["down_proj/compiled"] = 1.1
    notes = scale.explain(scale.scale_ratios(m), m)
    assert "not this kernel's alone" in notes["scale_step_rows4_vs_rows1"]
    assert "does not stream" not in notes["scale_step_rows4_vs_rows1"]


def test_a_missed_mbu_goal_holds_the_one_row_kernel_alone_against_the_probe() -> None:
    k = {"rows": [1, 5], "weight_bytes": {"down_proj": 45 * 10**6},
         "ratio": {"down_proj/compiled": 0.7, "down_proj/eager": 2.4},
         "gb_per_s": {"down_proj/compiled/1": 20.0, "down_proj/compiled/5": 28.0,
                      "down_proj/eager/1": 24.0, "down_proj/eager/5": 10.0}}
    m = measurements(linear_rows=k)             # probes: 40 GB/s (loops), 40 (engine)
    m["loops_step"]["mbu_fast_rounds"] = [0.6, 0.6, 0.6]
    notes = scale.explain(scale.scale_ratios(m), m)
    for name in ("scale_decode_mbu_b1", "scale_engine_mbu_b1"):
        assert ("at 1 row reads compiled 20.0 GB/s (0.50 of the fastest read), eager 24.0 "
                "GB/s (0.60 of the fastest read)") in notes[name]
        assert "kernel itself streams its weight below the memory's rate" in notes[name]
    # a kernel that streams near the probe: the shortfall is elsewhere, and the note says so
    k["gb_per_s"]["down_proj/compiled/1"] = 38.0
    notes = scale.explain(scale.scale_ratios(m), m)
    assert "lies outside its matmuls" in notes["scale_engine_mbu_b1"]


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
    assert "0.50 to 0.70" in notes["scale_engine_mbu_b1"]                 # its rounds
    assert "took 2.0 ms" in notes["scale_decode_mbu_b1"]                  # the median fast step
    assert "fastest read, 40.0 GB/s" in notes["scale_decode_mbu_b1"]
    assert "steps read 20.0 to 40.0" in notes["scale_decode_mbu_b1"]      # the probe's rounds
    assert "(per round: 1.60 to 1.70)" in notes["scale_step_rows4_vs_rows1"]
    assert "1.25x" in notes["scale_engine_throughput_4_vs_1"]             # 4-row / 1-row step
    assert "FX graph cache cannot pickle" in notes["scale_prepare_repeat_s"]
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


def test_a_knee_before_the_rooflines_says_what_each_extra_row_cost() -> None:
    # One row 10 ms (its bytes), 8 rows 16 ms: 6 ms of FLOPs added to the bytes' time, where
    # the roofline would take the larger (10 ms) and put the knee far later.
    sweep = [{"rows": r, "fastest_ms": ms, "fastest_path": "packed", "memory_bound_ms": 10.0,
              "compute_bound_ms": 0.75 * r, "eager_ms": 3 * ms, "compiled_ms": ms}
             for r, ms in ((1, 10.0), (4, 12.0), (8, 16.0))]
    m = measurements(sweep=sweep, knee={"measured_fastest": 5.0, "measured_eager": 1.5,
                                        "roofline": 20.0})
    ratios = {**scale.scale_ratios(m), "scale_knee_measured_vs_predicted": 0.25}
    note = scale.explain(ratios, m)["scale_knee_measured_vs_predicted"]
    assert "at 8 rows the fastest step (packed) took 16.0 ms against one row's 10.0" in note
    assert "0.86 ms per extra row where a row's FLOPs take 0.75 ms at the ceiling (1.1x)" in note
    assert "nearer their sum (16.0 against 10.0 ms)" in note
    late = measurements(sweep=sweep, knee={"measured_fastest": 40.0, "measured_eager": 1.5,
                                           "roofline": 10.0})
    note = scale.explain({**scale.scale_ratios(late), "scale_knee_measured_vs_predicted": 4.0},
                         late)["scale_knee_measured_vs_predicted"]
    assert "extra row" not in note                    # a later knee has other reasons


# ---- issue 50: the fast steps against eager, in turns, and what each shape chose ----------

def test_a_decode_step_is_the_median_gap_between_token_times() -> None:
    # 4 tokens, 3 gaps: 10, 30 (an interrupted step) and 12 ms; the first token is the prefill's
    assert _fast_vs_eager.decode_step_seconds([1.0, 1.010, 1.040, 1.052]) == pytest.approx(0.012)
    with pytest.raises(ValueError, match="two tokens"):
        _fast_vs_eager.decode_step_seconds([1.0])


def test_fast_against_eager_is_each_rounds_ratio_then_the_median() -> None:
    """A busy round slows both sides alike: its ratio is the quiet rounds'. Against the
    medians of each side alone the same rounds would read 10/12 too, but a busy fast round
    beside quiet eager ones would not."""
    f = _fast_vs_eager.in_turns_figures([9e-3, 18e-3, 10e-3], [12e-3, 24e-3, 10e-3])
    assert f["ratio_rounds"] == pytest.approx([0.75, 0.75, 1.0])
    assert f["ratio"] == pytest.approx(0.75)
    assert f["fast_median_ms"] == pytest.approx(10.0)
    assert f["eager_median_ms"] == pytest.approx(12.0)
    assert f["fast_ms"] == pytest.approx([9.0, 18.0, 10.0])
    with pytest.raises(ValueError):
        _fast_vs_eager.in_turns_figures([1e-3], [1e-3, 2e-3])


def test_the_fast_against_eager_ratios_read_the_loops_and_the_engines_rounds() -> None:
    ratios = scale.scale_ratios(measurements())
    assert ratios["scale_fast_vs_eager_b1"] == pytest.approx(0.75)
    assert ratios["scale_engine_fast_vs_eager_b1"] == pytest.approx(1.1)   # 1.1, 1.0, 1.2
    skipped = measurements(fast_vs_eager={"skipped": "failed"},
                           engine_fast={"skipped": "failed"})
    assert not {"scale_fast_vs_eager_b1", "scale_engine_fast_vs_eager_b1"} & set(
        scale.scale_ratios(skipped))


def test_the_fast_against_eager_ratios_are_declared_with_goal_at_most_one() -> None:
    from bench.headlines import headline
    for name in ("scale_fast_vs_eager_b1", "scale_engine_fast_vs_eager_b1"):
        goal = headline("scale", name).goal
        assert goal.met(1.0) and not goal.met(1.01)


def test_the_fast_against_eager_notes_say_what_each_batch1_shape_chose() -> None:
    """Met or not, each note reads the measured steps and the shape's choice; a missed one
    says what the choice's own timing held against (the fast path's static buffers)."""
    m = measurements()
    notes = scale.explain(scale.scale_ratios(m), m)
    met = notes["scale_fast_vs_eager_b1"]
    assert "took 10.00 ms with path='fast' against 12.00 with path='auto'" in met
    assert "median of 3 rounds in turns; per round 0.75 to 1.00x" in met
    assert ("its shape (decode 1 rows x window 128) runs compiled (timed in turns now: "
            "compiled 9.0 ms, eager 12.0 ms)") in met
    assert "static buffers" not in met                      # met: no excuse is made
    missed = notes["scale_engine_fast_vs_eager_b1"]
    assert "took 11.00 ms with EngineConfig(path='fast') against 10.00" in missed
    assert "its shape (engine decode 1 rows x 8 blocks) runs eager" in missed
    assert "eagerly on the fast path's static buffers" in missed
    # a missed goal whose shape chose the compiled step: the choice's own times are quoted
    m["fast_choices"][1] = choice("engine", "engine decode 1 rows x 8 blocks", "compiled",
                                  compiled=9e-3, eager=10e-3)
    note = scale.explain(scale.scale_ratios(m), m)["scale_engine_fast_vs_eager_b1"]
    assert "the compiled step timed 9.00 ms against the same shape eager 10.00" in note
    # no recorded choice (CUDA graphs): said so, no sentence made up
    m["fast_choices"] = []
    note = scale.explain(scale.scale_ratios(m), m)["scale_fast_vs_eager_b1"]
    assert "no choice recorded for its shape" in note


def test_the_report_lists_each_prepared_shapes_choice_once() -> None:
    """fast_choices: the loops', speculation's and the engine's shapes and the repeat's in
    both processes; a pass set made again later (read back from disk) is not listed twice."""
    loops = [choice("loops", "decode 1 rows x window 128", "compiled", compiled=1e-2,
                    eager=2e-2),
             choice("loops", "decode 4 rows x window 128", "packed", compiled=3e-2,
                    packed=2e-2, eager=4e-2)]
    spec = [choice("speculative", "pass width 1 x window 128", "eager", model="draft",
                   compiled=2e-3, eager=1e-3),
            choice("speculative", "pass width 1 x window 128", "eager", why="kept",
                   model="draft", compiled=2e-3, eager=1e-3)]
    kept = {"shape": "decode 1 rows x window 128", "rows": 1, "kernel": "eager",
            "seconds": {"compiled": 0.02, "eager": 0.01}, "why": "kept",
            "sentence": "eager (timed in an earlier run, kept on disk: ...)"}
    m = measurements(speculative_fast={"choices": _fast_choices.unique(spec)},
                     engine_fast={"choices": [choice("engine", "engine decode 1 rows x 8 "
                                                     "blocks", "compiled", compiled=1e-2,
                                                     eager=2e-2)]},
                     prepare_repeat={"first_choice": {**kept, "why": "timed"},
                                     "second_choice": kept, "tokens": 128})
    out = scale.fast_choices(loops, m)
    assert [(c["part"], c["model"], c["shape"], c["kernel"], c["why"]) for c in out] == [
        ("loops", "target", "decode 1 rows x window 128", "compiled", "timed"),
        ("loops", "target", "decode 4 rows x window 128", "packed", "timed"),
        ("speculative", "draft", "pass width 1 x window 128", "eager", "timed"),
        ("engine", "target", "engine decode 1 rows x 8 blocks", "compiled", "timed"),
        ("prepare_repeat (first process)", "target", "decode 1 rows x window 128", "eager",
         "timed"),
        ("prepare_repeat (second process)", "target", "decode 1 rows x window 128", "eager",
         "kept")]
    assert out[1]["seconds"] == {"compiled": 3e-2, "packed": 2e-2, "eager": 4e-2}
    assert _fast_choices.batch1(out, "engine", "engine decode")["kernel"] == "compiled"
    assert _fast_choices.batch1(out, "speculative", "decode") is None
    assert _fast_choices.choices_text(out[:1]) == [
        "loops, target decode 1 rows x window 128: compiled (timed in turns now: "
        "compiled 10.0 ms, eager 20.0 ms)"]


def test_an_engines_choices_are_its_steps_that_ran() -> None:
    class Step:
        def __init__(self, made):
            self.choice = made
    graphs = type("G", (), {"graphs": {(4, 8): Step(StepChoice(4, "packed")),
                                       (1, 8): Step(StepChoice(1, "eager")),
                                       (2, 8): Step(None)}})()
    engine = type("E", (), {"executor": type("X", (), {"graphs": graphs})()})()
    out = _fast_choices.engine_choices(engine)
    assert [(c["shape"], c["kernel"]) for c in out] == [
        ("engine decode 1 rows x 8 blocks", "eager"),
        ("engine decode 4 rows x 8 blocks", "packed")]
    no_graphs = type("E", (), {"executor": type("X", (), {"graphs": None})()})()
    assert _fast_choices.engine_choices(no_graphs) == []


def test_a_repeat_that_compiles_a_shape_kept_as_eager_is_flagged() -> None:
    timed = {"kernel": "eager", "why": "timed"}
    kept = {"kernel": "eager", "why": "kept"}
    ok = _prepare_repeat.repeat_checks({"choice": timed, "graphs_compiled": 1},
                                       {"choice": kept, "graphs_compiled": 0})
    assert ok["compiled_a_kept_loser"] is False
    assert ok["first_graphs_compiled"] == 1 and ok["second_choice"] == kept
    bad = _prepare_repeat.repeat_checks({"choice": timed}, {"choice": kept,
                                                            "graphs_compiled": 1})
    assert bad["compiled_a_kept_loser"] is True
    # a kept compiled step is compiled again (from the cache): that is no loser's compile
    won = _prepare_repeat.repeat_checks({}, {"choice": {"kernel": "compiled", "why": "kept"},
                                             "graphs_compiled": 1})
    assert won["compiled_a_kept_loser"] is False
    assert _prepare_repeat.repeat_checks({}, {})["second_choice"] is None


def test_a_missed_repeat_whose_kept_choice_is_eager_blames_no_compile() -> None:
    r = {"first_s": 60.0, "second_s": 20.0, "trace_s": 6.0, "second_graphs_compiled": 0,
         "second_choice": {"kernel": "eager", "why": "kept",
                           "sentence": "eager (timed in an earlier run, kept on disk)"}}
    m = measurements(prepare_repeat=r)
    note = scale.explain(scale.scale_ratios(m), m)["scale_prepare_repeat_s"]
    assert "compiled 0 graphs" in note and "no compile is in its time" in note
    assert "FX graph cache" not in note


def test_the_suites_cache_folder_is_fresh_and_put_back(monkeypatch, tmp_path) -> None:
    import os
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with _fast_choices.fresh_cache() as folder:
        assert os.environ["TINYSERVE_CACHE_DIR"] == str(folder) != str(tmp_path)
        assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
        assert not any(folder.iterdir())
    assert not folder.exists()
    assert os.environ["TINYSERVE_CACHE_DIR"] == str(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


def test_the_replay_runs_at_the_trained_pairs_a_and_a_stated_lower_one() -> None:
    # Issue 52, W1: the ratios are taken at the a the trained pair measures per draft at k = 4
    # (bench spec's acceptance_prob, not its acceptance rate); a lower a and the break-even sit
    # beside it in the report.
    import json
    from pathlib import Path
    spec = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results"
                       / "spec.json").read_text())
    trained = spec["measurements"]["runs"]["spec_k4"]["acceptance_prob"]
    assert scale.SPEC_ACCEPTANCE == scale.TRAINED_A == pytest.approx(trained, abs=0.02)
    assert scale.LOWER_A < scale.TRAINED_A - 0.1
    fast = {**measurements()["speculative_fast"], "k": 4, "acceptance_set": scale.TRAINED_A,
            "break_even_a": 0.31,
            "at_lower_a": {"acceptance_set": scale.LOWER_A, "acceptance_prob": 0.68,
                           "measured_speedup": 1.2, "predicted_speedup": 1.3}}
    lines = scale.spec_acceptance_lines(measurements(speculative_fast=fast))
    assert len(lines) == 1 and "fast path" in lines[0]
    assert f"set {scale.TRAINED_A:.2f}, realised 0.80" in lines[0]
    assert f"set {scale.LOWER_A:.2f}, realised 0.68" in lines[0]
    assert "1.50x measured" in lines[0] and "break-even a 0.31" in lines[0]


def test_break_even_acceptance_is_where_the_predicted_speedup_crosses_one() -> None:
    from tinyserve.speculative import break_even_acceptance, predicted_speedup
    a = break_even_acceptance(4, 0.1, 1.3)
    assert 0 < a < 1 and predicted_speedup(a, 4, 0.1, 1.3) == pytest.approx(1.0, abs=1e-6)
    assert break_even_acceptance(4, 0.0, 1.0) == pytest.approx(0.0, abs=1e-9)   # free: any a
    assert break_even_acceptance(4, 1.0, 5.0) == 1.0                             # never pays

"""What each suite's headline figures are: the ratios the ledger quotes, their goals, which
way is better, how far they move between runs of the same code, and the source paths whose
change makes a stored result stale.

The ledger (:mod:`bench.ledger`) renders these from ``bench/results/SUITE.json``; the
compare (:mod:`bench.compare`) flags the ones that moved the wrong way. A goal is declared
only where an issue or the README set one; the rest are reported, not judged.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Better = Literal["higher", "lower", "closer"]


@dataclass(frozen=True)
class Goal:
    """``at_least`` / ``at_most`` a value, ``within`` a relative tolerance of ``center``, or
    ``between`` ``value`` and ``high`` (a range not symmetric about ``center``, such as a
    factor of 3 either way; ``center`` is what ``closer`` aims at)."""
    kind: Literal["at_least", "at_most", "within", "between"]
    value: float
    center: float = 1.0
    high: float = float("inf")

    def met(self, x: float) -> bool:
        if self.kind == "at_least":
            return x >= self.value
        if self.kind == "at_most":
            return x <= self.value
        if self.kind == "between":
            return self.value <= x <= self.high
        return abs(x - self.center) <= self.value * abs(self.center)

    def text(self, fmt: str) -> str:
        if self.kind in ("within", "between"):
            lo, hi = ((self.value, self.high) if self.kind == "between" else
                      (self.center * (1 - self.value), self.center * (1 + self.value)))
            return f"{fmt.format(lo)} to {fmt.format(hi)}"
        return (">= " if self.kind == "at_least" else "<= ") + fmt.format(self.value)

    @property
    def better(self) -> Better:
        return {"at_least": "higher", "at_most": "lower", "within": "closer",
                "between": "closer"}[self.kind]


#: Relative change between two runs of the same code that is still noise, when a ratio has
#: no repeated runs on file: the timing ratios of bench/results/runs/ (the hf and decode
#: suites' repeated idle runs) moved by up to about this share of their mean between runs.
DEFAULT_BAND = 0.15
#: Accounting and simulator figures (no wall clock: the same schedule, the same seeds)
#: move only by the report's rounding.
EXACT_BAND = 0.01


@dataclass(frozen=True)
class Headline:
    """One ratio the ledger quotes. ``value`` reads it from a report (default: the report's
    ``ratios[name]``); ``band`` is the relative change :mod:`bench.compare` treats as noise."""
    name: str
    fmt: str = "{:.2f}x"
    goal: Goal | None = None
    better: Better | None = "higher"
    band: float = DEFAULT_BAND
    value: Callable[[dict[str, Any]], float | None] | None = None

    def read(self, report: dict[str, Any]) -> float | None:
        if self.value is not None:
            return self.value(report)
        found = report.get("ratios", {}).get(self.name)
        return None if found is None else float(found)

    @property
    def direction(self) -> Better | None:
        return self.goal.better if self.goal else self.better

    def goal_cell(self) -> str:
        """The goal as a table prints it ("-" where the ratio has none)."""
        return self.goal.text(self.fmt) if self.goal else "-"

    def met_cell(self, value: float) -> str:
        """"yes" or "no" against the goal, "-" where the ratio has none."""
        return "-" if self.goal is None else ("yes" if self.goal.met(value) else "no")


@dataclass(frozen=True)
class SuiteHeadlines:
    suite: str
    sources: tuple[str, ...]   # the suite and the engine code it times (repository paths)
    headlines: tuple[Headline, ...]
    file: str = ""             # the report's name in bench/results/ (default SUITE.json)

    @property
    def result_file(self) -> str:
        return self.file or f"{self.suite}.json"


def _engine_vs_model(rows: int) -> Callable[[dict[str, Any]], float | None]:
    """bench decode's engine step over the cost model at ``rows`` rows (a measurement, not
    one of its ratios: one figure per row count)."""
    def read(report: dict[str, Any]) -> float | None:
        for entry in report.get("measurements", {}).get("engine_vs_cost_model", []):
            if entry.get("rows") == rows:
                return float(entry["measured_over_model"])
        return None
    return read


def _spec_measured_vs_predicted(report: dict[str, Any]) -> float | None:
    """Measured k=4 speed-up over the one the bench's own cost model predicts at batch 1
    (issue 31: how much of the formula's gain the code delivers)."""
    m = report.get("measurements", {})
    try:
        measured = m["runs"]["spec_k4"]["speedup"]
        predicted = next(e["spec_predicted_speedup_k4"] for e in m["pass_costs_by_batch"]
                         if e["batch"] == 1)
    except (KeyError, StopIteration):
        return None
    return float(measured) / float(predicted)


_ENGINE = ("tinyserve/engine.py", "tinyserve/scheduler.py", "tinyserve/block_manager.py",
           "tinyserve/paged.py", "tinyserve/sequence.py", "tinyserve/model.py",
           "tinyserve/backends/cuda_graph.py", "tinyserve/backends/static.py")
#: The one timing loop and clock the step suites measure with (tinyserve.device's timings,
#: clock, sync and in-turns timers, which the fast path's own choices use too; bench.common's
#: median timer over them; issue 39).
_TIMERS = ("tinyserve/device.py", "bench/common.py")
_STEP = ("tinyserve/generate.py", "tinyserve/kv_cache.py", "tinyserve/model.py", *_TIMERS)
_COST_MODEL = ("tinyserve/simulator.py", "tinyserve/assets/cost_model.json")
#: What the serving-engine suites share (a workload run through the engine, its figures).
_ENGINE_RUNS = "bench/suites/_engine_runs.py"
#: What bench scale times: the suite, the scale model and the code each of its figures runs.
#: (Issue 37 item 5 added the fast path's modules and the engine it runs in; issue 50 its
#: per-shape choices and the toolchain probe.)
_SCALE_SOURCES = tuple(dict.fromkeys((
    "bench/suites/scale.py", "bench/suites/_prepare_repeat.py", "bench/suites/_loops_step.py",
    "bench/suites/_linear_rows.py", "bench/suites/_fast_vs_eager.py",
    "bench/suites/_fast_choices.py", "tinyserve/scale.py",
    "tinyserve/roofline.py",
    "tinyserve/backends/compiled.py", "tinyserve/backends/static.py", "tinyserve/quant.py",
    "tinyserve/speculative.py", "tinyserve/draft_replay.py", "tinyserve/parallel",
    "tinyserve/backends/fast.py", "tinyserve/backends/packed.py",
    "tinyserve/backends/choices.py", "tinyserve/toolchain.py",
    "tinyserve/backends/spec_graphs.py",
    "tinyserve/backends/cuda_graph.py", "tinyserve/backends/decoder_cache.py",
    "tinyserve/paths.py", *_STEP, *_ENGINE)))
#: What bench scale_long_context times (issue 52): its suite, the long-context preset, the
#: directly filled caches and their fit, the int8 cache, and the decode step they run.
_SCALE_LONG_SOURCES = ("bench/suites/scale_long_context.py", "tinyserve/long_context.py",
                       "tinyserve/scale.py", "tinyserve/workbook/kv_regime.py",
                       "tinyserve/roofline.py", "tinyserve/quant.py", *_STEP)
#: What bench llamacpp times on our side: the scale model exported by our writer, its fastest
#: compiled step, the eager loop, the fast prefill (on packed weights where that measured
#: faster), group-wise and per-row int8 (llama.cpp's own version is in the report).
_LLAMACPP_SOURCES = ("bench/suites/llamacpp.py", "tinyserve/hf_export.py", "tinyserve/scale.py",
                     "tinyserve/roofline.py", "tinyserve/backends/compiled.py",
                     "tinyserve/backends/static.py", "tinyserve/quant.py",
                     "tinyserve/backends/fast.py", "tinyserve/backends/packed.py", *_STEP)
#: What bench trained_quality measures: its suite, llama.cpp's worker and converter driver,
#: the quantizers and the int8 cache, the model, the writer, the held-out windows' corpus and
#: the trained target's weights.
_TRAINED_QUALITY_SOURCES = ("bench/suites/trained_quality.py", "bench/suites/llamacpp.py",
                            "tinyserve/quant.py", "tinyserve/model.py", "tinyserve/kv_cache.py",
                            "tinyserve/hf_export.py", "tinyserve/corpus.py", "tinyserve/train.py",
                            "tinyserve/assets/models/target")
_WITHIN_20 = Goal("within", 0.20)   # issue 16: the engine's step within 20% of the cost model
_PCT = "{:.1%}"

#: The headline ratios of every suite `bench all` runs, in the ledger's order. Bands other
#: than the defaults are the spread ((max - min) / mean) of the runs in bench/results/runs/
#: plus the headline run, rounded up: hf over five runs, decode over three.
SUITES: tuple[SuiteHeadlines, ...] = (
    SuiteHeadlines("kv", ("bench/suites/kv.py", *_STEP), (
        Headline("cache_speedup_256"), Headline("cache_speedup_512"))),
    SuiteHeadlines("hf", ("bench/suites/hf.py", "bench/suites/_plain_loop.py",
                          "tinyserve/hf_export.py", "tinyserve/roofline.py", *_STEP), (
        Headline("vs_hf_generate_b1", goal=Goal("at_least", 1.5), band=0.11),   # issue 16
        Headline("vs_hf_generate_b8", goal=Goal("at_least", 1.5), band=0.08),   # issue 16
        Headline("plain_loop_vs_ours_b1", better="lower", band=0.15),
        Headline("decode_roofline_fraction", fmt="{:.2f}", band=0.37))),        # two hosts
    SuiteHeadlines("decode", ("bench/suites/decode.py", "tinyserve/backends/compiled.py",
                              "tinyserve/backends/static.py", "tinyserve/roofline.py",
                              *_STEP, *_ENGINE, *_COST_MODEL), (
        Headline("decode_mbu_b1_eager", fmt="{:.2f}", band=0.05),
        Headline("decode_mbu_b1_compiled", fmt="{:.2f}", goal=Goal("at_least", 0.5), band=0.15),
        Headline("compiled_vs_eager_b1", band=0.16),
        # Cold compiles only: the 07:02 run had inductor's cache warm (a reload), so the
        # spread is of the headline run and the 11:41 one, on two hosts.
        Headline("compile_s", fmt="{:.1f} s", better="lower", band=0.40),
        *(Headline(f"engine_vs_cost_model_{r}", fmt="{:.2f}", goal=_WITHIN_20,
                   value=_engine_vs_model(r)) for r in (16, 32, 64)))),
    SuiteHeadlines("batching", ("bench/suites/batching.py", _ENGINE_RUNS, *_ENGINE), (
        Headline("continuous_vs_static_throughput"),)),
    SuiteHeadlines("paged", ("bench/suites/paged.py", *_ENGINE, *_COST_MODEL), (
        Headline("paged_waste_fraction", fmt=_PCT, better="lower", band=EXACT_BAND),
        Headline("contiguous_waste_fraction", fmt=_PCT, better=None, band=EXACT_BAND))),
    SuiteHeadlines("prefix", ("bench/suites/prefix.py", _ENGINE_RUNS, *_ENGINE), (
        Headline("prefix_ttft_speedup"),)),
    SuiteHeadlines("chunked", ("bench/suites/chunked.py", _ENGINE_RUNS, "tinyserve/policies.py",
                               *_ENGINE, *_COST_MODEL), (
        Headline("chunked_p99_itl_improvement"),
        Headline("size_aware_p99_ttft_improvement", band=EXACT_BAND))),
    SuiteHeadlines("quant", ("bench/suites/quant.py", "tinyserve/quant.py", *_STEP), (
        Headline("int8_weight_memory_ratio", band=EXACT_BAND),
        Headline("int8_kv_memory_ratio", band=EXACT_BAND),
        Headline("int8_val_loss_delta", fmt="{:.3%}", better=None),
        Headline("int8_decode_speedup"))),
    SuiteHeadlines("parallel", ("bench/suites/parallel.py", "tinyserve/parallel",
                                "tinyserve/model.py"), (
        Headline("tp2_speedup_decode"),
        Headline("tp2_allreduce_share", fmt="{:.0%}", better="lower"),
        Headline("tp2_speedup_prefill"),
        Headline("pp_bubble_measured", fmt="{:.2f}", better="lower"))),
    SuiteHeadlines("spec", ("bench/suites/spec.py", "tinyserve/speculative.py",
                                "tinyserve/backends/spec_graphs.py", "tinyserve/backends/static.py",
                                *_STEP), (
        Headline("spec_speedup_k4", goal=Goal("at_least", 1.5)),                 # issue 31
        Headline("spec_measured_vs_predicted_k4", fmt="{:.2f}",                  # issue 31
                 goal=Goal("at_least", 0.85), value=_spec_measured_vs_predicted),
        Headline("spec_acceptance_k4", fmt="{:.2f}", band=EXACT_BAND),
        Headline("ngram_speedup_k4", goal=Goal("at_least", 2.0)))),               # issue 31
    SuiteHeadlines("serve", ("bench/suites/serve.py", "tinyserve/serving", "tinyserve/loadgen",
                             *_ENGINE, *_COST_MODEL), (
        Headline("goodput_knee_vs_overload", fmt="{:.2f}x"),
        Headline("sim_shape_routing_p99_ttft_improvement", band=EXACT_BAND))),
    SuiteHeadlines("peers", ("bench/suites/peers.py", "tinyserve/serving", "tinyserve/loadgen",
                             *_ENGINE), (
        Headline("server_vs_transformers_output_throughput_prefix_on_c4"),
        Headline("server_vs_transformers_p50_ttft_ms_prefix_on_c4", better="lower"),
        # The load generator's brief: it keeps as many requests in the server as guidellm,
        # within 2%.
        Headline("loadgen_vs_guidellm_server_occupancy_completions_c1", fmt="{:.3f}",
                 goal=Goal("within", 0.02)))),
    # Issue 30's goals, set from what this machine can physically do (its measured roofline).
    SuiteHeadlines("scale", _SCALE_SOURCES, (
        Headline("scale_decode_mbu_b1", fmt="{:.2f}", goal=Goal("at_least", 0.85)),
        Headline("scale_step_rows4_vs_rows1", goal=Goal("at_most", 1.5)),
        # Issue 50: the fast path never loses to eager (its batch-1 step over eager's, in
        # turns, the loops' and the engine's).
        Headline("scale_fast_vs_eager_b1", goal=Goal("at_most", 1.0)),
        Headline("scale_engine_fast_vs_eager_b1", goal=Goal("at_most", 1.0)),
        Headline("scale_knee_measured_vs_predicted", fmt="{:.2f}",
                 goal=Goal("between", 0.33, high=3.0)),
        Headline("scale_int8_decode_speedup", goal=Goal("at_least", 2.5)),
        Headline("scale_verify_k4_vs_step", goal=Goal("at_most", 1.8)),
        # Issue 37 item 5: speculation, the engine and a repeat preparation on the fast path.
        Headline("scale_spec_speedup_fast", goal=Goal("at_least", 2.0)),
        Headline("scale_spec_measured_vs_predicted", fmt="{:.2f}",       # the fast run's
                 goal=Goal("between", 0.85, high=1.15)),
        Headline("scale_engine_mbu_b1", fmt="{:.2f}", goal=Goal("at_least", 0.85)),
        Headline("scale_engine_throughput_4_vs_1", goal=Goal("at_least", 2.8)),
        Headline("scale_prepare_repeat_s", fmt="{:.1f} s", goal=Goal("at_most", 15.0)),
        Headline("scale_tp2_vs_bandwidth_bound", fmt="{:.2f}", goal=Goal("at_least", 0.85)),
        Headline("scale_tp2_decode_speedup"),
        Headline("scale_cache_speedup_512"),
        Headline("scale_prefill_tokens_per_step", fmt="{:.1f}"))),
    # Issue 52: the KV-bound regime on the long-context scale model (its own report, so the
    # part runs alone): the long step's MBU, weights plus KV bytes, and the crossover context
    # measured over the bytes' (the KV cache's read rate over the weights').
    SuiteHeadlines("scale_long_context", _SCALE_LONG_SOURCES, (
        Headline("scale_long_context_mbu", fmt="{:.2f}", goal=Goal("at_least", 0.8)),
        Headline("scale_kv_crossover_measured_vs_predicted", fmt="{:.2f}",
                 goal=Goal("between", 0.67, high=1.5)))),
    # Issue 37's peer on the same weights: ours / llama.cpp's, one thread each, in turns
    # (bench llamacpp: not in bench all, it needs `make peers`).
    SuiteHeadlines("llamacpp", _LLAMACPP_SOURCES, (
        Headline("scale_fast_vs_llamacpp_f32_decode", goal=Goal("at_most", 0.9)),
        Headline("scale_int8_vs_llamacpp_q8_decode", goal=Goal("at_most", 1.0)),
        Headline("scale_prefill_vs_llamacpp_f32", goal=Goal("at_most", 1.0)))),
    # Issue 52 (M5): the 8-bit schemes' quality on the trained target, not the scale model's
    # random weights (no outliers; near-ties): our int8 in q8_0's layout against fp32, and
    # against llama.cpp's q8_0 where `make peers` built it (bench trained_quality; no clock).
    # Goals: chapter 6's per-row int8 keeps over 99% of fp32's top-1 tokens, and a scale per
    # 32 is finer; against q8_0, issue 37's: ours at least as close to fp32 as theirs.
    SuiteHeadlines("trained_quality", _TRAINED_QUALITY_SOURCES, (
        Headline("trained_int8_agreement_vs_fp32", fmt=_PCT, goal=Goal("at_least", 0.99),
                 band=EXACT_BAND),
        Headline("trained_int8_agreement_vs_llamacpp_q8", fmt="{:.3f}",
                 goal=Goal("at_least", 1.0), band=EXACT_BAND),
        Headline("trained_int8_logit_error_vs_llamacpp_q8", fmt="{:.2f}", better="lower",
                 band=EXACT_BAND))),
)

BY_SUITE: dict[str, SuiteHeadlines] = {s.suite: s for s in SUITES}


def headline(suite: str, name: str) -> Headline | None:
    """The declared headline ``name`` of ``suite``, or None (a ratio the ledger does not quote)."""
    entry = BY_SUITE.get(suite)
    return next((h for h in entry.headlines if h.name == name), None) if entry else None


def missed_goals(suite: str, ratios: dict[str, float]) -> set[str]:
    """The ratios of a run of ``suite`` that miss their declared goals."""
    return {name for name, value in ratios.items()
            if (h := headline(suite, name)) is not None and h.goal is not None
            and not h.goal.met(value)}


def goals_table(suite: str, ratios: dict[str, float]) -> str:
    """A run's ratios with their goals and whether each is met, as the suites print them."""
    from tinyserve.tables import table   # here: importing tinyserve imports torch
    rows = []
    for name, value in ratios.items():
        h = headline(suite, name)
        rows.append([name, value, "-" if h is None else h.goal_cell(),
                     "-" if h is None else h.met_cell(value)])
    return table(["ratio", "value", "goal", "met"], rows)

"""The memory wall, measured (issue 30): every regime-dependent lesson on the bandwidth-scale
model, held against this machine's own roofline measured in the same run.

The scale model (:mod:`tinyserve.scale`, ``load_model("bandwidth")``) is the shipped
``TinyLlama`` code at a size whose weights must come from DRAM (or HBM) on every decode step:
on a CPU 8x its last-level cache, on CUDA the GPU timing preset. Its weights are seeded
random numbers, so its text is noise; only its timings mean something.

What one run measures, in this order (the fast path's parts after the eager speculative
run, before its fast one):

- the machine: read bandwidth as the fastest of a reduction, a copy and a matrix-vector
  product over a buffer far above the cache (:func:`~tinyserve.roofline.read_bandwidth`),
  and the matmul FLOP rate (:func:`~tinyserve.roofline.matmul_flops`: the faster of MKL's
  and oneDNN's kernels on a CPU), each before and after the rows sweep, the faster kept;
- a decode step at rows 1, 2, 4, 8, 16, 32, eager and on the fastest compiled path (on a
  CPU ``torch.compile(mode="max-autotune")`` with inductor's ``freezing``: its C++ GEMM
  template over weights packed once at compile time; on CUDA the default CUDA-graph mode),
  with each bucket's compile time, and from 2 rows on a CPU eager over weights packed once for
  oneDNN (the fast path's other choice for several rows); the knee is the fastest of them;
- a (k+1) = 5-token verify pass against a one-token step, eager (what speculative decoding
  runs) and compiled;
- int8 weights through fbgemm's kernel (``quantize_model(model, kernel="fbgemm")``) against
  fp32, batch 1, eager both;
- a cached step against recomputing the whole 512-token context, and a 512-token prefill;
- speculative decoding at k = 4 with the bandwidth-draft model's real passes proposing the
  target's own greedy tokens at a set acceptance (:mod:`tinyserve.draft_replay`), against
  plain decoding of the same tokens, twice: eager (kept in the report as ``speculative``), and
  on the fast path both sides (:mod:`tinyserve.backends.fast`: the verify passes, the draft
  steps and the plain decode, ``path="fast"``; ``speculative_fast``), each against the speed-up
  :func:`~tinyserve.speculative.predicted_speedup` predicts from the acceptance and the pass
  costs measured on the same path in the same run;
- the loops' decode step (the fast path, what ``generate_batch(..., path="fast")`` runs) at 1
  and 4 rows and the eager batch-1 step, each round in turns with the read probe
  (:mod:`._loops_step`): the step's MBU against the probe of its own round; then
  ``generate(..., path="fast")`` against ``path="auto"`` at batch 1, in turns
  (:mod:`._fast_vs_eager`): whether the fast path's step, whatever it chose, is faster than
  eager's as the loops run them;
- one projection alone at 1 and 5 rows, eager and on the fast path's recipe, caches flushed
  (:mod:`._linear_rows`): the matmul kernel's share of a few-row step's extra cost;
- the continuous-batching engine on the fast path (``EngineConfig(path="fast")``, its 1- and
  4-row decode shapes prepared first): its batch-1 decode step against the bytes it reads
  and against the same engine's with ``path="auto"`` (in turns), and 4 concurrent requests'
  output tokens/s against one's;
- tensor parallelism over two processes against one, next to what two processes read
  together against one alone (:mod:`tinyserve.parallel.timing`);
- a chapter's fast shape (batch 1, a 128-token window) prepared in a fresh process and again
  in a second one sharing its persistent cache (``TINYSERVE_CACHE_DIR``), and a third that
  only traces it: what a learner waits the second time.

On a CPU each fast shape runs the fastest of its ways on this machine (compiled, eager over
packed weights, eager: :mod:`tinyserve.backends.choices`), timed when it first runs; the run
keeps its fast path's cache in a new folder (:func:`._fast_choices.fresh_cache`), so every
choice is this run's, and the report lists each shape's (``fast_choices``:
:mod:`._fast_choices`).

Ratios (``ratios`` in the report; goals in :mod:`bench.headlines`, from issues 30 and 37):
``scale_decode_mbu_b1`` (bytes of the loops' batch-1 fast step / the run's fastest read /
the step's time, per round, the median of rounds: :func:`run_roof`),
``scale_step_rows4_vs_rows1`` (the loops' 4-row fast step / its 1-row step, per round, the
median), ``scale_fast_vs_eager_b1`` (the loops' batch-1 decode step with ``path="fast"`` /
with ``path="auto"``, per round, the median; issue 50), ``scale_knee_measured_vs_predicted``
(rows where a step first costs 1.5x one row, measured / roofline), ``scale_int8_decode_speedup``,
``scale_verify_k4_vs_step``, ``scale_spec_speedup_fast`` (fast speculative over fast plain
decoding, the drafter replayed at the trained pair's a, :data:`TRAINED_A`; the report also
holds the run at :data:`LOWER_A` and the break-even a), ``scale_spec_measured_vs_predicted``
(of that fast run), ``scale_engine_mbu_b1``
(the engine's batch-1 decode step, each round's run against the run's fastest read, as
``scale_decode_mbu_b1``), ``scale_engine_fast_vs_eager_b1`` (the engine's batch-1 decode step
with ``path="fast"`` / ``path="auto"``, per round, the median),
``scale_engine_throughput_4_vs_1``, ``scale_tp2_decode_speedup``,
``scale_tp2_vs_bandwidth_bound`` (TP speed-up / chapter 7's bandwidth bound: the two-process
read-bandwidth gain times the bytes the split saves, :func:`~tinyserve.roofline.
tp_bandwidth_bound`),
``scale_cache_speedup_512``, ``scale_prefill_tokens_per_step``, ``scale_prepare_repeat_s``
(the second process's seconds). Where a goal is missed the report's ``notes`` say what the
measurements beside it show.

Every time is the fastest of several runs (other processes only slow a run down), except
the MBUs, the loops' 4 rows against 1 and the fast steps against eager: there each round's
figures are compared with each other and the median over rounds is quoted
(:mod:`._loops_step` says why). One torch thread
per process. ``--quick`` runs the same code on tiny random models and only traces the
compiled paths (the fast path's recipe set to trace, as the tests do): its figures mean
nothing and the report says so.
"""
from __future__ import annotations

from collections.abc import Iterator
import contextlib
import functools
import gc
import math
import statistics
from typing import Any

import torch

from tinyserve.backends.compiled import CompiledDecoder, DECODERS as _DECODERS, compiled_decoder
from tinyserve.backends import packed
from tinyserve.config import ModelConfig
from tinyserve.device import default_device, default_dtype
from tinyserve.generate import extend, generate, prefill
from tinyserve.kv_cache import KVCache
from tinyserve.model import TinyLlama
from tinyserve.paths import cache_dir
from tinyserve.roofline import (ReadBandwidth, RowPoint, bounds_seconds, compile_settings,
                                decode_cost, eager_step_seconds, flop_ceiling, matmul_flops,
                                mbu, measured_knee, read_bandwidth, roofline_knee, row_sweep,
                                tp_bandwidth_bound)
from tinyserve.speculative import (break_even_acceptance, expected_tokens_per_pass,
                                   predicted_speedup, speculative_generate)

from . import _fast_vs_eager
from ._fast_choices import (batch1, choices_text, engine_choices, fresh_cache, model_choices,
                            unique)
from ._linear_rows import kernel_sentence, linear_rows, one_row_sentence
from ._loops_step import loops_step_in_turns, paired_figures
from ._prepare_repeat import prepare_repeat
from ..common import (QUICK_CONFIG, clock, cold_compiles, in_turns, interleaved_seconds,
                      report, table, write_json)

#: Cores a run keeps busy (its tensor-parallel part runs two ranks): the load average after
#: it is judged less these.
OWN_THREADS = 2
ROWS = (1, 2, 4, 8, 16, 32)
QUICK_ROWS = (1, 4)
K = 4                 # draft tokens per speculative step (the k)
#: Per-draft acceptance a the replayed drafter is set to (issue 52, W1): the trained pair's,
#: as bench spec measures it at k = 4 (``runs["spec_k4"]["acceptance_prob"]``; its
#: ``spec_acceptance_k4`` is the acceptance *rate*, drafts accepted / proposed, another
#: quantity), which the ratios are taken at; and a stated lower a beside it (less predictable
#: text). Each run measures the acceptance it got and predicts from that; the report puts both
#: beside the break-even a of the same run's pass costs. tests/test_bench_scale_fast.py holds
#: TRAINED_A to the stored spec report.
TRAINED_A = 0.94
LOWER_A = 0.7
SPEC_ACCEPTANCE = TRAINED_A
#: Rounds of the loops' step in turns with the read probe (:mod:`._loops_step`); the report
#: keeps each round's figures.
LOOPS_ROUNDS = 9
LONG_CONTEXT = 512    # the cached-vs-recompute and prefill comparisons
QUICK_DRAFT = ModelConfig(vocab_size=128, hidden_size=16, intermediate_size=32,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=64)


# --- the fastest compiled path --------------------------------------------------------------

def fastest_mode(device: torch.device, quick: bool) -> dict[str, Any]:
    """How the fastest compiled path is built here (:func:`~tinyserve.roofline.
    compiled_step_seconds`'s options): on a CPU max-autotune with freezing (the weights
    become constants, packed once for the GEMM kernel the autotuner picks: inductor's C++
    template or MKL's linear, :func:`~tinyserve.roofline.compile_settings`: the fast path's
    compiled way; whether its step beats eager here, at each rows count, is what the rows
    sweep measures), on CUDA the default CUDA-graph mode. ``--quick`` on a CPU
    only traces (code generation takes minutes)."""
    if quick and device.type == "cpu":
        return {"backend": "eager", "mode": None, "freezing": False}
    if device.type == "cuda":
        return {"backend": "inductor", "mode": "reduce-overhead", "freezing": False}
    return {"backend": "inductor", "mode": "max-autotune", "freezing": True}


class VerifyDecoder(CompiledDecoder):
    """:class:`~tinyserve.backends.compiled.CompiledDecoder` whose compiled pass takes several
    tokens per row (B, T) at positions (B, T) and returns all their logits (B, T, vocab): a
    speculative verify pass on the static cache, compiled like a decode step."""

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, positions, self.cache)


def forget_compiled(model: TinyLlama) -> None:
    """Drop every compiled graph before compiling the next: with freezing, each holds the
    weights as constants (packed for its GEMMs) in the globals of the Python module inductor
    generated, and a dynamo reset alone leaves those modules loaded (measured: resident
    memory then grew with every bucket compiled, and the sweep's peak was far above what it
    is with this). The fast path's compiled passes (speculation) and engine steps go too."""
    import sys

    from torch._inductor.codecache import PyCodeCache

    from tinyserve.backends import fast as fastpath
    _DECODERS.drop(model)
    fastpath._PASSES.drop(model)          # the fast path's compiled passes (speculation)
    fastpath._ENGINE_STEPS.drop(model)    # and its engine steps (each with a paged pool)
    torch._dynamo.reset()
    PyCodeCache.cache_clear()
    for name, module in list(sys.modules.items()):
        if "torchinductor" in (getattr(module, "__file__", None) or ""):
            del sys.modules[name]          # nothing calls a generated module after the reset
            module.__dict__.clear()
    gc.collect()


@torch.no_grad()
def verify_vs_step(model: TinyLlama, step_decoder: CompiledDecoder, prompt: torch.Tensor,
                   fast: dict[str, Any], rounds: int) -> dict[str, float]:
    """A (K+1)-token pass against a one-token pass after ``prompt`` (1, T), both compiled
    (the verify pass on its own static cache) and both eager (:func:`extend` on a
    :class:`KVCache`, what :func:`speculative_generate` runs); each the fastest of ``rounds``
    runs taken in turns. Milliseconds, and the compiled verify pass's compile seconds."""
    device, T, W = model.device, prompt.shape[1], K + 1
    g = torch.Generator().manual_seed(1)
    guesses = torch.randint(0, model.config.vocab_size, (1, W), generator=g).to(device)
    pos_w = torch.arange(T, T + W, device=device)[None]
    pos_1 = pos_w[:, :1]
    with compile_settings(fast["freezing"], W):
        verify = VerifyDecoder(model, 1, fast["mode"], fast["backend"],
                               step_decoder.cache.max_seq)
        verify.prefill(prompt)
        verify.step(guesses, pos_w)                      # compiles
        step_decoder.prefill(prompt)
        cache = KVCache.for_model(model, 1, T + W)
        prefill(model, prompt, cache)

        def eager(width: int) -> None:
            extend(model, guesses[:, :width], pos_w[:, :width], cache)
            cache.rewind([T])                            # each run measures the same pass
        runs = interleaved_seconds({
            "compiled_step": lambda: step_decoder.step(guesses[:, 0], pos_1[:, 0]),
            "compiled_verify": lambda: verify.step(guesses, pos_w),
            "eager_step": functools.partial(eager, 1),
            "eager_verify": functools.partial(eager, W)}, device, rounds)
    out = {f"{name}_ms": 1e3 * min(times) for name, times in runs.items()}
    out["verify_compile_s"] = float(verify.compile_seconds or 0.0)
    return out


# --- the other measurements ---------------------------------------------------------------

def _prompts(model: TinyLlama, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=g).to(model.device)


@torch.no_grad()
def long_context(model: TinyLlama, context: int, rounds: int) -> dict[str, float]:
    """At ``context`` cached tokens: a cached decode step, the same step recomputed without a
    cache (the whole context through the model), and a prefill of the ``context``-token
    prompt. Fastest of ``rounds`` taken in turns, milliseconds."""
    device = model.device
    ids = _prompts(model, 1, context + 1, seed=2)
    cache = KVCache.for_model(model, 1, context + 1)
    prefill(model, ids[:, :context], cache)
    token, pos = ids[:, context:], torch.tensor([[context]], device=device)
    scratch = KVCache.for_model(model, 1, context)

    def cached() -> None:
        extend(model, token, pos, cache)
        cache.rewind([context])

    def prefill_once() -> None:
        scratch.rewind([0])
        prefill(model, ids[:, :context], scratch)
    runs = interleaved_seconds({"cached_step": cached,
                                "recompute_step": lambda: model(ids)[:, -1],
                                "prefill": prefill_once}, device, rounds)
    return {f"{name}_ms": 1e3 * min(times) for name, times in runs.items()}


@torch.no_grad()
def int8_vs_fp32(model: TinyLlama, prompt: torch.Tensor, n: int, repeats: int) -> dict[str, Any]:
    """Batch-1 eager decode step, the float model against int8 weights (whole model: every
    linear and the tied LM head), measured back to back. On the CPU through fbgemm's kernel;
    on CUDA through ``auto``'s choice, and each CUDA kernel that reads int8 in the matmul
    (int8pack where this torch has it, compiled scale_after) timed too, so a GPU run says
    which ``auto`` should prefer. (The ``fp32_ms`` key is the float model: bf16 on CUDA.)
    On a device without a kernel: the reason, no figure."""
    from tinyserve.quant import cuda_kernel, quantize_model, weight_bytes
    cpu = model.device.type == "cpu"
    try:
        kernel = "fbgemm" if cpu else cuda_kernel(model.device, model.dtype)
        q = quantize_model(model, kernel=kernel)
    except (ValueError, RuntimeError) as err:
        return {"skipped": str(err)}
    fp32 = eager_step_seconds(model, prompt, n, repeats)
    int8 = eager_step_seconds(q, prompt, n, repeats)
    fp32_again = eager_step_seconds(model, prompt, n, repeats)   # the machine may have moved
    out = {"fp32_ms": 1e3 * min(fp32, fp32_again), "int8_ms": 1e3 * int8, "kernel": kernel,
           "float_dtype": str(model.dtype).removeprefix("torch."),
           "fp32_weight_bytes": weight_bytes(model), "int8_weight_bytes": weight_bytes(q)}
    del q
    if not cpu:
        for other in ("int8pack", "compiled"):
            if other == kernel:
                continue
            try:
                alt = quantize_model(model, kernel=other)
                out[f"{other}_ms"] = 1e3 * eager_step_seconds(alt, prompt, n, repeats)
                del alt
            except (ValueError, RuntimeError) as err:
                out[f"{other}_skipped"] = str(err)[:200]
    gc.collect()
    return out


def _drafter_models(quick: bool, device: torch.device, dtype: torch.dtype) -> TinyLlama:
    if quick:
        torch.manual_seed(1)
        return TinyLlama(QUICK_DRAFT).eval().to(device)
    from tinyserve.checkpoint import load_model
    return load_model("bandwidth-draft", device=device, dtype=dtype).eval()


@torch.no_grad()
def speculative_at_scale(target: TinyLlama, quick: bool, rounds: int,
                         fast: bool = False) -> dict[str, Any]:
    """Speculative decoding at k = K with the draft model's real passes proposing the target's
    own greedy continuation, each guess right with probability :data:`TRAINED_A`
    (:class:`~tinyserve.draft_replay.ReplayDrafter`), against plain greedy decoding of the
    same prompts (outputs checked equal), same tokens both sides; then the same at
    :data:`LOWER_A` (``at_lower_a``), and the break-even a of the run's pass costs. The
    prediction uses the acceptance measured in each run and pass costs measured here on the
    code the loops run: eager, or with ``fast`` the fast path on both sides (verify passes,
    draft steps and the plain decode: :mod:`tinyserve.backends.fast`), its shapes prepared
    first (not timed)."""
    try:
        from tinyserve.draft_replay import ReplayDrafter, greedy_script
    except ImportError as err:
        return {"skipped": f"tinyserve.draft_replay is not available ({err})"}
    draft = _drafter_models(quick, target.device, target.dtype)
    prompt_len, max_tokens = (8, 16) if quick else (32, 64)
    prompts = [_prompts(target, 1, prompt_len, seed=10 + i)[0].tolist() for i in range(2)]
    prepared = _prepare_spec(target, draft, prompt_len + max_tokens) if fast else []
    # What each prepared shape chose, read now: a later request may make new pass sets
    # (and the cache may drop these) before the run ends.
    choices = [*model_choices(target, "speculative", "target"),
               *model_choices(draft, "speculative", "draft")] if fast else []
    # The script is what plain decoding on the same path emits: the tokens compared with.
    path = "fast" if fast else "auto"
    scripts = [generate(target, p, max_tokens, path="fast").tokens if fast else
               greedy_script(target, p, max_tokens) for p in prompts]

    def spec_once(i: int, a: float) -> Any:
        drafter = ReplayDrafter(draft, scripts[i], a, seed=i, path=path)
        return speculative_generate(target, drafter, prompts[i], max_tokens, k=K, path=path)

    def runs_at(a: float) -> tuple[list[Any], float, float]:
        stats_all, spec_s, plain_s = [], 0.0, 0.0
        for i, p in enumerate(prompts):
            got, stats = spec_once(i, a)
            if got != scripts[i]:
                raise RuntimeError("speculative output differs from plain greedy decoding at "
                                   "scale; verification is wrong")
            stats_all.append(stats)
            runs = interleaved_seconds(
                {"spec": functools.partial(spec_once, i, a),
                 "plain": lambda p=p: generate(target, p, max_tokens, path=path)},
                target.device, rounds, warmup=0)
            spec_s, plain_s = spec_s + min(runs["spec"]), plain_s + min(runs["plain"])
        return stats_all, spec_s, plain_s
    at = {a: runs_at(a) for a in (TRAINED_A, LOWER_A)}
    context = prompt_len + max_tokens // 2
    costs = (fast_pass_costs(target, draft, context, rounds * 3, prompt_len + max_tokens)
             if fast else pass_costs(target, draft, context, rounds * 3))
    tokens = sum(len(s) for s in scripts)

    def figures(a: float) -> dict[str, Any]:
        stats_all, spec_s, plain_s = at[a]
        return {**_spec_figures(stats_all, spec_s, plain_s, costs, a),
                "spec_tokens_per_s": tokens / spec_s, "plain_tokens_per_s": tokens / plain_s}
    out = {**figures(TRAINED_A), "at_lower_a": figures(LOWER_A), "fast": fast,
           "break_even_a": break_even_acceptance(K, costs["draft_step_ms"] / costs["decode_ms"],
                                                 costs["verify_ms"] / costs["decode_ms"]),
           "tokens": tokens, "prompts": len(prompts), "prompt_tokens": prompt_len,
           "max_tokens": max_tokens, "k": K}
    if fast:   # each frozen function holds a copy of its weights: free them for what follows
        out["prepare_s"] = {c.label: c.seconds for c in prepared}
        out["choices"] = unique([*choices, *model_choices(target, "speculative", "target"),
                                 *model_choices(draft, "speculative", "draft")])
        forget_compiled(draft)
        forget_compiled(target)
    del draft
    gc.collect()
    return out


def _spec_figures(stats_all: list[Any], spec_s: float, plain_s: float,
                  costs: dict[str, float], acceptance_set: float = TRAINED_A) -> dict[str, Any]:
    """Acceptance, measured and predicted speed-up (from the acceptance measured and the
    pass costs ``costs``: decode, verify and draft-step milliseconds) of a speculative run
    whose replayed drafter was set to ``acceptance_set``."""
    accepted = sum(s.accepted for s in stats_all)
    checked = sum(s.accepted + s.rejected for s in stats_all)
    a = accepted / max(checked, 1)
    draft_cost = costs["draft_step_ms"] / costs["decode_ms"]
    verify_cost = costs["verify_ms"] / costs["decode_ms"]
    predicted = predicted_speedup(a, K, draft_cost, verify_cost)
    measured = plain_s / spec_s
    passes = sum(s.target_passes for s in stats_all)
    return {"acceptance_set": acceptance_set, "acceptance_prob": a,
            "acceptance_rate": accepted / max(sum(s.proposed for s in stats_all), 1),
            "tokens_per_pass_expected": expected_tokens_per_pass(a, K),
            "tokens_per_pass_measured": sum(sum(s.emitted) for s in stats_all) / max(passes, 1),
            "spec_s": spec_s, "plain_s": plain_s, "measured_speedup": measured,
            "draft_cost": draft_cost, "verify_cost": verify_cost,
            "predicted_speedup": predicted, "measured_vs_predicted": measured / predicted,
            "target_passes": passes, "spec_pass_ms": 1e3 * spec_s / max(passes, 1),
            "formula_pass_ms": K * costs["draft_step_ms"] + costs["verify_ms"],
            "pass_costs_ms": costs}


def _prepare_spec(target: TinyLlama, draft: TinyLlama, tokens: int) -> list[Any]:
    """Compile (CUDA: capture) every fast shape the speculative and plain runs of ``tokens``
    positions use, before any is timed: the target's decode step and verify passes 1..K+1,
    the draft's steps; their costs."""
    from tinyserve.backends.fast import Shape, draft_shape, prepare, verify_shape
    root = cache_dir()
    return [*prepare(target, [Shape(tokens), verify_shape(K, tokens)], progress=False,
                     cache=root),
            *prepare(draft, [draft_shape(tokens)], progress=False, cache=root)]


@torch.no_grad()
def pass_costs(target: TinyLlama, draft: TinyLlama, context: int, rounds: int) -> dict[str, float]:
    """Milliseconds of a target decode step, a target (K+1)-token verify pass and a draft
    decode step after ``context`` cached tokens, eager (:func:`extend`), fastest of
    ``rounds`` taken in turns."""
    device = target.device
    ids = _prompts(target, 1, context + K + 1, seed=3)
    caches = {m: KVCache.for_model(model, 1, context + K + 1)
              for m, model in (("t", target), ("d", draft))}
    prefill(target, ids[:, :context], caches["t"])
    prefill(draft, ids[:, :context], caches["d"])

    def once(model: TinyLlama, cache: KVCache, width: int) -> None:
        pos = torch.arange(context, context + width, device=device)[None]
        extend(model, ids[:, context:context + width], pos, cache)
        cache.rewind([context])
    runs = interleaved_seconds({
        "decode": functools.partial(once, target, caches["t"], 1),
        "verify": functools.partial(once, target, caches["t"], K + 1),
        "draft_step": functools.partial(once, draft, caches["d"], 1)}, device, rounds)
    return {f"{name}_ms": 1e3 * min(times) for name, times in runs.items()}


@torch.no_grad()
def fast_pass_costs(target: TinyLlama, draft: TinyLlama, context: int, rounds: int,
                    tokens: int) -> dict[str, float]:
    """:func:`pass_costs` on the fast path, the functions the fast runs of ``tokens``
    positions use: the target's plain decode step (compiled step on a CPU, CUDA graph on
    CUDA), its (K+1)-token verify pass and the draft's one-token step (the speculative
    loops' static passes)."""
    from tinyserve.backends.fast import fast_passes
    device = target.device
    ids = _prompts(target, 1, context + K + 1, seed=3)
    step, release_step = _fast_plain_step(target, tokens, ids[:, :context])
    verify = fast_passes(target, tokens, range(1, K + 2), cache=cache_dir())
    drafts = fast_passes(draft, tokens, (1, 2), cache=cache_dir())
    try:
        for passes in (verify, drafts):
            passes.reset()
            passes.prefill(ids[:, :context])

        def feed(passes: Any, width: int) -> None:
            passes.feed(ids[:, context:context + width])
            passes.rewind(context)                  # each run measures the same pass
        runs = interleaved_seconds({
            "decode": functools.partial(step, ids[:, context]),
            "verify": functools.partial(feed, verify, K + 1),
            "draft_step": functools.partial(feed, drafts, 1)}, device, rounds)
    finally:
        verify.release()
        drafts.release()
        release_step()
    return {f"{name}_ms": 1e3 * min(times) for name, times in runs.items()}


def _fast_plain_step(model: TinyLlama, tokens: int, prompt: torch.Tensor) -> tuple[Any, Any]:
    """The fast path's one-row decode step (what ``generate(..., path="fast")`` runs) after
    ``prompt`` (1, T), as ``step(token)`` at position T each call, and its release."""
    T, device = prompt.shape[1], model.device
    if device.type == "cuda":
        from tinyserve.backends.cuda_graph import graph_decoder
        graphed = graph_decoder(model, 1, tokens=tokens)
        graphed.prefill(prompt, [T])
        return (lambda token: graphed.step(token, [T])), graphed.release
    from tinyserve.backends.fast import fast_decoder
    decoder = fast_decoder(model, 1, tokens, cache=cache_dir())
    decoder.prefill(prompt)
    position = torch.tensor([T], device=device)
    return (lambda token: decoder.step(token, position)), (lambda: None)


def tensor_parallel(quick: bool, repeats: int) -> dict[str, Any]:
    """Two tensor-parallel ranks against one process on the scale model, and what two
    processes read together against one alone (:mod:`tinyserve.parallel.timing`)."""
    try:
        from tinyserve.parallel.timing import parallel_read_bandwidth, tp_decode_speedup
    except ImportError as err:
        return {"skipped": f"tinyserve.parallel.timing lacks the scale timings ({err})"}
    if quick:   # tiny buffers and one layer: the shape of the report, in seconds
        bw = parallel_read_bandwidth(2, nbytes=8 * 2**20, repeats=2)
        tp = tp_decode_speedup(2, layers=1, context=8, repeats=2)
    else:
        bw = parallel_read_bandwidth(2, repeats=repeats)
        tp = tp_decode_speedup(2, repeats=repeats * 2)
    return {"bandwidth": {"way": bw.way, "nbytes": bw.nbytes, "single_gb_per_s": bw.single / 1e9,
                          "per_process_gb_per_s": [x / 1e9 for x in bw.per_process],
                          "aggregate_gb_per_s": bw.aggregate / 1e9, "speedup": bw.speedup},
            "tp": {"single_ms": [1e3 * s for s in tp.single_s],
                   "split_ms": [1e3 * s for s in tp.split_s], "speedup": tp.speedup,
                   "allreduce_share": tp.allreduce_share, "whole_bytes": tp.whole_bytes,
                   "shard_bytes": tp.shard_bytes},
            # chapter 7's bound, the one definition: the read gain times the bytes saved
            "bandwidth_bound": tp_bandwidth_bound(bw.speedup, tp.whole_bytes, tp.shard_bytes),
            "tp2_vs_bandwidth_bound": tp.speedup / tp_bandwidth_bound(bw.speedup, tp.whole_bytes,
                                                                      tp.shard_bytes)}


#: The engine runs: prompt tokens and new tokens per request (``--quick``: 8 and 8); the
#: loops' fast-against-eager runs take as many new tokens.
ENGINE_PROMPT, ENGINE_NEW = 64, 32
#: Rounds of the engine's runs in turns (``--quick``: 1).
ENGINE_ROUNDS = 5


@torch.no_grad()
def engine_fast(model: TinyLlama, quick: bool, rounds: int) -> dict[str, Any]:
    """The continuous-batching engine on the fast path (``EngineConfig(path="fast")``: its
    pure-decode steps on static buffers, each shape running the fast path's choice on a CPU
    (compiled, packed or eager, timed when prepared), CUDA graphs on CUDA), the shapes of 1
    and 4 rows prepared first (not timed) and one untimed round: the whole run of 1 request
    and of 4 at once (same prompt length and ``max_tokens``), the run of 1 request on the
    same engine with ``path="auto"``, and the read probe, taken in turns for ``rounds``
    rounds (the fastest run of each kept; each run's median pure-decode step, and each
    round's probe rate for the run's fastest read, :func:`run_roof`; the fast and eager
    batch-1 steps of the same round for ``scale_engine_fast_vs_eager_b1``); then one
    recorded run of each, whose steps say how much of a run was not pure decode."""
    from tinyserve.engine import Engine, EngineConfig

    def make(fast: bool) -> Engine:
        return Engine(model, EngineConfig(max_num_seqs=4, enable_prefix_caching=False,
                                          path="fast" if fast else "auto"),
                      record_steps=True)
    prompt_len, new = (8, 8) if quick else (ENGINE_PROMPT, ENGINE_NEW)
    engine, eager = make(True), make(False)
    prepared = engine.prepare(rows=(1, 4), tokens=prompt_len + new, progress=False)
    seeds = iter(range(100, 10**6))

    def serve(on: Engine, n: int) -> None:
        for _ in range(n):    # new prompts each run (no prefix to share)
            on.add_request(_prompts(model, 1, prompt_len, seed=next(seeds))[0].tolist(), new)
        on.run()

    def decode_ms(on: Engine, n: int) -> list[float]:
        return [1e3 * r.seconds for r in on.step_log if r.num_rows == r.num_tokens == n]

    def run(on: Engine, n: int) -> tuple[float, float]:
        on.step_log.clear()
        start = clock(model.device)
        serve(on, n)
        return clock(model.device) - start, statistics.median(decode_ms(on, n))
    probe = functools.partial(read_bandwidth, model.device, (16 if quick else 512) * 2**20, 2)
    runs = in_turns({"one": functools.partial(run, engine, 1),
                     "four": functools.partial(run, engine, 4),
                     "one_eager": functools.partial(run, eager, 1),
                     "probe": lambda: probe().best}, rounds)
    steps = {}
    for n in (1, 4):
        engine.step_log.clear()
        serve(engine, n)
        log = engine.step_log
        steps[str(n)] = {"decode_step_ms": statistics.median(decode_ms(engine, n)),
                         "decode_steps": len(decode_ms(engine, n)), "steps": len(log),
                         "other_steps_s": sum(r.seconds for r in log
                                              if not r.num_rows == r.num_tokens == n),
                         "step_s": sum(r.seconds for r in log)}
    one_s, four_s = min(s for s, _ in runs["one"]), min(s for s, _ in runs["four"])
    choices = engine_choices(engine)
    del engine, eager
    forget_compiled(model)
    fast_ms, eager_ms = ([ms for _, ms in runs[k]] for k in ("one", "one_eager"))
    return {"prompt_tokens": prompt_len, "new_tokens": new, "context": prompt_len + new // 2,
            "one_run_s": one_s, "four_run_s": four_s,
            "one_tokens_per_s": new / one_s, "four_tokens_per_s": 4 * new / four_s,
            "throughput_4_vs_1": 4 * one_s / four_s, "steps": steps,
            "rounds": {"one_decode_step_ms": fast_ms,
                       "four_decode_step_ms": [ms for _, ms in runs["four"]],
                       "one_eager_decode_step_ms": eager_ms,
                       "one_eager_run_s": [s for s, _ in runs["one_eager"]],
                       "probe_gb_per_s": [r / 1e9 for r in runs["probe"]]},
            "fast_vs_eager_b1": _fast_vs_eager.in_turns_figures(
                [ms / 1e3 for ms in fast_ms], [ms / 1e3 for ms in eager_ms]),
            "prepare_s": {c.label: c.seconds for c in prepared}, "choices": choices}


def engine_mbu(model: TinyLlama, e: dict[str, Any], roof: float) -> dict[str, Any]:
    """The engine's batch-1 decode step against the bytes a step reads at the run's mean
    context, per round: each round's run's median pure-decode step against ``roof``, the
    run's fastest read in bytes a second (:func:`run_roof`), the median over rounds quoted,
    as ``scale_decode_mbu_b1`` is for the loops' step."""
    cost = decode_cost(model, 1, e["context"])
    r = e["rounds"]
    per_round = [mbu(cost, roof, ms / 1e3) for ms in r["one_decode_step_ms"]]
    probes = r["probe_gb_per_s"]
    return {"bytes": cost.bytes, "mbu": statistics.median(per_round), "mbu_rounds": per_round,
            "roof_gb_per_s": roof / 1e9,
            "probe_gb_per_s": {"median": statistics.median(probes), "min": min(probes),
                               "max": max(probes)},
            "decode_step_ms": statistics.median(r["one_decode_step_ms"]),
            "memory_bound_ms": 1e3 * cost.bytes / roof}


def run_roof(m: dict[str, Any]) -> float:
    """The run's fastest read, bytes a second: the most any read probe of the run gave (the
    ceilings before and after the sweep, and every round's probe beside the loops' and the
    engine's steps). Every batch-1 MBU of the report is taken against it: a probe only ever
    reads as fast as the memory can or slower, so the fastest is the best estimate of the
    roof, and a round's slower probe would put a step above it. (The notes' other rates, the
    sweep's and int8's, are against the ceilings', ``bandwidth_gb_per_s``: measured around
    the sweep, at most this.)"""
    reads = [m["bandwidth_gb_per_s"] * 1e9, *m["loops_step"]["rounds"]["probe"]]
    if "skipped" not in m["engine_fast"]:
        reads += [r * 1e9 for r in m["engine_fast"]["rounds"]["probe_gb_per_s"]]
    return max(reads)


# --- the suite ----------------------------------------------------------------------------

def _part(fn: Any, *args: Any) -> dict[str, Any]:
    """A part that launches processes or runs for minutes: if it fails, the report keeps
    everything measured before it and says why this part has no figure (printed too)."""
    try:
        return fn(*args)
    except Exception as err:   # noqa: BLE001 (recorded in the report, not swallowed)
        import traceback
        traceback.print_exc()
        return {"skipped": f"failed: {type(err).__name__}: {str(err)[:500]}"}


def _model(quick: bool, device: torch.device, dtype: torch.dtype) -> tuple[TinyLlama, str]:
    if quick:
        torch.manual_seed(0)
        return TinyLlama(QUICK_CONFIG).eval().to(device, dtype), "random tiny (quick)"
    from tinyserve.checkpoint import load_model
    model = load_model("bandwidth", device=device, dtype=dtype).eval()
    cfg = model.config
    return model, (f"bandwidth (seeded random, hidden {cfg.hidden_size}, MLP "
                   f"{cfg.intermediate_size}, {cfg.num_hidden_layers} layers)")


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    # compile_s is what a first user waits: the caches are off for a full run (cold_compiles);
    # each compiled bucket is a fresh dynamo entry (forget_compiled resets). Every fast
    # shape's choice is timed in this run: its cache folder is new (fresh_cache).
    with fresh_cache():
        return cold_compiles(_run, json_path, quick)


def _run(json_path: str | None, quick: bool) -> dict[str, Any]:
    device = default_device()
    dtype = default_dtype(device)
    fast = fastest_mode(device, quick)
    prompt_len, n, repeats = (8, 4, 1) if quick else (64, 16, 3)
    rows_list = QUICK_ROWS if quick else ROWS

    def ceilings() -> tuple[ReadBandwidth, float]:
        return (read_bandwidth(device, (16 if quick else 512) * 2**20),
                matmul_flops(device, dtype, 256) if quick else flop_ceiling(device, dtype))
    # The machine's ceilings are measured before the model exists and again after the sweep,
    # each way keeping its faster figure: a busy spell only ever slows a measurement, and one
    # taken during a spell would make every step look faster than the memory (an MBU above 1).
    ways, flop_rate = ceilings()
    model, name = _model(quick, device, dtype)
    cfg = model.config
    print(f"bench scale: {name} on {device}, {str(dtype).removeprefix('torch.')}; fastest "
          f"path: {fast}", flush=True)

    # 1. Decode step against rows, eager and compiled, and the verify pass.
    sweep, compile_s, verify = rows_and_verify(model, fast, rows_list, prompt_len, n,
                                               repeats, 2 if quick else 9)
    again, flop_again = ceilings()
    ways = ReadBandwidth({w: max(r, again.ways[w]) for w, r in ways.ways.items()})
    m = roofline_figures(model, sweep, prompt_len + n // 2, ways, max(flop_rate, flop_again))
    m.update(compile_s=compile_s, verify_vs_step=verify)

    # 2. int8 weights, 3. long context, 4. speculative decoding (eager, then the fast path
    # both sides), 5. the engine on the fast path, 6. tensor parallelism, 7. a fast shape
    # prepared again in a second process.
    m["int8"] = int8_vs_fp32(model, _prompts(model, 1, prompt_len), n, repeats)
    long_n = 32 if quick else LONG_CONTEXT
    m["long_context"] = {"tokens": long_n, **long_context(model, long_n, 2 if quick else 5)}
    m["speculative"] = _part(speculative_at_scale, model, quick, 2 if quick else 3)
    with fast_recipe(quick):
        m["loops_step"] = loops_step_in_turns(model, _prompts(model, 4, prompt_len), n,
                                              2 if quick else LOOPS_ROUNDS,
                                              (16 if quick else 512) * 2**20)
        # The same batch-1 shape as the loops' step above (the window holds both).
        m["fast_vs_eager"] = _part(_fast_vs_eager.loops_fast_vs_eager, model,
                                   _prompts(model, 1, prompt_len)[0].tolist(),
                                   8 if quick else ENGINE_NEW, 2 if quick else LOOPS_ROUNDS)
        loops_choices = model_choices(model, "loops", "target")
        m["linear_rows"] = linear_rows(model, (1, K + 1), 2 if quick else 9,
                                       flush_bytes=(16 if quick else 256) * 2**20)
        forget_compiled(model)
        m["speculative_fast"] = _part(speculative_at_scale, model, quick, 2 if quick else 3,
                                      True)
        m["engine_fast"] = _part(engine_fast, model, quick, 1 if quick else ENGINE_ROUNDS)
    # The loops' MBUs again, now against the whole run's fastest read (loops_step_in_turns
    # took them against its own rounds' probes: all it had then).
    roof = run_roof(m)
    m["loops_step"].update(paired_figures(m["loops_step"]["rounds"], m["loops_step"]["bytes"],
                                          roof))
    if "skipped" not in m["engine_fast"]:
        m["engine_fast"]["mbu_b1"] = engine_mbu(model, m["engine_fast"], roof)
    del model
    gc.collect()
    m["tensor_parallel"] = _part(tensor_parallel, quick, 2 if quick else 5)
    m["prepare_repeat"] = _part(prepare_repeat, quick)
    m["fast_choices"] = fast_choices(loops_choices, m)

    ratios = scale_ratios(m)
    notes = explain(ratios, m)
    print_summary(ratios, m, notes)
    data = report("scale", ratios=ratios, measurements=m,
                  conditions={"model": name, "device": str(device), "dtype": str(dtype),
                              "config": {k: getattr(cfg, k) for k in (
                                  "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "vocab_size",
                                  "max_position_embeddings")},
                              "prompt_tokens": prompt_len, "steps": n, "repeats": repeats,
                              "rounds": 2 if quick else 9, "rows": list(rows_list),
                              "fastest_path": fast, "k": K,
                              "figures": "meaningless (--quick: tiny random models)"
                              if quick else "timings on this machine; the text is noise"},
                  quick=quick)
    data["notes"] = notes
    write_json(data, json_path)
    return data


def rows_and_verify(model: TinyLlama, fast: dict[str, Any], rows_list: tuple[int, ...],
                    prompt_len: int, n: int, repeats: int,
                    rounds: int) -> tuple[list[dict[str, Any]], dict[str, float], dict[str, float]]:
    """The decode step at each of ``rows_list``, eager and compiled (:func:`~tinyserve.
    roofline.row_sweep`), and from 2 rows on a CPU eager over weights packed once for oneDNN
    (the fast path's other kernel for several rows: ``fastest_ms`` is the fastest of the
    three, as the fast path keeps the faster), and the verify pass against a step on the
    one-row decoder while its graph exists (each bucket's window leaves room for it): the
    sweep's entries, each bucket's compile seconds, :func:`verify_vs_step`'s figures."""
    context = prompt_len + n // 2
    sweep, compile_s, verify = [], {}, {}
    compiled_options = {**fast, "tokens": prompt_len + n + K + 1}
    prompts = _prompts(model, max(rows_list), prompt_len)

    packs = packed.PackedLinears() if packed.available() and model.device.type == "cpu" else None

    def measured(point: RowPoint) -> None:
        rows, eager, compiled = point.rows, point.eager_s, point.compiled_s
        compile_s[str(rows)] = point.compile_s
        # The fast path's other kernel for a step of several rows (fast.choose_step): the
        # same eager step over weights packed once for oneDNN. One row stays plain there.
        on_packed = None
        if packs is not None and rows >= packed.MIN_ROWS:
            with packs:
                on_packed = eager_step_seconds(model, prompts[:rows], n, repeats)
        ways = {"eager": eager, "compiled": compiled}
        if on_packed is not None:
            ways["packed"] = on_packed
        fastest = min(ways, key=ways.__getitem__)
        if rows == 1:
            decoder = compiled_decoder(model, 1, mode=fast["mode"], backend=fast["backend"],
                                       tokens=compiled_options["tokens"])   # the one just timed
            verify.update(verify_vs_step(model, decoder, prompts[:1], fast, rounds))
            del decoder
        forget_compiled(model)
        cost = decode_cost(model, rows, context)
        sweep.append({"rows": rows, "eager_ms": eager * 1e3, "compiled_ms": compiled * 1e3,
                      "packed_ms": None if on_packed is None else on_packed * 1e3,
                      "fastest_ms": ways[fastest] * 1e3, "fastest_path": fastest,
                      "bytes": cost.bytes, "flops": cost.flops,
                      "compile_s": compile_s[str(rows)]})
        print(f"  rows {rows}: " + ", ".join(f"{w} {t * 1e3:.1f} ms" for w, t in ways.items())
              + f" (compile {compile_s[str(rows)]:.0f} s)", flush=True)
    row_sweep(model, prompts, rows_list, n, repeats, compiled=compiled_options, after=measured)
    return sweep, compile_s, verify


def roofline_figures(model: TinyLlama, sweep: list[dict[str, Any]], context: int,
                     ways: ReadBandwidth, flop_rate: float) -> dict[str, Any]:
    """The machine's ceilings as finally measured, each sweep entry's memory and compute
    bounds under them, the batch-1 MBU and the knee (measured and roofline); the table
    printed. The report's measurements so far."""
    bandwidth = ways.best
    for entry in sweep:
        bound = bounds_seconds(decode_cost(model, entry["rows"], context), bandwidth, flop_rate)
        entry.update(memory_bound_ms=bound["memory_s"] * 1e3,
                     compute_bound_ms=bound["compute_s"] * 1e3)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({ways.fastest_way}; "
          + ", ".join(f"{w} {r / 1e9:.1f}" for w, r in ways.ways.items())
          + f"), matmul {flop_rate / 1e9:.1f} GFLOP/s: each the faster of two measurements, "
          f"before and after the sweep", flush=True)
    by_rows = {r["rows"]: r for r in sweep}
    one = by_rows[1]
    b1_cost = decode_cost(model, 1, context)
    from tinyserve.quant import weight_bytes
    knee_roofline = roofline_knee(model.config, weight_bytes(model), model.dtype.itemsize,
                                  context, bandwidth, flop_rate)
    print(table(["rows", "eager ms", "compiled ms", "packed ms", "memory bound ms",
                 "compute bound ms", "fastest / 1 row", "compile s"],
                [[r["rows"], r["eager_ms"], r["compiled_ms"],
                  "-" if r["packed_ms"] is None else r["packed_ms"], r["memory_bound_ms"],
                  r["compute_bound_ms"], r["fastest_ms"] / one["fastest_ms"], r["compile_s"]]
                 for r in sweep]), flush=True)
    return {
        "read_bandwidth_gb_per_s": {w: r / 1e9 for w, r in ways.ways.items()},
        "bandwidth_gb_per_s": bandwidth / 1e9, "bandwidth_way": ways.fastest_way,
        "matmul_gflop_per_s": flop_rate / 1e9, "ridge_flop_per_byte": flop_rate / bandwidth,
        "weight_bytes": b1_cost.weight_bytes, "context": context, "sweep": sweep,
        # No batch-1 MBU here (issue 52, I7): the report's one MBU per path is the loops'
        # step against the run's fastest read (loops_step's mbu_fast and mbu_eager).
        "knee": {"measured_fastest": measured_knee({r: e["fastest_ms"]
                                                    for r, e in by_rows.items()}),
                 "measured_eager": measured_knee({r: e["eager_ms"] for r, e in by_rows.items()}),
                 "roofline": knee_roofline}}


def fast_choices(loops: list[dict[str, Any]], m: dict[str, Any]) -> list[dict[str, Any]]:
    """Every fast shape the suite prepared, with what it runs here and the times that chose
    it (:mod:`._fast_choices`): the loops' decode buckets, speculation's target step, verify
    and draft widths, the engine's steps, and the repeat's shape in its first process (timed)
    and its second (kept). Empty on CUDA (graphs: nothing to choose)."""
    out = unique(loops)
    for part in ("speculative_fast", "engine_fast"):
        out += m[part].get("choices", [])
    r = m["prepare_repeat"]
    for which in ("first", "second"):
        if r.get(f"{which}_choice"):
            out.append({"part": f"prepare_repeat ({which} process)", "model": "target",
                        **r[f"{which}_choice"]})
    return out


def scale_ratios(m: dict[str, Any]) -> dict[str, float]:
    """The report's ratios from its measurements (a part that was skipped gives none)."""
    v, longc = m["verify_vs_step"], m["long_context"]
    ratios: dict[str, float] = {
        # the loops' fast step against the run's fastest read (bench/suites/_loops_step)
        "scale_decode_mbu_b1": m["loops_step"]["mbu_fast"],
        "scale_step_rows4_vs_rows1": m["loops_step"]["rows4_vs_rows1"],
        # the fastest verify pass over the fastest step, whichever path each
        "scale_verify_k4_vs_step": min(v["compiled_verify_ms"], v["eager_verify_ms"])
        / min(v["compiled_step_ms"], v["eager_step_ms"]),
        "scale_cache_speedup_512": longc["recompute_step_ms"] / longc["cached_step_ms"],
        "scale_prefill_tokens_per_step": longc["tokens"] * longc["cached_step_ms"]
        / longc["prefill_ms"],
    }
    knee = m["knee"]
    if math.isfinite(knee["measured_fastest"]) and math.isfinite(knee["roofline"]):
        ratios["scale_knee_measured_vs_predicted"] = knee["measured_fastest"] / knee["roofline"]
    if "skipped" not in m["int8"]:
        ratios["scale_int8_decode_speedup"] = m["int8"]["fp32_ms"] / m["int8"]["int8_ms"]
    spec = m["speculative_fast"]    # the eager run's figures stay in m["speculative"]
    if "skipped" not in spec:
        ratios["scale_spec_speedup_fast"] = spec["measured_speedup"]
        ratios["scale_spec_measured_vs_predicted"] = spec["measured_vs_predicted"]
    if "ratio" in m.get("fast_vs_eager", {}):           # issue 50: fast / eager, in turns
        ratios["scale_fast_vs_eager_b1"] = m["fast_vs_eager"]["ratio"]
    if "skipped" not in m["engine_fast"]:
        ratios["scale_engine_mbu_b1"] = m["engine_fast"]["mbu_b1"]["mbu"]
        ratios["scale_engine_throughput_4_vs_1"] = m["engine_fast"]["throughput_4_vs_1"]
        if "fast_vs_eager_b1" in m["engine_fast"]:
            ratios["scale_engine_fast_vs_eager_b1"] = \
                m["engine_fast"]["fast_vs_eager_b1"]["ratio"]
    if "skipped" not in m["tensor_parallel"]:
        ratios["scale_tp2_decode_speedup"] = m["tensor_parallel"]["tp"]["speedup"]
        ratios["scale_tp2_vs_bandwidth_bound"] = m["tensor_parallel"]["tp2_vs_bandwidth_bound"]
    if "skipped" not in m["prepare_repeat"]:
        ratios["scale_prepare_repeat_s"] = m["prepare_repeat"]["second_s"]
    return ratios


@contextlib.contextmanager
def fast_recipe(quick: bool) -> Iterator[None]:
    """``--quick``: the fast path only traced (:data:`tinyserve.backends.fast.CPU_RECIPE`,
    the one knob, as the tests set it) for the block, the real recipe back after it."""
    from tinyserve.backends import fast as fastpath
    saved = fastpath.CPU_RECIPE
    if quick:
        fastpath.CPU_RECIPE = fastpath.Recipe((), False, "eager")
    try:
        yield
    finally:
        fastpath.CPU_RECIPE = saved


# --- what a missed goal's measurements show ------------------------------------------------

def _knee_cost(sweep: dict[int, dict[str, Any]]) -> str:
    """Why the measured knee came before the roofline's, from the first swept batch past it:
    what each extra row cost against its FLOPs at the ceiling, and whether the step took
    about its bytes' time *plus* its FLOPs' or the larger of the two (the roofline's)."""
    one = sweep[1]
    rows = next(r for r in sorted(sweep) if sweep[r]["fastest_ms"] >= 1.5 * one["fastest_ms"])
    e = sweep[rows]
    per_row = (e["fastest_ms"] - one["fastest_ms"]) / (rows - 1)
    flops_row = e["compute_bound_ms"] / rows
    both = e["memory_bound_ms"] + e["compute_bound_ms"]
    larger = max(e["memory_bound_ms"], e["compute_bound_ms"])
    nearer = ("their sum" if abs(e["fastest_ms"] - both) < abs(e["fastest_ms"] - larger)
              else "the larger of the two")
    return (f"at {rows} rows the fastest step ({e['fastest_path']}) took {e['fastest_ms']:.1f} ms "
            f"against one row's {one['fastest_ms']:.1f}, {per_row:.2f} ms per extra row where a "
            f"row's FLOPs take {flops_row:.2f} ms at the ceiling ({per_row / flops_row:.1f}x); "
            f"bytes alone {e['memory_bound_ms']:.1f} ms, FLOPs alone {e['compute_bound_ms']:.1f}: "
            f"the step came nearer {nearer} ({both:.1f} against {larger:.1f} ms), while the "
            f"roofline counts the larger")


def explain(ratios: dict[str, float], m: dict[str, Any]) -> dict[str, str]:
    """For each ratio that misses its goal (:mod:`bench.headlines`), a sentence computed from
    the measurements next to it: what they show, not only the number; and, met or not, the
    fast steps against eager with the way each batch-1 shape chose (:mod:`._fast_vs_eager`)."""
    from ..headlines import missed_goals
    missed = missed_goals("scale", ratios)
    notes: dict[str, str] = {}
    bw = m["bandwidth_gb_per_s"]
    sweep = {r["rows"]: r for r in m["sweep"]}
    one = sweep[1]
    notes.update(loops_step_notes(m, missed))
    if "scale_knee_measured_vs_predicted" in missed:
        k = m["knee"]
        notes["scale_knee_measured_vs_predicted"] = (
            f"the measured step reaches 1.5x one row at {k['measured_fastest']:.1f} rows "
            f"(eager {k['measured_eager']:.1f}); the roofline from {bw:.1f} GB/s and "
            f"{m['matmul_gflop_per_s']:.0f} GFLOP/s (ridge "
            f"{m['ridge_flop_per_byte']:.1f} FLOP/byte) puts it at {k['roofline']:.1f}"
            + (f": {_knee_cost(sweep)}" if k["measured_fastest"] < k["roofline"] else ""))
    if "scale_knee_measured_vs_predicted" not in ratios:
        notes["scale_knee_measured_vs_predicted"] = (
            f"not a number: the fastest step never reached 1.5x one row up to "
            f"{max(sweep)} rows (the measured knee lies beyond the sweep; the roofline puts "
            f"it at {m['knee']['roofline']:.1f})")
    v = m["verify_vs_step"]
    if "scale_verify_k4_vs_step" in missed:
        notes["scale_verify_k4_vs_step"] = (
            f"a {K + 1}-token pass costs {v['compiled_verify_ms']:.1f} ms compiled against a "
            f"step's {v['compiled_step_ms']:.1f} "
            f"({v['compiled_verify_ms'] / v['compiled_step_ms']:.2f}x), eager "
            f"{v['eager_verify_ms']:.1f} against {v['eager_step_ms']:.1f} "
            f"({v['eager_verify_ms'] / v['eager_step_ms']:.2f}x); the weights are read once "
            f"either way, so the extra time is the {K + 1}-row matmuls' work: the same kernel "
            f"cost that bends the rows sweep (4 rows: "
            f"{sweep[4]['fastest_ms'] / one['fastest_ms']:.2f}x){_kernel(m)}")
    notes.update(explain_parts(m, missed))
    notes.update(_fast_vs_eager.notes(m, missed))
    return {k: v for k, v in notes.items() if v}


def loops_step_notes(m: dict[str, Any], missed: set[str]) -> dict[str, str]:
    """:func:`explain`'s sentences for the loops' step timed in turns with the probe
    (:mod:`._loops_step`): the decode MBU and 4 rows against 1."""
    notes: dict[str, str] = {}
    p, sweep = m["loops_step"], {r["rows"]: r for r in m["sweep"]}
    ms, bw, roof = p["median_ms"], p["probe_gb_per_s"], p["roof_gb_per_s"]
    rounds = len(p["mbu_fast_rounds"])
    if "scale_decode_mbu_b1" in missed:
        floor = p["bytes"] / (roof * 1e9) * 1e3
        notes["scale_decode_mbu_b1"] = (
            f"the loops' batch-1 step (the fast path{_runs(m, 'loops')}) took "
            f"{ms['fast_1']:.1f} ms (median of "
            f"{rounds} rounds; eager {ms['eager_1']:.1f}) for {p['bytes'] / 1e6:.0f} MB, "
            f"against the run's fastest read, {roof:.1f} GB/s (the probe's rounds beside the "
            f"steps read {bw['min']:.1f} to {bw['max']:.1f}): {floor:.1f} ms at that rate, so "
            f"{ms['fast_1'] - floor:.1f} ms of the step is not reading at the memory's rate "
            f"(per round: {_spread(p['mbu_fast_rounds'])}; eager's MBU "
            f"{p['mbu_eager']:.2f})" + (
                f"; {one_row_sentence(m['linear_rows'], roof)}" if "linear_rows" in m
                else ": attention, norms and activations on the same thread, and matmul "
                     "kernels reading below a long-row matvec's rate (this run does not split "
                     "the two)"))
    if "scale_step_rows4_vs_rows1" in missed:
        four, one = sweep[4], sweep[1]
        roof4 = max(four["memory_bound_ms"], four["compute_bound_ms"])
        roof1 = max(one["memory_bound_ms"], one["compute_bound_ms"])
        notes["scale_step_rows4_vs_rows1"] = (
            f"on the loops' fast path 4 rows took {ms['fast_4']:.1f} ms against 1 row's "
            f"{ms['fast_1']:.1f} (per round: {_spread(p['rows4_vs_rows1_rounds'])}); the "
            f"roofline says {roof4:.1f} against {roof1:.1f} ms ({roof4 / roof1:.2f}x), so the "
            f"extra time is the kernels' work per row, not the physics; in the rows sweep "
            f"(each bucket alone, not in turns) the compiled step cost "
            f"{four['compiled_ms'] / one['compiled_ms']:.2f}x, eager "
            f"{four['eager_ms'] / one['eager_ms']:.2f}x{_kernel(m)}")
    return notes


def _runs(m: dict[str, Any], part: str) -> str:
    """'; it runs ...': the way the batch-1 shape of ``part`` ("loops", "engine") chose
    here, with the times that chose it, if the report recorded it."""
    c = batch1(m.get("fast_choices", []), part, "engine decode" if part == "engine" else "decode")
    return "" if c is None else f"; it runs {c['sentence']}"


def _kernel(m: dict[str, Any]) -> str:
    """'; ' and :func:`._linear_rows.kernel_sentence`, if the report measured it."""
    return f"; {kernel_sentence(m['linear_rows'])}" if "linear_rows" in m else ""


def _spread(values: list[float]) -> str:
    """'0.81 to 0.93' for a list of per-round figures."""
    return f"{min(values):.2f} to {max(values):.2f}"


def explain_parts(m: dict[str, Any], missed: set[str]) -> dict[str, str]:
    """:func:`explain`'s sentences for the parts after the rows sweep: int8, speculation on
    the fast path, the engine on the fast path, tensor parallelism, a second process's
    preparation."""
    notes: dict[str, str] = {}
    bw = m["bandwidth_gb_per_s"]
    i8 = m["int8"]
    if "scale_int8_decode_speedup" in missed and "int8_ms" in i8:
        rate = i8["int8_weight_bytes"] / (i8["int8_ms"] / 1e3) / 1e9
        notes["scale_int8_decode_speedup"] = (
            f"int8 weights are {i8['fp32_weight_bytes'] / i8['int8_weight_bytes']:.2f}x fewer "
            f"bytes, but the int8 step ({i8['int8_ms']:.1f} ms against fp32's "
            f"{i8['fp32_ms']:.1f}) reads them at {rate:.1f} GB/s, "
            f"{rate / bw:.2f} of the best read bandwidth: the kernel (dynamic activation "
            f"quantisation, int8 dot products) does not stream at the memory's rate")
    t = m["tensor_parallel"]
    if "scale_tp2_vs_bandwidth_bound" in missed and "tp" in t:
        notes["scale_tp2_vs_bandwidth_bound"] = (
            f"two ranks ran {t['tp']['speedup']:.2f}x one process while two processes read "
            f"{t['bandwidth']['speedup']:.2f}x what one reads alone and each rank read "
            f"{t['tp']['shard_bytes'] / t['tp']['whole_bytes']:.0%} of the bytes (the bound: "
            f"{t['bandwidth_bound']:.2f}x); "
            f"{t['tp']['allreduce_share']:.0%} of a split step was inside all-reduces "
            f"(waiting included): splitting the bytes can gain at most what the bus adds "
            f"for a second process, and the all-reduces come out of that")
    s = m["speculative_fast"]
    if "measured_speedup" in s and missed & {"scale_spec_speedup_fast",
                                             "scale_spec_measured_vs_predicted"}:
        c = s["pass_costs_ms"]
        costs = (f"on the fast path a {K + 1}-token verify pass costs {c['verify_ms']:.2f} ms "
                 f"against a one-token step's {c['decode_ms']:.2f} ({s['verify_cost']:.2f}x) "
                 f"and a draft step {c['draft_step_ms']:.2f} ({s['draft_cost']:.2f}x the "
                 f"target's)")
        if "scale_spec_speedup_fast" in missed:
            notes["scale_spec_speedup_fast"] = (
                f"{s['spec_tokens_per_s']:.1f} tokens/s speculative against "
                f"{s['plain_tokens_per_s']:.1f} plain at a = {s['acceptance_prob']:.2f} "
                f"({s['tokens_per_pass_measured']:.2f} tokens per target pass): {costs}, so "
                f"the formula itself allows {s['predicted_speedup']:.2f}x{_kernel(m)}")
        if "scale_spec_measured_vs_predicted" in missed:
            notes["scale_spec_measured_vs_predicted"] = (
                f"measured {s['measured_speedup']:.2f}x against {s['predicted_speedup']:.2f}x "
                f"predicted at a = {s['acceptance_prob']:.2f} ({costs}): a speculative pass as "
                f"run took {s['spec_pass_ms']:.2f} ms against the formula's "
                f"{s['formula_pass_ms']:.2f} ({K} draft steps + one verify pass, each timed "
                f"alone) and plain decoding {1e3 * s['plain_s'] / s['tokens']:.2f} ms a token "
                f"against its step's {c['decode_ms']:.2f}: what each loop pays beyond its "
                f"passes (prefills, the draft's catch-up, host work; on a busy machine, whole "
                f"runs also catch fewer quiet moments than single passes do)")
    e = m["engine_fast"]
    if "scale_engine_mbu_b1" in missed and "mbu_b1" in e:
        b1, loops = e["mbu_b1"], m["loops_step"]["median_ms"]["fast_1"]
        notes["scale_engine_mbu_b1"] = (
            f"the engine's batch-1 decode step took {b1['decode_step_ms']:.2f} ms (the median "
            f"over {len(b1['mbu_rounds'])} rounds of each run's median step; per round MBU "
            f"{_spread(b1['mbu_rounds'])}) against {b1['memory_bound_ms']:.2f} ms for its "
            f"{b1['bytes'] / 1e6:.0f} MB at the run's fastest read, "
            f"{b1['roof_gb_per_s']:.1f} GB/s; the loops' fast step took {loops:.2f} ms "
            f"({b1['decode_step_ms'] - loops:+.2f} ms: the engine's step is a shape of its "
            f"own, with its paged gather, chosen on its own{_runs(m, 'engine')}; plus the "
            f"host work around it: its inputs' copy into the static buffers, sampling, the "
            f"read-back)" + (f"; {one_row_sentence(m['linear_rows'], b1['roof_gb_per_s'])}"
                             if "linear_rows" in m else ""))
    if "scale_engine_throughput_4_vs_1" in missed and "steps" in e:
        one, four = e["steps"]["1"], e["steps"]["4"]
        sweep = {r["rows"]: r for r in m["sweep"]}
        notes["scale_engine_throughput_4_vs_1"] = (
            f"4 requests ran at {e['four_tokens_per_s']:.1f} tokens/s against one's "
            f"{e['one_tokens_per_s']:.1f}: a 4-row decode step took "
            f"{four['decode_step_ms']:.2f} ms against 1 row's {one['decode_step_ms']:.2f} "
            f"({four['decode_step_ms'] / one['decode_step_ms']:.2f}x; the rows sweep's "
            f"compiled step {sweep[4]['compiled_ms'] / sweep[1]['compiled_ms']:.2f}x), and the "
            f"steps that were not pure decode (prefills) took "
            f"{four['other_steps_s'] / four['step_s']:.0%} of the 4-request run's step time"
            f"{_kernel(m)}")
    r = m["prepare_repeat"]
    kept = r.get("second_choice") or {}
    if ("scale_prepare_repeat_s" in missed and "second_s" in r
            and kept.get("kernel", "compiled") != "compiled"):
        notes["scale_prepare_repeat_s"] = (
            f"the second process took {r['second_s']:.1f} s against the first's "
            f"{r['first_s']:.1f} s and compiled {r.get('second_graphs_compiled')} graphs: it "
            f"read the shape's choice kept by the first ({kept.get('sentence')}), so no "
            f"compile is in its time; the rest is the fast path's set-up (the toolchain's "
            f"probe, the kept measurements read) and the shape's first step")
    elif "scale_prepare_repeat_s" in missed and "second_s" in r:
        notes["scale_prepare_repeat_s"] = (
            f"the second process took {r['second_s']:.1f} s against the first's "
            f"{r['first_s']:.1f} s, and tracing the same shape alone (TorchDynamo, no "
            f"inductor) {r['trace_s']:.1f} s; {r['second_s'] - r['trace_s']:.1f} s of it is "
            f"beyond the trace: inductor lowers the graph again (its FX graph cache cannot "
            f"pickle the packed weights, tinyserve.backends.fast.PREPACK_FROM_ROWS) with the "
            f"built kernels and the autotuner's timings read back, and the step's first run")
    return notes


def spec_acceptance_lines(m: dict[str, Any]) -> list[str]:
    """Each speculative run's speed-up at the trained pair's a and at the lower a, beside the
    break-even a of its pass costs: which a each figure uses (issue 52, W1)."""
    lines = []
    for part, name in (("speculative", "eager"), ("speculative_fast", "fast path")):
        s = m.get(part, {})
        if "measured_speedup" not in s or "at_lower_a" not in s:
            continue
        low = s["at_lower_a"]
        lines.append(
            f"speculation at scale, {name}, k={s['k']}: at the trained pair's a (set "
            f"{s['acceptance_set']:.2f}, realised {s['acceptance_prob']:.2f}) "
            f"{s['measured_speedup']:.2f}x measured, {s['predicted_speedup']:.2f}x predicted; "
            f"at a lower a (set {low['acceptance_set']:.2f}, realised "
            f"{low['acceptance_prob']:.2f}) {low['measured_speedup']:.2f}x measured, "
            f"{low['predicted_speedup']:.2f}x predicted; break-even a {s['break_even_a']:.2f} "
            f"(c = {s['draft_cost']:.2f}, v = {s['verify_cost']:.2f})")
    return lines


def print_summary(ratios: dict[str, float], m: dict[str, Any], notes: dict[str, str]) -> None:
    from ..headlines import goals_table
    print()
    print(goals_table("scale", ratios))
    for part in ("int8", "speculative", "fast_vs_eager", "speculative_fast", "engine_fast",
                 "tensor_parallel", "prepare_repeat"):
        if "skipped" in m[part]:
            print(f"{part}: not measured: {m[part]['skipped']}")
    for name, text in notes.items():
        print(f"note, {name}: {text}")
    for line in spec_acceptance_lines(m):
        print(line)
    if m.get("fast_choices"):
        print("the fast path's per-shape choices on this machine (each timed in turns once, "
              "kept on disk):")
        for line in choices_text(m["fast_choices"]):
            print(f"  {line}")

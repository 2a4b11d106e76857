"""The memory wall, measured (issue 30): every regime-dependent lesson on the bandwidth-scale
model, held against this machine's own roofline measured in the same run.

The scale model (:mod:`tinyserve.scale`, ``load_model("bandwidth")``) is the shipped
``TinyLlama`` code at a size whose weights must come from DRAM (or HBM) on every decode step:
on this CPU 8x the last-level cache, on CUDA the GPU timing preset. Its weights are seeded
random numbers, so its text is noise; only its timings mean something.

What one run measures, in this order:

- the machine: read bandwidth as the fastest of a reduction, a copy and a matrix-vector
  product over a buffer far above the cache (:func:`~tinyserve.roofline.read_bandwidth`),
  and the matmul FLOP rate (:func:`~tinyserve.roofline.matmul_flops`), each before and
  after the rows sweep, the faster kept;
- a decode step at rows 1, 2, 4, 8, 16, 32, eager and on the fastest compiled path (on a
  CPU ``torch.compile(mode="max-autotune")`` with inductor's ``freezing``: its C++ GEMM
  template over weights packed once at compile time; on CUDA the default CUDA-graph mode),
  with each bucket's compile time;
- a (k+1) = 5-token verify pass against a one-token step, eager (what speculative decoding
  runs) and compiled;
- int8 weights through fbgemm's kernel (``quantize_model(model, kernel="fbgemm")``) against
  fp32, batch 1, eager both;
- a cached step against recomputing the whole 512-token context, and a 512-token prefill;
- speculative decoding at k = 4 with the bandwidth-draft model's real passes proposing the
  target's own greedy tokens at a set acceptance (:mod:`tinyserve.draft_replay`), against the
  speed-up :func:`~tinyserve.speculative.predicted_speedup` predicts from the acceptance and
  the pass costs measured here;
- tensor parallelism over two processes against one, next to what two processes read
  together against one alone (:mod:`tinyserve.parallel.timing`).

Ratios (``ratios`` in the report; goals in :mod:`bench.headlines`, from issue 30):
``scale_decode_mbu_b1`` (bytes of a batch-1 step / best read bandwidth / step time, fastest
path), ``scale_step_rows4_vs_rows1``, ``scale_knee_measured_vs_predicted`` (rows where a step
first costs 1.5x one row, measured / roofline), ``scale_int8_decode_speedup``,
``scale_verify_k4_vs_step``, ``scale_spec_measured_vs_predicted``, ``scale_tp2_decode_speedup``,
``scale_tp2_vs_bandwidth_bound`` (TP speed-up / two-process read-bandwidth gain),
``scale_cache_speedup_512``, ``scale_prefill_tokens_per_step``. Where a goal is missed the
report's ``notes`` say what the measurements beside it show.

Every time is the fastest of several runs (other processes only slow a run down). One torch
thread per process. ``--quick`` runs the same code on tiny random models and only traces the
compiled paths: its figures mean nothing and the report says so.
"""
from __future__ import annotations

import functools
import gc
import math
from typing import Any

import torch

from tinyserve.backends.compiled import CompiledDecoder, DECODERS as _DECODERS, compiled_decoder
from tinyserve.config import ModelConfig
from tinyserve.device import default_device, default_dtype
from tinyserve.generate import extend, generate, prefill
from tinyserve.kv_cache import KVCache
from tinyserve.model import TinyLlama
from tinyserve.roofline import (ReadBandwidth, RowPoint, bounds_seconds, compile_settings,
                                decode_cost, eager_step_seconds, flop_ceiling, matmul_flops,
                                mbu, measured_knee, read_bandwidth, roofline_knee, row_sweep)
from tinyserve.speculative import expected_tokens_per_pass, predicted_speedup, speculative_generate

from ..common import QUICK_CONFIG, cold_compiles, interleaved_seconds, report, table, write_json

#: Cores a run keeps busy (its tensor-parallel part runs two ranks): the load average after
#: it is judged less these.
OWN_THREADS = 2
ROWS = (1, 2, 4, 8, 16, 32)
QUICK_ROWS = (1, 4)
K = 4                 # draft tokens per speculative step (the k)
#: Per-draft acceptance set for the replayed drafter: about what the shipped (trained)
#: target/draft pair measures at k = 4 (bench spec's ``spec_acceptance_k4``, 0.85 on
#: 2026-12-01). The run measures the acceptance it actually got and predicts from that.
SPEC_ACCEPTANCE = 0.8
LONG_CONTEXT = 512    # the cached-vs-recompute and prefill comparisons
QUICK_DRAFT = ModelConfig(vocab_size=128, hidden_size=16, intermediate_size=32,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=64)


# --- the fastest compiled path --------------------------------------------------------------

def fastest_mode(device: torch.device, quick: bool) -> dict[str, Any]:
    """How the fastest compiled path is built here (:func:`~tinyserve.roofline.
    compiled_step_seconds`'s options): on a CPU max-autotune with freezing (the weights
    become constants, packed once for inductor's C++ GEMM template, the only GEMM choice left:
    :func:`~tinyserve.roofline.compile_settings`; issue 30 measured 1.2-1.5x one row at 4 rows
    with it, eager F.linear 2-2.2x), on CUDA the default CUDA-graph mode. ``--quick`` on a CPU
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
    generated, and a dynamo reset alone leaves those modules loaded (measured here: +400 MB
    of resident memory per bucket, 4.8 GB peak over the sweep; with this, 1.9 GB)."""
    import sys

    from torch._inductor.codecache import PyCodeCache
    _DECODERS.drop(model)
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
    with compile_settings(fast["freezing"]):
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
def speculative_at_scale(target: TinyLlama, quick: bool, rounds: int) -> dict[str, Any]:
    """Speculative decoding at k = K with the draft model's real passes proposing the target's
    own greedy continuation, each guess right with probability :data:`SPEC_ACCEPTANCE`
    (:class:`~tinyserve.draft_replay.ReplayDrafter`), against plain greedy decoding of the
    same prompts (outputs checked equal). The prediction uses the acceptance measured in the
    run and pass costs measured here on the same eager code the loops run."""
    try:
        from tinyserve.draft_replay import ReplayDrafter, greedy_script
    except ImportError as err:
        return {"skipped": f"tinyserve.draft_replay is not available ({err})"}
    device = target.device
    draft = _drafter_models(quick, device, target.dtype)
    prompt_len, max_tokens = (8, 16) if quick else (32, 64)
    prompts = [_prompts(target, 1, prompt_len, seed=10 + i)[0].tolist() for i in range(2)]
    scripts = [greedy_script(target, p, max_tokens) for p in prompts]
    stats_all = []
    spec_s = plain_s = 0.0
    for i, (p, script) in enumerate(zip(prompts, scripts)):
        def spec_once(p=p, script=script, i=i) -> Any:
            drafter = ReplayDrafter(draft, script, SPEC_ACCEPTANCE, seed=i)
            return speculative_generate(target, drafter, p, max_tokens, k=K)
        got, stats = spec_once()
        if got != script:
            raise RuntimeError("speculative output differs from plain greedy decoding at "
                               "scale; verification is wrong")
        stats_all.append(stats)
        runs = interleaved_seconds({"spec": spec_once,
                                    "plain": lambda p=p: generate(target, p, max_tokens)},
                                   device, rounds, warmup=0)
        spec_s, plain_s = spec_s + min(runs["spec"]), plain_s + min(runs["plain"])
    accepted = sum(s.accepted for s in stats_all)
    checked = sum(s.accepted + s.rejected for s in stats_all)
    a = accepted / max(checked, 1)
    costs = pass_costs(target, draft, prompt_len + max_tokens // 2, rounds * 3)
    draft_cost = costs["draft_step_ms"] / costs["decode_ms"]
    verify_cost = costs["verify_ms"] / costs["decode_ms"]
    predicted = predicted_speedup(a, K, draft_cost, verify_cost)
    measured = plain_s / spec_s
    passes = sum(s.target_passes for s in stats_all)
    del draft
    gc.collect()
    return {"acceptance_set": SPEC_ACCEPTANCE, "acceptance_prob": a,
            "acceptance_rate": accepted / max(sum(s.proposed for s in stats_all), 1),
            "tokens_per_pass_expected": expected_tokens_per_pass(a, K),
            "tokens_per_pass_measured": sum(sum(s.emitted) for s in stats_all) / max(passes, 1),
            "spec_s": spec_s, "plain_s": plain_s, "measured_speedup": measured,
            "draft_cost": draft_cost, "verify_cost": verify_cost,
            "predicted_speedup": predicted, "measured_vs_predicted": measured / predicted,
            "target_passes": passes, "spec_pass_ms": 1e3 * spec_s / max(passes, 1),
            "formula_pass_ms": K * costs["draft_step_ms"] + costs["verify_ms"],
            "pass_costs_ms": costs, "prompts": len(prompts), "prompt_tokens": prompt_len,
            "max_tokens": max_tokens, "k": K}


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
            "tp2_vs_bandwidth_bound": tp.speedup / bw.speedup}


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
    # each compiled bucket is a fresh dynamo entry (forget_compiled resets).
    return cold_compiles(_run, json_path, quick)


def _run(json_path: str | None, quick: bool) -> dict[str, Any]:
    device = default_device()
    dtype = default_dtype(device)
    fast = fastest_mode(device, quick)
    prompt_len, n, repeats = (8, 4, 1) if quick else (64, 16, 3)
    rows_list = QUICK_ROWS if quick else ROWS
    rounds = 2 if quick else 9

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

    # 1. Decode step against rows, eager and compiled (each bucket's window leaves room for
    # the verify pass, which runs on the one-row decoder while its graph exists).
    context = prompt_len + n // 2
    sweep, compile_s, verify = [], {}, {}
    compiled_options = {**fast, "tokens": prompt_len + n + K + 1}
    prompts = _prompts(model, max(rows_list), prompt_len)

    def measured(point: RowPoint) -> None:
        rows, eager, compiled = point.rows, point.eager_s, point.compiled_s
        compile_s[str(rows)] = point.compile_s
        if rows == 1:
            decoder = compiled_decoder(model, 1, mode=fast["mode"], backend=fast["backend"],
                                       tokens=compiled_options["tokens"])   # the one just timed
            verify.update(verify_vs_step(model, decoder, prompts[:1], fast, rounds))
            del decoder
        forget_compiled(model)
        cost = decode_cost(model, rows, context)
        sweep.append({"rows": rows, "eager_ms": eager * 1e3, "compiled_ms": compiled * 1e3,
                      "fastest_ms": min(eager, compiled) * 1e3,
                      "fastest_path": "compiled" if compiled < eager else "eager",
                      "bytes": cost.bytes, "flops": cost.flops,
                      "compile_s": compile_s[str(rows)]})
        print(f"  rows {rows}: eager {eager * 1e3:.1f} ms, compiled {compiled * 1e3:.1f} ms "
              f"(compile {compile_s[str(rows)]:.0f} s)", flush=True)
    row_sweep(model, prompts, rows_list, n, repeats, compiled=compiled_options, after=measured)
    again, flop_again = ceilings()
    ways = ReadBandwidth({w: max(r, again.ways[w]) for w, r in ways.ways.items()})
    flop_rate = max(flop_rate, flop_again)
    bandwidth = ways.best
    for entry in sweep:   # the bounds with the machine's ceilings as finally measured
        cost = decode_cost(model, entry["rows"], context)
        bound = bounds_seconds(cost, bandwidth, flop_rate)
        entry.update(memory_bound_ms=bound["memory_s"] * 1e3,
                     compute_bound_ms=bound["compute_s"] * 1e3)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({ways.fastest_way}; "
          + ", ".join(f"{w} {r / 1e9:.1f}" for w, r in ways.ways.items())
          + f"), matmul {flop_rate / 1e9:.1f} GFLOP/s: each the faster of two measurements, "
          f"before and after the sweep", flush=True)
    by_rows = {r["rows"]: r for r in sweep}
    one = by_rows[1]
    b1_cost = decode_cost(model, 1, context)
    mbu_eager = mbu(b1_cost, bandwidth, one["eager_ms"] / 1e3)
    mbu_compiled = mbu(b1_cost, bandwidth, one["compiled_ms"] / 1e3)
    knee_measured = measured_knee({r: e["fastest_ms"] for r, e in by_rows.items()})
    knee_eager = measured_knee({r: e["eager_ms"] for r, e in by_rows.items()})
    from tinyserve.quant import weight_bytes
    knee_roofline = roofline_knee(cfg, weight_bytes(model), dtype.itemsize, context,
                                  bandwidth, flop_rate)
    print(table(["rows", "eager ms", "compiled ms", "memory bound ms", "compute bound ms",
                 "fastest / 1 row", "compile s"],
                [[r["rows"], r["eager_ms"], r["compiled_ms"], r["memory_bound_ms"],
                  r["compute_bound_ms"], r["fastest_ms"] / one["fastest_ms"], r["compile_s"]]
                 for r in sweep]), flush=True)

    # 2. int8 weights, 3. long context, 4. speculative decoding, 5. tensor parallelism.
    int8 = int8_vs_fp32(model, _prompts(model, 1, prompt_len), n, repeats)
    long_n = 32 if quick else LONG_CONTEXT
    longc = long_context(model, long_n, 2 if quick else 5)
    spec = _part(speculative_at_scale, model, quick, 2 if quick else 3)
    del model
    gc.collect()
    tp = _part(tensor_parallel, quick, 2 if quick else 5)

    ratios: dict[str, float] = {
        "scale_decode_mbu_b1": max(mbu_eager, mbu_compiled),
        "scale_step_rows4_vs_rows1": by_rows[4]["fastest_ms"] / one["fastest_ms"],
        # the fastest verify pass over the fastest step, whichever path each
        "scale_verify_k4_vs_step": min(verify["compiled_verify_ms"], verify["eager_verify_ms"])
        / min(verify["compiled_step_ms"], verify["eager_step_ms"]),
        "scale_cache_speedup_512": longc["recompute_step_ms"] / longc["cached_step_ms"],
        "scale_prefill_tokens_per_step": long_n * longc["cached_step_ms"] / longc["prefill_ms"],
    }
    if math.isfinite(knee_measured) and math.isfinite(knee_roofline):
        ratios["scale_knee_measured_vs_predicted"] = knee_measured / knee_roofline
    if "skipped" not in int8:
        ratios["scale_int8_decode_speedup"] = int8["fp32_ms"] / int8["int8_ms"]
    if "skipped" not in spec:
        ratios["scale_spec_measured_vs_predicted"] = spec["measured_vs_predicted"]
    if "skipped" not in tp:
        ratios["scale_tp2_decode_speedup"] = tp["tp"]["speedup"]
        ratios["scale_tp2_vs_bandwidth_bound"] = tp["tp2_vs_bandwidth_bound"]

    measurements = {
        "read_bandwidth_gb_per_s": {w: r / 1e9 for w, r in ways.ways.items()},
        "bandwidth_gb_per_s": bandwidth / 1e9, "bandwidth_way": ways.fastest_way,
        "matmul_gflop_per_s": flop_rate / 1e9,
        "ridge_flop_per_byte": flop_rate / bandwidth,
        "weight_bytes": b1_cost.weight_bytes,
        "context": context, "sweep": sweep, "compile_s": compile_s,
        "mbu_b1": {"eager": mbu_eager, "compiled": mbu_compiled},
        "knee": {"measured_fastest": knee_measured, "measured_eager": knee_eager,
                 "roofline": knee_roofline},
        "verify_vs_step": verify, "int8": int8,
        "long_context": {"tokens": long_n, **longc},
        "speculative": spec, "tensor_parallel": tp,
    }
    notes = explain(ratios, measurements)
    print_summary(ratios, measurements, notes)
    data = report("scale", ratios=ratios, measurements=measurements,
                  conditions={"model": name, "device": str(device), "dtype": str(dtype),
                              "config": {k: getattr(cfg, k) for k in (
                                  "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "vocab_size",
                                  "max_position_embeddings")},
                              "prompt_tokens": prompt_len, "steps": n, "repeats": repeats,
                              "rounds": rounds, "rows": list(rows_list), "fastest_path": fast,
                              "k": K, "figures": "meaningless (--quick: tiny random models)"
                              if quick else "timings on this machine; the text is noise"},
                  quick=quick)
    data["notes"] = notes
    write_json(data, json_path)
    return data


# --- what a missed goal's measurements show ------------------------------------------------

def explain(ratios: dict[str, float], m: dict[str, Any]) -> dict[str, str]:
    """For each ratio that misses its goal (:mod:`bench.headlines`), a sentence computed from
    the measurements next to it: what they show, not only the number."""
    from ..headlines import headline
    missed = {name for name, value in ratios.items()
              if (h := headline("scale", name)) is not None and h.goal is not None
              and not h.goal.met(value)}
    notes: dict[str, str] = {}
    bw, ways = m["bandwidth_gb_per_s"], m["read_bandwidth_gb_per_s"]
    sweep = {r["rows"]: r for r in m["sweep"]}
    one = sweep[1]
    if "scale_decode_mbu_b1" in missed:
        rate = one["bytes"] / (one["fastest_ms"] / 1e3) / 1e9
        value = ratios["scale_decode_mbu_b1"]
        if value > 1:
            notes["scale_decode_mbu_b1"] = (
                f"above 1: the step read {rate:.1f} GB/s, faster than every reference way "
                f"({', '.join(f'{w} {r:.1f}' for w, r in ways.items())} GB/s); the references "
                f"were too slow (a busy spell during them), not the step faster than memory")
        else:
            others = ", ".join(f"{w} {r:.1f}" for w, r in ways.items())
            slower = [w for w, r in ways.items() if r < rate]
            notes["scale_decode_mbu_b1"] = (
                f"the batch-1 step ({one['fastest_path']}, {one['fastest_ms']:.1f} ms; eager "
                f"{one['eager_ms']:.1f}, compiled {one['compiled_ms']:.1f}) reads "
                f"{one['bytes'] / 1e6:.0f} MB at {rate:.1f} GB/s against the ways of reading "
                f"a buffer this size ({others} GB/s): "
                + (f"faster than {' and '.join(slower)}, " if slower else "")
                + f"below the best ({m['bandwidth_way']}); at the best way's rate its bytes "
                f"would take {one['memory_bound_ms']:.1f} ms, so "
                f"{one['fastest_ms'] - one['memory_bound_ms']:.1f} ms of the step is not "
                f"reading at that rate: the step's other work (attention, norms, activations "
                f"on the same thread) and its matmul kernels reading below a bare "
                f"reduction's rate (this run does not split the two; a profile would)")
    if "scale_step_rows4_vs_rows1" in missed:
        four = sweep[4]
        roof4 = max(four["memory_bound_ms"], four["compute_bound_ms"])
        roof1 = max(one["memory_bound_ms"], one["compute_bound_ms"])
        compute_bound = four["compute_bound_ms"] > four["memory_bound_ms"]
        why = (f"compute-bound at the measured {m['matmul_gflop_per_s']:.0f} GFLOP/s: four "
               f"rows' FLOPs take longer than the weights' read, so the roofline itself "
               f"predicts more than 1.5x" if compute_bound and roof4 / roof1 > 1.5 else
               f"{'compute' if compute_bound else 'memory'}-bound, so the extra "
               f"{four['fastest_ms'] - max(roof4, one['fastest_ms']):.1f} ms beyond it is "
               f"the kernel's per-row work, not the physics")
        notes["scale_step_rows4_vs_rows1"] = (
            f"4 rows cost {four['fastest_ms']:.1f} ms ({four['fastest_path']}) against "
            f"{one['fastest_ms']:.1f} at 1 row; the roofline says {roof4:.1f} against "
            f"{roof1:.1f} ms ({roof4 / roof1:.2f}x, {why}); eager costs "
            f"{four['eager_ms'] / one['eager_ms']:.2f}x, compiled "
            f"{four['compiled_ms'] / one['compiled_ms']:.2f}x")
    if "scale_knee_measured_vs_predicted" in missed:
        k = m["knee"]
        notes["scale_knee_measured_vs_predicted"] = (
            f"the measured step reaches 1.5x one row at {k['measured_fastest']:.1f} rows "
            f"(eager {k['measured_eager']:.1f}); the roofline from {bw:.1f} GB/s and "
            f"{m['matmul_gflop_per_s']:.0f} GFLOP/s (ridge "
            f"{m['ridge_flop_per_byte']:.1f} FLOP/byte) puts it at {k['roofline']:.1f}: "
            f"small-row matmuls run far below the large-matmul FLOP rate")
    if "scale_knee_measured_vs_predicted" not in ratios:
        notes["scale_knee_measured_vs_predicted"] = (
            f"not a number: the fastest step never reached 1.5x one row up to "
            f"{max(sweep)} rows (the measured knee lies beyond the sweep; the roofline puts "
            f"it at {m['knee']['roofline']:.1f})")
    i8 = m["int8"]
    if "scale_int8_decode_speedup" in missed and "int8_ms" in i8:
        rate = i8["int8_weight_bytes"] / (i8["int8_ms"] / 1e3) / 1e9
        notes["scale_int8_decode_speedup"] = (
            f"int8 weights are {i8['fp32_weight_bytes'] / i8['int8_weight_bytes']:.2f}x fewer "
            f"bytes, but the int8 step ({i8['int8_ms']:.1f} ms against fp32's "
            f"{i8['fp32_ms']:.1f}) reads them at {rate:.1f} GB/s, "
            f"{rate / bw:.2f} of the best read bandwidth: the kernel (dynamic activation "
            f"quantisation, int8 dot products) does not stream at the memory's rate")
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
            f"{sweep[4]['fastest_ms'] / one['fastest_ms']:.2f}x)")
    s = m["speculative"]
    if "scale_spec_measured_vs_predicted" in missed and "measured_speedup" in s:
        notes["scale_spec_measured_vs_predicted"] = (
            f"measured {s['measured_speedup']:.2f}x against {s['predicted_speedup']:.2f}x "
            f"predicted at a = {s['acceptance_prob']:.2f}: a speculative pass as run took "
            f"{s['spec_pass_ms']:.1f} ms against the formula's {s['formula_pass_ms']:.1f} "
            f"({K} draft steps + one verify pass, each timed alone); the difference is what "
            f"the loop pays beyond the passes (prefills, the draft's catch-up, host work)")
    t = m["tensor_parallel"]
    if "scale_tp2_vs_bandwidth_bound" in missed and "tp" in t:
        notes["scale_tp2_vs_bandwidth_bound"] = (
            f"two ranks ran {t['tp']['speedup']:.2f}x one process while two processes read "
            f"{t['bandwidth']['speedup']:.2f}x what one reads alone; "
            f"{t['tp']['allreduce_share']:.0%} of a split step was inside all-reduces "
            f"(waiting included): splitting the bytes can gain at most what the bus adds "
            f"for a second process, and the all-reduces come out of that")
    return {k: v for k, v in notes.items() if v}


def print_summary(ratios: dict[str, float], m: dict[str, Any], notes: dict[str, str]) -> None:
    from ..headlines import headline
    rows = []
    for name, value in ratios.items():
        h = headline("scale", name)
        goal = h.goal.text(h.fmt) if h is not None and h.goal else "-"
        met = "-" if h is None or h.goal is None else ("yes" if h.goal.met(value) else "no")
        rows.append([name, value, goal, met])
    print()
    print(table(["ratio", "value", "goal", "met"], rows))
    for part in ("int8", "speculative", "tensor_parallel"):
        if "skipped" in m[part]:
            print(f"{part}: not measured: {m[part]['skipped']}")
    for name, text in notes.items():
        print(f"note, {name}: {text}")

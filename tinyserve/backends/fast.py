"""The fast path: the fastest way this machine has to run a decode step, a verify pass and a
draft step, said once. The loops take one switch, ``fast=True``, and come here for it; the
eager step is the reference every test compares it with, token for token.

- **On CUDA**: the CUDA graphs already written (:mod:`~tinyserve.backends.cuda_graph` for
  decode steps, :mod:`~tinyserve.backends.spec_graphs` for speculation's passes): a step is
  one replay, so launches no longer set its time.
- **On a CPU**: ``torch.compile`` in max-autotune with inductor *freezing*, each matmul's
  kernel chosen by the autotuner between inductor's C++ GEMM template and ATen's MKL linear
  over weights packed once (:data:`CPU_RECIPE`, :func:`compile_settings`). Freezing turns
  the weights into constants packed once at compile time; eager ``F.linear`` packs them at
  every call. On a 2-core Xeon with a 32 MiB L3 (``bench scale``) this step read at ~0.85 of
  the machine's read bandwidth where eager reached ~0.57 (batch 1, the scale model, one
  thread), and 4 rows cost 1.2-1.5x one row where eager costs 2-2.2x; on a 2-core Xeon with
  a 105 MiB L3, which of the two kernels wins moves with the rows, so the autotuner decides
  on the learner's machine rather than we do once. The mode's options go through
  ``torch.compile(options=...)``, which inductor applies to that compile only; freezing cannot: TorchDynamo reads it from inductor's global
  config while it traces (``torch._dynamo.utils.is_parameter_freezing``), before those
  options apply (given only as options, the compile fails: the C++ GEMM template finds
  unfrozen weights and no choice is left). So :func:`compile_settings` patches it, scoped to
  the one call that compiles (:class:`~tinyserve.backends.compiled.CompiledDecoder`).
  Measured on the shipped target, back to back (load 4-5 on two cores): this compile took
  66 s cold against 61 s with the patch held around the whole compile (mode
  "max-autotune"), a step 0.437 against 0.430 ms, the same 32 greedy tokens as eager.

- **A decode step of several rows** (a batch bucket of :func:`fast_decoder` or the engine's
  :class:`CompiledStep`), once compiled, times itself against the same step run eagerly over
  the weights packed once for oneDNN (:func:`choose_step`) and keeps the faster: past a few
  rows inductor's template can fall well short of the machine's FLOP rate. On a 2-core AMD EPYC
  (the scale model, one thread) 8 rows took 28.5 ms compiled against 17.3 eager and packed,
  16 rows 56.3 against 25.9; at 4 rows the two tied. :func:`prepare` prints the choice.

- **The eager passes** (a prefill, whose rows change with every prompt; the engine's prefill
  and mixed steps) stay eager on both; on a CPU their fp32 linears run on weights packed once
  for oneDNN (:mod:`~tinyserve.backends.packed`, :func:`eager_passes`) from the pass size
  where that measured faster than ``F.linear`` on this machine (:func:`eager_kernels`, once a
  process). On a 2-core AMD EPYC the scale model's 128-token prefill took 79 ms against 162
  (one thread); :func:`prepare` says from which size and packs the weights.

What it costs, and how a run lives with it: each shape is a compile of its own (a batch
bucket x a cache window for decode; one per width for speculation), tens of seconds to
minutes on two cores. :func:`prepare` compiles exactly the shapes a run needs, up front, with
a progress bar, and returns what each took; the compiled kernels go to a persistent folder
(:func:`inductor_cache`: ``<cache>/inductor/torch-<version>-cold``), so a second process
compiles from them. Every step packs its frozen weights (:data:`PREPACK_FROM_ROWS`), which
inductor's whole-graph (FX graph) cache cannot pickle, so a repeat still traces and lowers the
graph and reuses the built C++ kernels and the autotuner's timings. A plain one-row step would
be reloaded whole from that cache, but on one of the course's machines it ran 1.6x slower
(see :data:`PREPACK_FROM_ROWS`): the learner's step time comes first.

Frozen weights are a copy: a decoder is kept per model *and* per weight version (every
parameter's in-place version counter), so changing a weight in place (loading a checkpoint,
fine-tuning) makes the next request compile again instead of reading stale weights.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
import contextlib
from dataclasses import dataclass
import functools
import os
from pathlib import Path
import statistics
import time
from typing import Any
import weakref

import torch
from torch import Tensor

from ..device import interleaved_seconds
from ..model import TinyLlama
from .compiled import MAX_COMPILED_BATCH, CompiledDecoder, compiled_decoder, compiling
from ..paged import PagedKVCache
from .cuda_graph import EngineGraphs, graph_decoder
from .decoder_cache import DecoderCache
from . import packed
from .packed import FLUSH_BYTES
from .spec_graphs import StaticPasses, static_passes
from .static import bucket_for, window_for

__all__ = ["CPU_RECIPE", "DECODE_STEPS", "EAGER_LINEARS", "FASTEST", "INDUCTOR_FOLDER",
           "PACK_LABEL", "PREPACK_FROM_ROWS", "CompiledStep", "FastDecoder", "Recipe", "Shape",
           "ShapeCost", "StepChoice", "choose_step", "cold_benchmarks", "compile_settings",
           "draft_shape", "eager_kernels",
           "eager_passes", "engine_steps", "prepare_eager",
           "fast_decoder", "fast_passes", "inductor_cache", "kind", "prepare", "verify_shape"]

@dataclass(frozen=True)
class Recipe:
    """How the CPU fast path compiles: ``torch.compile``'s ``options`` and whether
    :func:`compile_settings` (freezing, the GEMM choices) is held around the compile;
    ``backend``: torch.compile's (``"eager"`` only traces: the plumbing in seconds).
    ``eager_linears``: what the eager passes' linears run on (the prefill, the engine's mixed
    steps: :func:`eager_passes`): ``"measured"`` (from the pass size where that measured
    faster here, :func:`eager_kernels`),
    ``"packed"`` (oneDNN over weights packed once) or ``"plain"`` (``F.linear``).
    ``decode_steps``: what a decode step of several rows runs (:func:`choose_step`):
    ``"measured"`` (whichever of the two below was faster here, timed once per step shape),
    ``"compiled"`` or ``"packed"`` (the same step run eagerly over the packed weights)."""
    options: tuple[tuple[str, Any], ...]
    freezing: bool
    backend: str = "inductor"
    eager_linears: str = "measured"
    decode_steps: str = "measured"

    def __post_init__(self) -> None:
        if self.eager_linears not in EAGER_LINEARS:
            raise ValueError(f"eager_linears must be one of {', '.join(EAGER_LINEARS)}, "
                             f"not {self.eager_linears!r}")
        if self.decode_steps not in DECODE_STEPS:
            raise ValueError(f"decode_steps must be one of {', '.join(DECODE_STEPS)}, "
                             f"not {self.decode_steps!r}")

    def compile_options(self) -> dict[str, Any] | None:
        return dict(self.options) if self.backend == "inductor" else None


#: What :attr:`Recipe.eager_linears` may be.
EAGER_LINEARS = ("measured", "packed", "plain")
#: What :attr:`Recipe.decode_steps` may be.
DECODE_STEPS = ("measured", "compiled", "packed")

#: The fastest CPU step: mode "max-autotune" spelled as its options (``torch.compile`` takes
#: a mode or options, not both; the mode's third, ``triton.cudagraphs``, is CUDA's), with
#: freezing and the GEMM kernel of each matmul autotuned (the C++ template or MKL's).
FASTEST = Recipe((("max_autotune", True), ("coordinate_descent_tuning", True)), freezing=True)
#: What the CPU fast path compiles with: :data:`FASTEST`. The one knob: a test may set a
#: cheaper recipe here (``Recipe((), False, "eager")``: traced, not compiled, seconds instead
#: of minutes per shape) to check the loops' plumbing; one test keeps the real one.
CPU_RECIPE: Recipe = FASTEST


def kind(device: torch.device) -> str:
    """What ``fast=True`` runs on ``device``: ``"graph"`` (CUDA) or ``"compile"``."""
    return "graph" if device.type == "cuda" else "compile"


def compile_settings(freezing: bool = False, rows: int | None = None):
    """Inductor's settings for a compiled step, as a context manager (for callers that pass a
    ``mode``, which excludes ``options``; the loops pass :data:`CPU_RECIPE` instead). With
    ``freezing`` the weights become constants, packed once at compile time, and
    max-autotune's GEMM choices are inductor's C++ template and ATen's MKL linear over the
    packed weights (``_mkl_linear``), nothing else (Triton is a GPU backend). ``rows``: how
    many rows each matmul of the step serves (a decode bucket, a pass's width); below
    :data:`PREPACK_FROM_ROWS` the weights would stay plain (see there: today none does).

    Why both, measured: on the machine the course was first timed on (2-core Xeon, 32 MiB L3)
    the autotuner picked the template at every linear of the scale model (e.g. 1.5 against
    17.5 ms at 4 rows); on a 2-core Xeon with a 105 MiB L3 (load 1-2, one thread, the scale
    model, fastest of 12 interleaved steps) the template alone gave 78 ms at 1 row and 101 ms
    at 4 rows, both choices 71 and 86-90 ms (eager 59-72 and 176-184). Benchmarking two
    choices makes a first compile slower (here 39-51 s against 18-24 s), but its timings are
    kept on disk with the kernels: a repeat took 19 s.

    The autotuner times each choice with the caches flushed first (:func:`cold_benchmarks`):
    its own CPU loop times a kernel over and over, so a 25 MB weight sits in a 105 MiB L3
    while it is timed, where a decode step streams every weight from memory."""
    import torch._inductor.config as inductor_config
    if not freezing:
        return inductor_config.patch(freezing=False)
    # The autotuner reports its benchmarks on stderr (a table of choices, a JSON line per
    # matmul): noise in a notebook's output. Off where this torch has the settings.
    quiet = {k: v for k, v in (("max_autotune_report_choices_stats", False),
                               ("autotune_num_choices_displayed", 0))
             if hasattr(inductor_config, k)}
    prepack = rows is None or rows >= PREPACK_FROM_ROWS
    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch({"freezing": True, "cpp.weight_prepack": prepack,
                                               "max_autotune_gemm_backends": "CPP,ATEN",
                                               **quiet}))
    stack.enter_context(cold_benchmarks())
    return stack


#: The fewest rows a compiled step's matmuls serve for which freezing packs the weights for
#: MKL's linear (inductor's ``cpp.weight_prepack``); below it they stay plain and ATen's choice
#: is the plain ``mm``. 1: every step packs, and the autotuner chooses between MKL's packed
#: linear and inductor's C++ template on the learner's machine. Measured on the scale model's
#: batch-1 step, one thread: on a 2-core Xeon with AMX a plain step took 0.96x the packed one's
#: time (11 rounds in turns: 0.86-1.07) and, being picklable, reloaded from inductor's FX graph
#: cache in 7.5-8.4 s against 20-21 s packed (the packed weights are ``mkldnn`` tensors:
#: "Bypassing FX Graph Cache because 'mkldnn tensors unpickleable'"); on a 2-core AMD EPYC
#: (32 MiB L3) the plain step took 15.8-16.1 ms against 9.7-10.2 packed (two processes each,
#: alternating), its matmul reading at 0.5 of the memory's rate. Several rows pay on both: a
#: 5-token verify pass took 1.76x as long plain on the Xeon.
PREPACK_FROM_ROWS = 1

#: Timed calls per choice (the median is kept), each after a flush.
COLD_REPEATS = 7


@contextlib.contextmanager
def cold_benchmarks() -> Iterator[None]:
    """While held, inductor's autotuner times a CPU kernel as a decode step runs it: the
    caches flushed (:data:`FLUSH_BYTES` written) before each of :data:`COLD_REPEATS` timed
    calls, the median kept. Inductor's own CPU loop (``benchmarker.benchmark_cpu``) repeats
    the call back to back, so it times a weight the last-level cache already holds.

    Measured on the scale model, batch 1, one thread, a 2-core Xeon with a 105 MiB L3, a fresh
    cache folder each compile (two compiles each way): timed hot, the autotuner chose the C++
    template for 6-7 of the step's 21 matmuls and the step took 74-81 ms; timed cold, MKL's
    linear for 20-21 of them and 67-73 ms. Through :func:`fast_decoder` afterwards (one
    compile each): batch 1 took MKL's for 16 of 21 (82.8 ms, eager 84.5), 4 rows for all 21
    (94.8 ms, eager 197). What it costs: a flush takes ~40 ms here; compiling the batch-1 step
    timed 12 choices, 3.8-4.7 s in all (inductor's loop spends ~0.12 s a choice), within the
    noise of the whole compile (fresh cache folder, back to back: 98 s timed cold, 109 s hot).
    A torch without that benchmarker keeps its own."""
    try:
        from torch._inductor.runtime.benchmarking import benchmarker
    except ImportError:
        yield
        return
    if not hasattr(benchmarker, "benchmark_cpu"):
        yield
        return
    # A normal tensor even when the compile starts inside inference mode (a speculative
    # graph's first pass): the autotuner may time outside it, where an inference tensor
    # cannot be written.
    with torch.inference_mode(False):
        flush = torch.empty(FLUSH_BYTES // 4)

    def timed(fn: Callable[[], Any], *_: Any, **__: Any) -> float:
        fn()                                   # the first call pays for anything lazy
        seconds = []
        for _ in range(COLD_REPEATS):
            flush.fill_(1.0)                   # evicts the weights the last call read
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        return 1e3 * statistics.median(seconds)
    held = vars(benchmarker).get("benchmark_cpu")
    benchmarker.benchmark_cpu = timed          # the instance's, shadowing its class's
    try:
        yield
    finally:
        if held is None:
            del benchmarker.benchmark_cpu
        else:
            benchmarker.benchmark_cpu = held


#: The folder under ``<cache>/inductor`` for this torch and this way of autotuning:
#: inductor's autotune cache keys each matmul's timings by the shapes and choices alone, so
#: timings taken hot (before :func:`cold_benchmarks`) would be read back as they were.
INDUCTOR_FOLDER = f"torch-{torch.__version__}-cold"


def inductor_cache(root: Path | None) -> Path | None:
    """Send inductor's on-disk cache to ``root/inductor/`` :data:`INDUCTOR_FOLDER` (made if
    missing) and return it: kernels built, and choices timed, by one torch and one way of
    timing are never read by another. A
    ``TORCHINDUCTOR_CACHE_DIR`` the user set wins (returned as is). Called before the first
    fast compile, never at import; ``root=None`` leaves inductor's default."""
    if root is None:
        return None
    set_by_user = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if set_by_user and not _inductor_default(set_by_user):
        return Path(set_by_user)
    folder = Path(root) / "inductor" / INDUCTOR_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def _inductor_default(folder: str) -> bool:
    """Whether ``folder`` is inductor's own default: inductor writes it into the variable at
    its first compile, so finding it there does not mean a user chose it."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:   # an older torch (the floor is 2.5): its default is left as it is
        return False
    return os.path.abspath(folder) == os.path.abspath(default_cache_dir())


def _weights_version(model: TinyLlama) -> int:
    """Changes whenever a weight is changed in place (its version counter): parameters, and
    buffers, where an int8 model keeps its weights and scales (:mod:`tinyserve.quant`)."""
    return sum(t._version for t in (*model.parameters(), *model.buffers()))


def fast_decoder(model: TinyLlama, batch: int, tokens: int, *,
                 cache: Path | None = None) -> CompiledDecoder:
    """The CPU fast path's decode step for ``batch`` rows (padded to a bucket) of up to
    ``tokens`` positions: a :class:`~tinyserve.backends.compiled.CompiledDecoder` compiled
    with :data:`CPU_RECIPE`, kept and reused (compiled on its first step); ``cache``: the
    persistent folder (:func:`inductor_cache`). On CUDA the loops use the graphs instead."""
    inductor_cache(cache)
    recipe = CPU_RECIPE
    rows = bucket_for(batch, MAX_COMPILED_BATCH)
    return compiled_decoder(model, batch, backend=recipe.backend, tokens=tokens,
                            options=recipe.compile_options(), settings=_settings(recipe, rows),
                            tag=("fast", recipe, _weights_version(model)), kind=FastDecoder)


class FastDecoder(CompiledDecoder):
    """A :class:`~tinyserve.backends.compiled.CompiledDecoder` whose first step, once compiled,
    also decides what the later ones run (:func:`choose_step`, kept in :attr:`choice`): the
    compiled step, or the same forward pass eagerly over the packed weights."""

    choice: "StepChoice | None" = None

    @torch.no_grad()
    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        if self.choice is None:
            logits = super().step(tokens, positions)          # compiles
            t, p = tokens.clone(), positions.clone()
            # Both run the step just run again, on the same inputs: the same keys and values
            # land in the same slots, so timing them leaves the cache as it was.
            self.choice = choose_step(self.model, self.cache.batch_size,
                                      lambda: CompiledDecoder.step(self, t, p),
                                      lambda: self._forward(t, p), CPU_RECIPE.decode_steps)
            return logits
        return self.choice.run(self.model, lambda: CompiledDecoder.step(self, tokens, positions),
                               lambda: self._forward(tokens, positions))


def _settings(recipe: Recipe, rows: int):
    """What to hold around compiling a step whose matmuls serve ``rows`` rows:
    :func:`compile_settings` (freezing) or None."""
    return functools.partial(compile_settings, True, rows) if recipe.freezing else None


# ------------------------------------------------------------------ the eager passes

#: The measured pass sizes for each model shape (:func:`eager_kernels`), once a process.
_EAGER_KERNELS: dict[tuple, packed.PassTimes] = {}
#: Each model's :class:`~tinyserve.backends.packed.PackedLinears`: its packed copies are
#: kept from one request's prefill to the next.
_PACKED_MODES: "weakref.WeakKeyDictionary[TinyLlama, packed.PackedLinears]" = \
    weakref.WeakKeyDictionary()


def _packs(model: TinyLlama) -> bool:
    """Whether ``model``'s eager passes can run on packed copies at all: fp32 on a CPU whose
    torch has oneDNN's linear, and no int8 layer (those make a float weight per call:
    nothing to pack once)."""
    return (model.device.type == "cpu" and model.dtype == torch.float32 and packed.available()
            and not any(b.dtype == torch.int8 for b in model.buffers()))


def _mode(model: TinyLlama) -> packed.PackedLinears:
    mode = _PACKED_MODES.get(model)
    if mode is None:
        mode = _PACKED_MODES[model] = packed.PackedLinears()
    return mode


def eager_kernels(model: TinyLlama, cache: Path | None = None) -> packed.PassTimes:
    """``model``'s eager pass timed plain and on packed weights at
    :data:`~tinyserve.backends.packed.PROBE_ROWS` tokens (:func:`tinyserve.backends.packed.
    measure`, caches flushed: a second or so on the scale model), once per model shape and
    thread count: kept in this process, and in ``cache``'s kernel folder
    (:func:`inductor_cache`: per torch version) for the next; its ``from_rows`` is where the
    packed pass starts to win."""
    cfg = model.config
    key = (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size,
           model.dtype, torch.get_num_threads())
    if key not in _EAGER_KERNELS:
        _EAGER_KERNELS[key] = packed.measure_kept(model, inductor_cache(cache),
                                                  mode=_mode(model))
        if _EAGER_KERNELS[key].from_rows is None:
            _PACKED_MODES.pop(model, None)         # never used: its copies go
    return _EAGER_KERNELS[key]


def eager_passes(model: TinyLlama, tokens: int, *,
                 cache: Path | None = None) -> contextlib.AbstractContextManager:
    """What the loops hold around an eager pass of ``tokens`` tokens on the fast path (a
    prefill; the engine's prefill and mixed steps): on a CPU,
    :class:`~tinyserve.backends.packed.PackedLinears` where :data:`CPU_RECIPE` says so (by
    default: from the pass size where it measured faster, :func:`eager_kernels`), else
    nothing. On CUDA, for bf16 models and int8 ones: nothing. ``cache``: where the
    measurement is kept (:func:`eager_kernels`)."""
    choice = CPU_RECIPE.eager_linears
    if not _packs(model) or choice == "plain":
        return contextlib.nullcontext()
    if choice == "measured":
        start = eager_kernels(model, cache).from_rows
        if start is None or tokens < start:
            return contextlib.nullcontext()
    return _mode(model)


#: The label of the packing step in :func:`prepare`'s costs.
PACK_LABEL = "prefill weights packed for oneDNN"


@torch.inference_mode()
def prepare_eager(model: TinyLlama, *, say: Callable[[str], None] | None = None,
                  cache: Path | None = None) -> ShapeCost | None:
    """Before the first request: measure the eager passes both ways (the recipe's
    ``"measured"``, once a process: it packs the weights as it times them), ``say`` from
    which pass size the packed one won, and where it did at all, pack the weights a prefill
    reads (a two-token pass: every layer's projections; the last layer's MLP and the LM head
    serve one row a prompt, so they stay plain). Returns what that cost (None where nothing
    is packed here). ``cache``: where the measurement is kept (:func:`eager_kernels`)."""
    if not _packs(model) or CPU_RECIPE.eager_linears == "plain":
        return None
    start = time.perf_counter()
    mode = _mode(model)
    held = mode.packed
    if CPU_RECIPE.eager_linears == "measured":
        measured = eager_kernels(model, cache)
        if say is not None:
            say(measured.sentence())
        if measured.from_rows is None:
            return None
    with mode:
        model(torch.full((1, 2), model.config.pad_token_id, device=model.device),
              logits_at=torch.tensor([1], device=model.device))
    fresh = mode.packed > held
    return ShapeCost(PACK_LABEL, time.perf_counter() - start if fresh else 0.0, fresh)


@dataclass(frozen=True)
class StepChoice:
    """What a decode step of ``rows`` rows runs on the fast path (``kernel``: ``"compiled"``
    or ``"packed"``) and, where both were timed, each one's seconds (the fastest of
    :data:`CHOICE_RUNS`)."""
    rows: int
    kernel: str
    compiled_s: float | None = None
    packed_s: float | None = None

    def run(self, model: TinyLlama, compiled: Callable[[], Any], eager: Callable[[], Any]) -> Any:
        """The step as chosen: ``compiled()``, or ``eager()`` over ``model``'s packed weights."""
        if self.kernel == "packed":
            with _mode(model):
                return eager()
        return compiled()

    def sentence(self) -> str:
        what = ("compiled" if self.kernel == "compiled"
                else "eager over weights packed once for oneDNN")
        if self.compiled_s is None or self.packed_s is None:
            return what
        return (f"{what}: {self.rows} rows took {self.packed_s * 1e3:.1f} ms eager and packed "
                f"against {self.compiled_s * 1e3:.1f} ms compiled")


#: Runs of each way a decode step's choice is timed over, in turns (the fastest kept).
CHOICE_RUNS = 3


def choose_step(model: TinyLlama, rows: int, compiled: Callable[[], Any],
                eager: Callable[[], Any], how: str) -> StepChoice:
    """What a decode step of ``rows`` rows runs from now on: ``compiled`` (the step just
    compiled) or ``eager`` (the same forward pass) run over the weights packed once for oneDNN
    (:class:`~tinyserve.backends.packed.PackedLinears`, shared with the prefills), as ``how``
    (:attr:`Recipe.decode_steps`) says; ``"measured"`` times both back to back, as a loop runs
    them, in turns, and keeps the faster. One row, or a model whose linears cannot be packed
    (:func:`_packs`), stays compiled: the packed linear is for two rows or more.

    Why: the compiled step's matmuls are inductor's C++ template (or MKL's), chosen by the
    autotuner, and past a few rows the template's kernel can fall well short of the machine's
    FLOP rate. Measured on a 2-core AMD EPYC, one thread, the scale model: 4 rows 13.3 ms
    compiled against 13.4 eager and packed, 8 rows 28.5 against 17.3, 16 rows 56.3 against
    25.9 (plain eager 35.0, 41.4, 59.6)."""
    if how not in DECODE_STEPS:
        raise ValueError(f"how must be one of {', '.join(DECODE_STEPS)}, not {how!r}")
    if rows < 2 or not _packs(model) or how == "compiled":
        return StepChoice(rows, "compiled")
    mode = _mode(model)

    def packed_step() -> None:
        with mode:
            eager()
    if how == "packed":
        return StepChoice(rows, "packed")
    # The untimed first call packs any weight not packed yet; no flush: as a loop runs steps.
    runs = interleaved_seconds({"compiled": compiled, "packed": packed_step}, model.device,
                               CHOICE_RUNS)
    best = {name: min(seconds) for name, seconds in runs.items()}
    kernel = "packed" if best["packed"] < best["compiled"] else "compiled"
    return StepChoice(rows, kernel, best["compiled"], best["packed"])


class CompiledStep:
    """One of the engine's decode steps (:class:`~tinyserve.backends.cuda_graph.EngineGraphs`:
    one batch bucket of ``rows`` x blocks per row, on the paged pool's static buffers)
    compiled with ``recipe``, where a CUDA graph would be captured: :meth:`replay` runs it,
    the first call compiling (``compile_seconds``) and then choosing what the later calls
    run (:func:`choose_step`: the compiled step, or ``step`` eagerly over the packed
    weights; :attr:`choice`)."""

    def __init__(self, step: Callable[[], Tensor], rows: int, recipe: Recipe,
                 model: TinyLlama) -> None:
        self._eager, self._rows, self._model, self._how = step, rows, model, recipe.decode_steps
        self._step = torch.compile(step, backend=recipe.backend,
                                   options=recipe.compile_options(), fullgraph=True,
                                   dynamic=False)
        self._settings = _settings(recipe, rows)
        self.compile_seconds: float | None = None
        self.choice: StepChoice | None = None

    def replay(self) -> None:
        if self.choice is not None:
            self.choice.run(self._model, self._step, self._eager)
            return
        start = time.perf_counter()
        with compiling(self._settings):      # freezing is read while tracing (see the module)
            self._step()
        self.compile_seconds = time.perf_counter() - start
        # The step reads the buffers its caller filled and writes the same slots each time:
        # running it again to time it leaves the pool as it was.
        self.choice = choose_step(self._model, self._rows, self._step, self._eager, self._how)

    @property
    def note(self) -> str:
        """What this step runs, in words (once it has run)."""
        return "" if self.choice is None else self.choice.sentence()


#: How many engines' compiled decode steps are kept (each with its paged pool) for the next
#: engine made with the same sizes (see :func:`engine_steps`).
MAX_ENGINE_STEPS = 2
_ENGINE_STEPS: DecoderCache[EngineGraphs] = DecoderCache(MAX_ENGINE_STEPS)


def engine_steps(model: TinyLlama, num_blocks: int, block_size: int, max_rows: int, *,
                 cache: Path | None = None) -> EngineGraphs:
    """The engine's pure-decode steps on a CPU for ``fast=True``: a paged pool of
    ``num_blocks`` blocks (plus the scratch block) and :class:`~tinyserve.backends.cuda_graph.
    EngineGraphs` whose every shape is compiled with :data:`CPU_RECIPE` (read now), its
    kernels kept in ``cache`` (:func:`inductor_cache`). Kept for the next engine of the same
    model and sizes, as the loops keep their decoders: a compiled step reads the pool's
    tensors and its own buffers, never a request's state, so a new engine (a fresh block
    manager over the same pool) reuses every shape compiled so far instead of compiling
    them again. In use (``in_use``) until its engine is gone; then the next may take it."""
    inductor_cache(cache)
    recipe = CPU_RECIPE

    def make() -> EngineGraphs:
        pool = PagedKVCache(model.config, num_blocks, block_size, device=model.device,
                            dtype=model.dtype, scratch=True)
        return EngineGraphs(model, pool, max_rows, capture=False,
                            compiler=functools.partial(CompiledStep, recipe=recipe, model=model))
    key = (num_blocks, block_size, max_rows, recipe, model.device, model.dtype)
    steps = _ENGINE_STEPS.get(model, key, make)
    steps.in_use, steps.checked = True, False   # the first step checks the weights
    return steps


class CompiledPasses(StaticPasses):
    """:class:`~tinyserve.backends.spec_graphs.StaticPasses` whose every width's pass is
    compiled (the CPU fast path) instead of captured: the same static buffers, the same
    forward pass, one compiled function per width, each compiled on its first call."""

    def __init__(self, model: TinyLlama, window: int, widths: Sequence[int],
                 recipe: Recipe) -> None:
        super().__init__(model, window, widths, capture=False)
        self._compiled = {w: torch.compile(functools.partial(StaticPasses._forward, self, w),
                                           backend=recipe.backend,
                                           options=recipe.compile_options(), fullgraph=True,
                                           dynamic=False)
                          for w in self.widths}
        self._settings = {w: _settings(recipe, w) for w in self.widths}
        #: Seconds each width's first pass took (its compile, unless found on disk).
        self.compile_seconds: dict[int, float] = {}

    def _forward(self, w: int) -> Tensor:
        if w in self.compile_seconds:
            return self._compiled[w]()
        start = time.perf_counter()
        with compiling(self._settings[w]):   # freezing is read while tracing (see the module)
            out = self._compiled[w]()
        self.compile_seconds[w] = time.perf_counter() - start
        return out


#: How many compiled pass sets are kept (see :mod:`tinyserve.backends.decoder_cache`).
MAX_PASSES = 4
_PASSES: DecoderCache[CompiledPasses] = DecoderCache(MAX_PASSES)


def fast_passes(model: TinyLlama, tokens: int, widths: Iterable[int], *,
                cache: Path | None = None) -> StaticPasses:
    """One row's passes of ``widths`` on static buffers holding ``tokens`` positions, on the
    fast path: the CUDA graphs on CUDA, compiled with :data:`CPU_RECIPE` elsewhere. Marked
    in use until :meth:`~tinyserve.backends.spec_graphs.StaticPasses.release`."""
    widths = tuple(sorted(set(widths)))
    if model.device.type == "cuda":
        return static_passes(model, tokens, widths)
    inductor_cache(cache)
    window = window_for(tokens, model.config.max_position_embeddings)
    recipe = CPU_RECIPE
    key = (window, widths, recipe, _weights_version(model))
    passes = _PASSES.get(model, key, lambda: CompiledPasses(model, window, widths, recipe))
    passes.in_use = True
    return passes


# ------------------------------------------------------------------ preparing up front

@dataclass(frozen=True)
class Shape:
    """One thing a run compiles: the decode step of ``batch`` rows (padded to a bucket), or,
    given ``widths``, one row's passes of those widths (speculation: the target's verify
    passes 1..k+1, the draft's steps 1 and 2); ``tokens``: positions per row a request needs
    (prompt + output), the cache's window that rounded up to a power of two."""
    tokens: int
    batch: int = 1
    widths: tuple[int, ...] = ()


@dataclass(frozen=True)
class ShapeCost:
    """What preparing one compiled function cost: ``seconds`` (0 when this process already
    held it: ``compiled`` False). A repeat in a new process reads the kernels from the
    persistent cache: compare its seconds with the first process's."""
    label: str
    seconds: float
    compiled: bool


def verify_shape(k: int, tokens: int) -> Shape:
    """The target's passes for speculation with ``k`` drafts a step: widths 1..k + 1."""
    return Shape(tokens, widths=tuple(range(1, k + 2)))


def draft_shape(tokens: int) -> Shape:
    """The draft model's passes: its one-token steps and the catch-up of 1 or 2 tokens."""
    return Shape(tokens, widths=(1, 2))


@torch.no_grad()
def prepare(model: TinyLlama, shapes: Iterable[Shape], *, progress: bool = True,
            cache: Path | None = None) -> list[ShapeCost]:
    """Compile (on CUDA: capture) every shape in ``shapes`` not yet held, showing a progress
    bar (tqdm) and a line per shape with its seconds; return those costs, one per compiled
    function (a decode bucket, or one pass width). ``cache``: the persistent folder."""
    from tqdm.auto import tqdm
    shapes = list(dict.fromkeys(shapes))
    units = sum(len(s.widths) or 1 for s in shapes)
    costs: list[ShapeCost] = []
    with tqdm(total=units, desc="preparing the fast path", unit="shape",
              disable=not progress) as bar:
        for shape in shapes:
            for label, seconds, fresh, note in _prepare_one(model, shape, cache):
                costs.append(ShapeCost(label, seconds, fresh))
                if progress:
                    bar.write(f"{label}: {seconds:.1f} s" + ("" if fresh else " (held)")
                              + (f"; {note}" if note else ""))
                bar.update()
        packing = prepare_eager(model, say=bar.write if progress else None, cache=cache)
    if packing is not None:
        costs.append(packing)
        if progress:
            print(f"{packing.label}: {packing.seconds:.1f} s"
                  + ("" if packing.compiled else " (held)"))
    return costs


def _prepare_one(model: TinyLlama, shape: Shape, cache: Path | None):
    """Yield (label, seconds, compiled, note) for each function of ``shape``, compiling it by
    running it once on a dummy token at position 0 (the next request's prefill writes over
    that slot before anything reads it); ``note``: what a batched decode step chose to run
    (:func:`choose_step`), else empty."""
    window = window_for(shape.tokens, model.config.max_position_embeddings)
    device, pad = model.device, model.config.pad_token_id
    if not shape.widths:
        label = f"decode batch {shape.batch} x window {window}"
        if device.type == "cuda":
            decoder = graph_decoder(model, shape.batch, tokens=shape.tokens)
            fresh = decoder.graph is None
            start = time.perf_counter()
            decoder.prefill(torch.full((1, 1), pad, device=device), [1])   # captures
            decoder.release()
            yield label, time.perf_counter() - start if fresh else 0.0, fresh, ""
            return
        step = fast_decoder(model, shape.batch, shape.tokens, cache=cache)
        fresh = step.compile_seconds is None
        if fresh:
            B = step.cache.batch_size
            step.step(torch.full((B,), pad, device=device), torch.zeros(B, dtype=torch.long))
        note = step.choice.sentence() if step.choice is not None and shape.batch > 1 else ""
        yield label, float(step.compile_seconds) if fresh else 0.0, fresh, note
        return
    passes = fast_passes(model, shape.tokens, shape.widths, cache=cache)
    try:
        if device.type == "cuda":
            fresh = not passes.graphs
            passes.reset()                                 # captures every width
            each = (passes.capture_seconds or 0.0) / len(passes.widths) if fresh else 0.0
            for w in passes.widths:
                yield f"pass width {w} x window {window}", each, fresh, ""
            return
        for w in passes.widths:
            fresh = w not in passes.compile_seconds
            if fresh:
                passes.reset()
                passes.feed(torch.full((1, w), pad, device=device))
                passes.rewind(0)
            yield (f"pass width {w} x window {window}",
                   passes.compile_seconds[w] if fresh else 0.0, fresh, "")
    finally:
        passes.release()

"""The fast path: the fastest way this machine has to run a decode step, a verify pass and a
draft step, said once. The loops take one switch, ``path="fast"`` (:mod:`tinyserve.step_path`), and come here for it; the
eager step is the reference every test compares it with, token for token, and the floor no
fast step may fall below.

- **On CUDA**: the CUDA graphs already written (:mod:`~tinyserve.backends.cuda_graph` for
  decode steps, :mod:`~tinyserve.backends.spec_graphs` for speculation's passes): a step is
  one replay, so launches no longer set its time. No compiler is involved.
- **On a CPU**: each step's shape runs the fastest of three ways, measured on this machine
  (:mod:`~tinyserve.backends.choices`): ``torch.compile`` in max-autotune with inductor
  *freezing* (:data:`CPU_RECIPE`, :func:`compile_settings`: each matmul's kernel chosen by the
  autotuner between inductor's C++ GEMM template and MKL's linear over weights packed once),
  the same forward pass eagerly over weights packed once for oneDNN, or plain eager. Which
  wins depends on the CPU (vector width, BLAS, caches) and the rows: on some CPUs the
  compiled one-row step beats eager, on others it loses, so each shape is timed in turns once
  and the choice is kept on disk with the kernels. A shape whose kept choice is not the
  compiled step is never compiled again.
- **Where nothing can compile** (no C++ compiler, no OpenMP, no Python headers, a lowering
  error): :mod:`~tinyserve.toolchain` finds it once a process, before the first real
  compile; every step then runs eagerly and one line says why and how to fix it.

Freezing, and why it is patched: the mode's options go through ``torch.compile(options=...)``,
which inductor applies to that compile only; freezing cannot: TorchDynamo reads it from
inductor's global config while it traces (``torch._dynamo.utils.is_parameter_freezing``),
before those options apply (given only as options, the compile fails: the C++ GEMM template
finds unfrozen weights and no choice is left). So :func:`compile_settings` patches it, scoped
to the one call that compiles (:class:`~tinyserve.backends.compiled.CompiledDecoder`).

**The eager passes** (a prefill, whose rows change with every prompt; the engine's prefill and
mixed steps) stay eager; on a CPU their fp32 linears run on weights packed once for oneDNN
(:mod:`~tinyserve.backends.packed`, :func:`eager_passes`) from the pass size where that
measured faster than ``F.linear`` on this machine (:func:`eager_kernels`, once a process).

What it costs, and how a run lives with it: each compiled shape is a compile of its own (a
batch bucket x a cache window for decode; one per width for speculation), tens of seconds to
minutes on two cores. :func:`prepare` makes exactly the shapes a run needs ready, up front,
with a progress bar and a line per shape saying what it runs and the times that chose it; the
compiled kernels go to a persistent folder (:func:`inductor_cache`:
``<cache>/inductor/torch-<version>-cold``), so a second process compiles from them. Every
compiled step packs its frozen weights (:data:`PREPACK_FROM_ROWS`), which inductor's
whole-graph (FX graph) cache cannot pickle, so a repeat still traces and lowers the graph and
reuses the built C++ kernels and the autotuner's timings. ``bench scale`` measures all of it
(``scale_fast_vs_eager_b1``, ``scale_prepare_repeat_s``).

Frozen weights are a copy: a decoder is kept per model *and* per weight version (every
parameter's in-place version counter), so changing a weight in place (loading a checkpoint,
fine-tuning) makes the next request compile again instead of reading stale weights.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
import contextlib
from dataclasses import dataclass
import functools
from pathlib import Path
import statistics
import time
from typing import Any
import weakref

import torch
from torch import Tensor

from ..device import interleaved_seconds
from ..model import TinyLlama
from .choices import WAYS, ChoiceBook, StepChoice, choose, shape_key
from .compiled import (INDUCTOR_FOLDER, MAX_COMPILED_BATCH, CompiledDecoder,
                       compiled_decoder, compiling, inductor_cache)
from ..paged import PagedKVCache
from .cuda_graph import EngineGraphs, graph_decoder
from .decoder_cache import DecoderCache
from . import packed
from .packed import FLUSH_BYTES
from .spec_graphs import StaticPasses, static_passes
from .static import bucket_for, window_for
from .waits import CompileTimes, shown, waiting
from .. import toolchain

__all__ = ["CPU_RECIPE", "DECODE_STEPS", "EAGER_LINEARS", "FASTEST", "INDUCTOR_FOLDER",
           "PACK_LABEL", "PREPACK_FROM_ROWS", "CompiledStep", "FastDecoder", "Recipe", "Shape",
           "ShapeCost", "StepChoice", "choose_step", "cold_benchmarks", "compile_settings",
           "draft_shape", "eager_kernels", "first_step", "step_ways",
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
    ``decode_steps``: what a fast step runs (:func:`choose_step`): ``"measured"`` (the
    fastest of the ways this machine has, timed once per step shape and kept on disk),
    ``"compiled"``, ``"packed"`` (the same step run eagerly over the packed weights, two rows
    or more) or ``"eager"`` (the plain forward pass)."""
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
DECODE_STEPS = ("measured", *WAYS)

#: The fastest CPU step: mode "max-autotune" spelled as its options (``torch.compile`` takes
#: a mode or options, not both; the mode's third, ``triton.cudagraphs``, is CUDA's), with
#: freezing and the GEMM kernel of each matmul autotuned (the C++ template or MKL's).
FASTEST = Recipe((("max_autotune", True), ("coordinate_descent_tuning", True)), freezing=True)
#: What the CPU fast path compiles with: :data:`FASTEST`. The one knob: a test may set a
#: cheaper recipe here (``Recipe((), False, "eager")``: traced, not compiled, seconds instead
#: of minutes per shape) to check the loops' plumbing; one test keeps the real one.
CPU_RECIPE: Recipe = FASTEST


def kind(device: torch.device) -> str:
    """What ``path="fast"`` runs on ``device``: ``"graph"`` (CUDA) or ``"compile"``."""
    return "graph" if device.type == "cuda" else "compile"


def compile_settings(freezing: bool = False, rows: int | None = None, *,
                     weights: str | None = None):
    """Inductor's settings for a compiled step, as a context manager (for callers that pass a
    ``mode``, which excludes ``options``; the loops pass :data:`CPU_RECIPE` instead). With
    ``freezing`` the weights become constants, packed once at compile time, and
    max-autotune's GEMM choices are inductor's C++ template and ATen's MKL linear over the
    packed weights (``_mkl_linear``), nothing else (Triton is a GPU backend). ``rows``: how
    many rows each matmul of the step serves (a decode bucket, a pass's width); below
    :data:`PREPACK_FROM_ROWS` the weights would stay plain (see there: today none does).

    Why both: which of the two kernels is faster depends on the CPU and the rows, so the
    autotuner times them on the learner's machine rather than we choose once. Benchmarking
    two choices makes a first compile slower, but its timings are kept on disk with the
    kernels, so a repeat is faster (``bench scale``: ``scale_prepare_repeat_s``).

    The autotuner times each choice with the caches flushed first (:func:`cold_benchmarks`):
    its own CPU loop times a kernel over and over, so a weight that fits the last-level cache
    sits there while it is timed, where a decode step streams every weight from memory."""
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
    if weights is not None:
        stack.enter_context(_cache_key(weights))
    return stack


def _cache_key(weights: str) -> contextlib.AbstractContextManager:
    """Put ``weights`` (:func:`weights_digest`) into inductor's FX graph cache key while a
    frozen step compiles. With freezing, the cache keeps frozen parameters by name but every
    other constant by value (pytorch/pytorch#143808), and lowering adds constants made from
    the weights (pytorch/pytorch#143144: the C++ GEMM template's): seen here on a torch
    without MKL (``tests/test_toolchain.py``), a second model of the same shapes hit the
    first one's entry and ran with its weights, as would a model whose weights changed. With
    MKL the frozen weights are ``mkldnn`` tensors, which the cache cannot pickle, so it is
    bypassed. A torch without the key's tag has the cache turned off for the compile."""
    import torch.compiler.config as compiler_config
    if hasattr(compiler_config, "cache_key_tag"):
        tag = f"{compiler_config.cache_key_tag}|tinyserve-weights-{weights}"
        return compiler_config.patch(cache_key_tag=tag)
    import torch._inductor.config as inductor_config
    return inductor_config.patch(fx_graph_cache=False)


#: Each model's weights digest, with the weight version it was taken at.
_DIGESTS: "weakref.WeakKeyDictionary[TinyLlama, tuple[int, str]]" = weakref.WeakKeyDictionary()


def weights_digest(model: TinyLlama) -> str:
    """A digest of every parameter's and buffer's values (BLAKE2b over their bytes), kept per
    model until a weight changes in place (:func:`_weights_version`)."""
    import hashlib
    version = _weights_version(model)
    held = _DIGESTS.get(model)
    if held is not None and held[0] == version:
        return held[1]
    digest = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            digest.update(str((tuple(t.shape), t.dtype)).encode())
            digest.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    _DIGESTS[model] = (version, digest.hexdigest())
    return _DIGESTS[model][1]


#: The fewest rows a compiled step's matmuls serve for which freezing packs the weights for
#: MKL's linear (inductor's ``cpp.weight_prepack``); below it they stay plain and ATen's choice
#: is the plain ``mm``. 1: every step packs, and the autotuner chooses between MKL's packed
#: linear and inductor's C++ template on the learner's machine. The trade-off: a plain step
#: pickles, so inductor's FX graph cache reloads it whole in a second process, while packed
#: weights are ``mkldnn`` tensors it cannot pickle ("Bypassing FX Graph Cache because 'mkldnn
#: tensors unpickleable'"); but on CPUs where the plain ``mm`` reads the weight well below the
#: memory's rate, the plain step is much slower, and several rows (a verify pass) pay on every
#: CPU. The learner's step time comes before the repeat's compile time.
PREPACK_FROM_ROWS = 1

#: Timed calls per choice (the median is kept), each after a flush.
COLD_REPEATS = 7


@contextlib.contextmanager
def cold_benchmarks() -> Iterator[None]:
    """While held, inductor's autotuner times a CPU kernel as a decode step runs it: the
    caches flushed (:data:`FLUSH_BYTES` written) before each of :data:`COLD_REPEATS` timed
    calls, the median kept. Inductor's own CPU loop (``benchmarker.benchmark_cpu``) repeats
    the call back to back, so it times a weight the last-level cache already holds.

    Why: timed hot, a kernel whose weight fits the last-level cache looks faster than it is
    in a decode step, which streams the weight from memory, so the autotuner would choose
    kernels that lose in the step. A flush costs tens of milliseconds a choice, within the
    noise of a whole compile.
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
    folder = inductor_cache(cache)
    recipe = CPU_RECIPE
    rows = bucket_for(batch, MAX_COMPILED_BATCH)
    decoder = compiled_decoder(model, batch, backend=recipe.backend, tokens=tokens,
                               options=recipe.compile_options(), settings=_settings(recipe, rows, model),
                               tag=("fast", recipe, _weights_version(model)), kind=FastDecoder)
    if decoder.choice is None:            # what its first step reads to decide
        decoder.recipe, decoder.folder = recipe, folder
    return decoder


class FastDecoder(CompiledDecoder):
    """A :class:`~tinyserve.backends.compiled.CompiledDecoder` whose first step decides what
    every step runs (:func:`first_step`, kept in :attr:`choice`): the compiled step, or the same
    forward pass eagerly over the packed weights, or plain eager; a shape whose choice was
    kept from an earlier run is compiled only if that choice is the compiled step.
    ``compile_seconds``: what that first step took (a compile, or only the timing)."""

    choice: StepChoice | None = None
    recipe: "Recipe | None" = None
    folder: Path | None = None

    def _ways(self, tokens: Tensor, positions: Tensor) -> dict[str, Callable[[], Tensor]]:
        return step_ways(self.model, self.cache.batch_size,
                         lambda: CompiledDecoder.step(self, tokens, positions),
                         lambda: self._forward(tokens, positions))

    @torch.no_grad()
    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        if self.choice is not None:
            return self.choice.run(self._ways(tokens, positions))
        start = time.perf_counter()
        # Every way runs the step just run again, on the same inputs: the same keys and
        # values land in the same slots, so timing them leaves the cache as it was.
        t, p = tokens.clone(), positions.clone()
        what = f"decode {self.cache.batch_size} rows x window {self.cache.max_seq}"
        self.choice, logits = first_step(self.model, what, self.cache.batch_size,
                                         self.recipe or CPU_RECIPE, self.folder,
                                         self._ways(t, p))
        self.compile_seconds = time.perf_counter() - start
        return logits


def _settings(recipe: Recipe, rows: int, model: TinyLlama):
    """What to hold around compiling a step of ``model`` whose matmuls serve ``rows`` rows:
    :func:`compile_settings` (freezing, the weights' digest in the cache key) or None."""
    if not recipe.freezing:
        return None

    def settings() -> contextlib.AbstractContextManager:
        return compile_settings(True, rows, weights=weights_digest(model))
    return settings


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
#: The packing step's wait, said before it starts: the slowest seen on a loaded 2-core CPU.
PACK_ESTIMATE_S = 15


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
    if say is not None and not held:  # a wait says what it does and how long, before it starts
        say(f"timing the eager passes plain and packed for oneDNN, then packing the prefill's "
            f"weights: up to about {PACK_ESTIMATE_S} s on two cores (a measurement kept by an "
            f"earlier run is read back at once)")
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


def step_ways(model: TinyLlama, rows: int, compiled: Callable[[], Any],
              eager: Callable[[], Any]) -> dict[str, Callable[[], Any]]:
    """The ways a fast step of ``rows`` rows can run here: ``compiled()`` (its first call
    compiles), ``eager()`` and, for two rows or more of a model whose linears can be packed
    (:func:`_packs`), ``eager()`` over the weights packed once for oneDNN (one row is the
    plain weight's either way: :data:`~tinyserve.backends.packed.MIN_ROWS`)."""
    ways: dict[str, Callable[[], Any]] = {"compiled": compiled, "eager": eager}
    if rows >= packed.MIN_ROWS and _packs(model):
        mode = _mode(model)

        def packed_step() -> Any:
            with mode:
                return eager()
        ways["packed"] = packed_step
    return ways


def choose_step(model: TinyLlama, rows: int, ways: dict[str, Callable[[], Any]],
                how: str) -> StepChoice:
    """What a step of ``rows`` rows runs from now on, of ``ways`` (:func:`step_ways`, the
    compiled one already compiled, or left out where nothing compiles), as ``how``
    (:attr:`Recipe.decode_steps`) says: ``"measured"`` times every way back to back, as a loop
    runs them, in turns, and keeps the fastest (:func:`~tinyserve.backends.choices.choose`);
    a way named outright is run where offered, else the compiled step, else eager."""
    if how not in DECODE_STEPS:
        raise ValueError(f"how must be one of {', '.join(DECODE_STEPS)}, not {how!r}")
    if how == "measured":
        return choose(rows, ways, model.device)
    kernel = next(w for w in (how, "compiled", "eager") if w in ways)
    return StepChoice(rows, kernel, why="recipe")


def first_step(model: TinyLlama, what: str, rows: int, recipe: Recipe, folder: Path | None,
               ways: dict[str, Callable[[], Any]]) -> tuple[StepChoice, Any]:
    """Run a fast step's first call and decide what the later ones run: (the choice, the
    first call's output). ``what``: the step's shape in words (its key on disk, with the
    model's shape, this machine and ``recipe``: :func:`~tinyserve.backends.choices.shape_key`);
    ``ways``: :func:`step_ways`, whose ``"compiled"`` compiles on its first call.

    In order: where nothing compiles here (:func:`~tinyserve.toolchain.ready`) the
    compiled way is dropped; a choice kept from an earlier run (``folder``'s
    :class:`~tinyserve.backends.choices.ChoiceBook`) is taken as it is, so a shape that lost
    is not compiled; otherwise the step compiles (a failed compile drops that way, saying why
    once) and :func:`choose_step` times the ways, and the choice is kept."""
    ways = dict(ways)
    why = None
    if recipe.backend == "inductor" and not toolchain.ready(model.device):
        ways.pop("compiled")
        why = "no compiler"
    book, key = ChoiceBook(folder), shape_key(model, what, recipe)
    kept = book.get(key) if recipe.decode_steps == "measured" else None
    if kept is not None and kept.kernel in ways and not kept.compiles:
        return kept, kept.run(ways)
    out = None
    times, start = CompileTimes(folder), time.perf_counter()
    estimate, source = times.estimate(key)
    if "compiled" in ways:
        # one call that returns when the compile is done: say before how long, show elapsed
        with waiting(f"compiling {what}", estimate, source):
            try:
                out = ways["compiled"]()
            except Exception as error:   # noqa: BLE001 - any failed compile: run eagerly instead
                toolchain.failed(error)
                ways.pop("compiled")
                why = "compile failed"
        if why is None:
            times.put(key, time.perf_counter() - start)
    if kept is not None and kept.compiles and "compiled" in ways:
        return kept, out                    # compiled (from the kernel cache), not timed again
    choice = choose_step(model, rows, ways, recipe.decode_steps)
    if why is not None:
        choice = StepChoice(choice.rows, choice.kernel, choice.seconds, why)
    elif choice.why == "timed":
        book.put(key, choice)
    return choice, choice.run(ways) if out is None or not choice.compiles else out


class CompiledStep:
    """One of the engine's decode steps (:class:`~tinyserve.backends.cuda_graph.EngineGraphs`:
    one batch bucket of ``rows`` x ``blocks`` blocks per row, on the paged pool's static
    buffers) made with ``recipe`` where a CUDA graph would be captured: :meth:`replay` runs it,
    the first call deciding what every call runs (:func:`first_step`: compiled, eager over the
    packed weights, or eager; :attr:`choice`) and recording what that took
    (``compile_seconds``)."""

    def __init__(self, step: Callable[[], Tensor], rows: int, blocks: int, recipe: Recipe,
                 model: TinyLlama, folder: Path | None = None) -> None:
        self._eager, self._rows, self._blocks, self._model = step, rows, blocks, model
        self._recipe, self._folder = recipe, folder
        self._step = torch.compile(step, backend=recipe.backend,
                                   options=recipe.compile_options(), fullgraph=True,
                                   dynamic=False)
        self._settings = _settings(recipe, rows, model)
        self._compiled = False
        self.compile_seconds: float | None = None
        self.choice: StepChoice | None = None

    def _compiled_step(self) -> Tensor:
        if self._compiled:
            return self._step()
        with compiling(self._settings):      # freezing is read while tracing (see the module)
            out = self._step()
        self._compiled = True
        return out

    def _ways(self) -> dict[str, Callable[[], Tensor]]:
        return step_ways(self._model, self._rows, self._compiled_step, self._eager)

    def replay(self) -> None:
        if self.choice is not None:
            self.choice.run(self._ways())
            return
        start = time.perf_counter()
        # The step reads the buffers its caller filled and writes the same slots each time:
        # running it again to time it leaves the pool as it was.
        self.choice, _ = first_step(self._model, f"engine decode {self._rows} rows x "
                                    f"{self._blocks} blocks", self._rows, self._recipe,
                                    self._folder, self._ways())
        self.compile_seconds = time.perf_counter() - start

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
    """The engine's pure-decode steps on a CPU for ``path="fast"``: a paged pool of
    ``num_blocks`` blocks (plus the scratch block) and :class:`~tinyserve.backends.cuda_graph.
    EngineGraphs` whose every shape is compiled with :data:`CPU_RECIPE` (read now), its
    kernels kept in ``cache`` (:func:`inductor_cache`). Kept for the next engine of the same
    model and sizes, as the loops keep their decoders: a compiled step reads the pool's
    tensors and its own buffers, never a request's state, so a new engine (a fresh block
    manager over the same pool) reuses every shape compiled so far instead of compiling
    them again. In use (``in_use``) until its engine is gone; then the next may take it."""
    folder = inductor_cache(cache)
    recipe = CPU_RECIPE

    def make() -> EngineGraphs:
        pool = PagedKVCache(model.config, num_blocks, block_size, device=model.device,
                            dtype=model.dtype, scratch=True)
        return EngineGraphs(model, pool, max_rows, capture=False,
                            compiler=functools.partial(CompiledStep, recipe=recipe, model=model,
                                                       folder=folder))
    key = (num_blocks, block_size, max_rows, recipe, model.device, model.dtype)
    steps = _ENGINE_STEPS.get(model, key, make)
    steps.in_use, steps.checked = True, False   # the first step checks the weights
    return steps


class CompiledPasses(StaticPasses):
    """:class:`~tinyserve.backends.spec_graphs.StaticPasses` whose every width's pass runs the
    fast path's way (the CPU fast path) instead of a captured graph: the same static buffers,
    the same forward pass; each width's first pass decides what that width runs
    (:func:`first_step`: compiled, eager over the packed weights, or eager), kept in
    :attr:`choices`."""

    def __init__(self, model: TinyLlama, window: int, widths: Sequence[int],
                 recipe: Recipe, folder: Path | None = None) -> None:
        super().__init__(model, window, widths, capture=False)
        self._compiled = {w: torch.compile(functools.partial(StaticPasses._forward, self, w),
                                           backend=recipe.backend,
                                           options=recipe.compile_options(), fullgraph=True,
                                           dynamic=False)
                          for w in self.widths}
        self._settings = {w: _settings(recipe, w, model) for w in self.widths}
        self._recipe, self._folder = recipe, folder
        self._built: set[int] = set()
        #: Seconds each width's first pass took (a compile, unless found on disk or not chosen).
        self.compile_seconds: dict[int, float] = {}
        #: What each width runs, once its first pass has run.
        self.choices: dict[int, StepChoice] = {}

    def _compiled_pass(self, w: int) -> Tensor:
        if w in self._built:
            return self._compiled[w]()
        with compiling(self._settings[w]):   # freezing is read while tracing (see the module)
            out = self._compiled[w]()
        self._built.add(w)
        return out

    def _ways(self, w: int) -> dict[str, Callable[[], Tensor]]:
        return step_ways(self.model, w, functools.partial(self._compiled_pass, w),
                         functools.partial(StaticPasses._forward, self, w))

    def _forward(self, w: int) -> Tensor:
        if w in self.choices:
            return self.choices[w].run(self._ways(w))
        start = time.perf_counter()
        # A pass re-run on the same static tokens and positions writes the same keys and
        # values to the same slots: timing the ways leaves the cache as it was.
        self.choices[w], out = first_step(self.model, f"pass width {w} x window {self.window}",
                                          w, self._recipe, self._folder, self._ways(w))
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
    folder = inductor_cache(cache)
    window = window_for(tokens, model.config.max_position_embeddings)
    recipe = CPU_RECIPE
    key = (window, widths, recipe, _weights_version(model))
    passes = _PASSES.get(model, key,
                         lambda: CompiledPasses(model, window, widths, recipe, folder))
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
    # One shape is one long call: each shows its own wait (estimate, elapsed) as it compiles;
    # the bar over shapes only where there are several.
    with shown(progress), tqdm(total=units, desc="preparing the fast path", unit="shape",
                                disable=not progress or units < 2) as bar:
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
        note = step.choice.sentence() if step.choice is not None else ""
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
            choice = getattr(passes, "choices", {}).get(w)
            yield (f"pass width {w} x window {window}",
                   passes.compile_seconds[w] if fresh else 0.0, fresh,
                   choice.sentence() if choice is not None else "")
    finally:
        passes.release()

"""A compiled decode step: the same model, traced once into fused kernels (opt-in).

Eager PyTorch runs a decode step as a few hundred small operations, each dispatched from
Python (and on a GPU, each a kernel launch). For a small model at batch 1 that dispatch,
not memory traffic, is most of the step. ``torch.compile`` traces the step into a graph and
fuses it; on CUDA, mode ``"reduce-overhead"`` also records it as a CUDA graph, so a step
is one launch replayed.

Tracing needs *static shapes*, which the contiguous :class:`~tinyserve.kv_cache.KVCache` does
not have (its keys grow each step, and it keeps lengths on the host). So the step runs on a
:class:`~tinyserve.backends.static.StaticKVCache` (every row owns the whole window, always
returned whole; which slots a query may see is computed from the positions on the device, so
nothing in a step reads back to the host), and this module brings:

- :class:`CompiledDecoder`: one compiled step per (model, batch bucket, window), prefill left
  eager (it runs once per request and its shapes vary);
- :func:`compiled_decoder`: those decoders, compiled once and kept (:data:`DECODERS`);
- :func:`compile_token_layers`: the engine's token-wise layers compiled in place.

The loop over it is :func:`~tinyserve.generate.generate_compiled`, the compiled twin of
:func:`~tinyserve.generate.generate_batch` (tests check they give equal tokens): loops choose
a backend, a backend never runs a loop.

Batches are padded up to a bucket (:func:`~tinyserve.backends.static.bucket_for`: 1, 2, 4, 8,
then steps of 16 up to :data:`MAX_COMPILED_BATCH`) so a handful of graphs serve every size,
and the cache holds only the window a request needs, rounded up to a power of two (64, 128,
... the model's context window): attention in a static graph reads every slot of the cache,
so a 512-slot cache would make a 100-token request read five times the keys it has. One
graph per (batch bucket, window) pair, each compiled on first use.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, ExitStack, nullcontext
import os
from pathlib import Path
import time
from typing import Any
import warnings

import torch
from torch import Tensor

from ..model import TinyLlama
from .decoder_cache import DecoderCache
from .static import StaticKVCache, bucket_for, window_for
from .waits import CompileTimes, waiting

__all__ = ["COMPILED_ENTRIES", "MAX_COMPILED_BATCH", "CompiledDecoder", "compile_token_layers",
           "compiled_decoder", "compiling", "DECODERS", "MAX_DECODERS"]

#: How many compiled entries one code object may hold while a new one compiles (TorchDynamo's
#: ``recompile_limit``, 8 by default, fails a ``fullgraph`` compile past it).
COMPILED_ENTRIES = 1024


def compiling(settings: Callable[[], AbstractContextManager] | None = None) -> ExitStack:
    """What to hold around a call that compiles a new step: TorchDynamo's recompile limit
    raised to :data:`COMPILED_ENTRIES`, and ``settings`` if given. Every decoder (and every
    width of a pass set) compiles the same method (``_forward``) for another ``self`` and
    shape, so its entries pile up on one code object by design, one per static shape: the
    limit, meant to stop a function whose shapes churn, would fail the ninth decoder of a
    process (a chapter's batch sweep, a target and a draft at two windows)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    stack = ExitStack()
    stack.enter_context(config.patch(**{name: max(getattr(config, name), COMPILED_ENTRIES)}))
    # inductor's autotuner touches a deprecated storage API while it benchmarks: its warning
    # says nothing to a learner, so it is held back while a step compiles.
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
    if settings is not None:
        stack.enter_context(settings())
    return stack


#: The largest batch a compiled step is made for: every (bucket, window) is a compile of
#: its own, tens of seconds each, so the compiled path stops well short of the graphs' 512.
MAX_COMPILED_BATCH = 64


#: The folder under ``<cache>/inductor`` for this torch and this way of autotuning:
#: inductor's autotune cache keys each matmul's timings by the shapes and choices alone, so
#: timings taken hot (before :func:`~tinyserve.backends.fast.cold_benchmarks`) would be read back as they were.
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


class CompiledDecoder:
    """A static cache for one batch bucket and a compiled decode step over it.

    ``mode`` defaults to ``"reduce-overhead"`` on CUDA (CUDA graphs) and ``"default"``
    elsewhere (fused C++ kernels on a CPU); ``options`` (inductor's, instead of a mode) are
    what :mod:`tinyserve.backends.fast` passes for the fastest CPU step, with ``settings``:
    inductor settings held around the first step only, the one that traces and compiles
    (freezing is read while TorchDynamo traces, outside ``torch.compile``'s options; holding
    the patch around every step would cost ~70 us a step). So no later call may recompile:
    :meth:`step` hands the step its inputs with fresh contiguous strides, because a compiled
    function guards on strides too, and a token passed as a column view (stride 40 where the
    first call's had 1) recompiled the step outside the settings, unfrozen and unpacked, and
    much slower. The first :meth:`step` compiles
    (seconds to a minute), saying before how long and showing its elapsed time
    (:mod:`~tinyserve.backends.waits`); :attr:`compile_seconds` records how long that took.
    ``cache``: the folder its kernels and compile times are kept in across runs (the loops
    pass :func:`tinyserve.paths.cache_dir`); None: inductor's default, times kept in this
    process only.
    ``backend="eager"`` only traces (TorchDynamo, no code generation): it checks in seconds
    that the step is one graph with static shapes, and runs it op by op.
    """

    def __init__(self, model: TinyLlama, batch_size: int, mode: str | None = None,
                 backend: str = "inductor", window: int | None = None,
                 options: dict[str, Any] | None = None,
                 settings: Callable[[], AbstractContextManager] | None = None,
                 cache: Path | None = None) -> None:
        self.model = model
        self.cache_root = cache
        self.cache = StaticKVCache(model.config, batch_size, device=model.device,
                                   dtype=model.dtype, max_seq=window)
        self.cache.mark_static()
        self.backend = backend
        self.mode = None if backend != "inductor" else \
            mode or ("reduce-overhead" if model.device.type == "cuda" else "default")
        # On a CPU, inductor's "C++ wrapper" also writes the code that calls the kernels in
        # C++ instead of Python: Python's share of a small step is what it saves (bench
        # decode). (A mode and options cannot both be given; the default mode has none.)
        if options is None:
            options = {"cpp_wrapper": True} if self.mode == "default" else None
        else:      # inductor's options as given (the fast path's: tinyserve.backends.fast)
            self.mode = None
        self._step = torch.compile(self._forward, backend=backend,
                                   mode=None if options else self.mode, options=options,
                                   fullgraph=True, dynamic=False)
        self.compile_seconds: float | None = None
        self._settings = settings

    def _forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.model(tokens[:, None], positions[:, None], self.cache)[:, -1]

    @torch.no_grad()
    def prefill(self, ids: Tensor) -> Tensor:
        """Run right-padded prompts ``ids`` (B, T) eagerly into the cache; all logits."""
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        logits = self.model(ids, positions, self.cache)
        if self.mode == "reduce-overhead":
            # The stacked weight copies this eager pass made (tinyserve.model.fused_linear)
            # are plain tensors, not parameters: a CUDA graph would copy each into its own
            # buffer at every replay unless told their addresses are fixed.
            for module in self.model.modules():
                if "_fused_weight" in module.__dict__:
                    torch._dynamo.mark_static_address(module.__dict__["_fused_weight"][1])
        return logits

    @torch.no_grad()
    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """One token per row (B,) at its position (B,) -> next-token logits (B, vocab).

        The logits live in the CUDA graph's output buffer, which the next step overwrites:
        a copy is returned so callers may keep them."""
        first = self.compile_seconds is None
        # The same strides at every call, whatever view the caller holds (see the class).
        tokens = tokens.clone(memory_format=torch.contiguous_format)
        positions = positions.clone(memory_format=torch.contiguous_format)
        start = time.perf_counter()
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        if first:
            with self._compile_wait(), compiling(self._settings):
                logits = self._step(tokens, positions).clone()
        else:
            logits = self._step(tokens, positions).clone()
        if first:
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)
            self.compile_seconds = time.perf_counter() - start
            if self.backend == "inductor":
                CompileTimes(self._kernels()).put(self._wait_key(), self.compile_seconds)
        return logits

    def _wait_key(self) -> str:
        from .choices import shape_key
        return shape_key(self.model, f"compiled decode {self.cache.batch_size} rows x window "
                         f"{self.cache.max_seq}", (self.mode, self.backend))

    def _kernels(self) -> Path | None:
        """The kernel folder under :attr:`cache_root`
        (:func:`inductor_cache`), or None without one."""
        return inductor_cache(self.cache_root)

    def _compile_wait(self) -> AbstractContextManager:
        """The first step's wait, said and shown (:mod:`~tinyserve.backends.waits`); its
        kernels go to the cache folder, kept across runs and sessions where
        ``TINYSERVE_CACHE_DIR`` points at a kept disk."""
        if self.backend != "inductor":
            return nullcontext()
        estimate, source = CompileTimes(self._kernels()).estimate(self._wait_key())
        return waiting(f"compiling the decode step ({self.cache.batch_size} rows, window "
                       f"{self.cache.max_seq})", estimate, source)


def compile_token_layers(model: TinyLlama, backend: str = "inductor") -> None:
    """Compile, in place, the parts of every layer that work token by token (the MLP), for
    the serving engine (``serve --compile``).

    An engine step is one flat list of tokens from many sequences, its length changing every
    step, and its attention goes through the paged cache's Python bookkeeping; so the step
    cannot be one static graph like :class:`CompiledDecoder`'s. What can be compiled is what
    does not care which sequence a token belongs to: the MLP, with a dynamic token count
    (one graph for every step size). Attention stays eager. ``nn.Module.compile`` keeps the
    module in place, so state dicts and the Hugging Face export keep their names.
    """
    for layer in model.model.layers:
        # Traced without the stacked gate/up copy (tinyserve.model.fused_linear): a compiled
        # MLP never runs eagerly, so nothing would refresh that copy if a weight changed;
        # the parameters themselves are read at every call.
        layer.mlp.__dict__.pop("_fused_weight", None)
        layer.mlp.compile(backend=backend, dynamic=True, fullgraph=True)


#: How many compiled decoders are kept (beyond it the least recently used is freed): each
#: holds a static KV cache of its bucket and window and its compiled step.
MAX_DECODERS = 8
DECODERS: DecoderCache[CompiledDecoder] = DecoderCache(MAX_DECODERS)


def compiled_decoder(model: TinyLlama, batch: int, mode: str | None = None,
                     backend: str = "inductor", tokens: int | None = None, *,
                     options: dict[str, Any] | None = None,
                     settings: Callable[[], AbstractContextManager] | None = None,
                     tag: Hashable = None,
                     kind: type[CompiledDecoder] | None = None,
                     cache: Path | None = None) -> CompiledDecoder:
    """The decoder for ``model``, the bucket holding ``batch`` rows and the window holding
    ``tokens`` positions per row (default: the whole context window), compiled once and
    reused (compiling again for every request would cost more than it saves); at most
    :data:`MAX_DECODERS` are kept (see :mod:`tinyserve.backends.decoder_cache`).
    ``options``: inductor's, instead of ``mode``, and ``settings`` around the compile (see
    :class:`CompiledDecoder`); ``tag``: anything else the decoder must match (the fast
    path's settings and weight versions: its compiled step holds the weights frozen);
    ``kind``: a subclass to make instead (the fast path's); ``cache``: where its kernels and
    compile time are kept (see :class:`CompiledDecoder`)."""
    context = model.config.max_position_embeddings
    window = window_for(context if tokens is None else tokens, context)
    key = (bucket_for(batch, MAX_COMPILED_BATCH), window, mode, backend,
           tuple(sorted((options or {}).items())), tag)
    make = kind or CompiledDecoder
    return DECODERS.get(model, (*key, make), lambda: make(model, key[0], mode, backend,
                                                         window, options, settings, cache),
                        exclusive=False)

"""CUDA-graph decode: the eager decode step, captured once per batch bucket and replayed.

On a GPU an eager decode step of this model is a few hundred small kernels, each launched
from Python; at batch 1 the launches, not the weights' bytes, can set the step's time. A
CUDA graph records the kernels of one step once; replaying it is one launch for all of
them (PyTorch's ``torch.cuda.CUDAGraph``). No compiler is involved: the graph holds the
very kernels the eager step runs, so it gives the eager step's tokens, and capturing takes
a couple of eager steps' time, not a compile's minutes.

A replay re-runs the recorded kernels on the recorded addresses, with no Python in
between. So the step must (this is nano-vllm's recipe, ``ModelRunner.capture_cudagraph``):

- read and write only *static buffers*: the step's input tokens and positions live in
  tensors made once, and each step copies its values into them; the KV cache is a
  :class:`GraphKVCache` whose shapes never change (every row owns the whole window, and
  which slots a query may see is computed on the device from the positions);
- read nothing back to the host (a read during capture is an error): the positions come
  from the host's own count, copied in, never read out;
- have one shape per graph: batches are padded up to a *bucket* (1, 2, 4, 8, then steps
  of 16, nano-vllm's sizes), one graph per bucket and cache window. Graphs captured on
  one device share one memory pool (``torch.cuda.graph_pool_handle``), so their
  intermediate tensors take the memory once, not once per bucket.

:class:`GraphDecoder` serves one request or one static batch (``generate_stream``,
``generate_batch``). :class:`EngineGraphs` does the same for the continuous-batching
engine, whose rows join and leave every step and whose keys live in the paged pool. As
nano-vllm's model runner does, only a step in which every row feeds one token is replayed
(prefill and mixed steps, whose shapes change every step, stay eager): its rows are padded
to a bucket, and each row's token id, position, slot to write, context length and block
table are copied into static buffers (:class:`~tinyserve.paged.DecodeBuffers`), the table
padded to the window's blocks. Where nano-vllm hands the tables to a paged-attention kernel
that stops at each row's length, here every row gathers all of its window's blocks and a
mask made on the device from the lengths hides the ones past its end
(:class:`~tinyserve.paged.DecodeLayout`): a fixed shape and nothing read back. Padding rows
write and read one scratch block that the block manager never hands out, so they cannot
change a real row. The window is the step's longest context rounded up to a power of two
from 64, so there is one graph per (bucket, window), and all of them are captured at
start-up (:meth:`EngineGraphs.warmup`, which the engine's executor calls when it is made),
largest first, as nano-vllm captures its buckets: a capture mid-stream would stall every
request of that step for a couple of eager steps' time.

Captures use ``capture_error_mode="thread_local"``: the async server steps its engine on a
thread of its own, and in the default (global) mode a CUDA call another thread makes during
a capture (the event loop's, say) would be an error in the capture.

Where CUDA is absent (or ``capture=False``) both run the same step eagerly on the same
static buffers: that is how the buffers, the buckets and the padding are tested on a CPU,
against the plain KV-cache step and the engine's plain step. :class:`EngineGraphs` goes
through the very same warm-up there, with an :class:`EagerReplay` (the step, run when
"replayed") for each shape in place of a graph, so when and in which order shapes are
captured is tested on a CPU too. Idle :class:`GraphDecoder` s are kept in a
:class:`~tinyserve.backends.decoder_cache.DecoderCache` of at most :data:`MAX_DECODERS`.
``torch.compile``'s graphs (:mod:`tinyserve.backends.compiled`) stay the opt-in "compiled"
step: fused kernels, minutes to build. The buckets, the windows and the static cache are
:mod:`tinyserve.backends.static`'s, shared with the compiled step.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..config import ModelConfig
from ..device import upload
from ..kv_cache import CacheFullError
from ..model import TinyLlama
from ..paged import DecodeBuffers, PagedKVCache
from .decoder_cache import DecoderCache
from .static import MAX_BATCH, SMALLEST_WINDOW, StaticKVCache, bucket_for, buckets, window_for

__all__ = ["MAX_BATCH", "buckets", "bucket_for", "GraphKVCache", "GraphDecoder",
           "graph_decoder", "EngineGraphs", "EagerReplay", "shared_pool", "record",
           "weight_addresses", "MAX_DECODERS"]

class GraphKVCache(StaticKVCache):
    """:class:`~tinyserve.backends.static.StaticKVCache` (the whole window returned every step,
    visibility computed on the device) plus the step's positions as a static buffer
    ``positions`` (B, 1).

    ``step_positions`` hands the model that buffer, so ``model(tokens, None, cache)`` takes
    its positions from it: nothing to check on the device, nothing read back. The caller
    fills the buffer before each step (and checks the values on the host).
    """

    def __init__(self, config: ModelConfig, batch_size: int, *, device: torch.device | str,
                 dtype: torch.dtype, max_seq: int | None = None) -> None:
        # StaticKVCache's buffers, unmarked: torch.compile's markers (mark_static) are the
        # compiled step's, and a hand-captured graph needs none.
        super().__init__(config, batch_size, device=device, dtype=dtype, max_seq=max_seq)
        self.positions = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.prefilling = False   # set for one pass: the prompts, at 0..T-1

    def step_positions(self, batch: int, tokens: int) -> Tensor:
        """The static buffer for a decode step; 0..T-1 for the prefill that
        :meth:`GraphDecoder.prefill` announces (prompts start at 0: known on the host)."""
        if self.prefilling and batch == self.batch_size:
            self.prefilling = False
            if tokens > self.max_seq:
                raise CacheFullError(f"the prompts are {tokens} tokens but this cache holds "
                                     f"{self.max_seq} per row")
            return torch.arange(tokens, device=self.slots.device).expand(batch, tokens)
        if batch != self.batch_size or tokens != 1:
            raise ValueError(f"a graph step feeds one token to each of {self.batch_size} "
                             f"rows, got {batch} rows of {tokens}")
        return self.positions


_POOLS: dict[torch.device, object] = {}


def shared_pool(device: torch.device) -> object:
    """The memory pool every graph on ``device`` is captured into (one per device)."""
    if device not in _POOLS:
        _POOLS[device] = torch.cuda.graph_pool_handle()
    return _POOLS[device]


def record(step: Callable[[], Tensor], device: torch.device) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """``step`` warmed up and captured into a graph in ``device``'s shared pool; returns the
    graph and the tensor ``step`` returned (where each replay leaves its result).

    The warm-up runs twice on a side stream, for real: it makes the lazy state (the rotary
    table, the stacked weights, cuBLAS's workspace) before the capture, which must not
    allocate it. So ``step``'s buffers must hold harmless values (padding rows)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: only this thread's unsafe CUDA calls break the capture, not another
    # thread's (the async server steps its engine on a thread of its own).
    with torch.cuda.graph(graph, pool=shared_pool(device), capture_error_mode="thread_local"):
        out = step()
    torch.cuda.synchronize(device)
    return graph, out


def weight_addresses(model: TinyLlama) -> tuple:
    """The addresses a captured graph reads besides its buffers: every parameter and
    module buffer (an int8 model's weights), the stacked weight copies
    :func:`~tinyserve.model.fused_linear` keeps (rebuilt when a weight changes) and the
    rotary table. If any moved, the graph must be captured again. (A rebuilt copy at the
    old address is read correctly by the old graph.)"""
    kept = [m.__dict__.get("_fused_weight") for m in model.modules()]
    stacked = tuple(k[1].data_ptr() if k is not None else 0 for k in kept)
    rope = model.__dict__.get("_rope_table")
    tables = (rope[1].data_ptr(), rope[2].data_ptr()) if rope is not None else ()
    held = [*model.parameters(), *model.buffers()]   # int8 weights: buffers
    return tuple(t.data_ptr() for t in held) + stacked + tables


class GraphDecoder:
    """Static buffers, a static KV cache and (on CUDA) the captured decode step, for
    ``batch_size`` rows (a bucket) of up to ``window`` positions each.

    One request (or one static batch) at a time: :meth:`prefill` its right-padded prompts,
    then :meth:`step` per token, then :meth:`release`. Rows past the caller's batch are
    padding: they feed the pad token at the window's last slot, which no real row sees
    before writing it itself.
    """

    def __init__(self, model: TinyLlama, batch_size: int, window: int | None = None, *,
                 capture: bool | None = None) -> None:
        self.model = model
        self.device = model.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {self.device}")
        self.cache = GraphKVCache(model.config, batch_size, device=self.device,
                                  dtype=model.dtype, max_seq=window)
        self.batch_size, self.window = batch_size, self.cache.max_seq
        self.pad = model.config.pad_token_id
        self.tokens = torch.full((batch_size,), self.pad, dtype=torch.long, device=self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._out: Tensor | None = None      # the graph's logits (its pool's memory)
        self._captured_from: tuple | None = None
        self.captures = 0                    # how many times the step was captured
        self.capture_seconds: float | None = None
        self.in_use = False

    def _forward(self) -> Tensor:
        """The step itself: the static tokens at the static positions (B, vocab)."""
        return self.model(self.tokens[:, None], None, self.cache)[:, -1]

    def _weights(self) -> tuple:
        return weight_addresses(self.model)

    def _park(self) -> None:
        """Every row at the window's last slot: what a padding row (and the warm-up and
        capture) writes there is overwritten by a real row before that row can see it."""
        self.tokens.fill_(self.pad)
        self.cache.positions.fill_(self.window - 1)

    def _capture(self) -> None:
        start = time.perf_counter()
        self._park()
        self.graph = self._out = None
        self.graph, self._out = record(self._forward, self.device)
        self._captured_from = self._weights()
        self.captures += 1
        self.capture_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def prefill(self, ids: Tensor, lengths: Sequence[int]) -> Tensor:
        """Run right-padded prompts ``ids`` (B, T), row b holding ``lengths[b]`` real tokens,
        eagerly into the cache; return each row's next-token logits (B, vocab).

        The batch is padded to the bucket with one-token rows. The first prefill (and one
        after the model's weights moved) captures the step."""
        B, T = ids.shape
        if not 1 <= B <= self.batch_size or len(lengths) != B:
            raise ValueError(f"need 1 to {self.batch_size} rows with one length each, "
                             f"got {B} rows and {len(lengths)} lengths")
        if T > self.window:
            raise CacheFullError(f"the prompts are {T} tokens but this decoder's cache "
                                 f"holds {self.window} per row")
        if B < self.batch_size:
            ids = torch.cat([ids, torch.full((self.batch_size - B, T), self.pad,
                                             dtype=ids.dtype, device=ids.device)])
        lengths = list(lengths) + [1] * (self.batch_size - B)
        ends = sorted(set(n - 1 for n in lengths))   # each distinct last position once
        which = upload([ends.index(n - 1) for n in lengths], self.device)
        self.cache.prefilling = True    # positions 0..T-1 from the host: nothing read back
        try:
            logits = self.model(ids, None, self.cache, logits_at=upload(ends, self.device))
        finally:
            self.cache.prefilling = False
        logits = logits[torch.arange(self.batch_size, device=self.device), which][:B]
        if self.capture and (self.graph is None or self._captured_from != self._weights()):
            self._capture()
        return logits

    @torch.inference_mode()
    def step(self, tokens: Tensor, positions: Sequence[int]) -> Tensor:
        """Feed ``tokens`` (B,) (on the device: never read) at ``positions`` (B ints, known
        on the host); return next-token logits (B, vocab), a tensor of the caller's."""
        B = len(positions)
        if not 1 <= B <= self.batch_size or tokens.shape != (B,):
            raise ValueError(f"need 1 to {self.batch_size} tokens, one per position; got "
                             f"tokens of shape {tuple(tokens.shape)} and {B} positions")
        if max(positions) >= self.window or min(positions) < 0:
            raise CacheFullError(f"position {max(positions)} does not fit this decoder's "
                                 f"cache of {self.window} slots per row")
        if B < self.batch_size:
            self._park()   # padding rows: the pad token at the last slot
        self.tokens[:B].copy_(tokens)
        self.cache.positions[:B, 0].copy_(upload(list(positions), self.device))
        if self.graph is None:
            return self._forward()[:B]
        self.graph.replay()
        # A copy at once: the logits live in the pool, which another bucket's replay reuses.
        return self._out[:B].clone()

    def release(self) -> None:
        """The request is done: the decoder (its buffers, cache and graph) may serve another."""
        self.in_use = False


#: How many graph decoders are kept (idle ones beyond it are freed, least recently used
#: first): each holds a static KV cache of its bucket and window and, on CUDA, its graph.
MAX_DECODERS = 8
_DECODERS: DecoderCache[GraphDecoder] = DecoderCache(MAX_DECODERS)


def graph_decoder(model: TinyLlama, batch: int, tokens: int | None = None, *,
                  capture: bool | None = None) -> GraphDecoder:
    """A free decoder for ``model`` whose bucket holds ``batch`` rows and whose cache holds
    ``tokens`` positions per row (rounded up to a power of two from 64, as the compiled
    step does; default: the context window), marked in use until :meth:`GraphDecoder.release`.

    Decoders are kept per model and reused, graph and all: a graph is captured once, not
    per request. A second request while the first still streams gets a decoder of its own.
    At most :data:`MAX_DECODERS` are kept (see :mod:`tinyserve.backends.decoder_cache`).
    """
    context = model.config.max_position_embeddings
    window = window_for(context if tokens is None else tokens, context)
    capture = model.device.type == "cuda" if capture is None else capture
    key = (bucket_for(batch), window, capture, model.device, model.dtype)
    decoder = _DECODERS.get(model, key,
                            lambda: GraphDecoder(model, key[0], window, capture=capture))
    decoder.in_use = True
    return decoder


# ------------------------------------------------------------------ the engine's decode steps

class EagerReplay:
    """What the eager fallback keeps in place of a captured graph: :meth:`replay` runs the
    step itself, on the same static buffers (where CUDA is absent, or ``capture=False``)."""

    def __init__(self, step: Callable[[], Tensor]) -> None:
        self.step = step

    def replay(self) -> None:
        self.step()


#: What :class:`EngineGraphs` may be given in place of a capture: a function that turns one
#: shape's step and its rows into something with ``replay()`` (the CPU fast path's compiled step,
#: :class:`tinyserve.backends.fast.CompiledStep`), made ready on the parked buffers.
#: Makes a shape's step (the step, its rows, its blocks per row) where no graph is captured.
StepCompiler = Callable[[Callable[[], Tensor], int, int], "EagerReplay"]


class EngineGraphs:
    """The continuous-batching engine's pure-decode steps (every row feeds one token) on
    static buffers, replayed as one CUDA graph per (batch bucket, window), nano-vllm's way.

    A step copies each row's token id, position, write slot, context length and block
    table into :class:`~tinyserve.paged.DecodeBuffers` (one copy), pads the rows to a bucket
    with padding rows (the scratch block's slot: no real row reads it), and replays the
    graph of its bucket and window: every row gathers all the window's blocks of its table
    and is masked by its length on the device (:class:`~tinyserve.paged.DecodeLayout`), so
    one graph serves every mix of lengths up to the window. The window is the longest
    context rounded up to a power of two from 64
    (:func:`~tinyserve.backends.static.window_for`), as in the compiled step: gathering the
    whole context window would read far more keys than short requests hold. :meth:`warmup`
    captures every (bucket, window) up front, into the device's shared pool (the time each
    took is kept in ``capture_seconds``); the logits land in one static buffer ``logits``.

    With ``capture=False`` (the default where CUDA is absent) the very same step runs
    eagerly on the same buffers (an :class:`EagerReplay` per shape): that is how the
    buckets, the padding, the buffers and the warm-up are tested on a CPU against the
    engine's plain step. Given a ``compiler`` instead (the CPU fast path), each shape's step
    is compiled, once, on the parked buffers: a compile takes tens of seconds, so nothing is
    compiled up front by the engine; :meth:`prepare` compiles the shapes a run needs, and a
    shape not prepared compiles at its first step.
    """

    def __init__(self, model: TinyLlama, cache: PagedKVCache, max_rows: int, *,
                 capture: bool | None = None, compiler: StepCompiler | None = None) -> None:
        self.model, self.cache, self.device = model, cache, model.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {self.device}")
        if self.capture and compiler is not None:
            raise ValueError("a step is either captured (CUDA graphs) or compiled, not both")
        self.compiler = compiler
        self.in_use = False            # held by an engine (a kept set is lent to one at a time)
        self.context = model.config.max_position_embeddings
        self.max_rows = bucket_for(min(max_rows, MAX_BATCH))
        self.max_blocks = -(-self.context // cache.block_size)
        self.buffers = DecodeBuffers(cache, self.max_rows, self.max_blocks)
        self.logits = torch.zeros(self.max_rows, model.config.vocab_size, device=self.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | EagerReplay] = {}
        self.capture_seconds: dict[tuple[int, int], float] = {}
        self.captures = 0                              # shapes captured, warm-ups included
        self.steps = 0                                 # steps taken through these buffers
        self._captured_from: tuple | None = None
        # False after an eager step: the next replay first checks that the weights the
        # graphs read have not moved (an eager step rebuilds a stacked copy that changed).
        self.checked = False

    def shape(self, rows: int, longest: int) -> tuple[int, int]:
        """(bucket, blocks per row) of a step of ``rows`` rows whose longest context is
        ``longest`` tokens."""
        window = window_for(longest, self.context)
        return bucket_for(rows, self.max_rows), min(-(-window // self.cache.block_size),
                                                    self.max_blocks)

    def _check_weights(self) -> None:
        """After an eager step (or when lent to a new engine), remake every graph or compiled
        step if the weights they read moved or changed: all at once, before the step."""
        if not (self.capture or self.compiler is not None) or self.checked:
            return
        if self.graphs and self._weights() != self._captured_from:
            held = list(self.graphs)
            self.graphs.clear()                       # every graph reads moved weights:
            if self.capture:                          # all captured again, at once
                self.warmup()
            else:                                     # compiled again, the shapes held
                for shape in held:
                    self._capture(*shape)
        self.checked = True

    def covering(self, bucket: int, blocks: int) -> tuple[int, int]:
        """The shape a step of ``bucket`` rows and ``blocks`` blocks runs at: itself, or, for
        compiled steps, the smallest one held that is at least as large (more padding rows,
        more masked blocks: the same tokens), so that a run that prepared its largest shape
        never stops to compile a smaller one as its rows leave or before its contexts grow.
        A compile costs tens of seconds; the padding, a fraction of one step. Captured
        graphs are all made up front, so they always take their own shape."""
        if self.compiler is None or (bucket, blocks) in self.graphs:
            return bucket, blocks
        larger = [s for s in self.graphs if s[0] >= bucket and s[1] >= blocks]
        return min(larger) if larger else (bucket, blocks)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (bucket, blocks) a step can take, largest first: the order :meth:`warmup`
        captures them in, so the shared pool is sized by the largest graph at once and the
        smaller ones reuse its memory (nano-vllm captures its buckets in that order)."""
        longest, windows = SMALLEST_WINDOW, []
        while longest < self.context:                  # window_for's powers of two, then
            windows.append(longest)                    # the context window itself
            longest *= 2
        windows.append(self.context)
        return sorted({self.shape(rows, w) for rows in buckets(self.max_rows)
                       for w in windows}, reverse=True)

    def prepare(self, rows: Sequence[int], tokens: int,
                progress: bool = True) -> dict[tuple[int, int], float]:
        """Make ready (capture, or compile) the step of each bucket holding ``rows`` rows at
        the window holding ``tokens`` positions, if not already; return the seconds each
        shape took now (0.0 for one held already), a progress bar while it runs."""
        from tqdm.auto import tqdm
        self._check_weights()
        shapes = list(dict.fromkeys(self.shape(r, tokens) for r in rows))
        out = {}
        with tqdm(total=len(shapes), desc="preparing decode steps", unit="shape",
                  disable=not progress) as bar:
            for shape in shapes:
                held = shape in self.graphs
                if not held:
                    self._capture(*shape)
                out[shape] = 0.0 if held else self.capture_seconds[shape]
                if progress:
                    note = getattr(self.graphs[shape], "note", "")   # the fast path's choice
                    bar.write(f"engine decode {shape[0]} rows x {shape[1]} blocks: "
                              f"{out[shape]:.1f} s" + (" (held)" if held else "")
                              + (f"; {note}" if note else ""))
                bar.update()
        self.checked = True
        return out

    def warmup(self, progress: bool | None = None) -> None:
        """Capture every shape not yet captured (:meth:`shapes`), before any request: a
        capture mid-stream would stall that step's requests. ``progress`` (default: when
        capturing for real) shows a progress line."""
        from tqdm.auto import tqdm
        todo = [s for s in self.shapes() if s not in self.graphs]
        show = self.capture if progress is None else progress
        for rows, blocks in tqdm(todo, desc="capturing decode graphs", unit="graph",
                                 disable=not show or not todo, leave=False):
            self._capture(rows, blocks)
        self.checked = True

    def _weights(self) -> tuple:
        """What the steps were made from: for captured graphs every address they read
        (:func:`weight_addresses`); for compiled steps, which hold the weights frozen (a
        copy, as constants), the parameters themselves and their in-place versions: a weight
        replaced or changed in place compiles again, while the stacked copies an eager step
        rebuilds (which a frozen step never reads) do not."""
        if self.compiler is None:
            return weight_addresses(self.model)
        held = [*self.model.parameters(), *self.model.buffers()]
        return tuple(t.data_ptr() for t in held), sum(t._version for t in held)

    def _forward(self, rows: int, blocks: int) -> Tensor:
        layout = self.cache.prepare_decode(self.buffers, rows, blocks)
        self.logits[:rows].copy_(self.model(layout.input_ids, None, self.cache)[0])
        return self.logits[:rows]

    @torch.no_grad()
    def _capture(self, rows: int, blocks: int) -> torch.cuda.CUDAGraph | EagerReplay:
        start = time.perf_counter()
        step = functools.partial(self._forward, rows, blocks)
        if self.capture or self.compiler is not None:
            if self.graphs and self._weights() != self._captured_from:
                self.graphs.clear()                   # the others read moved weights
            self.buffers.park()                       # made on padding rows: the scratch
        if self.compiler is not None:                 # slot is all they write
            # One eager step first: it makes the stacked weight copies (model.fused_linear),
            # which the compiled step then traces as one matmul for q, k, v (and one for
            # gate, up), as the compiled decoder does after its eager prefill; without them
            # the step would trace five separate matmuls.
            step()
            graph: torch.cuda.CUDAGraph | EagerReplay = self.compiler(step, rows, blocks)
            graph.replay()                            # compiles
            self._captured_from = self._weights()
        elif not self.capture:
            graph = EagerReplay(step)
        else:
            graph, _ = record(step, self.device)
            self._captured_from = self._weights()
        self.graphs[rows, blocks] = graph
        self.captures += 1
        self.capture_seconds[rows, blocks] = time.perf_counter() - start
        return graph

    @torch.no_grad()
    def step(self, token_ids: Sequence[int], positions: Sequence[int],
             tables: Sequence[Sequence[int]]) -> Tensor:
        """Next-token logits (rows, vocab) of ``token_ids[r]`` at ``positions[r]`` in the
        sequence whose block table is ``tables[r]`` (its blocks must hold 0..position).
        A view of the static ``logits`` buffer: valid until the next step."""
        rows = len(positions)
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"a static decode step takes 1 to {self.max_rows} rows, got {rows}")
        bucket, blocks = self.covering(*self.shape(rows, max(positions) + 1))
        self.steps += 1
        self._check_weights()
        # Captured up front (warmup); only a decoder used without one captures here.
        graph = self.graphs.get((bucket, blocks)) or self._capture(bucket, blocks)
        self.buffers.fill(token_ids, positions, tables, bucket)
        graph.replay()
        return self.logits[:rows]

"""A compiled decode step: the same model, traced once into fused kernels (opt-in).

Eager PyTorch runs a decode step as a few hundred small operations, each dispatched from
Python (and on a GPU, each a kernel launch). For a small model at batch 1 that dispatch,
not memory traffic, is most of the step. ``torch.compile`` traces the step into a graph and
fuses it; on CUDA, mode ``"reduce-overhead"`` also records it as a CUDA graph, so a step
is one launch replayed.

Tracing needs *static shapes*, which the contiguous :class:`~tinyserve.kv_cache.KVCache` does
not have (its keys grow each step, and it keeps lengths on the host). So this module brings:

- :class:`StaticKVCache`: every row owns the whole window, always returned whole; which slots
  a query may see is computed from the positions on the device (slot ``s`` is visible to a
  row at position ``p`` when ``s <= p``), so nothing in a step reads back to the host;
- :class:`CompiledDecoder`: one compiled step per (model, batch bucket), prefill left eager
  (it runs once per request and its shapes vary);
- :func:`generate_compiled`: static-batch greedy or sampled generation on it, the compiled
  twin of :func:`~tinyserve.generate.generate_batch` (tests check they give equal tokens).

Batches are padded up to a bucket (1, 2, 4, ... 64) so a handful of graphs serve every size,
and the cache holds only the window a request needs, rounded up to a power of two (64, 128,
... the model's context window): attention in a static graph reads every slot of the cache,
so a 512-slot cache would make a 100-token request read five times the keys it has. One
graph per (batch bucket, window) pair, each compiled on first use.
"""
from __future__ import annotations

from collections.abc import Sequence
import time

import torch
from torch import Tensor

from .config import ModelConfig
from .decoder_cache import DecoderCache
from .model import TinyLlama
from .sampling import SamplingParams, sample_with

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SMALLEST_WINDOW = 64


def bucket_for(batch: int) -> int:
    """The smallest batch bucket that holds ``batch`` rows."""
    for b in BUCKETS:
        if batch <= b:
            return b
    raise ValueError(f"a compiled decode step takes at most {BUCKETS[-1]} rows, got {batch}; "
                     f"split the batch or run it eagerly (without --compile)")


def window_for(tokens: int, context_window: int) -> int:
    """The cache length for requests of up to ``tokens`` positions (prompt + output): the
    smallest power of two from :data:`SMALLEST_WINDOW` that holds them, at most the model's
    ``context_window``."""
    if tokens > context_window:
        raise ValueError(f"{tokens} positions do not fit the context window of "
                         f"{context_window}; shorten the prompt or lower max_tokens")
    window = SMALLEST_WINDOW
    while window < tokens:
        window *= 2
    return min(window, context_window)


class StaticKVCache:
    """Keys and values for ``batch_size`` rows of ``max_seq`` slots (default: the model's
    context window), fixed shapes.

    Implements the model's ``KVStore`` protocol like :class:`~tinyserve.kv_cache.KVCache`, but
    keeps no lengths on the host: it returns all ``max_seq`` slots every step, each with
    position ``s`` if the row has reached it (``s <= `` the row's current position) and
    ``-1`` otherwise. Stale slots from a longer earlier request are therefore invisible
    until overwritten, and a row's tokens must be written in order from position 0.

    Layout: one tensor per layer for K and one for V, each ``(batch, max_seq, n_kv_heads,
    head_dim)``; viewed as ``(batch * max_seq)`` rows it lets a step write every row's new
    token with one in-place ``index_copy_`` at row ``b * max_seq + position``. Both choices
    avoid a whole-cache copy per step in the compiled graph: an indexed assignment into the
    head-first layout, or a write into one layer of a tensor stacking all layers, is
    traced as "copy the cache (or the layer), then write" (seen in inductor's generated
    code: one copy per layer of the bucket's whole window, which made batch 8 and 64 slower
    compiled than eager). Attention reads it through a transposed view, no copy.
    """

    def __init__(self, config: ModelConfig, batch_size: int, *, device: torch.device | str,
                 dtype: torch.dtype, max_seq: int | None = None) -> None:
        self.config, self.batch_size = config, batch_size
        self.max_seq = max_seq or config.max_position_embeddings
        shape = (batch_size, self.max_seq, config.num_key_value_heads, config.head_dim)
        layers = range(config.num_hidden_layers)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in layers]
        self.slots = torch.arange(self.max_seq, device=device)
        self.row_starts = torch.arange(batch_size, device=device) * self.max_seq

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    def mark_static(self) -> None:
        """Tell ``torch.compile`` the buffers keep their addresses: the CUDA graph that
        mode ``"reduce-overhead"`` records then reads and writes these very tensors instead
        of copying them in at every replay. (The hand-captured graphs of
        :mod:`tinyserve.cuda_graph` need no marker: they replay whatever addresses they saw.)"""
        for t in (*self.k, *self.v, self.slots, self.row_starts):
            torch._dynamo.mark_static_address(t)

    def update(self, layer: int, k: Tensor, v: Tensor,
               positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write keys and values (B, n_kv, T, head_dim) at ``positions`` (B, T); return the
        whole window (B, n_kv, max_seq, head_dim) and each slot's position (B, max_seq),
        -1 for slots not yet reached."""
        B, n_kv, T, hd = k.shape
        index = (self.row_starts[:, None] + positions).reshape(B * T)
        for cache, new in ((self.k[layer], k), (self.v[layer], v)):
            cache.view(B * self.max_seq, n_kv, hd).index_copy_(
                0, index, new.transpose(1, 2).reshape(B * T, n_kv, hd))
        reached = positions.max(dim=1, keepdim=True).values             # (B, 1)
        k_positions = torch.where(self.slots[None, :] <= reached, self.slots, -1)
        return self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2), k_positions


class CompiledDecoder:
    """A static cache for one batch bucket and a compiled decode step over it.

    ``mode`` defaults to ``"reduce-overhead"`` on CUDA (CUDA graphs) and ``"default"``
    elsewhere (fused C++ kernels on a CPU). The first :meth:`step` compiles (seconds to a
    minute); :attr:`compile_seconds` records how long that took. ``backend="eager"`` only
    traces (TorchDynamo, no code generation): it checks in seconds that the step is one graph
    with static shapes, and runs it op by op.
    """

    def __init__(self, model: TinyLlama, batch_size: int, mode: str | None = None,
                 backend: str = "inductor", window: int | None = None) -> None:
        self.model = model
        self.cache = StaticKVCache(model.config, batch_size, device=model.device,
                                   dtype=model.dtype, max_seq=window)
        self.cache.mark_static()
        self.backend = backend
        self.mode = None if backend != "inductor" else \
            mode or ("reduce-overhead" if model.device.type == "cuda" else "default")
        # On a CPU, inductor's "C++ wrapper" also writes the code that calls the kernels in
        # C++ instead of Python: at batch 1 on this course's CPU that took 5-10% off a step of
        # under 2 ms. (A mode and options cannot both be given; the default mode has none.)
        options = {"cpp_wrapper": True} if self.mode == "default" else None
        self._step = torch.compile(self._forward, backend=backend,
                                   mode=None if options else self.mode, options=options,
                                   fullgraph=True, dynamic=False)
        self.compile_seconds: float | None = None

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
        start = time.perf_counter()
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        logits = self._step(tokens, positions).clone()
        if first:
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)
            self.compile_seconds = time.perf_counter() - start
        return logits


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
_DECODERS: DecoderCache[CompiledDecoder] = DecoderCache(MAX_DECODERS)


def compiled_decoder(model: TinyLlama, batch: int, mode: str | None = None,
                     backend: str = "inductor", tokens: int | None = None) -> CompiledDecoder:
    """The decoder for ``model``, the bucket holding ``batch`` rows and the window holding
    ``tokens`` positions per row (default: the whole context window), compiled once and
    reused (compiling again for every request would cost more than it saves); at most
    :data:`MAX_DECODERS` are kept (see :mod:`tinyserve.decoder_cache`)."""
    context = model.config.max_position_embeddings
    window = window_for(context if tokens is None else tokens, context)
    key = (bucket_for(batch), window, mode, backend)
    return _DECODERS.get(model, key, lambda: CompiledDecoder(model, key[0], mode, backend,
                                                             window), exclusive=False)


@torch.no_grad()
def generate_compiled(model: TinyLlama, prompts: Sequence[list[int]], max_tokens: int, *,
                      sampling: SamplingParams = SamplingParams(),
                      stop_ids: tuple[int, ...] = (), mode: str | None = None,
                      backend: str = "inductor") -> list[list[int]]:
    """Static batching with the compiled decode step: the same rules and the same tokens as
    :func:`~tinyserve.generate.generate_batch` (right-padded prompts, stopped rows computed
    but dropped), with the batch padded up to its bucket by dummy rows."""
    from .prompts import PromptError, check_prompt
    if not prompts:
        raise PromptError("no prompts given")
    window = model.config.max_position_embeddings
    for p in prompts:
        check_prompt(p, max_tokens, window)
    longest = max(len(p) for p in prompts)
    decoder = compiled_decoder(model, len(prompts), mode, backend,
                               tokens=min(window, longest + max_tokens))
    device, B, bucket = model.device, len(prompts), decoder.cache.batch_size
    lengths = [len(p) for p in prompts] + [1] * (bucket - len(prompts))
    pad = model.config.pad_token_id
    rows = [list(p) for p in prompts] + [[pad]] * (bucket - len(prompts))
    padded = torch.tensor([r + [pad] * (max(lengths) - len(r)) for r in rows], device=device)
    last = torch.tensor(lengths, device=device) - 1
    logits = decoder.prefill(padded)[torch.arange(bucket, device=device), last]
    generator = sampling.generator()
    steps = min(max_tokens, window - max(lengths))
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(steps):
        tokens = sample_with(logits[:B], sampling, generator)
        for b, t in enumerate(tokens.tolist()):
            if not done[b]:
                out[b].append(t)
                done[b] = t in stop_ids
        if all(done) or step == steps - 1:
            break
        last = last + 1
        feed = torch.cat([tokens, torch.full((bucket - B,), pad, device=device,
                                             dtype=tokens.dtype)])
        logits = decoder.step(feed, last)
    return out

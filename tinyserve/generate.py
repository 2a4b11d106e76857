"""Generation: the plain recompute loop, and the same loop with a KV cache and a clock.

``generate_ids`` is the plainest loop: re-run the whole sequence for every new token. It is
the reference every faster path (KV cache, batching, speculation) is checked against. Its
cost grows with the sequence on every step, which the KV-cache chapter measures.

``generate_stream`` is what a server does for one request: it yields each token as soon as
it is sampled and records the request's timestamps (arrival, admitted, prefill start and
end, every token, finish) in a :class:`~tinyserve.metrics.RequestTrace`. ``use_cache``
switches the KV cache on or off inside the *same* code, so the two can be compared fairly.

What is new with the cache, in two functions: :func:`prefill` runs the prompt once and fills
the cache; :func:`decode_step` feeds one token per row at its position and appends its key
and value. Without the cache, "decode" is the whole sequence again. (:func:`extend`, the
step for a few tokens per row, is what speculative decoding adds: it runs on the same code.)

The loops choose the decode backend (:mod:`tinyserve.backends`: a step on fixed buffers,
captured as a CUDA graph or compiled); :func:`generate_compiled` is the static-batch loop
over the compiled step. A backend never runs a loop. ``path="fast"`` asks the loops for the
fastest path this machine has (:mod:`tinyserve.backends.fast`: the compiled step with the
fastest settings on a CPU, the CUDA graphs on a GPU); :func:`prepare` compiles the shapes a
run needs up front, with a progress bar.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from .kv_cache import KVCache
from .metrics import RequestTrace
from .model import TinyLlama
from .paths import cache_dir
from .device import clock, upload  # noqa: F401 - clock: notebooks import it from here
from .prompts import PromptError, check_prompt  # noqa: F401 - the loops' callers import them here
from .sampling import SamplingParams, sample, sample_rows, sample_with
from .step_path import PATHS, PathName, resolve

__all__ = ["PromptError", "RequestTrace", "check_prompt", "generate_ids", "prefill",
           "extend", "decode_step", "generate_stream", "generate", "generate_batch",
           "generate_compiled", "prepare", "clock"]


@torch.no_grad()
def generate_ids(model: TinyLlama, prompt_ids: list[int], max_tokens: int, *,
                 temperature: float = 0.0, seed: int | None = None,
                 stop_ids: tuple[int, ...] = ()) -> Iterator[int]:
    """Yield up to ``max_tokens`` new token ids, stopping early at any of ``stop_ids`` (the
    stop token is yielded) or at the end of the context window."""
    window = model.config.max_position_embeddings
    check_prompt(prompt_ids, max_tokens, window)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    ids = torch.tensor([prompt_ids], device=model.device)
    for _ in range(min(max_tokens, window - len(prompt_ids))):
        logits = model(ids)[:, -1]                       # recompute everything, keep the last
        token = sample(logits, temperature, generator)   # (1,)
        yield int(token)
        if int(token) in stop_ids:
            return
        ids = torch.cat([ids, token[:, None]], dim=1)


# Inference mode, not just no_grad: tensors made inside skip autograd's version counters
# and view tracking, which is a measurable share of a decode step of a small model. (The
# logits they return are "inference tensors": read them freely, but not in place.)
@torch.inference_mode()
def prefill(model: TinyLlama, ids: Tensor, cache: KVCache,
            logits_at: Tensor | None = None) -> Tensor:
    """Run the prompts ``ids`` (B, T) through the model once, writing every position's key
    and value into ``cache``; return the logits of every position (B, T, vocab), or only
    of the positions ``logits_at`` (B, len(logits_at), vocab): generation samples from
    each row's last position only, and scoring the vocabulary at every prompt position
    would cost as much as a few decode steps."""
    if _knows_positions(model, cache) and not any(cache.lengths):
        positions = None     # 0..T-1 from the empty cache's host lengths: nothing read back
    else:                    # any model-like callable (a shard, a learner's model)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    if logits_at is None:
        return model(ids, positions, cache)
    return model(ids, positions, cache, logits_at=logits_at)


def _knows_positions(model: object, cache: object) -> bool:
    """Whether ``model(ids, None, cache)`` takes its positions from the cache's host lengths
    (this package's model with a cache that has ``step_positions``). Other model-like
    callables (a tensor-parallel shard, a learner's model) read ``None`` as "0..T-1, no
    cache" or not at all: they are always given explicit positions."""
    return isinstance(model, TinyLlama) and hasattr(cache, "step_positions")


@torch.inference_mode()
def extend(model: TinyLlama, tokens: Tensor, positions: Tensor | None, cache: KVCache) -> Tensor:
    """Feed T tokens per row (B, T) at their positions (B, T), right after what ``cache``
    holds; return their logits (B, T, vocab).

    The one cached forward pass every decoding loop shares: a decode step is T = 1,
    speculative decoding's verify pass feeds the last token and k guesses (T = k + 1),
    and its draft model catches up on the 1 or 2 tokens it has not seen.

    ``positions=None``: each row's tokens go right after what the cache holds, positions
    taken from the lengths the cache keeps on the host, so the pass reads nothing back from
    the device. Explicit positions are the reference (they may overwrite, and must be read
    back to be checked: two host reads per pass, a synchronisation each on a GPU).
    A model-like callable that does not take positions from a cache (a shard, a learner's
    model) is given them explicitly, built from the same host lengths.
    """
    if positions is None and not _knows_positions(model, cache):
        positions = upload(list(cache.lengths), tokens.device)[:, None] + \
            torch.arange(tokens.shape[1], device=tokens.device)
    return model(tokens, positions, cache)


@torch.inference_mode()
def decode_step(model: TinyLlama, tokens: Tensor, positions: Tensor | None,
                cache: KVCache) -> Tensor:
    """Feed one token per row (B,) at its position (B,); return next-token logits (B, vocab).

    The new token's query attends to every cached key of its row, so this costs one token's
    matmuls plus an attention over the row so far, instead of a pass over the whole row.
    ``positions=None``: the position after each row's cached tokens (see :func:`extend`).
    """
    return extend(model, tokens[:, None], None if positions is None else positions[:, None],
                  cache)[:, -1]


def eager_passes(model: TinyLlama, fast: bool, ids: Tensor) -> contextlib.AbstractContextManager:
    """What a loop holds around an eager pass over ``ids`` (the prefill): with ``fast``, the
    fast path's (:func:`tinyserve.backends.fast.eager_passes`: on a CPU, linears over weights
    packed once where that measured faster for a pass of this size), otherwise nothing."""
    if not fast:
        return contextlib.nullcontext()
    from .backends.fast import eager_passes as fast_eager_passes
    return fast_eager_passes(model, ids.numel(), cache=cache_dir())


def prepare(model: TinyLlama, shapes, *, progress: bool = True) -> list:
    """Compile (on CUDA: capture) the fast path's ``shapes`` up front, a progress bar and a
    line per shape; return their costs in seconds (:func:`tinyserve.backends.fast.prepare`,
    whose ``Shape``, ``verify_shape`` and ``draft_shape`` name them). The kernels go to the
    persistent cache (:func:`tinyserve.paths.cache_dir`), so a second run reads them."""
    from .backends import fast
    return fast.prepare(model, shapes, progress=progress, cache=cache_dir())


def _admit(model: TinyLlama, tokens: int, use_cache: bool, compile: bool, graph: bool,
           fast: bool = False) -> tuple:
    """Admission of one request: its KV memory reserved (prompt + output slots) on the decode
    path asked for: (compiled decoder, graph decoder, cache), the unused ones None."""
    decoder = graphed = None
    if compile and fast:
        from .backends.fast import fast_decoder
        decoder = fast_decoder(model, 1, tokens, cache=cache_dir())
    elif compile:
        from .backends.compiled import compiled_decoder
        decoder = compiled_decoder(model, 1, tokens=tokens, cache=cache_dir())
    elif graph:
        from .backends.cuda_graph import graph_decoder
        graphed = graph_decoder(model, 1, tokens=tokens)
    cache = (decoder.cache if decoder is not None else None if graphed is not None else
             KVCache.for_model(model, 1, tokens) if use_cache else None)
    return decoder, graphed, cache


@torch.no_grad()
def generate_stream(model: TinyLlama, prompt_ids: list[int], max_tokens: int, *,
                    sampling: SamplingParams = SamplingParams(),
                    stop_ids: tuple[int, ...] = (), use_cache: bool = True,
                    trace: RequestTrace | None = None,
                    path: PathName = "auto") -> Iterator[int]:
    """Yield up to ``max_tokens`` new tokens as they are sampled; record timestamps in
    ``trace`` if given (its ``arrival`` is kept, so a caller can stamp it when the request
    really arrived). Stops after a stop token (yielded) or at the end of the context window.

    ``path`` (:mod:`tinyserve.step_path`) says how decode steps run: ``"auto"`` (a CUDA
    graph on a GPU: :mod:`tinyserve.backends.cuda_graph`, static buffers, the step captured
    once and replayed; the eager step on the plain KV cache elsewhere), ``"eager"``,
    ``"graph"`` (the static-buffer code on any device; on a CPU it runs eagerly: the same
    code, no capture), ``"compiled"`` (:mod:`tinyserve.backends.compiled`: a static cache
    and a ``torch.compile``-d step; the first request pays the compile time) or ``"fast"``
    (:mod:`tinyserve.backends.fast`: on CUDA the graph; on a CPU each step shape's fastest
    way here, compiled or eager, timed once and kept on disk). Every path but ``"eager"``
    needs the KV cache. Tokens are the eager path's; :func:`prepare` makes the fast path's
    shapes ready ahead of the first request.

    A step reads one value back from the device: the sampled token, which the host needs
    anyway (to yield it and to stop). Positions come from the host's count.
    """
    device = model.device
    how = resolve(path, device, use_cache=use_cache, where="generate")
    compile, graph, fast = how.compiled, how.graph, how.fast
    if trace is None:
        trace = RequestTrace(prompt_tokens=len(prompt_ids), arrival=clock(device))
    trace.prompt_tokens, trace.use_cache = len(prompt_ids), use_cache
    window = model.config.max_position_embeddings
    check_prompt(prompt_ids, max_tokens, window)
    steps = min(max_tokens, window - len(prompt_ids))
    decoder, graphed, cache = _admit(model, len(prompt_ids) + steps, use_cache, compile, graph,
                                     fast)
    generator = sampling.generator(device)
    ids = torch.tensor([prompt_ids], device=device)
    trace.admitted = clock(device)
    try:
        trace.prefill_start = clock(device)
        last = torch.tensor([len(prompt_ids) - 1], device=device)
        with eager_passes(model, fast, ids):
            if graphed is not None:
                logits = graphed.prefill(ids, [len(prompt_ids)])
            elif cache is not None:
                logits = prefill(model, ids, cache, logits_at=last)[:, -1]
            else:
                logits = model(ids, logits_at=last)[:, -1]
        trace.prefill_end = clock(device)
        position = len(prompt_ids)
        trace.finish_reason = "length" if steps == max_tokens else "window"
        for step in range(steps):
            token = sample_rows(logits, [sampling], [generator])   # (1,), on the device
            token_id = int(token)                  # the step's one read: waits for the device
            trace.token_times.append(time.perf_counter())
            trace.tokens.append(token_id)
            yield token_id
            if token_id in stop_ids:
                trace.finish_reason = "stop"
                break
            if step == steps - 1:
                break  # no forward pass for a token nobody will sample
            if graphed is not None:
                logits = graphed.step(token, [position])
            elif decoder is not None:
                logits = decoder.step(token, upload([position], device))
            elif cache is not None:
                logits = decode_step(model, token, None, cache)   # at the cache's length
            else:
                ids = torch.cat([ids, token[:, None]], dim=1)
                logits = model(ids)[:, -1]                     # the whole sequence, again
            position += 1
        trace.finish = clock(device)
    finally:
        if graphed is not None:
            graphed.release()   # the next request may use its buffers


def generate(model: TinyLlama, prompt_ids: list[int], max_tokens: int, *,
             sampling: SamplingParams = SamplingParams(), stop_ids: tuple[int, ...] = (),
             use_cache: bool = True, path: PathName = "auto") -> RequestTrace:
    """Run :func:`generate_stream` to the end; the trace holds the tokens and timestamps."""
    trace = RequestTrace(prompt_tokens=len(prompt_ids), arrival=clock(model.device))
    for _ in generate_stream(model, prompt_ids, max_tokens, sampling=sampling,
                             stop_ids=stop_ids, use_cache=use_cache, trace=trace, path=path):
        pass
    return trace


@torch.no_grad()
def generate_batch(model: TinyLlama, prompts: Sequence[list[int]], max_tokens: int, *,
                   sampling: SamplingParams = SamplingParams(), stop_ids: tuple[int, ...] = (),
                   use_cache: bool = True, path: PathName = "auto") -> list[list[int]]:
    """Static batching: every prompt advances one token per step until all are done.

    Prompts of different lengths are right-padded into one tensor. Padding sits in each
    row's future, so the causal mask already hides it from the real tokens; with the cache,
    ``rewind`` then forgets the pads' slots and decode overwrites them. A row that has
    stopped keeps being computed (that is static batching's waste) but its tokens are
    dropped. Returns each row's new tokens. With sampling, all rows draw from one seeded
    stream, so a seeded batch is reproducible, though a row's tokens differ from the same
    prompt run alone with that seed.

    ``path`` as in :func:`generate_stream` but ``"compiled"`` (that is
    :func:`generate_compiled`): by default a CUDA graph on a GPU (the batch padded up to the
    graph's bucket), the eager step on the plain cache elsewhere; ``"fast"`` on a CPU pads the
    batch to its bucket's step. One read per step: the rows' sampled tokens.
    """
    if not prompts:
        raise PromptError("no prompts given")
    window = model.config.max_position_embeddings
    for p in prompts:
        check_prompt(p, max_tokens, window)
    device, B = model.device, len(prompts)
    how = resolve(path, device, use_cache=use_cache, where="generate_batch",
                  allowed=BATCH_PATHS)
    compiled, graph, fast = how.compiled, how.graph, how.fast
    lengths = [len(p) for p in prompts]
    steps = min(max_tokens, window - max(lengths))
    pad = model.config.pad_token_id
    padded = torch.tensor([p + [pad] * (max(lengths) - len(p)) for p in prompts], device=device)
    last = torch.tensor(lengths, device=device) - 1         # each row's last real position
    rows = torch.arange(B, device=device)
    generator = sampling.generator(device)

    graphed, decoder, cache = _admit_batch(model, B, max(lengths) + steps, use_cache, graph,
                                           compiled)
    try:
        with eager_passes(model, fast, padded):
            if graphed is not None:
                logits = graphed.prefill(padded, lengths)
            elif decoder is not None:
                logits, feed = _bucket_prefill(decoder, padded, lengths)
            elif cache is not None:
                # Only the rows' last prompt positions are scored, each distinct one once
                # (equal lengths share it): (B, distinct, vocab), row b's at [b, which[b]].
                ends, which = _distinct_ends(lengths, device)
                logits = prefill(model, padded, cache, logits_at=ends)[rows, which]
                cache.rewind(lengths)
            else:
                seqs = [list(p) for p in prompts]
                logits = model(padded)[rows, last]
        out: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        for step in range(steps):
            # Every row draws from the one stream, in row order.
            tokens = sample_rows(logits, [sampling] * B, [generator] * B)   # (B,)
            for b, t in enumerate(tokens.tolist()):          # the step's one read
                if not done[b]:
                    out[b].append(t)
                    done[b] = t in stop_ids
            if all(done) or step == steps - 1:
                break
            if graphed is not None:
                logits = graphed.step(tokens, [n + step for n in lengths])
            elif decoder is not None:
                logits = feed(tokens, step)
            elif cache is not None:
                logits = decode_step(model, tokens, None, cache)  # at each row's length
            else:
                last = last + 1
                for b, t in enumerate(tokens.tolist()):
                    seqs[b].append(t)
                width = max(len(s) for s in seqs)
                ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)
                logits = model(ids)[rows, last]
    finally:
        if graphed is not None:
            graphed.release()
    return out


#: The paths :func:`generate_batch` takes (``"compiled"`` is :func:`generate_compiled`).
BATCH_PATHS = tuple(p for p in PATHS if p != "compiled")


def _admit_batch(model: TinyLlama, B: int, tokens: int, use_cache: bool, graph: bool,
                 compiled: bool) -> tuple:
    """A static batch's KV memory (``tokens`` slots a row) on the decode path asked for:
    (graph decoder, fast compiled decoder, cache), the unused ones None."""
    if graph:
        from .backends.cuda_graph import graph_decoder
        return graph_decoder(model, B, tokens=tokens), None, None
    if compiled:
        from .backends.fast import fast_decoder
        return None, fast_decoder(model, B, tokens, cache=cache_dir()), None
    return None, None, KVCache.for_model(model, B, tokens) if use_cache else None


def _bucket_prefill(decoder, padded: Tensor, lengths: list[int]) -> tuple:
    """Prefill right-padded prompts (B, T) on a compiled decoder, the batch padded up to its
    bucket by one-token dummy rows (:func:`generate_compiled`'s rule): the B rows' next-token
    logits, and ``feed(tokens, step)``: decode step ``step``'s logits for tokens (B,)."""
    B, bucket, device = len(lengths), decoder.cache.batch_size, padded.device
    pad = decoder.model.config.pad_token_id
    dummies = torch.full((bucket - B, padded.shape[1]), pad, device=device)
    last = torch.tensor(lengths, device=device) - 1
    logits = decoder.prefill(torch.cat([padded, dummies]))[torch.arange(B, device=device), last]
    fill = torch.full((bucket - B,), pad, device=device)
    positions = torch.tensor(lengths + [1] * (bucket - B), device=device)

    def feed(tokens: Tensor, step: int) -> Tensor:
        return decoder.step(torch.cat([tokens, fill.to(tokens.dtype)]), positions + step)[:B]
    return logits, feed


def _distinct_ends(lengths: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """Each row's last prompt position, as (the distinct ones in order, which one each row
    has): worked out on the host, where the lengths are (``torch.unique`` would read them
    back from the device)."""
    ends = sorted(set(n - 1 for n in lengths))
    which = [ends.index(n - 1) for n in lengths]
    return upload(ends, device), upload(which, device)


@torch.no_grad()
def generate_compiled(model: TinyLlama, prompts: Sequence[list[int]], max_tokens: int, *,
                      sampling: SamplingParams = SamplingParams(),
                      stop_ids: tuple[int, ...] = (), mode: str | None = None,
                      backend: str = "inductor") -> list[list[int]]:
    """Static batching with the compiled decode step: the same rules and the same tokens as
    :func:`~tinyserve.generate.generate_batch` (right-padded prompts, stopped rows computed
    but dropped), with the batch padded up to its bucket by dummy rows: the loop over
    :mod:`tinyserve.backends.compiled`'s step, which the backend leaves to the loops."""
    from .backends.compiled import compiled_decoder
    if not prompts:
        raise PromptError("no prompts given")
    window = model.config.max_position_embeddings
    for p in prompts:
        check_prompt(p, max_tokens, window)
    longest = max(len(p) for p in prompts)
    decoder = compiled_decoder(model, len(prompts), mode, backend,
                               tokens=min(window, longest + max_tokens), cache=cache_dir())
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

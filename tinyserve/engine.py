"""The continuous-batching engine: schedule, execute, post-process, once per step.

::

    engine = Engine(model, EngineConfig(num_blocks=64))
    engine.add_request(prompt_ids, max_tokens=32)
    while engine.has_unfinished():
        for event in engine.step():      # (request id, new token, finished?) per sequence
            ...

A step asks the :class:`~tinyserve.scheduler.Scheduler` for a batch, hands it to an
*executor* that computes it, and then updates every sequence: tokens computed, a new token
sampled where a sequence reached its end, timestamps, finish (stop token, ``max_tokens`` or
the context window) and the blocks it returns. Two executors share this loop:
:class:`ModelExecutor` runs the real model over a paged KV cache, and
:class:`~tinyserve.simulator.SimulatedExecutor` charges a calibrated cost on a virtual
clock, so scheduling experiments with thousands of requests take seconds. On CUDA the
model executor replays each pure-decode step (every row one token) as a CUDA graph
(:class:`~tinyserve.backends.cuda_graph.EngineGraphs`), every (bucket, window) of them captured when
the executor is made, before any request; ``EngineConfig(path="graph")`` runs that same
static-buffer step eagerly on a CPU. ``EngineConfig(path="fast")`` asks for the fastest path
this machine has (:mod:`tinyserve.backends.fast`): the graphs on CUDA; on a CPU each
(bucket, window) of the same static-buffer step runs its fastest way here (compiled with the
fast recipe, eager over packed weights, or eager; timed once and kept), each shape made ready
by :meth:`Engine.prepare` or, failing that, at its first step.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from .block_manager import BlockManager
from .backends.cuda_graph import EngineGraphs
from .backends.fast import ShapeCost, eager_passes, engine_steps, prepare_eager
from .device import upload
from .generate import PromptError, check_prompt
from .model import TinyLlama
from .paged import PagedKVCache, RowSpec
from .paths import cache_dir
from .step_path import PATHS, PathName, resolve
from .policies import Policy
from .sampling import SamplingParams, sample_rows
from .scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from .sequence import Sequence, SeqStatus


@dataclass
class EngineConfig:
    num_blocks: int = 128
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    static: bool = False
    policy: str | Policy = "fcfs"
    # How a step runs (tinyserve.step_path, the one switch every loop takes): "auto" (CUDA
    # graphs for pure-decode steps on CUDA, eager elsewhere), "eager", "graph" (static-buffer
    # decode steps: replayed as CUDA graphs on CUDA, run eagerly elsewhere), "compiled" (the
    # token-wise layers compiled: backends.compiled.compile_token_layers) or "fast" (the
    # fastest here: the graphs on CUDA; on a CPU each decode shape's fastest way, timed once
    # and kept; Engine.prepare makes the shapes a run needs ready).
    path: PathName = "auto"

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"EngineConfig: path={self.path!r} is not one of "
                             f"{', '.join(map(repr, PATHS))}")

    @property
    def fast(self) -> bool:
        """Whether the engine runs the fast path."""
        return self.path == "fast"

    def decode_path(self, device: torch.device) -> tuple[bool, bool, bool]:
        """(static-buffer decode steps?, compiled decode steps?, compiled token-wise layers?)
        on ``device``."""
        how = resolve(self.path, device, where="EngineConfig")
        if how.fast:
            return True, device.type != "cuda", False
        return how.graph, False, how.compiled


@dataclass(frozen=True)
class StepRecord:
    """What one step computed and how long it took (the simulator's calibration data)."""

    num_tokens: int
    num_rows: int
    attention_pairs: int
    seconds: float
    decode_kv_tokens: int = 0   # ScheduledBatch.decode_kv_tokens (last: it came later)


@dataclass(frozen=True)
class StepEvent:
    seq_id: str
    token_id: int
    finished: bool
    finish_reason: str | None


class Executor(Protocol):
    def now(self) -> float: ...
    def wait_until(self, t: float) -> None: ...
    def execute(self, batch: ScheduledBatch, blocks: BlockManager) -> list[int | None]: ...


class ModelExecutor:
    """Runs a step on the real model: one forward pass over every scheduled token.

    With ``graph``, a step whose every row feeds one token goes through
    :class:`~tinyserve.backends.cuda_graph.EngineGraphs` instead (up to ``max_num_seqs`` rows): a
    replayed CUDA graph where ``capture`` (default: on CUDA), the same static-buffer step
    run eagerly otherwise. Prefill and mixed steps always take the eager path. Every graph
    is captured here, at start-up (nano-vllm's way): a capture on the first step of a
    shape would stall the requests in that step. With ``compiled`` (``path="fast"`` on a CPU)
    the steps are compiled instead, per shape, by :meth:`Engine.prepare` or at a shape's
    first step, and kept with their pool for the next engine of the same model and sizes
    (:func:`~tinyserve.backends.fast.engine_steps`)."""

    def __init__(self, model: TinyLlama, num_blocks: int, block_size: int, *,
                 graph: bool = False, max_num_seqs: int = 16,
                 capture: bool | None = None, compiled: bool = False) -> None:
        self.model = model
        if compiled:    # compiled per shape, by prepare() or at a shape's first step; the
            # steps (and their pool) of an earlier engine of these sizes are reused
            self.graphs: EngineGraphs | None = engine_steps(
                model, num_blocks, block_size, max_num_seqs, cache=cache_dir())
            self.cache = self.graphs.cache
            weakref.finalize(self, setattr, self.graphs, "in_use", False)
            # Prefill and mixed steps stay eager: on the fast path's linears (packed weights
            # where that measured faster here).
            self._eager = functools.partial(eager_passes, model, cache=cache_dir())
            return
        self._eager = lambda tokens: contextlib.nullcontext()
        self.cache = PagedKVCache(model.config, num_blocks, block_size,
                                  device=model.device, dtype=model.dtype, scratch=graph)
        self.graphs = EngineGraphs(model, self.cache, max_num_seqs, capture=capture) \
            if graph else None
        if self.graphs is not None:
            self.graphs.warmup()

    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch, blocks: BlockManager) -> list[int | None]:
        """One forward pass over the batch's new tokens, then a token for every row that
        reached the end of its sequence. The step's inputs go to the device in one copy
        (:class:`~tinyserve.paged.StepLayout`) and the sampled tokens come back in one read:
        the only point where the host waits for the device."""
        if self.graphs is not None:
            if len(batch) <= self.graphs.max_rows and all(n == 1 for n in batch.num_new_tokens):
                return self._execute_decode(batch, blocks)
            self.graphs.checked = False   # an eager step may rebuild the stacked weights
        rows = []
        bs = blocks.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed
            # Slot of position p: table[p // block_size] * block_size + p % block_size. Only
            # the new tokens' slots are listed; the cache reads the context by block.
            table = blocks.tables[seq.seq_id].blocks
            new = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            # Only a row that reaches the end of its sequence samples; a prefill chunk that
            # is not the last one produces no token, so its logits are never computed.
            rows.append(RowSpec(new_slots=new, context_slots=None, start=start,
                                block_table=table, token_ids=seq.token_ids[start:start + n],
                                sample=start + n >= seq.num_tokens))
        layout = self.cache.prepare(rows)
        sampled = [seq for seq, row in zip(batch.seqs, rows) if row.sample]
        # positions=None: the paged cache hands the model the positions it was prepared with.
        with self._eager(layout.input_ids.numel()):
            logits = self.model(layout.input_ids, None, self.cache,
                                logits_at=layout.logits_at)[0]
        tokens = iter(sample_rows(logits, [seq.sampling for seq in sampled],
                                  [self._generator(seq) for seq in sampled]).tolist()
                      if sampled else [])             # the step's one read from the device
        return [next(tokens) if row.sample else None for row in rows]

    def _execute_decode(self, batch: ScheduledBatch, blocks: BlockManager) -> list[int | None]:
        """A pure-decode step through the static buffers: each row's token at its position,
        then :meth:`execute`'s sampling, for the rows that reach their sequence's end (all
        of them but a one-token prefill chunk that is not a prompt's last)."""
        assert self.graphs is not None
        starts = [seq.num_computed for seq in batch.seqs]
        logits = self.graphs.step([seq.token_ids[p] for seq, p in zip(batch.seqs, starts)],
                                  starts, [blocks.tables[seq.seq_id].blocks for seq in batch.seqs])
        sample = [p + 1 >= seq.num_tokens for seq, p in zip(batch.seqs, starts)]
        sampled = [seq for seq, s in zip(batch.seqs, sample) if s]
        if not sampled:
            return [None] * len(sample)
        if len(sampled) < len(sample):
            logits = logits.index_select(0, upload([i for i, s in enumerate(sample) if s],
                                                   logits.device))
        tokens = iter(sample_rows(logits, [seq.sampling for seq in sampled],
                                  [self._generator(seq) for seq in sampled]).tolist())
        return [next(tokens) if s else None for s in sample]

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """The request's seeded generator, on the model's device (where its draws are made).

        A sequence is created with a CPU generator; on another device it is replaced by one
        seeded the same before its first draw (only the executor draws from it)."""
        gen = seq.generator
        if gen is not None and gen.device.type != self.model.device.type:
            gen = seq.generator = seq.sampling.generator(self.model.device)
        return gen


class Engine:
    def __init__(self, model: TinyLlama | None = None, config: EngineConfig | None = None, *,
                 executor: Executor | None = None, context_window: int | None = None,
                 record_steps: bool = False) -> None:
        self.config = config = config or EngineConfig()
        if executor is None:
            if model is None:
                raise ValueError("give a model, or an executor (e.g. a SimulatedExecutor)")
            graph, compiled, layers = config.decode_path(model.device)
            if layers:
                from .backends.compiled import compile_token_layers
                compile_token_layers(model)
            executor = ModelExecutor(model, config.num_blocks, config.block_size, graph=graph,
                                     max_num_seqs=config.max_num_seqs, compiled=compiled)
        self.executor = executor
        self.context_window = context_window or (model.config.max_position_embeddings
                                                 if model is not None else 1 << 30)
        self.blocks = BlockManager(config.num_blocks, config.block_size,
                                   config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            config.chunked_prefill, config.static),
            self.blocks, config.policy, self.context_window)
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.steps = 0
        self.step_log: list[StepRecord] | None = [] if record_steps else None

    def now(self) -> float:
        return self.executor.now()

    def prepare(self, rows: Iterable[int] = (1,), tokens: int | None = None, *,
                progress: bool = True) -> list[ShapeCost]:
        """Make the pure-decode steps of ``rows`` rows (each padded to its bucket) ready for
        requests of up to ``tokens`` positions (prompt + output; default: the context
        window), before any request: on a CPU with ``path="fast"`` each is a compile (tens of
        seconds; kernels kept on disk, so a second process compiles faster), on CUDA the
        graphs are already captured. A compiled step also serves every smaller step (fewer
        rows, shorter contexts: padded, masked), so preparing the most rows a run will hold at
        its longest request is enough; a step larger than any prepared compiles when it
        first comes. A progress bar and a line per shape; returns what each took (0 s for
        one held already). Without static-buffer steps there is nothing to do."""
        graphs = getattr(self.executor, "graphs", None)
        if graphs is None:
            return []
        tokens = self.context_window if tokens is None else tokens
        if not 1 <= tokens <= self.context_window:
            raise ValueError(f"tokens={tokens}: a request holds 1 to {self.context_window} "
                             f"positions (the context window)")
        done = graphs.prepare(list(rows), tokens, progress=progress)
        costs = [ShapeCost(f"engine decode {b} rows x {n} blocks", s, s > 0)
                 for (b, n), s in done.items()]
        if self.config.fast:     # the prefill's weights, where its linears run packed here
            packing = prepare_eager(getattr(self.executor, "model"),
                                    say=print if progress else None, cache=cache_dir())
            costs += [packing] if packing is not None else []
        return costs

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], max_tokens: int, *,
                    sampling: SamplingParams = SamplingParams(), stop_ids: Iterable[int] = (),
                    request_id: str | None = None, arrival: float | None = None) -> Sequence:
        """Queue a request; raises :class:`PromptError` if it can never be served."""
        check_prompt(prompt_ids, max_tokens, self.context_window)
        seq_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if seq_id in self.seqs and not self.seqs[seq_id].finished:
            raise ValueError(f"request id {seq_id!r} is already in use")
        seq = Sequence(seq_id, list(prompt_ids), max_tokens, sampling, tuple(stop_ids),
                       arrival=self.now() if arrival is None else arrival)
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            raise PromptError(str(e)) from None
        self.seqs[seq_id] = seq
        return seq

    def abort(self, seq_id: str) -> None:
        seq = self.seqs[seq_id]
        if not seq.finished:
            self.scheduler.abort(seq)
            seq.trace.finish, seq.trace.finish_reason = self.now(), "abort"

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        start = self.now()
        for seq in batch.seqs:
            if seq.trace.admitted is None:
                seq.trace.admitted = start
            if seq.trace.prefill_start is None:
                seq.trace.prefill_start = start
        features = (batch.num_tokens, len(batch), batch.attention_pairs)
        kv = batch.decode_kv_tokens
        tokens = self.executor.execute(batch, self.blocks)
        now = self.now()
        if self.step_log is not None:
            self.step_log.append(StepRecord(*features, now - start, kv))
        self.steps += 1
        events = []
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, tokens):
            seq.num_computed += n
            if token is None:
                continue
            self.blocks.register_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed)
            if seq.trace.prefill_end is None:
                seq.trace.prefill_end = now
            seq.output_ids.append(token)
            seq.trace.tokens.append(token)
            seq.trace.token_times.append(now)
            reason = self._finish_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
                seq.trace.finish, seq.trace.finish_reason = now, reason
            events.append(StepEvent(seq.seq_id, token, reason is not None, reason))
        return events

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.stop_ids:
            return "stop"
        if len(seq.output_ids) >= seq.max_tokens:
            return "length"
        if seq.num_tokens >= self.context_window:
            return "window"
        return None

    def run(self) -> list[Sequence]:
        """Step until every queued request is done; return them in the order they were added."""
        while self.has_unfinished():
            self.step()
        return list(self.seqs.values())


def generate_many(model: TinyLlama, prompts: list[list[int]], max_tokens: int,
                  config: EngineConfig | None = None, **kwargs: object) -> list[list[int]]:
    """Serve every prompt through the engine at once; each one's new tokens, in order."""
    engine = Engine(model, config)
    seqs = [engine.add_request(p, max_tokens, **kwargs) for p in prompts]  # type: ignore[arg-type]
    engine.run()
    return [s.output_ids for s in seqs]


__all__ = ["Engine", "EngineConfig", "ModelExecutor", "StepEvent", "StepRecord", "generate_many",
           "PromptError", "SeqStatus"]

"""The engine on a virtual clock: a calibrated cost model instead of the model.

Scheduling questions (which policy, what token budget, how many slots, what happens at 2x
the load) need thousands of requests, and a real run of thousands of requests takes hours on
a laptop and never gives the same numbers twice. The simulator keeps the *same* engine,
scheduler and block manager and swaps only the executor: a step costs

    seconds = step + token * tokens + row * rows + pair * query-key pairs + kv * decode KV reads

where ``tokens`` is everything computed in the step (prefill chunks + decodes), ``rows`` the
sequences in it, ``pairs`` the attention scores (each new token times its context) and
``decode KV reads`` the cached tokens the decode rows read (rows x the longest one's context:
they are gathered as one padded batch). The last term is apart from the pairs because the
two kinds of attention cost differently per pair: a prefill chunk scores many queries
against each key it reads (arithmetic), a decode row one query per key, so its cost is the
reading of its cache (memory); one constant for both fit the many-row decode steps badly,
where two fit every measured shape closely. The constants come from a least-squares fit to
steps of the real model measured on this machine (:func:`calibrate`); the shipped fit is in
``assets/cost_model.json``, with its median and largest error, and ``bench decode`` holds the
engine's steps against it (``engine_vs_cost_model_*``).
Produced tokens are placeholders: requests end at their ``max_tokens``.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .block_manager import BlockManager
from .engine import Engine, EngineConfig, StepRecord
from .metrics import RequestTrace
from .paths import ASSETS
from .scheduler import ScheduledBatch
from .sequence import Sequence as Seq
from .sequence import SeqStatus
from .workload import RequestSpec, prompt_ids

COST_MODEL_PATH = ASSETS / "cost_model.json"
FILLER_TOKEN = 6   # what a simulated step "generates"; never a stop token


@dataclass(frozen=True)
class CostModel:
    step: float = 2.0e-3     # seconds per step: Python, kernel launches, per-layer overheads
    token: float = 2.0e-5    # seconds per token computed (weights read once per step)
    row: float = 1.0e-5      # seconds per sequence in the step (gathers, sampling)
    pair: float = 1.0e-8     # seconds per query-key pair scored by attention
    kv: float = 0.0          # seconds per cached token a decode row reads (the gather)

    def seconds(self, num_tokens: int, num_rows: int, attention_pairs: int,
                decode_kv_tokens: int = 0) -> float:
        return (self.step + self.token * num_tokens + self.row * num_rows
                + self.pair * attention_pairs + self.kv * decode_kv_tokens)

    @classmethod
    def load(cls, path: str | Path = COST_MODEL_PATH) -> "CostModel":
        data = json.loads(Path(path).read_text())
        return cls(**data["constants"])


def describe_cost_model(path: str | Path = COST_MODEL_PATH) -> str:
    """Where a saved fit comes from, in one line: the date, the machine and its load, the
    commit of the engine it timed, and how well it fits, e.g. ``fitted 2026-12-02 on 2 x86_64
    CPUs (1 torch thread, torch 2.13.0+cpu, load 0.98), commit caa3440, R^2 0.998 over 35
    shapes (median error 3%)``. A chapter prints it next to its figures, so a reader knows
    which engine and machine the simulated milliseconds describe. Fields an older file lacks
    read "unrecorded"."""
    data = json.loads(Path(path).read_text())
    machine, fit = data.get("machine", {}), data.get("fit", {})
    date = str(data.get("date", "unrecorded"))[:10]
    where = (f"{machine['cpu_count']} {machine.get('processor') or ''} CPUs".replace("  ", " ")
             if machine.get("cpu_count") else "an unrecorded machine")
    if machine.get("cuda"):
        where += f" with CUDA {machine['cuda']}"
    threads = machine.get("torch_threads", data.get("threads"))
    details = [f"{threads} torch thread{'s' if threads != 1 else ''}" if threads else None,
               f"torch {machine['torch']}" if machine.get("torch") else None,
               f"load {data['load']:.2f}" if isinstance(data.get("load"), (int, float)) else None]
    commit = str(data["git_commit"])[:7] if data.get("git_commit") else "unrecorded"
    quality = "fit quality unrecorded"
    if {"r2", "steps", "median_abs_rel_error"} <= fit.keys():
        quality = (f"R^2 {fit['r2']:.3f} over {fit['steps']} shapes "
                   f"(median error {fit['median_abs_rel_error']:.0%})")
    inner = ", ".join(d for d in details if d)
    return (f"fitted {date} on {where}" + (f" ({inner})" if inner else "")
            + f", commit {commit}, {quality}")


def calibrate(records: Sequence[StepRecord]) -> tuple[CostModel, dict[str, float]]:
    """Least-squares fit of the cost model to measured steps, and how well it fits.

    Constants are kept non-negative (a negative cost per token would be an artefact of noise):
    a term that fits negative is dropped and the rest refitted.
    """
    if len(records) < 8:
        raise ValueError(f"need at least 8 measured steps to fit 5 constants, got {len(records)}")
    X = np.array([[1.0, r.num_tokens, r.num_rows, r.attention_pairs, r.decode_kv_tokens]
                  for r in records])
    y = np.array([r.seconds for r in records])
    # Relative least squares (each row divided by its time): a 3 ms decode step matters as
    # much as a 120 ms prefill, and decode steps are most of what a server runs.
    Xw, yw = X / y[:, None], np.ones_like(y)
    keep = [0, 1, 2, 3, 4]
    while True:
        coef, *_ = np.linalg.lstsq(Xw[:, keep], yw, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(5)
    full[keep] = np.clip(coef, 0, None)
    pred = X @ full
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
    fit = {"r2": 1 - ss_res / ss_tot,
           "median_abs_rel_error": float(np.median(np.abs(pred - y) / y)),
           "max_abs_rel_error": float(np.max(np.abs(pred - y) / y)),
           "steps": len(records)}
    return CostModel(*full.tolist()), fit


class SimulatedExecutor:
    """Charges each step its modelled cost on a virtual clock; runs no model."""

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost or CostModel.load()
        self.clock = 0.0

    def now(self) -> float:
        return self.clock

    def wait_until(self, t: float) -> None:
        self.clock = max(self.clock, t)

    def execute(self, batch: ScheduledBatch, blocks: BlockManager) -> list[int | None]:
        self.clock += self.cost.seconds(batch.num_tokens, len(batch), batch.attention_pairs,
                                        batch.decode_kv_tokens)
        return [FILLER_TOKEN if s.num_computed + n >= s.num_tokens else None
                for s, n in zip(batch.seqs, batch.num_new_tokens)]


def simulated_engine(config: EngineConfig, cost: CostModel | None = None,
                     context_window: int = 512) -> Engine:
    return Engine(config=config, executor=SimulatedExecutor(cost), context_window=context_window)


def serve(engine: Engine, specs: Sequence[RequestSpec], vocab_size: int = 4096,
          seed: int = 0, max_queue: int | None = None,
          on_step: Callable[[Engine], None] | None = None, progress: bool = False,
          ) -> list[Seq]:
    """Feed ``specs`` to ``engine`` at their arrival times and step until all are done.

    Works the same on a real engine (wall clock; it sleeps when idle) and a simulated one
    (virtual clock; it jumps). A request's arrival is its scheduled time, so time spent
    waiting for a busy engine to look at the queue counts as queueing, as it would for a
    user. With ``max_queue``, a request that finds that many already waiting is rejected
    (finish reason ``"rejected"``) instead of queued: the overload policy of chapter 5.
    ``on_step(engine)`` is called after every step (to sample memory use, queue length...);
    ``progress`` shows a bar of finished requests (a real run can take minutes).
    """
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival)
    t0 = engine.now()
    seqs: list[Seq] = []
    pending = 0
    bar = tqdm(total=len(specs), desc="requests", unit="req", disable=not progress, leave=False)
    while pending < len(order) or engine.has_unfinished():
        now = engine.now() - t0
        while pending < len(order) and specs[order[pending]].arrival <= now:
            i = order[pending]
            spec = specs[i]
            ids = prompt_ids(spec, i, vocab_size, seed)
            if max_queue is not None and engine.num_waiting >= max_queue:
                seqs.append(_rejected(f"r{i}", ids, spec, t0 + spec.arrival, engine.now()))
            else:
                seqs.append(engine.add_request(ids, spec.output_len, request_id=f"r{i}",
                                               arrival=t0 + spec.arrival))
            pending += 1
        if engine.has_unfinished():
            finished = sum(e.finished for e in engine.step())
            if on_step is not None:
                on_step(engine)
            bar.update(finished)
        elif pending < len(order):
            engine.executor.wait_until(t0 + specs[order[pending]].arrival)
    bar.close()
    return seqs


def _rejected(seq_id: str, ids: list[int], spec: RequestSpec, arrival: float, now: float) -> Seq:
    seq = Seq(seq_id, ids, spec.output_len, arrival=arrival)
    seq.status, seq.finish_reason = SeqStatus.FINISHED, "rejected"
    seq.trace.finish, seq.trace.finish_reason = now, "rejected"
    return seq


def completed_traces(seqs: Sequence[Seq]) -> list[RequestTrace]:
    return [s.trace for s in seqs if s.finish_reason in ("stop", "length", "window")]


def save_cost_model(cost: CostModel, fit: dict[str, Any], meta: dict[str, Any],
                    path: str | Path = COST_MODEL_PATH) -> None:
    Path(path).write_text(json.dumps({"constants": asdict(cost), "fit": fit, **meta},
                                     indent=2) + "\n")


def calibration_shapes(window: int) -> list[list[tuple[int, int]]]:
    """The batch shapes :func:`measure_steps` times, each a list of (context before, new
    tokens) per row: decode batches (1-64 sequences at contexts from 32 to most of the
    window, and 16 of different lengths), prefill chunks (16 tokens to most of the window,
    fresh or after cached tokens),
    and mixtures (decodes plus one chunk)."""
    shapes: list[list[tuple[int, int]]] = []
    for rows in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (32, window // 4, window * 3 // 4):
            shapes.append([(ctx, 1)] * rows)
    # Rows of different lengths, as in a real decode batch: the padding to the longest is
    # what separates the gather's cost (rows x longest) from the sum of the contexts.
    shapes.append([(32 + (window - 64) * i // 15, 1) for i in range(16)])
    for n in (window // 32, window // 8, window // 4, window // 2, window - 32):
        shapes.append([(0, n)])
        if n <= window // 2:
            shapes.append([(window // 2 - 16, n)])
    for rows in (4, 16):
        for n in (window // 16, window // 4):
            shapes.append([(window // 4, 1)] * rows + [(0, n)])
    return shapes


def measure_steps(model: Any, *, repeats: int = 5, seed: int = 0,
                  shapes: list[list[tuple[int, int]]] | None = None) -> list[StepRecord]:
    """Time the real model's step on ``shapes`` (default :func:`calibration_shapes`; each a
    list of rows ``(cached tokens, new tokens)``) and return one record per shape.

    Each shape runs through :class:`ModelExecutor` exactly as the engine runs a step (slots
    from block tables, one flat forward, sampling), ``repeats`` times, and the *fastest* is
    kept: on a shared machine the others measure the neighbours; the fastest is the step's
    own cost. The repeats go round the whole grid (shape 1, 2, ..., then 1, 2, ... again),
    so a burst of load from another process slows one timing of many shapes rather than
    every timing of one.
    """
    from .engine import ModelExecutor
    rng = np.random.default_rng(seed)
    if shapes is None:
        shapes = calibration_shapes(model.config.max_position_embeddings)
    block_size = 16
    # Every shape keeps its blocks for the whole run (the repeats go round the grid).
    need = sum(-(-(ctx + n) // block_size) for shape in shapes for ctx, n in shape)
    blocks = BlockManager(need, block_size, enable_prefix_caching=False)
    # As the engine runs it: on CUDA its pure-decode steps replay CUDA graphs (all captured
    # when the executor is made), elsewhere every step is eager.
    executor = ModelExecutor(model, blocks.num_blocks, block_size,
                             graph=model.device.type == "cuda",
                             max_num_seqs=max(len(shape) for shape in shapes))
    batches = []
    for i, shape in enumerate(shapes):
        batch = ScheduledBatch()
        for j, (ctx, n) in enumerate(shape):
            ids = rng.integers(6, model.config.vocab_size, ctx + n).tolist()
            seq = Seq(f"m{i}-{j}", ids, 1)
            blocks.allocate(seq.seq_id, ids)
            seq.num_computed = ctx
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
        executor.execute(batch, blocks)                # warm-up: first-call costs
        batches.append(batch)
    best = [float("inf")] * len(batches)
    for _ in range(repeats):
        for i, batch in enumerate(batches):
            start = executor.now()
            executor.execute(batch, blocks)
            best[i] = min(best[i], executor.now() - start)
    return [StepRecord(b.num_tokens, len(b), b.attention_pairs, t, b.decode_kv_tokens)
            for b, t in zip(batches, best)]

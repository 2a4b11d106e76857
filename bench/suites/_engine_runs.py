"""What the serving-engine suites (batching, prefix, chunked) share: the model, a run
of a workload through the engine, and the latency figures of that run."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tinyserve.device import default_device
from tinyserve.engine import Engine, EngineConfig
from tinyserve.metrics import SLO, summarize, throughput
from tinyserve.model import TinyLlama
from tinyserve.sequence import Sequence as Seq
from tinyserve.simulator import completed_traces, serve
from tinyserve.workload import RequestSpec

from ..common import load_bench_model


def bench_model(quick: bool) -> tuple[TinyLlama, str]:
    """The shipped target in fp32 (a tiny random model with ``--quick``), one thread on CPU
    unless the caller set otherwise, so a run does not fight other processes for cores."""
    return load_bench_model(quick, default_device())


def run_engine(model: TinyLlama, config: EngineConfig, specs: Sequence[RequestSpec],
               seed: int = 0) -> tuple[list[Seq], Engine]:
    engine = Engine(model, config, record_steps=True)
    warm = Engine(model, config)              # one untimed request: first-call costs
    warm.add_request([7] * 8, 2)
    warm.run()
    seqs = serve(engine, specs, model.config.vocab_size, seed, progress=True)
    return seqs, engine


def figures(seqs: Sequence[Seq], slo: SLO | None = None,
            engine: Engine | None = None) -> dict[str, Any]:
    """Latency percentiles (ms) and throughput of the completed requests of a run, and the
    mean number of sequences per step when the engine recorded its steps."""
    traces = completed_traces(seqs)
    out = {k: round(v, 3) if isinstance(v, float) else v
           for k, v in summarize(traces).items()}
    if engine is not None and engine.step_log:
        out["mean_rows_per_step"] = round(
            sum(r.num_rows for r in engine.step_log) / len(engine.step_log), 3)
    out.update({k: round(v, 3) for k, v in throughput(traces, slo).items()})
    out["preemptions"] = sum(s.preemptions for s in seqs)
    return out


def threads_note() -> str:
    return f"{torch.get_num_threads()} torch thread(s)"

"""Load generator (chapter 9) for any OpenAI-compatible endpoint.

- ``generator``: arrivals, streamed requests, per-request results, run figures, sweeps
  (SLOs and latency summaries are :mod:`tinyserve.metrics`'s, shared with the engine).
- ``prompts``: Harbor-shaped, corpus and ticket prompts of chosen token lengths.
- ``cli``: ``python -m tinyserve loadgen``; ``plot``: the throughput/latency sweep plot.

``from tinyserve.loadgen import run_load`` keeps working: the generator's names are re-exported.
"""
from .generator import TABLE_COLUMNS, Result, knee, run_load, run_metrics, sweep, table_rows

__all__ = ["Result", "TABLE_COLUMNS", "knee", "run_load", "run_metrics", "sweep", "table_rows"]

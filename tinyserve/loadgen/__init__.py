"""Load generator (chapter 9) for any OpenAI-compatible endpoint.

- ``generator``: arrivals, streamed requests, per-request results, SLOs, summaries, sweeps.
- ``prompts``: Harbor-shaped, corpus and ticket prompts of chosen token lengths.
- ``cli``: ``python -m tinyserve loadgen``; ``plot``: the throughput/latency sweep plot.

``from tinyserve.loadgen import run_load`` keeps working: the generator's names are re-exported.
"""
from .generator import (SLOs, TABLE_COLUMNS, Result, knee, run_load, summarize, sweep,
                        table_rows)

__all__ = ["Result", "SLOs", "TABLE_COLUMNS", "knee", "run_load", "summarize", "sweep",
           "table_rows"]

"""KV memory reserved vs used: a contiguous max-length reservation against paged blocks.

A contiguous cache (chapter 2's) reserves a whole context window of slots for every running
sequence at admission, because it cannot know how long the sequence will grow. A paged cache
takes one block at a time. Both are run here as accounting over the *same* schedule (the
engine on the simulator's virtual clock, chat-like traffic at a steady rate); after every step:

- **used**: token slots that hold a token of a running sequence;
- **paged reserved**: blocks in use x block size (a prefix block shared by several
  sequences counts once);
- **contiguous reserved**: running sequences x the context window.

``paged_waste_fraction`` and ``contiguous_waste_fraction`` are 1 - used / reserved, summed
over all steps (smaller is better; vLLM reports under 4% paged). Then the consequence: with
the same KV memory, how many sequences can run at once (contiguous: memory / window;
paged: the peak the engine reaches with every request queued at once). Finally, the pool's
real allocation is checked against the bytes formula of chapter 2. Accounting only, no
timings: the figures are the same on every machine.
"""
from __future__ import annotations

from typing import Any

from tinyserve.workbook.capacity import kv_bytes_for_config
from tinyserve.config import PRESETS
from tinyserve.engine import Engine, EngineConfig
from tinyserve.paged import PagedKVCache
from tinyserve.simulator import CostModel, serve, simulated_engine
from tinyserve.workload import LogNormal, describe, make_workload

from ..common import report, table, write_json

BLOCK_SIZE = 16


def _reservations(specs: list, window: int, blocks: int,
                  block_size: int = BLOCK_SIZE) -> dict[str, int]:
    totals = {"used": 0, "paged": 0, "contiguous": 0, "steps": 0}

    def sample(engine: Engine) -> None:
        running = engine.scheduler.running
        tables = engine.blocks.tables
        totals["used"] += sum(tables[s.seq_id].num_tokens for s in running)
        totals["paged"] += engine.blocks.num_used_blocks * block_size
        totals["contiguous"] += len(running) * window
        totals["steps"] += 1

    engine = simulated_engine(EngineConfig(num_blocks=blocks, block_size=block_size,
                                           max_num_seqs=64, max_num_batched_tokens=512),
                              CostModel(), context_window=window)
    serve(engine, specs, on_step=sample)
    return totals


def _peak_concurrency(specs: list, window: int, blocks: int) -> int:
    peak = [0]
    engine = simulated_engine(EngineConfig(num_blocks=blocks, block_size=BLOCK_SIZE,
                                           max_num_seqs=10_000, max_num_batched_tokens=4096),
                              CostModel(), context_window=window)
    serve(engine, specs, on_step=lambda e: peak.__setitem__(0, max(peak[0], e.num_running)))
    return peak[0]


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    config = PRESETS["target"]
    window = config.max_position_embeddings
    n = 100 if quick else 2000
    specs = make_workload(n, 20.0, LogNormal(80, 0.7, 8, 380), LogNormal(60, 0.8, 4, 128),
                          seed=0)
    t = _reservations(specs, window, blocks=4096)
    paged_waste = 1 - t["used"] / t["paged"]
    # Waste grows with the block size: on average half of each sequence's last block is empty.
    by_block = {}
    for bs in (8, 32):
        other = _reservations(specs, window, 4096 * BLOCK_SIZE // bs, bs)
        by_block[bs] = 1 - other["used"] / other["paged"]
    by_block[BLOCK_SIZE] = paged_waste
    contiguous_waste = 1 - t["used"] / t["contiguous"]

    budget_seqs = 16                                   # KV memory for 16 full windows
    blocks = budget_seqs * window // BLOCK_SIZE
    burst = make_workload(200 if quick else 1000, float("inf"), LogNormal(80, 0.7, 8, 380),
                          LogNormal(60, 0.8, 4, 128), seed=1)
    paged_peak = _peak_concurrency(burst, window, blocks)

    pool = PagedKVCache(config, num_blocks=64, block_size=BLOCK_SIZE)
    formula = kv_bytes_for_config(config, 64 * BLOCK_SIZE, "float32")
    if pool.nbytes != formula:
        raise AssertionError(f"pool allocates {pool.nbytes} bytes, formula says {formula}")

    print(f"{describe(specs)}; block size {BLOCK_SIZE}, window {window}")
    print(table(["cache", "reserved slot-steps", "used slot-steps", "waste"],
                [["contiguous", t["contiguous"], t["used"], f"{contiguous_waste:.1%}"],
                 ["paged", t["paged"], t["used"], f"{paged_waste:.1%}"]]))
    print("paged waste by block size: " + ", ".join(f"{bs}: {w:.1%}" for bs, w in
                                                      sorted(by_block.items())))
    print(f"\nsame KV memory ({budget_seqs} windows = {blocks} blocks): contiguous runs "
          f"{budget_seqs} sequences at once, paged peaked at {paged_peak}")
    print(f"pool of 64 blocks: {pool.nbytes:,} bytes allocated = formula {formula:,}")
    data = report("paged", {"paged_waste_fraction": paged_waste,
                            "contiguous_waste_fraction": contiguous_waste},
                  {"slot_steps": t, "paged_waste_by_block_size": by_block,
                   "concurrency_same_memory": {
                      "kv_memory_windows": budget_seqs, "contiguous": budget_seqs,
                      "paged_peak": paged_peak, "burst_requests": len(burst)},
                   "pool_bytes": pool.nbytes, "formula_bytes": formula},
                  {"workload": describe(specs), "block_size": BLOCK_SIZE, "window": window,
                   "executor": "simulated (accounting only; timings do not enter)"}, quick)
    write_json(data, json_path)
    return data

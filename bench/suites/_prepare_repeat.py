"""``bench scale``'s repeat preparation: the fast path's compile of a chapter's shape in fresh
processes sharing one persistent cache, as a learner's second run of a notebook finds it
(``scale_prepare_repeat_s``)."""
from __future__ import annotations

from typing import Any

from ..common import QUICK_CONFIG

__all__ = ["PREPARE_TOKENS", "prepare_repeat", "repeat_checks"]


#: One process preparing the fast path for one shape, its figures as JSON on its last line:
#: argv ``recipe`` ("fastest", or "traced": :data:`~tinyserve.backends.fast.CPU_RECIPE` set
#: to only trace), ``model`` ("bandwidth", or a tiny model's config as JSON), ``tokens``.
_PREPARE_SCRIPT = """
import json, sys, time
import torch
torch.set_num_threads(1)
from tinyserve.backends import fast
from tinyserve.device import default_device, default_dtype
from tinyserve.paths import cache_dir
recipe, model, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
if recipe == "traced":
    fast.CPU_RECIPE = fast.Recipe((), False, "eager")
device = default_device()
dtype = default_dtype(device)
if model == "bandwidth":
    from tinyserve.checkpoint import load_model
    net = load_model("bandwidth", device=device, dtype=dtype).eval()
else:
    from tinyserve.config import ModelConfig
    from tinyserve.model import TinyLlama
    torch.manual_seed(0)
    net = TinyLlama(ModelConfig(**json.loads(model))).eval().to(device, dtype)
from torch._dynamo.utils import counters
from tinyserve import toolchain
start = time.perf_counter()
if recipe != "traced":
    toolchain.ready(device)      # the fast path probes first anyway; its own compile not counted
graphs_before = counters["stats"]["unique_graphs"]
costs = fast.prepare(net, [fast.Shape(tokens=tokens, batch=1)], progress=False,
                     cache=cache_dir())
total = time.perf_counter() - start
choice = None
if device.type == "cpu":         # the decoder prepare just made (held: nothing is run again)
    d = fast.fast_decoder(net, 1, tokens, cache=cache_dir())
    c = d.choice
    if c is not None:
        choice = {"shape": f"decode {d.cache.batch_size} rows x window {d.cache.max_seq}",
                  "rows": c.rows, "kernel": c.kernel, "seconds": dict(c.seconds),
                  "why": c.why, "sentence": c.sentence()}
print(json.dumps({"total_s": total, "costs": [[c.label, c.seconds, c.compiled] for c in costs],
                  "graphs_compiled": counters["stats"]["unique_graphs"] - graphs_before,
                  "choice": choice}))
"""
#: A chapter's fast shape (one row, a 128-token window), prepared in fresh processes
#: (``--quick``: 32, inside the tiny model's window).
PREPARE_TOKENS = 128


def prepare_repeat(quick: bool) -> dict[str, Any]:
    """:func:`tinyserve.backends.fast.prepare` of a chapter's shape (batch 1, window of
    :data:`PREPARE_TOKENS`) on the scale model in two fresh processes, one after the other,
    sharing one new persistent cache (``TINYSERVE_CACHE_DIR``): the first compiles from
    nothing and times the shape's ways (:mod:`tinyserve.backends.choices`), the second
    finds the first's kernels and its choice. Then a third that only traces the same shape
    (TorchDynamo, no inductor): the part of a repeat no cache removes. Seconds each (from
    the model loaded to the shape ready), and :func:`repeat_checks`: where the first
    process chose eager (or packed), the second reads that choice and compiles nothing.
    ``--quick``: the tiny model, every process only tracing (seconds)."""
    import dataclasses
    import json
    import tempfile
    model = json.dumps(dataclasses.asdict(QUICK_CONFIG)) if quick else "bandwidth"
    recipe, limit = ("traced", 300) if quick else ("fastest", 1800)
    shape = (recipe, model, 32 if quick else PREPARE_TOKENS)
    with tempfile.TemporaryDirectory(prefix="tinyserve-prepare-") as folder:
        first = _prepare_process(*shape, folder, limit)
        second = _prepare_process(*shape, folder, limit)
    with tempfile.TemporaryDirectory(prefix="tinyserve-trace-") as folder:
        traced = _prepare_process("traced", *shape[1:], folder, limit)
    return {"first_s": first["total_s"], "second_s": second["total_s"],
            "trace_s": traced["total_s"], "first_costs": first["costs"],
            "second_costs": second["costs"], "tokens": shape[2], "batch": 1,
            "recipe": recipe, "deadline_s": limit,
            **repeat_checks(first, second)}


def repeat_checks(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """What each process chose for the shape (the first times the ways, the second should
    find that choice kept in the shared folder) and how many graphs each compiled; and
    ``compiled_a_kept_loser``: the second process compiled a graph although the choice it
    read was eager or packed (issue 50: a shape that lost is never compiled again)."""
    kept = second.get("choice") or {}
    return {"first_choice": first.get("choice"), "second_choice": second.get("choice"),
            "first_graphs_compiled": first.get("graphs_compiled"),
            "second_graphs_compiled": second.get("graphs_compiled"),
            "compiled_a_kept_loser": bool(kept.get("why") == "kept"
                                          and kept.get("kernel") != "compiled"
                                          and (second.get("graphs_compiled") or 0) > 0)}


def _prepare_process(recipe: str, model: str, tokens: int, cache: str,
                     limit: float) -> dict[str, Any]:
    """Run :data:`_PREPARE_SCRIPT` in a fresh interpreter (one thread) with ``cache`` as its
    ``TINYSERVE_CACHE_DIR`` and nothing else pointing inductor elsewhere; killed after
    ``limit`` seconds (``subprocess.run``'s timeout kills the child before raising)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FORCE_DISABLE_CACHES")}
    env.update(TINYSERVE_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _PREPARE_SCRIPT, recipe, model,
                           str(tokens)], env=env, capture_output=True, text=True,
                          timeout=limit, cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0:
        raise RuntimeError(f"a prepare process ({recipe}) exited with {done.returncode}: "
                           f"{done.stderr.strip()[-400:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])

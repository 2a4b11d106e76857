"""Start ranks for ``torch.distributed`` from a script, a test or a notebook.

:func:`launch` spawns ``world_size`` processes, joins them in one process group (gloo on the
CPU, nccl when every rank gets its own GPU), runs a worker function on each and hands back
what each returned. Two processes on a laptop stand in for two GPUs: the code and the
collectives are the same, only slower.

Everything is bounded: the rendezvous and every collective time out after ``timeout_s``, and
the parent kills the ranks past the same deadline, so a rank waiting for a peer that crashed
cannot hang a test run. The process group is always destroyed, even when the worker fails.
"""
from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException


def choose_backend(world_size: int) -> str:
    """nccl when every rank gets its own GPU, otherwise gloo with the ranks on the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def rank_device(rank: int) -> torch.device:
    """Where this rank's tensors live: its own GPU under nccl, the CPU under gloo."""
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


class RankError(RuntimeError):
    """A rank raised or died; the message holds the first failing rank's traceback."""


def _first_failure(folder: Path) -> str | None:
    failures = []
    for path in folder.glob("rank*.error"):
        stamp, _, trace = path.read_text().partition("\n")
        failures.append((float(stamp), path.stem, trace))
    if not failures:
        return None
    _, rank, trace = min(failures)
    return f"{rank} failed first:\n{trace}"


def _entry(rank: int, world_size: int, backend: str, folder: str, timeout_s: float,
           worker: Callable[..., Any], args: tuple[Any, ...]) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if "OMP_NUM_THREADS" not in os.environ:
        # The ranks share this machine's cores: more threads than cores and OpenMP threads
        # spin against each other, which would be measured as communication cost.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    # A file in a private temp folder as the rendezvous: no port to pick, nothing to collide.
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result = worker(rank, world_size, *args)
        tmp = Path(folder) / f"rank{rank}.tmp"
        torch.save(result, tmp)
        os.replace(tmp, Path(folder) / f"rank{rank}.pt")  # the parent never reads half a file
    except BaseException:
        # Stamp the failure: when one rank dies its peers fail too ("connection closed by
        # peer"), and the parent reports the earliest failure, the cause.
        (Path(folder) / f"rank{rank}.error").write_text(
            f"{time.monotonic()!r}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def launch(worker: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0,
           backend: str | None = None) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` fresh processes joined in one
    process group; return each rank's result (anything ``torch.save`` can write), rank order.

    The ranks are *spawned*: each is a new interpreter that imports ``worker`` by its module
    and name, so it must live in an importable module, not a notebook cell. Everything is
    bounded by ``timeout_s``: past it the ranks are killed and ``TimeoutError`` is raised.
    """
    qualname = getattr(worker, "__qualname__", "")
    if getattr(worker, "__module__", "__main__") == "__main__" or "<locals>" in qualname:
        raise ValueError(
            f"{qualname or worker!r} cannot be spawned: each rank is a fresh process that "
            f"imports its function by module and name, so define the worker in a .py module "
            f"and import it (functions from a notebook cell or a closure cannot be found)")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    backend = backend or choose_backend(world_size)
    with tempfile.TemporaryDirectory(prefix="tinyserve-ranks-") as folder:
        context = mp.start_processes(_entry, nprocs=world_size, join=False, start_method="spawn",
                                     args=(world_size, backend, folder, timeout_s, worker, args))
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"the {world_size} ranks did not finish within {timeout_s:.0f} s; they "
                        f"were stopped (a rank waiting for a peer that never came?). Raise "
                        f"timeout_s if the work is simply long.")
        except ProcessException as err:
            raise RankError(_first_failure(Path(folder)) or str(err)) from None
        finally:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]

"""How busy the machine is around a benchmark run: the 1-minute load average before and
after, and the threshold past which a run's ratios are not comparable with a quiet run's.

Why it matters: on a shared machine, runs at a load of several times its cores squeezed
every speed ratio towards 1 (both sides wait for a core alike), and such runs read like
regressions.
"""
from __future__ import annotations

import os
from typing import Any

#: A suite runs one torch thread, so it needs one core to itself. Past ``BUSY_PER_CORE`` x
#: cores of other work (1.5 on 2 cores: the other core more than half taken, on average over
#: the minute), the suite's thread shares its core part of the time.
BUSY_PER_CORE = 0.75


def busy_threshold(cores: int | None = None) -> float:
    """The load average above which this machine counts as busy (at least 1.0)."""
    return max(1.0, BUSY_PER_CORE * (cores or os.cpu_count() or 1))


def load_average() -> float:
    """The 1-minute load average (0.0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def stamp(before: float, after: float, own_threads: int = 1) -> dict[str, Any]:
    """The ``load`` a report records. After the run the average includes the suite's own
    ``own_threads``, so it is judged less those."""
    threshold = busy_threshold()
    busy = max(before, after - own_threads) > threshold
    return {"before": round(before, 2), "after": round(after, 2), "busy_above": threshold,
            "busy": busy}


def busy_warning(load: dict[str, Any], what: str) -> str | None:
    """A warning line for a busy run, or None."""
    if not load["busy"]:
        return None
    return (f"warning: {what} ran on a busy machine (load {load['before']:.1f} before, "
            f"{load['after']:.1f} after; busy above {load['busy_above']:.1f}): its ratios are "
            f"not comparable with a quiet run's; re-run when the load is below the threshold")

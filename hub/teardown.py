"""Ending a class hub and everything its accounts started: shared by the hub tests
(tests/test_hub.py) and the class-size run (hub/scale_run.py), which must both leave no
process behind."""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path


def account_processes(uids: Iterable[int]) -> dict[int, str]:
    """The running processes owned by these uids: pid -> command line (first 200 chars)."""
    uids = set(uids)
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid in uids:
                found[int(entry.name)] = (entry / "cmdline").read_bytes() \
                    .replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:      # the process ended while we looked
            continue
    return found


def stop_hub(hub: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to the hub's process group (the hub then stops its servers and proxy), SIGKILL
    if it has not exited within ``timeout`` seconds."""
    if hub.poll() is not None:
        return
    os.killpg(hub.pid, signal.SIGTERM)
    try:
        hub.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(hub.pid, signal.SIGKILL)
        hub.wait()


def kill_leftovers(uids: Iterable[int]) -> dict[int, str]:
    """SIGKILL every process these uids still run; returns what was found (pid -> command)."""
    left = account_processes(uids)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left

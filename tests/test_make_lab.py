"""`make lab`, the README's first command, starts JupyterLab serving this repository, and says
before the address whether the fast path can compile here (``tinyserve.toolchain``)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tinyserve.toolchain import fix_for
from tinyserve.serving.local_servers import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not os.environ.get("CI") and (
                    not (ROOT / ".venv" / "bin" / "jupyter").exists()
                    or Path(sys.prefix).resolve() != (ROOT / ".venv").resolve()),
                    reason="make lab uses the project's .venv; run the tests through `make test`")
def test_make_lab_serves_the_course_and_says_whether_the_fast_path_compiles(
        tmp_path: Path) -> None:
    # A compiler that is not there, so the fast path's line is the same on every machine.
    env = {**os.environ, "CXX": "/nonexistent/g++"}
    printed, log = tmp_path / "make-lab.out", tmp_path / "lab.log"
    port = free_port()
    with open(printed, "wb") as out:
        proc = subprocess.Popen(["make", "-s", "lab", f"LAB_PORT={port}", f"LAB_LOG={log}",
                                 "LAB_FAST_CHECK=80"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{port}/lab/tree/START_HERE.ipynb"
    try:
        deadline = time.monotonic() + 120
        lines: list[str] = []
        while time.monotonic() < deadline and proc.poll() is None:
            lines = printed.read_text(errors="replace").splitlines()
            if address in lines:   # printed once the port is open and the probe has answered
                break
            time.sleep(0.5)
        assert address in lines, f"make lab printed no address: {lines[-20:]}"
        # The fast path's line comes before the address, names the cause and this OS's fix,
        # and the course starts anyway; the line is kept beside the server's log.
        fast = [line for line in lines if line.startswith("fast path")]
        assert len(fast) == 1 and fast[0].startswith("fast path off: no working C++ compiler ("), lines
        assert fix_for("no working C++ compiler") in fast[0]
        assert lines.index(fast[0]) < lines.index("Stop it with Ctrl-C. Open the course at:")
        assert lines[-1] == address
        assert (tmp_path / "lab.fast-path.txt").read_text().strip() == fast[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents/", timeout=5) as r:
            code, listing = r.status, json.loads(r.read())
        names = {item["name"] for item in listing["content"]}
        # No token needed on loopback, and the server's root is the repository.
        assert code == 200 and {"README.md", "tinyserve", "exercises"} <= names
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab", timeout=5) as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM to `make lab`'s session (make, its shell, JupyterLab, the probe), then wait
    until every one of them is gone, not only make (SIGKILL after ``timeout``)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + timeout
        try:
            os.killpg(proc.pid, sig)
            while time.monotonic() < deadline:
                proc.poll()   # reap make itself, or its group never empties
                os.killpg(proc.pid, 0)
                time.sleep(0.2)
        except ProcessLookupError:   # the group is gone
            proc.wait()
            return
    raise AssertionError(f"make lab's processes outlived SIGKILL (group {proc.pid})")

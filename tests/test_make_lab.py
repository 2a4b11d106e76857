"""`make lab`, the README's first command, starts JupyterLab serving this repository."""
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

from tinyserve.serving.local_servers import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not os.environ.get("CI") and (
                    not (ROOT / ".venv" / "bin" / "jupyter").exists()
                    or Path(sys.prefix).resolve() != (ROOT / ".venv").resolve()),
                    reason="make lab uses the project's .venv; run the tests through `make test`")
def test_make_lab_serves_the_course() -> None:
    port = free_port()
    proc = subprocess.Popen(["make", "-s", "lab", f"LAB_PORT={port}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents/", timeout=2) as r:
                    status = r.status, json.loads(r.read())
                break
            except OSError:
                time.sleep(0.5)
        assert status is not None, f"JupyterLab did not answer on port {port}: " + (
            proc.stdout.read().decode(errors="replace")[-2000:] if proc.poll() is not None else "")
        code, listing = status
        names = {item["name"] for item in listing["content"]}
        # No token needed on loopback, and the server's root is the repository.
        assert code == 200 and {"README.md", "tinyserve", "exercises"} <= names
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab", timeout=5) as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)

"""Our server on this machine, for tests, notebooks and load tests: a free loopback port,
the server in a thread of this process (:func:`local_server`), or as separate processes
(:func:`server_processes`, the replicas the router of :mod:`tinyserve.serving.routing` spreads
requests over), each waited on until ``/health`` answers and stopped at the end."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with code {proc.returncode} "
                               f"before it became healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server at {url} did not answer /health within {timeout_s:g} s")


@contextmanager
def server_processes(n: int = 1, args: Sequence[str] = (), threads: int = 1,
                     timeout_s: float = 120.0) -> Iterator[list[str]]:
    """Start ``n`` ``python -m tinyserve serve`` processes on free loopback ports (each with
    ``threads`` torch threads), yield their base URLs, stop them at the end (SIGTERM: they
    drain, then exit)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    procs, urls = [], []
    try:
        for _ in range(n):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tinyserve", "serve", "--port", str(port), *args],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs):
            wait_healthy(url, timeout_s, proc)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def local_server(model_name: str = "target", **app_kwargs: Any) -> Iterator[tuple[str, Any]]:
    """Our server in a thread of this process on a free loopback port: yields ``(url, app)``
    (``app.state.server.engine`` is the live engine) and shuts it down at the end.
    Handy in a notebook or a test; for measurements prefer :func:`server_processes`, where
    the client does not share the interpreter with the engine."""
    import threading

    import uvicorn

    from .server import create_app
    app = create_app(model_name, **app_kwargs)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="tinyserve-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server thread did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        if thread.is_alive():
            raise RuntimeError("the server thread did not shut down within 30 s")

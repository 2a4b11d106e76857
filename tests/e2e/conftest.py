"""Browser tests: JupyterLab (started with `make lab` on a loopback port, serving a throwaway
copy of the course) driven by Playwright in the OS package's headless Chromium.

Where they can run: the `playwright` pip package (test extra) and a `chromium` executable
(`make system-deps` installs it as root; Playwright's own browser download is never used).
Elsewhere they skip with the reason, except in CI (`CI` set), where a missing piece must fail
the run rather than hide it, as with the sandbox tests.

Every test writes its screenshots, the server's log and the browser console to
artifacts/e2e/TEST_NAME/ (git-ignored); a failing test adds failure.png there.
"""
from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .jlab import ROOT, LabServer

ARTIFACTS = ROOT / "artifacts" / "e2e"

# Headless and quiet: without the background-networking flags Chromium keeps trying to reach
# Google's services, which this machine refuses (noisily).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    return os.environ.get("E2E_CHROMIUM") or shutil.which("chromium") \
        or shutil.which("chromium-browser")


@functools.lru_cache(maxsize=1)
def browser_skip_reason() -> str | None:
    """Why the browser tests cannot run here, or None when they can (always None in CI)."""
    if os.environ.get("CI"):
        return None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "needs the playwright package: pip install -e '.[test]' (or make test)"
    if chromium_path() is None:
        return "needs the chromium browser: apt-get install chromium (make system-deps, as root)"
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        return "starts JupyterLab with `make lab`, which uses the project's .venv: run make e2e"
    return None


def pytest_configure(config: pytest.Config) -> None:
    # Assertions on the page wait up to 30 s (a busy 2-core machine), not Playwright's 5 s.
    try:
        from playwright.sync_api import expect
    except ImportError:
        return
    expect.set_options(timeout=30_000)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = browser_skip_reason()
    if reason is None:
        return
    for item in items:
        if "page" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    report = yield
    if report.when == "call":
        item.e2e_failed = report.failed  # type: ignore[attr-defined]
    return report


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Path:
    """A fresh folder for this test's screenshots and logs (kept after the run)."""
    folder = ARTIFACTS / request.node.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


@pytest.fixture
def page(request: pytest.FixtureRequest, artifacts: Path,
         start_lab) -> Iterator["Page"]:  # type: ignore[no-untyped-def]  # noqa: F821
    """A Chromium page with a fresh profile; generous but bounded waits (60 s each).

    Depends on start_lab so that the server outlives the page: a failure screenshot then shows
    what the learner saw, not a lost connection."""
    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    assert exe, "no chromium executable: apt-get install chromium (or set E2E_CHROMIUM)"
    console: list[str] = []
    with tempfile.TemporaryDirectory(prefix="e2e-profile-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=exe, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900})
        pg = context.pages[0] if context.pages else context.new_page()
        pg.set_default_timeout(60_000)
        pg.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        pg.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        try:
            yield pg
        finally:
            if getattr(request.node, "e2e_failed", True):
                try:
                    pg.screenshot(path=str(artifacts / "failure.png"))
                except Exception as e:  # the browser may be the thing that broke
                    console.append(f"(no failure screenshot: {e})")
            (artifacts / "console.log").write_text("\n".join(console) + "\n")
            context.close()


@pytest.fixture
def start_lab(artifacts: Path, tmp_path: Path) -> Iterator:
    """Start `make lab` on a free loopback port serving a given folder; stopped afterwards."""
    servers: list[LabServer] = []

    def start(root: Path, role: str = "learner") -> LabServer:
        server = LabServer(root, state_dir=tmp_path / f"lab-state-{len(servers)}",
                           log_path=artifacts / f"lab-{len(servers)}.log", role=role)
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()

"""What the browser tests do in JupyterLab, named the way a learner would say it.

`LabServer` runs the README's own `make lab` (same flags, landing page and settings) against a
throwaway course folder. The page helpers wait on JupyterLab's own selectors, never on sleeps.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from tinyserve.serving.local_servers import free_port

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

ROOT = Path(__file__).resolve().parents[2]
VALIDATE_TIMEOUT_MS = 180_000   # Validate runs the whole notebook server-side (torch import)


def copy_course(dest: Path, *parts: str) -> Path:
    """Copy the named top-level files and folders of the repository into ``dest``."""
    import shutil
    dest.mkdir(parents=True, exist_ok=True)
    for part in parts:
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, dest / part,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        else:
            shutil.copy2(src, dest / part)
    return dest


class LabServer:
    """`make lab LAB_ROOT=root ROLE=role` on a free port, with its own JupyterLab user state.

    ``log_path`` gets what `make lab` prints (the address last); the server's own log goes
    beside it (``server_log``)."""

    def __init__(self, root: Path, *, state_dir: Path, log_path: Path,
                 role: str = "learner") -> None:
        self.root, self.state_dir, self.log_path, self.role = root, state_dir, log_path, role
        self.server_log = log_path.with_suffix(".server.log")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def printed(self) -> list[str]:
        """The lines `make lab` has printed so far."""
        return self.log_path.read_text(errors="replace").splitlines()

    def start(self, timeout: float = 120) -> None:
        env = dict(os.environ)
        # The learner's own settings and workspaces must not leak into (or out of) the test.
        for var, sub in (("JUPYTERLAB_SETTINGS_DIR", "settings"),
                         ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
                         ("JUPYTER_RUNTIME_DIR", "runtime")):
            env[var] = str(self.state_dir / sub)
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            ["make", "-s", "-C", str(ROOT), "lab", f"LAB_PORT={self.port}",
             f"LAB_ROOT={self.root}", f"ROLE={self.role}", f"LAB_LOG={self.server_log}"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`make lab` exited with {self.proc.returncode}: "
                                   + self.log_path.read_text(errors="replace")[-2000:])
            if not any(line.startswith(self.url) for line in self.printed()):
                time.sleep(0.3)   # the address is printed once the port is open
                continue
            try:
                with urllib.request.urlopen(f"{self.url}/api/status", timeout=2) as r:
                    json.loads(r.read())
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"JupyterLab did not answer on port {self.port} within {timeout} s; "
                           f"log: {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# ---- the notebook, as a learner uses it ------------------------------------------------------

def current_notebook(page: "Page") -> "Locator":
    return page.locator(".jp-NotebookPanel:visible")


def reveal(locator: "Locator") -> "Locator":
    """Wait for an element, scroll it into view, and wait until it is visible.

    JupyterLab skips rendering cells outside the viewport (content-visibility), so an output
    far down the notebook exists before it counts as visible."""
    locator.wait_for(state="attached")
    locator.scroll_into_view_if_needed()
    locator.wait_for(state="visible")
    return locator


def wait_for_kernel_idle(page: "Page") -> None:
    """Wait until the current notebook's kernel is connected and idle, as the status bar says
    ("Python 3 (ipykernel) | Idle"); Run All before that can run nothing at all."""
    page.locator(".jp-StatusBar-Item").filter(has_text="| Idle").wait_for()


def run_all_cells(page: "Page") -> None:
    """Run > Run All Cells, once the kernel is ready (JupyterLab stops at the first cell
    that raises)."""
    wait_for_kernel_idle(page)
    page.locator(".lm-MenuBar-item").filter(has_text="Run").first.click()
    page.locator("li[data-command='runmenu:run-all']").click()


def replace_cell_source(page: "Page", editor_text: str, new_source: str) -> None:
    """Replace the whole source of the code cell whose editor contains ``editor_text``.

    The text is inserted in one go (no key presses), so the editor's auto-indent and bracket
    closing cannot change what the learner meant to type."""
    editor = current_notebook(page).locator(".jp-Cell .cm-content").filter(has_text=editor_text)
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(new_source)


def validate(page: "Page") -> "Locator":
    """Press nbgrader's Validate button (it saves, then the server runs the notebook); return
    the results dialog's message once it is there (classes validation-failed / -success)."""
    current_notebook(page).locator(".jp-Toolbar").get_by_role("button", name="Validate").click()
    # Either the results, or nbgrader's error dialog ("Cannot check version", "Cannot
    # validate") when the server side is missing or broken: fail at once, saying which.
    dialog = page.locator(".jp-Dialog").filter(has_text="Validat")
    dialog.wait_for(timeout=VALIDATE_TIMEOUT_MS)
    message = dialog.locator("#validation-message")
    if message.count() == 0:
        raise AssertionError("Validate did not report test results; its dialog says: "
                             + dialog.inner_text()[:500])
    return message


def close_dialog(page: "Page") -> None:
    dialog = page.locator(".jp-Dialog")
    dialog.get_by_role("button", name="Ok").click()
    dialog.wait_for(state="detached")

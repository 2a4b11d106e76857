"""Run a notebook cell by cell in a kernel, surviving whatever the cells do.

On top of nbclient this adds what grading untrusted code needs: a per-cell timeout that first
interrupts and, if the kernel ignores the interrupt, kills it; a wall-clock limit for the whole
notebook; a cap on stored output; a kernel that dies mid-way (every later cell is "not run",
never silently passed); the testkit's integrity guard before every test cell; and a final
integrity report from inside the kernel.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

import nbformat
from jupyter_client import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

ARM = "import autograder.testkit"
# Prepended to every test cell: re-import the helpers (undoing any rebinding) and check the
# kernel for tampering before the test's own code runs.
GUARD = ("from autograder.testkit import check_close, check_equal, check; "
         "__import__('autograder.testkit').testkit._guard()\n")
TIMEOUT_NAME = "CellTimeout"


@dataclass
class CellResult:
    status: str                    # ok | error | timeout | not_run
    ename: str = ""
    evalue: str = ""


@dataclass
class RunReport:
    cells: dict[int, CellResult] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    integrity: dict | None = None
    kernel_died: bool = False
    seconds: float = 0.0


class _Client(NotebookClient):
    """nbclient with a cap on how much output it keeps (a print loop must not fill memory)."""

    output_limit = 2_000_000

    def output(self, outs, msg, display_id, cell_index):  # type: ignore[override]
        content = msg.get("content", {})
        size = len(content.get("text", "")) + sum(
            len(str(v)) for v in (content.get("data") or {}).values()) + len(
            str(content.get("traceback", "")))
        self._out_bytes = getattr(self, "_out_bytes", 0) + size
        if self._out_bytes > self.output_limit:
            if not getattr(self, "_truncated", False):
                self._truncated = True
                outs.append(nbformat.v4.new_output(
                    "stream", name="stderr",
                    text=f"[grader] output over {self.output_limit // 10**6} MB; "
                         "the rest was discarded\n"))
            return None
        return super().output(outs, msg, display_id, cell_index)


def run_notebook(nb: nbformat.NotebookNode, km: AsyncKernelManager, *, cwd: str,
                 env: dict[str, str] | None = None, cell_timeout: float = 60,
                 total_timeout: float = 600, guarded: set[int] | None = None,
                 interrupt_grace: float = 5, startup_timeout: float = 60,
                 kernel_output=None, after_start=None) -> RunReport:
    """Execute ``nb`` in place (outputs are stored on its cells) and report per cell.

    ``km`` must be an *async* kernel manager: nbclient polls the kernel from an event loop,
    and a blocking client would hang it for good when the kernel dies.
    """
    report = RunReport()
    guarded = guarded or set()
    replies: dict[int, dict] = {}

    def on_executed(cell, cell_index, execute_reply):  # nbclient hook
        replies[cell_index] = execute_reply.get("content", {}) if execute_reply else {}

    client = _Client(
        nb, km=km, allow_errors=True, timeout=int(cell_timeout), interrupt_on_timeout=True,
        error_on_timeout={"ename": TIMEOUT_NAME, "evalue": "cell timed out", "traceback": []},
        startup_timeout=int(startup_timeout), iopub_timeout=2, shutdown_kernel="immediate",
        record_timing=False, resources={"metadata": {"path": cwd}},
        on_cell_executed=on_executed)
    start = time.monotonic()
    deadline = start + total_timeout
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    stop_reason = ""
    try:
        kw: dict = {} if env is None else {"env": env}
        if kernel_output is not None:
            kw.update(stdout=kernel_output, stderr=kernel_output)
        with client.setup_kernel(**kw):
            # Import the testkit before any submitted code, so it captures clean references.
            if not _probe(client, ARM, timeout=startup_timeout):
                report.events.append("the grading helpers failed to load in the kernel")
            if after_start is not None:
                after_start()
            for index in code_cells:
                cell = nb.cells[index]
                label = _label(cell, index)
                if stop_reason:
                    report.cells[index] = CellResult("not_run", evalue=stop_reason)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 1:
                    stop_reason = (f"the notebook ran past its {total_timeout:.0f} s "
                                   "wall-clock limit")
                    report.events.append(stop_reason)
                    report.cells[index] = CellResult("not_run", evalue=stop_reason)
                    continue
                client.timeout = max(1, int(min(cell_timeout, remaining)))
                original = cell.source
                if index in guarded:
                    cell.source = GUARD + original
                try:
                    client.execute_cell(cell, index)
                except DeadKernelError:
                    report.kernel_died = True
                    stop_reason = f"the kernel died while running {label}"
                    report.events.append(stop_reason + " (exit, crash or resource limit)")
                    report.cells[index] = CellResult("error", "KernelDied", stop_reason)
                    continue
                except CellTimeoutError:
                    replies[index] = {"status": "error", "ename": TIMEOUT_NAME}
                finally:
                    cell.source = original
                result = _result(replies.get(index), cell)
                report.cells[index] = result
                if result.status == "timeout":
                    msg = f"{label} ran longer than {client.timeout} s and was interrupted"
                    if not _probe(client, "pass", timeout=interrupt_grace):
                        stop_reason = (f"{label} ran longer than {client.timeout} s and "
                                       "ignored the interrupt; the kernel was stopped")
                        report.events.append(stop_reason)
                        _kill(client)
                        report.kernel_died = True
                    else:
                        report.events.append(msg)
            if not stop_reason:
                client._out_bytes = -10 * client.output_limit  # the report must get out
                nonce = secrets.token_hex(8)
                probe = nbformat.v4.new_code_cell(
                    f"__import__('autograder.testkit').testkit._integrity_report({nonce!r})")
                if _probe(client, probe, timeout=30):
                    report.integrity = _parse_integrity(probe, nonce)
    except DeadKernelError:
        report.kernel_died = True
        report.events.append("the kernel died")
    except RuntimeError as e:  # kernel failed to start, typically
        report.events.append(f"kernel error: {e}")
        report.kernel_died = True
    finally:
        for index in code_cells:
            report.cells.setdefault(index, CellResult("not_run", evalue=stop_reason or
                                                      "not run"))
        if getattr(client, "_truncated", False):
            report.events.append(f"output over {client.output_limit // 10**6} MB was discarded")
        report.seconds = time.monotonic() - start
    return report


def _label(cell: nbformat.NotebookNode, index: int) -> str:
    gid = (cell.get("metadata", {}).get("nbgrader") or {}).get("grade_id")
    return f"cell {gid}" if isinstance(gid, str) else f"cell {index}"


def _probe(client: NotebookClient, code, *, timeout: float) -> bool:
    """Run code outside the notebook; False if the kernel did not answer in time."""
    cell = code if isinstance(code, nbformat.NotebookNode) else nbformat.v4.new_code_cell(code)
    old = client.timeout
    client.timeout = max(1, int(timeout))
    replies: dict = {}
    hook = client.on_cell_executed
    client.on_cell_executed = lambda cell, cell_index, execute_reply: replies.update(
        r=execute_reply)
    # nbclient stores the executed cell back at nb.cells[cell_index]; give the probe a slot
    # of its own at the end, so it never overwrites a notebook cell.
    client.nb.cells.append(cell)
    try:
        client.execute_cell(cell, len(client.nb.cells) - 1, store_history=False)
    except (CellTimeoutError, DeadKernelError):
        return False
    finally:
        client.nb.cells.pop()
        client.timeout = old
        client.on_cell_executed = hook
    content = (replies.get("r") or {}).get("content", {})
    return content.get("status") == "ok"


def _kill(client: NotebookClient) -> None:
    from jupyter_core.utils import ensure_async, run_sync

    async def stop():
        await ensure_async(client.km.shutdown_kernel(now=True))
    try:
        run_sync(stop)()
    except Exception:
        pass


def _result(content: dict | None, cell: nbformat.NotebookNode) -> CellResult:
    if content is None:
        return CellResult("not_run", evalue="no reply from the kernel")
    errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    if content.get("ename") == TIMEOUT_NAME:
        return CellResult("timeout", TIMEOUT_NAME, "the cell timed out")
    if content.get("status") == "ok" and not errors:
        return CellResult("ok")
    source = errors[0] if errors else content
    return CellResult("error", str(source.get("ename", "Error")),
                      str(source.get("evalue", ""))[:2000])


def _parse_integrity(cell: nbformat.NotebookNode, nonce: str) -> dict | None:
    for out in cell.get("outputs", []):
        for line in str(out.get("text", "")).splitlines():
            if line.startswith("AUTOGRADER-INTEGRITY "):
                try:
                    data = json.loads(line.split(" ", 1)[1])
                except ValueError:
                    continue
                if data.get("nonce") == nonce:
                    return data
    return None

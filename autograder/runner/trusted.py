"""The trusted test runner: executes read-only and test cells in the grader's own process.

Test cells run here, never in the student's kernel, in a ``TestNamespace`` whose missing
names are the student's (fetched over ``autograder.runner.channel``). Their outputs and errors are
built here too: no test source, frame or traceback ever reaches the kernel, and feedback
quotes only the tests' own messages and, marked as such, the student's (capped) errors.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys

import nbformat

from autograder.runner.result import CellResult
from autograder.runner.channel import Channel, GraderOverran, KernelLost, StudentTimeout, TemplateNameUnbound, \
    TestNamespace, cap_text
from autograder.submitted.scan import to_python

OUTPUT_CAP = 100_000


class _CappedText(io.StringIO):
    """stdout/stderr of a test cell, cut at OUTPUT_CAP characters."""

    def write(self, text: str) -> int:
        room = OUTPUT_CAP - self.tell()
        if room > 0:
            super().write(text[:room])
        return len(text)


_CURRENT: list["TrustedRunner"] = []   # the runner whose cell is running in this process


def current() -> "TrustedRunner | None":
    """The runner executing a trusted cell right now (None in a kernel, or between cells):
    the tests' helpers ask it for what only the trusted side holds (the learner's source)."""
    return _CURRENT[-1] if _CURRENT else None


class TrustedRunner:
    def __init__(self, kernel_request, *, cwd: str, template_names: frozenset[str] = frozenset()):
        self.channel = Channel(kernel_request)
        self.ns = TestNamespace(self.channel, template_names)
        self.channel.namespace = self.ns
        self.cwd = cwd
        self.student_sources: list[str] = []   # the learner's cells the kernel ran, in order
        self.review_flags: list[str] = []       # for an instructor's review; never a verdict
        self.publishes = False                  # read-only cells run here only (a build assignment)
        self.published: set[str] = set()        # names the read-only cells gave the kernel
        self.grader_side = False                # the last read-only cell failed on our side
        self.student_errors: list[tuple[str, str]] = []  # (source, "ename: evalue") of cells that raised

    def student_cell_ran(self, source: str = "", error: str = "") -> None:
        self.ns.forget_student_values()
        if source.strip():
            self.student_sources.append(source)
        if error:
            self.student_errors.append((source, cap_text(error, 300)))

    def flag(self, text: str) -> None:
        """A review signal from a test (what the learner's source reads): listed for the
        instructor with the submission, never a verdict."""
        text = cap_text(text, 400)
        if text not in self.review_flags:
            self.review_flags.append(text)

    @contextlib.contextmanager
    def _inside(self, out: io.StringIO):
        # Tests read the released data files by relative path, as they do in the notebook.
        # The folder is NOT put on sys.path: a .py file there is the student's to write.
        here = os.getcwd()
        os.chdir(self.cwd)
        _CURRENT.append(self)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                yield
        finally:
            _CURRENT.pop()
            os.chdir(here)

    def run_setup(self, cell: nbformat.NotebookNode, label: str, timeout: float = 60,
                  publish: bool = False) -> str:
        """Run a read-only cell here (as well, or only: ``publish`` then binds what it bound
        in the learner's namespace, see ``autograder.runner.publish``); returns a problem to report,
        or ''. Its requests to the kernel have the cell's time, like a test's."""
        import time
        out = _CappedText()
        before = {k: id(v) for k, v in dict.items(self.ns)}
        self.channel.deadline = time.monotonic() + timeout
        # Whether a problem returned is the grader's own (no code of the learner's failed):
        # the notebook is then not graded at all (autograder.runner.execute).
        self.grader_side = False
        try:
            code = compile(to_python(cell.source), f"<{label}>", "exec")
            with self._inside(out):
                exec(code, self.ns)
            # What it bound (the shipped weights) crosses to the kernel once, then by number.
            bound = {}
            for name, value in list(dict.items(self.ns)):
                if before.get(name) != id(value):
                    self.channel.constants.register(value)
                    self.channel.read_only.add(id(value))
                    bound[name] = value
            if publish:
                self._publish(bound, cell.source)
        except (StudentTimeout, KernelLost) as e:
            if publish:  # no code of yours runs here: the grader's request went unanswered
                self.grader_side = True
                return (f"{label} (read-only): the grader could not publish what it binds to your "
                        f"kernel ({cap_text(e, 200)}): the grader's failure, not your code's")
            return f"{label} (read-only) called your code, which failed: {e}"
        except GraderOverran as e:
            self.grader_side = True
            return f"{label} (read-only): the grader's own work ran past the cell's time: {e}"
        except Exception as e:  # noqa: BLE001 - reported, never fatal
            # Raised by the learner's code it called, or a name of theirs it needs: theirs.
            self.grader_side = not (getattr(e, "autograder_student", None)
                                    or isinstance(e, (NameError, TemplateNameUnbound)))
            return (f"{label} (read-only) failed in the test runner: {type(e).__name__}: "
                    f"{cap_text(e)}")
        finally:
            self.channel.deadline = float("inf")
            self._end()
        return ""

    def _publish(self, bound: dict, source: str) -> None:
        from autograder.runner.publish import publication
        lend = dict.get(self.ns, "_LEND", ())
        fields = publication(bound, source, self.ns["__name__"], frozenset(self.published),
                             frozenset(lend) if isinstance(lend, (tuple, list, set)) else frozenset())
        self.published.update(n for key in ("imports", "values", "sources") for n in fields[key])
        for fn in fields.pop("lent"):
            self.channel.lend(fn, ("__call__",), (), published=True)
        if any(fields.values()):
            self.channel.publish(**fields)

    def _end(self) -> None:
        try:
            self.channel.end()
        except (StudentTimeout, KernelLost):
            pass

    def run_test(self, cell: nbformat.NotebookNode, label: str, timeout: float):
        """Run a test cell here; its outputs replace the cell's, and a CellResult says how."""
        import time

        out = _CappedText()
        self.channel.deadline = time.monotonic() + timeout
        result = CellResult("ok")
        try:
            code = compile(to_python(cell.source), f"<{label}>", "exec")
            with self._inside(out):
                exec(code, self.ns)
        except StudentTimeout as e:
            result = CellResult("timeout", "CellTimeout", str(e))
        except KernelLost as e:
            result = CellResult("kernel_lost", "KernelDied", str(e))
        except GraderOverran as e:
            result = CellResult("error", "GraderOverran",
                                f"not your code: {e} (the grader's limit; your instructor sees it)")
        except BaseException as e:  # noqa: BLE001 - every failure is the test's verdict
            result = _failure(e, self.student_errors)
        finally:
            self.channel.deadline = float("inf")
            self._end()
        cell.outputs = _outputs(out.getvalue(), result)
        return result


def _failure(e: BaseException, student_errors: list[tuple[str, str]] = ()):
    student = getattr(e, "autograder_student", None)
    if isinstance(e, TemplateNameUnbound):
        return CellResult("error", "ReadOnlyCellFailed", str(e))
    if isinstance(e, NameError) and not student:
        name = getattr(e, "name", None) or str(e)
        errors = [err for source, err in student_errors if str(name) in source]
        raised = f" (the cell of yours that defines it raised {errors[-1]})" if errors else ""
        return CellResult("error", "NotAnswered", f"`{cap_text(name, 80)}` is not defined: "
                          f"run (or write) the answer cell that defines it{raised}")
    if student:
        return CellResult("error", cap_text(student, 80), cap_text(e), student=True)
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        return CellResult("error", type(e).__name__, "the test was stopped")
    return CellResult("error", type(e).__name__, cap_text(e, 2000))


def _outputs(text: str, result) -> list:
    outs = []
    if text:
        outs.append(nbformat.v4.new_output("stream", name="stdout", text=text))
    if result.status != "ok":
        outs.append(nbformat.v4.new_output(
            "error", ename=result.ename, evalue=result.evalue,
            traceback=[f"{result.ename}: {result.evalue}"]))
    return outs

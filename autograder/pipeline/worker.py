"""Grade one submission (one student, one assignment) and return a result record.

Runs in its own process, started by the coordinator (``autograder.pipeline.grade``), so a grader crash
costs one submission, never the batch. It never touches the gradebook: it writes the
autograded notebooks and returns a JSON result; the coordinator alone records grades.

    python -m autograder.pipeline.worker JOB.json RESULT.json
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from autograder.pipeline.collect import collect_notes
from autograder.pipeline.course import Course, grader_template, hidden_test_lines, write_json
from autograder.submitted.shown import shown
from autograder.runner.execute import Plan, RunReport, run_notebook
from autograder.runner.publish import needs_no_reference
from autograder.runner.sandbox import BASE_UID, KERNEL_NAME, Limits, SandboxSpec, lock_ipc, prepare_run_dir, \
    sandbox_processes, write_kernelspec
from autograder.submitted.setup_cells import skip_setup_cells
from autograder.submitted.scan import names_bound, scan_cell
from autograder.submitted.submission import Unreadable, grade_id, is_test, load, merge, nbgrader_meta


# The worker holds ~0.5 GB of data while grading the largest assignment (torch, the shipped
# weights, the tests' references) and the largest reply the wire admits (256 MB of base64)
# costs ~1.3 GB more while it is decoded: 4 GB holds both, and bounds each worker (one per
# CPU) to a known share of the host. The kernel's own limit is separate (Limits.memory_mb).
WORKER_MEMORY_MB = 4096
# CPU seconds past the notebooks' time limits: start-up, reading and writing the notebooks.
WORKER_CPU_MARGIN_S = 60


@dataclass
class Job:
    root: str
    assignment: str
    student: str
    slot: int = 0
    unsafe: bool = False
    cell_timeout: float = 60
    total_timeout: float = 600
    limits: dict = field(default_factory=lambda: asdict(Limits()))
    # "trusted": test cells run in the trusted runner (the grading path); "kernel": the old
    # in-kernel design, kept only so the tests can show which attacks it fell for.
    tests_in: str = "trusted"
    # Only for the mutants tool: stop at the first failed test (see execute.Plan).
    stop_at_failure: bool = False
    # The worker's own bounds (see limit_worker); None: the notebooks' time limits + a margin.
    worker_memory_mb: int = WORKER_MEMORY_MB
    worker_cpu_seconds: float | None = None


def grade(job: Job) -> dict:
    course = Course(Path(job.root))
    sub_dir = course.submitted / job.student / job.assignment
    started = time.time()
    result = {"student": job.student, "assignment": job.assignment, "status": "graded",
              "score": 0.0, "max_score": 0.0, "reasons": [], "flags": [], "notebooks": {},
              "graded_at": started}
    expected = course.notebooks(job.assignment)
    found, notes = locate_notebooks(sub_dir, expected, course.support_files(job.assignment))
    result["reasons"].extend(collect_notes(sub_dir) + notes)  # collect's first: a notebook
    # over its size cap was left out there, and is "missing" here
    out_dir = course.autograded / job.student / job.assignment
    if out_dir.exists():
        shutil.rmtree(out_dir)  # re-grading replaces the previous autograded copy
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in expected:
        nb_result = grade_notebook(course, job, name, found.get(name), out_dir)
        result["notebooks"][name] = nb_result
        result["score"] += nb_result["score"]
        result["max_score"] += nb_result["max_score"]
        result["reasons"].extend(nb_result["reasons"])
        result["flags"].extend(nb_result["flags"])
        if nb_result["failed"]:
            result["status"] = "failed"
    if result["status"] != "failed" and result["flags"]:
        result["status"] = "flagged"
    result["seconds"] = round(time.time() - started, 2)
    return result


def locate_notebooks(sub_dir: Path, expected: list[str], support: list[Path]
                     ) -> tuple[dict[str, Path], list[str]]:
    """Map expected notebook names to submitted files; note renames and extra files."""
    notes: list[str] = []
    if not sub_dir.is_dir():
        return {}, ["no submission folder"]
    files = sorted(p for p in sub_dir.rglob("*") if p.is_file() and not p.is_symlink()
                   and ".ipynb_checkpoints" not in p.parts)
    found = {n: sub_dir / f"{n}.ipynb" for n in expected if (sub_dir / f"{n}.ipynb").is_file()}
    missing = [n for n in expected if n not in found]
    others = [p for p in files if p.suffix == ".ipynb" and p.parent == sub_dir
              and p.stem not in expected]
    if len(missing) == 1 and len(others) == 1:
        found[missing[0]] = others[0]
        notes.append(f"notebook '{shown(others[0].name)}' graded as {missing[0]}.ipynb "
                     "(renamed)")
        others = []
    used = set(found.values()) | {sub_dir / s for s in support} | {sub_dir / "timestamp.txt"}
    # Names the student chose: no escape of theirs reaches a summary, a CSV or a page.
    extra = [shown(p.relative_to(sub_dir)) for p in files if p not in used]
    if extra:
        listed = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        notes.append(f"extra files ignored (graded notebooks must be self-contained): {listed}")
    return found, notes


def grade_notebook(course: Course, job: Job, name: str, path: Path | None,
                   out_dir: Path) -> dict:
    template = grader_template(course, job.assignment, name)
    release_nb = nbformat.read(course.release / job.assignment / f"{name}.ipynb", as_version=4)
    tests = score_cells(template)
    res = {"score": 0.0, "max_score": sum(t["max_points"] for t in tests), "tests": tests,
           "reasons": [], "flags": [], "failed": False}
    if path is None:
        res["failed"] = True
        res["reasons"].append(f"notebook {name}.ipynb is missing from the submission")
        _mark_all(tests, "not graded: notebook missing")
        return res
    try:
        student, notes = load(path)
    except Unreadable as e:
        res["failed"] = True
        res["reasons"].append(str(e))
        _mark_all(tests, "not graded: notebook unreadable")
        return res
    merged = merge(template, release_nb, student)
    res["reasons"].extend(notes + merged.notes)

    # Names the test code relies on: whatever the locked cells bind, and the helpers.
    protected: dict[str, str] = {n: f"autograder.testkit.{n}"
                                 for n in ("check_close", "check_equal", "check")}
    for cell in template.cells:
        nbg = nbgrader_meta(cell) or {}
        if cell.cell_type == "code" and nbg.get("locked") and not nbg.get("grade"):
            protected.update(names_bound(cell.source))
    for label, source in merged.student_cells:
        for finding in scan_cell(source, label, protected):
            res["flags"].append(f"static scan: {finding}")

    nb = merged.nb
    res["reasons"].extend(skip_setup_cells(nb))   # an install cell: never run (issue 51)
    report = execute_in_sandbox(course, job, name, nb, path.parent)
    res["reasons"].extend(report.events)
    apply_results(nb, report, tests)
    res["score"] = sum(t["points"] for t in tests)
    if report.grader_failures:   # never zero marks for what the grader's side failed to do
        res["failed"] = True
        res["reasons"].append("not graded: the grader's own side failed, not your code ("
                              + "; ".join(report.grader_failures)[:600] + "); your instructor regrades it")
    res["flags"].extend(runtime_flags(report, tests))
    if not report.cells or all(r.status == "not_run" for r in report.cells.values()):
        if report.kernel_died or not any(r.status != "not_run" for r in report.cells.values()):
            res["failed"] = True
            res["reasons"].append("the notebook could not be run: " +
                                  ("; ".join(report.events) or "kernel did not start"))
    nb.metadata["autograder"] = {"events": report.events, "seconds": round(report.seconds, 2)}
    scrub_hidden_lines(nb, hidden_test_lines(course, job.assignment))
    nbformat.write(nb, out_dir / f"{name}.ipynb")
    return res


HIDDEN_MARK = "[hidden test line]"


def scrub_hidden_lines(nb: nbformat.NotebookNode, secret: set[str]) -> None:
    """No output of the graded notebook (and so of the feedback made from it) quotes a line of
    hidden-test or solution source, whatever printed it: the learner's code echoing what it
    was sent, an error message quoting code, a test's own message."""
    if not secret:
        return

    def clean(text):
        if type(text) is list:
            return [clean(t) for t in text]
        if type(text) is not str:
            return text
        for line in secret:
            if line in text:
                text = text.replace(line, HIDDEN_MARK)
        return text
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            for key in ("text", "evalue", "traceback"):
                if key in out:
                    out[key] = clean(out[key])
            data = out.get("data") or {}
            for mime in list(data):
                data[mime] = clean(data[mime])


def score_cells(template: nbformat.NotebookNode) -> list[dict]:
    tests = []
    for cell in template.cells:
        nbg = nbgrader_meta(cell) or {}
        if not nbg.get("grade"):
            continue
        kind = ("test" if is_test(cell) else
                "manual" if cell.cell_type != "code" else "answer")
        tests.append({"grade_id": grade_id(cell), "kind": kind,
                      "max_points": float(nbg.get("points", 0)), "points": 0.0,
                      "passed": False, "needs_manual_grade": False, "message": ""})
    return tests


def _mark_all(tests: list[dict], message: str) -> None:
    for t in tests:
        t["message"] = message


def apply_results(nb: nbformat.NotebookNode, report: RunReport, tests: list[dict]) -> None:
    index = {grade_id(c): (i, c) for i, c in enumerate(nb.cells) if grade_id(c)}
    for t in tests:
        i, cell = index[t["grade_id"]]
        if t["kind"] == "manual":
            blank = cell.source.strip() in ("", "YOUR ANSWER HERE")
            t["needs_manual_grade"] = not blank
            t["message"] = ("no answer written" if blank else "awaiting manual grading")
            continue
        r = report.cells.get(i)
        if r is not None and r.status == "ok":
            t["points"], t["passed"], t["message"] = t["max_points"], True, "passed"
        elif report.grader_failures:
            # After the grader's side failed, a test's failure says nothing about the answer
            # (a name it never published reads "not answered"): the grader is named instead.
            t["message"] = (f"not graded: the grader's side failed ({report.grader_failures[0][:300]}); "
                            f"not your code")
        else:
            t["message"] = failure_message(r)


def failure_message(r) -> str:
    if r is None:
        return "not run"
    if r.status == "timeout":
        return "timed out (an answer cell may loop forever)"
    if r.status == "not_run":
        return f"not run: {r.evalue}"
    if r.ename == "NotImplementedError":
        return "not answered yet (the answer cell still raises NotImplementedError)"
    if r.ename == "NotAnswered" and not r.student:
        return f"not answered yet: {r.evalue}"
    if r.ename == "AssertionError" and not r.student:
        return r.evalue
    if r.student:
        return f"your code raised {r.ename}: {r.evalue[:300]}"
    if r.ename == "ReadOnlyCellFailed":
        return f"not graded: {r.evalue[:300]}"
    if r.ename == "KernelDied":
        return f"your kernel stopped: {r.evalue[:300]}"
    # Raised by the test's own code (trusted side), not inside a call to yours: say so, so
    # the learner does not hunt for an error their code never raised.
    return (f"the test itself raised {r.ename}: {r.evalue[:300]} (not an error of your code; "
            "it may be a value of a type the test did not expect: check what your answer "
            "returns, or ask your instructor)")


def runtime_flags(report: RunReport, tests: list[dict]) -> list[str]:
    flags = []
    violations = set((report.integrity or {}).get("violations", []))
    for t in tests:
        if "[integrity]" in t["message"]:
            violations.add(t["message"].split("[integrity] ", 1)[1].split(" -- ")[0])
    for v in sorted(violations):
        flags.append(f"runtime check: {v}")
    if report.integrity is None and not report.kernel_died:
        flags.append("runtime check: the integrity report never came back "
                     "(test cells were altered or output was faked)")
    for event in getattr(report, "audit", []):
        flags.append(f"sandbox audit: {event}")
    flags.extend(f"runtime check: {flag}" for flag in report.flags)
    return flags


# A Unix socket's path holds at most 107 bytes, and the kernel's ipc sockets live in
# <scratch>/run/ipc/kernel-<n>-<port>: about 50 bytes below the scratch root.
_SOCKET_PATH_MAX, _SOCKET_SUFFIX = 107, 50


def scratch_root(course: Course) -> Path:
    """Where a submission's run folder goes: the course's work folder, or the system temp
    folder when the course sits so deep that the kernel's sockets would not fit in a path."""
    if len(str(course.work)) + _SOCKET_SUFFIX <= _SOCKET_PATH_MAX:
        course.work.mkdir(parents=True, exist_ok=True)
        return course.work
    return Path(tempfile.gettempdir())


def execute_in_sandbox(course: Course, job: Job, name: str, nb: nbformat.NotebookNode,
                       sub_dir: Path) -> RunReport:
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    scratch = Path(tempfile.mkdtemp(prefix=f"run-{job.slot}-", dir=scratch_root(course)))
    try:
        plan = grading_plan(nb, trusted=job.tests_in == "trusted",
                            trusted_cwd=str(scratch / "trusted"))
        spec = SandboxSpec(run_dir=str(scratch / "run"), uid=BASE_UID + job.slot,
                           limits=Limits(**job.limits), isolate=not job.unsafe,
                           reference=not plan.publish)
        prepare_run_dir(spec)
        home = Path(spec.home)
        # Released support files, never the submitted copies (a student could edit them).
        for rel in course.support_files(job.assignment):
            dest = Path(spec.support) / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(course.release / job.assignment / rel, dest)
            os.chmod(dest, 0o644)
        ksm = KernelSpecManager(kernel_dirs=[str(write_kernelspec(scratch / "kernels"))])
        km = AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm,
                           transport="ipc", ip=str(Path(spec.ipc) / "kernel"),
                           connection_file=str(Path(spec.run_dir) / "kernel.json"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGRADER_")}
        env["AUTOGRADER_SANDBOX"] = spec.to_env()
        plan.trusted_cwd = str(trusted_folder(course, job, scratch))
        plan.stop_at_failure = job.stop_at_failure
        with open(scratch / "kernel.log", "wb") as log:
            report = run_notebook(nb, km, cwd=str(home), env=env,
                                  cell_timeout=job.cell_timeout,
                                  total_timeout=job.total_timeout, plan=plan,
                                  kernel_output=log, after_start=lambda: lock_ipc(spec),
                                  before_stop=lambda r: _count_processes(r, spec))
        report.audit = read_audit(Path(spec.audit_log)) + getattr(  # type: ignore[attr-defined]
            report, "process_events", [])
        if report.kernel_died and not any(r.status != "not_run" for r in report.cells.values()):
            tail = (scratch / "kernel.log").read_text(errors="replace").strip()[-600:]
            if tail:
                report.events.append(f"kernel log: {tail}")
        return report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def grading_plan(nb: nbformat.NotebookNode, *, trusted: bool = True,
                 trusted_cwd: str | None = None) -> Plan:
    """Test cells to the trusted runner; read-only code cells to both sides.

    Every test cell runs on the trusted side: no cell metadata can send one to the kernel
    (an older design let a test cell opt in with ``"autograder": {"tests_in": "kernel"}``;
    that key is now ignored). ``trusted=False`` is the old all-in-kernel design, used only
    by the tests that show which attacks it fell for.
    """
    tests = {i for i, c in enumerate(nb.cells) if is_test(c)}
    both = {i for i, c in enumerate(nb.cells) if is_read_only_code(c)}
    if not trusted:
        return Plan(trusted_tests=False, guarded=tests, trusted_cwd=trusted_cwd)
    return Plan(trusted_tests=True, tests=tests, both=both, trusted_cwd=trusted_cwd,
                publish=needs_no_reference([nb.cells[i].source for i in both]))


def is_read_only_code(cell: nbformat.NotebookNode) -> bool:
    nbg = nbgrader_meta(cell) or {}
    return (cell.cell_type == "code" and bool(nbg.get("locked"))
            and not nbg.get("grade") and not nbg.get("solution"))


def trusted_folder(course: Course, job: Job, scratch: Path) -> Path:
    """The trusted runner's working folder: the released data files, out of the kernel's
    reach (the kernel sees only its own run folder)."""
    folder = scratch / "trusted"
    for rel in course.support_files(job.assignment):
        dest = folder / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(course.release / job.assignment / rel, dest)
    folder.mkdir(exist_ok=True)
    return folder


def _count_processes(report: RunReport, spec: SandboxSpec) -> None:
    """Processes of the sandbox's own uid besides the kernel were started without an audit
    event (native code: ctypes reaches fork in libc). They end with the sandbox's PID
    namespace; the count, taken from outside, is the review flag."""
    if not spec.isolate or os.getuid() != 0:
        return  # without a uid of its own, the kernel's processes cannot be told apart
    found = sandbox_processes(spec.uid, spec.run_dir)
    extra = found[1:]  # the first is the kernel (or one of them; they are alike)
    if extra:
        report.process_events = [  # type: ignore[attr-defined]
            f"{len(extra)} process(es) running beside the kernel, started without an audit "
            f"event (native code?): {'; '.join(extra)[:300]}"]


def read_audit(path: Path) -> list[str]:
    events: list[str] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ["the audit log was removed"]
    for line in lines[:200]:
        try:
            rec = json.loads(line)
        except ValueError:
            events.append("the audit log was written to by the submission")
            continue
        kind, detail = rec.get("event", "?"), rec.get("detail", "")
        text = {"open": f"opened a file outside its folder: {detail}",
                "process": f"tried to start a process: {detail}",
                "tamper": f"tampered with the audit log: {detail}"}.get(
                    kind, f"{kind}: {detail}")
        if text not in events:
            events.append(text)
    return events[:20]


def limit_worker(memory_mb: int, cpu_seconds: float) -> None:
    """Bound this worker's own (trusted-side) work: its data memory and its CPU time.

    Soft limits only; the hard limits stay as they were, because the kernel is this worker's
    child and inherits both: kernel_boot then sets the sandbox's own (memory, data, CPU time,
    soft == hard, from ``Limits``), higher or lower than these. RLIMIT_DATA counts heap and
    anonymous memory, not the ~1 GB of libraries torch maps, so it bounds what replies and
    tests allocate. Past it an allocation fails (a MemoryError: the test, or the grade,
    fails with it); past the CPU time the kernel sends SIGXCPU, which ends the worker, and
    the coordinator records why (``grade._why_no_result``) and the feedback says so."""
    for res, value in ((resource.RLIMIT_DATA, int(memory_mb) * 2**20),
                       (resource.RLIMIT_CPU, max(1, int(cpu_seconds)))):
        _, hard = resource.getrlimit(res)
        soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(res, (soft, hard))


def worker_cpu_seconds(job: Job) -> float:
    """The CPU time a worker may use: the notebooks' time limits (its own work happens while
    they run) plus a margin, unless the job sets it."""
    if job.worker_cpu_seconds is not None:
        return job.worker_cpu_seconds
    notebooks = len(Course(Path(job.root)).notebooks(job.assignment)) or 1
    return job.total_timeout * notebooks + WORKER_CPU_MARGIN_S


def _internal_error(job: Job, e: Exception) -> str:
    if isinstance(e, MemoryError):
        return (f"the grader ran out of memory (its limit: {job.worker_memory_mb} MB) while "
                "grading this submission (a reply from your code too large?); it was not "
                "graded")
    return f"internal grader error: {type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from autograder.runner.sandbox import die_with_parent
    die_with_parent()  # a coordinator that dies takes its workers, and so their kernels, along
    job = Job(**json.loads(Path(argv[0]).read_text()))
    try:
        limit_worker(job.worker_memory_mb, worker_cpu_seconds(job))
        result = grade(job)
    except Exception as e:  # a grader bug must still produce a record for this student
        import traceback
        result = {"student": job.student, "assignment": job.assignment, "status": "failed",
                  "score": 0.0, "max_score": 0.0, "flags": [], "notebooks": {},
                  "reasons": [_internal_error(job, e)],
                  "traceback": traceback.format_exc()}
    write_json(Path(argv[1]), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

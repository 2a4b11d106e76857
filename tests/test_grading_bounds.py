"""Issue 25, items 3 and 6: the trusted side's own bounds, and what people are shown.

Fast checks (no kernel): the budget on decoded elements and hashed keys per reply, the
worker's own memory and CPU limits, the feedback page of a job that failed, the explicit list
of classes that may cross the channel, control characters in student-controlled text, an
oversized notebook at collect, and an nbformat 3 notebook's message.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autograder.submitted.submission import Unreadable, load


# ------------------------------------------------------------------ (g) nbformat 3

def test_an_nbformat_3_notebook_gets_the_format_message_not_not_a_notebook(tmp_path: Path):
    old = {"nbformat": 3, "nbformat_minor": 0, "metadata": {},
           "worksheets": [{"cells": [{"cell_type": "code", "input": "x = 1"}]}]}
    path = tmp_path / "old.ipynb"
    path.write_text(json.dumps(old))
    with pytest.raises(Unreadable, match="notebook format 3; open and save it in JupyterLab"):
        load(path)


# ------------------------------------------------------------------ (e) control characters

ESCAPES = "\x1b]8;;http://evil\x07x\x1b]8;;\x07\x1b[2J\x9b31m\u202e\x00"


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 and c not in "\n\t" or 0x7f <= ord(c) <= 0x9f
               or 0x202a <= ord(c) <= 0x202e for c in text)


def _course(tmp_path: Path):
    import nbformat

    from autograder.pipeline.course import Course
    root = tmp_path / "course"
    (root / "solutions" / "mini").mkdir(parents=True)
    nbformat.write(nbformat.v4.new_notebook(), root / "solutions" / "mini" / "mini.ipynb")
    return Course(root)


def _result(student: str = "ann", **extra) -> dict:
    return {"student": student, "assignment": "mini", "status": "flagged", "score": 1.0,
            "max_score": 2.0, "flags": [f"static scan: {ESCAPES}"],
            "reasons": [f"unknown nbgrader cell ids ignored: {ESCAPES}"],
            "notebooks": {"mini": {"tests": [
                {"grade_id": f"t{ESCAPES}", "kind": "test", "max_points": 1, "points": 0,
                 "passed": False, "needs_manual_grade": False,
                 "message": f"your code raised ValueError: {ESCAPES}"}]}}, **extra}


def test_shown_escapes_controls_visibly_and_keeps_lines_only_when_asked():
    from autograder.submitted.shown import shown
    assert shown("a\x1b[31mb\u202ec") == "a\\x1b[31mb\\u202ec"
    assert shown("x\ny\tz") == "x y z" and shown("x\ny\tz", lines=True) == "x\ny\tz"
    assert shown("lone \udc80") == "lone \ufffd" and shown(shown(ESCAPES)) == shown(ESCAPES)
    assert not _has_control(shown(ESCAPES))


def test_the_autograde_summary_prints_no_escape_of_the_students(capsys):
    from autograder.cli import summary_line
    line = summary_line(_result())
    assert "static scan" in line and not _has_control(line)


def test_the_grades_csv_and_the_feedback_page_carry_no_raw_escapes(tmp_path):
    from autograder.pipeline.report import export, feedback
    course = _course(tmp_path)
    (course.results / "mini").mkdir(parents=True)
    (course.results / "mini" / "ann.json").write_text(json.dumps(_result()))
    out = course.work / "grades.csv"
    assert export(course, ["mini"], out) == 1
    text = out.read_text(encoding="utf-8")
    assert "unknown nbgrader cell ids" in text and not _has_control(text.replace("\r\n", ""))
    [page] = feedback(course, "mini")
    html = page.read_text(encoding="utf-8")
    assert "your code raised ValueError" in html and not _has_control(html)


def test_extra_file_names_and_unknown_grade_ids_are_noted_escaped(tmp_path):
    import nbformat

    from autograder.submitted.submission import merge
    from autograder.pipeline.worker import locate_notebooks
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "mini.ipynb").write_text("{}")
    (sub / f"notes{ESCAPES.replace(chr(0), '').replace('/', '')}.txt").write_text("x")
    _, notes = locate_notebooks(sub, ["mini"], [])
    assert any("extra files" in n for n in notes) and not any(map(_has_control, notes))
    template = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    student = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("y = 2")])
    student.cells[0].metadata["nbgrader"] = {"grade_id": f"g{ESCAPES}", "grade": True}
    notes = merge(template, template, student).notes
    assert any("unknown nbgrader cell ids" in n for n in notes)
    assert not any(map(_has_control, notes))


def test_collect_warnings_name_files_escaped(tmp_path):
    from autograder.pipeline.collect import MAX_FILE_MB, _group
    rel = ("ann", "mini", f"big{ESCAPES}.bin")
    _, warnings, _ = _group([(rel, None, (MAX_FILE_MB + 1) * 2**20)], "mini")
    assert warnings and not any(map(_has_control, warnings))


# ------------------------------------------------------------------ (d) classes that cross

@pytest.mark.parametrize("path", ["tinyserve.simulator:Path", "tinyserve.simulator:tqdm",
                                  "tinyserve.train:tqdm", "tinyserve.engine:Engine",
                                  "tinyserve.workload:EngineConfig",  # an import, not its home
                                  "tinyserve.model:TinyLlama", "autograder.build_checks:_Unavailable"])
def test_a_reply_naming_a_class_off_the_list_is_refused(path):
    from autograder.protocol.wire import Decoder, WireError, allowed_class, rebuild
    decoder = Decoder(lambda *a: None, on_object=lambda p, f, _: rebuild(allowed_class(p), f))
    with pytest.raises(WireError, match="cannot cross the channel"):
        decoder.loads(json.dumps({"$o": [path, {"$d": []}, 0]}))


def test_every_class_on_the_list_is_a_course_data_class():
    import dataclasses

    import torch

    from autograder.protocol.wire import DATA_CLASSES, PLAIN_DATA_CLASSES, allowed_class, class_path
    assert set(PLAIN_DATA_CLASSES) <= set(DATA_CLASSES)
    for path in DATA_CLASSES:
        cls = allowed_class(path)
        assert class_path(cls) == path, path           # named where it is defined
        assert cls.__module__.startswith("tinyserve.")
        if path in PLAIN_DATA_CLASSES:
            # A plain class: state in its instance fields, no hook that runs on a read,
            # a write or a delete (object.__new__ plus fields is then the whole object).
            assert not issubclass(cls, torch.nn.Module), path
            hooks = {"__getattr__", "__getattribute__", "__setattr__", "__delattr__",
                     "__del__", "__reduce__", "__reduce_ex__", "__setstate__"}
            for klass in cls.__mro__[:-1]:
                assert not hooks & set(vars(klass)), (path, klass)
        else:
            assert dataclasses.is_dataclass(cls), path


def test_listed_objects_still_cross_both_ways_and_others_do_not():
    from pathlib import Path as _Path

    from autograder.protocol.wire import object_fields
    from tinyserve.metrics import SLO
    from tinyserve.simulator import CostModel
    assert object_fields(CostModel(step=1e-3, token=1e-5, row=1e-4, pair=1e-6)) is not None
    assert object_fields(SLO(ttft_ms=100.0)) is not None
    assert object_fields(_Path("/etc")) is None
    from tinyserve.engine import Engine
    assert object_fields(object.__new__(Engine)) is None


# ------------------------------------------------------------------ (a) the reply budget

def _decoder():
    from autograder.protocol.wire import Decoder
    return Decoder(lambda *a: None)


def test_a_reply_of_nested_empty_lists_is_refused_before_parsing():
    import tracemalloc

    from autograder.protocol.wire import MAX_ELEMENTS, WireError
    text = "[" + ",".join(["[[],[]]"] * (MAX_ELEMENTS // 2)) + "]"   # ~3.5 MB, ~2.5M nodes
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match=f"more than {MAX_ELEMENTS:,} elements"):
            _decoder().loads(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak   # refused from a count of the text: nothing was built


def test_forty_megabytes_of_empty_lists_cost_no_memory():
    import tracemalloc

    from autograder.protocol.wire import WireError
    text = "[" + ",".join(["[]"] * (40 * 2**20 // 3)) + "]"
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="elements"):
            _decoder().loads(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20   # refused from a count of the text: nothing was built


def test_an_already_parsed_reply_is_held_to_the_same_budget():
    from autograder.protocol.wire import MAX_ELEMENTS, WireError
    with pytest.raises(WireError, match="elements"):
        _decoder().decode([[0, 0]] * (MAX_ELEMENTS // 2))


@pytest.mark.parametrize("tag", ["$set", "$d"])
@pytest.mark.parametrize("n", [50_000, 250_000])
def test_keys_that_all_hash_alike_are_refused_in_linear_time(tag, n):
    # Refused by the checks that run before any set or dict is built (the message says which):
    # building one from these keys is the quadratic work (minutes at 250,000 keys).
    from autograder.protocol.wire import MAX_HASHED_KEYS, WireError
    keys = [i * (2**61 - 1) for i in range(1, n + 1)]   # all hash to 0
    body = keys if tag == "$set" else [[k, 0] for k in keys]
    text = json.dumps({tag: body})
    with pytest.raises(WireError, match="share one hash" if n <= MAX_HASHED_KEYS
                       else "dict keys and set items"):
        _decoder().loads(text)


def test_too_many_hashed_keys_in_one_reply_are_refused():
    from autograder.protocol.wire import MAX_HASHED_KEYS, WireError
    half = MAX_HASHED_KEYS // 2 + 1
    text = json.dumps([{"$set": list(range(half))}, {"$d": [[i, 0] for i in range(half)]}])
    with pytest.raises(WireError, match=f"more than {MAX_HASHED_KEYS:,} dict keys"):
        _decoder().loads(text)


def test_real_answers_fit_the_budget():
    import torch

    from autograder.protocol.wire import Encoder
    value = {"tokens": list(range(200_000)), "counts": {i: i % 7 for i in range(50_000)},
             "seen": set(range(-1000, 1000)) | {-1, -2},   # -1 and -2 share a hash
             "logits": torch.randn(64, 4096), "traces": [(i, 0.5, "ok") for i in range(5000)]}
    text = Encoder(lambda obj, depth: None).dumps(value)
    got = _decoder().loads(text)
    assert got["counts"] == value["counts"] and got["seen"] == value["seen"]
    assert torch.equal(got["logits"], value["logits"]) and len(got["tokens"]) == 200_000


def test_a_reply_through_the_channel_is_counted_before_it_is_parsed():
    import tracemalloc

    from autograder.runner.channel import Channel
    from autograder.protocol.wire import WireError
    # The reply is built before memory is traced: only what the channel makes of it counts.
    reply = '{"id":1,"ok":[' + ",".join(["[]"] * (4 * 2**20 // 3)) + "]}"

    def kernel(request, timeout):
        return None if request is None else reply
    ch = Channel(kernel)
    tracemalloc.start()
    try:
        with pytest.raises(WireError):
            ch.request("name", name="answer")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak


# ------------------------------------------------------------------ (f) over the collect cap

def test_a_notebook_over_the_collect_cap_is_graded_failed_with_the_reason(tmp_path, monkeypatch):
    import shutil

    from autograder.pipeline import collect as collect_mod
    from autograder.pipeline.course import Course
    from autograder.pipeline.report import export
    from autograder.pipeline.worker import Job, grade
    fixture = Path(__file__).parent / "fixtures" / "mini_assignment" / "mini"
    course = Course(tmp_path / "course")
    shutil.copytree(fixture, course.source / "mini")
    shutil.copytree(fixture, course.release / "mini")   # stands in for the released copy
    monkeypatch.setattr(collect_mod, "MAX_FILE_MB", 1)  # a 2 MB notebook is over the cap
    upload = tmp_path / "upload"
    (upload / "ann" / "mini").mkdir(parents=True)
    (upload / "ann" / "mini" / "mini.ipynb").write_text(" " * (2 * 2**20))
    (upload / "ben" / "mini").mkdir(parents=True)
    (upload / "ben" / "mini" / "mini.ipynb").write_text("{}")
    students, warnings = collect_mod.collect(course, "mini", upload)
    assert students == ["ann", "ben"] and any("ann" in w and "1 MB" in w for w in warnings)
    result = grade(Job(root=str(course.root), assignment="mini", student="ann", unsafe=True))
    assert result["status"] == "failed"
    why = "; ".join(result["reasons"])
    assert "mini.ipynb was not collected" in why and "over the 1 MB limit" in why
    assert "clear its outputs" in why
    # A later collection without the problem leaves no stale note behind.
    (upload / "ann" / "mini" / "mini.ipynb").write_text("{}")
    collect_mod.collect(course, "mini", upload)
    assert collect_mod.collect_notes(course.submitted / "ann" / "mini") == []
    # And the student is in the grades with that reason.
    (upload / "ann" / "mini" / "mini.ipynb").write_text(" " * (2 * 2**20))
    collect_mod.collect(course, "mini", upload)
    (course.results / "mini").mkdir(parents=True)
    result = grade(Job(root=str(course.root), assignment="mini", student="ann", unsafe=True))
    (course.results / "mini" / "ann.json").write_text(json.dumps(result))
    out = course.work / "grades.csv"
    export(course, ["mini"], out)
    rows = {r["student"]: r for r in __import__("csv").DictReader(open(out))}
    assert rows["ann"]["status"] == "failed" and "over the 1 MB limit" in rows["ann"]["reason"]


# ------------------------------------------------------------------ (c) a failed job's page

def _job(tmp_path: Path, **kw):
    from autograder.pipeline.worker import Job
    return Job(root=str(tmp_path), assignment="mini", student="ann", **kw)


@pytest.mark.parametrize("script, backstop, expect", [
    ("import time; time.sleep(60)", True, "was stopped after"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", False, "SIGKILL"),
    ("raise SystemExit(3)", False, "exit code 3"),
])
def test_a_worker_that_dies_or_is_stopped_leaves_a_record_saying_how(tmp_path, monkeypatch,
                                                                     script, backstop, expect):
    import sys

    from autograder.pipeline import grade as grade_mod
    monkeypatch.setattr(grade_mod, "worker_command",
                        lambda job_path, out_path: [sys.executable, "-c", script])
    monkeypatch.setattr(grade_mod, "BACKSTOP_GRACE_S", 0.5 - 60)
    [result] = grade_mod.run_jobs([_job(tmp_path, total_timeout=60)], 1, progress=False)
    why = "; ".join(result["reasons"])
    assert result["status"] == "failed" and expect in why, why
    assert ("backstop" in why) == backstop


def test_a_failed_job_still_gets_a_feedback_page_saying_what_happened(tmp_path):
    from autograder.pipeline.report import feedback
    course = _course(tmp_path)
    record = {"student": "ann", "assignment": "mini", "status": "failed", "score": 0.0,
              "max_score": 0.0, "flags": [], "notebooks": {},
              "reasons": ["grading was stopped after 720 s (the grader's backstop)"]}
    (course.results / "mini").mkdir(parents=True)
    (course.results / "mini" / "ann.json").write_text(json.dumps(record))
    [page] = feedback(course, "mini")
    assert page.name == "mini.html"
    html = page.read_text()
    assert "Could not be graded" in html and "backstop" in html and "Score" not in html


# ------------------------------------------------------------------ (b) the worker's bounds

def _python(code: str, timeout: float = 60):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parents[1])


def test_a_worker_cannot_grow_past_its_memory_bound_and_its_kernel_keeps_its_own():
    out = _python(
        "import resource, subprocess, sys\n"
        "from autograder.pipeline.worker import limit_worker\n"
        "limit_worker(memory_mb=256, cpu_seconds=600)\n"
        "try:\n"
        "    bytearray(512 * 2**20)\n"
        "    print('worker grew')\n"
        "except MemoryError:\n"
        "    print('worker bounded')\n"
        # A child (the kernel) sets the sandbox's limits, larger than the worker's.
        "child = ('from autograder.kernel.boot import _set_limits\\n'\n"
        "         '_set_limits({\"memory_mb\": 2048, \"processes\": 4000, \"file_size_mb\": 64,'\n"
        "         ' \"cpu_seconds\": 300, \"open_files\": 1024})\\n'\n"
        "         'import resource; x = bytearray(512 * 2**20)\\n'\n"
        "         'print(\"kernel\", resource.getrlimit(resource.RLIMIT_DATA)[0] // 2**20,'\n"
        "         ' resource.getrlimit(resource.RLIMIT_CPU)[0])')\n"
        "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True)"
        ".stdout.strip())\n")
    assert out.stdout.splitlines() == ["worker bounded", "kernel 2048 300"], out.stderr


def test_a_worker_past_its_cpu_bound_is_ended_and_the_record_says_so():
    import signal
    out = _python("from autograder.pipeline.worker import limit_worker\n"
                  "limit_worker(memory_mb=4096, cpu_seconds=1)\n"
                  "while True:\n    pass\n", timeout=30)
    assert out.returncode == -signal.SIGXCPU
    from autograder.pipeline.grade import _why_no_result
    assert "SIGXCPU (its CPU time limit)" in _why_no_result(_job(Path(".")), out.returncode,
                                                           False)


def test_the_worker_applies_its_bounds_before_grading(tmp_path, monkeypatch):
    from autograder.pipeline import worker
    seen = {}
    monkeypatch.setattr(worker, "limit_worker",
                        lambda memory_mb, cpu_seconds: seen.update(mb=memory_mb, s=cpu_seconds))
    monkeypatch.setattr(worker, "grade", lambda job: {"student": job.student, "seen": dict(seen)})
    job_path, out_path = tmp_path / "job.json", tmp_path / "out.json"
    job_path.write_text(json.dumps({"root": str(tmp_path), "assignment": "mini",
                                    "student": "ann", "total_timeout": 100}))
    assert worker.main([str(job_path), str(out_path)]) == 0
    got = json.loads(out_path.read_text())["seen"]
    assert got["mb"] == worker.WORKER_MEMORY_MB and got["s"] >= 100


def test_a_notebook_over_the_cap_in_the_exchange_is_left_out_and_said(tmp_path, monkeypatch):
    from autograder.pipeline import collect as collect_mod
    from autograder.pipeline import exchange
    course = _course(tmp_path)
    monkeypatch.setattr(collect_mod, "MAX_FILE_MB", 1)
    src = tmp_path / "inbound" / "ann+mini+2026-12-01 10:00:00.000000 UTC"
    src.mkdir(parents=True)
    (src / "mini.ipynb").write_text(" " * (2 * 2**20))
    (src / "timestamp.txt").write_text("2026-12-01 10:00:00.000000 UTC")
    assert len(exchange._copy_submission(course, "mini", "ann", src)) == 1  # raised before
    dest = course.submitted / "ann" / "mini"
    assert not (dest / "mini.ipynb").exists() and (dest / "timestamp.txt").exists()
    [note] = collect_mod.collect_notes(dest)
    assert note.startswith("mini.ipynb was not collected") and "over the 1 MB limit" in note

"""Fast checks of the grading pieces that need no kernel: the channel's data format, the
test namespace, collect's handling of each upload alone, encodings in the export and the
feedback, repaired cell ids, the kernel's resource limits and the output cap."""
from __future__ import annotations

import collections
import csv
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from autograder.runner.channel import Channel, Remote, StudentError, TestNamespace
from autograder.pipeline.collect import collect
from autograder.pipeline.course import Course
from autograder.runner.execute import _output_size
from autograder.pipeline.report import export
from autograder.submitted.submission import load
from autograder.protocol.wire import Decoder, Encoder, WireError
from conftest import FakeKernel

FIXTURES = Path(__file__).parent / "fixtures"


# ------------------------------------------------------------------ the data format

def _roundtrip(value):
    text = Encoder(lambda obj, depth: (_ for _ in ()).throw(WireError("no"))).dumps(value)
    return Decoder(lambda *a: None).loads(text)


@pytest.mark.parametrize("value", [
    None, True, 3, -2**70, 2.5, float("inf"), "text \u00e9", [1, [2, 3]], (1, "a"),
    {"a": 1, 2: (3, 4)}, {1, 2}, collections.deque([1, 2]), b"\x00\xff",
])
def test_plain_values_cross_unchanged(value):
    got = _roundtrip(value)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.int64,
                                   torch.bool])
def test_tensors_cross_as_dtype_shape_and_bytes(dtype):
    t = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    got = _roundtrip(t)
    assert type(got) is torch.Tensor and got.dtype == dtype and got.shape == (3, 4)
    assert torch.equal(got, t)
    assert _roundtrip(torch.empty(0, 5)).shape == (0, 5)


def test_values_with_behaviour_never_decode_as_data():
    class Always(int):
        def __eq__(self, other):
            return True
    handles = []
    enc = Encoder(lambda obj, depth: handles.append(obj) or {"$h": [len(handles), "Always"]})
    text = enc.dumps([Always(3), 4.0])
    got = Decoder(lambda ref, name, methods=frozenset(): ("handle", ref, name)).loads(text)
    assert got == [("handle", 1, "Always"), 4.0] and type(got[1]) is float


@pytest.mark.parametrize("text", [
    '{"$pickle": "x"}', '{"$t": [1], "$d": []}', "[" * 5000 + "]" * 5000,
    '{"$tensor": ["float32", [2], "AAAA"]}', '{"$tensor": ["os.system", [1], ""]}',
    '{"$nd": ["O", [1], ""]}',
])
def test_malformed_messages_are_refused(text):
    with pytest.raises((WireError, TypeError, ValueError)):
        Decoder(lambda *a: None).loads(text)


# ------------------------------------------------------------------ the channel, faked kernel

def test_student_names_resolve_late_and_trusted_names_never_change():
    kernel = FakeKernel({"answer": '{"ok":42}', "check_equal": '{"ok":"forged"}'})
    ch = Channel(kernel)
    ns = TestNamespace(ch)
    ch.namespace = ns
    exec("def check_equal(a, b):\n    return a == b\nok = check_equal(answer, 42)", ns)
    assert ns["ok"] is True
    assert [r["name"] for r in kernel.sent] == ["answer"]  # check_equal was never asked for
    with pytest.raises(NameError):
        exec("missing_answer", ns)


def test_student_errors_come_back_marked_and_capped():
    kernel = FakeKernel({"f": '{"ok":{"$h":[7,"function",[]]}}'},
                        {"call": json.dumps({"error": ["builtins", "ValueError", "x" * 5000]})})
    ch = Channel(kernel)
    ns = TestNamespace(ch)
    ch.namespace = ns
    with pytest.raises(ValueError) as info:
        exec("f(1)", ns)
    assert info.value.autograder_student == "ValueError" and len(str(info.value)) < 600
    # An AssertionError from the student's code is never mistaken for a test's message.
    kernel.replies["call"] = json.dumps({"error": ["builtins", "AssertionError", "[t] ok"]})
    with pytest.raises(StudentError):
        exec("f(1)", ns)


def test_a_handle_compares_by_identity_only():
    ch = Channel(FakeKernel({}))
    a, b = Remote(ch, 1, "Always"), Remote(ch, 2, "Always")
    assert a != b and not (a == 3) and a == a


# ------------------------------------------------------------------ collect, upload by upload

def _course(tmp_path) -> Course:
    import shutil
    shutil.copytree(FIXTURES / "mini_assignment" / "mini", tmp_path / "solutions" / "mini")
    return Course(tmp_path)


def test_a_nested_copy_in_one_upload_never_replaces_another_students(tmp_path):
    course = _course(tmp_path / "course")
    z = tmp_path / "export.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("export/ann/mini/mini.ipynb", "ANN")
        zf.writestr("export/ben/mini/mini.ipynb", "BEN")
        zf.writestr("export/ben/mini/ann/mini/mini.ipynb", "FORGED")
        zf.writestr("export/zed/ann/mini/mini.ipynb", "FORGED TOO")
    students, warnings = collect(course, "mini", z)
    assert students == ["ann", "ben"]
    assert (course.submitted / "ann" / "mini" / "mini.ipynb").read_text() == "ANN"
    assert any("ann: also found under export/zed/ann" in w for w in warnings), warnings


def test_one_bad_upload_costs_only_its_student(tmp_path):
    course = _course(tmp_path / "course")
    z = tmp_path / "export.zip"
    with zipfile.ZipFile(z, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("bob/mini/mini.ipynb", "BOB-PAYLOAD-" * 100)     # its CRC will lie
        zf.writestr("ann/mini/mini.ipynb", "ANN")
        zf.writestr("carl/mini/x", "a file...")
        zf.writestr("carl/mini/x/y", "...and a folder of the same name")
        zf.writestr(f"dave/mini/{'n' * 300}.ipynb", "a name too long")
        zf.writestr("erin/mini/mini.ipynb", "ERIN")
    raw = bytearray(z.read_bytes())
    at = raw.index(b"BOB-PAYLOAD-")
    raw[at] = ord("X")
    z.write_bytes(bytes(raw))
    students, warnings = collect(course, "mini", z)
    assert students == ["ann", "erin"], warnings
    for who in ("bob", "carl", "dave"):
        assert any(w.startswith(f"{who}: not collected") for w in warnings), (who, warnings)
        assert not (course.submitted / who / "mini").exists()


# ------------------------------------------------------------------ encodings, ids, limits

def test_lone_surrogates_never_stop_the_export_or_a_feedback_page(tmp_path):
    course = _course(tmp_path)
    result = {"student": "ann", "assignment": "mini", "status": "graded", "score": 1.0,
              "max_score": 4.0, "flags": [], "reasons": ["unknown nbgrader cell ids: evil\udc80"],
              "notebooks": {"mini": {"tests": [
                  {"grade_id": "t\ud800", "kind": "test", "max_points": 1, "points": 0,
                   "passed": False, "needs_manual_grade": False,
                   "message": "your code raised ValueError: bad \udc80"}]}}}
    (course.results / "mini").mkdir(parents=True)
    (course.results / "mini" / "ann.json").write_text(json.dumps(result))
    out = course.work / "grades.csv"
    assert export(course, ["mini"], out) == 1
    row = next(csv.DictReader(open(out, encoding="utf-8")))
    assert "evil\ufffd" in row["reason"]
    from autograder.pipeline.report import feedback
    [page] = feedback(course, "mini")
    text = page.read_text(encoding="utf-8")
    assert "bad \ufffd" in text and "t\ufffd" in text


def test_cell_ids_with_path_characters_are_replaced_not_fatal(tmp_path):
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    data = json.loads(nbformat.writes(nb))
    data["cells"][0]["id"] = "../../etc/passwd"
    path = tmp_path / "mini.ipynb"
    path.write_text(json.dumps(data))
    loaded, notes = load(path)
    nbformat.validate(loaded)  # writing the graded copy validates it
    assert loaded.cells[0].id != "../../etc/passwd"
    assert any("cell id" in n for n in notes)


def test_the_kernel_gets_its_memory_limit(tmp_path):
    code = ("import resource, json; from autograder.kernel.boot import _set_limits\n"
            "_set_limits({'memory_mb': 1500, 'processes': 4000, 'file_size_mb': 64,"
            " 'cpu_seconds': 300, 'open_files': 1024})\n"
            "print(json.dumps(resource.getrlimit(resource.RLIMIT_AS)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert json.loads(out.stdout) == [1500 * 2**20] * 2, out.stderr


def test_output_metadata_counts_against_the_cap():
    small = {"data": {"text/plain": "x"}, "metadata": {"m": "y" * 10**6}}
    assert _output_size(small) > 10**6


# ------------------------------------------------------------------ messages (issue 17, item 7)

def test_numbers_print_one_way_with_separators_and_units():
    from autograder.testkit import check_close
    with pytest.raises(AssertionError) as info:
        check_close(536_870_912, 1_073_741_824, name="kv", unit="bytes")
    text = str(info.value)
    assert "expected 1,073,741,824 bytes" in text and "got 536,870,912 bytes" in text
    assert "e+" not in text
    with pytest.raises(AssertionError) as info:
        check_close(0.0215, 0.021, name="itl", abs=1e-6, unit="s")
    assert "expected 0.021 s" in str(info.value) and "got 0.0215 s" in str(info.value)


def test_feedback_names_pending_manual_points_and_its_title_once():
    from autograder.pipeline.report import render
    nb = {"tests": [
        {"grade_id": "test_a", "kind": "test", "max_points": 2, "points": 2, "passed": True,
         "needs_manual_grade": False, "message": "passed"},
        {"grade_id": "written", "kind": "manual", "max_points": 3, "points": 0,
         "passed": False, "needs_manual_grade": True, "message": "awaiting manual grading"}]}
    r = {"status": "graded", "reasons": []}
    page = render("ann", "mini", "mini", r, nb, {})
    assert "answers awaiting manual grading: 3 points" in page
    assert "mini / mini" not in page and "<h1>mini</h1>" in page
    assert "awaiting" not in render("ann", "mini", "mini", r, {"tests": nb["tests"][:1]}, {})


def test_an_unanswered_name_reads_not_answered_yet():
    from autograder.runner.execute import CellResult
    from autograder.runner.trusted import _failure
    from autograder.pipeline.worker import failure_message
    try:
        exec("WORKED_EXAMPLE_BYTES + 1", {})
    except NameError as e:
        assert failure_message(_failure(e)).startswith("not answered yet")
    student = ValueError("boom")
    student.autograder_student = "AssertionError"
    assert failure_message(_failure(student)) == "your code raised AssertionError: boom"
    assert failure_message(CellResult("error", "AssertionError", "[t] expected 4")) \
        == "[t] expected 4"


def test_the_formgrader_view_of_a_submission_carries_no_active_content(tmp_path):
    """The formgrader renders a submission with nbconvert's HTMLExporter, nbgrader's formgrade
    template and this course's nbgrader_config.py; a student's planted scripts must not
    survive it (in a markdown answer, an HTML output, a JavaScript output)."""
    import nbformat
    from nbconvert.exporters import HTMLExporter
    from traitlets.config import Config
    from nbgrader.server_extensions.formgrader import handlers
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("My answer <script>window.pwned = 1</script> **bold**"),
        nbformat.v4.new_code_cell("x", outputs=[
            nbformat.v4.new_output("display_data", data={
                "text/html": "<b>hi</b><script>window.pwned = 2</script>"
                             "<img src=x onerror='window.pwned = 3'>",
                "application/javascript": "window.pwned = 4"})])])
    config = Config()
    course_config = Path(__file__).resolve().parents[1] / "nbgrader_config.py"
    exec(course_config.read_text(), {"get_config": lambda: config, "__file__": str(course_config)})
    config.HTMLExporter.template_name = "formgrade"
    config.HTMLExporter.extra_template_basedirs = [handlers.template_path]
    html, _ = HTMLExporter(config=config).from_notebook_node(nb, resources={
        "assignment_id": "mini", "notebook_id": "mini", "submission_id": "y", "index": 0,
        "total": 1, "base_url": "", "student": "ann", "last_name": "", "first_name": "",
        "notebook_path": "x"})
    import re
    # What is left of the planted code is inert, escaped text; no tag or handler survives.
    assert not re.search(r"<script[^>]*>[^<]*pwned", html)
    assert not re.search(r"<img[^>]*onerror", html) and "window.pwned = 4" not in html
    assert "<b>hi</b>" in html and "<strong>bold</strong>" in html


# ------------------------------------------------------------------ the protocol end to end

@pytest.fixture()
def in_process(monkeypatch):
    """The trusted side talking to autograder.kernel.agent in this process (no kernel): the same
    requests and replies as over jupyter's stdin channel."""
    from autograder.kernel import agent
    student_ns: dict = {}
    monkeypatch.setattr(agent, "_user_ns", lambda: student_ns)
    ch = Channel(lambda request, timeout: None if request is None else agent.serve(request))
    ns = TestNamespace(ch)
    ch.namespace = ns
    return student_ns, ns


def test_a_learners_class_is_driven_by_method_calls(in_process):
    student, ns = in_process
    exec("class Pool:\n"
         "    def __init__(self, n):\n        self.free = list(range(n))\n"
         "    @property\n    def num_free(self):\n        return len(self.free)\n"
         "    def take(self, k):\n        got, self.free = self.free[:k], self.free[k:]\n"
         "        return got\n", student)
    exec("p = Pool(5)\ngot = p.take(2)\nleft = (p.free, p.num_free)", ns)
    assert ns["got"] == [0, 1] and ns["left"] == ([2, 3, 4], 3)
    assert type(ns["p"]).__name__ == "Remote"


def test_lent_objects_come_back_with_what_the_call_wrote_and_nothing_else(in_process):
    from tinyserve.engine import EngineConfig
    student, ns = in_process
    exec("def tune(cfg):\n    cfg.max_num_seqs = 99\n    cfg.policy = object()\n"
         "    cfg.extra = 1\n    return slice(1, 5), range(3)", student)
    from autograder.testkit import yours_to_write
    cfg = yours_to_write(EngineConfig())   # copied back only into objects marked so
    ns["cfg"] = cfg
    exec("out = tune(cfg)", ns)
    assert cfg.max_num_seqs == 99                       # same field, same type: copied back
    assert cfg.policy == "fcfs" and not hasattr(cfg, "extra")  # a new type, a new field: not
    assert ns["out"] == (slice(1, 5), range(3))


@pytest.fixture()
def counted(monkeypatch):
    """Like ``in_process``, and a TrustedRunner over it, with every request's text kept."""
    from autograder.kernel import agent
    from autograder.runner.trusted import TrustedRunner
    student_ns: dict = {"__name__": "__main__"}   # classes defined there are the kernel's
    sent: list[str] = []
    monkeypatch.setattr(agent, "_user_ns", lambda: student_ns)

    def exchange(request, timeout):
        if request is None:
            return None
        sent.append(request)
        return agent.serve(request)
    runner = TrustedRunner(exchange, cwd=".")
    return student_ns, runner, sent


def _cell(source: str):
    import nbformat
    return nbformat.v4.new_code_cell(source)


def test_a_kernel_opt_in_in_cell_metadata_no_longer_moves_a_test_into_the_kernel():
    import nbformat
    from autograder.pipeline.worker import grading_plan
    test = nbformat.v4.new_code_cell("check(True, name='t', message='')", metadata={
        "autograder": {"tests_in": "kernel"},
        "nbgrader": {"grade": True, "solution": False, "locked": True, "grade_id": "t",
                     "points": 1, "schema_version": 3}})
    plan = grading_plan(nbformat.v4.new_notebook(cells=[test]))
    assert plan.trusted_tests and plan.tests == {0} and plan.guarded == set()


def test_only_errors_raised_in_the_learners_code_are_reported_as_theirs(counted):
    from autograder.pipeline.worker import failure_message
    student, runner, _ = counted
    exec("def label():\n    return 'seven'\n"
         "def parse(text):\n    return int(text)\n", student)
    # The test's own arithmetic fails on the (wrong-typed) answer: the test raised it.
    r = runner.run_test(_cell("total = label() + 1"), "cell t1", timeout=30)
    assert (r.ename, r.student) == ("TypeError", False)
    message = failure_message(r)
    assert message.startswith("the test itself raised TypeError") and "your code raised" \
        not in message
    # The same kind of error raised inside the learner's function: theirs.
    r = runner.run_test(_cell("parse('seven')"), "cell t2", timeout=30)
    assert (r.ename, r.student) == ("ValueError", True)
    assert failure_message(r).startswith("your code raised ValueError: invalid literal")


def test_call_each_is_one_request_and_stops_at_the_first_error(counted):
    student, runner, sent = counted
    exec("def double(x):\n    if x == 3:\n        raise ValueError('three')\n    return 2 * x\n",
         student)
    runner.ns["call_each"] = __import__("autograder.testkit").testkit.call_each
    assert runner.run_test(_cell("got = call_each(double, [(i,) for i in range(3)])"),
                           "cell t", timeout=30).status == "ok"
    assert runner.ns["got"] == [0, 2, 4]
    assert [json.loads(s)["op"] for s in sent] == ["name", "map"]   # one request, 3 calls
    r = runner.run_test(_cell("call_each(double, [(1,), (3,), (5,)])"), "cell u", timeout=30)
    assert (r.ename, r.student, r.evalue) == ("ValueError", True, "three")
    # Without the channel (a notebook run in one kernel) it is the plain loop.
    from autograder.testkit import call_each
    assert call_each(lambda a, b: a + b, [(1, 2), (3, 4)]) == [3, 7]


def test_a_large_constant_crosses_once_and_a_changed_copy_is_sent_again(counted):
    student, runner, sent = counted
    exec("def total(w):\n    return float(w['a'].sum())\n"
         "def spoil(w):\n    w['a'].zero_()\n"
         "def spoil_data(w):\n    w['a'].data.zero_()\n", student)
    assert runner.run_setup(_cell("import torch\nW = {'a': torch.ones(200, 200)}"),
                            "cell setup") == ""
    sizes = []
    for _ in range(3):
        sent.clear()
        assert runner.run_test(_cell("got = total(W)"), "cell t", timeout=30).status == "ok"
        assert runner.ns["got"] == 40_000.0
        sizes.append(len(sent[-1]))
    assert sizes[0] > 200 * 200 * 4 and max(sizes[1:]) < 200   # bytes once, then a number
    # The learner's code changed its copy in place, through .data too (a version counter of
    # its own): the next call still gets the tests' value, and no bytes go again (each
    # request works on a copy of what the kernel keeps).
    for spoil in ("spoil", "spoil_data"):
        sent.clear()
        runner.run_test(_cell(f"{spoil}(W)\ngot = total(W)"), "cell u", timeout=30)
        assert runner.ns["got"] == 40_000.0 and max(len(r) for r in sent) < 200
    # A change on the tests' side is a new constant.
    runner.run_test(_cell("W['a'].mul_(2)\ngot = total(W)"), "cell v", timeout=30)
    assert runner.ns["got"] == 80_000.0


def test_a_method_calls_reply_leaves_out_large_attributes_without_encoding_them(counted,
                                                                              monkeypatch):
    from autograder.kernel import agent
    from autograder.protocol import wire
    student, runner, _ = counted
    copied = []
    real = wire._tensor_bytes
    monkeypatch.setattr(wire, "_tensor_bytes", lambda t: copied.append(t.numel()) or real(t))
    exec("import torch\nclass Holder:\n    def __init__(self):\n"
         "        self.big = torch.zeros(1_000_000)\n        self.n = 0\n"
         "    def bump(self):\n        self.n += 1\n        return self.n\nh = Holder()\n", student)
    replies = []
    serve = agent.serve
    runner.channel._execute = lambda req, t: None if req is None else \
        replies.append(serve(req)) or replies[-1]
    assert runner.run_test(_cell("a = h.bump()\nb = h.n"), "cell t", timeout=30).status == "ok"
    assert (runner.ns["a"], runner.ns["b"]) == (1, 1)
    assert max(len(r) for r in replies) < 2000     # the 4 MB tensor never went into a reply
    assert copied == []                            # nor was it copied to find out it is large


def test_a_policy_asked_over_the_channel_schedules_exactly_as_run_directly(counted):
    """The reference is the policy itself inside the engine; over the channel, the trusted
    side's AskedPolicy must make every decision the same (same TTFT for every request)."""
    from autograder.remote_policy import AskedPolicy, PolicyDriver
    from tinyserve.engine import EngineConfig
    from tinyserve.policies import SizeAware
    from tinyserve.simulator import CostModel, completed_traces, serve, simulated_engine
    from tinyserve.workload import Fixed, Mixture, Uniform, make_workload
    student, runner, sent = counted
    student["POLICY"], student["_policy_driver"] = SizeAware(64, 0.25), PolicyDriver
    specs = make_workload(120, 30.0, Mixture((Uniform(8, 40), Fixed(120)), (0.7, 0.3)),
                          Uniform(4, 24), seed=3)
    fleet = dict(num_blocks=256, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                 chunked_prefill=True)
    cost = CostModel(step=7.7e-3, token=1.3e-5, row=5.2e-4, pair=1.4e-6)

    def run(policy):
        engine = simulated_engine(EngineConfig(**fleet, policy=policy), cost)
        if isinstance(policy, AskedPolicy):
            policy.scheduler = engine.scheduler
        traces = completed_traces(serve(engine, specs))
        return engine.steps, sorted((t.arrival, t.ttft, t.prompt_tokens) for t in traces)

    steps, direct = run(SizeAware(64, 0.25))
    asked = runner.ns["asked"] = AskedPolicy(None)
    runner.run_test(_cell("asked.ask = _policy_driver(POLICY).ask"), "cell t", timeout=30)
    with __import__("contextlib").ExitStack():
        runner.channel.deadline = float("inf")
        got_steps, over_channel = run(asked)
    assert len(direct) == 120 and over_channel == direct and got_steps == steps
    assert 0 < asked.requests < steps        # one request per step at most, none when full


def test_feedback_shows_each_hand_graded_answers_mark_scheme_escaped():
    """The mark scheme comes from the grader's copy (release cuts it) and appears, escaped,
    under its answer's row after grading; answers without one and tests get none."""
    import nbformat
    from autograder.pipeline.report import mark_schemes, render
    task = nbformat.v4.new_markdown_cell(
        "**2a (3 points).** Explain.\n\n### BEGIN MARK SCHEME\n*Rubric (3 points):*\n"
        "* 1 point: names the <queue> & the prefill <script>x()</script>\n### END MARK SCHEME")
    answer = nbformat.v4.new_markdown_cell("model answer")
    answer.metadata = {"nbgrader": {"grade": True, "solution": True, "grade_id": "written",
                                    "points": 3}}
    bare = nbformat.v4.new_markdown_cell("another answer")
    bare.metadata = {"nbgrader": {"grade": True, "solution": True, "grade_id": "bare",
                                  "points": 1}}
    schemes = mark_schemes(nbformat.v4.new_notebook(cells=[task, answer, bare]))
    assert schemes == {"written": "*Rubric (3 points):*\n* 1 point: names the <queue> & the "
                                  "prefill <script>x()</script>"}
    nb = {"tests": [
        {"grade_id": "test_a", "kind": "test", "max_points": 2, "points": 2, "passed": True,
         "needs_manual_grade": False, "message": "passed"},
        {"grade_id": "written", "kind": "manual", "max_points": 3, "points": 0,
         "passed": False, "needs_manual_grade": True, "message": "awaiting manual grading"},
        {"grade_id": "bare", "kind": "manual", "max_points": 1, "points": 0,
         "passed": False, "needs_manual_grade": True, "message": "awaiting manual grading"}]}
    page = render("ann", "mini", "mini", {"status": "graded", "reasons": []}, nb, {}, schemes)
    assert page.count("Mark scheme") == 1
    row = page.index("<td>written</td>")
    assert row < page.index("Mark scheme") < page.index("<td>bare</td>")
    assert "names the &lt;queue&gt; &amp; the prefill &lt;script&gt;" in page
    assert "<script>" not in page
    # The course's own notebooks: every hand-graded answer of practice has its scheme in the
    # grader's copy, and none of it is in the release (the leak test checks every assignment).
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    practice = mark_schemes(nbformat.read(root / "solutions/practice/practice.ipynb", 4))
    assert set(practice) == {"written_two_bars", "written_capacity", "written_speculative",
                             "written_drill"}
    released = (root / "exercises/practice/practice.ipynb").read_text()
    assert all("Rubric" in s and s.splitlines()[1] not in released for s in practice.values())

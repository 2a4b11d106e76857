"""What the trusted runner takes from the kernel (issue 25): answers, as data, and nothing
else. Fast checks with a faked kernel; the attacks themselves, graded end to end, are hostile
fixtures (tests/fixtures/hostile/)."""
from __future__ import annotations

import json

import pytest

from autograder.runner.channel import Channel, TemplateNameUnbound, TestNamespace
from autograder.submitted.scan import names_a_cell_binds
from conftest import FakeKernel


def _namespace(kernel, template_names=()) -> TestNamespace:
    ch = Channel(kernel)
    ns = TestNamespace(ch, frozenset(template_names))
    ch.namespace = ns
    return ns


# ------------------------------------------------------------------ finding 1

def test_every_binding_form_of_a_template_cell_is_found():
    source = ("import json\nfrom x import y as z\nCONST = 1\nif __name__ == '__main__':\n"
              "    _own, _dev = 1, 2\nfor i in []: pass\n(w := 3)\ndef f():\n    global g\n"
              "    g = 1\nclass C: pass\n[v for v in range(3)]\nwith open('a') as fh: pass\n")
    assert names_a_cell_binds(source) == {"json", "z", "CONST", "_own", "_dev", "i", "w", "f",
                                          "g", "C", "fh"}


def test_a_name_the_template_binds_is_never_fetched_from_the_kernel():
    kernel = FakeKernel({"check_close": '{"ok":"forged"}', "answer": '{"ok":41}'})
    ns = _namespace(kernel, {"check_close", "CONST"})
    with pytest.raises(TemplateNameUnbound, match="read-only cell above failed"):
        exec("check_close(answer, 42)", ns)
    with pytest.raises(TemplateNameUnbound):
        exec("def t():\n    return CONST\nt()", ns)  # through a function's globals too
    assert [r["name"] for r in kernel.sent] == []      # nothing was asked of the kernel
    assert ns["answer"] == 41                          # a student's name still resolves


# ------------------------------------------------------------------ finding 5

@pytest.fixture()
def in_process(monkeypatch):
    """The trusted side talking to autograder.kernel.agent in this process (no kernel)."""
    from autograder.kernel import agent
    from autograder.runner.trusted import TrustedRunner
    student_ns: dict = {"__name__": "__main__"}
    monkeypatch.setattr(agent, "_user_ns", lambda: student_ns)
    runner = TrustedRunner(lambda request, timeout: None if request is None
                           else agent.serve(request), cwd=".")
    return student_ns, runner


def _cell(source: str):
    import nbformat
    return nbformat.v4.new_code_cell(source)


def test_a_lent_object_is_written_back_only_where_a_test_marked_it(in_process):
    student, runner = in_process
    assert runner.run_setup(_cell("from tinyserve.engine import EngineConfig\n"
                                  "SLO = EngineConfig(max_num_seqs=4)"), "setup") == ""
    ns = runner.ns
    exec("def bump(c):\n    c.max_num_seqs = 99\n    return 0", student)
    runner.run_test(_cell("from autograder.testkit import yours_to_write\n"
                          "mine = EngineConfig(max_num_seqs=4)\n"
                          "bump(SLO); bump(mine); theirs = yours_to_write(EngineConfig());"
                          " bump(theirs)\n"
                          "yours_to_write(SLO); bump(SLO)"), "t", 30)
    assert ns["SLO"].max_num_seqs == 4      # a read-only cell's object: never, even if marked
    assert ns["mine"].max_num_seqs == 4     # a test's object it did not mark: not written
    assert ns["theirs"].max_num_seqs == 99  # marked as the learner's to write: copied back


# ------------------------------------------------------------------ finding 4

def test_prompts_that_are_not_the_reply_keep_the_channel_in_step():
    """The student's own input() is answered with an empty line; a stale reply of the loop
    gets the request again; the reply taken is always the one with the request's id."""
    script = []   # what the kernel answers next, whatever it was sent

    def kernel(request, timeout):
        if request is None:
            return None
        kernel.seen.append(request)
        if script:
            return script.pop(0)
        req = json.loads(request)
        return '{"id":%d,"ok":%d}' % (req["id"], 10 * req["id"])
    kernel.seen = []
    ns = _namespace(kernel)
    ch = ns._channel
    exec("f = None", ns)
    ns["f"] = __import__("autograder.runner.channel", fromlist=["Remote"]).Remote(ch, 1, "function")
    script[:] = ["press enter to go on", '{"id":99,"ok":0}']
    assert ns["f"]() == 10                    # request 1, after two strays
    assert kernel.seen[1] == ""               # the input() prompt got an empty line
    assert kernel.seen[2] == kernel.seen[0]   # the stale reply: the request again
    assert ns["f"]() == 20                    # and the next call is not one behind


# ------------------------------------------------------------------ finding 2

def _trusted_names():
    import math

    import torch
    import tinyserve.model
    return {"torch": torch, "math": math, "F": torch.nn.functional,
            "_apply_rope": tinyserve.model.apply_rope, "tinyserve": tinyserve, "DEVICE": "cpu"}


OWN = "def rms_norm(x, w, eps):\n    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w"


@pytest.mark.parametrize("cells, why", [
    ([OWN], None),
    (["def helper(x):\n    return x.pow(2).mean(-1, keepdim=True)\n",
      "def rms_norm(x, w, eps):\n    return x * torch.rsqrt(helper(x) + eps) * w"], None),
    (["def rms_norm(x, w, eps):\n    return attention(x) * w"], None),   # another piece
    (["from tinyserve.model import RMSNorm\n", "def rms_norm(x, w, eps):\n    return RMSNorm(4)(x)"],
     "through RMSNorm: imports tinyserve.model"),
    (["def rms_norm(x, w, eps, rope=_apply_rope):\n    return rope(x)"], "uses _apply_rope"),
    (["def rms_norm(x, w, eps):\n    return __import__('tiny' + 'serve').model.rms_norm(x)"],
     "__import__"),
    (["torch.my_norm = 1\n", "def rms_norm(x, w, eps):\n    return torch.my_norm(x)"],
     "torch does not have"),
    (["def rms_norm(x, w, eps):\n    return x.__class__.__init__.__globals__['norm'](x)"],
     "__globals__"),
    (["globals()['norm'] = 1\n", "def rms_norm(x, w, eps):\n    return norm(x)"],
     "no cell defines"),
    (["def rms_norm(x, w, eps):\n    return F.scaled_dot_product_attention(x)"],
     "uses scaled_dot_product_attention"),
    (["%%time\nfrom tinyserve.model import rms_norm as r\n"
      "def rms_norm(x, w, eps):\n    return r(x, w, eps)"], "imports tinyserve.model"),
])
def test_a_pieces_provenance_is_read_from_the_submitted_source(cells, why):
    from autograder.submitted.own_source import problems
    found = problems(cells, "rms_norm", ("rms_norm", "attention"), _trusted_names(),
                     banned=("scaled_dot_product_attention",))
    if why is None:
        assert found == []
    else:
        assert any(why in f for f in found), found


def test_a_pasted_copy_of_the_reference_is_recognised():
    from autograder.build_checks import _REFERENCE_LINES
    from autograder.submitted.own_source import copied_lines
    code = sorted(line for line in _REFERENCE_LINES if not line.startswith(('"', "'")))[:4]
    source = "def f(x):\n" + "\n".join(f"    {line}" for line in code)
    assert copied_lines(source, frozenset(_REFERENCE_LINES))
    assert not copied_lines(OWN, frozenset(_REFERENCE_LINES))


def test_a_lent_object_counts_on_the_tests_side_what_the_learners_code_does(in_process,
                                                                            monkeypatch):
    """The learner's code gets a stand-in: its methods and attributes are served here, one
    call back each, and it cannot be written; the tests read the real object's count."""
    from autograder.kernel import agent
    student, runner = in_process
    # In this process a call back goes straight to the runner (over jupyter it is one more
    # prompt and input reply inside the running request).
    monkeypatch.setattr(agent, "_ask", lambda text: runner.channel._call_back(json.loads(text)))
    exec("def use(model):\n    out = [model.feed([1, 2]), model.feed([3]), model.length]\n"
         "    try:\n        model.passes = 1\n    except AttributeError as e:\n"
         "        out.append(str(e))\n    return out", student)
    runner.run_setup(_cell("class Model:\n    def __init__(self):\n        self.passes, self.length = 0, 0\n"
                           "    def feed(self, tokens):\n        self.passes += 1\n"
                           "        self.length += len(tokens)\n        return sum(tokens)\n"
                           "    def secret(self):\n        return 'no'"), "setup")
    result = runner.run_test(_cell("from autograder.testkit import lend\n"
                                   "m = lend(Model(), ('feed',), ('length',))\n"
                                   "got = use(m)"), "t", 30)
    assert result.status == "ok", result
    ns = runner.ns
    assert ns["got"][:3] == [3, 3, 3] and "cannot be set" in ns["got"][3]
    assert ns["m"].passes == 2                 # counted here, by the tests' own object
    exec("def peek(model):\n    return model.secret()", student)
    result = runner.run_test(_cell("peek(m)"), "t2", 30)
    assert result.status == "error" and "has no 'secret'" in result.evalue


# ------------------------------------------------------------------ item 6: hidden lines

def test_no_output_of_a_graded_notebook_quotes_hidden_test_source():
    import nbformat

    from autograder.pipeline.worker import HIDDEN_MARK, scrub_hidden_lines
    secret = {"check_equal(double(21), 42, name='double hidden')"}
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout",
                               text="echo: check_equal(double(21), 42, name='double hidden')\n"),
        nbformat.v4.new_output("error", ename="E", evalue="at check_equal(double(21), 42, "
                               "name='double hidden')", traceback=["a", "check_equal(double(21), "
                                                                   "42, name='double hidden')"]),
        nbformat.v4.new_output("display_data", data={"text/plain": "check_equal(double(21), 42, "
                                                                   "name='double hidden')"})]
    nb.cells.append(cell)
    scrub_hidden_lines(nb, secret)
    text = json.dumps(nb)
    assert "double hidden" not in text and text.count(HIDDEN_MARK) == 4


def test_a_lent_function_gets_the_tests_constants_back_by_number(in_process, monkeypatch):
    """A lent function the learner's code calls with the tests' weights: they go back as
    their numbers (not 160 kB each call) and the function gets the tests' own tensors."""
    from autograder.kernel import agent
    student, runner = in_process
    texts = []

    def ask(text):
        texts.append(text)
        return runner.channel._call_back(json.loads(text))
    monkeypatch.setattr(agent, "_ask", ask)
    exec("def run(step, w, n):\n    return [step(w, i) for i in range(n)]", student)
    assert runner.run_setup(_cell("import torch\nW = {'a': torch.ones(200, 200)}\nSEEN = []\n"
                                  "def step(w, i):\n    SEEN.append(w['a'])\n"
                                  "    return float(w['a'][0, 0]) + i"), "setup") == ""
    result = runner.run_test(_cell("from autograder.testkit import lend\n"
                                   "got = run(lend(step, ('__call__',)), W, 3)"), "t", 30)
    assert result.status == "ok", result
    ns = runner.ns
    assert ns["got"] == [1.0, 2.0, 3.0]
    assert all(t is ns["W"]["a"] for t in ns["SEEN"])   # the tests' tensor, not a copy
    assert max(len(t) for t in texts) < 500             # by number, not by value

"""Shared test set-up: deterministic torch on a small number of threads."""
from __future__ import annotations

import collections
import functools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from tinyserve.config import ModelConfig
    from tinyserve.model import TinyLlama

torch.set_num_threads(2)


def sharp_model(cfg: "ModelConfig", seed: int) -> "TinyLlama":
    """A seeded random model with weights scaled up 3x, so its logits are far from uniform
    and greedy decoding has no near-ties that float noise could flip."""
    from tinyserve.model import TinyLlama
    torch.manual_seed(seed)
    model = TinyLlama(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    return model


def random_prompt(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


@pytest.fixture
def sdpa_efficient_layout():  # -> Iterator[sdpa_layout.EfficientLayoutSDPA]
    """Every SDPA call in the test returns the memory-efficient kernel's layout (what CUDA
    returns for a masked or fp32 call; tests/sdpa_layout.py)."""
    from sdpa_layout import efficient_layout
    with efficient_layout() as fake:
        yield fake


def pytest_configure(config: pytest.Config) -> None:
    from sdpa_layout import ENV
    value = os.environ.get(ENV, "")
    if value not in ("", "efficient"):
        raise pytest.UsageError(f"{ENV}={value!r}: the only layout it imposes is 'efficient' "
                                f"(unset it for the kernels' own layouts)")


@pytest.fixture(scope="session", autouse=True)
def _sdpa_layout_switch():
    """``TINYSERVE_SDPA_LAYOUT=efficient`` imposes that layout on the whole run."""
    from sdpa_layout import ENV, efficient_layout
    if not os.environ.get(ENV):
        yield
        return
    with efficient_layout():
        yield


def _compiles(item: pytest.Item) -> int | None:
    """How many cells of a chapter run compile the fast path (a minute or more each, the
    heaviest units of ``make test``); None for any test other than a chapter run."""
    if "::test_runs_without_a_compiler[" in item.nodeid:
        return 0                                   # a chapter run, with nothing to compile
    if "::test_runs_top_to_bottom[" not in item.nodeid:
        return None
    from test_course_notebooks import _PREPARES
    return len(_PREPARES.findall(Path(item.callspec.params["path"]).read_text()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Longest first, as xdist hands out scopes in collection order (``make test``'s scheduler
    # below keeps it): the chapter runs, most compiles first, then the files, most tests first
    # (xdist's own order). Left to xdist, every one-test chapter run came last, so the slowest
    # unit (chapter 8, six minutes cold) could start last and run alone. The same order in every worker (xdist
    # checks it); a stable sort, so a file's tests keep theirs.
    per_file = collections.Counter(item.nodeid.split("::")[0] for item in items)

    def longest_first(item: pytest.Item) -> tuple[int, int]:
        compiles = _compiles(item)
        if compiles is not None:
            return (0, -compiles)
        return (1, -per_file[item.nodeid.split("::")[0]])
    items.sort(key=longest_first)
    # GPU tests are collected everywhere and skipped, with the reason, where CUDA is absent.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class FakeKernel:
    """A grading kernel's answers to the trusted runner's requests (as autograder.kernel.agent would
    send them), from canned replies by op, and by name for ``name`` requests."""

    def __init__(self, names: dict, replies=None):
        self.names, self.replies, self.sent = names, replies or {}, []

    def __call__(self, request, timeout):
        if request is None:
            return None
        req = json.loads(request)
        self.sent.append(req)
        if req["op"] == "name":
            reply = self.names.get(req["name"], '{"missing":true}')
        else:
            reply = self.replies[req["op"]]
        return '{"id":%d,%s' % (req["id"], reply[1:])  # replies carry their request's id


@functools.lru_cache(maxsize=1)
def sandbox_skip_reason() -> str | None:
    """Why sandboxed grading tests cannot run here, or None when they can.

    On a learner's laptop without bubblewrap these tests skip with the reason. In CI
    (``CI`` set) they never skip: a missing sandbox there must fail the run, not hide."""
    from autograder.runner.sandbox import sandbox_available
    ok, why = sandbox_available()
    if ok or os.environ.get("CI"):
        return None
    return f"needs the bubblewrap sandbox: {why}"


@pytest.fixture(scope="session")
def class_hub():  # -> Iterator[test_hub.Hub]
    """One class hub (accounts, the instructor's course, JupyterHub and its proxy) for the
    session: tests/test_hub.py and the hub browser test each get a fresh class on it through
    test_hub's module-scoped `hub` fixture, instead of starting and stopping a hub each."""
    from test_hub import running_class_hub
    with running_class_hub() as hub:
        yield hub


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``--dist loadfile`` (``make test``), one file's tests go to one worker, so a
    file's module fixtures are built once. Each chapter run (tests/test_course_notebooks.py's
    ``test_runs_top_to_bottom``, a fresh kernel each, minutes where a chapter compiles the
    fast path) is a unit of its own instead, so the two workers share the chapters rather
    than one worker running all of them after the other has finished."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling
    # Keep the collection's order (longest first: pytest_collection_modifyitems); xdist's own,
    # most tests first, put every one-test chapter run last.
    config.option.loadscopereorder = False

    class ChaptersApart(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if "::test_runs_top_to_bottom[" in nodeid or "::test_runs_without_a_compiler[" in nodeid:
                return nodeid
            return super()._split_scope(nodeid)
    return ChaptersApart(config, log)


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The fast path traced only (its one knob, ``tinyserve.backends.fast.CPU_RECIPE``: the
    loops' plumbing in seconds, no code generation), its eager passes on packed weights
    whatever measures faster (so every test runs the packed linears against eager), its
    decode steps the traced ones (a timed choice would differ from run to run; the steps on
    packed weights have tests of their own), its persistent cache in a temporary folder;
    that folder. The real recipe has tests of its own (tests/test_fast_path.py)."""
    from tinyserve.backends import fast
    monkeypatch.setattr(fast, "CPU_RECIPE",
                        fast.Recipe((), False, "eager", "packed", "compiled"))
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return tmp_path

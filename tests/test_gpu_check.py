"""``make gpu-check`` (bench/gpu_check.py): its no-GPU message, and its report, produced on the
CPU with ``--device cpu`` over a small selection of its steps (seconds, not minutes)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_check import Step, main


def test_without_cuda_it_exits_at_once_and_says_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["--results", str(tmp_path)]) == gpu_check.NO_CUDA_EXIT
    err = capsys.readouterr().err
    assert "no CUDA device here" in err and "--device cpu" in err
    assert not list(tmp_path.iterdir())   # nothing ran, no report


def test_a_real_step_on_cpu_writes_the_report_and_copies_it_to_out(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    results = tmp_path / "results"
    assert main(["--device", "cpu", "--only", "bench-quick:paged", "--results", str(results)]) == 0
    [path] = list(results.glob("*.json"))
    data = json.loads(path.read_text())
    assert {"device", "device_name", "torch", "cuda", "python", "date", "git_commit",
            "commit_source", "budget_s", "total_s", "counts", "ratios", "smoke",
            "steps"} <= set(data)
    assert data["device"] == "cpu" and path.name.startswith(data["date"][:10])
    [step] = data["steps"]
    assert step["name"] == "bench-quick:paged" and step["status"] == "ok", step
    assert step["seconds"] > 0 and "failure" not in step
    # a quick suite's figures travel into the report as a smoke test, never as ratios
    assert set(data["smoke"]["bench-quick:paged"]) == {"paged_waste_fraction",
                                                        "contiguous_waste_fraction"}
    assert data["ratios"] == {} and "ratios" not in step
    assert data["counts"] == {"ok": 1, "failed": 0, "timeout": 0, "cut": 0}
    assert json.loads((out / path.name).read_text()) == data


def test_the_plan_covers_tests_notebooks_every_suite_and_the_compiled_path(tmp_path: Path) -> None:
    import bench
    steps = gpu_check.plan("cpu", tmp_path, 300)
    names = [s.name for s in steps]
    assert {"compiled-decode", "pytest-gpu", "graph-tokens", "graph-decode"} <= set(names)
    assert {f"bench-quick:{s}" for s in bench.SUITES} <= set(names)
    chapters = sorted(p.stem for p in (Path(gpu_check.REPO) / "course").glob("*.ipynb"))
    assert [n.split(":", 1)[1] for n in names if n.startswith("notebook:")] == chapters
    # the gpu-marked tests are found by their marker, not listed by hand
    assert "tests/test_model.py" in gpu_check.gpu_test_files()
    assert "tests/test_cuda_graph.py" in gpu_check.gpu_test_files()


def test_correctness_comes_first_then_the_chapters_then_the_timed_suites(tmp_path: Path) -> None:
    """What the budget cuts is the tail: the timed figures and the quick suites, never the
    import check, the gpu-marked tests or graph decode against eager."""
    steps = gpu_check.plan("cpu", tmp_path, 300)
    assert [s.name for s in steps[:3]] == ["imports", "pytest-gpu", "graph-tokens"]
    assert all(s.alone and not s.timed for s in steps[:3])
    kinds = ["check" if i < 3 else "chapter" if s.name.startswith("notebook:") else
             "timed" if s.timed else "smoke" if s.smoke else "other" for i, s in enumerate(steps)]
    order = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert order == ["check", "chapter", "timed", "smoke"], order
    assert all(s.alone for s in steps if s.timed)          # a timed step has the machine alone
    assert [s.name for s in steps if s.smoke] == [s.name for s in steps
                                                 if s.name.startswith("bench-quick:")]
    phases = gpu_check._phases(steps)
    assert all(len(p) == 1 for p in phases if p[0].alone)
    assert [len(p) > 1 for p in phases if not p[0].alone] == [True, True]   # chapters, smoke


def test_the_default_budget_fits_one_six_minute_device_call() -> None:
    """The wheels' install and the start-up take ~30 s; what the budget leaves must cover
    them and a step's kill, or the device call's own limit cuts the report."""
    assert gpu_check.DEVICE_CALL_S == 360
    assert gpu_check.DEFAULT_BUDGET_S + 60 <= gpu_check.DEVICE_CALL_S
    import inspect   # the default lives in that one constant
    assert "default=DEFAULT_BUDGET_S" in inspect.getsource(gpu_check.main)


def test_graph_decode_against_eager_gives_the_same_tokens_here(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The ``graph-tokens`` step's body on the CPU: the static-buffer code, eagerly (on CUDA
    the same calls capture and replay graphs)."""
    out = tmp_path / "graph-tokens.json"
    assert gpu_check.graph_tokens(out, tokens=8) == 0, capsys.readouterr()
    rows = json.loads(out.read_text())["measurements"]
    for name in ("generate", "generate_batch", "engine", "speculative"):
        assert rows[name]["tokens_equal"] is True, rows
    assert rows["captured"] is False and rows["capture_s"] is None


def test_the_report_is_written_after_every_phase_and_names_what_was_skipped(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A run killed from outside (the device call's limit) still leaves a report: the steps
    done, the rest ``pending``; a finished run lists what the budget cut under ``skipped``.
    The second step copies the report as it stands when that step runs."""
    py = sys.executable
    results = tmp_path / "results"
    copy = ("import glob, shutil; "
            f"shutil.copy(glob.glob({str(results)!r} + '/*.json')[0], {str(tmp_path)!r} + '/seen.json')")
    steps = [Step("first", [py, "-c", "print('one')"], 30, alone=True),
             Step("second", [py, "-c", copy], 30, alone=True),
             Step("third", [py, "-c", "import time; time.sleep(60)"], 100, alone=True)]
    monkeypatch.setattr(gpu_check, "plan", lambda device, tmp, budget: steps)
    data, path = gpu_check.run_all("cpu", 12, None, results)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["finished"] is False
    assert [r["status"] for r in seen["steps"]] == ["ok", "pending", "pending"]
    assert seen["skipped"] == ["second", "third"]
    assert data["finished"] is True
    assert [r["status"] for r in data["steps"]] == ["ok", "ok", "cut"]
    assert data["skipped"] == ["third"]
    assert json.loads(path.read_text()) == data


def test_every_notebook_import_of_the_package_resolves() -> None:
    """The check's first step, run here too: a module moved since a notebook was written
    fails in CI, not minutes into a chapter on a borrowed GPU."""
    assert len(gpu_check.notebook_paths()) >= 20
    assert gpu_check.check_imports() == []


def test_the_import_check_names_each_broken_import(tmp_path: Path) -> None:
    cells = [{"cell_type": "markdown", "source": "from tinyserve.nowhere import x"},
             {"cell_type": "code", "source": ["%%time\n", "import tinyserve.generate\n",
                                              "from tinyserve.generate import clock, gone\n"]},
             {"cell_type": "code", "source": "!pip list\nfrom tinyserve.moved import thing\n"
                                             "from bench import gpu_check\nimport numpy\n"},
             {"cell_type": "code", "source": "def f(:\n    from tinyserve import nope"},
             {"cell_type": "code", "source": "if False:\n    from tinyserve.workbook import nope2"}]
    nb = tmp_path / "nb.ipynb"
    nb.write_text(json.dumps({"cells": cells}))
    problems = gpu_check.check_imports([nb])
    assert len(problems) == 3, problems
    assert ("cell 1: from tinyserve.generate import gone: tinyserve.generate has no 'gone'"
            in problems[0])
    assert "cell 2: from tinyserve.moved import thing: no module tinyserve.moved" in problems[1]
    assert "cell 4: from tinyserve.workbook import nope2" in problems[2]


def test_the_commit_is_the_hosts_when_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPU_CHECK_COMMIT", raising=False)
    assert gpu_check.host_commit("abc123") == ("abc123", "host")
    monkeypatch.setenv("GPU_CHECK_COMMIT", "def456")
    assert gpu_check.host_commit() == ("def456", "host")
    monkeypatch.delenv("GPU_CHECK_COMMIT")
    assert gpu_check.host_commit()[1] == "local checkout"


def test_a_failing_or_hanging_step_is_recorded_and_the_rest_still_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    py = sys.executable
    steps = [Step("fails", [py, "-c", "import sys; print('boom ' * 2000); sys.exit(4)"], 30),
             Step("hangs", [py, "-c", "import time; time.sleep(60)"], 1),
             Step("passes", [py, "-c", "print('fine')"], 30, alone=True)]
    monkeypatch.setattr(gpu_check, "plan", lambda device, tmp, budget: steps)
    data, _ = gpu_check.run_all("cpu", 100, None, tmp_path, jobs=2, commit="c0ffee")
    assert [s["name"] for s in data["steps"]] == ["fails", "hangs", "passes"]  # plan order
    assert (data["git_commit"], data["commit_source"]) == ("c0ffee", "host")
    by_name = {s["name"]: s for s in data["steps"]}
    assert by_name["fails"]["status"] == "failed"
    assert by_name["fails"]["failure"].startswith("exit code 4") and "boom" in by_name["fails"]["failure"]
    assert len(by_name["fails"]["failure"]) <= gpu_check.FAILURE_CHARS + 50   # capped
    assert by_name["hangs"]["status"] == "timeout" and by_name["hangs"]["seconds"] < 30
    assert by_name["passes"]["status"] == "ok"


def test_steps_the_budget_stops_or_never_starts_are_cut_not_failures(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    py = sys.executable
    steps = [Step("long", [py, "-c", "import time; time.sleep(60)"], 100, alone=True),
             Step("never", [py, "-c", "raise SystemExit(1)"], 30)]
    monkeypatch.setattr(gpu_check, "plan", lambda device, tmp, budget: steps)
    data, _ = gpu_check.run_all("cpu", 12, None, tmp_path)
    long, never = data["steps"]
    assert long["status"] == "cut" and "budget" in long["note"] and "failure" not in long
    assert never["status"] == "cut" and "not started" in never["note"]
    assert data["counts"] == {"ok": 0, "failed": 0, "timeout": 0, "cut": 2}
    monkeypatch.setattr(gpu_check, "run_all", lambda *a, **k: (data, tmp_path / "r.json"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert main(["--results", str(tmp_path)]) == 0       # a cut run still passes

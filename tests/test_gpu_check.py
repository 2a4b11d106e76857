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
            "budget_s", "total_s", "counts", "ratios", "steps"} <= set(data)
    assert data["device"] == "cpu" and path.name.startswith(data["date"][:10])
    [step] = data["steps"]
    assert step["name"] == "bench-quick:paged" and step["status"] == "ok", step
    assert step["seconds"] > 0 and "failure" not in step
    # the suite's own ratios travel into the report
    assert set(data["ratios"]["bench-quick:paged"]) == {"paged_waste_fraction",
                                                         "contiguous_waste_fraction"}
    assert data["counts"] == {"ok": 1, "failed": 0, "timeout": 0, "skipped": 0}
    assert json.loads((out / path.name).read_text()) == data


def test_the_plan_covers_tests_notebooks_every_suite_and_the_compiled_path(tmp_path: Path) -> None:
    import bench
    names = [s.name for s in gpu_check.plan("cpu", tmp_path, 450)]
    assert names[0] == "pytest-gpu" and "compiled-decode" in names
    assert {f"bench-quick:{s}" for s in bench.SUITES} <= set(names)
    chapters = sorted(p.stem for p in (Path(gpu_check.REPO) / "course").glob("*.ipynb"))
    assert [n.split(":", 1)[1] for n in names if n.startswith("notebook:")] == chapters
    # the gpu-marked tests are found by their marker, not listed by hand
    assert "tests/test_model.py" in gpu_check.gpu_test_files()


def test_a_failing_or_hanging_step_is_recorded_and_the_rest_still_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    py = sys.executable
    steps = [Step("fails", [py, "-c", "import sys; print('boom ' * 2000); sys.exit(4)"], 30),
             Step("hangs", [py, "-c", "import time; time.sleep(60)"], 1),
             Step("passes", [py, "-c", "print('fine')"], 30, alone=True)]
    monkeypatch.setattr(gpu_check, "plan", lambda device, tmp, budget: steps)
    data, _ = gpu_check.run_all("cpu", 100, None, tmp_path, jobs=2)
    assert [s["name"] for s in data["steps"]] == ["fails", "hangs", "passes"]  # plan order
    by_name = {s["name"]: s for s in data["steps"]}
    assert by_name["fails"]["status"] == "failed"
    assert by_name["fails"]["failure"].startswith("exit code 4") and "boom" in by_name["fails"]["failure"]
    assert len(by_name["fails"]["failure"]) <= gpu_check.FAILURE_CHARS + 50   # capped
    assert by_name["hangs"]["status"] == "timeout" and by_name["hangs"]["seconds"] < 30
    assert by_name["passes"]["status"] == "ok"


def test_steps_past_the_budget_are_skipped_with_a_note(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    steps = [Step("never", [sys.executable, "-c", "raise SystemExit(1)"], 30)]
    monkeypatch.setattr(gpu_check, "plan", lambda device, tmp, budget: steps)
    data, _ = gpu_check.run_all("cpu", 5, None, tmp_path)
    [step] = data["steps"]
    assert step["status"] == "skipped" and "out of time" in step["failure"]
    assert data["counts"]["skipped"] == 1

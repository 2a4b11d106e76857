"""One command for a borrowed GPU machine: ``make gpu-check`` (or ``python -m bench.gpu_check``).

It runs, on ``cuda``, every check that a CPU machine cannot: the gpu-marked tests, every
chapter notebook (bf16, as a learner with a GPU would run it), a quick version of every
bench suite, the compiled decode path, then full versions of the decode suites while the
time budget lasts. It writes ONE JSON report, ``bench/results/gpu/<date>-<device>.json``
(device, torch and CUDA versions, each step's status, seconds and capped failure text, the
ratios the suites produced), and copies it to ``$OUT`` when that variable is set.

Designed for a bare, offline machine used once: each step runs in its own process group
with a timeout (a hang or a poisoned CUDA context costs one step, never the run), one
failing step never stops the others, and a global budget (8 minutes by default) skips
what is left with a note. Without CUDA it exits at once with a clear message, unless
``--device cpu`` asks for the same steps on the CPU (that is how the tests check it).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import fnmatch
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "gpu"
FAILURE_CHARS = 2000          # failure text kept per step: the tail, where the error is
NO_CUDA_EXIT = 3              # distinct from 1 (a step failed) and 2 (bad arguments)
#: Full-size suites run after everything else, in this order, while the budget lasts.
FULL_SUITES = ("hf", "kv", "quant", "batching")


@dataclass
class Step:
    """A command to run in its own process, with a cap on its seconds."""
    name: str
    argv: list[str]
    cap_s: float
    json_out: Path | None = None      # a bench report the step writes, read for its ratios
    env: dict[str, str] = field(default_factory=dict)
    alone: bool = False               # timed for its figures: runs with nothing beside it


def child_env(device: str, tmp: Path) -> dict[str, str]:
    """The environment every step inherits: this interpreter's path made absolute (a
    notebook kernel runs in ``course/``, where a relative ``PYTHONPATH=.`` would miss the
    repository), the device, a headless matplotlib and Jupyter folders in ``tmp``."""
    env = dict(os.environ)
    paths = [str(REPO)] + [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["TINYSERVE_DEVICE"] = device
    env["MPLBACKEND"] = "Agg"
    env["PYTHONUNBUFFERED"] = "1"
    env["JUPYTER_PATH"] = str(tmp / "jupyter")
    env["JUPYTER_RUNTIME_DIR"] = str(tmp / "jupyter" / "runtime")
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env["IPYTHONDIR"] = str(tmp / "ipython")
    env["MPLCONFIGDIR"] = str(tmp / "mpl")
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")   # a shared CPU: one thread per process
    return env


def write_kernel_spec(tmp: Path) -> None:
    """A ``python3`` kernel spec that starts *this* interpreter: on a machine where ipykernel
    came as a wheel into a ``--target`` folder, no kernel spec was installed with it."""
    spec = tmp / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))


def gpu_test_files() -> list[str]:
    """Test files holding a gpu-marked test (collecting all of tests/ would import the
    grading and browser stacks, which a bare GPU machine does not have)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text())


def plan(device: str, tmp: Path, budget_s: float) -> list[Step]:
    """Every step, most important first: what the budget cuts is the tail. The quick suites
    and the chapters first (do they run on this device at all?), then the compiled decode
    path on the real model, then full-size suites for ratios."""
    import bench
    py = sys.executable
    steps = [Step("pytest-gpu", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs",
                                 *gpu_test_files()], 150)]
    for suite in bench.SUITES:
        out = tmp / f"quick-{suite}.json"
        steps.append(Step(f"bench-quick:{suite}", [py, "-m", "tinyserve", "bench", suite,
                                                   "--quick", "--json", str(out)], 90, out))
    for nb in sorted((REPO / "course").glob("*.ipynb")):
        steps.append(Step(f"notebook:{nb.stem}", [py, "-m", "bench.gpu_check", "--notebook",
                                                  str(nb), "--cell-timeout", "120"], 180))
    # The compiled path on the real model: eager and compiled tokens, step times, roofline.
    steps.append(Step("compiled-decode", [py, "-m", "tinyserve", "bench", "decode",
                                          "--json", str(tmp / "compiled.json")],
                      240, json_out=tmp / "compiled.json", alone=True))
    for suite in FULL_SUITES:
        if suite in bench.SUITES:
            out = tmp / f"full-{suite}.json"
            steps.append(Step(f"bench:{suite}", [py, "-m", "tinyserve", "bench", suite,
                                                 "--json", str(out)], 150, out, alone=True))
    return steps


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_step(step: Step, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run one step in a new process group; on timeout the whole group (a notebook's kernel
    too) is killed. Returns its record for the report."""
    start = time.perf_counter()
    proc = subprocess.Popen(step.argv, cwd=REPO, env={**env, **step.env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        status = "timeout"
    finally:
        _kill_group(proc)   # anything the step left behind (a kernel, a server)
    record: dict[str, Any] = {"name": step.name, "status": status,
                              "seconds": round(time.perf_counter() - start, 2)}
    if status != "ok":
        note = f"exit code {proc.returncode}" if status == "failed" else f"killed after {timeout_s:.0f} s"
        record["failure"] = f"{note}\n{(output or '')[-FAILURE_CHARS:]}"
    if step.json_out is not None and step.json_out.exists():
        try:
            data = json.loads(step.json_out.read_text())
            record["ratios"] = data.get("ratios", {})
            record["quick"] = data.get("quick")
            if "measurements" in data and step.name == "compiled-decode":
                record["measurements"] = data["measurements"]
        except (OSError, ValueError) as err:
            record["report_error"] = str(err)[:200]
    print(f"[{record['seconds']:7.1f} s] {step.name}: {status}", flush=True)
    return record


def device_info(device: str) -> dict[str, Any]:
    import torch
    info: dict[str, Any] = {"device": device, "torch": torch.__version__,
                            "cuda": torch.version.cuda, "python": platform.python_version(),
                            "platform": platform.platform(), "cpu_count": os.cpu_count()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count)
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "device"


def run_all(device: str, budget_s: float, only: list[str] | None, results: Path,
            jobs: int = 1) -> tuple[dict[str, Any], Path]:
    """Run the plan within the budget; write and return the report.

    Steps that only check something runs (tests, quick suites, chapters) run ``jobs`` at a
    time; steps timed for their figures (``alone``) run afterwards, one by one."""
    from tinyserve.provenance import git_commit
    started = time.perf_counter()
    info = device_info(device)

    def attempt(step: Step, env: dict[str, str]) -> dict[str, Any]:
        left = budget_s - (time.perf_counter() - started)
        if left < 10:
            return {"name": step.name, "status": "skipped", "seconds": 0.0,
                    "failure": f"out of time: the {budget_s:.0f} s budget was spent"}
        return run_step(step, env, min(step.cap_s, left))

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as name:
        tmp = Path(name)
        write_kernel_spec(tmp)
        env = child_env(device, tmp)
        steps = [s for s in plan(device, tmp, budget_s)
                 if not only or any(fnmatch.fnmatch(s.name, pat) for pat in only)]
        shared_env = dict(env)
        if jobs > 1 and "OMP_NUM_THREADS" not in os.environ:   # side by side: share the cores
            shared_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            side_by_side = {s.name: pool.submit(attempt, s, shared_env)
                            for s in steps if not s.alone}
            done = {name: f.result() for name, f in side_by_side.items()}
        for s in steps:
            if s.alone:
                done[s.name] = attempt(s, env)
        records = [done[s.name] for s in steps]
    counts = {s: sum(r["status"] == s for r in records) for s in ("ok", "failed", "timeout", "skipped")}
    now = _dt.datetime.now(_dt.timezone.utc)
    data = {"kind": "gpu-check", "date": now.isoformat(timespec="seconds"), **info,
            "git_commit": git_commit(), "budget_s": budget_s,
            "total_s": round(time.perf_counter() - started, 2), "counts": counts,
            "ratios": {r["name"]: r["ratios"] for r in records if r.get("ratios")},
            "steps": records}
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{now:%Y-%m-%d}-{_slug(info['device_name'])}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    out = os.environ.get("OUT")
    if out and Path(out).is_dir():
        shutil.copy(path, Path(out) / path.name)
    return data, path


def run_notebook(path: Path, cell_timeout: int) -> int:
    """Execute one notebook top to bottom in a fresh ``python3`` kernel (a step's body)."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()   # raises CellExecutionError with the cell and traceback
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu runs the same steps on the CPU (to test this script)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="seconds for all steps; what is left when it is spent is skipped")
    p.add_argument("--only", help="comma-separated step names or patterns (bench-quick:*)")
    p.add_argument("--jobs", type=int, default=None,
                   help="steps side by side before the timed ones (default: 4 on cuda, 1 on cpu)")
    p.add_argument("--results", default=str(RESULTS), help="folder for the JSON report")
    p.add_argument("--notebook", help=argparse.SUPPRESS)   # internal: one notebook step
    p.add_argument("--cell-timeout", type=int, default=120, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.notebook:
        return run_notebook(Path(args.notebook), args.cell_timeout)
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive, got {args.budget_s}")
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); this check "
              "is for a GPU machine. Run it there, or pass --device cpu to run the same steps "
              "on the CPU.", file=sys.stderr)
        return NO_CUDA_EXIT
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    jobs = args.jobs if args.jobs is not None else (4 if args.device == "cuda" else 1)
    if jobs < 1:
        p.error(f"--jobs must be at least 1, got {jobs}")
    data, path = run_all(args.device, args.budget_s, only, Path(args.results), jobs)
    print(f"gpu-check on {data['device_name']}: {data['counts']} in {data['total_s']:.0f} s; "
          f"wrote {path}")
    return 0 if data["counts"]["failed"] == data["counts"]["timeout"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""One command for a borrowed GPU machine: ``make gpu-check`` (or ``python -m bench.gpu_check``).

It proves the course correct on ``cuda`` first and measures it with what time is left, so
that what the budget cuts is the tail, never a check:

1. ``imports``: a static check that every ``tinyserve`` / ``bench`` import of every notebook
   resolves (a module moved since the notebook was written fails here, in a second, not
   minutes into a chapter); CI runs the same check (tests/test_gpu_check.py);
2. ``pytest-gpu``: the gpu-marked tests (graphs replayed against eager, the CUDA kernels);
3. ``graph-tokens``: graph decode against eager on the shipped model in fp32 (``generate``,
   ``generate_batch``, the engine, speculative decoding: each path's greedy tokens with
   graphs and without must be equal), with the capture time (``python -m bench.gpu_check --graph-tokens``);
4. every chapter notebook, side by side, as a learner with a GPU runs it (default device);
5. the timed figures, one step at a time with nothing beside them: eager vs CUDA-graph
   decode (``python -m tinyserve.graph_check``: the shipped model and the GPU preset, with
   MBU), ``bench scale`` at the GPU preset, the compiled decode path, the full bench suites;
6. with what time is left, a quick version of every bench suite (does it run here?). Quick
   suites run a random 2-layer model of hidden size 32: their figures mean nothing, so the
   report keeps them under ``smoke``, never under ``ratios``.

It writes ONE JSON report, ``bench/results/gpu/<date>-<device>.json`` (device, torch and
CUDA versions, each step's status, seconds and capped failure text, the full suites'
``ratios`` and the quick suites' ``smoke``, and ``skipped``: the steps the budget cut or
never started), and copies it to ``$OUT`` when that variable is set. The report is
rewritten after every phase (``finished`` false until the end), so a run killed from
outside still leaves one. The commit it records is the host's: a device machine runs a copy
of the working tree without its git history, so pass ``--commit`` (or ``GPU_CHECK_COMMIT``)
from the host; without it the local checkout's is recorded and ``commit_source`` says so.

Designed for a bare, offline machine used once: each step runs in its own process group
with a timeout (a hang or a poisoned CUDA context costs one step, never the run), one
failing step never stops the others, and a global budget stops what is left: a step
stopped or never started for lack of time is ``cut``, not a failure. The default budget
(``DEFAULT_BUDGET_S``) fits one 6-minute device call with the wheels' install and the start-up
(README: "On a GPU"). Without CUDA it exits at once with a clear message, unless
``--device cpu`` asks for the same steps on the CPU (that is how the tests check it).
"""
from __future__ import annotations

import argparse
import ast
import datetime as _dt
import importlib
import importlib.util
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "gpu"
FAILURE_CHARS = 2000          # failure text kept per step: the tail, where the error is
NO_CUDA_EXIT = 3              # distinct from 1 (a step failed) and 2 (bad arguments)
#: Full-size suites, timed alone right after the import check, in this order.
FULL_SUITES = ("hf", "kv", "quant", "batching")
#: Seconds for every step: with the wheels' install (~30 s) and Python's and CUDA's start-up,
#: one device call of 6 minutes (360 s) holds it (tests/test_gpu_check.py keeps it so).
DEFAULT_BUDGET_S = 280.0
DEVICE_CALL_S = 360.0
#: The packages whose imports the static check resolves.
CHECKED_PACKAGES = ("tinyserve", "bench")


@dataclass
class Step:
    """A command to run in its own process, with a cap on its seconds."""
    name: str
    argv: list[str]
    cap_s: float
    json_out: Path | None = None      # a bench report the step writes, read for its ratios
    env: dict[str, str] = field(default_factory=dict)
    alone: bool = False               # runs with nothing beside it (timed, or needs the device)
    smoke: bool = False               # a quick suite: its figures are a smoke test only
    timed: bool = False               # measures: comes after every check


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
    """Every step, correctness first: the import check (seconds), the gpu-marked tests,
    graph decode against eager (tokens and capture time), the chapters side by side; then
    the full-size figures (alone: they are timed); then the quick suites. What the budget
    cuts is the tail."""
    import bench
    py = sys.executable
    steps = [Step("imports", [py, "-m", "bench.gpu_check", "--check-imports"], 60, alone=True)]
    steps.append(Step("pytest-gpu", [py, "-m", "pytest", "-m", "gpu", "-q", "-p",
                                     "no:cacheprovider", "-rs", *gpu_test_files()], 150,
                      alone=True))
    # The same greedy tokens with and without graphs (fp32), and what a capture costs.
    steps.append(Step("graph-tokens", [py, "-m", "bench.gpu_check", "--graph-tokens",
                                       str(tmp / "graph-tokens.json")], 120,
                      json_out=tmp / "graph-tokens.json", alone=True))
    for nb in sorted((REPO / "course").glob("*.ipynb")):
        steps.append(Step(f"notebook:{nb.stem}", [py, "-m", "bench.gpu_check", "--notebook",
                                                  str(nb), "--cell-timeout", "120"], 180))
    # The timed figures. Eager vs CUDA-graph decode for the shipped model and the GPU
    # preset, with MBU.
    steps.append(Step("graph-decode", [py, "-m", "tinyserve.graph_check", "--json",
                                       str(tmp / "graph.json")], 120,
                      json_out=tmp / "graph.json", alone=True, timed=True))
    # The memory wall at the GPU preset (~1.4B parameters, bf16): MBU, rows, verify, spec
    # (issue 30); CUDA-graph compiles per bucket, so it gets the longest cap.
    steps.append(Step("bench:scale", [py, "-m", "tinyserve", "bench", "scale", "--json",
                                      str(tmp / "full-scale.json")], 240,
                      tmp / "full-scale.json", alone=True, timed=True))
    # The compiled path on the real model: eager and compiled tokens, step times, roofline.
    steps.append(Step("compiled-decode", [py, "-m", "tinyserve", "bench", "decode",
                                          "--json", str(tmp / "compiled.json")],
                      240, json_out=tmp / "compiled.json", alone=True, timed=True))
    for suite in FULL_SUITES:
        if suite in bench.SUITES:
            out = tmp / f"full-{suite}.json"
            steps.append(Step(f"bench:{suite}", [py, "-m", "tinyserve", "bench", suite,
                                                 "--json", str(out)], 150, out, alone=True,
                              timed=True))
    for suite in bench.SUITES:
        out = tmp / f"quick-{suite}.json"
        steps.append(Step(f"bench-quick:{suite}", [py, "-m", "tinyserve", "bench", suite,
                                                   "--quick", "--json", str(out)], 90, out,
                          smoke=True))
    return steps


# ---------------------------------------------------------------- graph decode against eager

GRAPH_TOKENS = 24


def graph_tokens(out: Path | None = None, tokens: int = GRAPH_TOKENS) -> int:
    """Graph decode against eager on the default device (a step's body): the shipped target
    in fp32 (no near-ties between kernels of different reduction orders), three prompts of
    different lengths, greedy. ``generate``, ``generate_batch``, the paged engine (pure
    decode steps on static buffers) and speculative decoding (draft and verify passes on
    static buffers) must each give the tokens the same path gives without graphs; the
    capture time of the batch decoder's graph is recorded. Exit 1 on any difference."""
    import torch
    from tinyserve import load_model, load_tokenizer
    from tinyserve.corpus import example_prompts
    from tinyserve.backends.cuda_graph import graph_decoder
    from tinyserve.engine import EngineConfig, generate_many
    from tinyserve.generate import generate, generate_batch
    from tinyserve.speculative import ModelDrafter, speculative_generate

    target = load_model("target", dtype=torch.float32)
    draft = load_model("draft", dtype=torch.float32)
    tok = load_tokenizer()
    prompts = [tok.encode(p) for p in example_prompts(3)]
    rows: dict[str, Any] = {"device": str(target.device), "tokens": tokens}

    def engine(graph: bool) -> list[list[int]]:
        return generate_many(target, prompts, tokens, EngineConfig(
            num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
            path="graph" if graph else "eager"))

    def spec(graph: bool) -> list[list[int]]:
        return [speculative_generate(target, ModelDrafter(draft, path="graph" if graph else "eager"), p,
                                     tokens, k=4, path="graph" if graph else "eager")[0] for p in prompts]

    # Each path with graphs against the same path without: the same shapes but for the
    # static buffers, so a difference is the graph's (or the static buffers'), not batching's.
    pairs: dict[str, Callable[[bool], list[list[int]]]] = {
        "generate": lambda g: [generate(target, p, tokens, path="graph" if g else "eager").tokens for p in prompts],
        "generate_batch": lambda g: generate_batch(target, prompts, tokens, path="graph" if g else "eager"),
        "engine": engine,
        "speculative": spec,
    }
    problems = []
    for name, run in pairs.items():
        want = run(False)
        start = time.perf_counter()
        got = run(True)
        seconds = time.perf_counter() - start
        first = next((i for row_got, row_want in zip(got, want)
                      for i, (a, b) in enumerate(zip(row_got, row_want)) if a != b), None)
        same = got == want
        rows[name] = {"tokens_equal": same, "graph_seconds": round(seconds, 3)}
        print(f"{name}: {'the same tokens' if same else 'DIFFERENT tokens'} with graphs as "
              f"without ({seconds:.2f} s with graphs, captures included)", flush=True)
        if not same:
            problems.append(f"{name}: first difference at output token {first}: "
                            f"{got} with graphs, {want} without")
    decoder = graph_decoder(target, len(prompts), tokens=max(map(len, prompts)) + tokens)
    decoder.release()
    rows["captured"] = decoder.graph is not None
    rows["capture_s"] = decoder.capture_seconds
    print(f"capture of the batch decoder's graph: {decoder.capture_seconds:.3f} s"
          if decoder.graph is not None and decoder.capture_seconds is not None else
          "no capture here (not CUDA): the same static-buffer code, eagerly", flush=True)
    if out is not None:
        out.write_text(json.dumps({"suite": "graph-tokens", "measurements": rows,
                                   "ratios": {}}, indent=2))
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


# ---------------------------------------------------------------- the static import check

def notebook_paths() -> list[Path]:
    """Every notebook a learner or the check runs: the chapters, the exercises, the start."""
    found = [*(REPO / "course").glob("*.ipynb"), *(REPO / "exercises").glob("*/*.ipynb"),
             *REPO.glob("*.ipynb")]
    return sorted(p for p in found if ".ipynb_checkpoints" not in p.parts)


def _cell_source(cell: dict[str, Any]) -> str:
    """A code cell's Python, IPython's magics and shell lines blanked (line numbers kept)."""
    text = cell.get("source", "")
    lines = (text if isinstance(text, str) else "".join(text)).splitlines()
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)


def notebook_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """``(cell, module, name)`` for every import of a checked package in a notebook's code
    cells (``name`` None for ``import module``), found by parsing, never by running."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str, str | None]] = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        try:
            tree = ast.parse(_cell_source(cell))
        except SyntaxError:
            continue        # a cell the learner fills in: nothing to resolve until then
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(i, a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found += [(i, node.module, a.name) for a in node.names if a.name != "*"]
    return [f for f in found if f[1].split(".")[0] in CHECKED_PACKAGES]


def _resolve(module: str, name: str | None) -> str | None:
    """None if ``from module import name`` (or ``import module``) works, else why not."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing.split(".")[0] in CHECKED_PACKAGES:
            return f"no module {missing}"
        return f"{module} needs the package {missing!r}, not installed here"
    except Exception as err:   # noqa: BLE001 - the module's own import failed: say how
        return f"importing {module} raised {type(err).__name__}: {str(err)[:200]}"
    if name is None or hasattr(mod, name):
        return None
    if hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None:
        # a submodule of a package
        return _resolve(f"{module}.{name}", None)
    return f"{module} has no {name!r}"


def check_imports(paths: list[Path] | None = None) -> list[str]:
    """One line per unresolved import: ``notebook, cell N: from X import Y: why``."""
    problems = []
    for path in notebook_paths() if paths is None else paths:
        for cell, module, name in notebook_imports(path):
            why = _resolve(module, name)
            if why is not None:
                what = f"from {module} import {name}" if name else f"import {module}"
                where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                problems.append(f"{where}, cell {cell}: {what}: {why}")
    return problems


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_step(step: Step, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run one step in a new process group; on timeout the whole group (a notebook's kernel
    too) is killed. Returns its record for the report: ``timeout`` when the step ran past
    its own cap (a failure), ``cut`` when what was left of the budget stopped it first."""
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
        status = "timeout" if timeout_s >= step.cap_s else "cut"
    finally:
        _kill_group(proc)   # anything the step left behind (a kernel, a server)
    record: dict[str, Any] = {"name": step.name, "status": status,
                              "seconds": round(time.perf_counter() - start, 2)}
    if status != "ok":
        note = (f"exit code {proc.returncode}" if status == "failed" else
                f"killed after {timeout_s:.0f} s, its cap" if status == "timeout" else
                f"cut after {timeout_s:.0f} s: the budget's end (its cap is {step.cap_s:.0f} s)")
        record["failure" if status != "cut" else "note"] = \
            f"{note}\n{(output or '')[-FAILURE_CHARS:]}"
    if step.json_out is not None and step.json_out.exists():
        try:
            data = json.loads(step.json_out.read_text())
            # A quick suite's figures are a smoke test: never published as ratios.
            record["smoke" if step.smoke or data.get("quick") else "ratios"] = \
                data.get("ratios", {})
            record["quick"] = data.get("quick")
            if "measurements" in data and step.name in ("compiled-decode", "graph-decode",
                                                        "graph-tokens"):
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


def host_commit(given: str | None = None) -> tuple[str | None, str]:
    """The commit to record and where it came from: ``given`` (``--commit``), else
    ``GPU_CHECK_COMMIT``, both set on the host that sent the tree (``"host"``); else this
    checkout's HEAD (``"local checkout"``: on a device machine's copy of the tree, git's
    answer is not the host's commit, or there is none)."""
    from tinyserve.provenance import git_commit
    commit = given or os.environ.get("GPU_CHECK_COMMIT", "").strip()
    if commit:
        return commit, "host"
    return git_commit(), "local checkout"


def _phases(steps: list[Step]) -> list[list[Step]]:
    """Plan order, grouped: each ``alone`` step on its own, each run of the other steps
    together (the chapters, then the smoke suites: those never take a worker from a
    chapter)."""
    phases: list[list[Step]] = []
    for s in steps:
        if s.alone or not phases or phases[-1][0].alone or phases[-1][0].smoke != s.smoke:
            phases.append([s])
        else:
            phases[-1].append(s)
    return phases


def run_all(device: str, budget_s: float, only: list[str] | None, results: Path,
            jobs: int = 1, commit: str | None = None) -> tuple[dict[str, Any], Path]:
    """Run the plan within the budget, in plan order; write and return the report.

    Steps that run ``alone`` run one by one with nothing beside them; each run of steps that
    only check something runs ``jobs`` at a time. The report is written after every phase
    (``finished`` false, the steps still to come ``pending``), so a run killed from outside
    (the device call's own limit) leaves what it had done; the last write is the whole."""
    started = time.perf_counter()
    info = device_info(device)
    git, source = host_commit(commit)
    begun = _dt.datetime.now(_dt.timezone.utc)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{begun:%Y-%m-%d}-{_slug(info['device_name'])}.json"

    def attempt(step: Step, env: dict[str, str]) -> dict[str, Any]:
        left = budget_s - (time.perf_counter() - started)
        if left < 10:
            return {"name": step.name, "status": "cut", "seconds": 0.0,
                    "note": f"not started: the {budget_s:.0f} s budget was spent"}
        return run_step(step, env, min(step.cap_s, left))

    def write(steps: list[Step], done: dict[str, dict[str, Any]], finished: bool) -> dict[str, Any]:
        records = [done.get(s.name) or {"name": s.name, "status": "pending", "seconds": 0.0}
                   for s in steps]
        counts = {st: sum(r["status"] == st for r in records)
                  for st in ("ok", "failed", "timeout", "cut")}
        data = {"kind": "gpu-check", "date": begun.isoformat(timespec="seconds"), **info,
                "git_commit": git, "commit_source": source, "budget_s": budget_s,
                "finished": finished, "total_s": round(time.perf_counter() - started, 2),
                "counts": counts,
                "skipped": [r["name"] for r in records if r["status"] in ("cut", "pending")],
                "ratios": {r["name"]: r["ratios"] for r in records if r.get("ratios")},
                "smoke": {r["name"]: r["smoke"] for r in records if r.get("smoke")},
                "steps": records}
        path.write_text(json.dumps(data, indent=2) + "\n")
        out = os.environ.get("OUT")
        if out and Path(out).is_dir():
            shutil.copy(path, Path(out) / path.name)
        return data

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as name:
        tmp = Path(name)
        write_kernel_spec(tmp)
        env = child_env(device, tmp)
        steps = [s for s in plan(device, tmp, budget_s)
                 if not only or any(fnmatch.fnmatch(s.name, pat) for pat in only)]
        shared_env = dict(env)
        if jobs > 1 and "OMP_NUM_THREADS" not in os.environ:   # side by side: share the cores
            shared_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
        done: dict[str, dict[str, Any]] = {}
        write(steps, done, finished=False)
        for phase in _phases(steps):
            if phase[0].alone:
                done[phase[0].name] = attempt(phase[0], env)
            else:
                with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                    futures = {s.name: pool.submit(attempt, s, shared_env) for s in phase}
                    done.update({n: f.result() for n, f in futures.items()})
            write(steps, done, finished=False)
        return write(steps, done, finished=True), path


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
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds for all steps; what is left when it is spent is cut")
    p.add_argument("--commit", help="the commit the host sent (default: $GPU_CHECK_COMMIT, "
                                    "else this checkout's HEAD)")
    p.add_argument("--check-imports", action="store_true",
                   help="only resolve every tinyserve/bench import of every notebook")
    p.add_argument("--only", help="comma-separated step names or patterns (bench-quick:*)")
    p.add_argument("--jobs", type=int, default=None,
                   help="steps side by side before the timed ones (default: 4 on cuda, 1 on cpu)")
    p.add_argument("--results", default=str(RESULTS), help="folder for the JSON report")
    p.add_argument("--graph-tokens", nargs="?", const="", metavar="JSON",
                   help="only graph decode against eager on the default device (a step)")
    p.add_argument("--notebook", help=argparse.SUPPRESS)   # internal: one notebook step
    p.add_argument("--cell-timeout", type=int, default=120, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.notebook:
        return run_notebook(Path(args.notebook), args.cell_timeout)
    if args.graph_tokens is not None:
        return graph_tokens(Path(args.graph_tokens) if args.graph_tokens else None)
    if args.check_imports:
        problems = check_imports()
        for line in problems:
            print(line, file=sys.stderr)
        print(f"imports: {len(problems)} unresolved in {len(notebook_paths())} notebooks")
        return 1 if problems else 0
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
    data, path = run_all(args.device, args.budget_s, only, Path(args.results), jobs,
                         args.commit)
    print(f"gpu-check on {data['device_name']}: {data['counts']} in {data['total_s']:.0f} s; "
          f"wrote {path}")
    if data["skipped"]:
        print(f"skipped for lack of time ({args.budget_s:.0f} s budget): "
              f"{', '.join(data['skipped'])}")
    return 0 if data["counts"]["failed"] == data["counts"]["timeout"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

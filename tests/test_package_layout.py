"""The package reads as its map says: every module is on the module map (the package
docstring and the README's table), ``tinyserve`` never imports ``bench``, no function in it
passes 80 lines, and every assignment has its ``test_<assignment>_exercise.py``.

``python tests/test_package_layout.py [FOLDER ...]`` lists the longest functions of each folder
(default: tinyserve and autograder)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import tinyserve

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tinyserve"


def modules() -> list[str]:
    """Every module of the package as the map names it: ``engine``, ``serving/``, ``server``."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py":
            if len(rel.parts) > 1:
                names.append(f"{rel.parts[0]}/")
        else:
            names.append(rel.stem)
    return names


def test_every_module_is_on_the_package_docstring_map() -> None:
    doc = tinyserve.__doc__ or ""
    missing = [m for m in modules() if not re.search(rf"(?<![\w/]){re.escape(m)}(?![\w/])", doc)]
    assert not missing, f"tinyserve/__init__.py's module map misses {missing}: add a line for each"


def test_every_module_is_on_the_readme_layout_table() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### The `tinyserve` package", 1)[1].split("\n## ", 1)[0]
    missing = [m for m in modules() if f"`{m}`" not in section]
    assert not missing, f"the README's module table misses {missing}: add them to a row"


def bench_imports() -> list[str]:
    """``file:line`` of every import of ``bench`` in the package, outside the CLI's bench
    command (the one front door that runs the suites; no library module may need them)."""
    return [f for f in bench_importers() if f.startswith(f"{PACKAGE.name}/")]


#: The CLI's ``bench`` command: the only code in ``tinyserve`` that may import ``bench``.
CLI_BENCH_FUNCTIONS = {"_cmd_bench", "add_bench_parser"}


def test_tinyserve_never_imports_bench() -> None:
    found = bench_imports()
    assert not found, (f"tinyserve imports bench at {found}: bench depends on tinyserve, never "
                       f"the reverse; move what tinyserve needs into tinyserve")


#: Folders that are not the house's code: the suites themselves, the tests (they import what
#: they test), virtual environments, caches and build output.
NOT_BENCH_IMPORTERS = {"bench", "tests", "build", "node_modules"}


def bench_importers(root: Path = ROOT) -> list[str]:
    """``file:line`` of every import of ``bench`` (lazy ones included) or ``-m bench...``
    string in the house's Python files and notebooks outside bench/ and tests/, but the CLI's
    bench command in ``tinyserve/__main__.py``."""
    import os
    files = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d.endswith(".egg-info") or (
            here == root and d in NOT_BENCH_IMPORTERS))]
        files += [here / n for n in names if n.endswith((".py", ".ipynb"))]
    found = []
    for path in sorted(files):
        rel = path.relative_to(root)
        if path.suffix == ".ipynb":
            import json
            cells = json.loads(path.read_text()).get("cells", [])
            text = "\n".join("".join(c.get("source", [])) for c in cells
                             if c.get("cell_type") == "code")
            found += [f"{rel}: {m.group(0)!r}" for m in re.finditer(
                r"^\s*(?:from\s+bench\b|import\s+bench\b).*", text, re.M)]
            continue
        allowed: set[int] = set()
        tree = ast.parse(path.read_text())
        if rel == Path("tinyserve", "__main__.py"):
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and node.name in CLI_BENCH_FUNCTIONS:
                    allowed |= {n.lineno for n in ast.walk(node) if hasattr(n, "lineno")}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else bench_named_by(node.value)
                     if isinstance(node, ast.Constant) and isinstance(node.value, str)
                     else [])
            if any(n == "bench" or n.startswith("bench.") for n in names) \
                    and node.lineno not in allowed:
                found.append(f"{rel}:{node.lineno}")
    return found


def bench_named_by(text: str) -> list[str]:
    """The bench modules a string starts: an argv element (``"bench.suites.peers"``) or a
    command line (``"python -m bench.gpu_check"``)."""
    whole = re.fullmatch(r"bench(?:\.\w+)+", text)
    return [whole.group(0)] if whole else re.findall(r"-m\s+(bench(?:\.\w+)*)\b", text)


def test_only_the_cli_imports_bench() -> None:
    """bench sits above everything it measures: only the ``bench`` verb of
    ``tinyserve/__main__.py`` imports it (autograder, hub, the notebooks and tinyserve never)."""
    found = bench_importers()
    assert not found, (f"{found} import bench: only tinyserve/__main__.py's bench command may; "
                       f"move what they need out of bench (into tinyserve) or call the CLI")


def test_bench_importers_are_found_at_every_depth(tmp_path: Path) -> None:
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "a.py").write_text(
        "def f():\n    from bench.common import table\n"
        "CMD = ['python', '-m', 'bench.suites.peers']\n")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "b.py").write_text("import bench\n")
    assert bench_importers(tmp_path) == ["hub/a.py:2", "hub/a.py:3"]


def test_every_suite_file_is_a_suite_the_cli_lists_and_runs() -> None:
    """bench/suites/NAME.py is ``bench NAME``: the CLI lists exactly the files there (no
    table to drift), each has ``run(json_path, quick)``, a description, a ledger entry, and
    no suite is named like one of the CLI's other verbs."""
    import contextlib
    import importlib
    import inspect
    import io

    import bench
    from bench.cli import VERBS
    from bench.headlines import BY_SUITE
    from tinyserve.__main__ import main

    files = sorted(p.stem for p in (ROOT / "bench" / "suites").glob("*.py")
                   if not p.name.startswith("_"))
    assert files and sorted(bench.SUITES) == files
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
        main(["bench", "--help"])
    listed = re.search(r"one of:\s+(.*?)\n\s*paths", help_text.getvalue(), re.S)
    assert listed, help_text.getvalue()
    assert [n for n in re.split(r",\s*", listed.group(1).strip()) if n not in VERBS] == files
    assert not set(files) & set(VERBS)
    for name in files:
        module = importlib.import_module(f"bench.suites.{name}")
        assert {"json_path", "quick"} <= set(inspect.signature(module.run).parameters), name
        assert bench.SUITES[name], f"bench/suites/{name}.py needs a module docstring"
        assert name in BY_SUITE, f"bench {name} has no headlines in bench/headlines.py"


#: A function longer than this holds more than one idea (the house style's limit).
MAX_FUNCTION_LINES = 80


def function_lengths(folder: Path, base: Path = ROOT) -> list[tuple[int, str]]:
    """``(lines, "path:line name")`` of every function and method under ``folder`` (paths
    relative to ``base``), longest first."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((lines, f"{path.relative_to(base)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def test_no_function_in_tinyserve_passes_80_lines() -> None:
    long = [f"{where} ({n} lines)" for n, where in function_lengths(PACKAGE)
            if n > MAX_FUNCTION_LINES]
    assert not long, f"split these along their own comments: {long}"


def test_function_lengths_are_counted_from_the_source(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert function_lengths(tmp_path, tmp_path) == [(82, "m.py:5 long"), (2, "m.py:1 short")]


def test_every_assignment_has_its_exercise_test() -> None:
    assignments = sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir()
                         and any(p.glob("*.ipynb")))
    missing = [a for a in assignments if not (ROOT / "tests" / f"test_{a}_exercise.py").exists()]
    assert assignments and not missing, f"name each assignment's tests test_<assignment>_exercise.py: {missing}"


# ------------------------------------------------------------------ autograder's rooms

GRADER = ROOT / "autograder"
CONTRACT = GRADER / "protocol" / "contract.py"   # where the kernel's names are kept
# Each room's rule, in one sentence each (autograder/<room>/__init__.py says it too): the
# rooms it may import besides itself. Doors (modules at the top) may import every room.
ROOM_RULES = {
    "protocol": set(),                       # imports nothing from autograder
    "kernel": {"protocol"},                  # runs in the learner's kernel
    "submitted": {"protocol"},               # the learner's text, read
    "runner": {"protocol", "submitted"},     # the trusted side of one notebook
    "pipeline": {"protocol", "submitted", "runner"},
    "mutation": {"protocol", "submitted", "runner", "pipeline"},
}


def grader_imports(path: Path) -> set[str]:
    """Every autograder module ``path`` names: imports at any depth (lazy ones included) and
    strings that start one (``__import__("autograder...")``, ``python -m autograder...``)."""
    tree = ast.parse(path.read_text())
    here = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[:-node.level] if node.level else []
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and not path.samefile(CONTRACT):
            # a module named by a string: a whole string (`-m autograder...`, a "module:attr"
            # path) or an __import__ in code sent to a kernel; the contract's names excepted
            whole = re.fullmatch(r"(autograder(?:\.\w+)+)(?::\w+)?", node.value)
            found.update([whole.group(1)] if whole else re.findall(
                r"__import__\(['\"](autograder(?:\.\w+)+)['\"]\)", node.value))
    return {m for m in found if m.split(".")[0] == "autograder"}


def room_of(module: str) -> str:
    """"kernel" for autograder.kernel.agent; "door" for a module at the top; "" for the package."""
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    return parts[1] if (GRADER / parts[1]).is_dir() else "door"


def test_autograders_rooms_keep_their_rules() -> None:
    broken = []
    for path in sorted(GRADER.rglob("*.py")):
        rel = path.relative_to(GRADER)
        room = rel.parts[0] if len(rel.parts) > 1 else "door"
        for module in grader_imports(path):
            target = room_of(module)
            if target in ("", room) or room == "door":
                continue
            if target == "door":
                broken.append(f"{rel} imports the door {module}")
            elif target == "kernel":
                broken.append(f"{rel} imports {module}: kernel/ is started by name (protocol.contract)")
            elif target not in ROOM_RULES.get(room, set()):
                broken.append(f"{rel} ({room}/) imports {module} ({target}/)")
    assert not broken, "\n".join(broken)


def test_autograders_top_holds_only_doors() -> None:
    """A door is a module named from outside Python imports: the CLI, the notebooks' helpers,
    Jupyter's and nbgrader's configuration."""
    doors = {p.stem for p in GRADER.glob("*.py")}
    assert doors == {"__init__", "__main__", "cli", "testkit", "build_checks", "kernel_helpers",
                     "remote_policy", "validate", "nbfeedback"}, doors


def test_the_names_the_kernel_is_started_by_exist() -> None:
    import importlib.util

    from autograder.protocol.contract import AGENT, KERNEL_BOOT, KERNEL_FILES, KERNEL_MODULES, WITHHOLD
    for text in (AGENT, WITHHOLD):
        module = re.search(r"__import__\('([\w.]+)'\)\.([\w.]+)\.(\w+)\(\)", text)
        assert module and module.group(2) == module.group(1).split(".", 1)[1], text
        assert importlib.util.find_spec(module.group(1)) is not None, text
    assert importlib.util.find_spec(KERNEL_BOOT) is not None
    assert all((GRADER / f).is_file() for f in KERNEL_FILES)
    assert {".".join(Path("autograder", f).with_suffix("").parts).removesuffix(".__init__")
            for f in KERNEL_FILES} == set(KERNEL_MODULES)


def private_names_crossing(package: Path = GRADER) -> list[str]:
    """``file:line module._name`` wherever a module of ``package`` takes another module's
    private name: ``from x import _y`` (at any depth, relative or not) or ``x._y`` where ``x``
    names another module of the package. Dunders are not private."""
    root = package.parent
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for p in package.rglob("*.py")}
    private = re.compile(r"_(?!_)\w*")
    found = []
    for name, path in sorted(modules.items()):
        tree = ast.parse(path.read_text())
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        aliases: dict[str, str] = {}   # a local name -> the module of the package it is
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names
                                if a.name in modules and a.asname})
            elif isinstance(node, ast.ImportFrom):
                base = here.split(".")[:len(here.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    if f"{module}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{module}.{a.name}"
                    elif module in modules and module != name and private.fullmatch(a.name):
                        found.append(f"{path.relative_to(root)}:{node.lineno} {module}.{a.name}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and private.fullmatch(node.attr)):
                continue
            dotted, value = [], node.value
            while isinstance(value, ast.Attribute):
                dotted.insert(0, value.attr)
                value = value.value
            if not isinstance(value, ast.Name):
                continue
            module = ".".join([aliases.get(value.id, value.id), *dotted])
            if module in modules and module != name:
                found.append(f"{path.relative_to(root)}:{node.lineno} {module}.{node.attr}")
    return found


def test_no_module_of_the_autograder_takes_another_modules_private_name() -> None:
    """A name a second module uses is part of its module's interface: it is public, and its
    docstring says who uses it (issue 39: sandbox.die_with_parent, wire.tensor_node)."""
    found = private_names_crossing()
    assert not found, f"make these public (and say who uses them): {found}"


def test_private_names_are_found_imported_and_through_a_module(tmp_path: Path) -> None:
    pkg = tmp_path / "autograder"
    (pkg / "runner").mkdir(parents=True)
    for f in ("__init__.py", "runner/__init__.py", "runner/sandbox.py"):
        (pkg / f).write_text("def _die():\n    pass\n")
    (pkg / "runner" / "worker.py").write_text(
        "from .sandbox import _die\nfrom autograder.runner import sandbox as s\n"
        "import autograder.runner.sandbox\n"
        "def f():\n    s._die()\n    autograder.runner.sandbox._die()\n    s.__name__\n")
    assert private_names_crossing(pkg) == [
        "autograder/runner/worker.py:1 autograder.runner.sandbox._die",
        "autograder/runner/worker.py:5 autograder.runner.sandbox._die",
        "autograder/runner/worker.py:6 autograder.runner.sandbox._die"]


# ------------------------------------------------------------------ tinyserve's backends

#: The loops: they run the steps, and each chooses eager or a backend for its step.
LOOPS = {"generate", "engine", "speculative", "draft_replay", "batching"}
#: What a backend may import from tinyserve, besides the other backends.
BACKEND_MAY_IMPORT = {"config", "device", "toolchain", "model", "kv_cache", "paged", "sampling"}
#: The model and its storage, below every loop and backend.
MODEL_AND_STORAGE = {"model", "kv_cache", "paged", "block_manager", "config", "quant"}
#: ``toolchain`` (can this process compile?) sits beside ``device``: the backends and the
#: int8 kernels' choice ask it, and it imports nothing of the package.
#: Measurement above the loops, which times a backend's step directly (fast_lab: the fast
#: path's steps and passes timed for chapters 1, 3, 6b and 8).
MEASURING = {"roofline", "graph_check", "workbook.fast_lab", "workbook.scale_sweeps"}
#: Paths a notebook names, kept as a re-export of a backend (chapter 8: tinyserve.spec_graphs).
KEPT_FOR_NOTEBOOKS = {"spec_graphs"}


def tinyserve_imports(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every module of ``package`` that ``path`` imports, at any depth (lazy imports inside
    functions included), named from the package down: ``generate``, ``backends.static``."""
    name = package.name
    # the package ``from .`` means, for a module and for an __init__.py alike
    here = [name, *path.relative_to(package).parts[:-1]]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            # ``from . import cuda_graph``: the names may be modules themselves
            found.update(f"{module}.{a.name}" for a in node.names
                         if (package.parent / module.replace(".", "/") / f"{a.name}.py").exists())
    return {m.split(".", 1)[1] if "." in m else "" for m in found
            if m == name or m.startswith(name + ".")} - {""}


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its name from the package down (``backends.static``)."""
    return {".".join(p.relative_to(package).with_suffix("").parts).removesuffix(".__init__")
            .removesuffix("__init__"): p for p in sorted(package.rglob("*.py"))}


def test_imports_are_read_at_every_depth(tmp_path: Path) -> None:
    pkg = tmp_path / "tinyserve"
    (pkg / "backends").mkdir(parents=True)
    for f in ("__init__.py", "generate.py", "backends/__init__.py", "backends/static.py"):
        (pkg / f).write_text("")
    (pkg / "backends" / "compiled.py").write_text(
        "from ..model import M\nfrom .static import S\nfrom . import static\n"
        "def f():\n    from tinyserve.generate import g\n    import tinyserve.roofline\n")
    assert tinyserve_imports(pkg / "backends" / "compiled.py", pkg) == \
        {"model", "backends.static", "backends", "generate", "roofline"}


def test_backends_import_only_config_device_model_kv_cache_paged_sampling_and_each_other() -> None:
    broken = [f"{module} imports {m}" for module, path in package_modules().items()
              if module.startswith("backends") for m in tinyserve_imports(path)
              if m.split(".")[0] not in BACKEND_MAY_IMPORT | {"backends"}]
    assert not broken, (f"{broken}: a backend is a step on fixed buffers under the loops; move "
                        f"what it needs from a loop or a measuring module down, or the caller up")


def test_model_and_storage_never_import_a_loop_a_backend_or_roofline() -> None:
    broken = [f"{module} imports {m}" for module, path in package_modules().items()
              if module in MODEL_AND_STORAGE for m in tinyserve_imports(path)
              if m.split(".")[0] in LOOPS | {"backends", "roofline"}]
    assert not broken, f"{broken}: the model and its storage sit below the loops that run them"


def test_only_the_loops_and_the_measuring_modules_import_a_backend() -> None:
    allowed = LOOPS | MEASURING | KEPT_FOR_NOTEBOOKS
    broken = [f"{module} imports {m}" for module, path in package_modules().items()
              if not module.startswith("backends") and module not in allowed
              for m in tinyserve_imports(path) if m.split(".")[0] == "backends"]
    assert not broken, f"{broken}: the loop that runs a step chooses its backend, nothing else does"


if __name__ == "__main__":
    import sys
    for folder in sys.argv[1:] or ["tinyserve", "autograder"]:
        print(f"{folder}: the longest functions (limit {MAX_FUNCTION_LINES} lines)")
        for n, where in function_lengths(ROOT / folder)[:10]:
            print(f"  {n:4d}  {where}")

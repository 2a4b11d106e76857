"""Static scan of submitted code for constructs that can tamper with grading.

Honest answers to these exercises are arithmetic, functions and data structures; they never
need the shell's internals, trace hooks, the import machinery or patched library functions.
So the scan can afford to be strict: any finding holds the submission for review (it is never
silently given full marks, and never silently zeroed either: a person decides).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

# name -> why it matters. Matched against names, attributes and imported modules.
SUSPICIOUS_NAMES = {
    "get_ipython": "reaches into the IPython shell that runs the tests",
    "input_transformers_cleanup": "IPython input transformer (can rewrite test cells)",
    "input_transformers_post": "IPython input transformer (can rewrite test cells)",
    "ast_transformers": "IPython AST transformer (can rewrite test cells)",
    "set_custom_exc": "custom exception handler (can swallow test failures)",
    "settrace": "trace hook (can skip test code)",
    "setprofile": "profile hook (can intercept test code)",
    "_exit": "kills the kernel (stops the remaining tests)",
    "__builtins__": "edits the builtins tests rely on",
    "_getframe": "inspects the caller's frame (can rewrite test variables)",
    "excepthook": "replaces the exception hook",
    "__import__": "dynamic import (hides what is imported)",
}
# Builtins that are only suspicious when called by name (``re.compile`` is fine).
SUSPICIOUS_BUILTINS = {
    "exec": "runs code built at run time",
    "eval": "runs code built at run time",
    "compile": "compiles code at run time",
    "setattr": "sets attributes by name (can patch libraries)",
    "globals": "edits global names by dictionary",
    "vars": "edits names by dictionary",
    "__import__": "dynamic import (hides what is imported)",
}
# os.* functions (only as attributes of ``os``).
SUSPICIOUS_OS = {"fork": "starts processes", "system": "runs shell commands",
                 "kill": "sends signals to processes", "popen": "runs shell commands",
                 "execv": "replaces the kernel process", "_exit": "kills the kernel"}
SUSPICIOUS_MODULES = {
    "builtins": "edits the builtins tests rely on",
    "ctypes": "raw memory access",
    "gc": "finds and edits objects the tests hold",
    "inspect": "inspects or edits the test code at run time",
    "importlib": "reloads or swaps modules",
    "subprocess": "starts processes",
    "multiprocessing": "starts processes",
    "threading": "keeps code running behind the tests",
    "signal": "changes interrupt handling",
    "socket": "network access",
    "autograder": "imports the grader's own modules",
    "_thread": "keeps code running behind the tests",
    "pty": "starts processes",
}
SUSPICIOUS_DUNDERS = {
    "__eq__": "custom equality (can make any comparison true)",
    "__ne__": "custom inequality",
    "__bool__": "custom truth value",
    "__instancecheck__": "custom isinstance",
    "__subclasscheck__": "custom issubclass",
    "__class__": "fakes its own type",
    "__del__": "runs code when collected",
}
SWALLOWED = {"KeyboardInterrupt", "BaseException", "SystemExit"}
# Magics an honest answer may use (measuring is part of the course); their code is scanned.
SAFE_MAGICS = {"time", "timeit", "matplotlib", "capture", "pprint", "precision", "who",
               "whos"}


@dataclass(frozen=True)
class Finding:
    cell: str      # grade_id, or "cell N" for cells without one
    line: int      # 1-based line within the cell
    what: str

    def __str__(self) -> str:
        return f"{self.cell} line {self.line}: {self.what}"


def to_python(source: str) -> str:
    """Turn IPython syntax (%magics, !shell) into plain Python so ``ast`` can read it."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        return TransformerManager().transform_cell(source)
    except Exception:
        return source


def scan_cell(source: str, cell: str, protected: dict[str, str]) -> list[Finding]:
    """Findings for one cell.

    ``protected`` maps names the locked cells bind to where they come from (see
    ``names_bound``); re-importing the same module under the same name is fine.
    """
    code = to_python(source)
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []  # it will fail when run; nothing it contains can execute
    findings: list[Finding] = []
    module_aliases: set[str] = set()
    allowed_shell: set[int] = set()   # get_ipython names that only run a safe magic
    for node in ast.walk(tree):
        magic = _safe_magic(node)
        if magic is not None:
            allowed_shell.add(id(magic[0]))
            for code_arg in magic[1]:
                for f in scan_cell(code_arg, cell, protected):
                    findings.append(Finding(cell, getattr(node, "lineno", 0), f.what))

    def add(node: ast.AST, what: str) -> None:
        findings.append(Finding(cell, getattr(node, "lineno", 0), what))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names]
            mod = node.module if isinstance(node, ast.ImportFrom) else None
            for alias in node.names:
                bound, origin = _import_binding(node, alias)
                module_aliases.add(bound)
                if bound in protected and protected[bound] != origin:
                    add(node, f"import rebinds `{bound}`, which the test code relies on")
            for full in ([mod] if mod else names):
                top = (full or "").split(".")[0]
                if top in SUSPICIOUS_MODULES:
                    add(node, f"imports {top}: {SUSPICIOUS_MODULES[top]}")
            if mod:
                for name in names:
                    if name in SUSPICIOUS_NAMES:
                        add(node, f"imports {name}: {SUSPICIOUS_NAMES[name]}")
        elif isinstance(node, ast.Name) and node.id in SUSPICIOUS_NAMES:
            if id(node) not in allowed_shell:
                add(node, f"`{node.id}`: {SUSPICIOUS_NAMES[node.id]}")
        elif isinstance(node, ast.Name) and node.id in SUSPICIOUS_BUILTINS:
            add(node, f"`{node.id}`: {SUSPICIOUS_BUILTINS[node.id]}")
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "os" \
                    and node.attr in SUSPICIOUS_OS:
                add(node, f"`os.{node.attr}`: {SUSPICIOUS_OS[node.attr]}")
            elif node.attr in SUSPICIOUS_NAMES:
                add(node, f"`.{node.attr}`: {SUSPICIOUS_NAMES[node.attr]}")
            elif node.attr == "modules" and isinstance(node.value, ast.Name) \
                    and node.value.id == "sys":
                add(node, "`sys.modules`: swaps modules the tests import")
            elif node.attr == "register" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "events":
                add(node, "registers an IPython event hook (runs code around tests)")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in SUSPICIOUS_DUNDERS:
                add(node, f"defines {node.name}: {SUSPICIOUS_DUNDERS[node.name]}")
            if node.name in protected:
                add(node, f"redefines `{node.name}`, which the test code relies on")
        elif isinstance(node, ast.ClassDef) and node.name in protected:
            add(node, f"redefines `{node.name}`, which the test code relies on")
        elif isinstance(node, ast.ExceptHandler):
            caught = node.type
            names = []
            if caught is None:
                continue
            for n in (caught.elts if isinstance(caught, ast.Tuple) else [caught]):
                if isinstance(n, ast.Name):
                    names.append(n.id)
            for n in names:
                if n in SWALLOWED:
                    add(node, f"catches {n} (swallows interrupts and timeouts)")
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for n in node.names:
                if n in protected:
                    add(node, f"rebinds `{n}`, which the test code relies on")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                       else [node.target])
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name) and sub.id in protected:
                        add(node, f"rebinds `{sub.id}`, which the test code relies on")
                    elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                            and (sub.value.id in module_aliases or sub.value.id in protected):
                        add(node, f"assigns `{sub.value.id}.{sub.attr}` "
                                  "(patches a module or a test object)")
                    elif isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name) \
                            and sub.value.id in protected:
                        add(node, f"edits `{sub.value.id}[...]`, which the test code relies on")
    # One line per construct is enough for a reviewer.
    unique = {(f.line, f.what): f for f in findings}
    return sorted(unique.values(), key=lambda f: f.line)


def _safe_magic(node: ast.AST) -> tuple[ast.Name, list[str]] | None:
    """For ``get_ipython().run_line_magic('timeit', 'f(x)')`` and the like: the get_ipython
    name node and the code strings the magic will run; None for anything else."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("run_line_magic", "run_cell_magic")
            and isinstance(node.func.value, ast.Call)
            and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "get_ipython" and node.args
            and isinstance(node.args[0], ast.Constant) and node.args[0].value in SAFE_MAGICS):
        return None
    code = [a.value for a in node.args[1:] if isinstance(a, ast.Constant)
            and isinstance(a.value, str)]
    return node.func.value.func, code


def _import_binding(node: ast.Import | ast.ImportFrom, alias: ast.alias) -> tuple[str, str]:
    """(name bound, what it is bound to) for one alias of an import statement."""
    if isinstance(node, ast.ImportFrom):
        return alias.asname or alias.name, f"{node.module}.{alias.name}"
    if alias.asname:
        return alias.asname, alias.name
    top = alias.name.split(".")[0]
    return top, top


def names_bound(source: str) -> dict[str, str]:
    """Top-level names a (trusted) cell binds, mapped to their origin ("=" for values)."""
    try:
        tree = ast.parse(to_python(source))
    except SyntaxError:
        return {}
    bound: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                name, origin = _import_binding(node, alias)
                bound[name] = origin
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[node.name] = "="
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        bound[sub.id] = "="
    return bound

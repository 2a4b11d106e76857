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
    scanner = _Scanner(cell, protected)
    for node in ast.walk(tree):
        magic = safe_magic(node)
        if magic is not None:
            scanner.allowed_shell.add(id(magic[0]))
            for code_arg in magic[1]:
                for f in scan_cell(code_arg, cell, protected):
                    scanner.findings.append(Finding(cell, getattr(node, "lineno", 0), f.what))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            scanner.module_aliases.update(_import_binding(node, a)[0] for a in node.names)
    scanner.visit(tree)
    # One line per construct is enough for a reviewer.
    unique = {(f.line, f.what): f for f in scanner.findings}
    return sorted(unique.values(), key=lambda f: f.line)


class _Scanner(ast.NodeVisitor):
    """One method per kind of construct; each adds its findings and keeps walking."""

    def __init__(self, cell: str, protected: dict[str, str]):
        self.cell, self.protected = cell, protected
        self.findings: list[Finding] = []
        self.module_aliases: set[str] = set()
        self.allowed_shell: set[int] = set()   # get_ipython names that only run a safe magic

    def add(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.cell, getattr(node, "lineno", 0), what))

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        names = [a.name for a in node.names]
        mod = node.module if isinstance(node, ast.ImportFrom) else None
        for alias in node.names:
            bound, origin = _import_binding(node, alias)
            if bound in self.protected and self.protected[bound] != origin:
                self.add(node, f"import rebinds `{bound}`, which the test code relies on")
        for full in ([mod] if mod else names):
            top = (full or "").split(".")[0]
            if top in SUSPICIOUS_MODULES:
                self.add(node, f"imports {top}: {SUSPICIOUS_MODULES[top]}")
        for name in (names if mod else []):
            if name in SUSPICIOUS_NAMES:
                self.add(node, f"imports {name}: {SUSPICIOUS_NAMES[name]}")
        self.generic_visit(node)

    visit_ImportFrom = visit_Import

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in SUSPICIOUS_NAMES and id(node) not in self.allowed_shell:
            self.add(node, f"`{node.id}`: {SUSPICIOUS_NAMES[node.id]}")
        elif node.id in SUSPICIOUS_BUILTINS and node.id not in SUSPICIOUS_NAMES:
            self.add(node, f"`{node.id}`: {SUSPICIOUS_BUILTINS[node.id]}")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        base = node.value.id if isinstance(node.value, ast.Name) else None
        if base == "os" and node.attr in SUSPICIOUS_OS:
            self.add(node, f"`os.{node.attr}`: {SUSPICIOUS_OS[node.attr]}")
        elif node.attr in SUSPICIOUS_NAMES:
            self.add(node, f"`.{node.attr}`: {SUSPICIOUS_NAMES[node.attr]}")
        elif node.attr == "modules" and base == "sys":
            self.add(node, "`sys.modules`: swaps modules the tests import")
        elif node.attr == "register" and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "events":
            self.add(node, "registers an IPython event hook (runs code around tests)")
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if node.name in SUSPICIOUS_DUNDERS:
            self.add(node, f"defines {node.name}: {SUSPICIOUS_DUNDERS[node.name]}")
        if node.name in self.protected:
            self.add(node, f"redefines `{node.name}`, which the test code relies on")
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if node.name in self.protected:
            self.add(node, f"redefines `{node.name}`, which the test code relies on")
        self.generic_visit(node)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        caught = node.type
        for n in (caught.elts if isinstance(caught, ast.Tuple) else [caught]) if caught else []:
            if isinstance(n, ast.Name) and n.id in SWALLOWED:
                self.add(node, f"catches {n.id} (swallows interrupts and timeouts)")
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global | ast.Nonlocal) -> None:
        for n in node.names:
            if n in self.protected:
                self.add(node, f"rebinds `{n}`, which the test code relies on")
        self.generic_visit(node)

    visit_Nonlocal = visit_Global

    def visit_Assign(self, node: ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete) -> None:
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for target in targets:
            for sub in ast.walk(target):
                self._target(node, sub)
        self.generic_visit(node)

    visit_AugAssign = visit_AnnAssign = visit_Delete = visit_Assign

    def _target(self, node: ast.AST, sub: ast.AST) -> None:
        protected = self.protected
        if isinstance(sub, ast.Name) and sub.id in protected:
            self.add(node, f"rebinds `{sub.id}`, which the test code relies on")
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                and (sub.value.id in self.module_aliases or sub.value.id in protected):
            self.add(node, f"assigns `{sub.value.id}.{sub.attr}` "
                           "(patches a module or a test object)")
        elif isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name) \
                and sub.value.id in protected:
            self.add(node, f"edits `{sub.value.id}[...]`, which the test code relies on")


def safe_magic(node: ast.AST) -> tuple[ast.Name, list[str]] | None:
    """For ``get_ipython().run_line_magic('timeit', 'f(x)')`` and the like: the get_ipython
    name node and the code strings the magic will run; None for anything else. own_source
    reads the magics of a learner's cells with it too."""
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


def names_a_cell_binds(source: str) -> set[str]:
    """Every global name a (trusted) cell can bind, wherever the binding sits: at the top, in
    an ``if``/``for``/``with``/``try`` block, a ``for`` target, a walrus, or a ``global``
    statement in a function. The trusted runner never fetches these from the kernel: a name
    the assignment's own cells bind is the tests', even when the cell that binds it failed."""
    return global_names(to_python(source),
                        lambda s: s.is_assigned() or s.is_imported() or s.is_namespace(),
                        lambda s: s.is_declared_global() and s.is_assigned())


def global_names(code: str, at_top, inside) -> set[str]:
    """Names of module scope in ``code`` (symtable's reading): the top scope's symbols for
    which ``at_top(symbol)`` holds, and the nested scopes' for which ``inside(symbol)`` does.
    Empty when ``code`` does not parse."""
    import symtable
    try:
        table = symtable.symtable(code, "<cell>", "exec")
    except SyntaxError:
        return set()
    names = {s.get_name() for s in table.get_symbols() if at_top(s)}
    todo = list(table.get_children())
    while todo:
        child = todo.pop()
        todo.extend(child.get_children())
        names.update(s.get_name() for s in child.get_symbols() if inside(s))
    return names


"""Is a graded piece the learner's own code? Judged from the submitted source, on the trusted side.

The build track gives no points for a piece that calls or copies tinyserve (the reference the
tests compare with). That evidence used to be computed in the learner's kernel, where the
learner could rebind the function that computed it. Here it is read from the source of the
learner's cells, which the grader holds: the piece's definition, and every helper of the
learner's it reaches (other graded pieces excepted: each is judged on its own). A piece has a
problem when it, or a helper it reaches:

* imports from tinyserve, or reads a name the assignment's read-only cells bound to a
  tinyserve object (``_apply_rope``), in its body, its default arguments or its decorators;
* reaches names dynamically (``eval``, ``__import__``, ``globals()``, ``sys.modules``,
  ``__globals__``, ``getattr`` with a computed name ...), which a reading of the code cannot
  follow (flagged for review, never passed silently);
* where the exercise bans a call (torch's attention in the attention piece): reaches it under
  any other spelling (``banned_uses``: an import binding it under another name, ``torch.ops``,
  ``getattr`` with a computed name, the name spelled in a string), which counts as the call;
* reads an attribute of a module that the module does not have (put there at run time);
* reads a name no cell binds in a way this reading can see;
* is mostly tinyserve's lines, verbatim (``build_checks.copied_lines``).

A verdict needs nothing from the kernel, so nothing the learner's code does at run time can
change it.
"""
from __future__ import annotations

import ast
import builtins
import textwrap
import types
from collections.abc import Mapping

from autograder.protocol.contract import KERNEL_LIBRARIES
from autograder.submitted.scan import safe_magic, global_names, to_python

REFERENCE = "tinyserve"
# Names that reach other names at run time: code that uses them cannot be read for what it
# calls. None of them is needed to write a build-track piece.
DYNAMIC_NAMES = frozenset({"eval", "exec", "compile", "__import__", "globals", "locals", "vars",
                           "breakpoint", "importlib", "sys", "builtins", "__builtins__",
                           "get_ipython"})
DYNAMIC_ATTRS = frozenset({"__globals__", "__dict__", "__builtins__", "__code__", "__closure__",
                           "__defaults__", "__kwdefaults__", "__subclasses__", "__import__",
                           "__getattribute__", "__loader__", "__spec__", "__self__", "modules",
                           "f_globals", "f_locals", "f_back", "import_module"})
# Bound by IPython in every kernel namespace.
KERNEL_NAMES = frozenset({"In", "Out", "display", "exit", "quit", "_", "__", "___"})


def problems(sources: list[str], piece: str, pieces: tuple[str, ...], trusted: Mapping,
             banned: tuple[str, ...] = (), reference_lines: frozenset[str] = frozenset()
             ) -> list[str]:
    """Why ``piece`` (a name the learner's cells ``sources`` bind) is not the learner's own
    work; empty when nothing was found. ``trusted``: what the assignment's own cells bound
    (read-only and test cells), as objects of the trusted side."""
    bindings = _bindings(sources)
    found: list[str] = []
    seen: set[str] = set()
    todo = [piece]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name != piece and name in pieces:
            continue  # another graded piece: judged on its own
        if name in bindings:
            node, text = bindings[name]
            read, why = _reads(node, text, trusted, banned, reference_lines)
            found.extend(f"through {name}: {w}" if name != piece else w for w in why)
            todo.extend(read)
        elif name == piece:
            return []  # not defined: the piece's own tests say so
        elif not _star_imported(name, sources):
            found.extend(_outside_name(name, trusted, banned))
    return sorted(set(found))


def _star_imported(name: str, sources: list[str]) -> bool:
    """``name`` comes from a ``from MODULE import *`` of the learner's cells (a right answer
    using ``prod`` after ``from math import *`` reads a name no cell spells out)."""
    import importlib
    for stmt, _ in _statements(sources):
        for node in ast.walk(stmt):
            # Only the kernel's own libraries are imported here to list their names: a
            # module name the learner wrote is never imported on the trusted side otherwise.
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names) \
                    and node.module and node.module.split(".")[0] in KERNEL_LIBRARIES:
                try:
                    module = importlib.import_module(node.module)
                except Exception:  # noqa: BLE001 - not importable here: not this name's source
                    continue
                public = getattr(module, "__all__", None) or [
                    n for n in dir(module) if not n.startswith("_")]
                if name in public:
                    return True
    return False


# Statements whose binding runs whenever the cell does (no branch, loop, with or try).
_PLAIN = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign,
          ast.Import, ast.ImportFrom)


def _statements(sources: list[str]):
    """(module-level statement, its cell's text) of every learner cell that parses."""
    for source in sources:
        text = to_python(source)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for stmt in tree.body:
            yield stmt, text


def banned_in_candidates(sources: list[str], piece: str, banned: tuple[str, ...]) -> list[str]:
    """Banned names used by any binding of ``piece`` that may be the one that ran: the last
    binding outside an if, loop, with or try, and every binding after it (a reading of the
    source cannot tell which branch ran, so a banned call in any of them costs the piece)."""
    if not banned:
        return []
    candidates = [(node, text, isinstance(stmt, _PLAIN)) for stmt, text in _statements(sources)
                  for name, node in _bound_by(stmt) if name == piece]
    last_plain = max((i for i, c in enumerate(candidates) if c[2]), default=0)
    found: set[str] = set()
    for node, text, _ in candidates[last_plain:]:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in banned:
                found.add(f"uses {sub.id}")
        found.update(banned_uses(node, banned))
    return sorted(found)


def review_notes(sources: list[str], piece: str) -> list[str]:
    """What a reading of the source cannot settle about which code ran: ``piece`` bound more
    than once, or inside a compound statement (an ``if``, a loop, a ``try``). For review."""
    binding = [stmt for stmt, _ in _statements(sources) if piece in {n for n, _ in _bound_by(stmt)}]
    count, nested = len(binding), any(not isinstance(stmt, _PLAIN) for stmt in binding)
    notes = []
    if count > 1:
        notes.append(f"bound {count} times in your cells: which one ran is read from the run, "
                     "not the source")
    if nested:
        notes.append("bound inside an if, loop, with or try: which branch ran is not in the source")
    return notes


def _outside_name(name: str, trusted: Mapping, banned: tuple[str, ...]) -> list[str]:
    """A name the learner's code reads that their cells do not bind."""
    if name in banned:
        return [f"uses {name}"]
    if name in trusted:
        obj = trusted[name]
        return [f"uses {name} ({_origin(obj)})"] if _is_reference(obj) else []
    if hasattr(builtins, name) or name in KERNEL_NAMES:
        return []
    return [f"reads `{name}`, which no cell defines where the grader can see it"]


def _bindings(sources: list[str]) -> dict[str, tuple[ast.AST, str]]:
    """The last module-level binding of each name in the learner's cells (as the kernel ran
    them, in order): (the node that binds it, its cell's source)."""
    out: dict[str, tuple[ast.AST, str]] = {}
    for source in sources:
        _bind(source, out)
    return out


def _bind(source: str, out: dict, depth: int = 0) -> None:
    """Record ``source``'s module-level bindings in ``out``, and those of the code a cell
    magic runs (``%%time`` over a cell defines what the cell defines)."""
    for stmt, text in _statements([source]):
        for name, node in _bound_by(stmt):
            out[name] = (node, text)
        for sub in ast.walk(stmt) if depth < 4 else ():
            magic = safe_magic(sub)
            for code in magic[1] if magic is not None else ():
                _bind(code, out, depth + 1)


def _bound_by(stmt: ast.stmt):
    """(name, node whose code gives it its value) for each name ``stmt`` binds at module
    level, however deep in if/for/with/try it sits."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield stmt.name, stmt
        for sub in ast.walk(stmt):  # `global x` in a function: x is bound by that function
            if isinstance(sub, ast.Global):
                for name in sub.names:
                    yield name, stmt
        return
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        for alias in stmt.names:
            yield (alias.asname or alias.name).split(".")[0], stmt
        return
    for sub in ast.walk(stmt):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            yield sub.id, stmt
        elif isinstance(sub, (ast.Subscript, ast.Attribute)) and isinstance(sub.ctx, ast.Store):
            # `table["f"] = ...` or `ns.f = ...` fills a container a piece reads: followed too
            base = sub.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                yield base.id, stmt
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield sub.name, sub
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            for alias in sub.names:
                yield (alias.asname or alias.name).split(".")[0], sub


# Other names of a banned call: torch's own operators behind it (``torch.ops.aten``, the
# kernel-specific variants), reached under a name that is not the banned one.
BANNED_STEMS = {"scaled_dot_product_attention": ("scaled_dot_product", "flash_attention",
                                                 "efficient_attention", "_fused_sdp")}


def _is_banned_name(name: str, banned: tuple[str, ...]) -> str | None:
    """The banned name ``name`` stands for: itself, or one containing it or one of its stems."""
    for b in banned:
        if name == b or b in name or any(stem in name for stem in BANNED_STEMS.get(b, ())):
            return b
    return None


def banned_uses(node: ast.AST, banned: tuple[str, ...]) -> list[str]:
    """Where ``node``'s code may reach a banned call under another spelling: an import binding
    a banned name (under any name), ``torch.ops`` (operators by name), ``getattr`` with a name
    computed at run time, a string spelling a banned name (``attrgetter``, ``__dict__[...]``).
    Each counts as the banned call itself; with nothing banned, they are not looked for."""
    if not banned:
        return []
    found: list[str] = []
    prose = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Expr)}  # docstrings
    for sub in ast.walk(node):
        if isinstance(sub, ast.ImportFrom):
            for alias in sub.names:
                b = _is_banned_name(alias.name, banned)
                if b:
                    found.append(f"imports {b}" + (f" as {alias.asname}" if alias.asname else ""))
        elif isinstance(sub, ast.Attribute):
            b = _is_banned_name(sub.attr, banned)
            if b:
                found.append(f"uses {b}" + (f" (as .{sub.attr})" if sub.attr != b else ""))
            elif sub.attr == "ops":
                found.append(f"reaches torch.ops (operators by name), which counts as: uses {banned[0]}")
        elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "getattr" \
                and len(sub.args) >= 2:
            name = sub.args[1]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                found.append(f"getattr with a name computed at run time, which counts as: uses {banned[0]}")
            elif name.value == "ops":
                found.append(f"reaches torch.ops (operators by name), which counts as: uses {banned[0]}")
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and id(sub) not in prose:
            b = _is_banned_name(sub.value, banned)
            if b:
                found.append(f"spells {b!r} in a string, which counts as: uses {b}")
    return sorted(set(found))


def _reads(node: ast.AST, text: str, trusted: Mapping, banned: tuple[str, ...],
           reference_lines: frozenset[str]) -> tuple[set[str], list[str]]:
    """(global names ``node``'s code reads, problems found in it)."""
    why: list[str] = list(banned_uses(node, banned))
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Import, ast.ImportFrom)):
            modules = ([a.name for a in sub.names] if isinstance(sub, ast.Import)
                       else [sub.module or ""])
            for module in modules:
                root = module.split(".")[0]
                if root == REFERENCE or root in banned:
                    why.append(f"imports {module}")
                elif root in DYNAMIC_NAMES:
                    why.append(f"imports {module}, which reaches names at run time")
        elif isinstance(sub, ast.Attribute):
            why.extend(_attribute_problems(sub, trusted, banned))
        elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) \
                and sub.func.id in ("getattr", "setattr", "delattr") and len(sub.args) >= 2 \
                and not (isinstance(sub.args[1], ast.Constant) and isinstance(sub.args[1].value, str)):
            why.append(f"{sub.func.id} with a name computed at run time, which a reading cannot follow")
    names = _global_reads(node, text)
    for name in sorted(names & DYNAMIC_NAMES):
        why.append(f"uses {name}, which reaches names at run time")
    why.extend(copied_lines(ast.get_source_segment(text, node) or "", reference_lines))
    return names - DYNAMIC_NAMES, why


def _attribute_problems(node: ast.Attribute, trusted: Mapping, banned: tuple[str, ...]
                        ) -> list[str]:
    if node.attr == REFERENCE:
        return [f"uses {node.attr}"]
    if node.attr in DYNAMIC_ATTRS:
        return [f"reads .{node.attr}, which reaches names at run time"]
    base = node.value
    if isinstance(base, ast.Name) and base.id in trusted:
        module = trusted[base.id]
        if isinstance(module, types.ModuleType) and not hasattr(module, node.attr):
            return [f"reads {base.id}.{node.attr}, which {base.id} does not have "
                    "(set at run time?)"]
    return []


def _global_reads(node: ast.AST, text: str) -> set[str]:
    """Names ``node``'s code looks up in the notebook's globals (symtable's reading, so a
    local, a parameter or a comprehension variable is not one)."""
    segment = ast.get_source_segment(text, node)
    if segment is None:
        return set()
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        # A module-level statement: what it reads is global, except what it binds itself
        # before reading (too fine to matter here: it binds the names it is followed for).
        segment = ast.unparse(node)
    return global_names(textwrap.dedent(segment), lambda s: s.is_referenced(),
                        lambda s: s.is_global() and s.is_referenced())


def copied_lines(source: str, reference_lines: frozenset[str]) -> list[str]:
    """Source whose code lines are mostly tinyserve's, verbatim, is a copy."""
    lines = [ln.split("#")[0].strip() for ln in source.splitlines()[1:]]
    lines = [ln for ln in lines if ln and not ln.startswith(('"""', "'''"))]
    same = [ln for ln in lines if ln in reference_lines]
    if len(same) >= 2 and 2 * len(same) >= len(lines):
        return [f"lines copied from tinyserve ({same[0][:60]!r} ...)"]
    return []


def _is_reference(obj: object) -> bool:
    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    else:
        name = getattr(obj, "__module__", None) if callable(obj) else None
        name = name or getattr(type(obj), "__module__", "")
    return isinstance(name, str) and name.split(".")[0] == REFERENCE


def _origin(obj: object) -> str:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    module = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", "")
    return f"{module}.{getattr(obj, '__qualname__', type(obj).__name__)}"

"""What a build assignment's read-only cells give the learner's kernel, and in what form.

In a build assignment the kernel holds the learner's code, torch and data, never a reference:
the read-only cells run on the trusted side only, and what they bind reaches the kernel as
one ``bind`` request (``Channel.publish``), each name in one of five forms:

* not at all: a name with a leading underscore is the tests' own (``_RMSNorm``, ``_PIECES``);
* by import path: a module of the kernel's libraries (torch, the standard library, NumPy,
  safetensors, matplotlib), or an object one of them defines (``Tensor``, ``load_file``);
* by value: data (``WEIGHTS``, ``CFG``, ``DEVICE``), as the wire carries it, the shipped
  weights once;
* by source: a plain helper the cell defines whose code reads only builtins and names
  published above (``layer_weights``): the template's own text, no reference in it;
* lent: any other function the cell defines (a given piece built on the reference): a
  stand-in in the kernel whose calls are served, and counted, here;
* withheld: everything else (tinyserve, the grader's helpers): a placeholder that raises,
  naming it, when the learner's code uses it.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import types

from autograder.protocol.contract import KERNEL_LIBRARIES
from autograder.protocol.wire import Encoder, WireError

# The statement by which a template's read-only cell declares that its kernel holds no
# reference (every build assignment's first cell, as each is moved to this design).
DECLARATION = '_KERNEL_HOLDS = "no reference"'


def needs_no_reference(sources: list[str]) -> bool:
    """Whether the assignment's read-only cells declare ``DECLARATION``. Read from the
    template's own cells (the graded notebook takes every read-only cell from the template),
    never from anything a submission controls."""
    from autograder.submitted.scan import to_python
    for text in sources:
        try:
            tree = ast.parse(to_python(text))
        except SyntaxError:
            continue
        for node in tree.body:
            if ast.unparse(node) == DECLARATION.replace('"', "'"):
                return True
    return False


def _library_path(value: object) -> tuple[str, str] | None:
    """(module, attribute path) by which the kernel imports ``value`` itself, or None."""
    if isinstance(value, types.ModuleType):
        top = value.__name__.split(".")[0]
        return (value.__name__, "") if top in KERNEL_LIBRARIES else None
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    if module.split(".")[0] not in KERNEL_LIBRARIES:
        return None
    try:
        found: object = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return (module, qualname) if found is value else None


_PROBE = Encoder(lambda obj, depth: (_ for _ in ()).throw(WireError("not data")),
                 on_tensor=lambda t: {"$c": 0})


def _is_data(value: object) -> bool:
    try:
        _PROBE.encode(value)
        return True
    except (WireError, TypeError, RecursionError, ValueError):
        return False


def _definitions(cell_source: str) -> dict[str, str]:
    """Top-level function definitions of a cell, by name: their source text."""
    from autograder.submitted.scan import to_python
    text = to_python(cell_source)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    return {node.name: ast.get_source_segment(text, node) or ""
            for node in tree.body if isinstance(node, ast.FunctionDef) and not node.decorator_list}


def _reads(fn: types.FunctionType) -> set[str]:
    """Global names ``fn``'s code (nested code included) reads."""
    import dis
    names, todo = set(), [fn.__code__]
    while todo:
        code = todo.pop()
        names.update(str(ins.argval) for ins in dis.get_instructions(code)
                     if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"))
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def publication(bound: dict[str, object], cell_source: str, namespace: str,
                already: frozenset[str] = frozenset(), lend: frozenset[str] = frozenset()) -> dict:
    """The ``bind`` request's fields for what one read-only cell bound: ``imports``,
    ``withheld``, ``values``, ``sources``, and ``lent`` (objects to lend before sending).
    ``already``: names earlier read-only cells published (a helper here may read them);
    ``lend``: the cell's own functions to lend even when plain (the template's ``_LEND``: a
    given piece whose every call the tests count, however the learner's code reaches it)."""
    out: dict = {"imports": {}, "withheld": {}, "values": {}, "sources": {}, "lent": []}
    definitions = _definitions(cell_source)
    own: dict[str, types.FunctionType] = {}
    for name, value in bound.items():
        if name.startswith("_"):
            continue
        path = _library_path(value)
        if path is not None:
            out["imports"][name] = list(path)
        elif inspect.isfunction(value) and value.__module__ == namespace:
            own[name] = value
        elif _is_data(value):
            out["values"][name] = value
        else:
            module = getattr(value, "__module__", None) or getattr(value, "__name__", "")
            out["withheld"][name] = f"{type(value).__name__} from {str(module)[:60]}"
    published = set(out["imports"]) | set(out["values"]) | set(dir(builtins)) | set(already)
    for name, fn in own.items():
        plain = name not in lend and definitions.get(name) and _reads(fn) <= published | set(own)
        if plain:
            out["sources"][name] = definitions[name]
        else:
            out["values"][name] = fn
            out["lent"].append(fn)
    return out

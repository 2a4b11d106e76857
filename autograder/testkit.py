"""Assertion helpers for graded notebooks.

Test cells in ``solutions/`` use only these helpers, never bare ``assert`` on student
objects. The helpers capture the builtins they rely on at import time (the grader imports this
module in a fresh kernel before any submitted code runs, and the first, locked cell of every
graded notebook imports it too), so a submission that later monkeypatches ``math.isclose`` or
defines an ``__eq__`` that is always true cannot make a wrong answer pass.

Every failure raises ``AssertionError`` whose message names the check, what was expected and,
where a classic mistake is recognised, what the mistake probably was.

Before each check the helpers also look for tampering in the running kernel (IPython input
transformers and event hooks, a trace function, patched comparison functions, patched helpers)
and fail with an ``[integrity]`` message when they find any; the grader turns that message
into a review flag. This is one layer of several: the grader also scans the submission's
source statically and runs it in a sandbox with an audit hook.
"""
from __future__ import annotations

import builtins as _builtins
import math as _math
import sys as _sys

# References captured before any student code runs.
_isclose = _math.isclose
_isfinite = _math.isfinite
_type = type
_isinstance = isinstance
_float = float
_repr = repr
_len = len
_zip = zip
_enumerate = enumerate
_getattr = getattr
_sorted = sorted
_AssertionError = AssertionError
_NUMBER_TYPES = (int, float)

_BUILTIN_NAMES = ("isinstance", "type", "float", "int", "repr", "len", "zip", "enumerate",
                  "getattr", "abs", "round", "sum", "min", "max", "sorted", "str", "bool",
                  "AssertionError", "Exception", "__import__", "print")
_BUILTINS_AT_IMPORT = {name: _getattr(_builtins, name) for name in _BUILTIN_NAMES}
_MATH_AT_IMPORT = {"isclose": _math.isclose, "isfinite": _math.isfinite}

# Modules whose callbacks and transformers are expected inside a kernel.
_TRUSTED_MODULES = ("IPython", "ipykernel", "matplotlib", "matplotlib_inline", "ipywidgets",
                    "traitlets", "comm", "jupyter_client", "torch", "numpy", "debugpy",
                    "autograder", "tinyserve", "_pydevd", "pydevd")
# Comparison functions test code might rely on, and the module each must still come from.
_LIBRARY_FUNCTIONS = (("torch", "allclose"), ("torch", "equal"), ("torch", "isclose"),
                      ("numpy", "allclose"), ("numpy", "isclose"), ("numpy", "array_equal"))
_SHELL_METHODS = ("run_cell", "run_cell_async", "run_ast_nodes", "run_code", "transform_cell",
                  "showtraceback", "_showtraceback", "should_run_async", "showsyntaxerror")

_STATS = {"checks": 0, "failed": 0}


def _shell_overrides() -> dict:
    """Per-instance method overrides of the shell (ipykernel sets some itself at start-up)."""
    shell_mod = _sys.modules.get("IPython")
    try:
        shell = shell_mod.get_ipython() if shell_mod is not None else None
    except Exception:
        shell = None
    instance_dict = _getattr(shell, "__dict__", {}) if shell is not None else {}
    return {m: instance_dict.get(m) for m in _SHELL_METHODS}


_SHELL_AT_IMPORT = _shell_overrides()
_VIOLATIONS: list[str] = []


def _trusted(obj: object) -> bool:
    module = _getattr(obj, "__module__", None) or ""
    if not module:
        func = _getattr(obj, "__func__", None)
        module = _getattr(func, "__module__", None) or ""
    return module.split(".")[0] in _TRUSTED_MODULES


def _find_tampering() -> list[str]:
    """Describe every sign of tampering in this process (empty list: none found)."""
    found = []
    if _sys.gettrace() is not None:
        found.append("a trace function is installed (sys.settrace)")
    if _sys.getprofile() is not None:
        found.append("a profile function is installed (sys.setprofile)")
    for name, ref in _BUILTINS_AT_IMPORT.items():
        if _getattr(_builtins, name, None) is not ref:
            found.append(f"builtins.{name} was replaced")
    for name, ref in _MATH_AT_IMPORT.items():
        if _getattr(_math, name, None) is not ref:
            found.append(f"math.{name} was replaced")
    for module_name, attr in _LIBRARY_FUNCTIONS:
        module = _sys.modules.get(module_name)
        if module is not None:
            func = _getattr(module, attr, None)
            if func is None or not _trusted(func):
                found.append(f"{module_name}.{attr} was replaced")
    me = _sys.modules.get(__name__)
    for name, code in _CODE.items():
        func = _getattr(me, name, None)
        if func is None or _getattr(func, "__code__", None) is not code:
            found.append(f"autograder.testkit.{name} was replaced")
    found.extend(_shell_tampering())
    return found


def _shell_tampering() -> list[str]:
    shell_mod = _sys.modules.get("IPython")
    if shell_mod is None:
        return []
    try:
        shell = shell_mod.get_ipython()
    except Exception:
        return []
    if shell is None:
        return []
    found = []
    for attr in ("input_transformers_cleanup", "input_transformers_post", "ast_transformers"):
        for item in _getattr(shell, attr, None) or ():
            if not _trusted(item):
                found.append(f"an IPython input transformer was installed ({attr})")
                break
    if _getattr(shell, "custom_exceptions", ()):
        found.append("a custom exception handler was installed (set_custom_exc)")
    events = _getattr(_getattr(shell, "events", None), "callbacks", None) or {}
    for event, callbacks in events.items():
        for callback in callbacks:
            if not _trusted(callback):
                found.append(f"an IPython event hook was registered ({event})")
                break
    now = _shell_overrides()
    for method in _SHELL_METHODS:
        if now[method] is not _SHELL_AT_IMPORT[method] \
                or not _trusted(_getattr(_type(shell), method, None)):
            found.append(f"the IPython shell's {method} was replaced")
    return found


def _guard() -> None:
    """Fail the current test with an [integrity] message if the kernel was tampered with."""
    found = _find_tampering()
    if found:
        for item in found:
            if item not in _VIOLATIONS:
                _VIOLATIONS.append(item)
        raise _AssertionError("[integrity] " + "; ".join(found)
                              + " -- submission held for review")


def _integrity_report(nonce: str) -> None:
    """Print one line the grader parses after the last cell (see autograder.runner.execute)."""
    import json
    found = _find_tampering()
    report = {"nonce": nonce, "violations": _sorted(set(_VIOLATIONS) | set(found)),
              "checks": _STATS["checks"], "failed": _STATS["failed"]}
    _sys.__stdout__.flush()
    print("AUTOGRADER-INTEGRITY " + json.dumps(report), flush=True)


def _name_of(value: object) -> str:
    """The type to name in a message; for a value that stayed in the student's kernel (a
    handle of the trusted runner), the student's own type, said to be not plain data."""
    kind = _type(value)
    if _getattr(kind, "_autograder_remote", False) is True:
        return f"{object.__getattribute__(value, '_type')} (not a plain value)"
    return kind.__name__


def _fail(name: str, message: str) -> None:
    _STATS["failed"] += 1
    raise _AssertionError(f"[{name}] {message}")


def _begin() -> None:
    _STATS["checks"] += 1
    _guard()


def _as_number(name: str, got: object) -> float:
    # Exact type check: a subclass of float could override comparison or conversion.
    if _type(got) is bool or _type(got) not in _NUMBER_TYPES:
        if _type(got).__module__ == "numpy" and _type(got).__name__.startswith(("float", "int")):
            return _float(got.item())  # numpy scalar: convert through its own item()
        _fail(name, f"expected a number (int or float), got {_name_of(got)}")
    value = _float(got)
    if not _isfinite(value):
        _fail(name, f"expected a finite number, got {value!r}")
    return value


def _fmt(x: float, unit: str = "") -> str:
    """One number format for every message: whole numbers with thousands separators
    (536,870,912), others to 6 significant digits, then the unit if one was given."""
    if _isfinite(x) and x == int(x) and -1e18 < x < 1e18:
        text = f"{int(x):,}"
    else:
        text = f"{x:,.6g}"
    return f"{text} {unit}" if unit else text


def check_close(got: object, expected: float, *, name: str, rel: float = 1e-6,
                abs: float = 0.0, hint: str | None = None,
                mistakes: dict[float, str] | None = None, unit: str = "") -> None:
    """Check a numeric answer within a relative/absolute tolerance.

    ``mistakes`` maps the value a known wrong method produces to a message naming that
    mistake (e.g. query heads used instead of KV heads); a match is reported instead of the
    generic message. ``unit`` ("bytes", "s") is printed after every number.
    """
    _begin()
    value = _as_number(name, got)
    if _isclose(value, expected, rel_tol=rel, abs_tol=abs):
        return
    for wrong, why in (mistakes or {}).items():
        if _isclose(value, wrong, rel_tol=max(rel, 1e-9), abs_tol=abs):
            _fail(name, f"got {_fmt(value, unit)}: {why}")
    extra = f" Hint: {hint}" if hint else ""
    _fail(name, f"expected {_fmt(expected, unit)} (tolerance rel={rel:g}, abs={abs:g}), "
                f"got {_fmt(value, unit)}.{extra}")


def check_equal(got: object, expected: object, *, name: str, hint: str | None = None) -> None:
    """Check an exact answer of a plain type (str, int, bool, tuple/list of those)."""
    _begin()
    _check_equal(got, expected, name=name, hint=hint)


def _check_equal(got: object, expected: object, *, name: str, hint: str | None) -> None:
    # Compare the *expected* value's type first, so a student object's __eq__ is never called.
    if _type(got) is not _type(expected):
        _fail(name, f"expected a {_type(expected).__name__}, got {_name_of(got)}")
    if _isinstance(expected, (list, tuple)):
        if _len(got) != _len(expected):  # type: ignore[arg-type]
            _fail(name, f"expected {_len(expected)} items, got {_len(got)}")  # type: ignore[arg-type]
        for i, (g, e) in _enumerate(_zip(got, expected)):  # type: ignore[call-overload]
            _check_equal(g, e, name=f"{name}[{i}]", hint=hint)
        return
    if _isinstance(expected, dict):
        # Compare keys as sorted reprs and recurse into values, never calling their __eq__.
        keys_e = _sorted(_repr(k) for k in expected)
        keys_g = _sorted(_repr(k) for k in got)  # type: ignore[union-attr]
        if keys_e != keys_g:
            _fail(name, f"expected keys {keys_e}, got {keys_g}")
        by_repr = {_repr(k): v for k, v in got.items()}  # type: ignore[union-attr]
        for k, v in expected.items():
            _check_equal(by_repr[_repr(k)], v, name=f"{name}[{k!r}]", hint=hint)
        return
    if not (expected == got):
        extra = f" Hint: {hint}" if hint else ""
        _fail(name, f"expected {_repr(expected)}, got {_repr(got)}.{extra}")


def check(condition: bool, *, name: str, message: str) -> None:
    """Check a condition the test computed itself; ``message`` says what was expected."""
    _begin()
    if condition is not True:
        _fail(name, message)


def call_each(fn: object, calls: list) -> list:
    """``[fn(*args) for args in calls]``. At grading, where ``fn`` is the learner's function
    reached over the trusted runner's channel, all the calls go in one request, so a seeded
    distribution test of thousands of trials costs one round trip, not thousands."""
    from autograder.runner.channel import call_each as _each
    return _each(fn, calls)


def yours_to_write(obj: object) -> object:
    """Mark ``obj``, an object a test builds and lends to the learner's code, as one that code
    may write into: at grading, its fields as the learner's call left them are copied back
    into it. Objects not marked (a read-only cell's SLO, a reference config) never change,
    whatever the learner's code does to its copy. Returns ``obj``."""
    from autograder.runner.channel import mark_writable as _mark
    return _mark(obj)


def lend(obj: object, methods: tuple[str, ...], attributes: tuple[str, ...] = (),
         live: tuple[str, ...] = ()) -> object:
    """Lend ``obj`` to the learner's code and keep it: at grading the learner's kernel gets a
    stand-in whose ``methods`` and ``attributes`` are served by this object, on the tests'
    side, so what it records (a model's forward passes) is the tests' own count, out of the
    learner's reach. ``live``: list attributes the learner's code reads and writes item by
    item (``cache.lengths[slot] = 0``), each item a call back. Elsewhere (a plain run of the
    notebook) ``obj`` itself. Returns ``obj``."""
    from autograder.kernel_helpers import trusted_runner
    runner = trusted_runner()
    return obj if runner is None else runner.channel.lend(obj, methods, attributes, live=live)


# Code objects of the public helpers, to notice when a submission swaps them out.
_CODE = {f.__name__: f.__code__ for f in (check_close, check_equal, check)}

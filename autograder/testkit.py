"""Assertion helpers for graded notebooks.

Test cells in ``solutions/`` use only these helpers, never bare ``assert`` on student
objects. The helpers capture the builtins they rely on at import time (the first, locked cell
of every graded notebook imports this module before any student code runs), so a
submission that later monkeypatches ``math.isclose`` or defines an ``__eq__`` that is always
true cannot make a wrong answer pass.

Every failure raises ``AssertionError`` whose message names the check, what was expected and,
where a classic mistake is recognised, what the mistake probably was.
"""
from __future__ import annotations

import math as _math

# References captured before any student code runs.
_isclose = _math.isclose
_isfinite = _math.isfinite
_type = type
_isinstance = isinstance
_float = float
_repr = repr
_AssertionError = AssertionError
_NUMBER_TYPES = (int, float)


def _fail(name: str, message: str) -> None:
    raise _AssertionError(f"[{name}] {message}")


def _as_number(name: str, got: object) -> float:
    # Exact type check: a subclass of float could override comparison or conversion.
    if _type(got) is bool or _type(got) not in _NUMBER_TYPES:
        if _type(got).__module__ == "numpy" and _type(got).__name__.startswith(("float", "int")):
            return _float(got.item())  # numpy scalar: convert through its own item()
        _fail(name, f"expected a number (int or float), got {_type(got).__name__}")
    value = _float(got)
    if not _isfinite(value):
        _fail(name, f"expected a finite number, got {value!r}")
    return value


def check_close(got: object, expected: float, *, name: str, rel: float = 1e-6,
                abs: float = 0.0, hint: str | None = None,
                mistakes: dict[float, str] | None = None) -> None:
    """Check a numeric answer within a relative/absolute tolerance.

    ``mistakes`` maps the value a known wrong method produces to a message naming that
    mistake (e.g. query heads used instead of KV heads); a match is reported instead of the
    generic message.
    """
    value = _as_number(name, got)
    if _isclose(value, expected, rel_tol=rel, abs_tol=abs):
        return
    for wrong, why in (mistakes or {}).items():
        if _isclose(value, wrong, rel_tol=max(rel, 1e-9), abs_tol=abs):
            _fail(name, f"got {value:,.6g}: {why}")
    extra = f" Hint: {hint}" if hint else ""
    _fail(name, f"expected {expected:,.6g} (tolerance rel={rel:g}, abs={abs:g}), got {value:,.6g}.{extra}")


def check_equal(got: object, expected: object, *, name: str, hint: str | None = None) -> None:
    """Check an exact answer of a plain type (str, int, bool, tuple/list of those)."""
    # Compare the *expected* value's type first, so a student object's __eq__ is never called.
    if _type(got) is not _type(expected):
        _fail(name, f"expected a {_type(expected).__name__}, got {_type(got).__name__}")
    if _isinstance(expected, (list, tuple)):
        if len(got) != len(expected):  # type: ignore[arg-type]
            _fail(name, f"expected {len(expected)} items, got {len(got)}")  # type: ignore[arg-type]
        for i, (g, e) in enumerate(zip(got, expected)):  # type: ignore[call-overload]
            check_equal(g, e, name=f"{name}[{i}]", hint=hint)
        return
    if not (expected == got):
        extra = f" Hint: {hint}" if hint else ""
        _fail(name, f"expected {_repr(expected)}, got {_repr(got)}.{extra}")


def check(condition: bool, *, name: str, message: str) -> None:
    """Check a condition the test computed itself; ``message`` says what was expected."""
    if condition is not True:
        _fail(name, message)

"""Set-up the tests run in the learner's kernel: called by name, treated as answers.

Some of what a test hands the learner's code must live where that code runs: a KV cache it
fills, the kernel's device, the mirror of the requests a scheduling policy is asked about.
Tests get those through ``in_kernel``: at grading, a call goes to the kernel by a name listed
here (or to a read-only cell's own ``_kernel_...`` function there), never by a name the
template binds, and what comes back is the kernel's, exactly as an answer is (data, or a
handle on an object that stays there). None of these helpers judges anything: the tests
compare what the learner's code returns with their own references, on their own side.
"""
from __future__ import annotations

import importlib
import sys

# name -> "module:attribute" of the helper the kernel runs under that name.
HELPERS = {
    "reference_cache": "autograder.build_checks:reference_cache",
    "call_with_pieces": "autograder.build_checks:call_with_pieces",
    "device_name": "autograder.build_checks:device_name",
    "policy_driver": "autograder.remote_policy:PolicyDriver",
}
NOTEBOOK_PREFIX = "_kernel_"   # read-only cells' own set-up functions, by name


def trusted_runner():
    """The trusted runner running a test in this process, or None (in a kernel, or a plain
    run of the notebook)."""
    trusted = sys.modules.get("autograder.trusted")
    return trusted.current() if trusted is not None else None


def _name_of(fn) -> str:
    path = f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', '')}"
    for name, where in HELPERS.items():
        if where == path:
            return name
    name = getattr(fn, "__name__", "")
    if name.startswith(NOTEBOOK_PREFIX):
        return name
    raise ValueError(f"{path!r} is neither a kernel helper (autograder.kernel_helpers.HELPERS) "
                     f"nor a read-only cell's {NOTEBOOK_PREFIX}... function")


def in_kernel(fn):
    """``fn``, run where the learner's code lives: at grading, each call goes to the
    learner's kernel and returns what the kernel answers; elsewhere ``fn`` itself."""
    name = _name_of(fn)
    runner = trusted_runner()
    if runner is None:
        return fn
    channel = runner.channel

    def call(*args, **kwargs):
        return channel.request("helper", name=name, args=list(args), kwargs=dict(kwargs))
    call.__name__ = name
    return call


def resolve(name: str, user_ns: dict):
    """The kernel's side: the helper ``name`` stands for, or None if it names none."""
    if name in HELPERS:
        module, _, attr = HELPERS[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    if name.startswith(NOTEBOOK_PREFIX):
        return user_ns.get(name)   # the notebook's own, as the learner's code sees it
    return None

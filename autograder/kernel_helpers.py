"""Set-up the tests run in the learner's kernel: called by name, treated as answers.

Some of what a test hands the learner's code must live where that code runs: the mirror of
the requests a scheduling policy is asked about. Tests get it through ``in_kernel``: at
grading, a call goes to the kernel by a name listed here, resolved to a module path of the
grader's own (never a name of the learner's namespace, which the learner could rebind), and
what comes back is the kernel's, exactly as an answer is (data, or a handle on an object
that stays there). None of these helpers judges anything: the tests compare what the
learner's code returns with their own references, on their own side. A build assignment's
kernel holds none of them (it holds no reference: ``autograder.runner.publish``).
"""
from __future__ import annotations

import sys

from autograder.protocol.contract import HELPERS



def trusted_runner():
    """The trusted runner running a test in this process, or None (in a kernel, or a plain
    run of the notebook)."""
    trusted = sys.modules.get("autograder.runner.trusted")
    return trusted.current() if trusted is not None else None


def _name_of(fn) -> str:
    path = f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', '')}"
    for name, where in HELPERS.items():
        if where == path:
            return name
    raise ValueError(f"{path!r} is not a kernel helper (autograder.protocol.contract.HELPERS): a "
                     "test lends what it keeps (testkit.lend) instead")


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


"""What the trusted side and the learner's kernel agree on by name, not by import.

The kernel's code is started by name (an execute request's text, ``python -m``), never
imported by the trusted side, and a build assignment's kernel may import only its own files:
these names are the whole of that contract, in one place, so that a module moved is a name
changed here and a test of each (``tests/test_package_layout.py``) fails if one is missed.
"""
from __future__ import annotations

# The execute requests the runner sends: the channel's far end, and the import hook of a
# kernel that holds no reference (``__import__`` returns the top package, hence the path).
AGENT = "__import__('autograder.kernel.agent').kernel.agent.serve_loop()"
WITHHOLD = "__import__('autograder.kernel.agent').kernel.agent.withhold_reference()"
KERNEL_BOOT = "autograder.kernel.boot"   # python -m, inside the sandbox
# The test helpers, imported in the kernel before any submitted code (so they capture clean
# references); prepended to a test cell that runs in the kernel (the old design, kept for the
# tests that show what it fell for): re-import them and look for tampering; and the
# integrity report asked for after the last cell.
ARM = "import autograder.testkit"
GUARD = ("from autograder.testkit import check_close, check_equal, check; "
         "__import__('autograder.testkit').testkit._guard()\n")
INTEGRITY = "__import__('autograder.testkit').testkit._integrity_report({nonce})"

# The modules of autograder a kernel may import (the others are the grader's), and their
# files, which are all a build assignment's sandbox mounts of autograder.
KERNEL_MODULES = frozenset({"autograder", "autograder.kernel", "autograder.kernel.agent",
                            "autograder.kernel.boot", "autograder.protocol",
                            "autograder.protocol.wire", "autograder.protocol.contract",
                            "autograder.testkit"})
KERNEL_FILES = ("__init__.py", "kernel/__init__.py", "kernel/agent.py", "kernel/boot.py",
                "protocol/__init__.py", "protocol/wire.py", "protocol/contract.py", "testkit.py")

# Top-level packages the grading kernel imports for itself (they are in its sandbox): a
# read-only cell's objects from these cross by import path.
KERNEL_LIBRARIES = frozenset({
    "torch", "numpy", "safetensors", "matplotlib", "math", "json", "collections", "itertools",
    "functools", "random", "typing", "dataclasses", "time", "statistics", "re", "heapq",
    "bisect", "operator", "string", "textwrap", "copy", "enum"})

# Set-up helpers a test may run in the kernel, by name -> "module:attribute" (a module path
# of the grader's own, never a name of the learner's namespace).
HELPERS = {
    "policy_driver": "autograder.remote_policy:PolicyDriver",
}

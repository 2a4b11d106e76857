"""Can this process compile? The CPU fast path's ``torch.compile`` needs what inductor's C++
backend needs: a working C++ compiler, OpenMP for it, and the headers it includes. Many
learners' machines lack one of them (Windows without MSVC, macOS where Apple's clang ships no
OpenMP, slim containers without ``g++`` or without Python's headers). Without them the
first compile fails deep inside inductor; so before the first real compile a process asks
once (:func:`probe`: the compiler looked up, then a tiny compile of the same kind), and
where the answer is no, every loop runs the eager path instead, with one line that names
the cause and the fix for this OS (:meth:`Toolchain.line`). Nothing else changes: the
eager path gives the same tokens, and every chapter runs on it.

CUDA's fast path is its CUDA graphs, captured without any compiler, so it never asks.
"""
from __future__ import annotations

from dataclasses import dataclass
import os
import platform
import sys

import torch

__all__ = ["Toolchain", "announce", "cause_of", "failed", "fix_for", "probe", "ready", "reset"]


@dataclass(frozen=True)
class Toolchain:
    """What :func:`probe` found: ``ok``, else ``cause`` (a short phrase) and ``detail``
    (the first line of the error); ``fix``: what to install on this OS."""
    ok: bool
    cause: str = ""
    detail: str = ""
    fix: str = ""

    def line(self) -> str:
        """One line for a learner: what happened, why, the fix, and that nothing is lost."""
        if self.ok:
            return "fast path: torch.compile works here (a C++ compiler and OpenMP found)"
        return (f"fast path off: {self.cause} ({self.detail}); so every step runs eagerly, "
                f"with the same tokens, and the course works as it is. To turn it on: "
                f"{self.fix}, then restart Python (in a notebook: the kernel).")


def fix_for(cause: str, system: str | None = None) -> str:
    """What to install for ``cause`` on ``system`` (``platform.system()`` by default)."""
    system = system or platform.system()
    if system == "Windows":
        return ("run the course in WSL2 (Ubuntu: sudo apt install g++ python3-dev), or install "
                "Visual Studio Build Tools (C++) and start Jupyter from its Developer prompt")
    if system == "Darwin":
        return ("xcode-select --install for the compiler, and brew install libomp for OpenMP "
                "(Apple's clang ships none)")
    if cause == "no Python headers":
        return "install your Python's headers (Debian/Ubuntu: sudo apt install python3-dev)"
    return ("install a C++ compiler, OpenMP and Python's headers (Debian/Ubuntu: sudo apt "
            "install g++ python3-dev; Fedora: sudo dnf install gcc-c++ python3-devel)")


def cause_of(error: BaseException) -> str:
    """The likeliest missing piece behind a failed compile, in a few words."""
    text = f"{type(error).__name__}: {error}"
    if "InvalidCxxCompiler" in text or "No working C++ compiler" in text \
            or "is not found" in text:
        return "no working C++ compiler"
    output = _output(text)
    if "omp.h" in output or "-fopenmp" in output or "libomp" in output:
        return "no OpenMP for the C++ compiler"
    if "Python.h" in output:
        return "no Python headers"
    if "CppCompileError" in text or "C++ compile error" in text:
        return "the C++ compiler failed"
    return "torch.compile failed here"


def _output(text: str) -> str:
    """The compiler's own output in inductor's error (after its "Output:" line; the command
    line before it names every flag, ``-fopenmp`` included), else the whole text."""
    return text.split("Output:", 1)[1] if "Output:" in text else text


def _first_line(error: BaseException) -> str:
    text = str(error)
    if "Output:" in text:    # what the compiler said, not the command it was given
        said = [line.strip() for line in _output(text).splitlines() if line.strip()]
        if said:
            return said[0] if len(said[0]) <= 160 else said[0][:157] + "..."
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # inductor wraps the real error: its last meaningful line names it
    named = [line for line in lines if "Error" in line or "error:" in line]
    text = (named[-1] if named else lines[0] if lines else type(error).__name__)
    return text if len(text) <= 160 else text[:157] + "..."


def _compile_tiny() -> None:
    """Compile and run a tiny function the way the fast path compiles (inductor, one graph,
    static shapes): a pointwise op and a reduction, so a C++ kernel is built and loaded."""
    def tiny(x: torch.Tensor) -> torch.Tensor:
        return (x * 2.0 + 1.0).relu().sum(dim=-1)
    compiled = torch.compile(tiny, backend="inductor", fullgraph=True, dynamic=False)
    x = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    if not torch.equal(compiled(x), tiny(x)):
        raise RuntimeError("a compiled kernel gave a wrong answer")


_PROBED: Toolchain | None = None
_ANNOUNCED = False


def probe() -> Toolchain:
    """Whether ``torch.compile`` can build CPU kernels in this process: found once (the
    compiler looked up, then :func:`_compile_tiny`, a second or so, from inductor's cache
    after the first time) and remembered. Never raises."""
    global _PROBED
    if _PROBED is not None:
        return _PROBED
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()
        _compile_tiny()
        found = Toolchain(True)
    except Exception as error:   # noqa: BLE001 - any failure means: do not compile here
        torch._dynamo.reset()    # nothing half-compiled is left for the next compile
        cause = cause_of(error)
        found = Toolchain(False, cause, _first_line(error), fix_for(cause))
    _PROBED = found
    return found


def ready(device: torch.device | str = "cpu") -> bool:
    """Whether the fast path may compile on ``device``: on CUDA always (graphs need no
    compiler), elsewhere :func:`probe`'s answer, announced once (:func:`announce`) when no."""
    if torch.device(device).type == "cuda":
        return True
    found = probe()
    if not found.ok:
        announce(found)
    return found.ok


def announce(found: Toolchain) -> None:
    """Print ``found``'s line once a process (a notebook shows it where the fast path was
    first asked for; the loops stay quiet after)."""
    global _ANNOUNCED
    if not _ANNOUNCED:
        _ANNOUNCED = True
        print(found.line(), flush=True)


def failed(error: BaseException) -> Toolchain:
    """Record that a real compile failed with ``error`` (the probe passed, a step's lowering
    did not): from now on this process does not compile, and says so once."""
    global _PROBED
    cause = cause_of(error)
    _PROBED = Toolchain(False, cause, _first_line(error), fix_for(cause))
    announce(_PROBED)
    return _PROBED


def reset() -> None:
    """Forget the answer (tests that change the environment probe again)."""
    global _PROBED, _ANNOUNCED
    _PROBED, _ANNOUNCED = None, False


def _main() -> int:
    """``python -m tinyserve.toolchain``: the probe's line (``make lab`` prints it);
    exit status 0 either way, as the course runs without the fast path."""
    print(probe().line())
    return 0


if __name__ == "__main__":
    sys.exit(_main())

"""The sandbox a submission's kernel runs in.

Grading starts kernels through a kernelspec of ours whose argv is this module. Running on the
host (trusted, usually as root), it hands the connection file to the sandbox user and then
replaces itself with ``bwrap``, which runs ``autograder.kernel.boot`` inside:

- no network namespace (no interfaces but loopback), own PID, IPC and UTS namespaces;
- a filesystem of read-only binds only: the OS (``/usr``), the Python installation, the
  virtual environment and the ``autograder``/``tinyserve`` package sources, plus a tmpfs
  ``/tmp`` and the submission's own run folder (the only writable path). ``solutions/``,
  ``grading/`` and other students' folders simply do not exist in there;
- kernel/boot then sets rlimits (memory, processes, file size, CPU time), drops to an
  unprivileged uid and installs an audit hook before ipykernel starts. The wall-clock limit is
  enforced from outside by the executor.

Per-submission settings travel in the ``AUTOGRADER_SANDBOX`` environment variable (JSON), so
one kernelspec serves every submission.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autograder.protocol.contract import KERNEL_BOOT, KERNEL_FILES

KERNEL_NAME = "tinyserve-sandbox"
BASE_UID = 61000  # sandbox uids are BASE_UID + worker slot, so slots never share a process quota


@dataclass
class Limits:
    memory_mb: int = 3072       # address space; `import torch` alone maps about 0.8 GB
    processes: int = 256        # threads count too (torch and zmq start several)
    file_size_mb: int = 64
    cpu_seconds: int = 300
    open_files: int = 1024
    scratch_mb: int = 256       # size of each tmpfs (/tmp and the working folder; in RAM)


@dataclass
class SandboxSpec:
    run_dir: str                 # the only writable path; holds home/ (cwd) and the audit log
    uid: int = BASE_UID
    limits: Limits = field(default_factory=Limits)
    isolate: bool = True         # False only with --unsafe: no bwrap, limits and audit kept
    # False for a build assignment: tinyserve is not mounted and of autograder only the
    # kernel's own modules are (protocol.contract.KERNEL_FILES): the kernel holds no reference.
    reference: bool = True

    @property
    def home(self) -> str:
        return os.path.join(self.run_dir, "home")

    @property
    def support(self) -> str:
        """Released data files, copied into home by kernel/boot before any student code."""
        return os.path.join(self.run_dir, "support")

    @property
    def ipc(self) -> str:
        return os.path.join(self.run_dir, "ipc")

    @property
    def audit_log(self) -> str:
        """Outside the run folder, so not even mounted in the sandbox: the kernel writes its
        records into a pipe, and only the launcher (outside) writes this file."""
        return os.path.join(os.path.dirname(self.run_dir), "audit.log")

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> "SandboxSpec":
        data = json.loads(text)
        data["limits"] = Limits(**data["limits"])
        return cls(**data)


def package_dirs() -> list[str]:
    """Source folders of the packages graded code may import (never the repository root).

    Found with find_spec, which locates a package without importing it (importing tinyserve
    would import torch, two seconds on every kernel start).
    """
    import importlib.util
    dirs = []
    for name in ("autograder", "tinyserve"):
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(str(Path(location).resolve()))
    return dirs




def kernel_bytecode() -> list[str]:
    """The compiled bytecode of autograder's kernel files (``__pycache__``), where Python looks
    for it first: mounted when present, and never a flag when absent. Not the folder: it holds
    every module's bytecode, the grader's too."""
    import importlib.util
    return [importlib.util.cache_from_source(str(Path(d) / f)) for d in package_dirs()
            if Path(d).name == "autograder" for f in KERNEL_FILES]


def readonly_roots(reference: bool = True) -> list[str]:
    """What the kernel may read: the OS, the Python installation, the venv, package sources
    (without the reference: autograder's kernel files only, and no tinyserve)."""
    roots = {"/usr"}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]):
        roots.add(str(Path(p).resolve()))
    if reference:
        roots.update(package_dirs())
    else:
        roots.update(str(Path(d) / f) for d in package_dirs() if Path(d).name == "autograder"
                     for f in KERNEL_FILES)
    # Drop roots nested in another root.
    return sorted(r for r in roots
                  if not any(r != o and r.startswith(o.rstrip("/") + "/") for o in roots))


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def sandbox_available() -> tuple[bool, str]:
    """Whether bwrap can build our sandbox here; the message says what to do if not."""
    exe = bwrap_path()
    if exe is None:
        return False, ("bubblewrap (bwrap) is not installed: install it with "
                       "`apt-get install bubblewrap` (or `make system-deps` as root)")
    probe = [exe, *_namespace_args(), "--ro-bind", "/", "/", "--proc", "/proc", "true"]
    proc = subprocess.run(probe, capture_output=True, text=True)
    if proc.returncode != 0:
        return False, (f"bwrap is installed but cannot create a sandbox here: "
                       f"{proc.stderr.strip() or proc.returncode}")
    return True, "ok"


def _namespace_args() -> list[str]:
    args = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if os.getuid() != 0:
        args.insert(0, "--unshare-user")  # unprivileged bwrap needs a user namespace
    return args


def bwrap_argv(spec: SandboxSpec, inner: list[str]) -> list[str]:
    exe = bwrap_path()
    assert exe is not None
    argv = [exe, *_namespace_args()]  # the environment is the minimal one launch() passes
    dirs: set[str] = set()

    def ensure_parents(path: str) -> None:
        # bwrap creates missing parents mode 0700 as root; the sandbox user must traverse them.
        parts = Path(path).parts
        for i in range(2, len(parts)):
            d = str(Path(*parts[:i]))
            if d not in dirs:
                dirs.add(d)
                argv.extend(["--perms", "0755", "--dir", d])

    for link in ("lib", "lib64", "bin", "sbin"):
        target = os.readlink(f"/{link}") if os.path.islink(f"/{link}") else None
        if target and not target.startswith("/"):
            argv.extend(["--symlink", target, f"/{link}"])
        elif os.path.isdir(f"/{link}"):
            argv.extend(["--ro-bind", f"/{link}", f"/{link}"])
    # The private /tmp goes first: bwrap applies mounts in order, so a tmpfs mounted after
    # the read-only binds would hide any of them that live under /tmp (a checkout or venv in
    # /tmp, as CI and pytest's tmp_path have).
    size = str(spec.limits.scratch_mb * 2**20)
    argv.extend(["--proc", "/proc", "--dev", "/dev",
                 "--size", size, "--perms", "1777", "--tmpfs", "/tmp"])
    dirs.add("/tmp")
    roots = readonly_roots(spec.reference)
    for root in roots:
        ensure_parents(root)
        argv.extend(["--ro-bind", root, root])
    if not spec.reference:
        # A package installed inside a mounted root (not an editable install) is hidden under
        # an empty tmpfs; autograder's kernel files, mounted one by one, go back on top.
        for d in package_dirs():
            if not any(d.startswith(r.rstrip("/") + "/") for r in roots if not r.endswith(".py")):
                if Path(d).name == "autograder":   # an editable install: its files are mounted
                    for pyc in kernel_bytecode():
                        ensure_parents(pyc)
                        argv.extend(["--ro-bind-try", pyc, pyc])
                continue
            argv.extend(["--tmpfs", d])
            if Path(d).name == "autograder":
                for sub in sorted({str(Path(f).parent) for f in KERNEL_FILES} - {"."}):
                    argv.extend(["--perms", "0755", "--dir", str(Path(d) / sub)])
                for f in KERNEL_FILES:
                    argv.extend(["--ro-bind", str(Path(d) / f), str(Path(d) / f)])
                for pyc in kernel_bytecode():
                    argv.extend(["--ro-bind-try", pyc, pyc])
    for etc in ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf"):
        argv.extend(["--ro-bind-try", etc, etc])
    ensure_parents(spec.run_dir)
    # The run folder is root's: the sandbox user can write only in ipc/ (until the kernel
    # has started, see lock_ipc) and in home, a size-capped tmpfs, so it cannot fill a disk.
    argv.extend(["--bind", spec.run_dir, spec.run_dir,
                 "--size", size, "--perms", "1777", "--tmpfs", spec.home,
                 "--chdir", spec.home])
    if os.getuid() == 0:
        # kernel/boot needs these two to drop to the sandbox uid; it then has no capability.
        argv.extend(["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"])
    return [*argv, "--", *inner]


def kernel_env(spec: SandboxSpec) -> dict[str, str]:
    """The whole environment the kernel sees (nothing of the grader's leaks in)."""
    return {
        "PATH": f"{Path(sandbox_python()).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": spec.home, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "IPYTHONDIR": "/tmp/.ipython", "MPLCONFIGDIR": "/tmp/.mpl", "MPLBACKEND": "Agg",
        "JUPYTER_PLATFORM_DIRS": "1", "JUPYTER_RUNTIME_DIR": "/tmp/.jupyter",
        "PYTHONDONTWRITEBYTECODE": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        "OMP_NUM_THREADS": "1", "TINYSERVE_DEVICE": "cpu",
        "AUTOGRADER_SANDBOX": spec.to_env(),
        "AUTOGRADER_READ_ROOTS": json.dumps(readonly_roots(spec.reference) + (
            [] if spec.reference else kernel_bytecode())),
    }


def write_kernelspec(folder: Path) -> Path:
    """Write our kernelspec into ``folder/KERNEL_NAME`` and return the kernels folder."""
    spec_dir = folder / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sandbox_python(), "-m", "autograder.runner.sandbox", "{connection_file}"],
        "display_name": "tinyserve grading sandbox",
        "language": "python",
        # Signals cannot cross into bwrap's PID namespace reliably; ask ipykernel by message.
        "interrupt_mode": "message",
    }, indent=1))
    return folder


def prepare_run_dir(spec: SandboxSpec) -> None:
    """Lay out the run folder: root-owned, with only ipc/ handed to the sandbox uid.

    The audit log stays root's (0600): kernel/boot opens it before dropping privileges, so
    the submission holds only an append-only descriptor and cannot open it by name.
    """
    for d in (spec.run_dir, spec.home, spec.support, spec.ipc):
        Path(d).mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
    Path(spec.audit_log).touch(mode=0o600)
    if os.getuid() == 0 and spec.isolate:
        os.chown(spec.ipc, spec.uid, spec.uid)
        os.chmod(spec.ipc, 0o700)


def lock_ipc(spec: SandboxSpec) -> None:
    """Once the kernel has bound its sockets, take ipc/ back so it cannot grow files there."""
    if os.getuid() == 0 and spec.isolate:
        os.chown(spec.ipc, 0, 0)
        os.chmod(spec.ipc, 0o755)


AUDIT_FD_ENV = "AUTOGRADER_AUDIT_FD"
MAX_AUDIT_BYTES = 1 << 20


def launch(connection_file: str) -> None:
    """Kernelspec entry point (host side): run the kernel in bwrap (or, with --unsafe,
    straight), and copy its audit records from a pipe into the audit log until it ends.

    The kernel holds only the pipe's write end: it can add records (a forged one only flags
    itself) but never erase one, and closing the pipe early is itself recorded. This
    process stays the kernel's parent, so the kernel dies with it (bwrap's
    --die-with-parent, or PR_SET_PDEATHSIG without bwrap), and it dies with the grader.
    """
    spec = SandboxSpec.from_env(os.environ["AUTOGRADER_SANDBOX"])
    die_with_parent()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - replaced by exec
        os.close(read_end)
        os.set_inheritable(write_end, True)
        die_with_parent()
        _exec_kernel(spec, connection_file, write_end)
    os.close(write_end)
    _copy_audit(read_end, spec.audit_log, pid)
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def sandbox_python() -> str:
    """The interpreter to run inside the sandbox. The mounts are the *resolved* paths of the
    venv, so a venv reached through a symlinked folder must be named by its resolved folder;
    the interpreter itself stays the venv's link (resolving it would leave the venv)."""
    exe = Path(sys.executable)
    return str(exe.parent.resolve() / exe.name)


def _exec_kernel(spec: SandboxSpec, connection_file: str, audit_fd: int) -> None:
    inner = [sandbox_python(), "-m", KERNEL_BOOT, "-f", connection_file]
    env = {**kernel_env(spec), AUDIT_FD_ENV: str(audit_fd)}
    if not spec.isolate:
        os.chdir(spec.home)
        os.execve(inner[0], inner, {**env, "AUTOGRADER_UNSAFE": "1"})
    if os.getuid() == 0:
        os.chown(connection_file, spec.uid, spec.uid)  # jupyter_client writes it 0600 as root
    argv = bwrap_argv(spec, inner)
    os.execve(argv[0], argv, env)


def _copy_audit(fd: int, path: str, kernel_pid: int) -> None:
    written = 0
    with open(path, "ab") as log:
        while chunk := os.read(fd, 65536):
            if written < MAX_AUDIT_BYTES:
                log.write(chunk[:MAX_AUDIT_BYTES - written])
                log.flush()
            written += len(chunk)
        if os.waitpid(kernel_pid, os.WNOHANG) == (0, 0):
            log.write(b'{"event": "tamper", "detail": "the audit pipe was closed while the '
                      b'kernel ran"}\n')
    os.close(fd)


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (PR_SET_PDEATHSIG). The sandbox's
    own processes call it, and so does pipeline.worker (a dead coordinator takes its workers)."""
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def sandbox_processes(uid: int, marker: str) -> list[str]:
    """Command lines of the processes in one sandbox: those running as ``uid`` in the PID
    namespace of the process whose command line holds ``marker`` (its run folder). Other
    graders on the host may use the same uid; they live in other namespaces."""
    procs = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(x for x in status.read_text().splitlines() if x.startswith("Uid:"))
            if int(uid_line.split()[1]) != uid:
                continue
            cmd = (status.parent / "cmdline").read_bytes().replace(b"\0", b" ")
            procs.append((cmd.decode(errors="replace")[:200],
                          os.readlink(status.parent / "ns" / "pid")))
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    namespaces = {ns for cmd, ns in procs if marker in cmd}
    return [cmd for cmd, ns in procs if ns in namespaces]


if __name__ == "__main__":
    launch(sys.argv[1])

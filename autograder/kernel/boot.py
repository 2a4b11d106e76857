"""Kernel start-up inside the sandbox: limits, privilege drop, audit hook, then ipykernel.

Runs before any submitted code. The audit hook is CPython's (PEP 578): once installed it
cannot be removed, so every file a submission opens, every process it tries to start and
every connection it tries to make is seen. Process creation is refused outright (a fork bomb
gets a PermissionError, not a fork); file opens outside the allowed roots and network attempts
are recorded through a pipe to the launcher outside the sandbox (autograder.runner.sandbox.launch),
which writes the audit log the grader reads after the kernel stops and turns into review
flags.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import sys

_BLOCKED = ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
            "subprocess.Popen", "pty.spawn")
_RECORDED = ("socket.connect", "socket.bind", "socket.sendto", "sys.addaudithook",
             "os.kill", "os.killpg")
# platform.* asks `uname` at start-up; refused like any process, but not worth a flag.
# Still refused, but not flagged: libraries probe these on their own. platform calls uname;
# matplotlib asks fc-list for system fonts the first time it builds its font cache, and on
# refusal scans the font folders itself, so a learner's plot still draws.
_QUIET_PROGRAMS = ("uname", "fc-list")
_MAX_RECORDS = 200


def _set_limits(limits: dict) -> None:
    mb = 1024 * 1024
    # (scratch_mb is the tmpfs size, applied by bwrap)
    # RLIMIT_DATA as well as RLIMIT_AS: the grading worker, this kernel's ancestor, sets a
    # soft data limit of its own (worker.limit_worker), which must not become the kernel's.
    for res, value in ((resource.RLIMIT_AS, limits["memory_mb"] * mb),
                       (resource.RLIMIT_DATA, limits["memory_mb"] * mb),
                       (resource.RLIMIT_NPROC, limits["processes"]),
                       (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb),
                       (resource.RLIMIT_CPU, limits["cpu_seconds"]),
                       (resource.RLIMIT_NOFILE, limits["open_files"]),
                       (resource.RLIMIT_CORE, 0)):
        # soft == hard: an unprivileged process can lower its limits but never raise them.
        resource.setrlimit(res, (value, value))


def _drop_privileges(uid: int) -> None:
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if os.getuid() == 0 or os.geteuid() == 0:  # pragma: no cover - defensive
            raise SystemExit("could not drop root inside the sandbox")


def _install_audit_hook(log_fd: int, log_path: str, allowed: list[str]) -> None:
    log_real = os.path.realpath(log_path)
    prefixes = tuple(p.rstrip("/") + "/" for p in allowed)
    exact = {p.rstrip("/") for p in allowed}
    state = {"records": 0, "busy": False}
    isinstance_, str_, bytes_ = isinstance, str, bytes
    fspath, abspath, getcwd = os.fspath, os.path.abspath, os.getcwd
    write, dumps = os.write, json.dumps

    def record(event: str, detail: str) -> None:
        if state["records"] >= _MAX_RECORDS:
            return
        state["records"] += 1
        try:
            write(log_fd, (dumps({"event": event, "detail": detail[:300]}) + "\n").encode())
        except OSError:
            pass

    def allowed_path(path: str) -> bool:
        return path in exact or path.startswith(prefixes)

    def hook(event: str, args: tuple) -> None:
        if state["busy"]:
            return
        state["busy"] = True
        try:
            if event == "open":
                target = args[0]
                if isinstance_(target, int):
                    return
                if isinstance_(target, bytes_):
                    target = target.decode("utf-8", "replace")
                target = abspath(fspath(target)) if not str_(target).startswith("/") \
                    else abspath(target)
                if target == log_real:
                    record("tamper", f"opened the audit log {target}")
                    raise PermissionError("the grading audit log is off limits")
                if not allowed_path(target):
                    record("open", target)
            elif event in ("os.remove", "os.rename", "os.truncate", "os.chmod", "os.chown"):
                target = args[0]
                if isinstance_(target, (str_, bytes_)) and os.path.realpath(target) == log_real:
                    record("tamper", f"{event} on the audit log")
                    raise PermissionError("the grading audit log is off limits")
            elif event.startswith(_BLOCKED):
                program = os.path.basename(str_(args[0])) if args else ""
                if program not in _QUIET_PROGRAMS:
                    record("process", f"{event} {str_(args[:1])[:200]}")
                raise PermissionError(f"starting processes is not allowed while grading ({event})")
            elif event in ("os.kill", "os.killpg"):
                # ipykernel interrupts itself by signal (message-mode interrupts): not a flag.
                if args and args[0] not in (os.getpid(), 0):
                    record(event, str_(args[:2])[:200])
            elif event in _RECORDED:
                record(event, str_(args[:2])[:200])
            elif event == "ctypes.dlopen":
                name = args[0]
                if isinstance_(name, str_) and name.startswith("/") and not allowed_path(name):
                    record("open", name)
        finally:
            state["busy"] = False

    sys.addaudithook(hook)


def main() -> None:
    spec = json.loads(os.environ["AUTOGRADER_SANDBOX"])
    allowed = json.loads(os.environ.get("AUTOGRADER_READ_ROOTS", "[]"))
    run_dir = spec["run_dir"]
    home = os.path.join(run_dir, "home")
    allowed += [home, os.path.join(run_dir, "ipc"), os.path.join(run_dir, "kernel.json"),
                "/tmp", "/dev", "/proc", "/sys", "/etc/ld.so.cache", "/etc/localtime",
                "/usr", "/lib", "/lib64", "/bin"]
    log_path = os.path.join(os.path.dirname(run_dir), "audit.log")  # not even mounted here
    # The write end of the launcher's pipe (autograder.runner.sandbox.launch): records go out of
    # the sandbox as they happen, and nothing in here can take one back.
    log_fd = int(os.environ.pop("AUTOGRADER_AUDIT_FD"))
    # Still root here (inside the sandbox, with no capability but setuid/setgid): copy the
    # released data files into the tmpfs home, then drop.
    shutil.copytree(os.path.join(run_dir, "support"), home, dirs_exist_ok=True)
    # copytree copied support/'s mode (root's 0755) onto home: give the tmpfs back its
    # sticky, world-writable mode, or the submission could not write a file in its folder.
    os.chmod(home, 0o1777)
    _set_limits(spec["limits"])
    if spec.get("isolate", True):
        _drop_privileges(spec["uid"])
    os.chdir(home)
    _install_audit_hook(log_fd, log_path, allowed)
    for key in ("AUTOGRADER_SANDBOX", "AUTOGRADER_READ_ROOTS"):
        os.environ.pop(key, None)
    from ipykernel.kernelapp import launch_new_instance
    launch_new_instance(argv=sys.argv[1:])


if __name__ == "__main__":
    main()

"""A whole class, simulated, on this machine: the hub's start-up per user, collection and
grading throughput, peak memory. Run as root, on a quiet machine (the 40-student run took
over 50 minutes on a 2-core machine at load 15):

    .venv/bin/python hub/scale_run.py --students 40 --workers 2 \
        --json bench/results/hub_class.json

What it does, with the same pieces as `make hub` and tests/test_hub.py:
  1. accounts tsh-class-teacher and tsh-s01..tsh-sNN (hub/setup_class.py), a hub on a free
     loopback port with a REST API token;
  2. the instructor releases kv_cache_basics to the exchange;
  3. every student's JupyterLab is started through the REST API, all at once as a class
     arriving would; start-up time per user is request -> ready;
  4. each student fetches the assignment and submits the *solution* with one of several
     mistakes (none, the missing factor 2, a blank answer, an exception), with nbgrader's own
     commands as that account;
  5. the instructor collects from the exchange and autogrades (sandboxed unless --unsafe) with
     N workers; feedback is returned;
  6. memory: the summed RSS of the hub, its proxy and every class account's processes,
     sampled each second, peak reported.
Everything it starts is stopped at the end; the accounts stay (their homes are emptied).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import pwd
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from teardown import account_processes, kill_leftovers, stop_hub  # hub/, this script's folder

REPO = Path(__file__).resolve().parents[1]
# Its own accounts, none shared with tests/test_hub.py (whose hub empties its users' homes
# and ends their processes): a test hub on the same machine cannot touch this run.
INSTRUCTOR = "tsh-class-teacher"
NAME = "kv_cache_basics"
RIGHT = "return 2 * layers * tokens * kv_heads * head_dim * bytes_per_elem"
MISTAKES = {   # what replaces the solution's 1a line, in turn across the class
    "none": RIGHT,
    "factor_2_missing": "return layers * tokens * kv_heads * head_dim * bytes_per_elem",
    "blank": "raise NotImplementedError()",
    "exception": "return 1 / 0",
}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_user(user: str, hub_dir: Path, python: str, *args: str, cwd: Path | None = None
            ) -> subprocess.CompletedProcess:
    entry = pwd.getpwnam(user)
    role = "instructor" if user == INSTRUCTOR else "student"
    env = {"HOME": entry.pw_dir, "USER": user, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
           "PATH": os.pathsep.join([str(Path(python).parent), "/usr/bin", "/bin"]),
           "JUPYTER_CONFIG_PATH": os.pathsep.join([str(REPO / "hub" / "nbgrader"),
                                                   str(REPO / ".jupyter" / "roles" / role)]),
           "TINYSERVE_EXCHANGE": str(hub_dir / "exchange")}
    if role == "instructor":
        env["TINYSERVE_COURSE"] = str(Path(entry.pw_dir) / "tinyserve")
    proc = subprocess.run([python, *args], user=entry.pw_uid, group=entry.pw_gid,
                          extra_groups=[], env=env, capture_output=True, text=True,
                          cwd=cwd or env.get("TINYSERVE_COURSE", entry.pw_dir), timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{user}: {args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


class Memory(threading.Thread):
    """Each second: summed RSS (MiB) of the given pids' children and the given accounts'
    processes (peak kept), the largest single kernel's and server's RSS, the load average."""

    def __init__(self, uids: set[int], roots: list[int], course: str = "") -> None:
        super().__init__(daemon=True)
        self.uids, self.roots, self.peak_mib, self.stop = uids, roots, 0.0, threading.Event()
        # Grading kernels run as the sandbox's own uids; their command line names the course.
        self.course = course.encode()
        self.kernel_mib = self.server_mib = 0.0
        self.loads: list[float] = []   # 1-minute load average, one per second

    def sample(self) -> float:
        total = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            uid = int(fields.get("Uid", "0").split()[0])
            ppid = int(fields.get("PPid", "0").strip())
            if uid in self.uids or int(entry.name) in self.roots or ppid in self.roots \
                    or (self.course and self._names_course(entry)):
                rss = int(fields.get("VmRSS", "0 kB").split()[0])
                total += rss
                self._largest(entry, rss / 1024)
        return total / 1024

    def _names_course(self, entry: Path) -> bool:
        try:
            return self.course in (entry / "cmdline").read_bytes()
        except OSError:
            return False

    def _largest(self, entry: Path, rss_mib: float) -> None:
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            return
        if b"ipykernel" in cmd or b"kernel_boot" in cmd:   # a Lab kernel or a grading one
            self.kernel_mib = max(self.kernel_mib, rss_mib)
        elif b"jupyterhub.singleuser" in cmd:
            self.server_mib = max(self.server_mib, rss_mib)

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak_mib = max(self.peak_mib, self.sample())
            self.loads.append(os.getloadavg()[0])
            self.stop.wait(1.0)


def api(url: str, token: str, method: str, path: str) -> dict:
    req = urllib.request.Request(f"{url}/hub/api{path}", method=method,
                                 headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read()
    return json.loads(text) if text else {}


def submit_with_mistake(student: str, hub_dir: Path, python: str, mistake: str) -> None:
    as_user(student, hub_dir, python, "-m", "nbgrader", "fetch_assignment", NAME)
    target = Path(pwd.getpwnam(student).pw_dir) / NAME / f"{NAME}.ipynb"
    solution = (REPO / "solutions" / NAME / f"{NAME}.ipynb").read_text()
    target.write_text(solution.replace(RIGHT, MISTAKES[mistake]))   # as root: hand it back
    entry = pwd.getpwnam(student)
    os.chown(target, entry.pw_uid, entry.pw_gid)
    as_user(student, hub_dir, python, "-m", "nbgrader", "submit", NAME)


def start_hub(students: list[str], report: dict) -> tuple[Path, str, str, subprocess.Popen]:
    """hub/setup_class.py, then the hub on free loopback ports; returns once its API answers."""
    hub_dir = Path(tempfile.mkdtemp(prefix="tsh-class-"))
    subprocess.run([sys.executable, str(REPO / "hub" / "setup_class.py"), "--hub-dir",
                    str(hub_dir), "--instructor", INSTRUCTOR, "--students", ",".join(students),
                    f"--password={secrets.token_urlsafe(12)}", "--empty-homes"],
                   check=True, capture_output=True)
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, TINYSERVE_HUB_DIR=str(hub_dir), TINYSERVE_INSTRUCTOR=INSTRUCTOR,
               TINYSERVE_STUDENTS=",".join(students), TINYSERVE_HUB_PORT=str(port),
               TINYSERVE_PROXY_API_PORT=str(free_port()),
               TINYSERVE_HUB_API_PORT=str(free_port()), TINYSERVE_HUB_TOKEN=token,
               # A whole class asking at once on 2 busy cores: each Lab waits for CPU.
               TINYSERVE_SPAWN_TIMEOUT="1200")
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    hub = subprocess.Popen([str(Path(sys.executable).parent / "jupyterhub"), "-f",
                            str(REPO / "hub" / "jupyterhub_config.py")], cwd=hub_dir / "state",
                           env=env, stdout=open(hub_dir / "state" / "hub.log", "wb"),
                           stderr=subprocess.STDOUT, start_new_session=True)
    while True:
        try:
            api(url, token, "GET", "/")
            break
        except OSError:
            if hub.poll() is not None or time.monotonic() - t0 > 300:
                raise RuntimeError("the hub did not start; see " + str(hub_dir / "state"))
            time.sleep(0.5)
    report["hub_start_s"] = round(time.monotonic() - t0, 1)
    return hub_dir, url, token, hub


def class_arrives(url: str, token: str, students: list[str], report: dict) -> None:
    """Every server requested at once, as a class arriving does; each timed to ready."""
    asked = {}

    def ask(s: str) -> None:   # the hub answers a POST only after slow_spawn_timeout (10 s)
        asked[s] = time.monotonic()
        api(url, token, "POST", f"/users/{s}/server")

    with ThreadPoolExecutor(max_workers=len(students)) as pool:
        list(pool.map(ask, students))
    ready: dict[str, float] = {}
    failed: list[str] = []
    while len(ready) + len(failed) < len(students):
        time.sleep(1)
        now = time.monotonic()
        for user in api(url, token, "GET", "/users?limit=1000"):   # one request a second
            name, server = user["name"], user.get("servers", {}).get("")
            if name not in asked or name in ready or name in failed:
                continue
            if server and server.get("ready"):
                ready[name] = now - asked[name]
            elif not server:     # neither pending nor ready: the spawn failed
                failed.append(name)
        if now - min(asked.values()) > 1500:
            raise RuntimeError(f"only {len(ready)} of {len(students)} servers started")
    if failed:
        raise RuntimeError(f"servers that failed to start: {failed}; see the hub's log")
    times = sorted(ready.values())
    report["server_start_s"] = {"min": round(times[0], 1),
                                "p50": round(statistics.median(times), 1),
                                "p95": round(times[int(0.95 * (len(times) - 1))], 1),
                                "max": round(times[-1], 1)}


def grade(python: str, hub_dir: Path, students: list[str], args: argparse.Namespace,
          report: dict, save) -> None:
    """Collect, grade with N workers (then a sample with 1 worker), return feedback."""
    ag = ["-m", "autograder"]
    safe = ["--unsafe"] if args.unsafe else []
    t = time.monotonic()
    as_user(INSTRUCTOR, hub_dir, python, *ag, "collect", NAME, "--from-exchange")
    report["collect_s"] = round(time.monotonic() - t, 1)
    save()
    t = time.monotonic()
    out = as_user(INSTRUCTOR, hub_dir, python, *ag, "autograde", NAME, "--no-progress",
                  "--workers", str(args.workers), *safe).stdout
    grading_s = time.monotonic() - t
    report["grading"] = [{"workers": args.workers, "notebooks": len(students),
                          "seconds": round(grading_s, 1),
                          "notebooks_per_minute": round(len(students) / grading_s * 60, 1)}]
    report["graded_lines"] = out.strip().splitlines()[:6]
    save()
    if args.one_worker_sample and args.workers != 1:
        # The same grading again on a sample, one worker: what the second worker buys.
        sample = students[:args.one_worker_sample]
        t = time.monotonic()
        as_user(INSTRUCTOR, hub_dir, python, *ag, "autograde", NAME, "--no-progress",
                "--workers", "1", *safe, *[a for s in sample for a in ("--student", s)])
        s1 = time.monotonic() - t
        report["grading"].append({"workers": 1, "notebooks": len(sample),
                                  "seconds": round(s1, 1),
                                  "notebooks_per_minute": round(len(sample) / s1 * 60, 1)})
        save()
    t = time.monotonic()
    as_user(INSTRUCTOR, hub_dir, python, *ag, "feedback", NAME, "--return")
    report["feedback_return_s"] = round(time.monotonic() - t, 1)


def stop_everything(url: str, token: str, students: list[str], hub: subprocess.Popen,
                    uids: set[int]) -> list[int]:
    """Each server stopped through the API (kernels first), then the hub; returns the pids
    of the class's accounts that had to be killed (none when all went well)."""
    for s in students:
        try:
            api(url, token, "DELETE", f"/users/{s}/server")
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 180
    while account_processes(uids) and time.monotonic() < deadline:
        time.sleep(1)
    stop_hub(hub, timeout=120)
    return list(kill_leftovers(uids))   # started by this run, as the class's accounts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--students", type=int, default=40)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--one-worker-sample", type=int, default=8,
                   help="regrade this many with 1 worker too (0: skip)")
    p.add_argument("--unsafe", action="store_true", help="grade without the sandbox")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "hub_class.json")
    args = p.parse_args(argv)
    if os.getuid() != 0:
        sys.exit("error: the class run creates accounts and switches to them: run it as root")
    students = [f"tsh-s{i:02d}" for i in range(1, args.students + 1)]
    report: dict = {"students": len(students), "workers": args.workers,
                    "sandboxed": not args.unsafe, "cpus": os.cpu_count(),
                    "machine": platform.platform(), "load_avg_before": os.getloadavg()}

    def save() -> None:   # after every phase: a run cut short still leaves its figures
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")

    def on_term(signum, frame):   # `timeout` sends SIGTERM: stop the class, keep the figures
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    hub_dir, url, token, hub = start_hub(students, report)
    python = (hub_dir / "state" / "user_python").read_text().strip()
    uids = {pwd.getpwnam(u).pw_uid for u in [INSTRUCTOR, *students]}
    memory = Memory(uids, [hub.pid], str(Path(pwd.getpwnam(INSTRUCTOR).pw_dir) / "tinyserve"))
    memory.start()
    phase = {}
    try:
        as_user(INSTRUCTOR, hub_dir, python, "-m", "autograder", "release-exchange", NAME)
        t = time.monotonic()
        class_arrives(url, token, students, report)
        save()
        phase["class_arrives"] = time.monotonic() - t
        time.sleep(5)   # settled: every server idle
        report["rss_mib_all_servers_idle"] = round(memory.sample())
        report["rss_mib_largest_idle_server"] = round(memory.server_mib)

        kinds = list(MISTAKES)
        t = time.monotonic()
        for i, s in enumerate(students):
            submit_with_mistake(s, hub_dir, python, kinds[i % len(kinds)])
        report["submit_s_per_student"] = round((time.monotonic() - t) / len(students), 2)
        save()
        grade(python, hub_dir, students, args, report, save)
    finally:
        memory.stop.set()
        report["peak_rss_mib"] = round(memory.peak_mib)
        report["rss_mib_largest_kernel"] = round(memory.kernel_mib)
        killed = stop_everything(url, token, students, hub, uids)
        report["processes_killed_at_the_end"] = len(killed)
        loads = memory.loads or [0.0]
        report["load_avg_1min_during"] = {"mean": round(statistics.mean(loads), 2),
                                          "max": round(max(loads), 2)}
        report["note"] = (f"{os.cpu_count()} cores shared with other jobs (1-minute load "
                          f"average above): figures are pessimistic for a dedicated server")
        shutil.rmtree(hub_dir, ignore_errors=True)
        save()
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

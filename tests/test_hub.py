"""The class hub with real Unix accounts: hub/setup_class.py and hub/jupyterhub_config.py
(what `make hub` runs), then the whole flow through nbgrader's exchange as the instructor and
two students, each command run as that account; and what one student can and cannot read.

Needs root (accounts, switching users), jupyterhub and its proxy (`make hub-deps`); elsewhere
these tests skip saying why, except in CI (we are root there), where a missing piece fails.
One hub for the whole session (tests/conftest.py's `class_hub`; the hub browser test shares
it), a fresh class for each module (empty homes, a new course copy, an empty exchange), one
student server started through the REST API; every process is stopped at the end of each
module and of the session, and checked gone (the grading kernels included: grading runs in
the sandbox, as the instructor's unprivileged account). About 3 minutes on a busy 2-core
machine, most of it the release, one student's JupyterLab starting and the grading of two
notebooks.
"""
from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hub.teardown import account_processes, kill_leftovers, stop_hub

from tinyserve.serving.local_servers import free_port

ROOT = Path(__file__).resolve().parents[1]
CHP = ROOT / "hub" / "node_modules" / ".bin" / "configurable-http-proxy"
INSTRUCTOR, ADA, BOB = "tsh-teacher", "tsh-ada", "tsh-bob"
CLASS = [INSTRUCTOR, ADA, BOB]
NAME = "kv_cache_basics"
ANSWER = "return 2 * layers * tokens * kv_heads * head_dim * bytes_per_elem"
SLIP = "return layers * tokens * kv_heads * head_dim * bytes_per_elem"


def skip_reason() -> str | None:
    if os.getuid() != 0:
        return "needs root: creates Unix accounts and runs commands as them (CI is root)"
    if shutil.which("jupyterhub", path=str(Path(sys.executable).parent)) is None:
        return "needs jupyterhub in this venv: pip install -e '.[test]' (make test)"
    if not CHP.exists():
        return "needs JupyterHub's proxy from npm: make hub-deps"
    if shutil.which("useradd") is None:
        return "needs useradd (shadow utils) to create the class's accounts"
    return None


REASON = skip_reason()
if REASON and os.environ.get("CI"):
    pytest.fail(f"the hub tests cannot run in CI: {REASON}", pytrace=False)
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@dataclass
class Hub:
    url: str
    token: str
    dir: Path
    proc: subprocess.Popen
    log: Path
    password: str

    @property
    def python(self) -> str:
        """The Python the class's accounts run (hub/setup_class.py's user_python)."""
        return (self.dir / "state" / "user_python").read_text().strip()

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(f"{self.url}/hub/api{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"},
                                     data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
        return json.loads(text) if text else {}

    def get(self, path: str) -> tuple[int, str]:
        req = urllib.request.Request(f"{self.url}{path}",
                                     headers={"Authorization": f"token {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, ""


def home(user: str) -> Path:
    return Path(pwd.getpwnam(user).pw_dir)


def as_user(user: str, hub_dir: Path, *cmd: str, check: bool = True, cwd: Path | None = None
            ) -> subprocess.CompletedProcess:
    """Run ``cmd`` as ``user`` with the environment the hub's spawner gives their Lab (so the
    same nbgrader config): what they would type in their Lab's terminal."""
    entry = pwd.getpwnam(user)
    role = "instructor" if user == INSTRUCTOR else "student"
    env = {"HOME": entry.pw_dir, "USER": user, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
           "PATH": os.pathsep.join([str(Path(cmd[0]).parent), "/usr/bin", "/bin"]),
           "JUPYTER_CONFIG_PATH": os.pathsep.join([str(ROOT / "hub" / "nbgrader"),
                                                   str(ROOT / ".jupyter" / "roles" / role)]),
           "TINYSERVE_EXCHANGE": str(hub_dir / "exchange")}
    if role == "instructor":
        env["TINYSERVE_COURSE"] = str(home(user) / "tinyserve")
    if cwd is None:   # where their Lab's terminal opens: the course, or home
        cwd = Path(env.get("TINYSERVE_COURSE", entry.pw_dir))
    proc = subprocess.run(list(cmd), user=entry.pw_uid, group=entry.pw_gid, extra_groups=[],
                          env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    if check:
        assert proc.returncode == 0, f"{user}: {cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def user_processes(users: list[str]) -> dict[int, str]:
    """The running processes of these accounts: pid -> command line."""
    return account_processes(pwd.getpwnam(u).pw_uid for u in users)


def setup_class(hub_dir: Path, password: str) -> None:
    """hub/setup_class.py, as `make hub` runs it (accounts, exchange, the instructor's course),
    with the accounts' homes emptied first: no earlier module's work stays."""
    # --password=VALUE: a password may begin with "-", which argparse would take for an
    # option if it came as the next argument.
    done = subprocess.run([sys.executable, str(ROOT / "hub" / "setup_class.py"), "--hub-dir",
                           str(hub_dir), "--instructor", INSTRUCTOR, "--students", f"{ADA},{BOB}",
                           f"--password={password}", "--empty-homes"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"setup_class.py failed:\n{done.stdout}\n{done.stderr}"


def stop_servers(h: Hub) -> dict[int, str]:
    """Every class server stopped as the hub does it (kernels first); returns the class's
    processes still running after a grace period (none when all went well)."""
    for user in CLASS:
        try:
            h.api("DELETE", f"/users/{user}/server")
        except (OSError, ValueError):
            pass   # not running, or the hub never came up
    deadline = time.monotonic() + 90
    while user_processes(CLASS) and time.monotonic() < deadline:
        time.sleep(0.5)
    return user_processes(CLASS)


@contextlib.contextmanager
def running_class_hub() -> Iterator[Hub]:
    """`make hub`'s two steps on a fresh folder and free loopback ports; stopped afterwards,
    with every process of the class's accounts checked gone. tests/conftest.py's `class_hub`
    holds one for the session: this module and the hub browser test share it."""
    hub_dir = Path(tempfile.mkdtemp(prefix="tsh-hub-"))
    # Always led by "-": token_urlsafe gives one in 64 such passwords, and one broke the
    # command line of setup_class.py in CI; leading with it keeps that case tested every run.
    password = "-" + secrets.token_urlsafe(12)
    setup_class(hub_dir, password)
    port = free_port()
    token = secrets.token_hex(16)
    env = dict(os.environ, TINYSERVE_HUB_DIR=str(hub_dir), TINYSERVE_INSTRUCTOR=INSTRUCTOR,
               TINYSERVE_STUDENTS=f"{ADA},{BOB}", TINYSERVE_HUB_PORT=str(port),
               TINYSERVE_PROXY_API_PORT=str(free_port()), TINYSERVE_HUB_API_PORT=str(free_port()),
               TINYSERVE_HUB_TOKEN=token)
    log = hub_dir / "state" / "hub.log"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "jupyterhub"), "-f",
                             str(ROOT / "hub" / "jupyterhub_config.py")],
                            cwd=hub_dir / "state", env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    h = Hub(f"http://127.0.0.1:{port}", token, hub_dir, proc, log, password)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the hub exited:\n" + log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the hub did not answer:\n" + log.read_text()[-3000:]
            try:
                h.api("GET", "/")
                break
            except OSError:
                time.sleep(0.2)
        yield h
    finally:
        stop_servers(h)
        stop_hub(proc, timeout=60)
        # started by these tests (as the class's accounts): end them, and fail below
        left = kill_leftovers(pwd.getpwnam(u).pw_uid for u in CLASS)
        # The hub's log (its users' servers log there too) outlives the folder, for a failure.
        (ROOT / "artifacts").mkdir(exist_ok=True)
        shutil.copy(log, ROOT / "artifacts" / "hub-test.log")
        shutil.rmtree(hub_dir, ignore_errors=True)
        assert not left, f"processes of the class's accounts outlived the hub: {left}"


@pytest.fixture(scope="module")
def hub(class_hub: Hub) -> Iterator[Hub]:
    """The session's hub with a fresh class for this module: no server running, empty homes,
    a new copy of the course (gradebook included) and an empty exchange, as after `make hub`.
    Every server the module started is stopped, and its processes checked gone, at the end."""
    left = stop_servers(class_hub)
    assert not left, f"a previous module left processes of the class's accounts: {left}"
    shutil.rmtree(class_hub.dir / "exchange", ignore_errors=True)
    setup_class(class_hub.dir, class_hub.password)
    yield class_hub
    left = stop_servers(class_hub)
    assert not left, f"processes of the class's accounts outlived the module: {left}"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None


def log_in(hub: Hub, user: str, password: str) -> tuple[int, str]:
    """The login form, as a browser posts it (with its _xsrf field): (status, redirect)."""
    import http.cookiejar
    import urllib.parse
    opener = urllib.request.build_opener(
        urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()), _NoRedirect)
    form = opener.open(f"{hub.url}/hub/login", timeout=30).read().decode()
    xsrf = re.search(r'name="_xsrf"[^>]*value="([^"]+)"', form).group(1)
    body = urllib.parse.urlencode({"username": user, "password": password,
                                   "_xsrf": xsrf}).encode()
    try:
        with opener.open(f"{hub.url}/hub/login", data=body, timeout=60) as r:
            return r.status, ""
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Location", "")


def test_the_class_logs_in_with_its_unix_passwords_and_no_one_else(hub: Hub) -> None:
    status, where = log_in(hub, ADA, hub.password)
    assert status == 302 and where.startswith("/hub/"), (status, where)
    assert log_in(hub, ADA, hub.password + "x")[0] == 403
    # root is a Unix account too, but not one of the class's
    assert log_in(hub, "root", hub.password)[0] == 403


@pytest.fixture(scope="module")
def released(hub: Hub) -> Hub:
    """The instructor has released kv_cache_basics to the exchange (from their terminal)."""
    out = as_user(INSTRUCTOR, hub.dir, hub.python, "-m", "autograder", "release-exchange",
                  NAME).stdout
    assert str(hub.dir / "exchange" / "tinyserve" / "outbound" / NAME) in out, out
    return hub


def edit_and_submit(user: str, hub: Hub, answer: str) -> None:
    """A student's fetch, edit and submit, with nbgrader's own commands (what the Assignments
    tab runs on the server)."""
    if not (home(user) / NAME).exists():
        as_user(user, hub.dir, hub.python, "-m", "nbgrader", "fetch_assignment", NAME)
    path = home(user) / NAME / f"{NAME}.ipynb"
    text = path.read_text()
    as_user(user, hub.dir, hub.python, "-c", (
        "import nbformat, sys; p = sys.argv[1]; nb = nbformat.read(p, as_version=4); "
        "c = next(c for c in nb.cells if 'def kv_bytes(' in c.source); "
        "c.source = 'def kv_bytes(layers, tokens, kv_heads, head_dim, bytes_per_elem):\\n    ' "
        "+ sys.argv[2]; nbformat.write(nb, p)"), str(path), answer)
    assert path.read_text() != text
    as_user(user, hub.dir, hub.python, "-m", "nbgrader", "submit", NAME)


def test_a_students_lab_from_the_hub_has_the_assignments_tab_not_the_instructors_tools(
        released: Hub) -> None:
    hub = released
    hub.api("POST", f"/users/{ADA}/server")
    deadline = time.monotonic() + 240
    while not hub.api("GET", f"/users/{ADA}")["servers"].get("", {}).get("ready"):
        assert time.monotonic() < deadline, "ada's server did not start:\n" \
            + hub.log.read_text()[-3000:]
        time.sleep(1)
    status, page = hub.get(f"/user/{ADA}/lab")
    assert status == 200
    config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page,
                                  re.S).group(1))
    assert "@jupyter/nbgrader:formgrader" in config["disabledExtensions"]
    assert "@jupyter/nbgrader:create-assignment" in config["disabledExtensions"]
    assert "@jupyter/nbgrader:assignment-list" not in config["disabledExtensions"]
    assert hub.get(f"/user/{ADA}/formgrader")[0] == 404
    # The Assignments tab's own request: the released assignment, from the exchange.
    status, body = hub.get(f"/user/{ADA}/assignments?course_id=tinyserve")
    assert status == 200, body
    listed = json.loads(body)
    assert listed["success"], listed
    assert [(a["assignment_id"], a["status"]) for a in listed["value"]] == [(NAME, "released")]
    hub.api("DELETE", f"/users/{ADA}/server")


def test_whole_flow_through_the_exchange_as_the_class(released: Hub) -> None:
    hub = released
    edit_and_submit(ADA, hub, SLIP)
    edit_and_submit(BOB, hub, "return 0")
    edit_and_submit(BOB, hub, ANSWER)                  # bob's second try is the one graded
    ag = [hub.python, "-m", "autograder"]
    out = as_user(INSTRUCTOR, hub.dir, *ag, "collect", NAME, "--from-exchange").stdout
    assert f"collected 2 submission(s) of {NAME}" in out, out
    course = home(INSTRUCTOR) / "tinyserve"
    assert ANSWER in (course / "grading/submitted" / BOB / NAME / f"{NAME}.ipynb").read_text()
    # In the sandbox, as the README's flow: bubblewrap as an unprivileged account.
    out = as_user(INSTRUCTOR, hub.dir, *ag, "autograde", NAME, "--no-progress",
                  "--workers", "2").stdout
    # Only 1a answered (2 points): ada's slip scores 0, bob's right answer 2.
    assert re.search(rf"{ADA}\s+graded\s+0/22", out) and re.search(rf"{BOB}\s+graded\s+2/22",
                                                                     out), out
    out = as_user(INSTRUCTOR, hub.dir, *ag, "feedback", NAME, "--return").stdout
    assert f"returned feedback to 2 student(s) through the exchange: {ADA}, {BOB}" in out, out
    as_user(ADA, hub.dir, hub.python, "-m", "nbgrader", "fetch_feedback", NAME)
    pages = list((home(ADA) / NAME / "feedback").glob(f"*/{NAME}.html"))
    text = pages[0].read_text() if len(pages) == 1 else ""
    assert "Score: <b>0.0 / 22.0</b>" in text, text[:3000]
    assert "half the expected size: the factor 2 for keys AND values is missing" in text
    assert "BEGIN HIDDEN TESTS" not in text


def test_one_student_cannot_read_anothers_work_or_the_instructors(released: Hub) -> None:
    hub = released
    if not list((hub.dir / "exchange/tinyserve/inbound").glob(f"{BOB}+*")):
        edit_and_submit(BOB, hub, ANSWER)
    bob_submission = next((hub.dir / "exchange/tinyserve/inbound").glob(f"{BOB}+*"))
    course = home(INSTRUCTOR) / "tinyserve"
    attempts = {
        "list the exchange's inbound folder": f"os.listdir({str(bob_submission.parent)!r})",
        "list bob's home": f"os.listdir({str(home(BOB))!r})",
        "read bob's fetched notebook":
            f"open({str(home(BOB) / NAME / (NAME + '.ipynb'))!r}).read()",
        "read bob's nbgrader cache": f"os.listdir({str(home(BOB) / '.local')!r})",
        "list the exchange's feedback folder":
            f"os.listdir({str(hub.dir / 'exchange/tinyserve/feedback')!r})",
        "read the instructor's solutions":
            f"open({str(course / 'solutions' / NAME / (NAME + '.ipynb'))!r}).read()",
        "read the instructor's gradebook": f"os.listdir({str(course)!r})",
        "read the checkout's solutions":
            f"open({str(ROOT / 'solutions' / NAME / (NAME + '.ipynb'))!r}).read()",
        "read the checkout's tests": f"os.listdir({str(ROOT / 'tests')!r})",
    }
    for what, code in attempts.items():
        proc = as_user(ADA, hub.dir, hub.python, "-c", f"import os; {code}", check=False)
        assert proc.returncode != 0 and "PermissionError" in proc.stderr, \
            f"ada could {what}: {proc.stdout[:200]}"
    # What she needs stays readable: the released assignment and the course's environment.
    as_user(ADA, hub.dir, hub.python, "-c",
            f"open({str(hub.dir / 'exchange/tinyserve/outbound' / NAME / (NAME + '.ipynb'))!r})"
            ".read(); import tinyserve, autograder")

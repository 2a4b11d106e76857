"""The class hub: JupyterHub on loopback, local Unix accounts, each user's JupyterLab from
the course's environment, nbgrader's exchange between them. `make hub` starts it as root
(`jupyterhub -f hub/jupyterhub_config.py`, after hub/setup_class.py made the accounts).

Settings come from the environment (the Makefile's HUB_* variables set them):
    TINYSERVE_HUB_DIR      the hub's folder: state/ (database, cookie secret; root only)
                           and exchange/ (nbgrader's Exchange.root)
    TINYSERVE_INSTRUCTOR   the instructor's account (admin; Lab with formgrader)
    TINYSERVE_STUDENTS     the students' accounts, comma-separated (Lab with Assignments tab)
    TINYSERVE_HUB_IP/PORT  where the hub listens (127.0.0.1:8000: loopback only)
    TINYSERVE_HUB_TOKEN    optional: a token for scripts (the tests, the 40-student run) to
                           start and stop servers through the REST API

Who sees what is Jupyter's own config: the spawner points JUPYTER_CONFIG_PATH at
hub/nbgrader (the exchange, the course id) and .jupyter/roles/ROLE (the server extensions and
Lab plugins of a student or the instructor). Unix permissions keep students apart: their homes
are 0700, nbgrader's inbound is 2733 (write, no listing), the instructor's course lives in
their own home.
"""
import os
import pwd
import sys
from pathlib import Path

c = get_config()  # noqa: F821 (provided by traitlets when JupyterHub loads this file)

REPO = Path(__file__).resolve().parents[1]
HUB_DIR = Path(os.environ.get("TINYSERVE_HUB_DIR", "/srv/tinyserve-hub"))
STATE = HUB_DIR / "state"
EXCHANGE = HUB_DIR / "exchange"
INSTRUCTOR = os.environ.get("TINYSERVE_INSTRUCTOR", "instructor")
STUDENTS = [s for s in os.environ.get("TINYSERVE_STUDENTS", "").split(",") if s]
# The Python each user's server runs: the course's venv, or the stand-in hub/setup_class.py
# made when that venv's interpreter is out of other accounts' reach (its user_python).
_USER_PYTHON = STATE / "user_python"
USER_PYTHON = Path(_USER_PYTHON.read_text().strip() if _USER_PYTHON.exists() else sys.executable)

# Loopback only: the proxy's public side and the hub's API both.
c.JupyterHub.ip = os.environ.get("TINYSERVE_HUB_IP", "127.0.0.1")
c.JupyterHub.port = int(os.environ.get("TINYSERVE_HUB_PORT", "8000"))
c.JupyterHub.hub_ip = "127.0.0.1"
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{int(os.environ.get('TINYSERVE_PROXY_API_PORT', c.JupyterHub.port + 1))}"
c.JupyterHub.hub_port = int(os.environ.get("TINYSERVE_HUB_API_PORT", c.JupyterHub.port + 2))
c.ConfigurableHTTPProxy.command = [str(REPO / "hub" / "node_modules" / ".bin" /
                                       "configurable-http-proxy")]
c.ConfigurableHTTPProxy.pid_file = str(STATE / "proxy.pid")
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")
# Each server is stopped with the hub (a test's or a class's hub leaves nothing running).
c.JupyterHub.cleanup_servers = True

# Real local accounts, checked by PAM; only the class may log in.
c.JupyterHub.authenticator_class = "pam"
c.Authenticator.allowed_users = {INSTRUCTOR, *STUDENTS}
c.Authenticator.admin_users = {INSTRUCTOR}

if os.environ.get("TINYSERVE_HUB_TOKEN"):
    c.JupyterHub.services = [{"name": "course-admin",
                              "api_token": os.environ["TINYSERVE_HUB_TOKEN"]}]
    c.JupyterHub.load_roles = [{
        "name": "course-admin", "services": ["course-admin"],
        "scopes": ["admin:users", "admin:servers", "access:servers", "read:hub"],
    }]

# Each user's JupyterLab, as the user, from the course's environment.
c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = [str(USER_PYTHON), "-m", "jupyterhub.singleuser"]
c.Spawner.default_url = "/lab"
# A busy 2-core machine imports JupyterLab slowly; a whole class at once (hub/scale_run.py)
# waits longer.
c.Spawner.start_timeout = int(os.environ.get("TINYSERVE_SPAWN_TIMEOUT", "180"))
c.Spawner.http_timeout = c.Spawner.start_timeout
# Stopping: SIGINT, then SIGTERM, then SIGKILL. A server killed before it has shut its kernels
# down leaves them running as the user; give it time on a busy machine (default 10 s).
c.LocalProcessSpawner.interrupt_timeout = 30
c.Spawner.args = [
    f"--LabApp.extra_labextensions_path={REPO / '.jupyter' / 'labextensions'}",
    f"--LabApp.app_settings_dir={REPO / '.jupyter' / 'lab' / 'settings'}",
    "--LabApp.news_url=None",
    "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
]


def role(username: str) -> str:
    return "instructor" if username == INSTRUCTOR else "student"


def pre_spawn_hook(spawner) -> None:
    """The user's role: Jupyter config path, nbgrader's exchange, the instructor's course."""
    name = spawner.user.name
    home = pwd.getpwnam(name).pw_dir
    spawner.environment.update({
        "JUPYTER_CONFIG_PATH": os.pathsep.join([str(REPO / "hub" / "nbgrader"),
                                                str(REPO / ".jupyter" / "roles" / role(name))]),
        "TINYSERVE_EXCHANGE": str(EXCHANGE),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PATH": os.pathsep.join([str(USER_PYTHON.parent), "/usr/local/bin", "/usr/bin", "/bin"]),
    })
    if role(name) == "instructor":
        course = os.path.join(home, "tinyserve")
        spawner.environment["TINYSERVE_COURSE"] = course
        spawner.notebook_dir = course
    else:
        spawner.notebook_dir = home


c.Spawner.pre_spawn_hook = pre_spawn_hook

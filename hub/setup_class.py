"""Set up a class on this machine for the hub (run as root; `make hub` does).

    python hub/setup_class.py --hub-dir DIR --instructor NAME --students a,b,c

Idempotent: what exists is kept (accounts, their passwords, the instructor's course copy).
  - local Unix accounts for the instructor and the students, homes mode 0700, a random
    password for each account it creates (printed once, kept in DIR/state/accounts.txt, 0600);
  - nbgrader's exchange at DIR/exchange, mode 0777 as nbgrader's release step sets it (each step below it
    sets its own, tighter modes: inbound 2733, feedback 0711);
  - the course (solutions, exercises, nbgrader_config.py, chapters) copied to the instructor's
    ~/tinyserve, the CourseDirectory.root of the instructor's Lab;
  - a Python every account can run, seeing the course's venv (user_python);
  - this checkout hardened: the venv, the package and the Lab settings stay readable by the
    students' servers, while solutions/, tests/, grading/ and git's objects (which hold the
    solutions' history) are closed to other users.
"""
from __future__ import annotations

import argparse
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COURSE_PARTS = ("nbgrader_config.py", "solutions", "exercises", "course", "START_HERE.ipynb")
CLOSED = ("solutions", "tests", "grading")
COURSE_DIR_NAME = "tinyserve"


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def ensure_account(name: str, password: str | None) -> str | None:
    """Create the account if missing; return the password it was given, if any."""
    try:
        pwd.getpwnam(name)
        created = False
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--user-group", "--shell", "/bin/bash",
                        name], check=True)
        created = True
    home = Path(pwd.getpwnam(name).pw_dir)
    home.chmod(0o700)   # Debian's default is 0700 already; other systems differ
    if password is None and created:
        password = secrets.token_urlsafe(12)
    if password is not None:
        subprocess.run(["chpasswd"], input=f"{name}:{password}\n", text=True, check=True)
    return password


def copy_course(instructor: str) -> Path:
    entry = pwd.getpwnam(instructor)
    dest = Path(entry.pw_dir) / COURSE_DIR_NAME
    if not dest.exists():
        dest.mkdir()
        for part in COURSE_PARTS:
            src = REPO / part
            if src.is_dir():
                shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns(
                    ".ipynb_checkpoints", "__pycache__"))
            elif src.exists():
                shutil.copy2(src, dest / part)
        for path in [dest, *dest.rglob("*")]:
            os.chown(path, entry.pw_uid, entry.pw_gid, follow_symlinks=False)
    return dest


def others_can_run(path: Path) -> bool:
    """Can an account other than root execute ``path`` (every folder above it traversable)?"""
    path = Path(os.path.realpath(path))
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


def user_python(hub_dir: Path) -> Path:
    """A Python every account can run that sees this venv's packages.

    The venv's own interpreter when others can run it. Otherwise (a venv built on a Python
    under root's home, as pyenv installs it) a small venv in HUB_DIR/venv on a system Python
    of the same version, sharing this venv's site-packages: same ABI, so the same installed
    packages, and nothing under /root needs opening."""
    if others_can_run(Path(sys.executable)):
        return Path(sys.executable)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    bridge = hub_dir / "venv"
    for candidate in (Path(f"/usr/bin/python{version}"), Path(f"/usr/local/bin/python{version}")):
        if candidate.exists() and others_can_run(candidate):
            break
    else:
        fail(f"the course's Python ({os.path.realpath(sys.executable)}) cannot be run by other "
             f"accounts, and there is no system python{version} to stand in: build .venv from "
             f"a Python every account can run (make hub PYTHON=/usr/bin/python3)")
    if not (bridge / "bin" / "python").exists():
        subprocess.run([str(candidate), "-m", "venv", "--without-pip", str(bridge)], check=True)
    # Its site-packages *is* the venv's (a link): every package, editable installs included,
    # and the grading sandbox, which lets a kernel read its interpreter's site-packages,
    # resolves the link to the venv's folder.
    lib = next((bridge / "lib").glob("python3*/site-packages"))
    if not lib.is_symlink():
        shutil.rmtree(lib)
        lib.symlink_to(sysconfig.get_paths()["purelib"])
    # Jupyter finds its extensions' config and assets under sys.prefix: the venv's.
    for rel in ("etc/jupyter", "share/jupyter"):
        link, real = bridge / rel, Path(sys.prefix) / rel
        if real.is_dir() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(real)
    # The venv's commands (jupyter, nbgrader, alembic that nbgrader calls, ...) on the
    # stand-in's interpreter, so a student's terminal has them too.
    venv_bin = Path(sys.executable).parent
    for script in venv_bin.iterdir():
        if script.name.startswith(("python", "activate", "pip")) or not script.is_file():
            continue
        with open(script, "rb") as f:
            first = f.readline()
        ours = {str(venv_bin / name).encode() for name in ("python", "python3")}
        if first.startswith(b"#!") and first[2:].strip() in ours:
            target = bridge / "bin" / script.name
            target.write_bytes(b"#!" + str(bridge / "bin" / "python").encode() + b"\n"
                               + script.read_bytes()[len(first):])
            target.chmod(0o755)
    return bridge / "bin" / "python"


def harden_checkout() -> None:
    """Close what students must not read; the rest stays as git left it."""
    for part in CLOSED:
        path = REPO / part
        if path.exists():
            path.chmod(path.stat().st_mode & ~0o007)
    git_dir = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-common-dir"],
                             capture_output=True, text=True)
    if git_dir.returncode == 0:
        path = (REPO / git_dir.stdout.strip()).resolve()
        path.chmod(path.stat().st_mode & ~0o007)


def empty_homes(users: list[str]) -> None:
    """An earlier run's fetched work, course copy and nbgrader caches go (tests and the scale
    run reuse their accounts); accounts that do not exist yet are left to ensure_account."""
    for user in users:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            continue
        shutil.rmtree(entry.pw_dir, ignore_errors=True)
        Path(entry.pw_dir).mkdir(mode=0o700)
        os.chown(entry.pw_dir, entry.pw_uid, entry.pw_gid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hub-dir", type=Path, required=True)
    p.add_argument("--instructor", required=True)
    p.add_argument("--students", required=True, help="comma-separated account names")
    p.add_argument("--password", help="set this password on every account (tests only)")
    p.add_argument("--empty-homes", action="store_true",
                   help="empty the accounts' existing home folders first (tests, scale run)")
    args = p.parse_args(argv)
    if os.getuid() != 0:
        fail("setting up a class hub creates Unix accounts and needs root: run `sudo make hub` "
             "(or as root in a container); on a shared server ask its administrator")
    students = [s for s in args.students.split(",") if s]
    if not students:
        fail("--students names no account")
    if args.empty_homes:
        empty_homes([args.instructor, *students])
    state = args.hub_dir / "state"
    state.mkdir(parents=True, exist_ok=True)
    state.chmod(0o700)
    exchange = args.hub_dir / "exchange"
    exchange.mkdir(parents=True, exist_ok=True)
    exchange.chmod(0o777)
    args.hub_dir.chmod(0o755)
    new = {}
    for name in [args.instructor, *students]:
        given = ensure_account(name, args.password)
        if given and not args.password:
            new[name] = given
    if new:
        accounts = state / "accounts.txt"
        with open(os.open(accounts, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as f:
            f.writelines(f"{n} {pw}\n" for n, pw in new.items())
        print(f"new accounts (passwords also in {accounts}, root only):")
        for n, pw in new.items():
            print(f"  {n:<16} {pw}")
    course = copy_course(args.instructor)
    harden_checkout()
    python = user_python(args.hub_dir)
    (state / "user_python").write_text(f"{python}\n")
    print(f"exchange: {exchange}   instructor's course: {course}   users' Python: {python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

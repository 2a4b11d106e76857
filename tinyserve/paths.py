"""Where the package's files are. Everything it reads at run time ships inside it, under
``ASSETS``, so the same paths hold in a checkout and in an installed wheel."""
from __future__ import annotations

from pathlib import Path

#: The ``tinyserve`` package folder.
PACKAGE = Path(__file__).resolve().parent
#: Shipped files (package data): the models, the tokenizer, the simulator's cost model and
#: the Harbor ticket fixtures the load generator replays.
ASSETS = PACKAGE / "assets"
#: The shipped models, each a folder under ``ASSETS / "models"``; every ``--model`` choice.
MODEL_NAMES = ("target", "draft")
#: Harbor's 200 fictional tickets; a copy of ``harbor_project/fixtures/tickets.jsonl`` (the
#: learners' project file), kept identical by ``harbor_project/tools/make_tickets.py``.
HARBOR_TICKETS = ASSETS / "harbor" / "tickets.jsonl"
#: The git checkout the package runs from, or None when it is installed (no ``.git`` above it).
CHECKOUT: Path | None = PACKAGE.parent if (PACKAGE.parent / ".git").exists() else None


def cache_dir() -> Path:
    """Where the package keeps what it prepares and can reuse across runs (the fast path's
    compiled kernels, under ``inductor/torch-<version>-cold``): ``$TINYSERVE_CACHE_DIR`` if set;
    else, in a checkout, its ``.cache/`` (git-ignored), so a course's generated files stay in
    the folder the learner works in, next to ``runs/``, go with it when it is deleted, and CI
    caches one path inside its workspace; else (an installed package)
    ``$XDG_CACHE_HOME/tinyserve``, by default ``~/.cache/tinyserve``. Read at each call, not
    at import, so a caller may set the variable first. Nothing is created here."""
    import os
    if os.environ.get("TINYSERVE_CACHE_DIR"):
        return Path(os.environ["TINYSERVE_CACHE_DIR"]).expanduser()
    if CHECKOUT is not None:
        return CHECKOUT / ".cache"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "tinyserve"

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


#: The variable that names a folder of the course's bench reports (``bench/results``), for a
#: copy of the package that neither ships them nor was installed from a clone.
RESULTS_ENV = "TINYSERVE_RESULTS_DIR"


def installed_from() -> Path | None:
    """The folder this package was installed from (``pip install ./tinyserve``: the clone),
    read from pip's ``direct_url.json``, when it is a local folder still on disk; else None
    (a checkout, an index install, an editable one without the record)."""
    import importlib.metadata
    import json
    from urllib.parse import unquote, urlparse
    try:
        record = importlib.metadata.distribution("tinyserve").read_text("direct_url.json")
        url = urlparse(json.loads(record or "{}").get("url", ""))
    except (importlib.metadata.PackageNotFoundError, ValueError, AttributeError):
        return None
    folder = Path(unquote(url.path)) if url.scheme == "file" else None
    return folder if folder is not None and (folder / "pyproject.toml").is_file() else None


def course_root() -> Path | None:
    """The course's folder (chapters, exercises, ``bench/results``): the checkout the package
    runs from, else the clone it was installed from, else None."""
    return CHECKOUT or installed_from()


def results_folder() -> Path | None:
    """Where the course's committed bench reports are, the first that exists of:
    ``$TINYSERVE_RESULTS_DIR``; ``bench/results`` beside the package (a checkout, or an
    installed copy, which ships them as package data); the clone it was installed from.
    None when none is there. Read at each call, so ``%env`` in a notebook counts."""
    import os
    named = os.environ.get(RESULTS_ENV)
    places = [Path(named).expanduser()] if named else []
    places.append(PACKAGE.parent / "bench" / "results")
    clone = installed_from()
    if clone is not None:
        places.append(clone / "bench" / "results")
    return next((p for p in places if p.is_dir() and any(p.glob("*.json"))), None)

# Two commands set everything up on a fresh machine:
#   make lab    create .venv if missing, install the course, open JupyterLab
#   make test   create .venv if missing, install with test extras, run every test
#
# On a CUDA machine pick the matching torch build, e.g.
#   make test TORCH_SPEC="torch==2.13.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu128"

SHELL        := /bin/bash
PYTHON       ?= $(shell command -v python3.11 || command -v python3)
VENV         ?= .venv
PY           := $(VENV)/bin/python
PIP          := $(PY) -m pip
TORCH_SPEC   ?= torch==2.13.0
TORCH_INDEX  ?=
LAB_PORT     ?= 8888
LAB_IP       ?= 127.0.0.1
PYTEST_ARGS  ?=

# JupyterLab refuses to run as root unless told; in a container or CI we usually are root.
ROOT_FLAG    := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test venv system-deps train bench release clean help \
        collect autograde feedback export grade-bench check

help:
	@echo "make lab     open the course in JupyterLab (http://$(LAB_IP):$(LAB_PORT))"
	@echo "make test    run the whole test suite"
	@echo "make train   retrain the shipped models (target and draft)"

# The stamp depends on pyproject.toml, so a changed dependency list reinstalls.
$(VENV)/.stamp-base: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PIP) install -q -e .
	@touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PIP) install -q -e ".[test]"
	@touch $@

venv: $(VENV)/.stamp-base

# OS packages the grading sandbox needs (bubblewrap); installed when we are root.
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) \
	      || echo "warning: could not install bubblewrap; sandboxed grading tests will fail"; \
	  else \
	    echo "note: bubblewrap (bwrap) is not installed; install it for sandboxed grading"; \
	  fi; }

lab: $(VENV)/.stamp-base
	$(VENV)/bin/jupyter lab --no-browser --ip=$(LAB_IP) --port=$(LAB_PORT) $(ROOT_FLAG) \
	  --ServerApp.root_dir="$(CURDIR)" --IdentityProvider.token='' \
	  --LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate

test: $(VENV)/.stamp-test system-deps
	$(PY) -m pytest $(PYTEST_ARGS)

train: $(VENV)/.stamp-base
	$(PY) -m tinyserve train --preset target
	$(PY) -m tinyserve train --preset draft

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# ---- Grading workflow (instructor guide: README.md) --------------------------------
# make release                         regenerate exercises/ from solutions/ (commit the result)
# make collect A=harbor_capacity FROM=path/to/export.zip
# make autograde A=harbor_capacity [WORKERS=4] [UNSAFE=1]
# make feedback A=harbor_capacity
# make export                          grading/grades.csv
# make check NB=exercises/harbor_capacity/harbor_capacity.ipynb   (learner self-check)
# make grade-bench                     parallel vs serial grading of 30 submissions
A        ?=
FROM     ?=
NB       ?=
WORKERS  ?=
UNSAFE   ?=
AG       := $(PY) -m autograder

release: $(VENV)/.stamp-base
	$(AG) release $(A)

collect: $(VENV)/.stamp-base
	@test -n "$(A)" -a -n "$(FROM)" || { echo "usage: make collect A=ASSIGNMENT FROM=folder-or-zip"; exit 2; }
	$(AG) collect $(A) "$(FROM)"

autograde: $(VENV)/.stamp-base system-deps
	@test -n "$(A)" || { echo "usage: make autograde A=ASSIGNMENT [WORKERS=n] [UNSAFE=1]"; exit 2; }
	$(AG) autograde $(A) $(if $(WORKERS),--workers $(WORKERS),) $(if $(UNSAFE),--unsafe,)

feedback: $(VENV)/.stamp-base
	@test -n "$(A)" || { echo "usage: make feedback A=ASSIGNMENT"; exit 2; }
	$(AG) feedback $(A)

export: $(VENV)/.stamp-base
	$(AG) export $(A)

check: $(VENV)/.stamp-base
	@test -n "$(NB)" || { echo "usage: make check NB=path/to/notebook.ipynb"; exit 2; }
	$(AG) check "$(NB)"

grade-bench: $(VENV)/.stamp-base system-deps
	$(AG) bench --json artifacts/grading_bench.json

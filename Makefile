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
# The folder JupyterLab serves (and where nbgrader finds nbgrader_config.py), and the
# notebook it opens first. The e2e tests point LAB_ROOT at a throwaway copy.
LAB_ROOT     ?= $(CURDIR)
LAB_START    ?= START_HERE.ipynb
PYTEST_ARGS  ?=
# `make test` runs the suite on this many pytest-xdist workers, one test file per worker at a
# time (a file's module fixtures are built once); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

# JupyterLab refuses to run as root unless told; in a container or CI we usually are root.
ROOT_FLAG    := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab lab-instructor lab-plugin hub hub-deps test e2e venv system-deps train bench release clean help peers peers-llamacpp \
        collect autograde feedback export grade-bench check gpu-wheels gpu-check torch-floor torch-floor-venv

help:
	@echo "make lab     open the course in JupyterLab (http://$(LAB_IP):$(LAB_PORT))"
	@echo "make lab-instructor   the same with nbgrader's instructor tools (formgrader, ...)"
	@echo "make test    run the whole test suite (browser tests included)"
	@echo "make e2e     run only the browser tests (JupyterLab in headless Chromium)"
	@echo "make hub     a class on JupyterHub: accounts, exchange, hub (as root; README)"
	@echo "make train   retrain the shipped models (target and draft)"
	@echo "make bench   every CPU benchmark suite into bench/results/, then the README's ledger"
	@echo "make peers   install guidellm, transformers serve and llama.cpp (own venvs) for bench peers / llamacpp"
	@echo "make torch-floor   the oldest supported torch in a throwaway venv: every decoding path once"

# The stamp depends on pyproject.toml, so a changed dependency list reinstalls.
$(VENV)/.stamp-base: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	# the runtime, then what the Lab and the grading need (pyproject's extras lab, grading)
	$(PIP) install -q -e ".[lab,grading]"
	@touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PIP) install -q -e ".[test]"
	@touch $@

$(VENV)/.stamp-hub: $(VENV)/.stamp-base
	$(PIP) install -q -e ".[hub]"
	@touch $@

venv: $(VENV)/.stamp-base

# OS packages: bubblewrap for the grading sandbox, chromium for the browser (e2e) tests.
# Installed with apt when we are root; elsewhere the tests that need them say so and skip
# (except in CI, where they fail).
system-deps:
	@missing=""; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "warning: could not install$$missing; sandboxed grading or browser tests will fail"; \
	  else \
	    echo "note: not installed:$$missing (bwrap sandboxes grading, chromium runs the browser tests)"; \
	  fi; \
	fi

# Opens on the course's landing page. No news pop-up and no update checks: the server never
# fetches them, and .jupyter/lab/settings/overrides.json sets the defaults to "never ask".
# Runs from LAB_ROOT so nbgrader's Validate button and formgrader read its nbgrader_config.py.
# ROLE picks what the Lab shows, by Jupyter's own config (.jupyter/roles/ROLE: the server
# extensions enabled and the page_config's disabled Lab plugins):
#   learner     (make lab) no Nbgrader menu, formgrader or Create Assignment; Validate only on
#               assignment notebooks (.jupyter/labextensions: a 40-line plugin)
#   instructor  (make lab-instructor) everything nbgrader has
#   student     what the hub gives a student: learner plus the Assignments tab (exchange)
# The server's log goes to LAB_LOG; the last line printed is the address to open.
# Before it, the fast path's line (tinyserve.toolchain: whether torch.compile can build
# CPU kernels here, else the cause and this OS's fix; the course runs either way). The probe
# imports torch and compiles a tiny kernel while the server starts; the address waits for it at
# most LAB_FAST_CHECK seconds (0: no probe). Its line is also kept in LAB_FAST_LINE.
ROLE         ?= learner
LAB_LOG      ?= $(CURDIR)/artifacts/lab-$(ROLE).log
LAB_FAST_CHECK ?= 30
LAB_FAST_LINE = $(basename $(LAB_LOG)).fast-path.txt
LAB_FLAGS     = --no-browser --ip=$(LAB_IP) --port=$(LAB_PORT) --ServerApp.port_retries=0 \
  $(ROOT_FLAG) --ServerApp.root_dir="$(LAB_ROOT)" --IdentityProvider.token='' \
  --LabApp.default_url="/lab/tree/$(LAB_START)" \
  --LabApp.app_settings_dir="$(CURDIR)/.jupyter/lab/settings" \
  --LabApp.extra_labextensions_path="$(CURDIR)/.jupyter/labextensions" \
  --LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate

lab: $(VENV)/.stamp-base
	@test -d ".jupyter/roles/$(ROLE)" || { echo "ROLE=$(ROLE): no such role; use learner, instructor or student"; exit 2; }
	@mkdir -p "$(dir $(LAB_LOG))"
	@echo "Starting JupyterLab ($(ROLE)) on $(LAB_IP):$(LAB_PORT); server log: $(LAB_LOG)"
	@(cd "$(LAB_ROOT)" && exec env JUPYTER_CONFIG_PATH="$(CURDIR)/.jupyter/roles/$(ROLE)" \
	  "$(abspath $(VENV))/bin/jupyter" lab $(LAB_FLAGS)) > "$(LAB_LOG)" 2>&1 & pid=$$!; \
	probe=; rm -f "$(LAB_FAST_LINE)"; \
	if [ "$(LAB_FAST_CHECK)" != 0 ]; then \
	  "$(abspath $(PY))" -m tinyserve.toolchain > "$(LAB_FAST_LINE)" 2>/dev/null & probe=$$!; \
	fi; \
	trap 'kill -TERM $$pid $$probe 2>/dev/null; wait; exit 0' INT TERM; \
	until (exec 3<>/dev/tcp/$(LAB_IP)/$(LAB_PORT)) 2>/dev/null; do \
	  kill -0 $$pid 2>/dev/null || { kill $$probe 2>/dev/null; tail -n 20 "$(LAB_LOG)"; echo "JupyterLab did not start (log above: $(LAB_LOG))"; exit 1; }; \
	  sleep 0.3; \
	done; \
	if [ -n "$$probe" ]; then \
	  until ! kill -0 $$probe 2>/dev/null || [ $$SECONDS -ge $(LAB_FAST_CHECK) ]; do sleep 0.3; done; \
	  if kill -0 $$probe 2>/dev/null; then \
	    echo "fast path: still being checked (its line will be in $(LAB_FAST_LINE))"; \
	  elif [ -s "$(LAB_FAST_LINE)" ]; then cat "$(LAB_FAST_LINE)"; \
	  else echo "fast path: not checked ($(PY) -m tinyserve.toolchain failed; run it to see why)"; fi; \
	fi; \
	echo "Stop it with Ctrl-C. Open the course at:"; \
	echo "http://$(LAB_IP):$(LAB_PORT)/lab/tree/$(LAB_START)"; \
	wait $$pid

lab-instructor:
	@$(MAKE) --no-print-directory lab ROLE=instructor

# Rebuild the course's Lab plugin (.jupyter/labextensions, committed) after editing its source
# in .jupyter/labextension-src; needs npm (JupyterLab's own builder, pinned there).
lab-plugin: $(VENV)/.stamp-base
	cd .jupyter/labextension-src && npm ci --no-audit --no-fund --loglevel=error && \
	  node node_modules/@jupyterlab/builder/lib/build-labextension.js --core-path \
	  "$$("$(abspath $(PY))" -c 'import jupyterlab, os; print(os.path.join(os.path.dirname(jupyterlab.__file__), "staging"))')" .

test: $(VENV)/.stamp-test system-deps hub-deps
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The browser tests alone: a learner and an instructor in JupyterLab (screenshots: artifacts/e2e/).
e2e: $(VENV)/.stamp-test system-deps hub-deps
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

# ---- A class on JupyterHub (README: "A class on JupyterHub") ------------------------------
# make hub   as root: Unix accounts for HUB_INSTRUCTOR and HUB_STUDENTS (new ones get random
#            passwords, printed once), nbgrader's exchange in HUB_DIR/exchange, then the hub on
#            http://HUB_IP:HUB_PORT (loopback by default). Its log: HUB_DIR/state/hub.log.
HUB_DIR        ?= /srv/tinyserve-hub
HUB_IP         ?= 127.0.0.1
HUB_PORT       ?= 8000
HUB_INSTRUCTOR ?= instructor
HUB_STUDENTS   ?= student1,student2,student3
CHP            := hub/node_modules/.bin/configurable-http-proxy

# JupyterHub's proxy, from npm, pinned by hub/package-lock.json, into hub/node_modules/.
$(CHP): hub/package.json hub/package-lock.json
	@command -v npm >/dev/null || { echo "the hub's proxy needs npm: apt-get install npm"; exit 2; }
	cd hub && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# For `make test`: without npm the hub's tests say so and skip (in CI they fail).
hub-deps:
	@if command -v npm >/dev/null; then $(MAKE) --no-print-directory $(CHP); \
	else echo "note: no npm, so no JupyterHub proxy: the class hub's tests will skip"; fi

hub: $(VENV)/.stamp-hub $(CHP)
	@test "$$(id -u)" = 0 || { echo "make hub creates Unix accounts and runs each user's Lab as that user: run it as root (sudo make hub)"; exit 2; }
	$(PY) hub/setup_class.py --hub-dir "$(HUB_DIR)" --instructor "$(HUB_INSTRUCTOR)" --students "$(HUB_STUDENTS)"
	@(cd "$(HUB_DIR)/state" && exec env TINYSERVE_HUB_DIR="$(HUB_DIR)" TINYSERVE_INSTRUCTOR="$(HUB_INSTRUCTOR)" \
	  TINYSERVE_STUDENTS="$(HUB_STUDENTS)" TINYSERVE_HUB_IP="$(HUB_IP)" TINYSERVE_HUB_PORT="$(HUB_PORT)" \
	  "$(abspath $(VENV))/bin/jupyterhub" -f "$(CURDIR)/hub/jupyterhub_config.py") > "$(HUB_DIR)/state/hub.log" 2>&1 & pid=$$!; \
	trap 'kill -TERM $$pid 2>/dev/null; wait $$pid; exit 0' INT TERM; \
	until (exec 3<>/dev/tcp/$(HUB_IP)/$(HUB_PORT)) 2>/dev/null; do \
	  kill -0 $$pid 2>/dev/null || { tail -n 20 "$(HUB_DIR)/state/hub.log"; echo "the hub did not start (log above)"; exit 1; }; \
	  sleep 0.5; \
	done; \
	echo "Stop it with Ctrl-C. The class logs in at:"; \
	echo "http://$(HUB_IP):$(HUB_PORT)/hub/login"; \
	wait $$pid

# ---- Peers: tools no one here wrote, for `python -m tinyserve bench peers` ----------------
# Each in its own venv under .venv-peers/ (git-ignored), from the package index, CPU torch
# first and pinned (so no CUDA build is pulled). Nothing they run downloads anything: the
# bench hands them the folder `python -m tinyserve export-hf` writes and sets HF_HUB_OFFLINE.
PEERS_DIR        ?= .venv-peers
GUIDELLM_SPEC    ?= guidellm==0.8.1
TRANSFORMERS_SPEC ?= transformers[serving]==5.24.0 accelerate==1.15.0
PEER_CONSTRAINT  := $(PEERS_DIR)/constraints.txt

$(PEERS_DIR)/%/.stamp:
	@mkdir -p $(PEERS_DIR)
	@echo "$(TORCH_SPEC)" > $(PEER_CONSTRAINT)
	@test -x $(PEERS_DIR)/$*/bin/python || $(PYTHON) -m venv $(PEERS_DIR)/$*
	$(PEERS_DIR)/$*/bin/python -m pip install -q --upgrade pip
	$(PEERS_DIR)/$*/bin/python -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PEERS_DIR)/$*/bin/python -m pip install -q -c $(PEER_CONSTRAINT) $(PEER_SPEC)
	@touch $@

peers:
	@$(MAKE) --no-print-directory $(PEERS_DIR)/guidellm/.stamp PEER_SPEC="$(GUIDELLM_SPEC)"
	@$(MAKE) --no-print-directory $(PEERS_DIR)/transformers/.stamp PEER_SPEC="$(TRANSFORMERS_SPEC)"
	@$(MAKE) --no-print-directory peers-llamacpp
	@echo "peers ready in $(PEERS_DIR)/: run .venv/bin/python -m tinyserve bench peers (and bench llamacpp)"

# llama.cpp for `python -m tinyserve bench llamacpp`: llama-cpp-python built from its source
# distribution for this CPU (a plain CPU build, -march=native; no llava, tools or tests): about
# 10-35 minutes on 2 cores, most of it llama.cpp's C++. Its GGUF converter ships in the same
# source (vendor/llama.cpp: convert_hf_to_gguf.py with conversion/ and its own gguf-py/) and is
# unpacked into $(LLAMACPP_DIR)/convert; the suite runs it in $(VENV) (it needs torch and
# transformers, which `make bench`'s venv has), so this venv holds llama-cpp-python only.
LLAMACPP_SPEC    ?= llama-cpp-python==0.3.36
LLAMACPP_CMAKE   ?= -DLLAVA_BUILD=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF \
                    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
LLAMACPP_DIR     := $(PEERS_DIR)/llamacpp
LLAMACPP_VENDOR  := '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' \
                    '*/vendor/llama.cpp/gguf-py/*'

peers-llamacpp: $(LLAMACPP_DIR)/.stamp

$(LLAMACPP_DIR)/.stamp:
	@mkdir -p $(PEERS_DIR)
	@test -x $(LLAMACPP_DIR)/bin/python || $(PYTHON) -m venv $(LLAMACPP_DIR)
	$(LLAMACPP_DIR)/bin/python -m pip install -q --upgrade pip
	rm -rf $(LLAMACPP_DIR)/sdist $(LLAMACPP_DIR)/convert
	$(LLAMACPP_DIR)/bin/python -m pip download -q --no-deps --no-binary :all: \
	  -d $(LLAMACPP_DIR)/sdist "$(LLAMACPP_SPEC)"
	@echo "building llama-cpp-python from source (10-35 minutes on 2 cores) ..."
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	  $(LLAMACPP_DIR)/bin/python -m pip install -q $(LLAMACPP_DIR)/sdist/llama_cpp_python-*.tar.gz
	mkdir -p $(LLAMACPP_DIR)/convert
	tar -xzf $(LLAMACPP_DIR)/sdist/llama_cpp_python-*.tar.gz -C $(LLAMACPP_DIR)/convert \
	  --strip-components=3 --wildcards $(LLAMACPP_VENDOR)
	@touch $@

# ---- The torch floor (README: "On a GPU") ------------------------------------------------
# make torch-floor   a throwaway venv (FLOOR_VENV; kept once made: rm it for a new one) with the oldest torch the package
#                    index has at or above pyproject's floor, the plain package (the runtime),
#                    then tests/smoke_paths.py: every decoding path on the shipped models, each
#                    path's tokens checked against plain generate. From PyPI on x86-64 Linux that
#                    torch is a CUDA build (~3 GB of downloads, ~5 GB in the venv; it runs on a
#                    CPU); TORCH_INDEX="--index-url .../whl/cpu" takes a CPU build where reachable.
FLOOR_VENV ?= .venv-floor

# The venv and its torch alone (the download, most of the time): CI starts it beside `make test`.
torch-floor-venv: $(FLOOR_VENV)/.stamp-torch

$(FLOOR_VENV)/.stamp-torch:
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --upgrade pip
	@v=$$($(FLOOR_VENV)/bin/python tests/smoke_paths.py --lowest-torch) || exit 1; \
	echo "torch-floor: torch==$$v, the oldest the index has at or above pyproject's floor"; \
	$(FLOOR_VENV)/bin/python -m pip install -q $(TORCH_INDEX) "torch==$$v" || exit 1
	touch $@

torch-floor: $(FLOOR_VENV)/.stamp-torch
	$(FLOOR_VENV)/bin/python -m pip install -q .
	rm -rf build
	cd $(FLOOR_VENV) && OMP_NUM_THREADS=2 TINYSERVE_DEVICE=cpu ./bin/python $(CURDIR)/tests/smoke_paths.py

train: $(VENV)/.stamp-base
	$(PY) -m tinyserve train --preset target
	$(PY) -m tinyserve train --preset draft

# ---- Benchmarks (README: "Benchmarks") -----------------------------------------------------
# make bench   every CPU suite in turn (each file of bench/suites/ but peers, which runs on its own),
#              each in its own process with one thread, into bench/results/: each new report
#              is compared with the one it replaces (regressions marked) before it is moved
#              in; then the ledger is rendered into README.md and bench/results/README.md.
#              Run it on a quiet machine and commit the results with the ledger.
# BENCH_ARGS="--suites spec,hf" runs a subset.
BENCH_ARGS ?=

bench: $(VENV)/.stamp-test
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(PY) -m tinyserve bench all $(BENCH_ARGS)
	$(PY) -m tinyserve bench ledger --write

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


# ---- GPU check (a borrowed, offline GPU machine; bench/gpu_check.py says what it runs) ----
# make gpu-wheels   here, with a registry: the wheels that machine lacks (notebooks, server)
#                   into .whl/, for CPython 3.12 on x86-64 Linux, pinned in bench/gpu_wheels.txt
# make gpu-check    there: its own python3 (torch with CUDA), no venv; report in
#                   bench/results/gpu/ (and $OUT when set). Correctness first (imports, the
#                   gpu-marked tests, graph decode against eager, the chapters), then the timed
#                   suites with what the budget leaves; the default budget fits one 6-minute call
#                   with the install. The copy there has no git history: pass the host's commit,
#                     GPU_CHECK_COMMIT=<host's HEAD> make gpu-check     (.whl/ carried along)
#                   GPU_CHECK_ARGS="--device cpu" tries the same steps on a CPU.
GPU_PYTHON     ?= python3
GPU_SITE       ?= /tmp/site
GPU_CHECK_ARGS ?=
GPU_PLATFORMS  := $(foreach p,manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
                    manylinux2014_x86_64 manylinux1_x86_64,--platform $(p))

gpu-wheels:
	@mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --abi cp312 --abi abi3 --abi none $(GPU_PLATFORMS) -d .whl \
	  -r bench/gpu_wheels.txt
	@du -sh .whl

gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --target $(GPU_SITE) \
	    --upgrade .whl/*.whl; \
	else echo "note: no .whl/ (make gpu-wheels on a machine with a registry); notebooks and the server may not run"; fi
	PYTHONPATH=$(CURDIR):$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m bench.gpu_check $(GPU_CHECK_ARGS)

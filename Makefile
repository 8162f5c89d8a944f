# Entry points: `make demo` (main job, embedded defaults, no services), `make test` (whole suite) and
# `make test-fast` (the tests that need no server, in under a minute).
# The virtual environment is built from the dev lock once and rebuilt only when the lock or project changes.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint lock bench clean

$(STAMP): requirements-dev.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --require-hashes -r requirements-dev.lock
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/reservations demo

lint: $(STAMP)
	$(BIN)/ruff check fencing reservations tasks admin service testing tests bench
	$(BIN)/mypy

# pytest keeps the test modules it has rewritten (for its assertions) in tests/__pycache__, and Python the
# modules it has compiled: the next run, each of its processes and every worker and command they start
# read them rather than doing it again (a test process collects in half the CPU: about 4 s less). Where
# the environment sets PYTHONDONTWRITEBYTECODE, none of them would ever be written.
test test-fast: export PYTHONDONTWRITEBYTECODE :=

# Four processes on two CPUs, one test file each (a module's clusters and topologies are built once):
# the suite's tests wait on workers and servers far more than they compute (a whole run in three
# processes used about 1.3 CPUs and took 5m48s; in four, 4m57s). `pytest tests/x.py` stays one process.
test: lint
	$(BIN)/pytest -n 4 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The fast tier: every test that reaches no server (SQLite files, the SQL lease backend on them, pure
# decisions, plans stepped with scripted answers) and runs no process for seconds; tests/conftest.py marks
# them `fast` from their parameters and fixtures. Redis, PostgreSQL and RabbitMQ need not run: their URLs
# point at a closed port here, so a test that reaches one anyway fails at once, and none waits past
# FAST_TIMEOUT seconds (the slowest, a property test on SQLite, takes about 5 s, and 20 s on a loaded
# machine).
CLOSED       := 127.0.0.1:9
FAST_TIMEOUT ?= 60
test-fast: $(STAMP)
	TEST_REDIS_URL=redis://$(CLOSED)/0 TEST_POSTGRES_URL=postgresql+psycopg://postgres@$(CLOSED)/test \
	TEST_RABBITMQ_URL=amqp://guest:guest@$(CLOSED) \
	$(BIN)/pytest -m fast -n 2 --dist loadfile --timeout $(FAST_TIMEOUT) $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

# Regenerate both lock files after changing dependencies in pyproject.toml. requirements-dev.lock (the
# [project] dependencies and the dev extra) builds the virtual environment; requirements.lock (the
# [project] dependencies alone, at the dev lock's versions) builds the image, and names no package index
# or wheel folder: whatever index this machine's pip uses is no business of the image.
LOCK_ARGS := -q --generate-hashes --strip-extras --allow-unsafe
lock:
	test -x $(VENV)-lock/bin/pip-compile || ($(PYTHON) -m venv $(VENV)-lock && $(VENV)-lock/bin/pip install -q pip-tools)
	$(VENV)-lock/bin/pip-compile $(LOCK_ARGS) --extra dev -o requirements-dev.lock pyproject.toml
	$(VENV)-lock/bin/pip-compile $(LOCK_ARGS) --no-emit-index-url --no-emit-find-links \
		--constraint requirements-dev.lock -o requirements.lock pyproject.toml

clean:
	rm -rf $(VENV) $(VENV)-lock

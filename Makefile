# Two entry points: `make demo` (main job, embedded defaults, no services) and `make test` (whole suite).
# The virtual environment is built from the lock file once and rebuilt only when the lock or project changes.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint lock bench clean

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --require-hashes -r requirements.lock
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/reservations demo

lint: $(STAMP)
	$(BIN)/ruff check fencing reservations tasks admin tests bench
	$(BIN)/mypy

test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

# Regenerate the lock file after changing dependencies in pyproject.toml.
lock:
	test -x $(VENV)-lock/bin/pip-compile || ($(PYTHON) -m venv $(VENV)-lock && $(VENV)-lock/bin/pip install -q pip-tools)
	$(VENV)-lock/bin/pip-compile -q --extra dev --generate-hashes --strip-extras --allow-unsafe -o requirements.lock pyproject.toml

clean:
	rm -rf $(VENV) $(VENV)-lock

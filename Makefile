# The two commands a fresh machine needs: `make demo` and `make test`.
# Each bootstraps what it uses first (idempotent; a second run only verifies).
PY ?= python3
VENV := .venv/bin

.PHONY: bootstrap demo test unit down lint bench lock

# The tests use the demo model too (C18: a burst on Gemma 3 270M).
bootstrap:
	$(PY) -m devcluster.bootstrap --with-demo-model

demo:
	$(PY) -m devcluster.bootstrap --with-demo-model
	$(VENV)/python -m devcluster demo

# The tests also format-check terraform/ with OpenTofu (built once, ~5 min).
test:
	$(PY) -m devcluster.bootstrap --with-demo-model --with-tofu
	$(MAKE) lint
	$(VENV)/python -m pytest

# Unit tests only: seconds, no agents, no binaries (only the .venv is built).
unit:
	$(PY) -m devcluster.bootstrap --venv-only
	$(VENV)/python -m pytest tests/unit -q

# Lint, import contracts, types (mypy: the packages and flags in pyproject's [tool.mypy]).
lint:
	$(VENV)/ruff check .
	$(VENV)/ruff format --check .
	$(VENV)/lint-imports
	$(VENV)/mypy

down:
	$(VENV)/python -m devcluster down

bench: bootstrap
	$(VENV)/python bench/router_overhead.py

# Re-pin constraints.txt to the newest versions pyproject.toml allows (review, test, commit).
lock:
	$(PY) -m devcluster.lock

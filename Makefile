# The two commands a fresh machine needs: `make demo` and `make test`.
# Each bootstraps what it uses first (idempotent; a second run only verifies).
PY ?= python3
VENV := .venv/bin

.PHONY: bootstrap demo test down lint bench

bootstrap:
	$(PY) -m devcluster.bootstrap

demo:
	$(PY) -m devcluster.bootstrap --with-demo-model
	$(VENV)/python -m devcluster demo

test: bootstrap lint
	$(VENV)/python -m pytest

lint:
	$(VENV)/ruff check .
	$(VENV)/lint-imports

down:
	$(VENV)/python -m devcluster down

bench: bootstrap
	$(VENV)/python bench/router_overhead.py

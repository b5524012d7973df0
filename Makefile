# The two commands of the README. Each sets up .venv on first use (scripts/setup.sh), then runs.
.PHONY: setup demo test test-fast lint bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/kvferry demo

test: setup
	.venv/bin/ruff check src tests bench
	.venv/bin/python -m pytest -q tests

test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow" tests

lint: setup
	.venv/bin/ruff check src tests bench

bench: setup
	.venv/bin/kvferry bench

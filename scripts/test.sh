#!/usr/bin/env bash
# Set up a virtual environment with the test extra (once; again when setup.cfg or pyproject.toml
# changes) and run the test suite.
#   bash scripts/test.sh [--fast] [pytest args]     (--fast: the in-process tier, README "Test it")
set -euo pipefail
cd "$(dirname "$0")/.."
fast=()
if [ "${1:-}" = "--fast" ]; then
    fast=(-m "not mpi and not daemon and not kernels and not slow")
    shift
fi
stamp=.venv/.flover-test-installed
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    python3 -m venv .venv
    .venv/bin/pip install -q -e '.[test]'
    touch "$stamp"
fi
# the tree is formatted and lint-clean (ruff format . && ruff check --fix . repair most of it)
.venv/bin/ruff format --check --quiet . || { echo "ruff format: the files above are not formatted"; exit 1; }
.venv/bin/ruff check --quiet . || { echo "ruff check: see above"; exit 1; }
exec .venv/bin/python -m pytest -q "${fast[@]}" "$@"

#!/usr/bin/env bash
# Set up a virtual environment with the test extra and run the whole test suite.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -e '.[test]'
# the tree is formatted and lint-clean (ruff format . && ruff check --fix . repair most of it)
.venv/bin/ruff format --check --quiet . || { echo "ruff format: the files above are not formatted"; exit 1; }
.venv/bin/ruff check --quiet . || { echo "ruff check: see above"; exit 1; }
exec .venv/bin/python -m pytest -q "$@"

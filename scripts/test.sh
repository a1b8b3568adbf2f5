#!/usr/bin/env bash
# Set up a virtual environment with the test extra and run the whole test suite.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -e '.[test]'
exec .venv/bin/python -m pytest -q "$@"

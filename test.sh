#!/usr/bin/env bash
# Set up (a venv in .venv with the dev extras) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/pytest ] || [ pyproject.toml -nt .venv/.installed-dev ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e ".[dev,spark]"
  touch .venv/.installed-dev
fi
exec .venv/bin/python -m pytest "$@"

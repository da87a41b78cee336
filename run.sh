#!/usr/bin/env bash
# Set up (a venv in .venv) and start a local kera cluster with a short demo.
# Extra arguments go to `kera up` (e.g. --nodes 4 --data /tmp/kera).
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/kera ] || [ pyproject.toml -nt .venv/.installed ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e .
  touch .venv/.installed
fi
exec .venv/bin/kera up --demo "$@"

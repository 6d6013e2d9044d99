#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh machine: a virtual environment with symhess,
# the CPU build of torch and the test tools.  LaTeX (for `report --pdf`) is optional:
#   apt-get install texlive-latex-base texlive-latex-recommended
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"

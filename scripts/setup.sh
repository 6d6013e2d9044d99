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
# constraints.txt keeps torch at the CPU build: curvlinops' dependency backpack asks for
# torchvision, whose newest release would pull a newer (CUDA) torch
.venv/bin/python -m pip install -q -c scripts/constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[test]"

#!/usr/bin/env bash
# Set-up on a fresh machine: a virtual environment .venv with symhess (editable install), the
# CPU build of torch and the test tools.  Idempotent and quiet: when the last complete install
# was made from the same pyproject.toml, scripts/constraints.txt, this script and Python
# version (their hash is kept in .venv/.symhess-setup), it does nothing and prints nothing.
# LaTeX (for `report --pdf`) is optional:
#   apt-get install texlive-latex-base texlive-latex-recommended
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.symhess-setup
want="$({ cat pyproject.toml scripts/constraints.txt scripts/setup.sh; .venv/bin/python --version; } \
        | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/symhess ]; then
  exit 0
fi
rm -f "$stamp"
.venv/bin/python -m pip install -q --upgrade pip
# constraints.txt keeps torch at the CPU build: curvlinops' dependency backpack asks for
# torchvision, whose newest release would pull a newer (CUDA) torch
.venv/bin/python -m pip install -q -c scripts/constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[test]"
# transformers (a test extra) imports torchvision when it is installed; a torchvision built
# for another torch (curvlinops' backpack pulls one in) cannot load and breaks that import,
# and nothing here uses torchvision: remove one that does not load
if .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)" \
    && ! .venv/bin/python -c "import torchvision" >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -q -y torchvision
fi
echo "$want" > "$stamp"

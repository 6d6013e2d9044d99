#!/usr/bin/env bash
# Regenerates every committed figure and table in docs/img (about 6 minutes on 2 cores):
#   bash scripts/figures.sh          # into docs/img
#   bash scripts/figures.sh DIR      # into DIR (e.g. to compare with the committed ones)
# The example commands in README.md and docs/ write to experiments_out/ or their --out DIR.
# One command per line (a test reads them and checks that they write exactly docs/img).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/img}"
symhess="${SYMHESS:-.venv/bin/symhess}"
"$symhess" experiment scaling --quiet --out "$out"
"$symhess" experiment scaling --attention linear --d-model 8 --d-mlp 32 --batch 8 --seeds 3 --quiet --out "$out"
"$symhess" experiment scaling --norm pre --d-model 8 --d-mlp 32 --batch 8 --seeds 3 --quiet --out "$out"
"$symhess" experiment scaling --attention linear --depth 2 --d-model 8 --d-mlp 32 --batch 8 --seeds 3 --quiet --out "$out"
"$symhess" experiment scaling --attention linear --depth 3 --d-model 8 --d-mlp 32 --batch 8 --seeds 3 --quiet --out "$out"
"$symhess" experiment scaling --attention softmax --depth 2 --d-model 8 --d-mlp 32 --batch 8 --seeds 3 --quiet --out "$out"
"$symhess" experiment scaling --attention softmax --depth 3 --d-model 8 --d-mlp 32 --batch 8 --seeds 3 --quiet --out "$out"
"$symhess" experiment histogram --batch 16 --quiet --out "$out"
"$symhess" spectrum addition_block --data addition --size d=32 --size d_h=32 --size d_m=128 --batches 4 --batch 8 --k 5 --density --ncv 64 --out "$out/spectra"
"$symhess" experiment language-model --quiet --out "$out"

#!/usr/bin/env bash
# One run on a CUDA machine: the CUDA tests, a few quick CPU tests, and the realistic-size
# benchmarks (hvp, diagonal, Frobenius norms against autograd and Hutchinson) with --device cuda.  Run from the repository root:
#     bash scripts/device_check.sh
# Everything is tee'd into "$OUT/device_log.txt" (OUT defaults to /tmp/out).  A failing
# step does not stop the others; the script exits 1 if any step failed.  Nothing is
# installed: python3 must already have torch (CUDA), numpy, sympy, jinja2, opt_einsum, pytest.
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
LOG="$OUT/device_log.txt"
: > "$LOG"
PY="${PYTHON:-python3}"
FAILED=()

log() { echo "$@" | tee -a "$LOG"; }

# step NAME TIMEOUT_S CMD...: run one step with a time limit, log its output and status
step() {
    local name="$1" limit="$2"; shift 2
    log ""
    log "=== $name: $* (limit ${limit}s) ==="
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=$?
    log "=== $name: exit $rc after $((SECONDS - t0)) s ==="
    if [ "$rc" -ne 0 ]; then FAILED+=("$name (exit $rc)"); fi
}

log "device check started $(date -u +%FT%TZ) in $PWD"
step nvidia-smi 30 nvidia-smi -L
VERSIONS_PY='
import sys, torch, numpy, sympy
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| numpy", numpy.__version__, "| sympy", sympy.__version__)
print("cuda available:", torch.cuda.is_available(), "| devices:",
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
try:
    print("tf32 matmul allowed:", torch.backends.cuda.matmul.allow_tf32)
except Exception as e:
    print("tf32 setting unreadable:", e)
'
step versions 60 "$PY" -c "$VERSIONS_PY"
# the copy on a device machine may carry a stale .git: identify the code by its content
log "git HEAD (may be stale on a copied tree): $(git rev-parse HEAD 2>/dev/null || echo unknown)"
log "content hash of symhess/ generated/ tests/ benchmarks/: $(git ls-files -co --exclude-standard \
    symhess generated tests benchmarks 2>/dev/null | sort | xargs cat 2>/dev/null | sha1sum | cut -c1-12)"

# the CUDA tests, forced onto cuda (without a visible GPU they fail here instead of skipping) ...
step test_cuda 150 env SYMHESS_TEST_DEVICE=cuda "$PY" -m pytest -p no:cacheprovider -q -rs --tb=short \
    --durations=5 tests/test_cuda.py
# ... and a few quick device-independent tests (the slow whole-folder regeneration excluded)
step tests_cpu 120 "$PY" -m pytest -p no:cacheprovider -q -x tests/test_codegen.py \
    tests/test_jacobian_kernels.py tests/test_runtime.py

# benchmarks at the sizes models are trained at: torch kernels and autograd on CUDA, eager
step scale_attention_hvp_diag 240 "$PY" -m benchmarks.bench_scale --device cuda --what hvp,diag \
    --L 512 --d 512 --batch 8 --rounds 3
step scale_attention_frob 150 "$PY" -m benchmarks.bench_scale --device cuda --what frob \
    --L 256 --d 256 --batch 8 --rounds 1
step scale_post_ln 150 "$PY" -m benchmarks.bench_scale --device cuda --layer post_ln_block \
    --what hvp,diag --L 256 --d 256 --dff 1024 --batch 8 --rounds 3

log ""
if [ "${#FAILED[@]}" -ne 0 ]; then
    log "FAILED steps: ${FAILED[*]}"
    log "device check finished $(date -u +%FT%TZ): FAILED"
    exit 1
fi
log "device check finished $(date -u +%FT%TZ): all steps passed"

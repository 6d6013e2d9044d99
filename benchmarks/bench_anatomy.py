"""Where the post-LN Hessian routine spends its time: the committed routine against copies
of it with one kind of statement replaced, all traced and timed in turn.

    python -m benchmarks.bench_anatomy [--rounds 4] [--layer post_ln_block] [--threads 1]

Sizes are the issue's (L=8, d=16, d_K=16, d_ff=64); the full Hessian is written into one
reused array (``out=``), as ``kernel.traced().hessian(..., out=H)`` does. Each variant rewrites
the text of the routine in generated/torch/<layer>.py and nothing else:

- ``slab GEMMs → fill``: each slab's GEMM into its rows of H (``_matmul_into``, symhess.smallk)
  replaced by ``fill_`` of the same rows: the difference is the GEMMs' arithmetic.
- ``slab GEMMs → no write``: the slab rows of H are not written: the difference is the
  GEMMs' arithmetic and writing H.
- ``slab operands → fill``: the broadcast products that write the slabs' operands R
  (``torch.mul(.., out=)``, ``addcmul_``) replaced by ``fill_``: the difference is computing
  them and the statements that only feed them.
- ``product-rule terms not added``: the additions into blocks the slabs wrote (``+=``,
  ``baddbmm_``) computed into temporaries but not added to H: the difference is their
  passes over H.
- ``product-rule terms removed``: not computed either.
- ``transposed copies → fill``: the blocks below the diagonal copied from their transposes
  (``_transpose_into``, symhess.smallk) filled instead: the difference is the copy's
  strided reads.

A traced graph drops statements whose results nothing reads, so every variant still reads
what it stops using (one entry of it, added to one entry of H; ``_touch``): otherwise
removing a GEMM would also remove everything that computes its operands. The rewritten
routines compute wrong Hessians (that is the point); only times are printed, as differences
from the committed routine measured in the same rounds.
"""
from __future__ import annotations

import argparse
import math
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from .timing import interleaved

# an operand of a slab GEMM: a name and its views (``t1.narrow(-2, r0, min(32, d_V - r0))``,
# ``t2.view((L*n_batch, n_rows, …)).permute(1, 0, 2)``, ``t3.expand(*(n_rows,), *t3.shape[-2:])``)
_OPERAND = r"\w+(?:\.\w+\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\))*"
GEMM = re.compile(rf"^(\s+)_matmul_into\(({_OPERAND}), ({_OPERAND}), ({_OPERAND})\)$", re.M)
MIRROR = re.compile(r"^(\s+)_transpose_into\((\w+), (\w+)\)$", re.M)
OPERAND = re.compile(r"^(\s+)(?:torch\.mul\([^\n]*, out=(\w+)\)|(\w+)\.addcmul_\([^\n]*\))$", re.M)
ADDED = re.compile(r"^(\s+)(?:(\w+) \+= ([^\n]*)|(\w+)\.baddbmm_\(([^\n]*)\))$", re.M)


def _touch(dst, src):
    """Read one entry of ``src`` into one entry of ``dst`` (keeps ``src`` live in a trace)."""
    dst[(0,) * dst.dim()] += src[(0,) * src.dim()]


def _not_added(m):
    if m.group(2):
        return f"{m.group(1)}_touch({m.group(2)}, {m.group(3)})"
    return f"{m.group(1)}_touch({m.group(4)}, torch.bmm({m.group(5)}))"


VARIANTS = {          # variant -> body -> (rewritten body, statements rewritten)
    "as generated": lambda body: (body, 0),
    "slab GEMMs → fill": lambda body: GEMM.subn(
        lambda m: f"{m.group(1)}({m.group(4)}).fill_(1.0); _touch({m.group(4)}, {m.group(3)})", body),
    "slab GEMMs → no write": lambda body: GEMM.subn(
        lambda m: f"{m.group(1)}_touch({m.group(4)}, {m.group(3)})", body),
    "slab operands → fill": lambda body: OPERAND.subn(
        lambda m: f"{m.group(1)}{m.group(2) or m.group(3)}.fill_(0.5)", body),
    "product-rule terms not added": lambda body: ADDED.subn(_not_added, body),
    "product-rule terms removed": lambda body: ADDED.subn(lambda m: f"{m.group(1)}pass", body),
    "transposed copies → fill": lambda body: MIRROR.subn(
        lambda m: f"{m.group(1)}{m.group(3)}.fill_(1.0); _touch({m.group(3)}, {m.group(2)})", body),
}


def routine(text, variant, name):
    """(the function ``name`` of a module text whose body of ``name`` is rewritten, the
    number of statements rewritten). A variant that finds nothing to rewrite stops the run:
    the printer's output has changed and the pattern with it."""
    start = text.index(f"def {name}(")
    end = text.index("\ndef ", start + 1)
    body, count = VARIANTS[variant](text[start:end])
    if variant != "as generated" and not count:
        raise SystemExit(f"{variant}: no statement of {name} matches; update the pattern")
    ns = {"__name__": "anatomy", "_touch": _touch}
    exec(compile(text[:start] + body + text[end:], f"<{variant}>", "exec"), ns)
    return ns[name], count


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", default="post_ln_block", choices=("post_ln_block", "pre_ln_block"),
                    help="a full block (the routine's arguments are X, W_Q, W_K, W_V, W_1, W_2, Y)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    text = (Path(__file__).resolve().parent.parent / "generated" / "torch" / f"{a.layer}.py").read_text()
    name = re.search(r"^def (mse\w*__hessian__full)\(", text, re.M).group(1)
    L, d, dk, dff = 8, 16, 16, 64
    rng = np.random.default_rng(0)

    def value(*shape):
        return torch.tensor(rng.standard_normal(shape) / math.sqrt(shape[0]))

    args = (value(1, L, d), value(d, dk), value(d, dk), value(d, d), value(d, dff), value(dff, d),
            value(1, L, d))
    n = d * dk * 2 + d * d + 2 * d * dff
    fns, counts = {}, {}
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")              # torch.jit.trace's deprecation notice
        for v in VARIANTS:
            fn, counts[v] = routine(text, v, name)
            H = torch.empty((n, n), dtype=torch.float64)
            # traced here, not by symhess.traces (Kernel.traced()): its check compares replays
            # with the eager routine on fresh, uninitialised outputs, and these copies leave
            # parts of H unwritten, so it would fall back to the eager routine
            traced = torch.jit.trace(lambda *x, fn=fn: fn(*x[:-1], out=x[-1]), args + (H,),
                                     check_trace=False)
            fns[v] = (lambda traced=traced, H=H: traced(*args, H))
        times = interleaved(fns, rounds=a.rounds, repeat={v: 5 for v in fns})
    base = times["as generated"]
    print(f"{a.layer} full Hessian {n}×{n} (MSE, L={L}, d={d}, d_K={dk}, d_ff={dff}), traced, "
          f"out= reused, torch threads {a.threads}")
    for v, s in times.items():
        diff = "" if v == "as generated" else \
            f"   → that part costs {(base - s) * 1e3:5.2f} ms ({counts[v]} statements rewritten)"
        print(f"  {v:28s} {s * 1e3:7.2f} ms{diff}")


if __name__ == "__main__":
    main()

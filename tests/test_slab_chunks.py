"""Row-slab operands written a chunk of rows at a time (``printing.code.SlabChunk``).

At the test sizes one chunk holds every row, so the committed kernels run each loop once;
here the full-block routines are rendered with chunks of a single row (every row of R
written, multiplied into H and overwritten in turn, diagonal writes included), and their
slab GEMMs in blocks of two rows (``SLAB_GEMM_ROWS`` for NumPy, ``smallk.BLAS_ROWS`` for
torch's BLAS fallback: the last block shorter), and must
give the same Hessian as the committed routine and as autograd, for one sequence and for a
batch (R then holds each sequence's rows)."""
import math

import numpy as np
import opt_einsum as oe
import pytest
import torch

import symhess as sh
from symhess import codegen, smallk
from symhess.verify import random_values

from test_block_kernels import SIZES, reference


def rendered(name, backend, monkeypatch, entries, rows=codegen.SLAB_GEMM_ROWS):
    monkeypatch.setattr(codegen, "CHUNK_ENTRIES", entries)
    monkeypatch.setattr(codegen, "SLAB_GEMM_ROWS", rows)
    v = codegen.Variant(codegen.lowered(name, "mse", ()), codegen.TARGETS[backend], "x")
    fn = v.make(("hessian", "full"))
    src = f"def f({', '.join(fn.args)}):\n" + "\n".join("    " + ln for ln in fn.lines) + \
        f"\n    return {fn.ret}\n"
    ns = {"np": np, "torch": torch, "math": math, "oe": oe}
    exec("\n".join(codegen.TARGETS[backend]["preamble"]), ns)
    exec(src, ns)
    return ns["f"], src, [a for a in fn.args if "=" not in a]


@pytest.mark.parametrize("name", ["post_ln_block", "pre_ln_block"])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_one_row_chunks_give_the_committed_hessian(name, backend, monkeypatch):
    f, src, args = rendered(name, backend, monkeypatch, 1, rows=2)   # GEMMs of ≤ 2 rows too
    assert src.count("for f0") >= 2 and "n_rows = max(1, min(" in src
    if backend == "torch":      # one call per GEMM: symhess.smallk's BLAS fallback splits rows
        assert "for r0" not in src
        monkeypatch.setattr(smallk, "MAX_K", 0)         # every product through BLAS …
        monkeypatch.setattr(smallk, "BLAS_ROWS", 2)     # … two rows at a time
    else:
        assert "for r0" in src and "min(2, " in src
    d = sh.derive(sh.layer(name), "mse")
    k = sh.kernel(name, backend, "mse")
    for batch in (1, 2):
        seqs = [random_values(d, seed=10 + s, sizes=SIZES) for s in range(batch)]
        values = {n: np.stack([s[n] for s in seqs]) if n in k._data else seqs[0][n]
                  for n in seqs[0]}
        if backend == "torch":
            values = {n: torch.tensor(v) for n, v in values.items()}
        want = k.hessian(values, "full")
        arrays = k._prepare(values)
        got = f(*[arrays[a] for a in args])
        assert float(abs(got - want).max()) <= 1e-13 * float(abs(want).max()), batch
        if batch == 1:
            ref = reference(d, seqs[0], list(d.layer.param_names))
            got = np.asarray(got)
            assert np.linalg.norm(got - ref) <= 1e-10 * np.linalg.norm(ref)


def test_slabs_with_other_writes_are_printed_whole(monkeypatch):
    """The W_K row of the post-LN block writes its operand by GEMMs (not broadcast
    products): its slab keeps one R of all rows; the other four are chunked."""
    _, src, _ = rendered("post_ln_block", "torch", monkeypatch, 1)
    slab_branch = src[:src.index("    return H")]
    assert slab_branch.count("for f0") == 4
    whole = [ln for ln in slab_branch.splitlines() if " = torch.empty((n_batch, L, d_K," in ln]
    assert len(whole) == 1, whole


def test_post_ln_slab_rows_copy_every_block_left_of_the_diagonal(monkeypatch):
    """Each post-LN slab row's leaf depends only on earlier parameters, so the product-rule
    terms lie left of the diagonal; every such block is left out of its row's GEMM and copied
    from its transpose (``Variant._slab``): ten copies in the routine's slab version."""
    seen = {}
    real = codegen.Variant._slab

    def spy(self, rt, i, *args):
        got = real(self, rt, i, *args)
        seen[i] = got and got[1]
        return got

    monkeypatch.setattr(codegen.Variant, "_slab", spy)
    _, src, _ = rendered("post_ln_block", "torch", monkeypatch, codegen.CHUNK_ENTRIES)
    assert seen == {i: [(i, j) for j in range(i)] for i in range(5)}
    slab_branch = src[:src.index("    return H")]
    assert slab_branch.count("_transpose_into(") == 10

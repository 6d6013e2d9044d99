"""The kernels of the full Transformer blocks (committed in generated/ at their defaults):
the whole Hessian of the post-LN and pre-LN blocks against reverse-over-reverse autograd of
the derivation's own loss (LayerNorm's forward-over-reverse issue), and NumPy against torch.

These blocks exercise what attention alone does not: dense terms that share one half (written
as one product with the sum of the other halves) and products batched over an output index.
"""
import numpy as np
import pytest
import torch
from torch.func import jacrev

import symhess as sh
from symhess.evaluate import evaluate
from symhess.verify import autograd_blocks, random_values

SIZES = {"L": 4, "d_V": 6, "d_K": 5, "d_ff": 7}      # distinct sizes
TOL = 1e-9


def reference(d, values, names):
    """The dense Hessian by reverse-over-reverse autograd of the derivation's loss."""
    data = {n: torch.tensor(v) for n, v in values.items()}

    def loss(*ws):
        return evaluate(d.loss_expr, {**data, **dict(zip(names, ws))}, backend="torch")[0, 0]

    params = [data[p] for p in names]
    h = jacrev(jacrev(loss, argnums=tuple(range(len(names)))),
               argnums=tuple(range(len(names))))(*params)
    return torch.cat([torch.cat([h[i][j].reshape(params[i].numel(), params[j].numel())
                                 for j in range(len(names))], 1)
                      for i in range(len(names))]).numpy()


@pytest.mark.parametrize("name", ["post_ln_block", "pre_ln_block"])
def test_full_block_hessian_kernels_match_autograd(name):
    d = sh.derive(sh.layer(name), "mse")
    values = random_values(d, seed=3, sizes=SIZES)
    names = list(d.layer.param_names)
    ref = reference(d, values, names)
    got_np = sh.kernel(name, "numpy", "mse").hessian(values, "full")
    got_t = sh.kernel(name, "torch", "mse").hessian(
        {n: torch.tensor(v) for n, v in values.items()}, "full").numpy()
    scale = np.linalg.norm(ref)
    assert np.linalg.norm(got_np - ref) <= TOL * scale
    assert np.linalg.norm(got_t - ref) <= TOL * scale
    assert np.allclose(got_np, got_np.T, atol=1e-12 * scale)      # a Hessian is symmetric


@pytest.mark.parametrize("part", ["outer", "functional"])
def test_post_ln_hessian_parts_match_autograd(part):
    """The Gauss–Newton split of the whole Hessian (blocks below the diagonal with many terms
    are copied from the transposed block above it, so each part must be symmetric too)."""
    d = sh.derive(sh.layer("post_ln_block"), "mse")
    values = random_values(d, seed=4, sizes=SIZES)
    names = list(d.layer.param_names)
    ref = autograd_blocks(d, values)
    want = np.block([[ref[(p, q, part)] for q in names] for p in names])
    got = sh.kernel("post_ln_block", "numpy", "mse").hessian(values, part)
    assert np.linalg.norm(got - want) <= TOL * np.linalg.norm(want)


def test_causal_post_ln_variant_is_rendered_on_first_use():
    """Only the default options are committed for the blocks (codegen.DEFAULTS_ONLY); the
    causal variant comes from the same printer, in memory, and must agree with autograd."""
    from symhess import codegen, kernels
    committed = codegen.variants("post_ln_block")
    assert [loss for loss, _ in committed] == ["mse", "ce"]
    assert all(dict(opts)["causal"] is False for _, opts in committed)
    k = sh.kernel("post_ln_block", "numpy", "ce", causal=True)
    assert isinstance(k._fns, kernels._LazyTable)
    d = sh.derive(sh.layer("post_ln_block", causal=True), "ce")
    values = random_values(d, seed=6, sizes=SIZES)
    want = autograd_blocks(d, values)[("W_V", "W_1", "full")]
    got = k.hessian_block(values, "W_V", "W_1", "full")
    assert np.linalg.norm(got - want) <= TOL * np.linalg.norm(want)



def _slab_limit(name, backend):
    """The batch size up to which the committed full (MSE) Hessian takes its row-slab
    version (codegen: ``Variant.hessian``), read from the generated source; None if none."""
    import re
    from symhess.codegen import ROOT
    src = (ROOT / "generated" / backend / f"{name}.py").read_text()
    start = re.search(r"\ndef mse\w*__hessian__full\(", src).start()
    body = src[start:src.index("\ndef ", start + 1)]
    m = re.search(r"if n_batch <= (\d+):", body)
    return int(m.group(1)) if m else None


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", ["post_ln_block", "pre_ln_block"])
def test_full_block_hessian_both_versions_match_autograd(name, backend):
    """The row-slab version (batches up to its limit) and the block-by-block version (larger
    batches) of the committed full Hessian: each against the batch mean of per-sequence
    reverse-over-reverse autograd Hessians."""
    limit = _slab_limit(name, backend)
    assert limit is not None and limit >= 1      # the blocks' rows are written as slabs
    d = sh.derive(sh.layer(name), "mse")
    names = list(d.layer.param_names)
    k = sh.kernel(name, backend, "mse")
    for n_batch in (limit, limit + 1):
        seqs = [random_values(d, seed=10 + b, sizes=SIZES) for b in range(n_batch)]
        values = dict(seqs[0])
        for v in ("X", "Y"):
            values[v] = np.stack([s[v] for s in seqs])
        want = np.mean([reference(d, {**values, "X": s["X"], "Y": s["Y"]}, names)
                        for s in seqs], axis=0)
        if backend == "torch":
            got = k.hessian({n: torch.tensor(v) for n, v in values.items()}, "full").numpy()
        else:
            got = k.hessian(values, "full")
        assert np.linalg.norm(got - want) <= TOL * np.linalg.norm(want)


@pytest.mark.parametrize("name, loss, opts", [
    ("post_ln_block", "mse", {"activation": "gelu"}),
    ("post_ln_block", "ce", {"bias": True}),
    ("post_ln_block", "mse", {"affine": "param"}),
    ("pre_ln_block", "mse", {"causal": True, "activation": "gelu"}),
])
def test_uncommitted_block_variants_full_hessian_matches_autograd(name, loss, opts):
    """Variants rendered in memory on first use (GELU's second derivative, biases, LayerNorm
    gains and shifts as parameters, a causal mask) go through the same printer rules as the
    committed kernels (compact tensors, reused sums, slab rows, block-order products): the
    whole Hessian, every block, against reverse-over-reverse autograd."""
    d = sh.derive(sh.layer(name, **opts), loss)
    values = random_values(d, seed=3, sizes=SIZES)
    want = autograd_blocks(d, values)
    k = sh.kernel(name, "torch", loss, **opts)
    got = k.hessian({n: torch.tensor(v) for n, v in values.items()}, "full").numpy()
    names = d.layer.param_names
    offs = np.cumsum([0] + [int(np.prod(values[p].shape)) for p in names])
    for i, p in enumerate(names):
        for j, q in enumerate(names):
            w = want[(p, q, "full")]
            g = got[offs[i]:offs[i + 1], offs[j]:offs[j + 1]]
            assert np.linalg.norm(g - w) <= TOL * max(np.linalg.norm(w), 1e-12), (p, q)

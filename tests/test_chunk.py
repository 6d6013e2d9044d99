"""Compact tensors too large to keep, evaluated one slice of sequences (and tokens) at a time
(``runtime.chunk``), against torch autograd.

A memory budget of a few hundred bytes makes every per-token compact of a full block larger
than ``compact_limit``; the blocks and diagonals are then summed over slices of the batch
and token axes, each slice's compacts formed once.  The numbers must be the batch mean of
the per-sequence autograd Hessians (≤ 1e-10), with the slicing engaged (more networks out of
``chunked`` than in) and without it (the default budget)."""
import numpy as np
import pytest

import symhess as sh
from symhess.calculus.verify import autograd_blocks, random_values
from symhess.runtime import chunk, cost, network as N
from symhess.runtime.numpy_ops import OPS as NP
from symhess.runtime.schedule import Schedule

SIZES = {"L": 3, "d_V": 5, "d_K": 2, "d_ff": 4}
TOL = 1e-10


def _batch(der, seeds):
    vals = [random_values(der, s, sizes=SIZES) for s in seeds]
    values = dict(vals[0])
    for k in ("X", "Y"):
        values[k] = np.stack([v[k] for v in vals])
    return values


def _reference(der, values):
    """The batch mean of the per-sequence autograd blocks (the full Hessian's)."""
    n = values["X"].shape[0]
    per = [autograd_blocks(der, {**values, "X": values["X"][i], "Y": values["Y"][i]})
           for i in range(n)]
    names = der.layer.param_names
    return {(p, q): sum(b[(p, q, "full")] for b in per) / n for p in names for q in names}


def _numpy(x):
    return x.detach().numpy() if hasattr(x, "detach") else np.asarray(x)


@pytest.mark.parametrize("name,backend,seeds", [
    ("post_ln_block", "torch", (0, 1, 2)),
    pytest.param("post_ln_block", "numpy", (3, 4), marks=pytest.mark.slow),
    pytest.param("pre_ln_block", "torch", (5, 6, 7), marks=pytest.mark.slow),
])
def test_sliced_compacts_give_autograds_blocks_and_diagonals(name, backend, seeds):
    der = sh.derive(sh.layer(name), "mse")
    values = _batch(der, seeds)
    ref = _reference(der, values)
    k = sh.kernel(name, backend, "mse")
    names = der.layer.param_names
    rng = np.random.default_rng(len(seeds))
    pairs = [(p, q) for p in names for q in names]
    chosen = [pairs[i] for i in rng.choice(len(pairs), 6, replace=False)]
    for budget in (None, 800, 4000):
        st = k.prepare(values) if budget is None else k.prepare(values, memory_budget=budget)
        sliced = 0
        for p, q in chosen:
            nets = st.nets(p, q, "full")
            sliced += len(list(chunk.chunked(st, {0: nets}, (0, 1)))) > len(nets)
            got = _numpy(st.hessian_block(p, q, "full"))
            scale = max(np.abs(ref[(p, q)]).max(), 1e-300)
            assert np.abs(got - ref[(p, q)]).max() <= TOL * scale, (budget, p, q)
        fresh = k.prepare(values) if budget is None else k.prepare(values, memory_budget=budget)
        order = list(rng.permutation(names))
        together = fresh.diagonals("full", order)          # every slice formed once for all
        assert list(together) == order
        for p in names:
            want = np.diag(ref[(p, p)])
            for got in (_numpy(st.diag(p, "full")), _numpy(together[p])):
                assert np.abs(got - want).max() <= TOL * max(np.abs(want).max(), 1e-300), (budget, p)
            for s in (st, fresh):
                assert abs(float(_numpy(s.trace(p, "full"))) - want.sum()) <= TOL * np.abs(want).sum()
        assert (sliced > 0) == (budget is not None)


def test_slices_follow_the_budget():
    """Between one sequence's compact and the batch's, slices are whole sequences; below one
    sequence's, the token axis is cut as well (more slices); the diagonal does not change."""
    der = sh.derive(sh.layer("post_ln_block"), "mse")
    values = _batch(der, (8, 9))
    want = np.diag(_reference(der, values)[("W_1", "W_1")])
    k = sh.kernel("post_ln_block", "torch", "mse")
    counts = []
    for budget in (4000, 800):
        st = k.prepare(values, memory_budget=budget)
        per_sequence = SIZES["L"] * SIZES["d_V"] ** 2
        assert (st.schedule.compact_limit >= per_sequence) == (budget == 4000)
        nets = st.nets("W_1", "W_1", "full")
        counts.append(len(list(chunk.chunked(st, {0: nets}, (0,)))))
        got = _numpy(st.diag("W_1", "full"))
        assert np.abs(got - want).max() <= TOL * np.abs(want).max()
    assert len(nets) < counts[0] < counts[1]


def test_attention_moments_over_the_limit_give_autograds_diagonals():
    """Attention's per-token moments over the compact limit are either inlined (the planner
    contracts per token over d_K) or formed in slices, whichever plans fewer flops at the
    call's sizes; either way its diagonals are autograd's."""
    der = sh.derive(sh.layer("attention"), "mse")
    values = _batch(der, (10, 11))
    ref = _reference(der, values)
    k = sh.kernel("attention", "torch", "mse")
    st = k.prepare(values, memory_budget=200)
    got = st.diagonals("full")
    assert any(op.entries > st.schedule.compact_limit for p in der.layer.param_names
               for n in st.nets(p, p, "full") for op in n.ops if hasattr(op, "entries"))
    for p in der.layer.param_names:
        want = np.diag(ref[(p, p)])
        assert np.abs(_numpy(got[p]) - want).max() <= TOL * np.abs(want).max(), p


class _State:
    def __init__(self):
        self.ops, self.like = NP, np.zeros(1)
        self.schedule = Schedule()


def test_a_compact_two_networks_of_a_pass_hold_is_formed_once_for_both():
    """C = X Y (n × m × m, summed over k < m) in two networks C D_1 and C D_2 of one pass: alone,
    each contracts X (Y D) (4 n k m² flops) for less than forming C and using it
    (2 n k m² + 2 n m³); for both, C formed once pays (2 n k m² + 2 · 2 n m³ < 2 · 4 n k m²).
    The pass forms it once, gives each network's einsum, and leaves the compact as it was."""
    n, m, k = 2, 40, 32
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((n, m, k)), rng.standard_normal((n, k, m))
    D = [rng.standard_normal((n, m, m)) for _ in range(2)]
    C = N.Compact("C", [N.net(1, "nik,nkj->nij", X, Y)])
    sums = {i: [N.net(1, "nij,njl->nil", C, D[i])] for i in range(2)}
    with cost.counting() as c:
        out = chunk.dense_each(_State(), sums, (0,))
    assert c.flops == 2 * n * k * m * m + 2 * 2 * n * m ** 3 < 2 * 4 * n * k * m * m
    assert C.users == 1
    for i in range(2):
        want = np.einsum("nik,nkj,njl->nil", X, Y, D[i]).reshape(-1)
        assert np.abs(out[i] - want).max() <= 1e-12 * np.abs(want).max()

"""Networks that agree but for a sub-network, contracted once over the sum of those
sub-networks (``runtime.collect``), against the networks reduced one by one and autograd."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

import symhess as sh
from symhess.calculus.verify import autograd_blocks, random_values
from symhess.runtime import chunk, collect, network as N
from symhess.runtime.numpy_ops import OPS as NP
from symhess.runtime.schedule import Schedule

TOL = 1e-12

# a family over the shared operands X[n,t,r] A[n,t,h] B[n,t,i] Y[n,t,c] (h and i of one size),
# each member with a middle of its own between A and B
MIDDLES = ("dense", "transposed", "product", "identity", "compact", "per_token", "stranger")


class _State:
    def __init__(self, materialise, limit_bytes):
        self.ops, self.like = NP, np.zeros(1)
        self.schedule = Schedule(memory_budget=limit_bytes, materialise=materialise)


def _member(kind, arrays, letters, order, coef):
    """One network of the family, its labels spelled with ``letters`` (a renaming of
    n t r c h i j) and its operands in ``order``."""
    n, t, r, c, h, i, j = letters
    X, A, B, Y = arrays["X"], arrays["A"], arrays["B"], arrays["Y"]
    ops = [(X, n + t + r), (A, n + t + h), (B, n + t + i), (Y, n + t + c)]
    if kind == "dense":
        ops.append((arrays["M"], n + t + h + i))
    elif kind == "transposed":
        ops.append((arrays["M"], n + t + i + h))
    elif kind == "product":
        ops += [(arrays["P"], n + t + h + j), (arrays["Q"], j + i)]
    elif kind == "identity":
        ops[2] = (B, n + t + h)
    elif kind == "compact":
        ops.append((arrays["K"], n + t + h + i))
    elif kind == "per_token":
        ops.append((arrays["V"], t + h + i))
    else:                                   # another array where the others share A
        ops[1] = (arrays["A2"], n + t + h)
        ops.append((arrays["M"], n + t + h + i))
    ops = [ops[k] for k in order if k < len(ops)]
    spec = ",".join(ls for _, ls in ops) + "->" + r + "|" + c
    return N.net(coef, spec, *[op for op, _ in ops])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_collected_networks_reduce_to_the_same_sums(data):
    """Random families (middles: an array, its transpose, a product, the identity, a compact,
    one constant along the batch, and a member that shares less), random coefficients,
    operand orders and label names; the block, its diagonal and its trace agree with the
    networks reduced one by one, whether compacts are materialised, inlined or sliced."""
    nb, nt, w, m, q = (data.draw(st.integers(1, k)) for k in (2, 3, 3, 3, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    shapes = {"X": (nb, nt, w), "A": (nb, nt, m), "A2": (nb, nt, m), "B": (nb, nt, m),
              "Y": (nb, nt, w), "M": (nb, nt, m, m), "P": (nb, nt, m, q), "Q": (q, m),
              "V": (nt, m, m)}
    arrays = {k: rng.standard_normal(s) for k, s in shapes.items()}
    arrays["K"] = N.Compact("K", [N.net(1.0, "ntaj,jb->ntab", arrays["P"], arrays["Q"])])
    kinds = data.draw(st.lists(st.sampled_from(MIDDLES), min_size=1, max_size=7))
    nets = []
    for kind in kinds:
        letters = "".join(rng.permutation(list("ntrchij")))
        order = list(rng.permutation(6))          # a member has at most 6 operands
        nets.append(_member(kind, arrays, letters, order, float(rng.uniform(-2, 2))))
    s = _State(data.draw(st.sampled_from(("auto", "never", "always"))),
               data.draw(st.sampled_from((2 ** 30, 400, 64))))
    want = N.dense(s, nets)
    got_nets = collect.collected(s, nets, (0, 1))
    assert len(got_nets) <= len(nets)
    assert np.allclose(chunk.dense(s, got_nets), want, rtol=TOL, atol=TOL * np.abs(want).max())
    diag = [N.identified(s, n, 0, 1) for n in nets]
    merged = collect.collected(s, diag, (0,))
    scale = TOL * max(np.abs(np.diag(want)).max(), 1e-300)
    assert np.abs(chunk.dense(s, merged, (0,)) - np.diag(want)).max() <= scale
    trace = N.scalar(s, [N.closed(n) for n in merged])
    assert abs(float(trace) - np.trace(want)) <= TOL * max(np.abs(np.diag(want)).sum(), 1e-300)


def test_a_family_of_middles_collects_into_one_network():
    """Four middles between the same two halves (I, J, Jᵀ, JᵀJ per token, as (I + J)ᵀ(I + J)
    between a block's attention and its loss) reduce as one network over their sum."""
    rng = np.random.default_rng(0)
    nb, nt, w, m = 2, 8, 6, 5
    X, A, B, Y = (rng.standard_normal(s) for s in ((nb, nt, w), (nb, nt, m), (nb, nt, m), (nb, nt, w)))
    J = rng.standard_normal((nb, nt, m, m))
    nets = [N.net(1.0, "ntr,nth,nth,ntc->r|c", X, A, B, Y),
            N.net(1.0, "ntr,nth,nthi,nti,ntc->r|c", X, A, J, B, Y),
            N.net(1.0, "ntr,nth,ntih,nti,ntc->r|c", X, A, J, B, Y),
            N.net(1.0, "ntr,nth,ntjh,ntji,nti,ntc->r|c", X, A, J, J, B, Y)]
    s = _State("auto", 2 ** 30)
    got = collect.collected(s, nets, (0, 1))
    assert len(got) == 1
    eye = np.eye(m)
    mid = np.einsum("ntjh,ntji->nthi", eye + J, eye + J)
    want = np.einsum("ntr,nth,nthi,nti,ntc->rc", X, A, mid, B, Y)
    assert np.allclose(N.dense(s, got), want, rtol=TOL, atol=TOL)


def test_the_modern_blocks_key_diagonal_collected_is_autograds(monkeypatch):
    """The modern block's W_K and W_V diagonals (two query heads on one key and value head,
    the MLP's residual between them and the loss) from collected networks: fewer networks,
    autograd's numbers, and the plain schedule's (nothing collected) to 1e-12."""
    der = sh.derive(sh.layer("modern_block"), "mse")
    sizes = {"L": 3, "d_V": 4, "d_K": 2, "d_ff": 5}
    values = random_values(der, 3, sizes=sizes)
    ref = autograd_blocks(der, values)
    st_ = sh.kernel("modern_block", "torch", "mse").prepare(
        {k: torch.as_tensor(v) for k, v in values.items()})
    for p in ("W_K", "W_V"):
        nets = [N.identified(st_, n, 0, 1) for n in st_.nets(p, p, "outer")]
        assert len(collect.collected(st_, nets, (0,))) < len(nets)
        for part in ("outer", "functional", "full"):
            want = np.diag(ref[(p, p, part)])
            got = st_.diag(p, part).detach().numpy()
            assert np.abs(got - want).max() <= 1e-10 * np.abs(want).max(), (p, part)
    monkeypatch.setenv("SYMHESS_SCHEDULE", "plain")
    plain = sh.kernel("modern_block", "torch", "mse").prepare(
        {k: torch.as_tensor(v) for k, v in values.items()})
    assert not plain.schedule.collect
    for p in ("W_K", "W_V"):
        a, b = st_.diag(p, "full").detach().numpy(), plain.diag(p, "full").detach().numpy()
        assert np.abs(a - b).max() <= 1e-12 * np.abs(a).max()

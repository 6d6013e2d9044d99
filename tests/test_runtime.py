"""The kernels' runtime against NumPy's einsum and dense algebra: contraction at any budget,
matrix chains, network reductions, compact tensors materialised or inlined."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, strategies as st

from symhess.runtime import chain, contract as C, network as N
from symhess.runtime.numpy_ops import OPS as NP, mm as np_mm
from symhess.runtime.cost import counting
from symhess.runtime.schedule import Schedule
from symhess.runtime.state import Forward
from symhess.runtime.torch_ops import OPS as TORCH, mm as torch_mm

LETTERS = "abcdefgh"


@st.composite
def networks(draw):
    """A random network: 1-6 operands over up to 6 labels (repeats inside an operand
    allowed), a random subset of the labels as output."""
    n_labels = draw(st.integers(1, 6))
    sizes = [draw(st.integers(1, 4)) for _ in range(n_labels)]
    ops = []
    for _ in range(draw(st.integers(1, 6))):
        k = draw(st.integers(1, 4))
        ops.append(tuple(draw(st.integers(0, n_labels - 1)) for _ in range(k)))
    used = sorted(set(x for o in ops for x in o))
    out = tuple(draw(st.permutations(used))[:draw(st.integers(0, len(used)))])
    seed = draw(st.integers(0, 2 ** 16))
    return sizes, ops, out, seed


def _arrays(sizes, ops, seed):
    """Random operands, every other one laid out in reverse axis order (a strided view)."""
    rng = np.random.default_rng(seed)
    out = [rng.standard_normal([sizes[x] for x in o]) for o in ops]
    return [np.asfortranarray(a) if i % 2 else a for i, a in enumerate(out)]


def _einsum(arrays, ops, out):
    eq = ",".join("".join(LETTERS[x] for x in o) for o in ops) + "->" + "".join(LETTERS[x] for x in out)
    return np.einsum(eq, *arrays)


@given(networks(), st.sampled_from([None, 1, 3, 10 ** 6]))
@example(([2], [(0, 0), (0,), (0, 0)], (), 0), 1)          # a sliced label repeated in an operand
@example(([2, 1, 1, 2], [(0, 0, 0, 3), (0,), (1, 3)], (0,), 0), 1)
def test_contract_matches_einsum_at_any_budget(net, limit):
    sizes, ops, out, seed = net
    arrays = _arrays(sizes, ops, seed)
    want = _einsum(arrays, ops, out)
    size_of = dict(enumerate(sizes))
    before = [a.copy() for a in arrays]
    got = C.contract(NP, arrays, ops, out, limit, size_of)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before))      # operands untouched
    tensors = [torch.from_numpy(a) for a in arrays]                     # same strides
    got_t = C.contract(TORCH, tensors, ops, out, limit, size_of)
    assert np.allclose(got_t.numpy(), want, rtol=1e-12, atol=1e-12)
    assert all(np.array_equal(t.numpy(), b) for t, b in zip(tensors, before))


def test_a_limit_of_one_entry_slices_down_to_scalars():
    rng = np.random.default_rng(5)
    a, b, c = rng.standard_normal((6, 7)), rng.standard_normal((7, 5)), rng.standard_normal((5, 6))
    got = C.contract(NP, [a, b, c], [(0, 1), (1, 2), (2, 0)], (), limit=1)
    assert np.isclose(got, np.trace(a @ b @ c))


def test_slicing_keeps_every_intermediate_under_the_limit():
    """An outer product whose result fits but whose natural order does not is sliced."""
    rng = np.random.default_rng(0)
    a, b, c = rng.standard_normal((30, 40)), rng.standard_normal((40, 50)), rng.standard_normal((50, 30))
    ops, out = [(0, 1), (1, 2), (2, 3)], (0, 3)
    p = C.plan(ops, out, {0: 30, 1: 40, 2: 50, 3: 30}, None)
    assert p.largest > 900
    got = C.contract(NP, [a, b, c], ops, out, limit=900)
    assert np.allclose(got, a @ b @ c)


class _Chains(Forward):
    """A bare prepared state whose products P Q and (P Q)ᵀ are shared by two chains."""

    RUNS = {"P Q": 2}


def test_shared_runs_are_formed_once_and_found_in_either_orientation():
    rng = np.random.default_rng(3)
    P, Q, R, V = (rng.standard_normal(s) for s in [(2, 5, 7), (7, 3), (3, 30), (2, 6, 5)])
    for one_shot in (True, False):
        st = _Chains({"P": P, "Q": Q, "R": R}, {}, 2, NP, Schedule(), P)
        st._one_shot = one_shot
        with counting() as first:
            a = st.mm("P Q R", st.P, st.Q, st.R)
        assert np.allclose(a, P @ Q @ R, rtol=1e-13)
        with counting() as second:           # (P Q)ᵀ found, only the product with V is new
            b = st.mm("Q' P' _", Q.T, np.swapaxes(P, 1, 2), np.swapaxes(V, 1, 2))
        assert np.allclose(b, np.swapaxes(P @ Q, 1, 2) @ np.swapaxes(V, 1, 2), rtol=1e-13)
        assert second.flops == 2 * 2 * 3 * 5 * 6 < first.flops
        c = st.mm_sum("r", (2.0, "P Q _", st.P, st.Q, R), (-1.0, "_ R", P @ Q, st.R))
        assert np.allclose(c, P @ Q @ R, rtol=1e-13)
    with pytest.raises(ValueError, match="names 3 factors, 2 given"):
        st.mm("P Q R", st.P, st.Q)


@given(st.sampled_from(["numpy", "torch"]), st.sampled_from(["r", "l"]), st.booleans(),
       st.lists(st.tuples(st.sampled_from([1.0, -1.0, 0.5, 3.0]), st.integers(1, 3),
                          st.booleans()), min_size=1, max_size=4),
       st.integers(1, 40), st.integers(0, 2 ** 16))
def test_sums_of_products_sharing_an_end_factor(backend, side, mean, spec, width, seed):
    """Σ_t c_t F_t,1 ⋯ F_t,k F (F F_t,1 ⋯ F_t,k on the left), batched or not, its batch mean
    or not: the sum of the products as written, whether F is factored out or not."""
    rng = np.random.default_rng(seed)
    ops, arr = (NP, np.asarray) if backend == "numpy" else (TORCH, torch.tensor)
    n, dims = 2, [3, 4, 5, 2]
    shared = rng.standard_normal((width, 3) if side == "r" else (3, width))
    terms, want = [], 0
    for c, k, batched in spec:
        sizes = dims[:k] + [width] if side == "r" else [width] + dims[1:k] + dims[:1]
        fs = [rng.standard_normal(((n,) if batched and i == 0 else ()) + (sizes[i], sizes[i + 1]))
              for i in range(k)]
        fs = fs + [shared] if side == "r" else [shared] + fs
        prod = fs[0]
        for f in fs[1:]:
            prod = prod @ f
        want = want + c * prod
        terms.append((c, " ".join("_" for _ in fs), *[arr(f) for f in fs]))
    if mean and np.ndim(want) == 3:
        want = want.mean(0)
    state = Forward({"F": shared}, {}, n, ops, Schedule(), arr(shared))
    got = np.asarray(state.mm_sum(side, *terms, mean=mean))
    assert got.shape == want.shape
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_matrix_chain_order_and_values():
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(s) for s in [(50, 4), (4, 60), (60, 3), (3, 70)]]
    assert np.allclose(np_mm(*xs), np.linalg.multi_dot(xs))
    assert chain.order(((50, 4), (4, 60), (60, 3), (3, 70))) == ((0, (1, 2)), 3)
    batched = [rng.standard_normal((2, 5, 6)), rng.standard_normal((6, 7)), rng.standard_normal((7, 3))]
    want = batched[0] @ batched[1] @ batched[2]
    assert np.allclose(np_mm(*batched), want)
    assert np.allclose(torch_mm(*[torch.tensor(x) for x in batched]).numpy(), want)


class _State:
    """The part of a prepared state the reductions read."""

    def __init__(self, materialise="auto", limit_bytes=2 ** 30):
        self.ops, self.like = NP, np.zeros(1)
        self.schedule = Schedule(memory_budget=limit_bytes, materialise=materialise)


def test_reductions_of_a_delta_block():
    """B = (P ⊗ I_k) + (u vᵀ ⊗ w zᵀ): dense, diagonal, trace and Frobenius norms."""
    rng = np.random.default_rng(2)
    m, k = 3, 4
    P = rng.standard_normal((m, m))
    u, v, w, z = (rng.standard_normal(s) for s in (m, m, k, k))
    dense = np.kron(P, np.eye(k)) + np.kron(np.outer(u, v), np.outer(w, z))
    s = _State()
    nets = [N.net(1.0, "ac->ab|cb", P, free={"b": k}),
            N.net(1.0, "a,c,b,d->ab|cd", u, v, w, z)]
    assert np.allclose(N.dense(s, nets), dense)
    diag = [N.identified(s, n, 0, 1) for n in nets]
    assert np.allclose(N.dense(s, diag, (0,)), np.diag(dense))
    assert np.isclose(N.scalar(s, [N.closed(n) for n in diag]), np.trace(dense))
    assert np.isclose(N.frobenius_sq(s, nets), np.sum(dense ** 2))
    assert np.isclose(N.frobenius_sq(s, nets[:1], nets[1:]),
                      np.sum(np.kron(P, np.eye(k)) * np.kron(np.outer(u, v), np.outer(w, z))))


@given(networks(), st.sampled_from(["numpy", "torch"]))
@example(([3, 4, 2, 5], [(0, 1), (0, 2), (3,)], (0, 1, 2), 1), "torch")      # parts joined by no sum
@example(([3, 4, 2], [(0, 1), (0, 2), (0, 1)], (1, 0, 2), 2), "numpy")
def test_accumulated_networks_match_einsum(net, backend):
    """acc += c · Σ Π operands: a network whose operands fall into parts that share no summed
    label (a per-token outer product, a scaled one) is written in one pass; the same sum."""
    sizes, ops, out, seed = net
    arrays = _arrays(sizes, ops, seed)
    base = np.asarray(np.random.default_rng(seed + 1).standard_normal([sizes[x] for x in out]))
    want = base + 2.5 * _einsum(arrays, ops, out)
    s = _State()
    if backend == "torch":
        s.ops, s.like = TORCH, torch.zeros(1, dtype=torch.float64)
        arrays, acc = [torch.from_numpy(a) for a in arrays], torch.from_numpy(base.copy())
    else:
        acc = base.copy()
    used = {x: sizes[x] for o in ops for x in o}
    got = N.accumulate(s, N.Net(2.5, arrays, ops, (out,), used), (0,), acc)
    assert np.allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ops", [NP, TORCH])
def test_outer_products_on_a_diagonal_of_the_result(ops):
    """Rows (i, a) and columns (i, b) of a block that is zero off i = i′: the rank-one
    terms u_ia v_ib w_i go onto that diagonal only."""
    rng = np.random.default_rng(5)
    u, v, w = rng.standard_normal((3, 4)), rng.standard_normal((3, 2)), rng.standard_normal((3, 6))
    s = _State()
    if ops is TORCH:
        s.ops, s.like = TORCH, torch.zeros(1, dtype=torch.float64)
        u, v, w = (torch.from_numpy(x) for x in (u, v, w))
    got = np.asarray(N.dense(s, [N.net(-1.5, "ia,ib,ic->ia|ib", u, v, w)]))
    want = np.zeros((3, 4, 3, 2))
    for i in range(3):
        want[i, :, i, :] = -1.5 * np.outer(np.asarray(u)[i], np.asarray(v)[i]) * np.asarray(w)[i].sum()
    assert np.allclose(got, want.reshape(12, 6))


def test_identification_refines_atoms():
    """Rows (m, k) against columns (m·k): the diagonal needs the column atom split."""
    rng = np.random.default_rng(3)
    m, k = 3, 5
    M = rng.standard_normal((m, k, m * k))
    s = _State()
    n = N.net(2.0, "abc->ab|c", M)
    want = 2.0 * np.diag(M.reshape(m * k, m * k))
    assert np.allclose(N.dense(s, [N.identified(s, n, 0, 1)], (0,)), want)


@pytest.mark.parametrize("materialise", ["auto", "always", "never"])
def test_compact_tensors_materialised_or_inlined(materialise):
    """A per-row block-diagonal sum (δ_jk a_j − a_j a_k per row) used inside a network."""
    rng = np.random.default_rng(4)
    L, d = 5, 3
    A = rng.random((L, L))
    X = rng.standard_normal((L, d))
    comp = N.Compact("S", [N.net(1.0, "ij,jk->ijk", A, N.EYE, free={"k": L}),
                           N.net(-1.0, "ij,ik->ijk", A, A)])
    jac = np.stack([np.diag(A[i]) - np.outer(A[i], A[i]) for i in range(L)])
    want = np.einsum("ijk,ja,kb->iab", jac, X, X)
    s = _State(materialise)
    got = N.dense(s, [N.net(1.0, "ijk,ja,kb->i|a|b", comp, X, X)], (0, 1, 2))
    assert np.allclose(got.reshape(L, d, d), want)


def test_a_materialised_compact_is_inlined_where_that_plans_fewer_flops():
    """A rank-one compact u_a v_e w_x (L³ entries), once formed, is still inlined into a
    network that contracts it with a matrix (L² flops instead of L³), with the same numbers."""
    rng = np.random.default_rng(5)
    L = 9
    u, v, w, P = rng.standard_normal(L), rng.standard_normal(L), rng.standard_normal(L), rng.standard_normal((L, L))
    comp = N.Compact("D", [N.net(1.0, "a,e,x->aex", u, v, w)])
    s = _State()
    assert np.allclose(comp.array(s), np.einsum("a,e,x->aex", u, v, w)) and comp.materialised
    n = N.net(1.0, "aex,ex->a|", comp, P)
    resolved = N.resolve(s, n, (0,))
    assert all(op.shape != (L, L, L) for m in resolved for op in m.ops)
    assert np.allclose(N.dense(s, [n], (0,)), u * (v @ P @ w))


def _every_method(state, params, v):
    """Every kernel method of a prepared state, as one list of arrays."""
    out = [state.hessian("full"), state.hvp(v, "outer")]
    for p in params:
        out += [state.diag(p, "functional"), np.asarray(state.trace(p, "full"))]
        for q in params:
            split = state.frobenius_split(p, q)
            out += [np.array([split[part] for part in sorted(split)]), state.hessian_block(p, q, "outer")]
    return [np.asarray(x, dtype=float) for x in out]


@pytest.mark.parametrize("name", ["attention", pytest.param("post_ln_block", marks=pytest.mark.slow),
                                  pytest.param("multihead_attention", marks=pytest.mark.slow), "ffn"])
def test_every_tunable_off_gives_the_same_numbers(name, monkeypatch):
    """SYMHESS_SCHEDULE=plain (no cost comparisons, no mirrored blocks, no collected
    networks) and a memory budget small enough to slice contractions give the default
    schedule's numbers to 1e-12."""
    import symhess as sh
    from symhess.calculus.verify import random_values
    d = sh.derive(sh.layer(name), "mse")
    values = random_values(d, seed=5)
    values = {k: (np.stack([v, v[::-1] * 0.7]) if k in ("X", "Y") else v) for k, v in values.items()}
    k = sh.kernel(name, "numpy", "mse")
    params = d.layer.param_names
    n = sum(values[p].size for p in params)
    v = np.random.default_rng(0).standard_normal(n)
    tuned = _every_method(k.prepare(values), params, v)
    monkeypatch.setenv("SYMHESS_SCHEDULE", "plain")
    plain = _every_method(k.prepare(values), params, v)
    monkeypatch.delenv("SYMHESS_SCHEDULE")
    sliced = _every_method(k.prepare(values, memory_budget=4096), params, v)
    for a, b, c in zip(tuned, plain, sliced):
        scale = max(np.abs(a).max(), 1e-300)
        assert np.abs(a - b).max() <= 1e-12 * scale
        assert np.abs(a - c).max() <= 1e-12 * scale


def test_counting_reports_planned_flops_and_nothing_outside():
    """A chain (2,3)(3,4)(4,5) bracketed left: 2·2·3·4 + 2·2·4·5 flops; a contraction reports
    its plan; outside a counting block nothing is recorded."""
    from symhess.runtime import cost
    a, b, c = np.ones((2, 3)), np.ones((3, 4)), np.ones((4, 5))
    with cost.counting() as n:
        np_mm(a, b, c)
    assert n.flops == 2 * 2 * 3 * 4 + 2 * 2 * 4 * 5 and n.largest == 10
    x, y = np.ones((6, 7)), np.ones((7, 8))
    with cost.counting() as m:
        C.contract(NP, [x, y], [(0, 1), (1, 2)], (0, 2))
    assert m.flops == C.plan([(0, 1), (1, 2)], (0, 2), {0: 6, 1: 7, 2: 8}).flops > 0
    np_mm(a, b, c)
    assert n.flops == 2 * 2 * 3 * 4 + 2 * 2 * 4 * 5


def test_counting_blocks_nest():
    """An inner block (opened while the outer one has counted nothing, so both are equal)
    counts its own work, the outer one all of it, and each closes as itself."""
    from symhess.runtime import cost
    a, b = np.ones((2, 3)), np.ones((3, 4))
    with cost.counting() as outer:
        with cost.counting() as inner:
            np_mm(a, b)
        np_mm(a, b)
    assert (inner.flops, outer.flops) == (2 * 2 * 3 * 4, 2 * 2 * 2 * 3 * 4)
    np_mm(a, b)
    assert outer.flops == 2 * 2 * 2 * 3 * 4


_LIN_SHAPES = [((2, 3, 4),), ((2, 3, 1), (2, 3, 4)), ((2, 1, 4), (2, 3, 1))]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("unit", [True, False])
def test_lin_is_the_broadcast_linear_combination(backend, unit):
    """lin((c, x), (c, x, y), …) = Σ c x (∘ y) for broadcast operands, whatever term comes
    first (a per-token column first, no unit coefficient, a product first), and leaves its
    operands untouched."""
    from symhess.runtime import numpy_ops, torch_ops
    rng = np.random.default_rng(4)
    a, b, c = rng.standard_normal((2, 3, 1)), rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 1, 4))
    c0 = 1 if unit else -0.5
    want = c0 * a + 2.5 * b * c - 3 * b + 0.25 * a * c
    conv = (lambda x: x) if backend == "numpy" else torch.tensor
    lin = numpy_ops.lin if backend == "numpy" else torch_ops.lin
    xa, xb, xc = conv(a), conv(b), conv(c)
    copies = [np.array(x) for x in (a, b, c)]
    for terms in ([(c0, xa), (2.5, xb, xc), (-3, xb), (0.25, xa, xc)],
                  [(2.5, xb, xc), (c0, xa), (0.25, xa, xc), (-3, xb)],
                  [(0.25, xa, xc), (-3, xb), (2.5, xb, xc), (c0, xa)]):
        got = np.asarray(lin(*terms))
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-13
    for x, y in zip((xa, xb, xc), copies):
        assert np.array_equal(np.asarray(x), y)


@pytest.mark.parametrize("ops", [NP, TORCH], ids=["numpy", "torch"])
def test_matmul_mean_is_the_batch_mean_of_the_products(ops):
    """mean_n a_n b_n for every layout the fold meets: a laid out (n, K, R) transposed, a
    contiguous (copied or not), one operand unbatched."""
    rng = np.random.default_rng(5)
    conv = (lambda x: x) if ops is NP else torch.tensor
    a, b = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 5, 6))
    want = np.matmul(a, b).mean(0)
    at = conv(np.ascontiguousarray(a.transpose(0, 2, 1)))
    for x in (conv(a), ops.tr(at)):
        assert np.abs(np.asarray(ops.matmul_mean(x, conv(b))) - want).max() <= 1e-13
    w = rng.standard_normal((5, 2))
    assert np.abs(np.asarray(ops.matmul_mean(conv(a), conv(w))) - np.matmul(a, w).mean(0)).max() <= 1e-13
    assert np.abs(np.asarray(ops.matmul_mean(conv(w.T), conv(b))) - np.matmul(w.T, b).mean(0)).max() <= 1e-13


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_lin_accumulates_deferred_products_into_its_sum(backend):
    """lin with deferred products (``Forward.prod``) = Σ c F₁⋯F_k + the other terms, for
    every layout the accumulating GEMM meets (batched times plain, both batched, plain times
    batched, a transposed view, a chain of three), the product first or later; the
    operands are left untouched."""
    from symhess.runtime import numpy_ops, torch_ops
    mod, ops = (numpy_ops, NP) if backend == "numpy" else (torch_ops, TORCH)
    conv = (lambda x: x) if backend == "numpy" else torch.tensor
    rng = np.random.default_rng(6)
    r = lambda *s: rng.standard_normal(s)                          # noqa: E731
    a, w, bb, p, col = r(3, 4, 5), r(5, 6), r(3, 5, 6), r(4, 5), r(3, 4, 1)
    at, v, x = r(3, 5, 4), r(6, 6), r(3, 4, 6)
    s = Forward({}, {}, 3, ops, Schedule(), conv(a))
    cases = [
        ([("_ _", a, w), ("_ _", a, bb), ("_ _", p, bb)], a @ w + 2 * (a @ bb) - 0.5 * (p @ bb)),
        ([("_ _", np.swapaxes(at, 1, 2), w), ("_ _ _", a, w, v)],
         np.swapaxes(at, 1, 2) @ w + 2 * (a @ w @ v)),
    ]
    for prods, want_p in cases:
        copies = [np.array(f) for _, *fs in prods for f in fs]
        coefs = (1, 2, -0.5)
        want = want_p + 0.25 * x - 3 * col * x
        for order in (0, 1):
            terms = [(c, s.prod(k, *map(conv, fs))) for c, (k, *fs) in zip(coefs, prods)]
            terms += [(0.25, conv(x)), (-3, conv(col), conv(x))]
            got = np.asarray(mod.lin(*(terms if order == 0 else terms[::-1])))
            assert got.shape == want.shape
            assert np.abs(got - want).max() <= 1e-12
        flat = [f for _, *fs in prods for f in fs]
        assert all(np.array_equal(f, c) for f, c in zip(flat, copies))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_mul_and_relu_are_the_entrywise_product_and_max(backend):
    """mul(x₁, x₂, …) = x₁ ∘ x₂ ∘ ⋯ for broadcast operands in any order (a column first or
    later), its operands untouched; relu(x) = x H(x)."""
    from symhess.runtime import numpy_ops, torch_ops
    mod = numpy_ops if backend == "numpy" else torch_ops
    conv = (lambda x: x) if backend == "numpy" else torch.tensor
    rng = np.random.default_rng(7)
    col, full, row = rng.standard_normal((2, 3, 1)), rng.standard_normal((2, 3, 4)), rng.standard_normal((1, 4))
    want = col * full * row * full
    for xs in ((col, full, row, full), (full, col, full, row), (row, col, full, full)):
        copies = [np.array(x) for x in xs]
        got = np.asarray(mod.mul(*map(conv, xs)))
        assert got.shape == want.shape and np.abs(got - want).max() <= 1e-13
        assert all(np.array_equal(x, c) for x, c in zip(xs, copies))
    assert np.array_equal(np.asarray(mod.relu(conv(full))),
                          np.asarray(conv(full) * mod.heaviside(conv(full), 0.0)) + 0.0)


@pytest.mark.parametrize("name", ["attention", "multihead_attention"])
def test_token_form_pairings_against_autograd(name):
    """Every block's ‖H_o‖, ‖H_f‖, ‖H‖ with each pairing in token form (``runtime.gram``),
    the factors in tiles of one value of the first token label, against the dense autograd Hessian of a batch of
    three sequences; attention's W_K and W_V pairings do take the token form."""
    import symhess as sh
    from symhess.calculus.verify import autograd_blocks, random_values
    from symhess.runtime import gram
    d = sh.derive(sh.layer(name), "mse")
    first = random_values(d, seed=11)
    seqs = [first] + [{k: np.random.default_rng(s).standard_normal(v.shape) for k, v in first.items()}
                      for s in (1, 2)]
    values = {k: (np.stack([s[k] for s in seqs]) if k in ("X", "Y") else seqs[0][k]) for k in seqs[0]}
    refs = [autograd_blocks(d, {k: (s[k] if k in ("X", "Y") else values[k]) for k in s}) for s in seqs]
    k = sh.kernel(name, "numpy", "mse")
    state = k.prepare(values)
    params = d.layer.param_names
    scale = np.linalg.norm(np.block([[np.mean([r[(p, q, "full")] for r in refs], 0) for q in params]
                                     for p in params]))
    used = 0
    for p in params:
        for q in params:
            o, f = (state.nets(p, q, part) for part in ("outer", "functional"))
            norms = gram.Norms(state, "token", step=1)
            its = gram.items(state, o), gram.items(state, f)
            got = [norms.sq(its[0]), norms.sq(its[1])]
            got.append(gram.frobenius_split_sq(state, o, f, prefer="token", step=1)[2])
            used += norms.pairer.pairs
            for part, x in zip(("outer", "functional", "full"), got):
                want = np.linalg.norm(np.mean([r[(p, q, part)] for r in refs], 0))
                assert abs(np.sqrt(max(float(x), 0.0)) - want) <= 1e-10 * scale, (p, q, part)
    assert used >= 6
    if name == "attention":
        assert all(gram.token_form(state, m) is not None for n in state.nets("W_K", "W_K", "outer")
                   for m in N.resolve(state, n, (0, 1), paired=True))


@given(networks(), st.sampled_from([None, 3, 10 ** 6]))
@example(([3, 4, 5], [(0, 1, 2), (0, 1), (0, 2)], (1, 2), 0), None)     # Σ_e P[e,l,k] Q[e,l] R[e,k]
@example(([3, 4, 5, 2], [(0, 1, 3), (0, 2, 3), (0, 1, 2)], (3, 1, 2), 1), None)   # the triangle
@example(([1, 1, 1, 2], [(0, 3), (3,), (3, 0), (1,)], (0,), 0), None)   # a label in two of three
def test_triangle_steps_match_einsum(net, limit):
    """Every outer product followed by a step that sums one label runs as one loop over that
    label (``TRIANGLE_MIN`` at 1), in tiles of one entry of the result's first label
    (``TRIANGLE_TILE`` at 1): the numbers are einsum's, on both backends."""
    _matches_einsum_with(net, limit, TRIANGLE_MIN=1, TRIANGLE_TILE=1)


def _matches_einsum_with(net, limit, **tunables):
    """The network contracted on both backends with ``tunables`` set in ``runtime.contract``
    gives einsum's numbers."""
    sizes, ops, out, seed = net
    arrays = _arrays(sizes, ops, seed)
    want = _einsum(arrays, ops, out)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in tunables.items():
            mp.setattr(C, name, value)
        got = C.contract(NP, arrays, ops, out, limit, dict(enumerate(sizes)))
        got_t = C.contract(TORCH, [torch.from_numpy(a) for a in arrays], ops, out, limit,
                           dict(enumerate(sizes)))
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.allclose(got_t.numpy(), want, rtol=1e-12, atol=1e-12)


def test_a_triangle_contraction_at_size_forms_nothing_larger_than_its_result():
    """P[e,l,k] Q[e,m,k] R[e,l,m] summed over e at L = 64: einsum's numbers, with a peak
    allocation well under the outer product P Q (|e| times the result) that two pairwise
    steps would write."""
    rng = np.random.default_rng(0)
    e, l, m, k = 64, 64, 64, 16
    P, Q, R = (torch.from_numpy(rng.standard_normal(s)) for s in ((e, l, k), (e, m, k), (e, l, m)))
    sizes = {0: e, 1: l, 2: m, 3: k}
    import tracemalloc
    Pn, Qn, Rn = P.numpy(), Q.numpy(), R.numpy()
    tracemalloc.start()
    got = C.contract(NP, [Pn, Qn, Rn], [(0, 1, 3), (0, 2, 3), (0, 1, 2)], (1, 2, 3), None, sizes)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    want = np.einsum("elk,emk,elm->lmk", Pn, Qn, Rn)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)
    got_t = C.contract(TORCH, [P, Q, R], [(0, 1, 3), (0, 2, 3), (0, 1, 2)], (1, 2, 3), None, sizes)
    assert np.allclose(got_t.numpy(), want, rtol=1e-12, atol=1e-12)
    assert peak < 8 * e * l * m * k / 4          # the outer product alone: 8 e l m k bytes


@given(networks(), st.sampled_from([None, 3, 10 ** 6]))
@example(([2, 3, 4, 5], [(0, 1, 2, 3), (2, 1)], (0, 1, 3), 0), None)  # M[n, a, k, j] W[k, a]
@example(([2, 3, 4, 5], [(0, 1, 2, 3), (2, 3)], (0, 1, 3), 0), None)  # Σ_k M[n, a, k, j] W[k, j]
def test_products_over_stacks_of_views_match_einsum(net, limit):
    """With ``PROMOTE_MIN`` at 1 every product whose larger operand fits a layout only with
    some of its own labels as batch axes runs as a stack of views: einsum's numbers."""
    _matches_einsum_with(net, limit, PROMOTE_MIN=1)


def test_a_per_token_matrix_times_a_weight_over_its_rows_copies_nothing():
    """Σ_k M[t, k, j] W[k, r] for 256 tokens of 64 × 64 matrices: einsum's numbers, with a
    peak allocation of about the result (M is not copied to a (t·j) × k layout)."""
    rng = np.random.default_rng(1)
    t, k, j, r = 256, 64, 64, 64
    M, W = rng.standard_normal((t, k, j)), rng.standard_normal((k, r))
    import tracemalloc
    tracemalloc.start()
    got = C.contract(NP, [M, W], [(0, 1, 2), (1, 3)], (0, 2, 3), None, {0: t, 1: k, 2: j, 3: r})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert np.allclose(got, np.einsum("tkj,kr->tjr", M, W), rtol=1e-12, atol=1e-12)
    assert peak < 1.5 * M.nbytes                # result and copy: 2 M.nbytes


def test_labels_one_operand_carries_are_summed_before_the_product_in_the_plan():
    """P[n, a, b] Q[n, c, e] → (n, a, c) with b and e carried by one operand each: planned
    as two sums and an outer product (O(n (a b + c e + a c))), not over every label at once
    (2 n a b c e), so a per-token LayerNorm Jacobian's rank-one term inlined next to a dense
    per-token matrix plans as cheap as it runs."""
    n, a, b, c, e = 2, 64, 64, 64, 64
    p = C.plan([(0, 1, 2), (0, 3, 4)], (0, 1, 3), {0: n, 1: a, 2: b, 3: c, 4: e})
    assert p.flops <= n * (a * b + c * e) + 2 * n * a * c
    rng = np.random.default_rng(2)
    P, Q = rng.standard_normal((n, a, b)), rng.standard_normal((n, c, e))
    with counting() as m:
        got = C.contract(NP, [P, Q], [(0, 1, 2), (0, 3, 4)], (0, 1, 3), None,
                         {0: n, 1: a, 2: b, 3: c, 4: e})
    assert m.flops == p.flops
    assert np.allclose(got, np.einsum("nab,nce->nac", P, Q), rtol=1e-12, atol=1e-12)


def test_a_plan_weighs_memory_bound_steps_by_the_entries_they_move():
    """An outer product of per-token rows writes n a b entries for n a b flops: its planned
    time is ``MOVE_COST`` per entry moved; a product of per-token 64 × 64 matrices is its
    flops (2 n 64³), which dwarf its traffic."""
    n, a, b = 8, 64, 64
    outer = C.plan([(0, 1), (0, 2)], (0, 1, 2), {0: n, 1: a, 2: b})
    assert outer.cost >= C.MOVE_COST * n * a * b > outer.flops
    gemm = C.plan([(0, 1, 2), (0, 2, 3)], (0, 1, 3), {0: n, 1: a, 2: a, 3: a})
    assert gemm.cost == gemm.flops == 2 * n * a ** 3

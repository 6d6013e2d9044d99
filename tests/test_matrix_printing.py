"""Matrix-view printing (gradients, HVPs): shared products, factored sums, exact results."""
import numpy as np
import pytest

import symhess as sh
from symhess import expr as E
from symhess.codegen import TARGETS
from symhess.evaluate import evaluate
from symhess.printing.code import Routine

L, d_V, d_K = E.dims("L d_V d_K")
X = E.matrix("X", L, d_V)
P = E.matrix("P", L, L)
Q = E.matrix("Q", L, L)
WQ = E.param("W_Q", d_V, d_K)
WK = E.param("W_K", d_V, d_K)
WV = E.param("W_V", d_V, d_V)
VARS = {v.name: v for v in (X, P, Q, WQ, WK, WV)}
SIZES = {"L": 5, "d_V": 7, "d_K": 3}


def routine(sizes=None):
    return Routine(TARGETS["numpy"], dict(VARS), ["X", "P", "Q"], sorted(
        {s for v in VARS.values() for d in v.shape for s in d.free_symbols}, key=lambda s: s.name),
        sizes=sizes)


def run(rt, names, seed=0):
    """Execute the routine's lines (one sequence) and return the named results."""
    rng = np.random.default_rng(seed)
    vals = {n: rng.standard_normal(tuple(int(d.subs({E.dim(k): v for k, v in SIZES.items()}))
                                         for d in VAR.shape))
            for n, VAR in VARS.items()}
    env = {"np": np, "math": __import__("math"), **SIZES, "n_batch": 1}
    env.update({n: (a[None] if n in ("X", "P", "Q") else a) for n, a in vals.items()})
    exec("\n".join(rt.lines), env)
    return [env[n][0] if env[n].ndim == 3 else env[n] for n in names], vals


def products(rt):
    return [line for line in rt.lines if " @ " in line]


def check(rt, exprs, names):
    got, vals = run(rt, names)
    for g, e in zip(got, exprs):
        want = evaluate(e, vals)
        assert np.abs(g - want).max() <= 1e-12 * max(1.0, np.abs(want).max())


def test_product_is_reused_in_the_transposed_orientation():
    rt = routine()
    a = rt.mat(X @ WV)
    b = rt.mat(WV.T @ X.T)            # (X W_V)ᵀ: a view, no second product
    assert len(products(rt)) == 1
    check(rt, [X @ WV, WV.T @ X.T], [a, b])


def test_shared_sub_products_are_amortised_over_the_planned_chains():
    """At L=16, widths 64, X W_Q W_Kᵀ Xᵀ alone ties between its orders; planned with the
    chains that also hold X W_Q and X W_K, it becomes (X W_Q)(X W_K)ᵀ, both reused."""
    exprs = [X @ WQ @ WK.T @ X.T, P @ X @ WK, Q @ X @ WQ]
    rt = routine()
    rt.plan(exprs)
    names = [rt.mat(e) for e in exprs]
    assert len(products(rt)) == 5     # X W_Q, X W_K (or its transpose), T, P·, Q·
    assert not any("W_Q @" in line for line in rt.lines)
    check(rt, exprs, names)


def test_common_outer_factor_of_a_sum_is_multiplied_once():
    e = X.T @ P @ X @ WK + X.T @ Q @ X @ WQ      # Xᵀ (P X W_K + Q X W_Q)
    rt = routine()
    name = rt.mat(e)
    assert sum(line.split(" = ")[1].startswith("np.swapaxes(X") for line in rt.lines) <= 1
    assert len(products(rt)) == 5     # X W_K, X W_Q, P·, Q·, Xᵀ·(sum): one product by Xᵀ
    check(rt, [e], [name])


def test_common_coefficient_and_its_inner_sum_are_shared():
    c1, c2 = 2 / (L * d_V), 3 / L
    e1 = c1 * (P @ X) - c1 * (Q @ X)
    e2 = c2 * (P @ X) - c2 * (Q @ X)
    rt = routine()
    names = [rt.mat(e1), rt.mat(e2)]
    subs = [line for line in rt.lines if " - " in line]
    assert len(subs) == 1             # P X − Q X once, each sum one scaling of it
    assert len(rt.lines) == 5
    check(rt, [e1, e2], names)


def repeated_products(lines):
    """Products `a @ b` of a routine computed twice, also as (b' @ a') with transposed views."""
    view = {}                          # name -> ("T", base) for transposed views
    seen, repeats = set(), []
    for line in lines:
        name, rhs = line.split(" = ", 1)
        if rhs.startswith("np.swapaxes(") and rhs.endswith(", -1, -2)"):
            view[name] = rhs[len("np.swapaxes("):-len(", -1, -2)")]
            continue
        if " @ " not in rhs:
            continue
        a, b = rhs.split(" @ ")

        def tr(x):
            return view.get(x, ("T", x))

        key, tkey = (a, b), (tr(b), tr(a))
        if key in seen or tkey in seen:
            repeats.append(line)
        seen.add(key)
    return repeats


def test_repeated_products_are_detected():
    lines = ["t0 = X @ W_V", "t1 = np.swapaxes(W_V, -1, -2)", "t2 = np.swapaxes(X, -1, -2)",
             "t3 = t1 @ t2"]
    assert repeated_products(lines) == ["t3 = t1 @ t2"]


@pytest.mark.parametrize("layer", ["attention", "ffn"])
def test_generated_matrix_routines_compute_no_product_twice(layer):
    """No product of a gradient/HVP routine is computed twice (up to transposition)."""
    from symhess.codegen import Variant, lowered, variant_tag
    lay = sh.layer(layer)
    opts = tuple(sorted(lay.options.items()))
    v = Variant(lowered(layer, "mse", opts), TARGETS["numpy"], variant_tag("mse", opts))
    for key in (("hvp", "full"), ("gradient",)):
        lines = [line for line in v.make(key).lines if " = " in line]
        assert repeated_products(lines) == []

"""LayerNorm, FFN and full Transformer blocks against torch autograd (float64).

Oracles share no derivative code with the engine: ``symhess.calculus.verify`` differentiates the
forward evaluation with reverse-over-reverse ``torch.func.jacrev`` (safe for LayerNorm),
and the LayerNorm forward itself is checked against ``torch.nn.functional.layer_norm``.

ReLU kinks: derivatives hold almost everywhere, so values are drawn such that every FFN
pre-activation H = Y W_1 (+ b_1) satisfies |H_ij| >= KINK_MARGIN (``kink_safe_values``
tries seeds until it does); autograd and symhess then differentiate the same smooth piece.
"""
from functools import lru_cache

import numpy as np
import pytest
import torch
from torch.func import jacrev

import symhess as sh
from symhess.layers import transformer as T
from symhess.expr.evaluate import InputError, evaluate
from symhess.expr.scalarfn import get_function
from symhess.calculus.verify import autograd_blocks, random_values, relative_error

TOL = 1e-10
KINK_MARGIN = 1e-3
SIZES = {"L": 3, "d_V": 5, "d_K": 2, "d_ff": 4}   # all distinct, d_V >= 3 for LayerNorm


@lru_cache(maxsize=None)
def derivation(name, loss="mse", **opts):
    return sh.derive(sh.layer(name, **opts), loss)


def kink_safe_values(der, seed=0):
    """random_values with every FFN pre-activation at least KINK_MARGIN away from 0."""
    h = der.layer.intermediates.get("H")
    for s in range(seed, seed + 50):
        values = random_values(der, s, sizes=SIZES)
        if h is None or np.abs(evaluate(h, values)).min() >= KINK_MARGIN:
            return values
    raise AssertionError("no kink-free seed found")


def check_all_blocks(der, seed=0):
    values = kink_safe_values(der, seed)
    ref = autograd_blocks(der, values)
    names = der.layer.param_names
    worst = 0.0
    for p in names:
        for q in names:
            scale = max(float(np.linalg.norm(ref[(p, q, part)])) for part in sh.calculus.hessian.PARTS)
            for part in sh.calculus.hessian.PARTS:
                got = der.block(p, q, part).evaluate(values)
                err = relative_error(got, ref[(p, q, part)], scale)
                assert err <= TOL, f"{der.layer.name} {p},{q} {part}: {err:.2e}"
                worst = max(worst, err)
    return worst


CASES = [
    ("post_ln_block", "mse", {}),
    ("post_ln_block", "ce", {}),
    ("pre_ln_block", "mse", {}),
    ("pre_ln_block", "ce", {"causal": True, "activation": "gelu"}),
    ("pre_ln_block", "mse", {"bias": True, "affine": "param", "eps": 1e-5}),
    ("ffn", "mse", {}),
    ("ffn", "ce", {"activation": "gelu", "bias": True, "residual": True}),
    ("layernorm", "mse", {}),
    ("layernorm", "ce", {"eps": 0.25, "affine": "param"}),
    ("layernorm", "mse", {"affine": "const"}),
]


# post-LN with cross-entropy repeats the mse case's checks through a second loss, and pre-LN
# with every option repeats the options the layernorm and ffn cases check: slow profile
SLOW_CASES = [("post_ln_block", "ce", {}),
              ("pre_ln_block", "mse", {"bias": True, "affine": "param", "eps": 1e-5})]


@pytest.mark.parametrize("name,loss,opts", [
    pytest.param(n, l, o, marks=pytest.mark.slow if (n, l, o) in SLOW_CASES else ()) for n, l, o in CASES],
    ids=[f"{n}-{l}-{o}" for n, l, o in CASES])
def test_blocks_match_autograd(name, loss, opts):
    der = derivation(name, loss, **opts)
    check_all_blocks(der, seed=3)


def test_post_ln_has_the_25_blocks():
    der = derivation("post_ln_block")
    assert der.layer.param_names == ("W_Q", "W_K", "W_V", "W_1", "W_2")
    assert len(der.blocks("outer")) == 25


# ----------------------------------------------------------------------------- LayerNorm
@pytest.mark.parametrize("eps,affine", [(0, "none"), (1e-5, "none"), (0.5, "const")])
def test_layernorm_forward_matches_torch(eps, affine):
    lay = sh.layer("layernorm", eps=eps, affine=affine)
    rng = np.random.default_rng(1)
    values = {"X": rng.standard_normal((4, 6))}
    weight = bias = None
    if affine == "const":
        values["gamma"], values["beta"] = rng.standard_normal((1, 6)), rng.standard_normal((1, 6))
        weight, bias = (torch.tensor(values[k][0]) for k in ("gamma", "beta"))
    ref = torch.nn.functional.layer_norm(torch.tensor(values["X"]), (6,), weight, bias, eps=eps)
    got = evaluate(lay.output, values)
    assert np.abs(got - ref.numpy()).max() <= 1e-13


@lru_cache(maxsize=None)
def ln_jacobian_and_hessian():
    lay = sh.layer("layernorm")
    return T.input_jacobian(lay, "X"), T.input_hessian(lay, "X")


def test_layernorm_input_jacobian_and_hessian_match_autograd_and_are_row_local():
    J, H = ln_jacobian_and_hessian()
    L, d = 4, 5
    X = np.random.default_rng(2).standard_normal((L, d))
    Jv, Hv = evaluate(J, {"X": X}), evaluate(H, {"X": X})
    f = lambda x: torch.nn.functional.layer_norm(x, (d,), eps=0.0)
    xt = torch.tensor(X)
    Jref = jacrev(f)(xt).reshape(L * d, L * d).numpy()
    Href = jacrev(jacrev(f))(xt).reshape(L * d * L * d, L * d).numpy()   # reverse-over-reverse
    assert relative_error(Jv, Jref, 0) <= TOL and relative_error(Hv, Href, 0) <= TOL
    # Jacobian: block-diagonal, L blocks of d×d
    J4 = Jv.reshape(L, d, L, d).transpose(0, 2, 1, 3)     # [row i, row j, a, b]
    off = ~np.eye(L, dtype=bool)
    assert np.all(J4[off] == 0) and np.all(J4[~off] != 0)
    # Hessian: the only non-zeros are ∂²y_{ia}/∂x_{ib}∂x_{ic}, L·d³ of them
    H6 = Hv.reshape(L, d, L, d, L, d)
    assert np.count_nonzero(Hv) == L * d ** 3
    i = np.arange(L)
    assert np.count_nonzero(H6[i, :, i, :, i, :]) == L * d ** 3


def test_layernorm_jacobian_is_declared_from_existing_nodes():
    J, _ = ln_jacobian_and_hessian()
    assert "LayerNorm" not in {type(n).__name__ for n in sh.expr.walk(J)}
    assert J.latex()   # printable in the papers' notation


# ----------------------------------------------------------------------------- ReLU structure
def test_relu_second_derivative_is_structurally_zero():
    assert get_function("relu").derivative().derivative().is_zero
    der = derivation("ffn")
    assert der.block("W_1", "W_1", "functional").expr.is_zero
    assert der.block("W_2", "W_2", "functional").expr.is_zero
    assert not der.block("W_1", "W_2", "functional").is_zero
    # GELU is curved: its W_1, W_1 functional block is not zero
    assert not derivation("ffn", activation="gelu").block("W_1", "W_1", "functional").is_zero


# ----------------------------------------------------------------------------- bad input
def test_zero_variance_row_names_the_row():
    der = derivation("layernorm")
    X = np.random.default_rng(0).standard_normal((4, 5))
    X[2] = 0.7
    with pytest.raises(InputError, match=r"LayerNorm Z: row 2 .*zero variance.*eps = 0"):
        der.block("X", "X").evaluate({"X": X, "Y": X})
    # ε > 0 makes the same row legal
    ok = derivation("layernorm", eps=1e-3).block("X", "X").evaluate({"X": X, "Y": X})
    assert np.all(np.isfinite(ok))


def test_zero_variance_inside_a_block_names_the_layernorm():
    der = derivation("post_ln_block")
    values = random_values(der, 0, sizes=SIZES)
    values["W_V"] = np.zeros_like(values["W_V"])   # SA(X) = 0, so LN's input is X
    values["X"][1] = -1.5
    with pytest.raises(InputError, match=r"LayerNorm Y: row 1 "):
        der.block("W_1", "W_2").evaluate(values)


@pytest.mark.parametrize("opts,msg", [
    ({"activation": "tanh"}, r"unknown activation 'tanh'; valid: relu, gelu"),
    ({"eps": -1e-5}, r"eps must be a finite real number >= 0"),
    ({"eps": "small"}, r"eps must be a real number >= 0"),
    ({"affine": "yes"}, r"unknown affine option 'yes'; valid: none, const, param"),
    ({"bias": 1}, r"bias must be True or False"),
])
def test_options_are_validated(opts, msg):
    with pytest.raises(ValueError, match=msg):
        sh.layer("post_ln_block", **opts)


def test_raw_derivative_api_names_unknown_variables():
    with pytest.raises(KeyError, match="unknown block 'W_3'"):
        T.input_jacobian(sh.layer("ffn"), "W_3")

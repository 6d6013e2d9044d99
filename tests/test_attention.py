"""Softmax attention: every block and part against torch autograd, and symbolic facts."""
import numpy as np
import pytest
import sympy as sp

import symhess as sh
from symhess import expr as E
from symhess.calculus.verify import TOLERANCE, autograd_blocks, random_values, verify

PARAMS = ("W_Q", "W_K", "W_V")


@pytest.fixture(scope="module", params=[(loss, causal) for loss in ("mse", "ce") for causal in (False, True)],
                ids=lambda p: f"{p[0]}-{'causal' if p[1] else 'full'}")
def derivation(request):
    loss, causal = request.param
    return sh.derive(sh.layer("attention", causal=causal), loss)


@pytest.mark.parametrize("seed", [0, 7])
def test_every_block_matches_autograd(derivation, seed):
    checks, values = verify(derivation, seed=seed)
    assert values["W_Q"].shape[1] != values["W_V"].shape[1], "d_K must differ from d_V"
    assert len(checks) == 9 * 3
    bad = [(c.block, c.part, c.error) for c in checks if c.error > TOLERANCE]
    assert not bad


def test_blocks_are_symmetric_after_contraction(derivation):
    values = random_values(derivation, seed=3)
    for p in PARAMS:
        for q in PARAMS:
            a = derivation.block(p, q, "full").evaluate(values)
            b = derivation.block(q, p, "full").evaluate(values)
            np.testing.assert_allclose(a, b.T, rtol=1e-12, atol=1e-13)


def test_structural_zero_value_value_functional(derivation):
    assert derivation.block("W_V", "W_V", "functional").is_zero
    assert isinstance(derivation.block("W_V", "W_V", "functional").expr, E.Zero)
    assert not derivation.block("W_V", "W_V", "outer").is_zero
    for p, q in [("W_Q", "W_Q"), ("W_K", "W_K"), ("W_Q", "W_K"), ("W_V", "W_Q")]:
        assert not derivation.block(p, q, "functional").is_zero


def test_t_functional_term_only_in_query_key_blocks(derivation):
    for p in PARAMS:
        for q in PARAMS:
            b = derivation.block(p, q, "functional", at="T")
            assert b.is_zero == ({p, q} != {"W_Q", "W_K"}), (p, q)


def test_t_functional_term_is_part_of_the_functional_block(derivation):
    """H_f(Q,K) minus the T-split term has no first-order-only softmax term left."""
    values = random_values(derivation, seed=5)
    ref = autograd_blocks(derivation, values)
    t_term = derivation.block("W_Q", "W_K", "functional", at="T").evaluate(values)
    assert np.linalg.norm(t_term) > 1e-6 * np.linalg.norm(ref[("W_Q", "W_K", "functional")])
    rest = derivation.block("W_Q", "W_K", "functional").expr
    # the remaining term is the second-order softmax term, printed through Z_2
    assert "Z_2" in repr(rest) and "∂softmax_rows(" in repr(rest)


def test_text_labels_softmax_derivatives_by_their_argument():
    """The plain-text printer names a softmax derivative after the softmax it differentiates:
    A = softmax_rows(S) gives ∂A/∂S, not a fixed dA/dT; an unnamed argument is written out."""
    L, d = E.dims("L d_V")
    X = E.matrix("X", L, d)
    W = E.param("W_S", d, d)
    S = E.named(X @ W @ X.T, "S")
    A = E.softmax_rows(S)
    assert repr(E.SoftmaxJac(A)) == "∂softmax_rows(S)/∂S"
    assert repr(E.SoftmaxHess(A, X @ X.T)) == "∂²softmax_rows(S)/∂S²[X @ X.T]"
    assert repr(E.SoftmaxJac(E.softmax_rows(X @ X.T))) == "J_softmax(X @ X.T)"
    # in a derivation: the Jacobian of the cross-entropy's softmax over the output F = M_1 W_V
    text = sh.derive(sh.layer("attention"), "ce").block("W_Q", "W_V", "outer").text()
    assert "J_softmax(M_1 @ W_V)" in text and "dA" not in text and "/dT" not in text
    # and a layer whose softmax argument is a declared name
    lay = sh.Layer("named_logits", A @ X, (W,), (X,), {"S": S, "A": A})
    assert repr(sh.derive(lay, "mse").gradient("W_S")) == "X.T @ ∂softmax_rows(S)[G @ X.T] @ X"


def test_latex_uses_paper_notation():
    d = sh.derive(sh.layer("attention"), "mse")
    qq = d.block("W_Q", "W_Q", "outer").latex()
    assert r"\mathbf Z_1^\top" in qq and r"\mathbf Z_1" in qq and r"\otimes" in qq
    assert r"\mathbf M_1" in d.block("W_V", "W_V", "outer").latex()
    assert r"\mathbf Z_2" in d.block("W_Q", "W_Q", "functional").latex()
    kk = d.block("W_K", "W_K", "outer").latex()
    assert r"\mathbf K_{d_{V},d_{K}}" in kk and r"\mathbf K_{d_{K},d_{V}}" in kk
    names = {n.name for n in d.block("W_Q", "W_Q", "outer").definitions()}
    assert {"M_2", "Z_1"} <= names


def test_simplified_and_raw_blocks_agree():
    d = sh.derive(sh.layer("attention", causal=True), "ce")
    values = random_values(d, seed=11)
    for p in PARAMS:
        for q in PARAMS:
            for part in ("outer", "functional"):
                raw = sh.calculus.hessian.Block(d.raw_block(p, q, part), d, (p, q, part)).evaluate(values)
                np.testing.assert_allclose(d.block(p, q, part).evaluate(values), raw, rtol=1e-12, atol=1e-14)


def test_forward_matches_torch_attention():
    import torch
    lay = sh.layer("attention", causal=True)
    d = sh.derive(lay, "mse")
    values = random_values(d, seed=2)
    t = {k: torch.as_tensor(v) for k, v in values.items()}
    L = t["X"].shape[0]
    logits = t["X"] @ t["W_Q"] @ t["W_K"].T @ t["X"].T / t["W_Q"].shape[1] ** 0.5
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    a = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)
    want = (a @ t["X"] @ t["W_V"]).numpy()
    np.testing.assert_allclose(lay.output.evaluate(values), want, rtol=1e-13)


def test_hvp_expressions_match_dense_blocks():
    d = sh.derive(sh.layer("attention"), "ce")
    values = random_values(d, seed=4)
    rng = np.random.default_rng(0)
    v = {f"V_{q}": rng.standard_normal(values[q].shape) for q in PARAMS}
    for part in ("outer", "functional", "full"):
        hv = d.hvp_expressions(part)
        for p in PARAMS:
            got = hv[p].evaluate({**values, **v}).reshape(-1)
            want = sum(d.block(p, q, part).evaluate(values) @ v[f"V_{q}"].reshape(-1) for q in PARAMS)
            np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13)


def test_scale_option_is_a_declared_constant():
    import sympy as sp
    d1 = sh.derive(sh.layer("attention", scale=1), "mse")
    checks, _ = verify(d1, seed=1)
    assert max(c.error for c in checks) <= TOLERANCE
    b = sh.derive(sh.layer("attention", scale="1/sqrt(d_V)"), "mse").block("W_Q", "W_Q", "outer").expr
    L, d_V = E.dims("L d_V")
    assert sp.simplify(b.coef - 2 / (L * d_V**2)) == 0
    with pytest.raises(ValueError, match="which this layer does not have"):
        sh.layer("attention", scale="1/sqrt(d_ff)")


@pytest.mark.parametrize("name", ["attention", "linear_attention", "multihead_attention",
                                  "value_output_attention", "single_matrix_attention",
                                  "attention_stack"])
def test_every_attention_reads_scale_with_one_parser(name):
    """The temperature is positive for every variant, and the named choices mean the same."""
    for bad in (-1, "-1", 0, "-1/sqrt(d_V)"):
        with pytest.raises(ValueError, match="must be positive"):
            sh.layer(name, scale=bad)
    d_V = E.dim("d_V")
    T = next(v for k, v in sh.layer(name, scale="1/sqrt(d_model)").intermediates.items()
             if k.startswith("T"))
    assert next(n.coef for n in E.walk(T) if isinstance(n, E.Scale)) == 1 / sp.sqrt(d_V)


def test_a_negative_scale_on_the_command_line_is_one_line(capsys):
    from symhess.cli.main import main
    assert main(["derive", "attention", "--set", "scale=-1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "symhess: error: scale -1 must be positive"

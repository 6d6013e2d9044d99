"""LayerNorm, FFN and full Transformer blocks, declared with the expression API.

Nothing here has its own derivative: LayerNorm is composed from existing nodes
(centring with ``rowsum``, the biased row variance with a Hadamard square and
``rowsum``, an entrywise ``rsqrt``), so the engine differentiates it like any other
expression and the kernels follow from the generic code generator.

* ``layer_norm(U)``  = (U − rowmean U) ∘ (rowvar U + ε)^{∘−1/2}  [∘ 1γ + 1β]
* ``feed_forward(Y)`` = σ(Y W_1 [+ 1 b_1]) W_2 [+ 1 b_2],  σ ∈ {relu, gelu}
* post-LN block:  Y = LN(X + SA(X)),  Z = LN(Y + FFN(Y))
* pre-LN block:   Y = X + SA(LN(X)),  Z = Y + FFN(LN(Y))

Registered layers: ``layernorm`` (its input X is the "parameter", so ``jacobian("X")``
is the LN input Jacobian), ``ffn``, ``post_ln_block``, ``pre_ln_block``.  For raw
derivatives of any expression use ``input_jacobian`` / ``second_derivative`` /
``input_hessian``.

A LayerNorm row of zero variance with ε = 0 is undefined; every layer declared here
carries a check (``Layer.checks``) that raises ``InputError`` naming the row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import sympy as sp

from ..expr import nodes as E
from ..errors import DeclarationError, OptionError, UnknownNameError
from ..expr.evaluate import InputError, evaluate
from ..calculus.adjoint import adjoint
from ..calculus.kron import vec_jacobian
from ..expr.layer import Layer
from .variants import attention
from .registry import register_layer
from ..expr.latex import bold_name
from ..calculus.rules import differential

ACTIVATIONS = ("relu", "gelu")
AFFINE = ("none", "const", "param")

# a row whose standard deviation is below this fraction of its RMS is constant to
# working precision: its "variance" is rounding noise and LN(row) is meaningless
ZERO_VARIANCE_RTOL = 1e-12


# ----------------------------------------------------------------------------- options
def check_activation(activation) -> str:
    if activation not in ACTIVATIONS:
        raise OptionError(f"unknown activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
    return activation


def check_eps(eps) -> sp.Expr:
    """ε as an exact sympy number (floats become rationals so LaTeX stays readable)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, sp.Number)):
        raise OptionError(f"eps must be a real number >= 0 (0 is the papers' LayerNorm, "
                         f"1e-5 is torch's default), got {eps!r}")
    if not math.isfinite(float(eps)) or float(eps) < 0:
        raise OptionError(f"eps must be a finite real number >= 0, got {eps!r}")
    return sp.nsimplify(eps, rational=True) if isinstance(eps, float) else sp.sympify(eps)


def check_affine(affine) -> str:
    if affine not in AFFINE:
        raise OptionError(f"unknown affine option {affine!r}; valid: {', '.join(AFFINE)} "
                         f"(none: γ=1, β=0; const: γ, β given with the values; param: "
                         f"γ, β are Hessian parameters)")
    return affine


# ----------------------------------------------------------------------------- LayerNorm
@dataclass(frozen=True)
class ZeroVarianceCheck:
    """Raise InputError if a row of a LayerNorm input has zero variance while ε = 0.

    ``input`` is the expression LayerNorm normalises (the kernels compute it for a whole
    batch with a generated routine and call ``check_batch``); calling the check with values
    evaluates it with the interpreter, one sequence at a time."""

    label: str
    input: E.Expr

    def __call__(self, values):
        if isinstance(self.input, E.Var) and self.input.name in values:
            u = _numpy(values[self.input.name])      # the layer's own input: no interpreter
        else:
            try:
                u = np.asarray(evaluate(self.input, {k: _numpy(v) for k, v in values.items()}))
            except InputError:
                return  # the values are incomplete; evaluation itself reports what is missing
        self.check_batch(u[None])

    def check_batch(self, u):
        """The check on ``u`` of shape (N, L, d) (NumPy or torch, any device): one boolean
        comes back to the host unless a row fails; the sequence is named when N > 1."""
        # the biased row variance LN divides by
        var = np.var(u, axis=-1) if isinstance(u, np.ndarray) else u.var(-1, correction=0)
        bad = var <= ZERO_VARIANCE_RTOL ** 2 * (u * u).mean(-1)
        if not bool(bad.any()):
            return
        var, bad = _numpy(var), _numpy(bad)
        seq = int(np.flatnonzero(bad.any(-1))[0])
        rows = np.flatnonzero(bad[seq])
        i = int(rows[0])
        where = f"sequence {seq}, " if bad.shape[0] > 1 else ""
        more = ", rows " + ", ".join(map(str, rows.tolist())) if rows.size > 1 else ""
        raise InputError(
            f"LayerNorm {self.label}: {where}row {i} (0-based) of its input has zero variance "
            f"(σ² = {var[seq, i]:.3g}{more}) and eps = 0, so LN is undefined there (Petrov et "
            f"al.'s Assumption 2 needs min_i σ_i² > 0); use eps > 0 or inputs whose rows are "
            f"not constant")


def _numpy(v):
    if hasattr(v, "detach"):
        return v.detach().cpu().numpy()
    return np.asarray(v)


def _tex_label(label):
    return label if len(label) == 1 else "{" + label + "}"


def layer_norm(U, eps=0, gamma=None, beta=None, label="Y"):
    """(LN(U), check): LN(U) = M ∘ (σ² 1ᵀ + ε)^{∘−1/2} [∘ 1γ + 1β], M = U − (1/d) U 1 1ᵀ.

    σ² is the biased row variance (1/d) (M∘M) 1; ``gamma``/``beta`` are 1×d (or None).
    Returns the expression and a ``ZeroVarianceCheck`` (None when ε > 0).
    """
    eps = check_eps(eps)
    L, d = U.shape
    t = _tex_label(label)
    M = E.named(U - (1 / d) * E.rowsum(U), f"M_{label}", rf"\mathbf M_{t}")
    var = E.named((1 / d) * E.rowsum(M * M), f"sigma2_{label}", rf"\boldsymbol\sigma^2_{t}")
    shifted = var + eps * E.ones(L, d) if eps != 0 else var
    P = E.named(E.elementwise("rsqrt", shifted), f"P_{label}", rf"\mathbf P_{t}")
    out = M * P
    if gamma is not None:
        out = out * (E.ones(L, 1) @ gamma)
    if beta is not None:
        out = out + E.ones(L, 1) @ beta
    check = None
    if eps == 0:
        check = ZeroVarianceCheck(label, U)
    return E.named(out, label, bold_name(label)), check  # N_1 → \mathbf N_{1}, a TeX symbol


def _affine_vars(affine, d, tag):
    """γ, β (1×d) for an affine option: None, constants or parameters."""
    affine = check_affine(affine)
    if affine == "none":
        return None, None
    make = E.const if affine == "const" else E.param
    suffix = f"_{tag}" if tag else ""
    return (make(f"gamma{suffix}", 1, d, rf"\boldsymbol\gamma{suffix}"),
            make(f"beta{suffix}", 1, d, rf"\boldsymbol\beta{suffix}"))


# ----------------------------------------------------------------------------- FFN
def feed_forward(Y, W1, W2, activation="relu", b1=None, b2=None):
    """σ(Y W_1 + 1 b_1) W_2 + 1 b_2 (biases optional, broadcast over rows by a ones column)."""
    check_activation(activation)
    L = Y.rows
    H = Y @ W1
    if b1 is not None:
        H = H + E.ones(L, 1) @ b1
    out = E.elementwise(activation, H) @ W2
    if b2 is not None:
        out = out + E.ones(L, 1) @ b2
    return out, H


def _ffn_params(d, d_ff, bias):
    W1, W2 = E.param("W_1", d, d_ff), E.param("W_2", d_ff, d)
    if not isinstance(bias, bool):
        raise OptionError(f"bias must be True or False, got {bias!r}")
    if bias:
        return W1, W2, E.param("b_1", 1, d_ff), E.param("b_2", 1, d)
    return W1, W2, None, None


def _self_attention(U, causal):
    """The registered attention declaration with its input X replaced by U."""
    att = attention(causal=causal)
    X = att.inputs[0]
    sub = {X: U}
    F = E.substitute(att.output, sub)
    return F, att.params, {k: E.substitute(v, sub) for k, v in att.intermediates.items()}


def _checks(*cs):
    return tuple(c for c in cs if c is not None)


# ----------------------------------------------------------------------------- layers
@register_layer("layernorm")
def layernorm(eps=0, affine="none") -> Layer:
    """Row-wise LayerNorm Z = (X − rowmean X) ∘ (rowvar X + ε)^{∘−1/2} [∘ 1γ + 1β]; X is the parameter."""
    L, d_V = E.dims("L d_V")
    X = E.param("X", L, d_V)
    gamma, beta = _affine_vars(affine, d_V, "")
    Z, check = layer_norm(X, eps, gamma, beta, label="Z")
    params = (X,) + ((gamma, beta) if affine == "param" else ())
    inputs = (gamma, beta) if affine == "const" else ()
    return Layer("layernorm", Z, params, inputs, {}, {"eps": eps, "affine": affine},
                 layernorm.__doc__, _checks(check))


# code generation orders contractions for representative sizes (64 for a width unless declared):
# an FFN's hidden width is typically 4× the model width, which changes the best order of the
# block-sized products of W_1 and W_2 (post-LN Hessian kernel ≈ 10–20 % faster)
FFN_TYPICAL_SIZES = {"d_ff": 256}


@register_layer("ffn")
def ffn(activation="relu", bias=False, residual=False) -> Layer:
    """F = σ(X W_1 [+ 1 b_1]) W_2 [+ 1 b_2] [+ X], σ ∈ {relu, gelu}."""
    L, d_V, d_ff = E.dims("L d_V d_ff")
    X = E.matrix("X", L, d_V)
    W1, W2, b1, b2 = _ffn_params(d_V, d_ff, bias)
    F, H = feed_forward(X, W1, W2, activation, b1, b2)
    if residual:
        F = F + X
    params = (W1, b1, W2, b2) if bias else (W1, W2)
    return Layer("ffn", F, params, (X,), {"H": H},
                 {"activation": activation, "bias": bias, "residual": residual}, ffn.__doc__,
                 typical_sizes=dict(FFN_TYPICAL_SIZES))


def _block_parts(d_V, d_ff, affine, bias):
    W1, W2, b1, b2 = _ffn_params(d_V, d_ff, bias)
    g1, be1 = _affine_vars(affine, d_V, "1")
    g2, be2 = _affine_vars(affine, d_V, "2")
    extra = tuple(v for v in (b1, b2) if v is not None)
    affine_vars = tuple(v for v in (g1, be1, g2, be2) if v is not None)
    return W1, W2, b1, b2, (g1, be1), (g2, be2), extra, affine_vars


def _block_layer(name, Z, att_params, W1, W2, extra, affine, affine_vars, X, inter, opts, doc, checks):
    params = tuple(att_params) + (W1, W2) + extra
    inputs = (X,)
    if affine == "param":
        params += affine_vars
    elif affine == "const":
        inputs += affine_vars
    return Layer(name, Z, params, inputs, inter, opts, doc, checks,
                 typical_sizes=dict(FFN_TYPICAL_SIZES))


@register_layer("post_ln_block")
def post_ln_block(causal=False, activation="relu", eps=0, bias=False, affine="none") -> Layer:
    """Post-LN block: Y = LN(X + SA(X)), Z = LN(Y + FFN(Y)), FFN(Y) = σ(Y W_1) W_2."""
    check_activation(activation)
    L, d_V, d_ff = E.dims("L d_V d_ff")
    X = E.matrix("X", L, d_V)
    F, att_params, inter = _self_attention(X, causal)
    W1, W2, b1, b2, a1, a2, extra, affine_vars = _block_parts(d_V, d_ff, affine, bias)
    Y, c1 = layer_norm(X + F, eps, *a1, label="Y")
    ffn_out, H = feed_forward(Y, W1, W2, activation, b1, b2)
    S = E.named(Y + ffn_out, "S", r"\mathbf S")
    Z, c2 = layer_norm(S, eps, *a2, label="Z")
    inter = dict(inter, Y=Y, H=H, S=S)
    opts = {"causal": causal, "activation": activation, "eps": eps, "bias": bias, "affine": affine}
    return _block_layer("post_ln_block", Z, att_params, W1, W2, extra, affine, affine_vars, X,
                        inter, opts, post_ln_block.__doc__, _checks(c1, c2))


@register_layer("pre_ln_block")
def pre_ln_block(causal=False, activation="relu", eps=0, bias=False, affine="none") -> Layer:
    """Pre-LN block: Y = X + SA(LN(X)), Z = Y + FFN(LN(Y)), FFN(N) = σ(N W_1) W_2."""
    check_activation(activation)
    L, d_V, d_ff = E.dims("L d_V d_ff")
    X = E.matrix("X", L, d_V)
    W1, W2, b1, b2, a1, a2, extra, affine_vars = _block_parts(d_V, d_ff, affine, bias)
    N1, c1 = layer_norm(X, eps, *a1, label="N_1")
    F, att_params, inter = _self_attention(N1, causal)
    Y = E.named(X + F, "Y", r"\mathbf Y")
    N2, c2 = layer_norm(Y, eps, *a2, label="N_2")
    ffn_out, H = feed_forward(N2, W1, W2, activation, b1, b2)
    Z = Y + ffn_out
    inter = dict(inter, Y=Y, H=H)
    opts = {"causal": causal, "activation": activation, "eps": eps, "bias": bias, "affine": affine}
    return _block_layer("pre_ln_block", Z, att_params, W1, W2, extra, affine, affine_vars, X,
                        inter, opts, pre_ln_block.__doc__, _checks(c1, c2))


# ----------------------------------------------------------------------------- raw derivatives
def _resolve(expr, wrt):
    """(expression, variable) from an Expr or a Layer and a variable or its name."""
    if isinstance(expr, Layer):
        if isinstance(wrt, str):
            wrt = expr.variables.get(wrt) or expr.param(wrt)
        expr = expr.output
    elif isinstance(wrt, str):
        found = {v.name: v for v in E.walk(expr) if isinstance(v, E.Var)}
        if wrt not in found:
            raise UnknownNameError(f"the expression has no variable {wrt!r}; valid: {', '.join(sorted(found))}")
        wrt = found[wrt]
    if not expr.depends_on(wrt):
        raise DeclarationError(f"the expression does not depend on {wrt.name}")
    return expr, wrt


def _dir(var, tag):
    return E.Var(f"d{tag}{var.name}", var.rows, var.cols, "direction")


def input_jacobian(expr, wrt) -> E.Expr:
    """∂vec_r F/∂vec_r W (numerator layout), e.g. the LayerNorm input Jacobian."""
    expr, wrt = _resolve(expr, wrt)
    d = _dir(wrt, "")
    return vec_jacobian(differential(expr, {wrt: d}), d)


def second_derivative(expr, wrt_i, wrt_j) -> E.Expr:
    """∂vec_r(∂F/∂W_i)/∂vec_r W_j: row o·n_i + a (output o, W_i entry a), column = W_j entry."""
    expr, wi = _resolve(expr, wrt_i)
    _, wj = _resolve(expr, wrt_j) if not isinstance(wrt_j, E.Var) else (expr, wrt_j)
    J = input_jacobian(expr, wi)
    dj = _dir(wj, "2")
    return vec_jacobian(E.vec_r(differential(J, {wj: dj})), dj)


def input_hessian(expr, wrt) -> E.Expr:
    """∂²F/∂W² in the layout of conventions §3, e.g. the LayerNorm input Hessian H_LN."""
    expr, wrt = _resolve(expr, wrt)
    return second_derivative(expr, wrt, wrt)


def contracted_second_derivative(expr, wrt_i, wrt_j, cotangent="G"):
    """((vec_r G)ᵀ ⊗ I) ∂²F/∂W_i∂W_j (n_i × n_j) for a free cotangent G shaped like F; returns (expr, G).

    This is the functional block of the loss ⟨G, F⟩.  It never vectorises a Kronecker form,
    so it also covers the attention parameters (whose Kronecker Jacobian holds ∂A/∂T).
    """
    expr, wi = _resolve(expr, wrt_i)
    _, wj = _resolve(expr, wrt_j)
    G = E.Var(cotangent, expr.rows, expr.cols, "const")
    di, dj = _dir(wi, ""), _dir(wj, "2")
    grad = adjoint(differential(expr, {wi: di}), di, G)
    return vec_jacobian(differential(grad, {wj: dj}), dj), G


def second_derivative_values(expr, wrt_i, wrt_j, values, env=None):
    """Dense ∂²F/∂W_i∂W_j (layout of conventions §3), evaluated row block by row block.

    Row block o is the contracted second derivative at G = e_o (one output entry).
    """
    expr, wi = _resolve(expr, wrt_i)
    h, G = contracted_second_derivative(expr, wi, wrt_j)
    vals = {k: _numpy(v) for k, v in values.items()}
    shape = np.shape(evaluate(expr, vals, env=env))
    rows = []
    for o in range(int(np.prod(shape))):
        g = np.zeros(shape)
        g.flat[o] = 1.0
        rows.append(evaluate(h, dict(vals, **{G.name: g}), env=env))
    return np.concatenate(rows, axis=0)

"""The matrix view: transpose a linear map to get gradients as plain matrix expressions.

``adjoint(L, D, G)`` returns the matrix Ḡ with ⟨G, L(D)⟩ = ⟨Ḡ, D⟩ for an expression
``L`` linear in the direction ``D``.  Applied to a differential dF[D] it gives the
gradient (vector–Jacobian product) without any Kronecker product; cotangents are
accumulated once per node of the DAG (reverse mode).
"""
from __future__ import annotations

from ..expr import nodes as E
from ..expr.registry import Registry

ADJOINTS = Registry("adjoint rule for")   # how a cotangent passes from a linear node to a child
adjoint_rule = ADJOINTS.register


def adjoint(lin: E.Expr, direction: E.Var, cot: E.Expr) -> E.Expr:
    """Ḡ with ⟨cot, lin(D)⟩ = ⟨Ḡ, D⟩, where ``lin`` is linear in ``direction``."""
    return adjoints(lin, [direction], cot)[direction]


def adjoints(lin: E.Expr, directions, cot: E.Expr) -> dict:
    """{D: Ḡ_D} with ⟨cot, lin(D₁, …, D_k)⟩ = Σ_D ⟨Ḡ_D, D⟩, for ``lin`` linear in the
    ``directions`` jointly: one reverse pass for all of them, so the cotangent of every node
    that several directions pass through is one node (the gradients of all parameters from
    the differential in all of them share their backward pass, as in reverse mode)."""
    dirs = set(directions)
    nodes = [n for n in E.walk(lin) if n.free_vars & dirs]
    out = {}
    contrib = {lin: [cot]} if nodes else {}
    for node in reversed(nodes):
        parts = contrib.pop(node, [])
        if not parts:
            continue
        g = E.add(*parts)
        if node in dirs:
            out[node] = g
            continue
        fn = ADJOINTS.get(type(node))
        if fn is None:
            names = ", ".join(sorted(d.name for d in node.free_vars & dirs))
            raise NotImplementedError(f"{type(node).__name__} is not linear in "
                                      f"{names}, or has no adjoint rule")
        for j, child in enumerate(node.args):
            if child.free_vars & dirs:
                contrib.setdefault(child, []).append(fn(node, j, g))
    return {d: out.get(d, E.zero(*d.shape)) for d in directions}


@adjoint_rule(E.MatMul)
def _matmul(n, j, g):
    """A X B ↦ Aᵀ G Bᵀ."""
    f = n.args
    left = [E.transpose(a) for a in reversed(f[:j])]
    right = [E.transpose(b) for b in reversed(f[j + 1:])]
    return E.matmul(*left, g, *right)


@adjoint_rule(E.Add)
def _add(n, j, g):
    """Each term receives G."""
    return g


@adjoint_rule(E.Scale)
def _scale(n, j, g):
    """cX ↦ cG."""
    return E.scale(n.coef, g)


@adjoint_rule(E.Transpose)
def _transpose(n, j, g):
    """Xᵀ ↦ Gᵀ."""
    return E.transpose(g)


@adjoint_rule(E.Hadamard)
def _hadamard(n, j, g):
    """C ∘ X ↦ C ∘ G."""
    others = n.args[:j] + n.args[j + 1:]
    return E.hadamard(*others, g)


@adjoint_rule(E.Kron)
def _kron(n, j, g):
    """L ⊗ X ⊗ R ↦ Σ L[a,b] R[c,e] G[(a,i,c),(b,j,e)] (a partial contraction)."""
    f = n.args
    x = f[j]
    left = E.kron(*f[:j]) if j > 0 else None
    right = E.kron(*f[j + 1:]) if j < len(f) - 1 else None
    if right is not None:
        rows = (left.rows if left is not None else 1) * x.rows
        cols = (left.cols if left is not None else 1) * x.cols
        g = E.kron_contract(g, right, "left", rows, cols)
    if left is not None:
        g = E.kron_contract(g, left, "right", x.rows, x.cols)
    return g


@adjoint_rule(E.SoftmaxDiff)
def _softmax_diff(n, j, g):
    """dA[·] is self-adjoint: ⟨G, dA[E]⟩ = ⟨dA[G], E⟩ (third cumulants are symmetric)."""
    if j != 1:
        raise NotImplementedError("softmax differential is linear only in its direction")
    return E.softmax_diff(n.args[0], g)


@adjoint_rule(E.SoftmaxDiff2)
def _softmax_diff2(n, j, g):
    """⟨G, d²A[E, F]⟩ is symmetric in (G, E, F): ⟨G, d²A[E, F]⟩ = ⟨d²A[E, G], F⟩."""
    a, e, f = n.args
    if j == 2:
        return E.softmax_diff2(a, e, g)
    if j == 1:
        return E.softmax_diff2(a, f, g)
    raise NotImplementedError("softmax second differential is not linear in A")


@adjoint_rule(E.Diag)
def _diag(n, j, g):
    """diag(v) ↦ diagpart(G)."""
    return E.diag_part(g)


@adjoint_rule(E.DiagPart)
def _diag_part(n, j, g):
    """diagpart(A) ↦ diag(g)."""
    return E.diag(g)


@adjoint_rule(E.VecR)
def _vec(n, j, g):
    """vec_r(A) ↦ unvec(g)."""
    a = n.args[0]
    return E.unvec_r(g, a.rows, a.cols)


@adjoint_rule(E.UnvecR)
def _unvec(n, j, g):
    """unvec(v) ↦ vec_r(G)."""
    return E.vec_r(g)


@adjoint_rule(E.KronContract)
def _kron_contract(n, j, g):
    """KC(G₀, C) is the adjoint of D ↦ C⊗D; its own adjoints are C⊗G and KC(G₀, G)."""
    g0, c = n.args
    side = n.params[0]
    if j == 0:
        return E.kron(c, g) if side == "right" else E.kron(g, c)
    other = "left" if side == "right" else "right"
    return E.kron_contract(g0, g, other, c.rows, c.cols)


@adjoint_rule(E.Named)
def _named(n, j, g):
    """Names are transparent."""
    if j != 0:
        raise NotImplementedError("shown arguments of a name are not differentiable")
    return g

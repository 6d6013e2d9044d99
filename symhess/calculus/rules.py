"""First-order differential rules, one per node type.

A rule states the differential of its node, dN, given the node and the differentials
of its children (``d``): a matrix expression that is linear in the directions.  The
Kronecker view (``calculus/kron.py``) and the matrix (gradient) view (``calculus/adjoint.py``) both follow
from this one linear map, and a second derivative is the differential of a first.
"""
from __future__ import annotations

from ..expr import nodes as E
from ..expr.registry import Registry

RULES = Registry("differential rule for")
rule = RULES.register


def differential(expr: E.Expr, directions: dict, memo=None) -> E.Expr:
    """dF: the differential of ``expr`` along ``directions`` (Var → direction expression).
    ``memo``: {node: its differential}, a dict shared by calls with the same directions, so
    that expressions sharing sub-DAGs (every parameter's gradient shares the backward pass)
    differentiate each shared node once."""
    wrt = frozenset(directions)
    memo = {} if memo is None else memo
    for node in E.walk(expr, skip=memo):
        if not (node.free_vars & wrt) or (isinstance(node, E.Named) and node.frozen):
            memo[node] = E.zero(*node.shape)
        elif isinstance(node, E.Var):
            memo[node] = directions[node]
        else:
            fn = RULES.get(type(node))
            if fn is None:
                raise NotImplementedError(f"no differential rule for {type(node).__name__}")
            memo[node] = fn(node, [memo[a] for a in node.args], memo)
    return memo[expr]


@rule(E.MatMul)
def _matmul(n, d, memo):
    """d(F₁⋯F_k) = Σ_j F₁⋯dF_j⋯F_k."""
    f = n.args
    return E.add(*(E.matmul(*f[:j], dj, *f[j + 1:]) for j, dj in enumerate(d) if not dj.is_zero)) \
        if any(not dj.is_zero for dj in d) else E.zero(*n.shape)


@rule(E.Add)
def _add(n, d, memo):
    """d(ΣF_j) = ΣdF_j."""
    return E.add(*d)


@rule(E.Scale)
def _scale(n, d, memo):
    """d(cF) = c dF."""
    return E.scale(n.coef, d[0])


@rule(E.Transpose)
def _transpose(n, d, memo):
    """d(Fᵀ) = (dF)ᵀ."""
    return E.transpose(d[0])


@rule(E.Kron)
def _kron(n, d, memo):
    """d(F₁⊗⋯⊗F_k) = Σ_j F₁⊗⋯⊗dF_j⊗⋯⊗F_k."""
    f = n.args
    terms = [E.kron(*f[:j], dj, *f[j + 1:]) for j, dj in enumerate(d) if not dj.is_zero]
    return E.add(*terms) if terms else E.zero(*n.shape)   # frozen factors give no terms


@rule(E.Hadamard)
def _hadamard(n, d, memo):
    """d(F₁∘⋯∘F_k) = Σ_j F₁∘⋯∘dF_j∘⋯∘F_k."""
    f = n.args
    terms = [E.hadamard(*f[:j], dj, *f[j + 1:]) for j, dj in enumerate(d) if not dj.is_zero]
    return E.add(*terms) if terms else E.zero(*n.shape)   # frozen factors give no terms


@rule(E.Elementwise)
def _elementwise(n, d, memo):
    """d f(F) = f'(F) ∘ dF."""
    return E.hadamard(E.elementwise(n.fn.derivative(), n.args[0]), d[0])


@rule(E.SoftmaxRows)
def _softmax(n, d, memo):
    """dA = A ∘ (dT − rowsum(A ∘ dT)), A = softmax_rows(T); masked entries stay 0."""
    return E.softmax_diff(n, d[0])


@rule(E.LogSoftmaxRows)
def _log_softmax(n, d, memo):
    """d log softmax(T) = dT − rowsum(softmax(T) ∘ dT)."""
    p = E.softmax_rows(n.args[0])
    return E.add(d[0], E.scale(-1, E.rowsum(E.hadamard(p, d[0]))))


@rule(E.SoftmaxDiff)
def _softmax_diff(n, d, memo):
    """d(dA[E]) = dA[dE] + d²A[E, dT]."""
    a, e = n.args
    dt = memo[a.args[0]]
    return E.add(E.softmax_diff(a, d[1]), E.softmax_diff2(a, e, dt))


@rule(E.SoftmaxDiff2)
def _softmax_diff2(n, d, memo):
    """d(d²A[E,F]) = d²A[dE,F] + d²A[E,dF] (+ d³A[E,F,dT], not needed for Hessians)."""
    a, e, f = n.args
    if not memo[a].is_zero:
        raise NotImplementedError("third derivatives of softmax are not implemented "
                                  "(a Hessian never needs them)")
    return E.add(E.softmax_diff2(a, d[1], f), E.softmax_diff2(a, e, d[2]))


@rule(E.Diag)
def _diag(n, d, memo):
    """d diag(v) = diag(dv)."""
    return E.diag(d[0])


@rule(E.DiagPart)
def _diag_part(n, d, memo):
    """d diagpart(A) = diagpart(dA)."""
    return E.diag_part(d[0])


@rule(E.VecR)
def _vec(n, d, memo):
    """d vec_r(A) = vec_r(dA)."""
    return E.vec_r(d[0])


@rule(E.UnvecR)
def _unvec(n, d, memo):
    """d unvec(v) = unvec(dv)."""
    return E.unvec_r(d[0], *n.params[0:2])


@rule(E.KronContract)
def _kron_contract(n, d, memo):
    """Bilinear in (G, C): d = KC(dG, C) + KC(G, dC)."""
    g, c = n.args
    return E.add(E.kron_contract(d[0], c, *n.params), E.kron_contract(g, d[1], *n.params))


@rule(E.Named)
def _named(n, d, memo):
    """A name is transparent to differentiation (frozen names are constant)."""
    return d[0]

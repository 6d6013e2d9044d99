"""The Kronecker view: vectorise a linear map, vec_r(L(D)) = J · vec_r(D).

``vec_jacobian(L, D)`` returns J as an expression of structured operators (Kronecker
products, commutation matrices, identities, softmax Jacobians …), the papers' notation.
"""
from __future__ import annotations

from ..expr import nodes as E
from ..expr.registry import Registry

VECTORISERS = Registry("vectorisation rule for")
vectoriser = VECTORISERS.register


def vec_jacobian(lin: E.Expr, direction: E.Var) -> E.Expr:
    """J with vec_r(lin) = J vec_r(direction), for ``lin`` linear in ``direction``."""
    memo = {}

    def jac(node):
        if node in memo:
            return memo[node]
        n_out = node.rows * node.cols
        if node == direction:
            out = E.identity(n_out)
        elif not node.depends_on(direction):
            out = E.zero(n_out, direction.rows * direction.cols)
        else:
            fn = VECTORISERS.get(type(node))
            if fn is None:
                raise NotImplementedError(f"{type(node).__name__} is not linear in "
                                          f"{direction.name}, or has no vectorisation rule")
            out = fn(node, jac, direction)
        memo[node] = out
        return out

    return E.bottom_up(jac, lin, lambda n: n.depends_on(direction))


def kron_right_jacobian(p, x):
    """∂vec_r(P⊗X)/∂vec_r X = (I_n ⊗ K_{m,q} ⊗ I_r)(vec_r P ⊗ I_{mr}), P n×q, X m×r."""
    n, q = p.shape
    m, r = x.shape
    perm = E.kron(E.identity(n), E.commutation(m, q), E.identity(r))
    return E.matmul(perm, E.kron(E.vec_r(p), E.identity(m * r)))


def kron_left_jacobian(x, p):
    """∂vec_r(X⊗P)/∂vec_r X = (I_n ⊗ K_{m,q} ⊗ I_r)(I_{nq} ⊗ vec_r P), X n×q, P m×r."""
    n, q = x.shape
    m, r = p.shape
    perm = E.kron(E.identity(n), E.commutation(m, q), E.identity(r))
    return E.matmul(perm, E.kron(E.identity(n * q), E.vec_r(p)))


@vectoriser(E.MatMul)
def _matmul(n, jac, d):
    """vec_r(A X B) = (A ⊗ Bᵀ) vec_r X."""
    f = n.args
    terms = []
    for j, x in enumerate(f):
        if x.depends_on(d):
            left = E.matmul(*f[:j]) if j else E.identity(x.rows)
            right = E.matmul(*f[j + 1:]) if j < len(f) - 1 else E.identity(x.cols)
            terms.append(E.matmul(E.kron(left, E.transpose(right)), jac(x)))
    if len(terms) > 1:
        raise ValueError("expression is not linear in the direction (it appears twice in a product)")
    return terms[0]


@vectoriser(E.Add)
def _add(n, jac, d):
    """vec_r is linear."""
    return E.add(*(jac(t) for t in n.args))


@vectoriser(E.Scale)
def _scale(n, jac, d):
    """vec_r(cX) = c vec_r X."""
    return E.scale(n.coef, jac(n.args[0]))


@vectoriser(E.Transpose)
def _transpose(n, jac, d):
    """vec_r(Xᵀ) = K_{s,r} vec_r X for X ∈ R^{r×s}."""
    x = n.args[0]
    return E.matmul(E.commutation(x.cols, x.rows), jac(x))


@vectoriser(E.Hadamard)
def _hadamard(n, jac, d):
    """vec_r(C ∘ X) = diag(vec_r C) vec_r X."""
    dep = [f for f in n.args if f.depends_on(d)]
    if len(dep) != 1:
        raise ValueError("expression is not linear in the direction (Hadamard of two dependents)")
    others = [f for f in n.args if not f.depends_on(d)]
    return E.matmul(E.diag(E.vec_r(E.hadamard(*others))), jac(dep[0]))


@vectoriser(E.Kron)
def _kron(n, jac, d):
    """Kronecker factors: (I⊗K⊗I)(vec_r P ⊗ I) on the right, (I⊗K⊗I)(I ⊗ vec_r P) on the left."""
    f = n.args
    dep = [j for j, x in enumerate(f) if x.depends_on(d)]
    if len(dep) != 1:
        raise ValueError("expression is not linear in the direction (Kronecker of two dependents)")
    j = dep[0]
    if j == len(f) - 1:
        return E.matmul(kron_right_jacobian(E.kron(*f[:j]), f[j]), jac(f[j]))
    head = E.kron(*f[:-1])
    return E.matmul(kron_left_jacobian(head, f[-1]), jac(head))


@vectoriser(E.SoftmaxDiff)
def _softmax_diff(n, jac, d):
    """vec_r dA[E] = (∂A/∂T) vec_r E."""
    return E.matmul(E.SoftmaxJac(n.args[0]), jac(n.args[1]))


@vectoriser(E.SoftmaxDiff2)
def _softmax_diff2(n, jac, d):
    """vec_r d²A[E, F] = H_A[E] vec_r F, H_A[E] the softmax Hessian contracted with E."""
    a, e, f = n.args
    terms = []
    if f.depends_on(d):
        terms.append(E.matmul(E.SoftmaxHess(a, e), jac(f)))
    if e.depends_on(d):
        terms.append(E.matmul(E.SoftmaxHess(a, f), jac(e)))
    return E.add(*terms)


@vectoriser(E.Diag)
def _diag(n, jac, d):
    """vec_r diag(v) = E_n v."""
    return E.matmul(E.diag_selector(n.rows), jac(n.args[0]))


@vectoriser(E.DiagPart)
def _diag_part(n, jac, d):
    """diagpart(A) = E_nᵀ vec_r A."""
    return E.matmul(E.transpose(E.diag_selector(n.rows)), jac(n.args[0]))


@vectoriser(E.VecR)
def _vec(n, jac, d):
    """vec_r(vec_r A) = vec_r A."""
    return jac(n.args[0])


@vectoriser(E.UnvecR)
def _unvec(n, jac, d):
    """vec_r(unvec v) = v."""
    return jac(n.args[0])


@vectoriser(E.KronContract)
def _kron_contract(n, jac, d):
    """KC(G, C) is linear in G (the transposed Kronecker Jacobian) and in C (a rearranged G)."""
    g, c = n.args
    side = n.params[0]
    terms = []
    if g.depends_on(d):
        shell = E.zero(n.rows, n.cols)
        kj = kron_right_jacobian(c, shell) if side == "right" else kron_left_jacobian(shell, c)
        terms.append(E.matmul(E.transpose(kj), jac(g)))
    if c.depends_on(d):
        terms.append(E.matmul(kron_rearrangement(g, c, side, n.rows, n.cols), jac(c)))
    return E.add(*terms)


def kron_rearrangement(g, c, side, m, n):
    """M with vec_r KC(G, C) = M vec_r C: M[(i,j),(a,b)] = G[(a,i),(b,j)] (side 'right')."""
    p, q = c.shape
    v = E.vec_r(g)
    if side == "right":      # G index (a,i,b,j) -> (a,b,i,j) -> (i,j,a,b)
        v = E.matmul(E.kron(E.identity(p), E.commutation(q, m), E.identity(n)), v)
        v = E.matmul(E.commutation(m * n, p * q), v)
    else:                    # G index (i,a,j,b) -> (i,j,a,b)
        v = E.matmul(E.kron(E.identity(m), E.commutation(n, p), E.identity(q)), v)
    return E.unvec_r(v, m * n, p * q)


@vectoriser(E.Named)
def _named(n, jac, d):
    """Names are transparent."""
    return jac(n.inner)

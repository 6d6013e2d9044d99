"""Display simplification: name the attention moments so blocks read like the papers.

The canonicalising constructors already apply the mixed-product rule, identity and zero
elimination, transpose push-down and commutation algebra.  This module adds a catalogue
of *named* rewrites on product chains, each an exact identity:

* ``M1``:  A X                        → M_1   (attention-weighted token means)
* ``M2``:  (P⊗Q Xᵀ) ∂A/∂T (R⊗X S)     → (P⊗Q) M_2 (R⊗S),   M_2 = (I⊗Xᵀ)∂A/∂T(I⊗X) = blockdiag_i M_2^{(i)}
* ``Z1``:  M_2 (X R⊗S)                → Z_1 (R⊗S),         Z_1 = M_2 (X⊗I)
* ``M3``:  (P⊗Q Xᵀ) H_A[E Xᵀ] (R⊗X S) → (P⊗Q) M_3[E] (R⊗S), M_3[E] = (I⊗Xᵀ)H_A[E Xᵀ](I⊗X)
* ``Z2``:  (P Xᵀ⊗Q) M_3[E] (X R⊗S)    → (P⊗Q) Z_2[E] (R⊗S), Z_2[E] = (X⊗I)ᵀ M_3[E] (X⊗I)

Here X is any input matrix that sits on both sides; A = softmax_rows(T).  Every rewrite
is an equality of matrices, so simplified blocks evaluate to the same numbers.

Termination (by construction, no cap).  ``simplify`` visits each node of the DAG once,
children first, and rewrites each product chain f = (f_1, …, f_n) in three stages, each a
loop of one rewrite whose measure (a natural number) every application strictly decreases:

1. commutations outward, (C⊗D) K S → K (D⊗C) S and S K (C⊗D) → S (D⊗C) K for a
   structured S (a softmax Jacobian or Hessian); measure ``commutation_measure``: the number
   of (K, S) neighbours in the chain.  The rewrite is *oriented*: it applies only when the
   moved K does not land next to another structured operator, so it removes the pair it
   acts on and creates none (the chain's length is unchanged; the new Kronecker factor is
   not a K).  Without that guard S·K·(A⊗B)·S' and S·(B⊗A)·K·S' rewrite into each other
   for ever (two softmax Jacobians in one chain: every second-order block of stacked
   attention layers);
2. moments M_2, M_3 (``_sandwich``); measure ``structured_measure``: the number of softmax
   Jacobian/Hessian nodes in the chain's factor trees outside a ``Named`` node.  Each
   rewrite moves one into a ``Named`` node and builds the new Kronecker factors from
   sub-trees of the old ones (the canonical constructors never create structured nodes);
3. Z_1, Z_2 (``_z_forms``); measure ``moment_measure``: the number of ``Named`` M_2/M_3
   nodes in the factor trees outside another ``Named`` node; each rewrite wraps one.

The measures are exposed so that tests can check the strict decrease step by step.
"""
from __future__ import annotations

import re
from functools import lru_cache

from ..expr import nodes as E

DEFINITIONS = {
    "M_1": r"\mathbf A\mathbf X,\ \text{rows }\boldsymbol\mu_i=\textstyle\sum_j A_{ij}\mathbf x_j",
    "M_2": r"\operatorname{blockdiag}_i\big(\mathbf M_2^{(i)}\big),\ \mathbf M_2^{(i)}="
           r"\textstyle\sum_j A_{ij}(\mathbf x_j-\boldsymbol\mu_i)(\mathbf x_j-\boldsymbol\mu_i)^\top",
    "Z_1": r"\mathbf M_2(\mathbf X\otimes\mathbf I)",
    "M_3": r"\operatorname{blockdiag}_i\big(\textstyle\sum_a E_{ia}\,\mathbf M_3^{(i)}[a,:,:]\big),\ "
           r"\mathbf M_3^{(i)}=\textstyle\sum_j A_{ij}(\mathbf x_j-\boldsymbol\mu_i)^{\otimes 3}",
    "Z_2": r"(\mathbf X\otimes\mathbf I)^\top\mathbf M_3[\mathbf E](\mathbf X\otimes\mathbf I)",
}


def simplify(expr, layer=None, shared=None):
    """Apply the named-moment catalogue bottom-up (``layer`` gives the moment labels and the
    named sub-layer inputs, see ``Moments``).  ``shared``: a ``Simplifier`` whose results
    earlier calls of the same layer already hold (a derivation's blocks share sub-DAGs)."""
    if shared is None:
        shared = Simplifier(layer)
    return shared(expr)


class Simplifier:
    """``simplify`` for one layer, remembering every node it has rewritten (the result for a
    node depends only on the node and the layer)."""

    def __init__(self, layer=None):
        self.ctx = Moments(layer)
        self.memo = {}

    def __call__(self, expr):
        return _simplify(expr, self.ctx, self.memo)


def _simplify(expr, ctx, memo):
    for node in E.walk(expr):
        if node in memo:
            continue
        new = node.rebuild(tuple(memo[a] for a in node.args)) if node.args else node
        if node in ctx.labels:      # a softmax keeps its label through the rewrite of its input
            ctx.labels.setdefault(new, ctx.labels[node])
        if isinstance(new, E.MatMul):
            new = _rewrite_chain(new, ctx)
        elif isinstance(new, E.Scale) and isinstance(new.args[0], E.MatMul):
            new = E.scale(new.coef, _rewrite_chain(new.args[0], ctx))
        elif isinstance(new, E.Named) and isinstance(new.inner, E.Named) and new.inner.name == new.name:
            new = new.inner  # a definition is not renamed by itself
        memo[node] = new
    return memo[expr]


# ----------------------------------------------------------------------------- labels
_KEY = re.compile(r"[A-Za-z]+(\d*)(?:\^(.+))?")


def key_label(key) -> str:
    """The superscript an intermediate's key carries: 'A1' → '1' (head 1), 'A^(2)' → '(2)'
    (sub-layer 2 of a composition), 'A1^(2)' → '1,(2)', 'A' → ''."""
    m = _KEY.fullmatch(key)
    if m is None:
        return ""
    return ",".join(part for part in m.groups() if part)


@lru_cache(maxsize=64)
def _softmax_labels(layer):
    return softmax_labels(layer)


def softmax_labels(layer) -> dict:
    """{softmax node: superscript} for a layer with several softmaxes (heads, sub-layers).

    A softmax declared as an intermediate takes its key's label (``key_label``); when some
    softmax has no label or two share one, all are numbered (1), (2), … in declared order
    (intermediates first, then the order of the output's DAG).  One softmax: no label."""
    if layer is None:
        return {}
    found = [n for n in E.walk(layer.output) if isinstance(n, E.SoftmaxRows)]
    if len(found) < 2:
        return {}
    labels = {}
    for key, node in layer.intermediates.items():
        if isinstance(node, E.SoftmaxRows) and node not in labels:
            labels[node] = key_label(key)
    order = list(labels) + [n for n in found if n not in labels]
    values = [labels.get(n, "") for n in order]
    if "" in values or len(set(values)) < len(values):
        return {n: f"({k})" for k, n in enumerate(order, 1)}
    return {n: labels[n] for n in order}


def superscript(tex, label) -> str:
    """``tex`` with a superscript label: \\mathbf M_1 → \\mathbf M_1^{1}; an existing final
    superscript is extended (\\mathbf W_{Q}^{1} → \\mathbf W_{Q}^{1,(2)}); a template
    with a shown argument ("…\\left[{0}\\right]") gets it before the bracket."""
    if not label:
        return tex
    if "{0}" in tex:
        head, sep, tail = tex.partition(r"\left[")
        return superscript(head.replace("{{", "{").replace("}}", "}"), label) \
            .replace("{", "{{").replace("}", "}}") + sep + tail
    m = re.search(r"\^\{([^{}]*)\}$", tex)
    if m:
        return f"{tex[:m.start()]}^{{{m.group(1)},{label}}}"
    if "^" in tex:
        return f"{{{tex}}}^{{{label}}}"
    return f"{tex}^{{{label}}}"


MOMENT_TEX = {"M_1": r"\mathbf M_1", "M_2": r"\mathbf M_2", "Z_1": r"\mathbf Z_1",
              "M_3": r"\mathbf M_3\left[{0}\right]", "Z_2": r"\mathbf Z_2\left[{0}\right]"}


class Moments:
    """What the catalogue needs from a layer: which matrices are inputs X (the input
    variables and the layer's ``moment_inputs``) and each softmax's label."""

    def __init__(self, layer=None):
        # by name: simplifying a named input's definition (M_1 inside X^{(2)}) keeps its name
        self.inputs = frozenset(n.name for n in getattr(layer, "moment_inputs", ()) or ()
                                if isinstance(n, E.Named))
        self.labels = dict(_softmax_labels(layer)) if layer is not None else {}

    def is_input(self, x) -> bool:
        return ((isinstance(x, E.Var) and x.role == "input")
                or (isinstance(x, E.Named) and x.name in self.inputs))

    def name(self, inner, name, a, **kw):
        """The moment ``name`` of softmax ``a`` (labelled when the layer has several)."""
        return E.named(inner, name, superscript(MOMENT_TEX[name], self.labels.get(a, "")), **kw)


_PLAIN = Moments()


def moment_softmax(named):
    """The softmax a moment (M_1, M_2, Z_1, M_3, Z_2) is built from: a factor of its
    definition (A of A X, the operator of M_2/M_3, the M_2/M_3 inside Z_1/Z_2)."""
    inner = named.inner
    for node in (inner.args if isinstance(inner, E.MatMul) else (inner,)):
        if isinstance(node, (E.SoftmaxJac, E.SoftmaxHess)):
            return node.args[0]
        if isinstance(node, E.SoftmaxRows):
            return node
        if isinstance(node, E.Named) and node.name in MOMENT_TEX:
            return moment_softmax(node)
    return None


# ----------------------------------------------------------------------------- catalogue
def _first(e):
    """(head, rest) with e = head·rest."""
    if isinstance(e, E.MatMul):
        return e.args[0], E.matmul(*e.args[1:])
    return e, E.identity(e.cols)


def _last(e):
    """(rest, tail) with e = rest·tail."""
    if isinstance(e, E.MatMul):
        return E.matmul(*e.args[:-1]), e.args[-1]
    return E.identity(e.rows), e


def _kron2(e):
    return isinstance(e, E.Kron) and len(e.args) == 2


def _ends_with_xt(e, ctx):
    """X with e = (…)Xᵀ, or None."""
    rest, tail = _last(e)
    if isinstance(tail, E.Transpose) and ctx.is_input(tail.args[0]):
        return tail.args[0], rest
    return None, None


def _starts_with_x(e, ctx):
    head, rest = _first(e)
    return (head, rest) if ctx.is_input(head) else (None, None)


def _moment_m1(f, ctx):
    out, i = [], 0
    while i < len(f):
        a, b = f[i], f[i + 1] if i + 1 < len(f) else None
        if isinstance(a, E.SoftmaxRows) and b is not None and ctx.is_input(b):
            out.append(m1(a, b, ctx))
            i += 2
        elif (isinstance(a, E.Transpose) and ctx.is_input(a.args[0]) and isinstance(b, E.Transpose)
              and isinstance(b.args[0], E.SoftmaxRows)):
            out.append(E.transpose(m1(b.args[0], a.args[0], ctx)))
            i += 2
        else:
            out.append(a)
            i += 1
    return out


def m1(a, x, ctx=_PLAIN):
    return ctx.name(E.matmul(a, x), "M_1", a)


def _sandwich(f, i, ctx):
    """Try M2/M3 at position i of a chain: returns the new chain or None."""
    op = f[i]
    if i == 0 or i == len(f) - 1 or not (_kron2(f[i - 1]) and _kron2(f[i + 1])):
        return None
    (p, q), (r, s) = f[i - 1].args, f[i + 1].args
    x, q_rest = _ends_with_xt(q, ctx)
    x2, s_rest = _starts_with_x(s, ctx)
    if x is None or x != x2:
        return None
    n = p.cols
    left, right = E.kron(E.identity(n), E.transpose(x)), E.kron(E.identity(n), x)
    if isinstance(op, E.SoftmaxJac):
        mid = ctx.name(E.matmul(left, op, right), "M_2", op.args[0], symmetric=True)
    elif isinstance(op, E.SoftmaxHess):
        x3, e = _ends_with_xt(op.args[1], ctx)
        if x3 != x:
            return None
        mid = ctx.name(E.matmul(left, op, right), "M_3", op.args[0], symmetric=True, shown=(e,))
    else:
        return None
    return f[:i - 1] + [E.kron(p, q_rest), mid, E.kron(r, s_rest)] + f[i + 2:]


def _z_forms(f, ctx):
    """Z1 = M2 (X⊗I) on either side; Z2[E] = (X⊗I)ᵀ M3[E] (X⊗I) when X sits on both sides."""
    for i, op in enumerate(f):
        if not (isinstance(op, E.Named) and op.name in ("M_2", "M_3")):
            continue
        x = op.inner.args[-1].args[1]  # (I ⊗ X) on the right of the definition
        a = moment_softmax(op)
        right = f[i + 1] if i + 1 < len(f) and _kron2(f[i + 1]) else None
        left = f[i - 1] if i > 0 and _kron2(f[i - 1]) else None
        rx, r_rest = _starts_with_x(right.args[0], ctx) if right is not None else (None, None)
        lx, l_rest = _ends_with_xt(left.args[0], ctx) if left is not None else (None, None)
        eye = E.identity(x.cols)
        if op.name == "M_2" and rx == x:
            z = ctx.name(E.matmul(op, E.kron(x, eye)), "Z_1", a)
            return f[:i] + [z, E.kron(r_rest, right.args[1])] + f[i + 2:]
        if op.name == "M_2" and lx == x:
            z = ctx.name(E.matmul(op, E.kron(x, eye)), "Z_1", a)
            return f[:i - 1] + [E.kron(l_rest, left.args[1]), E.transpose(z)] + f[i + 1:]
        if op.name == "M_3" and rx == x and lx == x:
            z = ctx.name(E.matmul(E.kron(E.transpose(x), eye), op, E.kron(x, eye)), "Z_2", a,
                         symmetric=True, shown=op.args[1:])
            return f[:i - 1] + [E.kron(l_rest, left.args[1]), z, E.kron(r_rest, right.args[1])] + f[i + 2:]
    return None


_STRUCTURED = (E.SoftmaxJac, E.SoftmaxHess)


def _kron_swap_left(f, i):
    """(C⊗D) K_{c_C,c_D} at f[i-1], f[i] → K_{r_C,r_D} (D⊗C), or None."""
    c, d = f[i - 1].args
    k = f[i]
    if k.params != (c.cols, d.cols):
        return None
    return f[:i - 1] + [E.commutation(c.rows, d.rows), E.kron(d, c)] + f[i + 1:]


def _kron_swap_right(f, i):
    """K_{r_D,r_C} (C⊗D) at f[i], f[i+1] → (D⊗C) K_{c_D,c_C}, or None."""
    c, d = f[i + 1].args
    k = f[i]
    if k.params != (d.rows, c.rows):
        return None
    return f[:i] + [E.kron(d, c), E.commutation(d.cols, c.cols)] + f[i + 2:]


def _structured_at(f, i):
    return 0 <= i < len(f) and isinstance(f[i], _STRUCTURED)


def commutation_measure(f) -> int:
    """The number of (commutation, structured operator) neighbours in the chain f."""
    return sum(1 for i, k in enumerate(f) if isinstance(k, E.Commutation)
               for j in (i - 1, i + 1) if _structured_at(f, j))


def _commutations_outward(f, ctx=None):
    """Move K past a Kronecker product, away from a structured operator:

    (C⊗D) K_{c_C,c_D} = K_{r_C,r_D} (D⊗C)   (and the mirror image on the right),

    only where K does not land next to another structured operator (so that
    ``commutation_measure`` strictly decreases; see the module docstring).
    """
    f = list(f)
    for i, k in enumerate(f):
        if not isinstance(k, E.Commutation):
            continue
        if _structured_at(f, i + 1) and i > 0 and _kron2(f[i - 1]) and not _structured_at(f, i - 2):
            new = _kron_swap_left(f, i)
            if new is not None:
                return new
        if _structured_at(f, i - 1) and i + 1 < len(f) and _kron2(f[i + 1]) and not _structured_at(f, i + 2):
            new = _kron_swap_right(f, i)
            if new is not None:
                return new
    return None


def _unnamed_count(f, pred) -> int:
    """Nodes satisfying ``pred`` in the factor trees of f, not descending into Named nodes
    (a node counts once per path: a tree count)."""
    memo = {}

    def count(node):
        if node in memo:
            return memo[node]
        n = 1 if pred(node) else 0
        if not isinstance(node, E.Named):
            n += sum(count(a) for a in node.args)
        memo[node] = n
        return n
    return sum(count(x) for x in f)


def structured_measure(f) -> int:
    """Softmax Jacobian/Hessian nodes in the chain's factor trees outside a Named node."""
    return _unnamed_count(f, lambda n: isinstance(n, _STRUCTURED))


def moment_measure(f) -> int:
    """Named M_2/M_3 nodes in the chain's factor trees outside another Named node."""
    return _unnamed_count(f, lambda n: isinstance(n, E.Named) and n.name in ("M_2", "M_3"))


def _first_sandwich(f, ctx):
    for i in range(len(f)):
        new = _sandwich(f, i, ctx)
        if new is not None:
            return new
    return None


# the rewrite stages of a product chain, each with the measure it strictly decreases
STAGES = ((_commutations_outward, commutation_measure),
          (_first_sandwich, structured_measure),
          (_z_forms, moment_measure))


def rewrite_steps(factors, layer=None):
    """The chains a product's factors go through: yields (measure, before, after) for every
    rewrite, ``measure`` being the one its stage strictly decreases (see the module docstring)."""
    ctx = Moments(layer)
    return _steps(_moment_m1(list(factors), ctx), ctx)


def _steps(f, ctx):
    for rewrite, measure in STAGES:
        while True:
            new = rewrite(f, ctx)
            if new is None:
                break
            yield measure, f, new
            f = new


def _rewrite_chain(mm, ctx):
    f = _moment_m1(list(mm.args), ctx)
    for _measure, _before, f in _steps(f, ctx):
        pass
    return E.matmul(*f)


def definitions(expr):
    """The named quantities an expression uses (Named nodes, definitions before their uses)."""
    return [node for node in E.walk(expr) if isinstance(node, E.Named)]

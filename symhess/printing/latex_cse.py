"""Common sub-expressions for LaTeX: name large recurring sub-expressions once.

Blocks of deep layers (two LayerNorms, attention and an FFN chained) repeat the same
large sub-expressions (a LayerNorm Jacobian, an attention Jacobian …) many times, so
printed in full a single term runs to hundreds of thousands of characters.  This pass
works on the *printed* DAG (the nodes the LaTeX printer actually descends into; equal
nodes are shared because ``Expr`` hashes structurally):

1. print every root once with a memoising printer that records, for every node, the
   nodes it prints (``children``) and so how often each node is printed (``uses``);
2. visit nodes children-first and reprint each with the names chosen so far; a node
   whose LaTeX is longer than ``max_chars`` gets its longest printed children named
   until it fits; a node printed at least twice whose LaTeX is longer than
   ``min_chars`` is named itself;
3. a node that is the Kronecker Jacobian of one of the layer's named quantities w.r.t.
   a parameter (``jacobian_names``) is named by what it is (∂Y/∂W_Q), the rest are
   numbered; a named sum inside a larger sum is written as its symbol;
4. order the definitions so each comes after the names it uses, and print each in
   terms of the names before it.

Termination: the pass rewrites nothing; step 2 visits each printed node once, and its
inner loop (``_Chooser.shrink``) names one more of the node's printed children per
iteration (a node is never named twice) or stops, so it ends after at most as many
iterations as the node has children.

Every name is a plain substitution (the symbol stands for exactly its definition), so
substituting the definitions back gives the original expression (see ``expand``).
Everything is ordered by the printing order, never by hashes: the output is
byte-identical run to run.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import sympy as sp

from ..expr import nodes as E
from ..expr.latex import LatexPrinter, signed_sum

MIN_CHARS = 160    # a recurring sub-expression shorter than this stays inline
HINT_CHARS = 80    # a sub-expression with a meaningful name (a Jacobian) is named above this
MAX_CHARS = 1200   # no printed line (term or definition) longer than this, where avoidable
_PLACEHOLDER = r"\mathcal J_{000}"  # same length as a final symbol while choosing


@dataclass(frozen=True)
class Shared:
    """A named sub-expression ``symbol := tex``; ``var`` is the symbol as a placeholder variable."""

    symbol: str
    node: E.Expr
    tex: str
    var: E.Var


class _MemoPrinter(LatexPrinter):
    """LaTeX printer that prints each node once and records the nodes each node prints.

    With ``cap`` every node's text is cut to ``cap`` characters: a node prints longer than
    ``cap − 1`` exactly when its capped text has ``cap`` characters (a node's text contains
    the texts of the children it shows), and the texts stay short when the full ones would
    not fit in memory (the unnamed terms of stacked blocks, whose DAGs share sub-expressions
    along exponentially many paths)."""

    def __init__(self, names, cap=None):
        super().__init__(names)
        self.memo, self.children, self.order, self._stack = {}, {}, [], []
        self.cap = cap

    def doprint(self, node) -> str:
        if self._stack:
            self.children.setdefault(self._stack[-1], []).append(node)
        if node in self.names:
            return self.names[node]
        if node not in self.memo:
            self._stack.append(node)
            try:
                text = self._dispatch(node)
            finally:
                self._stack.pop()
            self.memo[node] = text if self.cap is None else text[:self.cap]
            self.order.append(node)
        return self.memo[node]

    def forget(self, node):
        self.memo.pop(node, None)


def _is_operator(node) -> bool:
    """A Kronecker-view operator: a dimension is a product (e.g. L d_V)."""
    return any(isinstance(sp.sympify(d), sp.Mul) for d in node.shape)


def _symbol(letter, k) -> str:
    return rf"\mathcal {letter}_{{{k}}}"


class _Chooser:
    """Greedy bottom-up choice of the nodes to name (see the module docstring)."""

    def __init__(self, roots, names, min_chars, max_chars, hints=None):
        self.base = dict(names or {})
        self.hints = dict(hints or {})
        self.min_chars, self.max_chars = min_chars, max_chars
        rec = _MemoPrinter(self.base, cap=max_chars + 1)   # only its records are used
        for r in roots:
            rec.print(r)
        self.children, self.order = rec.children, rec.order
        self.uses = {}
        for kids in rec.children.values():
            for k in kids:
                self.uses[k] = self.uses.get(k, 0) + 1
        for r in roots:
            self.uses[r] = self.uses.get(r, 0) + 1
        for node in self.order:  # Aᵀ prints A: a use of Aᵀ is a use of A
            if isinstance(node, E.Transpose):
                a = node.args[0]
                self.uses[a] = self.uses.get(a, 0) + self.uses.get(node, 0) - 1
        self.printer = _MemoPrinter(dict(self.base))
        self.chosen = {}

    def eligible(self, node) -> bool:
        return (bool(node.args) and not isinstance(node, (E.Named, E.Transpose))
                and node not in self.base and node not in self.chosen)

    def name(self, node, symbol=None):
        self.chosen[node] = symbol
        self.printer.names[node] = symbol or _PLACEHOLDER
        self.printer.forget(node)

    def tex(self, node) -> str:
        return self.printer.doprint(node) if node not in self.chosen else self.printer.names[node]

    def _target(self, child):
        """The node to name for a printed child (Aᵀ is named through A)."""
        if isinstance(child, E.Transpose) and self.eligible(child.args[0]):
            return child.args[0]
        return child if self.eligible(child) else None

    def shrink(self, node):
        """Name node's longest printed children until node prints within max_chars."""
        while len(self.tex(node)) > self.max_chars:
            best, best_len = None, len(_PLACEHOLDER) + 8
            for child in dict.fromkeys(self.children.get(node, ())):
                target = self._target(child)
                if target is not None and len(self.tex(target)) > best_len:
                    best, best_len = target, len(self.tex(target))
            if best is None:
                return
            self.name(best)
            for child in self.children.get(node, ()):
                if isinstance(child, E.Transpose) and child.args[0] == best:
                    self.printer.forget(child)
            self.printer.forget(node)

    def run(self):
        for node in self.order:
            if not self.eligible(node) and not isinstance(node, E.Transpose):
                continue
            self.shrink(node)
            if not self.eligible(node):
                continue
            if node in self.hints and len(self.tex(node)) > HINT_CHARS:
                self.name(node, self.hints[node])
            elif self.uses.get(node, 0) >= 2 and len(self.tex(node)) > self.min_chars:
                self.name(node)
        return {n: self.chosen[n] for n in self.order if n in self.chosen}


class SharedPrinter(LatexPrinter):
    """LaTeX printer that writes named sums inside larger sums (A + B + C with S := A + B → S + C).

    ``used`` collects the named nodes printed (the dependencies of a definition).
    """

    def __init__(self, names, sums=()):
        super().__init__(names)
        self.sums, self.used = list(sums), {}

    def doprint(self, node) -> str:
        if node in self.names:
            self.used[node] = True
        return super().doprint(node)

    def paren(self, node, parent_precedence) -> str:
        if node in self.names:
            self.used[node] = True
        return super().paren(node, parent_precedence)

    def _print_Add(self, n):
        return signed_sum([self.doprint(t) for t in _fold(n, self.sums)], self.plus, self.minus)

    def children_of(self, node):
        """A sum shows its folded terms."""
        return _fold(node, self.sums) if isinstance(node, E.Add) else super().children_of(node)


def _fold(node, sums):
    """The terms of a sum, every named sum whose terms it all has taken as one term (in place of its first)."""
    items = list(node.args)
    for s in sums:
        if len(s.args) >= len(items) or s == node:
            continue
        where = {a: i for i, a in enumerate(items)}
        if all(a in where for a in s.args):
            first = min(where[a] for a in s.args)
            drop = set(s.args)
            items = [s if i == first else a for i, a in enumerate(items) if i == first or a not in drop]
    return items


def _sums(nodes):
    """The named sums, largest first (so a sum folds before the sums inside it)."""
    adds = [n for n in nodes if isinstance(n, E.Add)]
    return sorted(adds, key=lambda n: -len(n.args))


def _symbols(chosen, order):
    """Symbols for the chosen nodes: hinted ones keep theirs, the rest numbered in ``order``."""
    out, counts = {}, {"J": 0, "S": 0}
    for node in order:
        symbol = chosen[node]
        if symbol is None:
            letter = "J" if _is_operator(node) else "S"
            counts[letter] += 1
            symbol = _symbol(letter, counts[letter])
        out[node] = symbol
    return out


def _dependency_order(chosen, names, sums):
    """The chosen nodes, each after the names its definition prints (stable otherwise)."""
    provisional = {**names, **_symbols(chosen, list(chosen))}
    deps = {}
    for node in chosen:
        printer = SharedPrinter(provisional, sums)
        printer.define(node)
        deps[node] = [u for u in printer.used if u in chosen and u is not node]
    order, done = [], set()

    def visit(node):
        if node not in done:
            done.add(node)
            for u in deps[node]:
                visit(u)
            order.append(node)
    for node in chosen:
        visit(node)
    return order


def share(roots, names=None, min_chars=MIN_CHARS, max_chars=MAX_CHARS, hints=None, sums=()):
    """(definitions, names): the named sub-expressions of ``roots`` and the printer names.

    ``names`` are the symbols already in use (a layer's intermediates); the returned
    ``names`` extend them with the new symbols, so ``latex(root, names, definitions)``
    prints a root in terms of the definitions.  Definitions are in dependency order.
    ``hints`` gives meaningful symbols for some nodes (see ``jacobian_names``); the rest
    are numbered \\mathcal J_k (Kronecker-view operators) and \\mathcal S_k (matrices).
    ``sums``: further named sums the definitions fold (see ``latex``).
    """
    roots = list(dict.fromkeys(roots))
    names = dict(names or {})
    chosen = _Chooser(roots, names, min_chars, max_chars, hints).run()
    sums = _sums(list(chosen) + list(sums))
    order = _dependency_order(chosen, names, sums)
    out_names = {**names, **_symbols(chosen, order)}
    printer = SharedPrinter(out_names, sums)
    defs = [Shared(out_names[n], n, printer.define(n),
                   E.Var(f"cse_{i}", n.rows, n.cols, "placeholder", out_names[n]))
            for i, n in enumerate(order)]
    return defs, out_names


def latex(expr, names=None, definitions=(), sums=()) -> str:
    """LaTeX of ``expr`` in terms of the names (named sums folded into larger sums).

    ``sums`` are further named sums to fold, e.g. ``named_sums(names)``: the layer's
    intermediates that are sums (X := O W_E + P prints A X W_V W_O + O W_E + P as
    A X W_V W_O + X)."""
    return SharedPrinter(names, _sums([d.node for d in definitions] + list(sums))).print(expr)


def named_sums(names) -> list:
    """The sums among the printer's named nodes (their symbols stand for them inside larger sums)."""
    return [node for node in (names or {}) if isinstance(node, E.Add)]


def _named_quantities(lay):
    """(tex, node) for the layer's intermediates and the named nodes of its output (M_Y, P_Z …)."""
    from ..expr.latex import RESERVED_TEX, intermediate_tex

    out = {intermediate_tex(k): node for k, node in lay.intermediates.items()}
    for node in E.walk(lay.output):
        if isinstance(node, E.Named) and not node.frozen and len(node.args) == 1:
            out.setdefault(RESERVED_TEX.get(node.tex, node.tex), node)
    return out


def jacobian_names(derivation) -> dict:
    """{∂vec_r N/∂vec_r W: symbol} for the layer's named quantities N (and output F) and parameters W.

    The Kronecker-view Jacobians as the engine derives them (``vec_jacobian`` of the
    differential, display-simplified); where one recurs inside a block it is named by
    what it is rather than by a number.
    """
    from ..calculus.kron import vec_jacobian
    from ..calculus.rules import differential
    from ..calculus.simplify import simplify

    lay, out = derivation.layer, {}
    quantities = _named_quantities(lay)
    for p in lay.params:
        wrt = rf"\partial {p.latex()}"
        out.setdefault(derivation.jacobian(p.name), rf"\frac{{\partial \mathbf F}}{{{wrt}}}")
        dp = E.Var(f"d{p.name}", p.rows, p.cols, "direction")
        for tex, node in quantities.items():
            if node.depends_on(p):
                jac = simplify(vec_jacobian(differential(node, {p: dp}), dp), lay)
                out.setdefault(jac, rf"\frac{{\partial {tex}}}{{{wrt}}}")
    return out


def terms(expr):
    """The terms of a sum (each printed on its own line by the report)."""
    return list(expr.args) if isinstance(expr, E.Add) else [expr]


def share_if_long(exprs, names=None, limit=4000, hints=None, sums=()):
    """``share`` over the terms of ``exprs`` when some term prints longer than ``limit``, else ([], names).

    ``hints`` may be a callable (e.g. ``lambda: jacobian_names(d)``), called only when needed.
    """
    names = dict(names or {})
    ts = [t for e in exprs for t in terms(e)]
    printer = _MemoPrinter(names, cap=limit + 1)
    if all(len(printer.print(t)) <= limit for t in ts):
        return [], names
    return share(ts, names, hints=hints() if callable(hints) else hints, sums=sums)


def _rebuilt(expr, args):
    """``expr`` over new args, node for node (no re-canonicalisation)."""
    if len(args) == len(expr.args) and all(a is b for a, b in zip(args, expr.args)):
        return expr
    out = copy.copy(expr)
    out.args, out._hash, out._key, out._free = args, None, None, None
    return out


def _replace(expr, mapping, memo, sums=()):
    """``expr`` with sub-expressions replaced, keeping the shape of the tree.

    ``E.substitute`` rebuilds through the factories, which re-sort sums by their new
    operands; here nothing is re-canonicalised (named sums are folded as the printer
    folds them), so the result prints exactly as ``expr`` printed with the names.
    """
    if expr in mapping:
        return mapping[expr]
    if expr not in memo:
        args = _fold(expr, sums) if isinstance(expr, E.Add) else expr.args
        memo[expr] = _rebuilt(expr, tuple(_replace(a, mapping, memo, sums) for a in args))
    return memo[expr]


def _mapping(definitions, names, skip=None):
    mapping = {n: n for n in (names or {})}   # symbols already: never descended into
    mapping.update({d.node: d.var for d in definitions if d is not skip})
    mapping.pop(skip.node if skip is not None else None, None)
    return mapping


def named_form(expr, definitions, names=None):
    """``expr`` with every named sub-expression replaced by its placeholder variable."""
    sums = _sums(d.node for d in definitions)
    return _replace(expr, _mapping(definitions, names), {}, sums)


def definition_form(shared, definitions, names=None):
    """The right-hand side of one definition in terms of the other placeholders."""
    mapping, memo = _mapping(definitions, names, skip=shared), {}
    sums = _sums(d.node for d in definitions)
    node = shared.node
    args = _fold(node, sums) if isinstance(node, E.Add) else node.args
    return _rebuilt(node, tuple(_replace(a, mapping, memo, sums) for a in args))


def _substitute_back(expr, mapping, memo):
    """Replace placeholders; a sum that had a named sum folded in is flattened again."""
    if expr in mapping:
        return mapping[expr]
    if expr not in memo:
        args = tuple(_substitute_back(a, mapping, memo) for a in expr.args)
        if isinstance(expr, E.Add) and any(isinstance(a, E.Add) for a in args):
            memo[expr] = E.add(*args)
        else:
            memo[expr] = _rebuilt(expr, args)
    return memo[expr]


def expand(expr, definitions, names=None):
    """Substitute the definition forms back (in dependency order) into a named form."""
    full = {}
    for d in definitions:
        full[d.var] = _substitute_back(definition_form(d, definitions, names), full, {})
    return _substitute_back(expr, full, {})

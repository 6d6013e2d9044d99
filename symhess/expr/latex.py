"""LaTeX printer in the papers' notation: bold matrices, ⊗, K_{m,n}, M_1…M_3, Z_1, Z_2."""
from __future__ import annotations

import re

import sympy as sp

from .printer import Printer


def bold_name(name: str) -> str:
    """'W_Q' → \\mathbf W_{Q}; 'W_V^1' → \\mathbf W_{V}^{1}."""
    base, _, sub = name.partition("_")
    sup = ""
    if "^" in sub:
        sub, _, sup = sub.partition("^")
    elif "^" in base:
        base, _, sup = base.partition("^")
    out = rf"\mathbf {base}" if len(base) == 1 else rf"\mathbf{{{base}}}"
    if sub:
        out += "_{" + sub.replace("_", r"\_") + "}"
    if sup:
        out += "^{" + sup + "}"
    return out


# symbols a derivation gives to the loss target and the output gradient: a layer quantity
# that would print as one of them is printed with a tilde instead (variables with these
# names are refused when a layer is declared, symhess.layers.RESERVED_NAMES)
RESERVED_TEX = {r"\mathbf Y": r"\widetilde{\mathbf Y}", r"\mathbf G": r"\widetilde{\mathbf G}"}


def intermediate_tex(key: str) -> str:
    """The symbol of a layer's intermediate from its key: 'T' → \\mathbf T, 'A1' (head 1)
    → \\mathbf A^{1}, 'A^(2)' (sub-layer 2) → \\mathbf A^{(2)}, 'A1^(2)' → \\mathbf A^{1,(2)};
    'Y' → \\widetilde{\\mathbf Y} (not the loss target)."""
    m = re.fullmatch(r"([A-Za-z])(\d+)(?:\^(.+))?", key)
    if m:
        sup = ",".join(x for x in (m.group(2), m.group(3)) if x)
        tex = rf"\mathbf {m.group(1)}^{{{sup}}}"
    else:
        tex = bold_name(key)
    return RESERVED_TEX.get(tex, tex)


def dim_tex(d) -> str:
    return sp.latex(sp.sympify(d), fold_frac_powers=True)


# how the LaTeX printer writes some entrywise functions (amssymb has no blackboard-bold 1)
FUNCTION_TEX = {"step": r"\operatorname{step}"}


def _exponent_tex(q) -> str:
    """An exponent as the function table writes it: -1/2, not \\frac{-1}{2}."""
    q = sp.nsimplify(q)
    return f"{q.p}/{q.q}" if isinstance(q, sp.Rational) and q.q != 1 else sp.latex(q)


def _explicit_tex(expr) -> str:
    """A function of x in (·) notation: c(·)^q for a monomial (parenthesised when c < 0,
    being an operand of products), else sympy's LaTeX with x written (·)."""
    from .scalarfn import x
    c, q = expr.as_coeff_exponent(x)
    if c != 0 and not c.has(x) and sp.simplify(c * x**q - expr) == 0:
        if q == 0:
            return sp.latex(c)
        base = r"(\cdot)" if q == 1 else rf"(\cdot)^{{{_exponent_tex(q)}}}"
        coef = "" if c == 1 else "-" if c == -1 else sp.latex(c).replace(r"\frac", r"\tfrac")
        out = coef + base
    else:
        out = sp.latex(expr.subs(x, sp.Symbol(r"(\cdot)")))
    return rf"\left({out}\right)" if out.startswith("-") or "+" in out else out


def function_tex(fn) -> str:
    """How an entrywise function prints (its template, \\cdot standing for the argument).

    A derivative of a function written with (·) (powers, square root) is printed as the
    explicit function, (·)^{-1/2} → -½(·)^{-3/2}; a derivative of a named function gets
    primes before the name's subscript, tanh → tanh′, GELU_{tanh} → GELU′_{tanh}.  (The
    function's own ``tex`` marks a derivative as {f}′, which on a power reads as a prime
    on the exponent.)
    """
    base = fn.name.rstrip("'")
    order = len(fn.name) - len(base)
    if order == 0:
        return FUNCTION_TEX.get(fn.name, fn.tex)
    tex = fn.tex
    for _ in range(order):                    # {{f}'}' → f
        if tex.startswith("{") and tex.endswith("}'"):
            tex = tex[1:-2]
    tex = FUNCTION_TEX.get(base, tex)
    if r"\cdot" in tex:
        return _explicit_tex(fn.expr)
    m = re.fullmatch(r"(.*?)(_\{[^{}]*\})?", tex)
    return m.group(1) + "'" * order + (m.group(2) or "")


def signed_sum(texts, plus="+", minus="-") -> str:
    """Printed terms joined by their signs, a positive term first where there is one
    (X − ½X1, not −½X1 + X); the order is otherwise the canonical one."""
    first = next((i for i, t in enumerate(texts) if not t.startswith("-")), 0)
    texts = [texts[first]] + texts[:first] + texts[first + 1:]
    out = texts[0]
    for t in texts[1:]:
        out += minus + t[1:] if t.startswith("-") else plus + t
    return out


class LatexPrinter(Printer):
    plus, minus = "+", "-"
    """``names`` maps sub-expressions (a layer's intermediates) to their LaTeX symbols."""

    lparen, rparen = r"\left(", r"\right)"

    def __init__(self, names=None):
        self.names = dict(names or {})

    def doprint(self, node) -> str:
        if node in self.names:
            return self.names[node]
        return super().doprint(node)

    def shown(self, node):
        """A named sub-expression is its symbol (no children)."""
        return () if node in self.names else self.children_of(node)

    def children_of(self, node):
        """A name shows its arguments only."""
        return node.args[1:] if type(node).__name__ == "Named" else node.args

    def paren(self, node, parent_precedence) -> str:
        if node in self.names:  # a named intermediate is a symbol: no brackets
            return self.names[node]
        return super().paren(node, parent_precedence)

    def _softmax_parts(self, a):
        """(numerator, denominator) symbols for the derivatives of A = softmax(T)."""
        t = a.args[0]
        return self.doprint(a), self.doprint(t) if t in self.names or len(t.args) == 0 else None

    def _print_Var(self, n):
        return n.tex or bold_name(n.name)

    def _print_Zero(self, n):
        return r"\mathbf 0"

    def _print_Identity(self, n):
        return rf"\mathbf I_{{{dim_tex(n.rows)}}}"

    def _print_Ones(self, n):
        if n.cols == 1:
            return rf"\mathbf 1_{{{dim_tex(n.rows)}}}"
        if n.rows == 1:
            return rf"\mathbf 1_{{{dim_tex(n.cols)}}}^\top"
        return rf"\mathbf 1_{{{dim_tex(n.rows)}\times {dim_tex(n.cols)}}}"

    def _print_CausalMask(self, n):
        return rf"\mathbf M^{{\mathrm{{causal}}}}_{{{dim_tex(n.rows)}}}"

    def _print_Commutation(self, n):
        return rf"\mathbf K_{{{dim_tex(n.params[0])},{dim_tex(n.params[1])}}}"

    def _print_DiagSelector(self, n):
        return rf"\mathbf E_{{{dim_tex(n.params[0])}}}"

    def _print_Add(self, n):
        return signed_sum([self.doprint(t) for t in n.args], self.plus, self.minus)

    def _print_MatMul(self, n):
        return "".join(self.paren(a, n.precedence + 1) for a in n.args)

    def _print_Scale(self, n):
        c = n.coef
        inner = self.paren(n.args[0], n.precedence + 1)
        if c == -1:
            return "-" + inner
        ctex = sp.latex(c, fold_frac_powers=True)
        if isinstance(c, sp.Add):
            ctex = rf"\left({ctex}\right)"
        return ctex + inner

    def _print_Transpose(self, n):
        s = self.paren(n.args[0], n.precedence + 1)
        if "^" in s and not s.startswith(self.lparen):
            s = "{" + s + "}"   # W_V^{1} or M^{causal}: a second superscript is a TeX error
        return s + r"^\top"

    def _print_Kron(self, n):
        return r"\otimes ".join(self.paren(a, n.precedence + 1) for a in n.args)

    def _print_Hadamard(self, n):
        return r"\odot ".join(self.paren(a, n.precedence + 1) for a in n.args)

    def _print_Elementwise(self, n):
        tex = function_tex(n.fn)
        arg = self.doprint(n.args[0])
        if r"\cdot" in tex:
            return tex.replace(r"\cdot", arg)
        return rf"{tex}\left({arg}\right)"

    def _print_SoftmaxRows(self, n):
        name = r"\operatorname{softmax}_{\mathrm{causal}}" if n.causal else r"\operatorname{softmax}"
        if n.mask is not None:
            name = rf"\operatorname{{softmax}}_{{{self.doprint(n.mask)}}}"
        return rf"{name}\left({self.doprint(n.args[0])}\right)"

    def _print_LogSoftmaxRows(self, n):
        return rf"\log\operatorname{{softmax}}\left({self.doprint(n.args[0])}\right)"

    def _print_SoftmaxDiff(self, n):
        a, _ = self._softmax_parts(n.args[0])
        return rf"\partial{a}\left[{self.doprint(n.args[1])}\right]"

    def _print_SoftmaxDiff2(self, n):
        a, _ = self._softmax_parts(n.args[0])
        return rf"\partial^2{a}\left[{self.doprint(n.args[1])},{self.doprint(n.args[2])}\right]"

    def _jac(self, a, order):
        num, den = self._softmax_parts(a)
        if den is None:
            return rf"\mathbf J^{{({order})}}_{{\operatorname{{softmax}}}}\left({self.doprint(a.args[0])}\right)"
        sq = "^2" if order == 2 else ""
        if sq and "^" in den:
            den = "{" + den + "}"   # T^{(2)}: a second superscript is a TeX error
        return rf"\frac{{\partial{sq}{num}}}{{\partial{den}{sq}}}"

    def _print_SoftmaxJac(self, n):
        return self._jac(n.args[0], 1)

    def _print_SoftmaxHess(self, n):
        return self._jac(n.args[0], 2) + rf"\left[{self.doprint(n.args[1])}\right]"

    def _print_Diag(self, n):
        return rf"\operatorname{{diag}}\left({self.doprint(n.args[0])}\right)"

    def _print_DiagPart(self, n):
        return rf"\operatorname{{diagpart}}\left({self.doprint(n.args[0])}\right)"

    def _print_VecR(self, n):
        return rf"\operatorname{{vec}}_r\left({self.doprint(n.args[0])}\right)"

    def _print_UnvecR(self, n):
        return rf"\operatorname{{vec}}_r^{{-1}}\left({self.doprint(n.args[0])}\right)"

    def _print_KronContract(self, n):
        g, c = (self.doprint(a) for a in n.args)
        return rf"\operatorname{{tr}}_{{{n.params[0]}}}\left[{g};{c}\right]"

    def _print_Named(self, n):
        if len(n.args) > 1:
            return n.tex.format(*(self.doprint(a) for a in n.args[1:]))
        if not n.frozen:   # the derivation's own G is frozen
            return RESERVED_TEX.get(n.tex, n.tex)
        return n.tex


def latex(expr, names=None) -> str:
    return LatexPrinter(names).print(expr)

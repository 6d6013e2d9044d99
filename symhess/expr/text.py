"""Plain-text printer (repr and ``--format text``)."""
from __future__ import annotations

import re

import sympy as sp

from .printer import Printer, _children_first


class TextPrinter(Printer):
    plus, minus = " + ", " - "

    def shown(self, n):
        """Softmax derivatives print their direction(s) only, a name its shown arguments."""
        kind = type(n).__name__
        if kind in ("SoftmaxDiff", "SoftmaxDiff2", "SoftmaxHess", "Named"):
            return n.args[1:]
        return () if kind == "SoftmaxJac" else n.args

    def _print_Var(self, n):
        return n.name

    def _print_Zero(self, n):
        return f"0[{n.rows}x{n.cols}]"

    def _print_Identity(self, n):
        return f"I[{n.rows}]"

    def _print_Ones(self, n):
        return f"1[{n.rows}x{n.cols}]"

    def _print_CausalMask(self, n):
        return f"Mcausal[{n.rows}]"

    def _print_Commutation(self, n):
        return f"K[{n.params[0]},{n.params[1]}]"

    def _print_DiagSelector(self, n):
        return f"E[{n.params[0]}]"

    def _print_MatMul(self, n):
        return " @ ".join(self.paren(a, n.precedence + 1) for a in n.args)

    def _print_Scale(self, n):
        c = n.coef
        inner = self.paren(n.args[0], n.precedence + 1)
        if c == -1:
            return "-" + inner
        return f"({sp.sstr(c)})*{inner}" if isinstance(c, sp.Add) else f"{sp.sstr(c)}*{inner}"

    def _print_Transpose(self, n):
        return self.paren(n.args[0], n.precedence + 1) + ".T"

    def _print_Kron(self, n):
        return " ⊗ ".join(self.paren(a, n.precedence + 1) for a in n.args)

    def _print_Hadamard(self, n):
        return " ∘ ".join(self.paren(a, n.precedence + 1) for a in n.args)

    def _print_Elementwise(self, n):
        return f"{n.fn.name}({self.doprint(n.args[0])})"

    def _print_SoftmaxRows(self, n):
        mask = f", mask={self.doprint(n.mask)}" if n.mask is not None else ""
        return f"softmax_rows({self.doprint(n.args[0])}{', causal' if n.causal else ''}{mask})"

    def _print_LogSoftmaxRows(self, n):
        return f"log_softmax_rows({self.doprint(n.args[0])})"

    def _softmax_parts(self, a):
        """(the softmax A = softmax_rows(S) as printed, S when it is a name or a variable, else
        None): derivatives are labelled by their actual argument."""
        s = a.args[0]
        named = not s.args or (type(s).__name__ == "Named" and len(s.args) == 1)
        return self.doprint(a), self.doprint(s) if named else None

    def _print_SoftmaxDiff(self, n):
        a, _ = self._softmax_parts(n.args[0])
        return f"∂{a}[{self.doprint(n.args[1])}]"

    def _print_SoftmaxDiff2(self, n):
        a, _ = self._softmax_parts(n.args[0])
        return f"∂²{a}[{self.doprint(n.args[1])}, {self.doprint(n.args[2])}]"

    def _jac(self, a, order):
        """∂A/∂S (∂²A/∂S²) for a named argument S, else J_softmax(S) (J2_softmax(S))."""
        num, den = self._softmax_parts(a)
        if den is None:
            return f"J{order if order > 1 else ''}_softmax({self.doprint(a.args[0])})"
        return f"∂{num}/∂{den}" if order == 1 else f"∂²{num}/∂{den}²"

    def _print_SoftmaxJac(self, n):
        return self._jac(n.args[0], 1)

    def _print_SoftmaxHess(self, n):
        return f"{self._jac(n.args[0], 2)}[{self.doprint(n.args[1])}]"

    def _print_Diag(self, n):
        return f"diag({self.doprint(n.args[0])})"

    def _print_DiagPart(self, n):
        return f"diagpart({self.doprint(n.args[0])})"

    def _print_VecR(self, n):
        return f"vec_r({self.doprint(n.args[0])})"

    def _print_UnvecR(self, n):
        return f"unvec[{n.params[0]}x{n.params[1]}]({self.doprint(n.args[0])})"

    def _print_KronContract(self, n):
        return f"kron_contract_{n.params[0]}({self.doprint(n.args[0])}, {self.doprint(n.args[1])})"

    def _print_Named(self, n):
        name = n.name + _label(n.tex)
        if len(n.args) > 1:
            return f"{name}[{', '.join(self.doprint(a) for a in n.args[1:])}]"
        return name


def _label(tex) -> str:
    """The per-head / per-sub-layer label of a moment's symbol (\\mathbf M_1^{(2)} → ^(2))."""
    m = re.match(r"\\mathbf [MZ]_[123]\^\{\{?([^{}]*)\}?\}", tex or "")
    return f"^{m.group(1)}" if m else ""


def text(expr) -> str:
    return TextPrinter().print(expr)


def short_text(expr, limit) -> str | None:
    """``text(expr)`` when it is at most ``limit`` characters, else None — decided without
    printing large expressions: a printed expression has at least as many characters as its
    tree has leaves, and a derivation's DAGs can have exponentially many (counted per node
    once, children first, capped at ``limit``)."""
    leaves = {}
    for n in _children_first(expr, lambda n: n.args):
        args = n.args[1:] if type(n).__name__ == "Named" else n.args    # a name prints as itself
        leaves[n] = 1 if not args else min(limit + 1, 1 + sum(leaves[a] for a in args))
    if leaves[expr] > limit:
        return None
    s = text(expr)
    return s if len(s) <= limit else None

"""The named quantities a printout uses, each defined once (reports, ``derive --definitions``).

A printed block uses three kinds of symbols besides the declared variables:

* ``Named`` nodes: the moments the simplifier names (M_1, M_2, Z_1, M_3[E], Z_2[E], labelled
  per head or sub-layer when a layer has several softmaxes), the derivation's F and G, and
  the named parts of a declaration (LayerNorm's M_Y, P_Y, the input X^{(2)} of a second
  sub-layer …);
* the layer's intermediates (T, A …), printed through ``Derivation.latex_names``.

``definitions`` lists, in an order where every definition comes after the symbols it uses,
one entry per symbol: the symbol, its right-hand side in terms of the other symbols, an
optional note with the moments' element-wise meaning written with *their own* softmax and
input (z_j for cross-attention's key/value input Z), and the node the symbol stands for.
A symbol never has two definitions: nodes that print alike are listed once (the simplified
and the declared form of one intermediate), and the notation keeps different quantities
apart (per-head and per-sub-layer superscripts, a tilde on a layer quantity that would
print as the loss target Y or the output gradient G).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from . import expr as E
from .printing.latex import LatexPrinter
from .simplify import MOMENT_TEX, moment_softmax


@dataclass(frozen=True)
class Definition:
    """``symbol := tex`` followed by ``note`` (its own connective: ", rows …" or "= …");
    ``node`` is what the symbol stands for."""

    symbol: str
    tex: str
    note: str | None
    node: E.Expr


def _symbol_parts(sym):
    """(letter, superscript) of a symbol like \\mathbf A or \\mathbf A^{1}, else None."""
    m = re.fullmatch(r"\\mathbf ([A-Za-z])(?:\^\{([^{}]*)\})?", sym)
    return (m.group(1), m.group(2) or "") if m else None


def _sup(label):
    return f"^{{{label}}}" if label else ""


def _entry(sym):
    """The (i, j) entry of a matrix symbol: A_{ij}, A^{1}_{ij}, else [·]_{ij}."""
    parts = _symbol_parts(sym)
    if parts:
        return f"{parts[0]}{_sup(parts[1])}_{{ij}}"
    return rf"\left[{sym}\right]_{{ij}}"


def _row(sym):
    """Row j of a matrix symbol: \\mathbf x_j for \\mathbf X, else [·]_{j,:}."""
    parts = _symbol_parts(sym)
    if parts:
        return rf"\mathbf {parts[0].lower()}{_sup(parts[1])}_j"
    return rf"\left[{sym}\right]_{{j,:}}"


def moment_input(named):
    """The input X a moment is taken over (the X of A X, of (I⊗Xᵀ)·(I⊗X), of (X⊗I))."""
    inner = named.inner
    f = list(inner.args) if isinstance(inner, E.MatMul) else [inner]
    if named.name == "M_1":
        return f[-1]
    return f[-1].args[1] if named.name in ("M_2", "M_3") else f[-1].args[0]


def moment_note(named, names):
    """The element-wise meaning of M_1, M_2, M_3 in the symbols of *its* softmax and input,
    starting with its connective (printed right after the definition)."""
    if named.name not in ("M_1", "M_2", "M_3"):
        return None
    printer = LatexPrinter(names)
    a, x = moment_softmax(named), moment_input(named)
    if a is None:
        return None
    a_sym, x_sym = printer.doprint(a), printer.doprint(x)
    label = (_symbol_parts(a_sym) or ("", ""))[1]
    mu, aij, xj = rf"\boldsymbol\mu{_sup(label)}_i", _entry(a_sym), _row(x_sym)
    dev = rf"({xj}-{mu})"
    if named.name == "M_1":
        return rf",\ \text{{rows }}{mu}=\textstyle\sum_j {aij}\,{xj}"
    block = rf"\mathbf M{_sup(label)}_{{{named.name[-1]},i}}"
    if named.name == "M_2":
        return (rf"=\operatorname{{blockdiag}}_i\big({block}\big),\ {block}="
                rf"\textstyle\sum_j {aij}\,{dev}{dev}^\top")
    return (rf"=\operatorname{{blockdiag}}_i\big(\textstyle\sum_a E_{{ia}}\,{block}[a,:,:]\big),\ "
            rf"{block}=\textstyle\sum_j {aij}\,{dev}^{{\otimes 3}}")


def _without(names, node):
    """The printer names less a node's own symbol (so its definition prints its expression)."""
    return {u: t for u, t in names.items() if u != node and u != E.transpose(node)}


def definitions(exprs, names) -> list:
    """One ``Definition`` per symbol the expressions use, definitions before their uses.

    ``names`` are the printer's symbols for the layer's intermediates
    (``Derivation.latex_names``); the Named nodes print as their own symbols.
    """
    symbol_of = {node: sym for node, sym in names.items() if not sym.endswith(r"^\top")}
    seen, out = {}, []
    roots = list(exprs)
    for node in (n for r in roots for n in E.walk(r)):
        if isinstance(node, E.Transpose) and node.args[0] in symbol_of:
            node = node.args[0]
        if isinstance(node, E.Named):
            symbol = LatexPrinter(names).doprint(node)
            rhs = node.inner.latex(_without(names, node))
            note = moment_note(node, names)
        elif node in symbol_of:
            symbol = symbol_of[node]
            rhs = node.latex(_without(names, node))
            note = None
        else:
            continue
        if symbol in seen:
            continue
        seen[symbol] = node
        out.append(Definition(symbol, rhs, note, node))
    return out


__all__ = ["Definition", "definitions", "moment_note", "moment_input", "MOMENT_TEX"]

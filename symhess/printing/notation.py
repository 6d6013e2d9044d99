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

from ..expr import nodes as E
from ..expr.latex import LatexPrinter, function_tex
from ..calculus.simplify import MOMENT_TEX, moment_softmax


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


def _entry(sym, index="ij"):
    """The (i, j) entry of a matrix symbol: A_{ij}, A^{1}_{ij}, else [·]_{ij}."""
    parts = _symbol_parts(sym)
    if parts:
        return f"{parts[0]}{_sup(parts[1])}_{{{index}}}"
    return rf"\left[{sym}\right]_{{{index}}}"


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
    # M_3[E] is contracted with its own argument E (row i of E against the first axis)
    eia = _entry(printer.doprint(named.args[1]), "ia") if len(named.args) > 1 else "E_{ia}"
    return (rf"=\operatorname{{blockdiag}}_i\big(\textstyle\sum_a {eia}\,{block}[a,:,:]\big),\ "
            rf"{block}=\textstyle\sum_j {aij}\,{dev}^{{\otimes 3}}")


def _without(names, node):
    """The printer names less a node's own symbol (so its definition prints its expression)."""
    return {u: t for u, t in names.items() if u != node and u != E.transpose(node)}


def _rhs(expr, names, node):
    """A definition's right-hand side: the other symbols, named sums folded into larger sums."""
    from .latex_cse import latex, named_sums
    others = _without(names, node)
    return latex(expr, others, sums=named_sums(others))


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
            rhs = _rhs(node.inner, names, node)
            note = moment_note(node, names)
        elif node in symbol_of:
            symbol = symbol_of[node]
            rhs = _rhs(node, names, node)
            note = None
        else:
            continue
        if symbol in seen:
            continue
        seen[symbol] = node
        out.append(Definition(symbol, rhs, note, node))
    return out


__all__ = ["Definition", "definitions", "moment_note", "moment_input", "MOMENT_TEX"]


# ----------------------------------------------------------------------------- glossary
# What a document's notation means, one sentence per key, in the order a document lists them;
# ``glossary`` keeps the sentences whose notation the printed expressions use.
GLOSSARY = {
    "G": r"$\mathbf G=\partial\ell/\partial\mathbf F$ is the gradient of the loss with respect to the output",
    "kron": r"$\otimes$ is the Kronecker product",
    "hadamard": r"$\odot$ the entrywise (Hadamard) product",
    "identity": r"$\mathbf I_n$ the $n\times n$ identity",
    "ones": r"$\mathbf 1_{m\times n}$ the $m\times n$ matrix of ones and $\mathbf 1_n$ a column of $n$ ones",
    "commutation": (r"$\mathbf K_{m,n}$ the commutation matrix: $\mathbf K_{m,n}\operatorname{vec}_r\mathbf B"
                    r"=\operatorname{vec}_r\mathbf B^\top$ for $\mathbf B\in\mathbb R^{n\times m}$"),
    "diag_selector": (r"$\mathbf E_n=(\mathbf e_1\otimes\mathbf e_1,\dots,\mathbf e_n\otimes\mathbf e_n)$, "
                      r"so that $\operatorname{vec}_r\operatorname{diag}(\mathbf v)=\mathbf E_n\mathbf v$"),
    "diag": r"$\operatorname{diag}(\mathbf v)$ the diagonal matrix with the column $\mathbf v$ on its diagonal",
    "diagpart": r"$\operatorname{diagpart}(\mathbf B)$ the diagonal of a square $\mathbf B$ as a column",
    "vec": r"$\operatorname{vec}_r(\mathbf B)$ the rows of $\mathbf B$ stacked into one column",
    "unvec": r"$\operatorname{vec}_r^{-1}$ the inverse of $\operatorname{vec}_r$ (a column refilled row by row)",
    "causal_mask": (r"$\mathbf M^{\mathrm{causal}}_n$ the causal mask ($1$ on and below the diagonal, "
                    r"$0$ above)"),
    "softmax": r"$\operatorname{softmax}$ acts on each row separately",
    "softmax_causal": (r"$\operatorname{softmax}_{\mathrm{causal}}$ is the row softmax with the entries "
                       r"above the diagonal masked (exactly $0$)"),
    "softmax_masked": (r"$\operatorname{softmax}_{\mathbf M}$ is the row softmax with the entries "
                       r"where the constant $0/1$ mask $\mathbf M$ is $0$ masked (exactly $0$)"),
    "log_softmax": r"$\log\operatorname{softmax}$ is its entrywise logarithm",
    "softmax_jac": (r"$\frac{\partial\mathbf A}{\partial\mathbf T}=\operatorname{blockdiag}_i"
                    r"(\operatorname{diag}\mathbf a_i-\mathbf a_i\mathbf a_i^\top)$ is the Jacobian of "
                    r"$\mathbf A=\operatorname{softmax}(\mathbf T)$, $\mathbf a_i$ the $i$-th row of "
                    r"$\mathbf A$ as a column"),
    "softmax_jac_of": (r"$\mathbf J^{(1)}_{\operatorname{softmax}}(\mathbf U)=\operatorname{blockdiag}_i"
                       r"(\operatorname{diag}\mathbf a_i-\mathbf a_i\mathbf a_i^\top)$ is the Jacobian of "
                       r"$\operatorname{softmax}$ at $\mathbf U$, $\mathbf a_i$ the $i$-th row of "
                       r"$\operatorname{softmax}(\mathbf U)$ as a column"),
    "softmax_hess": (r"$\frac{\partial^2\mathbf A}{\partial\mathbf T^2}[\mathbf E]=\operatorname{blockdiag}_i"
                     r"(\operatorname{diag}(\mathbf a_i\odot\mathbf e_i')-(\mathbf a_i\odot\mathbf e_i')\mathbf a_i^\top"
                     r"-\mathbf a_i(\mathbf a_i\odot\mathbf e_i')^\top)$, "
                     r"$\mathbf e_i'=\mathbf e_i-(\mathbf a_i^\top\mathbf e_i)\mathbf 1$, is the second "
                     r"derivative of $\mathbf A$ contracted with $\mathbf E$ ($\mathbf e_i$ the $i$-th row of $\mathbf E$)"),
    "softmax_hess_of": (r"$\mathbf J^{(2)}_{\operatorname{softmax}}(\mathbf U)[\mathbf E]$ is the same "
                        r"contracted second derivative of $\operatorname{softmax}$ at $\mathbf U$"),
    "softmax_diff": (r"$\partial\mathbf A[\mathbf E]=\mathbf A\odot(\mathbf E-(\mathbf A\odot\mathbf E)"
                     r"\mathbf 1\mathbf 1^\top)$ is the differential of a row softmax $\mathbf A$ in the "
                     r"direction $\mathbf E$"),
    "softmax_diff2": (r"$\partial^2\mathbf A[\mathbf E_1,\mathbf E_2]$ its second differential: row $i$ is "
                      r"$\mathbf a\odot\mathbf e_1'\odot\mathbf e_2'-\mathbf a\,\mathbf a^\top"
                      r"(\mathbf e_1'\odot\mathbf e_2')$ with $\mathbf a$ the row of $\mathbf A$ and "
                      r"$\mathbf e_k'=\mathbf e_k-\mathbf a^\top\mathbf e_k$"),
    "kron_contract": (r"$\operatorname{tr}_{right}[\mathbf G;\mathbf C]_{ij}=\sum_{a,b}C_{ab}G_{(a,i),(b,j)}$ and "
                      r"$\operatorname{tr}_{left}[\mathbf G;\mathbf C]_{ij}=\sum_{a,b}C_{ab}G_{(i,a),(j,b)}$ "
                      r"(the adjoints of $\mathbf D\mapsto\mathbf C\otimes\mathbf D$ and "
                      r"$\mathbf D\mapsto\mathbf D\otimes\mathbf C$)"),
    "entrywise": r"a scalar function of a matrix (such as $\exp$ or $(\cdot)^{-1/2}$) applies entrywise",
    "relu": r"$\operatorname{ReLU}(x)=\max(x,0)$",
    "step": r"$\operatorname{step}(x)$ is $1$ for $x>0$ and $0$ otherwise (the derivative of $\operatorname{ReLU}$)",
    "gelu": r"$\operatorname{GELU}(x)=\tfrac{x}{2}\bigl(1+\operatorname{erf}(x/\sqrt2)\bigr)$",
    "gelu_tanh": (r"$\operatorname{GELU}_{\tanh}(x)=\tfrac{x}{2}\bigl(1+\tanh(\sqrt{2/\pi}\,"
                  r"(x+0.044715x^3))\bigr)$"),
    "sigmoid": r"$\operatorname{sigmoid}(x)=1/(1+e^{-x})$",
    "prime": r"$f'$ and $f''$ are the first and second derivatives of a scalar function $f$",
    "head_label": (r"a superscript $1, 2, \dots$ on a symbol ($\mathbf W_{Q}^{1}$, $\mathbf A^{1}$) "
                   r"numbers the attention head it belongs to, not a power"),
    "layer_label": (r"a superscript $(1), (2), \dots$ on a symbol ($\mathbf W_{Q}^{(1)}$, "
                    r"$\mathbf A^{(2)}$) numbers the sub-layer it belongs to, not a power"),
}

_FUNCTION_KEYS = {"relu": "relu", "step": "step", "gelu": "gelu", "gelu_tanh": "gelu_tanh",
                  "sigmoid": "sigmoid"}


def _softmax_keys(node, printer):
    """The Jacobian prints as ∂A/∂T where T has a symbol, else as J_softmax(U)."""
    named = printer.doprint(node).startswith(r"\frac")
    kind = "softmax_jac" if isinstance(node, E.SoftmaxJac) else "softmax_hess"
    return (kind if named else kind + "_of",)


def _elementwise_keys(node, printer):
    fn = node.fn
    keys = ["entrywise"]
    base = fn.name.rstrip("'")
    if base in _FUNCTION_KEYS:
        keys.append(_FUNCTION_KEYS[base])
    if "'" in function_tex(fn):
        keys.append("prime")
    return keys


def _labels(tex):
    """The glossary keys of the head / sub-layer superscripts in a symbol (W_Q^{1}, A^{1,(2)})."""
    keys = []
    for sup in re.findall(r"\^\{([^{}]*(?:\([^{}]*\))?[^{}]*)\}", tex):
        parts = sup.split(",")
        if any(part.isdigit() for part in parts):
            keys.append("head_label")
        if any(re.fullmatch(r"\(\d+\)", part) for part in parts):
            keys.append("layer_label")
    return keys


def _named_keys(node, printer):
    keys = ["G"] if node.frozen and node.name == "G" else []
    return keys + _labels(node.tex)      # the symbol itself, not the arguments it shows


def _symbol_keys(node, printer):
    return _labels(printer.doprint(node))


# node type -> the glossary keys its printed form uses
_USES = {
    "Kron": lambda n, p: ("kron",),
    "Hadamard": lambda n, p: ("hadamard",),
    "Identity": lambda n, p: ("identity",),
    "Ones": lambda n, p: ("ones",),
    "Commutation": lambda n, p: ("commutation",),
    "DiagSelector": lambda n, p: ("diag_selector",),
    "Diag": lambda n, p: ("diag",),
    "DiagPart": lambda n, p: ("diagpart",),
    "VecR": lambda n, p: ("vec",),
    "UnvecR": lambda n, p: ("vec", "unvec"),
    "CausalMask": lambda n, p: ("causal_mask",),
    "SoftmaxRows": lambda n, p: (("softmax_causal",) if n.causal else ("softmax",)) +
    (("softmax_masked",) if n.mask is not None else ()),
    "LogSoftmaxRows": lambda n, p: ("softmax", "log_softmax"),
    "SoftmaxJac": _softmax_keys,
    "SoftmaxHess": _softmax_keys,
    "SoftmaxDiff": lambda n, p: ("softmax_diff",),
    "SoftmaxDiff2": lambda n, p: ("softmax_diff", "softmax_diff2"),
    "KronContract": lambda n, p: ("kron_contract",),
    "Elementwise": _elementwise_keys,
    "Named": _named_keys,
    "Var": _symbol_keys,
}


def glossary(exprs, names) -> list[str]:
    """The sentences of ``GLOSSARY`` for the notation that the expressions print, in its order.

    Every node is looked at, names included: a named quantity's definition is printed too.
    """
    printer, used = LatexPrinter(names), set()
    seen = set()
    for root in exprs:
        for node in E.walk(root):
            if node in seen:
                continue
            seen.add(node)
            rule = _USES.get(type(node).__name__)
            if rule is not None:
                used.update(rule(node, printer))
            if node in names:
                used.update(_labels(names[node]))
    return [text for key, text in GLOSSARY.items() if key in used]


__all__ += ["GLOSSARY", "glossary"]

"""Sound notation: every symbol a printout uses is defined once, from the right quantities.

For each layer, the expressions a report prints (its intermediates and every block) are
walked; every node that prints as a symbol (a Named node or an intermediate) must have
exactly one definition, and every node printing as that symbol must evaluate to the same
numbers as the definition's node (so one symbol never stands for two quantities: two heads'
M_1, the post-LN intermediate Y and the loss target Y).  The rendered report and
``derive --definitions`` are checked on the text as well.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import symhess as sh
from symhess import expr as E
from symhess.cli.main import main
from symhess.errors import DeclarationError
from symhess.expr.evaluate import evaluate
from symhess.printing.notation import definitions
from symhess.expr.latex import LatexPrinter
from symhess.cli.report import render_report, report_expressions
from symhess.calculus.verify import random_values


def cross_attention():
    """softmax(X W_Q W_Kᵀ Zᵀ/√d_K) Z W_V: keys and values from a second input Z."""
    L, S, d_V, d_M, d_K = E.dims("L S d_V d_M d_K")
    X, Z = E.matrix("X", L, d_V), E.matrix("Z", S, d_M)
    W_Q, W_K, W_V = E.param("W_Q", d_V, d_K), E.param("W_K", d_M, d_K), E.param("W_V", d_M, d_V)
    T = (X @ W_Q @ W_K.T @ Z.T) / E.dim("d_K") ** 0.5
    A = E.softmax_rows(T)
    return sh.Layer("cross_attention", A @ Z @ W_V, (W_Q, W_K, W_V), (X, Z), {"T": T, "A": A})


LAYERS = {
    "attention": lambda: sh.layer("attention"),
    "multihead": lambda: sh.layer("multihead_attention"),
    "post_ln": lambda: sh.layer("post_ln_block"),
    "cross": cross_attention,
    "attention_stack": lambda: sh.layer("attention_stack", depth=2),
}


def _symbol_nodes(exprs, names):
    """{node: symbol} for every node of the expressions that prints as a symbol."""
    printer, out = LatexPrinter(names), {}
    for root in exprs:
        for node in E.walk(root):
            if isinstance(node, E.Named) or (node in names and not names[node].endswith(r"^\top")):
                out.setdefault(node, printer.doprint(node))
    return out


def check_notation(d, exprs, seed=0):
    names = d.latex_names
    defs = definitions(exprs, names)
    by_symbol = {df.symbol: df for df in defs}
    assert len(by_symbol) == len(defs), "a symbol is defined twice"
    # definitions come after the definitions of the symbols they use
    position = {df.symbol: i for i, df in enumerate(defs)}
    for i, df in enumerate(defs):
        inner = df.node.inner if isinstance(df.node, E.Named) else df.node
        for node, sym in _symbol_nodes([a for a in inner.args] if inner.args else [], names).items():
            if node is not df.node and sym in position:
                assert position[sym] < i or sym == df.symbol, (sym, df.symbol)
    # no quantity prints like a variable (the loss target Y above all)
    printer = LatexPrinter(names)
    var_symbols = {printer.doprint(v) for r in exprs for v in E.walk(r) if isinstance(v, E.Var)}
    var_symbols.add(printer.doprint(d.Y))
    assert not (set(by_symbol) & var_symbols), set(by_symbol) & var_symbols
    # every node printed as a symbol is defined, and means the same numbers as its definition
    values = random_values(d, seed=seed)
    env = d.dimension_env(values)
    cache = {}

    def value(node):
        if node not in cache:
            cache[node] = np.asarray(evaluate(node, values, env=env))
        return cache[node]
    nodes = _symbol_nodes(exprs, names)
    for node, sym in nodes.items():
        assert sym in by_symbol, f"{sym} is used but not defined"
        want = value(by_symbol[sym].node)
        got = value(node)
        assert got.shape == want.shape and np.allclose(got, want, rtol=1e-12, atol=1e-12), sym
    return defs


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_every_report_symbol_is_defined_once_and_means_what_the_blocks_use(name):
    d = sh.derive(LAYERS[name](), "mse")
    defs = check_notation(d, report_expressions(d))
    assert defs


@pytest.mark.slow
def test_post_ln_stack_report_symbols():
    d = sh.derive(sh.layer("post_ln_stack", depth=2), "ce")
    defs = {df.symbol for df in check_notation(d, report_expressions(d))}
    assert {r"\mathbf Y^{(1)}", r"\mathbf Y^{(2)}", r"\mathbf M_1^{(2)}", r"\mathbf X^{(2)}"} <= defs


def test_multihead_moments_are_per_head():
    d = sh.derive(sh.layer("multihead_attention"), "mse")
    defs = {df.symbol: df for df in check_notation(d, report_expressions(d))}
    for h in (1, 2):
        assert rf"\mathbf M_1^{{{h}}}" in defs and rf"\mathbf Z_1^{{{h}}}" in defs
        assert defs[rf"\mathbf M_1^{{{h}}}"].tex == rf"\mathbf A^{{{h}}}\mathbf X"
    assert r"\mathbf M_1^{1}" in defs[r"\mathbf F"].tex and r"\mathbf M_1^{2}" in defs[r"\mathbf F"].tex


def test_stacked_moments_are_per_layer():
    d = sh.derive(sh.layer("attention_stack", depth=2), "mse")
    defs = {df.symbol: df for df in check_notation(d, report_expressions(d))}
    assert defs[r"\mathbf M_1^{(1)}"].tex == r"\mathbf A^{(1)}\mathbf X"
    assert defs[r"\mathbf M_1^{(2)}"].tex == r"\mathbf A^{(2)}\mathbf X^{(2)}"
    assert r"\mathbf M_2^{(2)}" in defs and r"\mathbf Z_1^{(2)}" in defs


def test_cross_attention_moments_use_the_key_value_input():
    d = sh.derive(cross_attention(), "mse")
    defs = {df.symbol: df for df in check_notation(d, report_expressions(d))}
    for sym in (r"\mathbf M_1", r"\mathbf M_2"):
        assert r"\mathbf z_j" in defs[sym].note and r"\mathbf x_j" not in defs[sym].note
    assert r"\mathbf Z^\top" in defs[r"\mathbf M_2"].tex


def test_post_ln_intermediate_is_not_the_loss_target():
    text = render_report(sh.layer("post_ln_block"), losses=("mse",))
    lhs = re.findall(r"^(.*?) &:= ", text, flags=re.M)
    assert len(lhs) == len(set(lhs))
    assert r"\widetilde{\mathbf Y}" in lhs and r"\mathbf Y" not in lhs and r"\mathbf S" in lhs
    assert r"\mathbf Y &:= \mathbf Y" not in text and r"\mathbf S &:= \mathbf S" not in text


def test_report_defines_each_symbol_once_per_section():
    text = render_report(sh.layer("multihead_attention"), losses=("mse", "ce"))
    for section in text.split(r"\section{")[1:]:
        lhs = re.findall(r"^(.*?) &:= ", section, flags=re.M)
        assert len(lhs) == len(set(lhs))
        assert r"\mathbf M_1^{1}" in lhs and r"\mathbf M_1^{2}" in lhs


def test_derive_definitions_use_the_right_head(capsys):
    assert main(["derive", "multihead_attention", "--block", "W_Q1,W_V2", "--definitions"]) == 0
    out = capsys.readouterr().out
    defs = dict(line.split(" := ", 1) for line in out.splitlines() if " := " in line)
    assert len(defs) == len([line for line in out.splitlines() if " := " in line])
    assert defs[r"\mathbf M_1^{2}"].startswith(r"\mathbf A^{2}\mathbf X")
    assert defs[r"\mathbf Z_1^{1}"].startswith(r"\mathbf M_2^{1}")
    assert defs[r"\mathbf M_2^{1}"].startswith(r"\left(\mathbf I_{L}\otimes \mathbf X^\top\right)\frac{\partial\mathbf A^{1}}")


@pytest.mark.parametrize("name,role", [("Y", "param"), ("G", "input"), ("Y", "const")])
def test_variables_named_like_the_target_or_the_gradient_are_refused(name, role):
    L, d = E.dims("L d")
    X = E.matrix("X", L, d)
    V = E.Var(name, d, d, role)
    W = E.param("W", d, d) if role != "param" else V
    F = X @ W @ V if role != "param" else X @ V
    with pytest.raises(DeclarationError, match=f"'{name}' is reserved"):
        sh.Layer("bad", F, (W,), (X,) + ((V,) if role == "input" else ()))

"""What a reader of `symhess report` sees: lines that fit unshrunk, defined notation, readable symbols.

The layout is checked twice: on the generated .tex (no scaling commands, rows within the
estimated line width, every row a complete formula) and, where pdflatex is installed, by
TeX itself (no overfull line in the compiled document of any registered layer).
"""
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import sympy as sp

import symhess as sh
from symhess import expr as E
from symhess.expr.evaluate import evaluate
from symhess.printing.notation import GLOSSARY, definitions
from symhess.printing.latex_lines import break_lines, width
from symhess.cli.report import FILL, LINE_EM, render_report, report_expressions
from symhess.expr.latex import function_tex
from symhess.expr.scalarfn import FUNCTIONS, get_function

NEED_TEX = os.environ.get("CI") == "true"
HAVE_TEX = shutil.which("pdflatex") is not None or NEED_TEX
FAST_LAYERS = ("attention", "layernorm", "ffn", "linear_attention", "single_matrix_attention",
               "value_output_attention", "multihead_attention")
DEEP_LAYERS = ("addition_block", "pre_ln_block", "post_ln_block", "attention_stack", "post_ln_stack")


def _rows(text):
    """(lhs, rhs) of every row of every align* environment."""
    out = []
    for env in re.findall(r"\\begin\{align\*\}\n(.*?)\n\\end\{align\*\}", text, flags=re.S):
        for row in env.split(" \\\\\n"):
            lhs, _, rhs = row.partition("&")
            out.append((lhs.strip(), rhs))
    return out


def _balanced(tex):
    return tex.count(r"\left") == tex.count(r"\right") and tex.count("{") == tex.count("}")


@pytest.fixture(scope="module")
def layernorm_report():
    return render_report(sh.layer("layernorm"))


@pytest.fixture(scope="module")
def attention_report():
    return render_report(sh.layer("attention"))


# ----------------------------------------------------------------------------- layout
def test_nothing_is_shrunk_and_rows_fit(layernorm_report):
    text = layernorm_report
    for command in (r"\resizebox", r"\scalebox", r"\fiteq", r"graphicx"):
        assert command not in text
    rows = _rows(text)
    assert len(rows) > 20
    lhs_width = max(width(lhs) for lhs, _ in rows)
    for lhs, rhs in rows:
        assert _balanced(rhs), rhs
        assert width(rhs) <= FILL * LINE_EM - lhs_width + 1e-9 or len(break_lines(rhs, 1.0)) == 1, rhs


def test_long_layernorm_terms_are_named_and_broken(layernorm_report):
    """The LayerNorm Jacobian recurs in every term: it is named (∂M_Z/∂X), and a term that is
    still wider than the line continues on the next rows."""
    text = layernorm_report
    assert "Shared sub-expressions" in text
    assert r"\frac{\partial \mathbf M_Z}{\partial \mathbf X} &:= \mathbf I_{L d_{V}}" in text
    continued = [rhs for _, rhs in _rows(text) if rhs.startswith(r"\qquad\quad ")]
    assert continued, "no continuation rows"
    assert max(len(rhs) for _, rhs in _rows(text)) < 1200


@pytest.mark.skipif(not HAVE_TEX, reason="pdflatex not installed")
@pytest.mark.parametrize("name", FAST_LAYERS + tuple(pytest.param(n, marks=pytest.mark.slow) for n in DEEP_LAYERS))
def test_compiled_report_has_no_overfull_line(name, tmp_path):
    """TeX's own measurement: no line of the document is wider than the text."""
    (tmp_path / "r.tex").write_text(render_report(sh.layer(name)))
    proc = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "r.tex"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = (tmp_path / "r.log").read_text(errors="replace")
    assert proc.returncode == 0, log[-2000:]
    overfull = re.findall(r"Overfull \\hbox \(([\d.]+)pt too wide\)", log)
    assert not overfull, overfull


def test_break_lines_breaks_at_top_level_signs_and_balances_every_line():
    tex = "+".join(rf"\left(\mathbf A_{{{i}}}\otimes \mathbf B\right)\mathbf C" for i in range(30))
    lines = break_lines(tex, 30, 25)
    assert len(lines) > 1
    assert all(line.startswith("+") for line in lines[1:])      # broken before top-level +
    assert all(_balanced(line) for line in lines)
    assert all(width(line) <= 30 for line in lines)
    assert "".join(lines) == tex                                  # nothing lost or added


def test_break_lines_inside_brackets_uses_fixed_sizes():
    inner = "+".join(rf"\frac{{1}}{{d}}\mathbf A_{{{i}}}" for i in range(40))
    tex = rf"\mathbf K\left({inner}\right)^\top\mathbf B"
    lines = break_lines(tex, 40)
    assert len(lines) > 2 and all(_balanced(line) for line in lines)
    assert lines[0].count(r"\Bigl(") == 1 and lines[-2].count(r"\Bigr)^\top") + lines[-1].count(r"\Bigr)^\top") == 1
    restored = "".join(lines).replace(r"\Bigl(", r"\left(").replace(r"\Bigr)", r"\right)")
    assert restored == tex


def test_break_lines_ends_with_a_width_too_small_for_anything():
    """Each line end moves the line start forward: a tiny width gives one piece per line."""
    tex = r"\mathbf A\left(\mathbf B+\mathbf C\right)\otimes \mathbf D-\frac{1}{2}\mathbf E"
    lines = break_lines(tex, 0.1)
    assert all(line.strip() for line in lines) and len(lines) >= 4
    assert "".join(lines).replace(r"\bigl(", r"\left(").replace(r"\bigr)", r"\right)") == tex


def test_break_lines_leaves_unreadable_input_whole():
    tex = r"\left(" + r"\mathbf A+" * 100 + r"\mathbf B"        # no \right
    assert break_lines(tex, 10) == [tex]


# ----------------------------------------------------------------------------- notation
def test_preamble_explains_only_the_notation_used(layernorm_report, attention_report):
    """LayerNorm prints no commutation matrix and no softmax derivative of an attention
    layer: its notation paragraph does not mention them; attention's does."""
    head = layernorm_report.split(r"\section{")[0]
    for absent in (r"\mathbf K_{m,n}", r"\partial\mathbf A[\mathbf E]", r"\frac{\partial^2\mathbf A}"):
        assert absent not in head
    assert r"(\cdot)^{-1/2}" in head                      # entrywise functions are used
    head = attention_report.split(r"\section{")[0]
    for present in (r"\mathbf K_{m,n}", r"\partial\mathbf A[\mathbf E]", r"\frac{\partial^2\mathbf A}"):
        assert present in head


# what a notation sentence explains, and how the body of a report prints it (a regular expression)
A = r"\\mathbf A(?:\^\{[^{}]*\})?"
USES = {
    "commutation": r"\\mathbf K_\{",
    "diag_selector": r"\\mathbf E_\{",
    "diag": r"\\operatorname\{diag\}\\left\(",
    "softmax_diff": rf"(?<!\{{)\\partial{A}\\left\[",
    "softmax_diff2": rf"\\partial\^2{A}\\left\[",
    "softmax_jac": rf"\\frac\{{\\partial{A}\}}",
    "softmax_hess": rf"\\frac\{{\\partial\^2{A}\}}",
    "softmax_jac_of": r"\\mathbf J\^\{\(1\)\}_\{\\operatorname\{softmax\}\}",
    "softmax_hess_of": r"\\mathbf J\^\{\(2\)\}_\{\\operatorname\{softmax\}\}",
    "causal_mask": r"\\mathbf M\^\{\\mathrm\{causal\}\}",
    "softmax_causal": r"\\operatorname\{softmax\}_\{\\mathrm\{causal\}\}",
    "kron": r"\\otimes",
    "hadamard": r"\\odot",
    "relu": r"\\operatorname\{ReLU\}\\left\(",
    "step": r"\\operatorname\{step\}",
    "prime": r"\}'",
}


@pytest.mark.parametrize("name,options", [("attention", {}), ("attention", {"causal": True}),
                                          ("layernorm", {}), ("ffn", {}), ("ffn", {"activation": "gelu"}),
                                          ("linear_attention", {}),
                                          ("multihead_attention", {})])
def test_notation_paragraph_matches_the_body(name, options):
    text = render_report(sh.layer(name, **options))
    head, rest = text.split(r"\noindent Notation:", 1)
    notation, rest = rest.split(r"\section{", 1)
    body = head + rest                        # the layer's definition and every section
    for key, mark in USES.items():
        assert (GLOSSARY[key] in notation) == bool(re.search(mark, body)), (key, mark)


def test_commutation_sentence_holds():
    """K_{m,n} vec_r B = vec_r Bᵀ for B ∈ R^{n×m}, as the notation paragraph states."""
    assert r"\mathbf B\in\mathbb R^{n\times m}" in GLOSSARY["commutation"]
    K = np.asarray(evaluate(E.commutation(2, 3), {}, env={}))
    B = np.arange(6.0).reshape(3, 2)
    assert np.array_equal(K @ B.ravel(), B.T.ravel())


def test_a_definition_is_not_restated():
    """M_1 := AX followed by its row-wise meaning, never by its right-hand side again."""
    d = sh.derive(sh.layer("attention"), "mse")
    defs = {df.symbol: df for df in definitions(report_expressions(d), d.latex_names)}
    m1 = defs[r"\mathbf M_1"]
    assert m1.tex == r"\mathbf A\mathbf X" and m1.note.startswith(r",\ \text{rows }")
    for df in defs.values():
        assert not (df.note or "").startswith("=" + df.tex), df.symbol
    text = render_report(sh.layer("attention"), losses=("mse",))
    assert not re.search(r"^(.*?) &:= (.+?)=\2\s*(?:\\\\)?$", text, flags=re.M)


def test_third_moment_note_is_contracted_with_its_own_argument(attention_report):
    """M_3[G W_Vᵀ]'s note sums the tensor against the entries of G W_Vᵀ, not an undefined E."""
    row = next(rhs for lhs, rhs in _rows(attention_report) if lhs.startswith(r"\mathbf M_3"))
    assert r"\left[\mathbf G\mathbf W_{V}^\top\right]_{ia}" in row
    assert "E_{ia}" not in attention_report


# ----------------------------------------------------------------------------- entrywise functions
def _derivatives(name):
    f = get_function(name)
    return [g for g in (f, f.derivative(), f.derivative().derivative())
            if not g.is_zero and g.constant is None]


@pytest.mark.parametrize("name", sorted(FUNCTIONS) + ["pow"])
def test_derivatives_of_entrywise_functions_print_readably(name):
    """No prime on a superscript ((σ²)^{-1/2}′): powers get the explicit function, names a prime."""
    gs = _derivatives(name) if name != "pow" else [get_function("pow", 3).derivative()]
    for g in gs:
        tex = function_tex(g)
        assert not re.search(r"\^\{[^{}]*\}'", tex) and r"\mathbb 1" not in tex, tex
        if r"\cdot" in tex:
            assert "'" not in tex, tex


def test_explicit_derivatives_are_the_derivatives():
    """The printed (·) form of a derivative, read back by sympy, is the derivative."""
    from symhess.expr.scalarfn import x
    for name in ("rsqrt", "sqrt", "recip", "square"):
        for g in _derivatives(name)[1:]:
            tex = function_tex(g)
            if tex.startswith(r"\left(") and tex.endswith(r"\right)"):
                tex = tex[len(r"\left("):-len(r"\right)")]
            m = re.fullmatch(r"(-)?\s*(?:\\tfrac\{(\d+)\}\{(\d+)\}|(\d+))?\(\\cdot\)(?:\^\{(-?\d+)(?:/(\d+))?\})?", tex)
            assert m, tex
            sign = -1 if m.group(1) else 1
            coef = sp.Rational(int(m.group(2)), int(m.group(3))) if m.group(2) else int(m.group(4) or 1)
            q = sp.Rational(int(m.group(5) or 1), int(m.group(6) or 1))
            assert sp.simplify(sign * coef * x**q - g.expr) == 0, (name, tex)


def test_rsqrt_derivatives_are_explicit(layernorm_report):
    rsqrt = get_function("rsqrt")
    assert function_tex(rsqrt.derivative()) == r"\left(- \tfrac{1}{2}(\cdot)^{-3/2}\right)"
    assert function_tex(rsqrt.derivative().derivative()) == r"\tfrac{3}{4}(\cdot)^{-5/2}"
    assert function_tex(get_function("gelu_tanh").derivative()) == r"\operatorname{GELU}'_{\tanh}"
    assert function_tex(get_function("tanh").derivative().derivative()) == r"\tanh''"
    assert r"(\boldsymbol\sigma^2_Z)^{-3/2}" in layernorm_report
    assert not re.search(r"\^\{[^{}]*\}'", layernorm_report)


def test_head_and_sub_layer_superscripts_are_explained():
    """W_Q^{1} (head 1) and A^{(2)} (sub-layer 2) are labels, and the notation says so."""
    heads = render_report(sh.layer("multihead_attention"), losses=("mse",)).split(r"\section{")[0]
    assert GLOSSARY["head_label"] in heads and GLOSSARY["layer_label"] not in heads
    stack = render_report(sh.layer("attention_stack"), losses=("mse",)).split(r"\section{")[0]
    assert GLOSSARY["layer_label"] in stack and GLOSSARY["head_label"] not in stack
    plain = render_report(sh.layer("attention"), losses=("mse",)).split(r"\section{")[0]
    assert GLOSSARY["head_label"] not in plain and GLOSSARY["layer_label"] not in plain


def test_a_sum_prints_a_positive_term_first():
    """M_Z := X − (1/d_V) X 1, not −(1/d_V) X 1 + X."""
    text = render_report(sh.layer("layernorm"), losses=("mse",))
    assert r"\mathbf M_Z &:= \mathbf X- \frac{1}{d_{V}}" in text
    assert not re.search(r"&:= -", text)


# ----------------------------------------------------------------------------- the layer
def _used(symbol, tex):
    return re.search(re.escape(symbol) + r"(?![A-Za-z0-9_{^])", tex) is not None


@pytest.mark.parametrize("name", sorted(sh.LAYERS))
def test_first_display_defines_the_layer_before_using_a_symbol(name):
    """The report opens with the layer's definition: each named quantity it is built from,
    defined once and before any use, and F last in those symbols."""
    from symhess.cli.report import layer_definition
    rows, defined = layer_definition(sh.layer(name))
    lhs = [row.partition("&")[0].strip() for row in rows if not row.startswith("&")]
    assert lhs[-1] == r"\mathbf F" and len(set(lhs)) == len(lhs) and set(lhs) == defined
    for i, row in enumerate(r for r in rows if not r.startswith("&")):
        rhs = row.partition("&")[2]
        assert not any(_used(sym, rhs) for sym in lhs[i:]), (name, row)


def test_post_ln_report_states_the_block_not_only_f_equals_z(layernorm_report):
    """Post-LN's output is the name Z: the first display defines Y = LN(X + SA(X)) and
    Z = LN(Y + FFN(Y)) through their parts instead of reading F = Z alone."""
    from symhess.cli.report import layer_definition
    rows, _ = layer_definition(sh.layer("post_ln_block"))
    row = {r.partition("&")[0].strip(): r.partition("&")[2] for r in rows}
    Y = r"\widetilde{\mathbf Y}"
    assert r"\mathbf A\mathbf X\mathbf W_{V}" in row[r"\mathbf M_Y"] and "+\\mathbf X" in row[r"\mathbf M_Y"]
    assert row[Y] == r":= \mathbf M_Y\odot \mathbf P_Y"
    assert row[r"\mathbf S"] == r":= \operatorname{ReLU}\left(\mathbf H\right)\mathbf W_{2}+" + Y
    assert row[r"\mathbf H"] == r":= " + Y + r"\mathbf W_{1}"
    assert row[r"\mathbf Z"] == r":= \mathbf M_Z\odot \mathbf P_Z"
    assert list(row)[-2:] == [r"\mathbf Z", r"\mathbf F"] and row[r"\mathbf F"] == r"= \mathbf Z"
    # the same in a document: defined in the first display, not again under each loss
    first = layernorm_report.split(r"\section{", 1)[0]
    assert r"\mathbf Z &:= \mathbf M_Z\odot \mathbf P_Z" in first and r"\mathbf F &= \mathbf Z" in first
    assert layernorm_report.count(r"\mathbf Z &:=") == 1 and r"\mathbf F &:=" not in layernorm_report

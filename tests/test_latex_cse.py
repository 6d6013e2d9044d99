"""Shared sub-expressions in LaTeX (symhess.printing.latex_cse): readable full-block reports."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import symhess as sh
from symhess import expr as E
from symhess.expr.evaluate import evaluate
from symhess.printing import latex_cse as C
from symhess.expr.latex import latex
from symhess.cli.report import MAX_TERM_CHARS, render_report, write_report
from symhess.calculus.verify import random_values

ROOT = Path(__file__).resolve().parent.parent
NEED_TEX = os.environ.get("CI") == "true"
PARAMS = ("W_Q", "W_K", "W_V", "W_1", "W_2")


@pytest.fixture(scope="module")
def post_ln():
    """The post-LN MSE derivation, every (outer, functional) block, and its shared names."""
    d = sh.derive(sh.layer("post_ln_block"), "mse")
    blocks = [d.block(p, q, part) for p in PARAMS for q in PARAMS for part in ("outer", "functional")]
    terms = [t for b in blocks for t in C.terms(b.expr)]
    defs, names = C.share(terms, d.latex_names, hints=C.jacobian_names(d))
    return d, terms, defs, names


def test_full_block_terms_fit_after_naming(post_ln):
    d, terms, defs, names = post_ln
    before = max(len(C._MemoPrinter(d.latex_names).doprint(t)) for t in terms)
    after = max(len(C.latex(t, names, defs)) for t in terms)
    longest_def = max(len(s.tex) for s in defs)
    assert before > 100_000  # the chain rule through two LayerNorms: unreadable in full
    assert after <= C.MAX_CHARS and longest_def <= C.MAX_CHARS
    assert len({s.symbol for s in defs}) == len(defs)


def test_definitions_are_in_dependency_order(post_ln):
    _, _, defs, _ = post_ln
    for i, s in enumerate(defs):
        assert not any(later.symbol in s.tex for later in defs[i:]), s.symbol


def test_recurring_jacobians_are_named_by_what_they_are(post_ln):
    """∂vec_r Y/∂vec_r W_Q (a LayerNorm output w.r.t. a weight) recurs: it is named so (Y with a
    tilde: the plain symbol is the loss target)."""
    d, _, defs, _ = post_ln
    symbols = {s.symbol: s for s in defs}
    s = symbols[r"\frac{\partial \widetilde{\mathbf Y}}{\partial \mathbf W_{Q}}"]
    assert C.jacobian_names(d)[s.node] == s.symbol
    numbered = [x for x in defs if x.symbol.startswith(r"\mathcal")]
    assert len(numbered) == len({x.symbol for x in numbered}) and len(numbered) < len(defs)


def test_printed_names_are_exactly_substitutions(post_ln):
    """Printing with the names = printing the expression with each node replaced by its symbol."""
    d, terms, defs, names = post_ln
    for t in terms[::7]:
        assert latex(C.named_form(t, defs, d.latex_names), d.latex_names) == C.latex(t, names, defs)
    for s in defs[::5]:
        assert latex(C.definition_form(s, defs, d.latex_names), d.latex_names) == s.tex


def test_named_form_expands_back(post_ln):
    """The definitions substituted back give the original terms, structurally and numerically."""
    d, terms, defs, _ = post_ln
    for t in terms:
        assert C.expand(C.named_form(t, defs, d.latex_names), defs, d.latex_names) == t
    # evaluate the "where" list in order (each symbol from its definition form) and the
    # terms from their named forms: the same numbers as the terms evaluated directly
    values = random_values(d, seed=3)
    env = d.dimension_env(values)
    named = dict(values)
    for s in defs:
        named[s.var.name] = np.asarray(evaluate(C.definition_form(s, defs, d.latex_names), named, env=env))
    for t in terms[::8]:                    # every term structurally above; a sample numerically
        want = np.asarray(evaluate(t, values, env=env))
        got = np.asarray(evaluate(C.named_form(t, defs, d.latex_names), named, env=env))
        assert np.abs(got - want).max() <= 1e-12 * max(1.0, np.abs(want).max())


def test_recurring_subexpression_is_named_once_and_transpose_counts():
    L, d = E.dims("L d")
    X, W = E.matrix("X", L, d), E.param("W", d, d)
    big = E.softmax_rows(X @ W @ W.T @ X.T + X @ X.T)
    roots = [big @ X, X.T @ big.T, E.elementwise("exp", big)]
    defs, names = C.share(roots, min_chars=20, max_chars=10_000)
    assert [s.node for s in defs] == [big] and names[big] == r"\mathcal S_{1}"
    assert latex(roots[1], names) == r"\mathbf X^\top\mathcal S_{1}^\top"
    defs, _ = C.share(roots, min_chars=10_000, max_chars=10_000)
    assert defs == []  # nothing is long enough


def test_a_term_too_long_gets_its_longest_parts_named():
    L, d = E.dims("L d")
    X, W = E.matrix("X", L, d), E.param("W", d, d)
    term = E.add(*(E.elementwise(f, X @ W + X) for f in ("tanh", "exp", "sigmoid")))
    full = len(latex(term))
    defs, names = C.share([term], min_chars=10, max_chars=full // 2)
    assert defs and len(latex(term, names)) <= full // 2
    assert all(len(s.tex) <= full // 2 for s in defs)


def test_attention_report_is_unchanged():
    lay = sh.layer("attention")
    d = sh.derive(lay, "mse")
    exprs = [d.block(p, q, part).expr for p in lay.param_names for q in lay.param_names
             for part in ("outer", "functional")]
    assert C.share_if_long(exprs, d.latex_names, MAX_TERM_CHARS) == ([], d.latex_names)
    assert "Shared sub-expressions" not in render_report(lay, losses=("mse",))


def _derive_cli(seed):
    env = dict(os.environ, PYTHONHASHSEED=str(seed))
    cmd = [sys.executable, "-m", "symhess", "derive", "post_ln_block", "--block", "W_V,W_1", "--part", "all"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, check=True).stdout


@pytest.mark.slow
def test_naming_is_deterministic_across_processes():
    """Different hash seeds (set iteration order) give byte-identical LaTeX."""
    a, b = _derive_cli(1), _derive_cli(2)
    assert a == b
    lines = a.decode().splitlines()
    assert " := " in lines[0] and lines[-1].startswith(r"\mathbf H(")
    assert max(map(len, lines)) <= MAX_TERM_CHARS


@pytest.mark.skipif(shutil.which("pdflatex") is None and not NEED_TEX, reason="pdflatex not installed")
@pytest.mark.slow
def test_post_ln_report_compiles_without_summaries(tmp_path):
    out = write_report(sh.layer("post_ln_block"), tmp_path / "post.tex", losses=("mse",), pdf=True)
    text = out.read_text()
    assert "LaTeX characters; print it with" not in text and "Shared sub-expressions" in text
    assert r"\frac{\partial \widetilde{\mathbf Y}}{\partial \mathbf W_{Q}} &:= " in text
    assert max(len(line) for line in text.splitlines()) <= MAX_TERM_CHARS
    assert text.count(r"\mathbf H_o(") == 25 and text.count(r"\mathbf H_f(") == 25
    pdf = out.with_suffix(".pdf").read_bytes()
    assert pdf[:5] == b"%PDF-"

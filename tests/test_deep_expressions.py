"""Deep expressions do not depend on Python's recursion limit: the structural properties of
nodes, substitution, the Kronecker view, the printers, the interpreter and the kernels'
index lowering walk a DAG children-first (or run their rules on an explicit stack) without
nesting calls per level.  A six-layer attention stack (gradient
expressions 81 levels high) is derived, printed and evaluated with 100 frames to spare,
where walks recursing per level would need several hundred; the numbers are torch's."""
import contextlib
import inspect
import io
import sys

import numpy as np
import pytest
import torch

import symhess as sh
from symhess.expr import nodes as E
from symhess.cli.main import main
from symhess.expr.evaluate import evaluate
from symhess.codegen.index import Lowering
from symhess.printing.latex_cse import share_if_long
from symhess.codegen.program import Program
from symhess.expr.text import text
from symhess.calculus.verify import random_values

DEPTH = 6


def height(e):
    h = {}
    for n in E.walk(e):
        h[n] = 1 + max((h[a] for a in n.args), default=0)
    return h[e]


@contextlib.contextmanager
def frames_to_spare(n):
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + n)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


@pytest.fixture(scope="module")
def case():
    lay = sh.layer("attention_stack", depth=DEPTH)
    der = sh.derive(lay, "mse")
    values = random_values(der, seed=0, sizes={"L": 3, "d_V": 3, "d_K": 2})
    # the gradient of W_Q_1 from torch autograd through the interpreted forward
    t = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in values.items()}
    w = t["W_Q_1"].clone().requires_grad_(True)
    F = evaluate(lay.output, {**{k: v for k, v in t.items() if k != "Y"}, "W_Q_1": w},
                 backend="torch")
    loss = ((F - t["Y"]) ** 2).sum() / F.numel()
    (grad,) = torch.autograd.grad(loss, w)
    return lay, der, values, grad.numpy()


def test_deep_expressions_do_not_depend_on_the_recursion_limit(case):
    lay, _, values, want = case
    with frames_to_spare(100):
        der = sh.derive(sh.layer("attention_stack", depth=DEPTH), "mse")
        g = der.gradient("W_Q_1")
        assert height(g) > 80
        got = evaluate(g, values)
        block = der.block("W_Q_1", "W_K_1", "functional")
        assert not block.is_zero
        assert "[G @ W_V_6.T @ X^(6).T]" in text(g) and r"\mathbf W" in g.latex()
        shared, _ = share_if_long([g], der.latex_names, 4000)
        assert shared                           # long enough to name sub-expressions
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(["derive", "attention_stack", "--set", f"depth={DEPTH}",
                         "--block", "W_Q_1,W_K_1", "--part", "outer"]) == 0
        assert r"\mathbf H_o(" in out.getvalue()
        assert len(der.hvp_expressions("full")) == len(lay.param_names)
    assert np.abs(np.asarray(got) - want).max() <= 1e-10 * np.abs(want).max()


def test_the_index_lowering_does_not_depend_on_the_recursion_limit():
    """The kernels' lowering of a three-layer stack's Jacobian, with 60 frames to spare
    (recursing per nested operator needs more than that)."""
    der = sh.derive(sh.layer("attention_stack", depth=3), "mse")
    jac = der.jacobian("W_Q_1")
    with frames_to_spare(60):
        prog = Program(der)
        prog.lowering = Lowering()
        terms = prog._lower(prog.lowering, jac, der.F.shape, der.param("W_Q_1").shape)
    assert len(terms) == 4 ** 2           # every path through the two residual layers after

"""The addition model's blocks against torch autograd, small-σ slopes, and the experiment CLI."""
import math

import numpy as np
import pytest
import torch

from symhess.cli import data  # noqa: F401  (registers addition_block)
from symhess.layers import models
from symhess.cli.experiments import Config, Experiment, BlockColumns, fit_slope
from symhess.cli.main import main


def main_experiment(argv):
    return main(["experiment", *argv])

SMALL = dict(d_model=4, d_head=3, d_mlp=5, batch=2)


def _forward(v, attention, norm):
    """Independent torch forward of the declared model (no symhess code)."""
    def ln(x):
        c = x - x.mean(1, keepdim=True)
        return c / torch.sqrt((c * c).mean(1, keepdim=True) + 1e-5)
    ident = (lambda x: x) if norm == "none" else ln
    X = v["O"] @ v["W_E"] + v["P"]
    Xa = ident(X)
    T = Xa @ v["W_Q"] @ v["W_K"].T @ Xa.T / math.sqrt(v["W_Q"].shape[1])
    if attention == "softmax":
        L = T.shape[0]
        A = torch.softmax(T.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), -math.inf), 1)
        X1 = X + A @ Xa @ v["W_V"] @ v["W_O"]
    else:
        X1 = (T * v["M"]) @ Xa @ v["W_V"] @ v["W_O"]
    X2 = X1 + torch.relu(ident(X1) @ v["W_1"]) @ v["W_2"]
    Z = ident(X2) @ v["W_U"]
    return Z * v["R"] if attention == "linear" else Z


def _loss(z, y, attention):
    if attention == "linear":
        return ((z - y) ** 2).sum()
    return -(y * torch.log_softmax(z, 1)).sum() / 6


def _autograd_block(exp, sigma, seed, p):
    """(H_o, H_f, H) of the batch-mean loss for W_p by reverse-over-reverse autograd."""
    cfg = exp.cfg
    vals, O, Y, _ = exp.tensors(sigma, seed)
    w0 = vals[p]

    def out(w, b):
        return _forward(dict(vals, **{p: w, "O": O[b]}), cfg.attention, cfg.norm)

    full, outer = 0, 0
    for b in range(O.shape[0]):
        f = lambda w: _loss(out(w, b), Y[b], cfg.attention)  # noqa: E731
        full = full + torch.func.hessian(f)(w0).reshape(w0.numel(), -1)
        J = torch.func.jacrev(out)(w0, b).reshape(-1, w0.numel())
        z = out(w0, b)
        Hz = torch.func.hessian(lambda zz: _loss(zz, Y[b], cfg.attention))(z).reshape(z.numel(), -1)
        outer = outer + J.T @ Hz @ J
    n = O.shape[0]
    return {"outer": outer / n, "functional": (full - outer) / n, "full": full / n}


@pytest.mark.parametrize("attention,norm,tol", [("softmax", "none", 1e-10), ("linear", "none", 1e-10),
                                                ("softmax", "pre", 1e-9)])
def test_blocks_match_autograd(attention, norm, tol):
    exp = Experiment(Config(attention=attention, norm=norm, **SMALL))
    for p in ("W_Q", "W_V"):
        ref = _autograd_block(exp, 0.7, 1, p)
        for part in ("outer", "functional", "full"):
            got = torch.as_tensor(exp.dense_block(p, 0.7, 1, part))
            scale = max(float(ref["full"].norm()), float(ref["outer"].norm()))
            err = float((got - ref[part]).norm()) / scale
            assert err <= tol, (p, part, err)


def test_engine_kronecker_block_agrees_with_columns():
    """The engine's Kronecker-view block (interpreter) equals the vmapped matrix-view columns."""
    exp = Experiment(Config(**SMALL))
    vals, O, Y, _ = exp.tensors(0.5, 2)
    np_vals = {k: v.numpy() for k, v in vals.items()}
    for p in ("W_Q", "W_V"):
        ref = sum(exp.derivation.block(p, p, "outer").evaluate(dict(np_vals, O=O[b].numpy(), Y=Y[b].numpy()))
                  for b in range(O.shape[0])) / O.shape[0]
        got = exp.dense_block(p, 0.5, 2, "outer")
        assert np.linalg.norm(got - ref) <= 1e-12 * np.linalg.norm(ref)


@pytest.mark.parametrize("attention,norm", [("softmax", "none"), ("linear", "none"),
                                            pytest.param("softmax", "pre", marks=pytest.mark.slow)])
def test_generated_frobenius_split_agrees_with_columns(attention, norm):
    """The scaling sweep's norms (generated pairings, no block) equal the block columns' norms."""
    exp = Experiment(Config(attention=attention, norm=norm, **dict(SMALL, batch=3)))
    for p in ("W_Q", "W_V"):
        got = exp.frobenius_norms(p, 0.6, 1)
        ref = exp.frobenius_norms_by_columns(p, 0.6, 1)
        for part in ("outer", "functional", "full"):
            assert abs(got[part] - ref[part]) <= 1e-10 * max(ref["full"], ref["outer"]), (p, part)


SIGMAS = list(10 ** np.linspace(-2.5, -1, 4))


def _slopes(attention, norm, sigmas=SIGMAS, **sizes):
    cfg = Config(attention=attention, norm=norm, **dict(SMALL, d_model=6, d_head=5, d_mlp=7, batch=3, **sizes))
    exp = Experiment(cfg)
    out = {}
    for p in ("W_Q", "W_V"):
        norms = [exp.frobenius_norms(p, s, 0) for s in sigmas]
        for part in ("outer", "functional", "full"):
            zero = exp.structural_zero(p, part)
            out[(p, part)] = "zero" if zero else fit_slope(sigmas, [n[part] for n in norms], 0.1)
    return out


def test_softmax_slopes():
    s = _slopes("softmax", "none")
    assert s[("W_V", "outer")] == pytest.approx(2, abs=0.15)
    assert s[("W_Q", "outer")] == pytest.approx(6, abs=0.15)
    assert s[("W_Q", "functional")] == pytest.approx(5, abs=0.15)
    assert s[("W_V", "functional")] == "zero"           # the engine derives the Zero node
    assert s[("W_V", "full")] == pytest.approx(2, abs=0.15)


def test_linear_attention_slopes():
    s = _slopes("linear", "none")
    for p in ("W_Q", "W_V"):
        assert s[(p, "outer")] == pytest.approx(6, abs=0.15)
        assert s[(p, "full")] == pytest.approx(6, abs=0.15)
        assert s[(p, "functional")] == "zero"            # block-hollow H_f (attention.md §10)


def test_pre_ln_is_near_flat():
    s = _slopes("softmax", "pre", sigmas=list(10 ** np.linspace(-2, -1, 3)))
    for key, slope in s.items():
        assert slope != "zero" and abs(slope) < 1, (key, slope)


def test_cli_scaling_writes_csv_and_png(tmp_path, capsys):
    rc = main_experiment(["scaling", "--d-model", "4", "--d-head", "3", "--d-mlp", "5", "--batch", "2",
                          "--seeds", "2", "--sigmas", "0.01,0.03,0.1", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "H_f(W_V): identically 0" in text and "fitted slopes" in text
    assert (tmp_path / "scaling_softmax.png").stat().st_size > 10000
    lines = (tmp_path / "scaling_softmax.csv").read_text().splitlines()
    assert lines[0] == "sigma,seed,block,part,norm,structural_zero" and len(lines) == 1 + 3 * 2 * 2 * 3
    from PIL import Image
    title = Image.open(tmp_path / "scaling_softmax.png").text["Title"]
    assert title == "softmax attention, d_model=4, d_head=3, d_mlp=5, batch=2, 2 seed(s)"


@pytest.mark.parametrize("norm,attention,name", [("pre", "softmax", "pre-LN softmax attention"),
                                                  ("pre", "linear", "pre-LN linear attention"),
                                                  ("none", "linear", "linear attention")])
def test_scaling_title_names_the_model(norm, attention, name):
    from symhess.cli.experiments import Config, scaling_title
    cfg = Config(d_model=8, d_mlp=32, batch=8, norm=norm, attention=attention)
    assert scaling_title(cfg, 3) == f"{name}, d_model=8, d_head=128, d_mlp=32, batch=8, 3 seed(s)"


@pytest.mark.slow
def test_scaling_figure_names_the_model(tmp_path, capsys):
    """The pre-LN figure's title names the model (pre-LN softmax attention), stored in the PNG."""
    from PIL import Image

    rc = main_experiment(["scaling", "--norm", "pre", "--d-model", "4", "--d-head", "3", "--d-mlp", "5",
                          "--batch", "2", "--seeds", "1", "--sigmas", "0.01,0.1", "--out", str(tmp_path),
                          "--quiet"])
    assert rc == 0
    title = Image.open(tmp_path / "scaling_pre.png").text["Title"]
    assert title.startswith("pre-LN softmax attention, d_model=4"), title


def test_cli_histogram_and_bounds(tmp_path, capsys):
    rc = main_experiment(["histogram", "--d-model", "4", "--d-head", "3", "--d-mlp", "5", "--batch", "2",
                          "--out", str(tmp_path)])
    assert rc == 0 and (tmp_path / "histogram.png").exists()
    assert "ratio V/Q" in capsys.readouterr().out
    assert main_experiment(["bounds", "--trials", "1"]) == 0
    out = capsys.readouterr().out
    assert "bound violated for: none" in out


@pytest.mark.parametrize("argv,msg", [(["scaling", "--sigmas", "0,1"], "positive"),
                                      (["scaling", "--sigmas", "abc"], "--sigmas"),
                                      (["scaling", "--batch", "0"], "--batch")])
def test_cli_bad_input(argv, msg, capsys):
    assert main_experiment(argv + ["--quiet"]) == 2
    assert msg in capsys.readouterr().err


# ----------------------------------------------------------------------------- depth
def _forward_deep(v, attention, depth):
    """Independent torch forward of the depth-n model without LayerNorm (no symhess code)."""
    X = v["O"] @ v["W_E"] + v["P"]
    L = X.shape[0]
    for k in range(1, depth + 1):
        w = {n: v[f"{n}_{k}"] for n in ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2")}
        T = X @ w["W_Q"] @ w["W_K"].T @ X.T / math.sqrt(w["W_Q"].shape[1])
        if attention == "softmax":
            A = torch.softmax(T.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), -math.inf), 1)
            X = X + A @ X @ w["W_V"] @ w["W_O"]
        else:
            X = (T * v[f"M_{k}"]) @ X @ w["W_V"] @ w["W_O"]
        X = X + torch.relu(X @ w["W_1"]) @ w["W_2"]
    Z = X @ v["W_U"]
    return Z * v["R"] if attention == "linear" else Z


@pytest.mark.parametrize("attention", ["softmax", pytest.param("linear", marks=pytest.mark.slow)])
def test_two_layer_blocks_match_autograd(attention, monkeypatch):
    exp = Experiment(Config(attention=attention, depth=2, **SMALL))
    assert exp.blocks == ("W_Q_1", "W_V_1", "W_Q_2", "W_V_2")
    monkeypatch.setitem(globals(), "_forward", lambda v, a, n: _forward_deep(v, a, 2))
    for p in ("W_Q_1", "W_V_2"):                     # across layers: the first and the last
        ref = _autograd_block(exp, 0.8, 1, p)
        got = exp.exact_norms(p, 0.8, 1)
        for part in ("outer", "functional", "full"):
            want = float(ref[part].norm())
            assert abs(got[part] - want) <= 1e-10 * float(ref["full"].norm() + ref["outer"].norm()), (p, part)


def _deep_slopes(attention, depth, sigmas):
    exp = Experiment(Config(attention=attention, depth=depth, **dict(SMALL, d_model=5, d_head=4, d_mlp=6)))
    out = {}
    for p in exp.blocks:
        norms = [exp.exact_norms(p, s, 0) for s in sigmas]
        for part in ("outer", "functional", "full"):
            zero = exp.structural_zero(p, part)
            out[(p, part)] = "zero" if zero else fit_slope(sigmas, [n[part] for n in norms], 0.1)
    return out


def test_linear_attention_two_layers_slope_eighteen():
    """No residual around linear attention: the output is ~X^9, every H_o block grows as σ^18;
    the first layer's functional blocks as σ^9 (the residual F − Y → −Y), the last layer's
    diagonal ones are structurally zero."""
    s = _deep_slopes("linear", 2, [0.01, 0.1])         # an exact power law: two σ fix the slope
    for p in ("W_Q_1", "W_V_1", "W_Q_2", "W_V_2"):
        assert s[(p, "outer")] == pytest.approx(18, abs=0.01), p
    for p in ("W_Q_1", "W_V_1"):
        assert s[(p, "functional")] == pytest.approx(9, abs=0.01), p
    assert s[("W_Q_2", "functional")] == s[("W_V_2", "functional")] == "zero"


@pytest.mark.slow
def test_softmax_two_layers_keep_the_one_layer_slopes():
    s = _deep_slopes("softmax", 2, list(10 ** np.linspace(-2.5, -1, 4)))
    for k in (1, 2):
        assert s[(f"W_V_{k}", "outer")] == pytest.approx(2, abs=0.15)
        assert s[(f"W_Q_{k}", "outer")] == pytest.approx(6, abs=0.15)
        assert s[(f"W_Q_{k}", "functional")] == pytest.approx(5, abs=0.15)


@pytest.mark.slow
def test_linear_attention_three_layers_slope_fifty_four():
    s = _deep_slopes("linear", 3, list(10 ** np.linspace(-2, -1, 3)))
    for k in (1, 2, 3):
        for p in ("W_Q", "W_V"):
            assert s[(f"{p}_{k}", "outer")] == pytest.approx(54, abs=0.05)


@pytest.mark.slow
def test_cli_scaling_depth_writes_per_layer_rows(tmp_path, capsys):
    rc = main_experiment(["scaling", "--attention", "linear", "--depth", "2", "--d-model", "4",
                          "--d-head", "3", "--d-mlp", "5", "--batch", "2", "--seeds", "1",
                          "--sigmas", "0.01,0.1", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "H_o(W_Q_2): 18.000   (paper: 18)" in text
    assert (tmp_path / "scaling_linear_depth2.png").stat().st_size > 10000
    lines = (tmp_path / "scaling_linear_depth2.csv").read_text().splitlines()
    assert len(lines) == 1 + 2 * 4 * 3

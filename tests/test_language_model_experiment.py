"""The language-model experiment: its numbers against autograd of the model's own loss."""
import csv

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

from symhess.cli import language_model as lm  # noqa: E402
from symhess.cli.data import addition_batches  # noqa: E402
from symhess.cli.main import main  # noqa: E402
from symhess.layers.modules import no_downcasts  # noqa: E402
from flat_params import hessian_rows, unflat  # noqa: E402

TINY = ["--layers", "2", "--d-model", "8", "--heads", "2", "--d-mlp", "16", "--steps", "4",
        "--batch", "8", "--eval-batches", "2", "--eval-batch", "2", "--k", "3", "--ncv", "24",
        "--quiet"]


class Args:
    layers, d_model, heads, d_mlp, seed = 2, 8, 2, 16, 0


def autograd_columns(model, held, positions):
    """Columns of the Hessian of the mean held-out loss (the model's own, its float32 cast of
    the logits neutralised: ``no_downcasts``), by autograd."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])

    def loss(th):
        params = unflat(th, names, shapes)
        ids = [torch.as_tensor(b) for b in held]
        return sum(torch.func.functional_call(model, params, (), {
            "input_ids": b, "labels": b, "use_cache": False}).loss for b in ids) / len(ids)
    with no_downcasts():
        return hessian_rows(loss, theta, positions)


@pytest.fixture(scope="module")
def captured():
    """The experiment's model (2 layers, d_model 8) at initialisation, captured on held-out
    sequences."""
    import symhess as sh
    model = lm.build_model(Args)
    held = addition_batches(1, 3, seed=5)
    ids = torch.as_tensor(held[0])
    ml = sh.from_module(model, (), {"input_ids": ids, "labels": ids, "use_cache": False})
    return model, ml, held


def test_groups_cover_every_parameter_once_with_q_k_v_columns(captured):
    model, ml, _ = captured
    gs, heads = lm.groups(ml, 8, 4)
    allpos = np.sort(np.concatenate(list(gs.values())))
    assert np.array_equal(allpos, np.arange(len(ml.index)))
    assert {k for k in gs if k[0] is not None} == {(l, k) for l in (0, 1) for k in lm.KINDS}
    # Q of layer 1: c_attn's first d columns and bias entries: 8·8 + 8 entries
    assert gs[(1, "Q")].size == 72 and gs[(None, "embedding")].size == 12 * 8
    # a head's W_Q, W_K, W_V columns: 3 · 8 · 4 entries, heads disjoint
    assert all(v.size == 96 for v in heads.values()) and len(heads) == 4
    pos = ml.module_positions()
    flat = {n: p.numel() for n, p in model.named_parameters()}
    start = dict(zip(flat, np.cumsum([0] + list(flat.values()))[:-1]))
    c_attn = start["transformer.h.0.attn.c_attn.weight"]
    order = np.concatenate([pos[p.name] for p in ml.layer.params])
    for h in range(2):
        cols = {(int(order[i]) - c_attn) % 24 for i in heads[(0, h)]}
        assert cols == {k * 8 + h * 4 + j for k in range(3) for j in range(4)}


@pytest.mark.slow     # trains and forms two dense Hessians of a 2-layer model
def test_experiment_numbers_equal_autograd(tmp_path, capsys):
    assert main(["experiment", "language-model", *TINY, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "held-out loss" in out and "Theorem 1" in out
    with open(tmp_path / "language_model.csv") as fh:
        rows = {(r["state"], r["group"]): r for r in csv.DictReader(fh)}
    assert {s for s, _ in rows} == {"initial", "trained"}
    assert (tmp_path / "language_model.png").stat().st_size > 10_000
    # the initial model again (same seed) and the held-out data: blocks by autograd
    import symhess as sh
    model = lm.build_model(Args)
    held = addition_batches(2, 2, seed=2)
    ids = torch.as_tensor(held[0])
    ml = sh.from_module(model, (), {"input_ids": ids, "labels": ids, "use_cache": False})
    gs, _ = lm.groups(ml, 8, 4)
    order = np.concatenate([ml.module_positions()[p.name] for p in ml.layer.params])
    for key in ((0, "Q"), (None, "final LN"), (1, "LN")):
        mod = order[gs[key]]                       # the group's positions in the model's vector
        want = autograd_columns(model, held, mod)[:, mod].numpy()
        r = rows[("initial", lm.label(key))]
        scale = np.linalg.norm(want)
        assert abs(float(r["frobenius"]) - scale) <= 1e-10 * scale
        assert abs(float(r["trace"]) - np.trace(want)) <= 1e-10 * scale
        assert abs(float(r["max_abs_diagonal"]) - np.abs(np.diag(want)).max()) <= 1e-10 * scale
        assert abs(float(r["spectral_norm"]) - np.linalg.norm(want, 2)) <= 1e-10 * scale


def test_dense_hessian_columns_equal_autograd(captured):
    import symhess as sh
    model, ml, held = captured
    k = sh.kernel(ml.layer, "torch", ml.loss)
    op = sh.operator(k, ml.batches(held), p=list(ml.layer.param_names),
                     params=ml.params(model))
    H = lm.dense_hessian(op, 97, False)                # chunks that do not divide N
    order = np.concatenate([ml.module_positions()[p.name] for p in ml.layer.params])
    pick = np.random.default_rng(0).choice(len(order), 12, replace=False)
    want = autograd_columns(model, held, order[pick]).numpy()[:, order]
    assert np.abs(H[pick] - want).max() <= 1e-10 * np.abs(want).max()


def test_bad_options_are_one_line(capsys):
    assert main(["experiment", "language-model", "--d-model", "10", "--heads", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a multiple of --heads" in err[0]


def test_missing_curvlinops_is_refused_before_any_work(monkeypatch, capsys):
    import symhess.curvature.spectra as spectra
    from symhess.errors import DeclarationError

    def missing():
        raise DeclarationError("the spectral density needs curvlinops: pip install 'symhess[spectra]'")
    monkeypatch.setattr(spectra, "require_curvlinops", missing)
    monkeypatch.setattr(lm, "build_model", lambda args: pytest.fail("built a model"))
    assert main(["experiment", "language-model", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs curvlinops" in err[0]

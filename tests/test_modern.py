"""The modern block (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU): its
declaration against a torch forward written out with real rotary angles, and its options."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import symhess as sh
from symhess.errors import InputError, OptionError
from symhess.expr.evaluate import evaluate


def _rotary(L, dk):
    half = dk // 2
    ang = torch.arange(L, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(half) * 2 / dk)
    C, S = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    R = torch.zeros(dk, dk, dtype=torch.float64)
    R[torch.arange(half) + half, torch.arange(half)] = -1.0
    R[torch.arange(half), torch.arange(half) + half] = 1.0
    return C, S, R


def _reference(X, p, C, S, eps=1e-6):
    """Llama-style: rotate_half rotary, two query heads on one key/value head, SwiGLU."""
    def rms(u):
        return u * torch.rsqrt((u * u).mean(-1, keepdim=True) + eps)

    def rope(q):
        h = q.shape[-1] // 2
        return q * C + torch.cat([-q[:, h:], q[:, :h]], -1) * S
    N = rms(X)
    K, V = rope(N @ p["W_K"]), N @ p["W_V"]
    Y = X
    for h in (1, 2):
        T = rope(N @ p[f"W_Q{h}"]) @ K.T / math.sqrt(K.shape[1])
        Y = Y + torch.softmax(T, -1) @ V @ p[f"W_O{h}"]
    N2 = rms(Y)
    return Y + (torch.nn.functional.silu(N2 @ p["W_1"]) * (N2 @ p["W_3"])) @ p["W_2"]


def test_forward_matches_a_written_out_block_with_real_rotary_angles():
    lay = sh.layer("modern_block")
    L, d, dk, dh, dff = 6, 8, 4, 3, 10
    g = torch.Generator().manual_seed(0)
    shapes = {"W_Q1": (d, dk), "W_Q2": (d, dk), "W_K": (d, dk), "W_V": (d, dh), "W_O1": (dh, d),
              "W_O2": (dh, d), "W_1": (d, dff), "W_3": (d, dff), "W_2": (dff, d)}
    p = {n: torch.randn(*s, generator=g, dtype=torch.float64) / math.sqrt(s[0]) for n, s in shapes.items()}
    X = torch.randn(L, d, generator=g, dtype=torch.float64)
    C, S, R = _rotary(L, dk)
    got = evaluate(lay.output, {**{k: v.numpy() for k, v in p.items()}, "X": X.numpy(),
                                "C": C.numpy(), "S": S.numpy(), "R": R.numpy()})
    assert np.abs(np.asarray(got) - _reference(X, p, C, S).numpy()).max() <= 1e-12
    assert lay.param_names == ("W_Q1", "W_Q2", "W_K", "W_V", "W_O1", "W_O2", "W_1", "W_3", "W_2")


@pytest.mark.parametrize("opts, msg", [({"group": 0}, "group"), ({"group": True}, "group"),
                                       ({"causal": 1}, "causal"), ({"eps": -1.0}, "eps")])
def test_options_are_validated(opts, msg):
    with pytest.raises(OptionError, match=msg):
        sh.layer("modern_block", **opts)


def test_a_zero_row_with_eps_zero_names_the_row():
    lay = sh.layer("modern_block", eps=0)
    X = np.ones((3, 4))
    X[1] = 0.0
    with pytest.raises(InputError, match="row 1"):
        for c in lay.checks:
            c({"X": X})

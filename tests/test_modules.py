"""torch modules as declared layers: forward equal to the module's, block Hessians equal to
autograd through the module itself (float64)."""
import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import symhess as sh
from symhess.errors import DeclarationError

E, HEADS, DFF = 6, 2, 10


def module_hessian(m, ml, x, y):
    """Rows of ∂²/∂θ² of MSELoss(mean) through the module, θ = module.parameters() flattened.

    Classic double backward (torch.autograd.grad twice): torch.func's jacrev-over-jacrev
    through native layer_norm gives an asymmetric Hessian in torch 2.13."""
    names = [n for n, _ in m.named_parameters()]
    shapes = [p.shape for p in m.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    def f(th):
        ps, o = {}, 0
        for n, s in zip(names, shapes):
            k = int(np.prod(s))
            ps[n] = th[o:o + k].reshape(s)
            o += k
        with sdpa_kernel(SDPBackend.MATH):
            if isinstance(m, nn.MultiheadAttention):
                out = functional_call(m, ps, (x, x, x), dict(need_weights=False,
                                                             attn_mask=mask(x, ml)))[0]
            elif isinstance(m, nn.TransformerEncoderLayer) and ml.causal:
                out = functional_call(m, ps, (x,), dict(src_mask=mask(x, ml), is_causal=True))
            else:
                out = functional_call(m, ps, (x,), {})
        return ((out - y) ** 2).mean()

    return _Rows(f, theta)


class _Rows:
    """Rows of the Hessian of f at theta, each one backward through the gradient's graph."""

    def __init__(self, f, theta):
        self.theta = theta.clone().requires_grad_(True)
        self.g = torch.autograd.grad(f(self.theta), self.theta, create_graph=True)[0]
        self.rows = {}

    def row(self, i):
        if i not in self.rows:
            self.rows[i] = torch.autograd.grad(self.g[i], self.theta, retain_graph=True)[0].numpy()
        return self.rows[i]

    def block(self, rows, cols):
        return np.stack([self.row(int(i))[cols] for i in rows])

    def dense(self):
        return self.block(range(len(self.theta)), np.arange(len(self.theta)))


def mask(x, ml):
    n = x.shape[1] if ml.batch_first else x.shape[0]
    return torch.triu(torch.ones(n, n, dtype=torch.bool), 1) if ml.causal else None


def offsets(ml):
    vals, out, o = ml.params(), {}, 0
    for p in ml.layer.param_names:
        n = vals[p].numel()
        out[p] = ml.index[o:o + n]
        o += n
    return out


def check_blocks(m, ml, x, y, pairs):
    H = module_hessian(m, ml, x, y)
    layer, to_values = ml
    k = sh.kernel(layer, "torch", "mse")
    vals = to_values((x, y))
    off = offsets(ml)
    blocks = {(p, q): H.block(off[p], off[q]) for p, q in pairs}
    scale = max(np.linalg.norm(b) for b in blocks.values())
    for (p, q), want in blocks.items():
        got = sh.operator(k, vals, p, q).to_dense()
        assert np.linalg.norm(got - want) <= 1e-12 * scale, (p, q)
        if (q, p) in blocks:        # the module's Hessian is symmetric, so is ours
            assert np.linalg.norm(want - blocks[(q, p)].T) <= 1e-12 * scale
    return H


@pytest.mark.parametrize("batch_first,causal,bias", [
    pytest.param(True, False, True, marks=pytest.mark.slow), (False, True, False)])
def test_multihead_attention(batch_first, causal, bias):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, HEADS, bias=bias, batch_first=batch_first).double()
    ml = sh.from_module(m, causal=causal)
    shape = (3, 4, E) if batch_first else (4, 3, E)
    x, y = torch.randn(*shape, dtype=torch.float64), torch.randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        want = ml.module_forward(x)
    assert torch.abs(ml.forward(x) - want).max() <= 1e-12 * torch.abs(want).max()
    names = ml.layer.param_names
    assert names[:3] == ("W_Q", "W_K", "W_V") and ("b_O" in names) == bias
    pairs = [(p, p) for p in names] + [("W_Q", "W_K"), ("W_O", "W_V"), ("W_K", "W_O")]
    if bias:
        pairs += [("b_Q", "W_K"), ("b_O", "W_V")]
    H = check_blocks(m, ml, x, y, pairs).dense()
    # the whole declared Hessian in the module's parameter order is the module's Hessian
    k = sh.kernel(ml.layer, "torch", "mse")
    vals = ml.values((x, y))
    Hd = sh.operator(k, vals).to_dense()
    assert np.abs(ml.to_module_matrix(Hd) - H).max() <= 1e-12 * np.abs(H).max()
    g = sh.Dataset(k, vals).gradient()
    per = ml.to_parameters(g)
    assert set(per) == {n for n, _ in m.named_parameters()}
    assert per["in_proj_weight"].shape == (3 * E, E)


@pytest.mark.parametrize("norm_first", [pytest.param(True, marks=pytest.mark.slow), False])
def test_transformer_block(norm_first):
    """nn.TransformerEncoderLayer, pre-LN and post-LN: every parameter kind, both directions."""
    torch.manual_seed(1)
    m = nn.TransformerEncoderLayer(E, HEADS, DFF, dropout=0.0, batch_first=True,
                                   norm_first=norm_first).double()
    ml = sh.from_module(m, causal=norm_first)
    x, y = torch.randn(2, 4, E, dtype=torch.float64), torch.randn(2, 4, E, dtype=torch.float64)
    with torch.no_grad():
        want = ml.module_forward(x)
    assert torch.abs(ml.forward(x) - want).max() <= 1e-12 * torch.abs(want).max()
    pairs = [("W_Q", "W_Q"), ("W_V", "W_V"), ("gamma_1", "W_Q"), ("W_Q", "gamma_1"),
             ("gamma_1", "gamma_2"),
             ("gamma_2", "gamma_1"), ("beta_2", "b_1"), ("W_1", "W_2"), ("b_K", "W_1"),
             ("W_O", "beta_1")]
    check_blocks(m, ml, x, y, pairs)


class GPTBlock(nn.Module):
    """A plain GPT-style block written from nn.Linear, nn.LayerNorm and an MLP."""

    def __init__(self, d, heads, pre_ln, causal):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.pre_ln, self.causal = pre_ln, causal

    def sa(self, x):
        n = x.shape[1]
        m = torch.triu(torch.ones(n, n, dtype=torch.bool), 1) if self.causal else None
        return self.attn(x, x, x, need_weights=False, attn_mask=m)[0]

    def forward(self, x):
        if self.pre_ln:
            x = x + self.sa(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))
        x = self.ln_1(x + self.sa(x))
        return self.ln_2(x + self.mlp(x))


def test_gpt_style_block_and_refusals():
    torch.manual_seed(2)
    m = GPTBlock(E, HEADS, pre_ln=True, causal=True).double()
    ml = sh.from_module(m, causal=True)
    x, y = torch.randn(2, 3, E, dtype=torch.float64), torch.randn(2, 3, E, dtype=torch.float64)
    with torch.no_grad():
        want = m(x)
    assert torch.abs(ml.forward(x) - want).max() <= 1e-12 * torch.abs(want).max()
    check_blocks(m, ml, x, y, [("W_K", "W_K"), ("gamma_2", "W_1"), ("b_2", "gamma_1")])
    # the recognised structure is checked against the module's forward
    with pytest.raises(DeclarationError, match="differs from the module's forward"):
        sh.from_module(m, causal=False)
    with pytest.raises(DeclarationError, match="add_bias_kv"):
        sh.from_module(nn.MultiheadAttention(E, HEADS, add_bias_kv=True))
    with pytest.raises(DeclarationError, match="dropout 0.1 in training mode"):
        sh.from_module(nn.MultiheadAttention(E, HEADS, dropout=0.1))
    with pytest.raises(DeclarationError, match="not the causal mask"):
        sh.from_module(nn.MultiheadAttention(E, HEADS), attn_mask=torch.eye(4, dtype=torch.bool))
    with pytest.raises(DeclarationError, match="cannot declare a Linear"):
        sh.from_module(nn.Linear(3, 3))
    lay = nn.TransformerEncoderLayer(E, HEADS, DFF, dropout=0.0, activation=torch.tanh)
    with pytest.raises(DeclarationError, match="activation"):
        sh.from_module(lay)

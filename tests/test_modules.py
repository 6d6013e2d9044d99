"""torch modules captured as declarations: every Hessian block (outer, functional, full), the
Hessian–vector product, diagonals, traces and Frobenius norms against torch autograd on the
module's own forward (float64, ≤ 1e-10), per-parameter results under the module's names, and
the refusals.

The reference differentiates ``module(*args, **kwargs)`` itself (``functional_call`` over its
parameters, MSE of its output) by double backward; modules that compute steps in float32
inside a float64 run (Llama's RMSNorm, the eager softmax upcast) are differentiated under
``symhess.layers.modules.no_downcasts`` (their own forward with those casts made no-ops), which is
the mathematics the declaration states.  Sizes are tiny (L = 4, d = 8, 2 heads)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import symhess as sh
from symhess.errors import DeclarationError, InputError
from symhess.layers.modules import no_downcasts
from symhess.runtime.network import Compact
from flat_params import unflat

B, L, D, HEADS, DFF = 2, 4, 8, 2, 12
TOL = 1e-10

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")


def hidden(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, D, generator=g, dtype=torch.float64)


def causal_additive():
    m = torch.triu(torch.full((L, L), torch.finfo(torch.float64).min, dtype=torch.float64), 1)
    return m[None, None].expand(B, 1, L, L)


# ----------------------------------------------------------------------------- the reference
class Reference:
    """Autograd of the module's own forward: the dense Hessian of the MSE loss over the module's
    flat parameters (double backward) and its Gauss–Newton part Jᵀ (2/n) J."""

    def __init__(self, ml, x, y):
        m = ml.module
        self.names = [n for n, _ in m.named_parameters()]
        self.shapes = [p.shape for _, p in m.named_parameters()]
        theta = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).requires_grad_(True)
        args, kwargs = ml.call_args(x)
        self.y = y

        def out(th):
            ps = unflat(th, self.names, self.shapes)
            with no_downcasts(), sdpa_kernel(SDPBackend.MATH):
                r = functional_call(m, ps, args, kwargs)
            return r[0] if isinstance(r, tuple) else r

        F = out(theta)
        if not ml.batch_first:
            F = F.transpose(0, 1)
        yy = y if ml.batch_first else y
        loss = ((F - yy) ** 2).mean()
        g = torch.autograd.grad(loss, theta, create_graph=True)[0]
        self.H = torch.stack([torch.autograd.grad(g[i], theta, retain_graph=True)[0]
                              for i in range(len(theta))]).detach().numpy()
        J = torch.autograd.functional.jacobian(lambda th: (out(th).transpose(0, 1) if not ml.batch_first
                                                           else out(th)).reshape(-1), theta.detach())
        self.GGN = (2.0 / F.numel()) * (J.T @ J).numpy()
        self.n = len(theta)


def close(got, want, scale, floor=0.0):
    """‖got − want‖ ≤ 1e-10 · max(scale, floor): ``floor`` is the rounding level of the whole
    Hessian (1e-4 ‖H‖_F), the scale of quantities that are zero up to rounding (H(W_Q, b_K):
    a key bias shifts each softmax row by a constant)."""
    return np.linalg.norm(np.asarray(got) - np.asarray(want)) <= TOL * max(scale, floor, 1e-300)


def check(module, args, kwargs=None, blocks="all", seed=1):
    """The module's declaration against autograd: the blocks (``all`` or a list of pairs),
    hvp, every diagonal and trace, Frobenius norms, per-parameter results."""
    ml = sh.from_module(module, args, kwargs or {})
    x = args[0]
    with torch.no_grad():
        shape = tuple(ml.module_forward(x).shape)
    y = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    yd = y if ml.batch_first else y.transpose(0, 1)
    ref = Reference(ml, x, yd)
    covered = np.zeros(ref.n, bool)
    covered[ml.index] = True
    assert covered.all(), "every module parameter is declared"
    k = sh.kernel(ml.layer, "torch", "mse")
    st = k.prepare(ml.values((x, y)))
    off = ml.module_positions()
    names = ml.layer.param_names
    pairs = [(p, q) for p in names for q in names] if blocks == "all" else blocks
    refs = {"full": ref.H, "outer": ref.GGN, "functional": ref.H - ref.GGN}
    floor = 1e-4 * np.linalg.norm(ref.H)
    if blocks == "all":                  # every block at once (mapped back to module order)
        st.all_blocks()
        whole = {"outer": st.hessian("outer").numpy(), "functional": st.hessian("functional").numpy()}
        whole["full"] = whole["outer"] + whole["functional"]
        offs = np.cumsum([0] + [len(off[p]) for p in names])
        get = lambda p, q, part: whole[part][offs[names.index(p)]:offs[names.index(p) + 1],  # noqa: E731
                                             offs[names.index(q)]:offs[names.index(q) + 1]]
    else:
        get = lambda p, q, part: st.hessian_block(p, q, part).numpy()  # noqa: E731
    for p, q in pairs:
        want = {part: r[np.ix_(off[p], off[q])] for part, r in refs.items()}
        scale = np.linalg.norm(want["full"])
        for part in ("outer", "functional", "full"):
            assert close(get(p, q, part), want[part], max(scale, np.linalg.norm(want[part])), floor), \
                (p, q, part)
    v = torch.randn(len(ml.index), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    vm = np.zeros(ref.n)
    vm[ml.index] = v.numpy()
    for part, r in refs.items():
        want = (r @ vm)[ml.index]
        assert close(st.hvp(v, part).numpy(), want, np.linalg.norm(want), floor), part
    diag = {}
    checked = names if blocks == "all" else list(dict.fromkeys(x for pq in pairs for x in pq))
    for p in checked:
        want = np.diag(ref.H)[off[p]]
        diag[p] = st.diag(p)
        assert close(diag[p].numpy(), want, np.linalg.norm(want), floor), p
        assert close(float(st.trace(p)), want.sum(), abs(want).sum(), floor), p
    for p, q in [(checked[0], checked[0]), (checked[0], checked[-1]),
                 (checked[-1], checked[len(checked) > 1])]:
        for part, r in refs.items():
            want = np.linalg.norm(r[np.ix_(off[p], off[q])])
            assert close(st.frobenius_norm(p, q, part), want, want, floor), (p, q, part)
    per = ml.to_parameters(diag)           # entries of parameters not checked are 0
    full = np.zeros(ref.n)
    for p in checked:
        full[off[p]] = np.diag(ref.H)[off[p]]
    o = 0
    for n, s in zip(ref.names, ref.shapes):
        k_ = int(np.prod(s))
        assert tuple(per[n].shape) == tuple(s)
        assert close(per[n].numpy().reshape(-1), full[o:o + k_], np.linalg.norm(full), floor), n
        o += k_
    return ml


# ----------------------------------------------------------------------------- torch modules
@pytest.mark.parametrize("batch_first,causal,bias", [(True, False, True), (False, True, False)])
def test_multihead_attention(batch_first, causal, bias):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(D, HEADS, bias=bias, batch_first=batch_first).double().eval()
    x = hidden() if batch_first else hidden().transpose(0, 1)
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1) if causal else None
    ml = check(m, (x, x, x), {"need_weights": False, "attn_mask": mask})
    names = ml.layer.param_names
    # each head reads column pieces d × d_h of W_Q, W_K, W_V (never a d × d projector)
    assert names[:2 * HEADS + 2] == tuple(f"in_proj_weight_{i}" for i in range(1, 2 * HEADS + 3))
    assert all(ml.layer.param(n).shape == (sh.expr.dim("d"), sh.expr.dim("d_h"))
               for n in names if n.startswith("in_proj_weight"))
    assert ml.causal == causal and not ml.layer.inputs[1:]


def test_multihead_attention_default_call():
    """Without example inputs nn.MultiheadAttention is captured on a random input; the
    causal declaration holds at every length (no constant is bound to L)."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(D, HEADS, batch_first=True).double().eval()
    ml = sh.from_module(m, causal=True)
    x = hidden(3)
    with torch.no_grad():
        want = ml.module_forward(x, m)
    assert torch.allclose(ml.forward(x), want, rtol=0, atol=1e-12)
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    with torch.no_grad():
        assert torch.allclose(want, m(x, x, x, need_weights=False, attn_mask=mask)[0], atol=1e-14)


@pytest.mark.parametrize("norm_first,activation,causal", [(True, "gelu", True), (False, "relu", False)])
def test_transformer_encoder_layer(norm_first, activation, causal):
    """Both norm orders, every block; one head (the head split of its nn.MultiheadAttention
    is test_multihead_attention's)."""
    torch.manual_seed(1)
    m = nn.TransformerEncoderLayer(D, 1, DFF, dropout=0.0, activation=activation,
                                   batch_first=True, norm_first=norm_first).double().eval()
    kw = {"src_mask": nn.Transformer.generate_square_subsequent_mask(L).double(),
          "is_causal": True} if causal else {}
    ml = check(m, (hidden(),), kw)
    assert ml.causal == causal and len(ml.layer.params) == 16


# ----------------------------------------------------------------------------- transformers
def gpt2_config(heads=HEADS, impl="eager"):
    cfg = transformers.GPT2Config(n_embd=D, n_head=heads, n_inner=DFF, n_layer=1, n_positions=16,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    cfg._attn_implementation = impl
    return cfg


def bert_config(heads=HEADS, impl="eager"):
    cfg = transformers.BertConfig(hidden_size=D, num_attention_heads=heads, intermediate_size=DFF,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = impl
    return cfg


def llama(impl="eager", heads=4, kv=2):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = transformers.LlamaConfig(hidden_size=D, num_attention_heads=heads, num_key_value_heads=kv,
                                   intermediate_size=DFF, max_position_embeddings=16)
    cfg._attn_implementation = impl
    x = hidden()
    cos, sin = LlamaRotaryEmbedding(cfg).double()(x, torch.arange(L)[None].expand(B, L))
    return cfg, x, (cos, sin)


@pytest.mark.parametrize("impl,heads", [("eager", 1), ("sdpa", 2)])
def test_gpt2_block(impl, heads):
    """Every block with one head; with two (heads split from the fused c_attn), a selection."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    torch.manual_seed(2)
    m = GPT2Block(gpt2_config(heads, impl)).double().eval()
    blocks = "all" if heads == 1 else [("attn_c_attn_weight_1", "attn_c_attn_weight_3"),
                                       ("attn_c_attn_weight_2", "attn_c_proj_weight_2"),
                                       ("mlp_c_fc_bias", "ln_1_weight")]
    ml = check(m, (hidden(),), {"attention_mask": causal_additive()}, blocks=blocks)
    assert ml.causal and len(ml.layer.params) == 4 + 6 * heads + heads + 1 + 4


def test_bert_layer_with_a_padding_mask():
    """BertLayer with a padding mask (additive finfo.min): a per-sequence constant."""
    from transformers.models.bert.modeling_bert import BertLayer
    torch.manual_seed(3)
    m = BertLayer(bert_config(heads=1)).double().eval()
    pad = torch.ones(B, L)
    pad[1, -1] = 0
    ext = (1.0 - pad[:, None, None, :].double()) * torch.finfo(torch.float64).min
    ml = check(m, (hidden(),), {"attention_mask": ext})
    assert [v.name for v in ml.layer.inputs[1:]] == ["M_1"]       # one mask, per sequence
    with pytest.raises(InputError, match="differ between the 2 sequences"):
        ml.batch(torch.randn(3, L, D, dtype=torch.float64))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_llama_decoder_layer(impl):
    """Grouped-query attention (2 query heads, 1 key-value head), rotary embeddings passed as
    position_embeddings, RMSNorm, SwiGLU; float32 steps of transformers neutralised."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    torch.manual_seed(4)
    cfg, x, pe = llama(impl, heads=2, kv=1)
    m = LlamaDecoderLayer(cfg, 0).double().eval()
    blocks = "all" if impl == "eager" else [("self_attn_q_proj_weight_1", "self_attn_k_proj_weight"),
                                             ("input_layernorm_weight", "mlp_gate_proj_weight")]
    ml = check(m, (x,), {"position_embeddings": pe, "attention_mask": causal_additive()}, blocks=blocks)
    assert any("to float32" in c and "input_layernorm" in c for c in ml.casts)
    assert ml.forward_error <= 1e-12 < ml.cast_error <= 1e-4
    names = ml.layer.param_names
    assert "self_attn_k_proj_weight" in names                       # one key head for two queries


# ----------------------------------------------------------------------------- sub-modules
def test_gpt2_submodules():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2MLP
    torch.manual_seed(5)
    cfg = gpt2_config()
    x = hidden()
    check(GPT2Attention(cfg).double().eval(), (x,), {"attention_mask": causal_additive()})
    check(GPT2MLP(DFF, cfg).double().eval(), (x,))
    check(nn.LayerNorm(D).double(), (x,))


def test_bert_submodules():
    from transformers.models.bert.modeling_bert import BertAttention, BertIntermediate, BertOutput
    torch.manual_seed(6)
    cfg = bert_config()
    x = hidden()
    check(BertAttention(cfg).double().eval(), (x,))
    check(BertIntermediate(cfg).double().eval(), (x,))
    h = torch.randn(B, L, DFF, dtype=torch.float64)
    ml = check(BertOutput(cfg).double().eval(), (h, x))          # the residual input is a constant
    assert ml.layer.inputs[1].name == "C_1"


def test_llama_submodules():
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm
    torch.manual_seed(7)
    cfg, x, pe = llama()
    check(LlamaAttention(cfg, 0).double().eval(), (x,),
          {"position_embeddings": pe, "attention_mask": causal_additive()})
    check(LlamaMLP(cfg).double().eval(), (x,))
    check(LlamaRMSNorm(D).double(), (x,))


def test_a_family_not_in_the_required_list():
    """Qwen2 (biased q/k/v, grouped-query attention, rotary), Qwen3 (RMSNorms of each head's
    query and key) and GPT-NeoX (partial rotary, parallel residual) go in without anything
    specific to them."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer, GPTNeoXRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding
    torch.manual_seed(8)
    x = hidden()
    pos = torch.arange(L)[None].expand(B, L)
    cfg = transformers.Qwen2Config(hidden_size=D, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=DFF)
    cfg._attn_implementation = "eager"
    pe = Qwen2RotaryEmbedding(cfg).double()(x, pos)
    names = ["self_attn_q_proj_bias_2", "self_attn_k_proj_weight", "mlp_down_proj_weight"]
    check(Qwen2DecoderLayer(cfg, 0).double().eval(), (x,),
          {"position_embeddings": pe, "attention_mask": causal_additive()},
          blocks=[(p, q) for p in names for q in names])
    cfg = transformers.Qwen3Config(hidden_size=D, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=D // 2, intermediate_size=DFF)
    cfg._attn_implementation = "eager"
    pe = Qwen3RotaryEmbedding(cfg).double()(x, pos)
    q, k = "self_attn_q_norm_weight", "self_attn_k_norm_weight"      # one γ for every head
    check(Qwen3DecoderLayer(cfg, 0).double().eval(), (x,),
          {"position_embeddings": pe, "attention_mask": causal_additive()},
          blocks=[(q, k), (q, "self_attn_q_proj_weight_1"), (k, k)])
    cfg = transformers.GPTNeoXConfig(hidden_size=D, num_attention_heads=2, intermediate_size=DFF,
                                     rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)
    cfg._attn_implementation = "eager"
    pe = GPTNeoXRotaryEmbedding(cfg).double()(x, pos)
    check(GPTNeoXLayer(cfg, 0).double().eval(), (x,),
          {"position_embeddings": pe, "attention_mask": causal_additive()},
          blocks=[("attention_query_key_value_weight_1", "attention_query_key_value_weight_3")])


# ----------------------------------------------------------------------------- refusals
def test_dropout_in_training_mode_is_refused():
    m = nn.MultiheadAttention(D, HEADS, dropout=0.1, batch_first=True).double()
    x = hidden()
    with pytest.raises(DeclarationError, match=r"dropout 0\.1 in training mode is random; call "
                                               r"module\.eval\(\).*activation\.py:\d+"):
        sh.from_module(m, (x, x, x), {"need_weights": False})


class Cumulative(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return torch.cumsum(self.proj(x), 1)


def test_an_unsupported_op_names_itself_the_module_and_the_line():
    with pytest.raises(DeclarationError, match=r"aten\.cumsum\.default cannot be declared .*"
                                               r"in the module, test_modules\.py:\d+: return torch\.cumsum"):
        sh.from_module(Cumulative().double(), (hidden(),))


class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return self.proj(x)[:, 1:]


def test_a_refusal_inside_a_rule_names_the_op_the_module_and_the_line():
    with pytest.raises(DeclarationError, match=r"^aten\.slice\.Tensor: a slice of the pos 4 axis .*"
                                               r"in the module, test_modules\.py:\d+: return self\.proj"):
        sh.from_module(Positions().double(), (hidden(),))


class Overlapping(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x):
        half = x @ self.w[:, : D // 2]
        return x @ self.w + torch.cat([half, half], -1)


class FullyMasked(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, D)

    def forward(self, x, mask):
        return torch.softmax(self.q(x) @ x.transpose(1, 2) + mask, -1) @ x


def test_other_refusals():
    with pytest.raises(DeclarationError, match="needs example_inputs"):
        sh.from_module(nn.Linear(D, D))
    with pytest.raises(DeclarationError, match="in_proj|overlapping pieces"):
        sh.from_module(Overlapping().double(), (hidden(),))
    mask = torch.zeros(B, L, L, dtype=torch.float64)
    mask[0, 1, :] = -torch.inf
    with pytest.raises(DeclarationError, match="row 1 of an attention mask masks every key"):
        sh.from_module(FullyMasked().double(), (hidden(), mask))
    with pytest.raises(DeclarationError, match="takes a torch.nn.Module"):
        sh.from_module("gpt2")


def test_constants_bind_the_length():
    """A declaration whose constants (rotary tables) hold the example's length refuses data of
    another length with one line."""
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaAttention  # noqa: F401
    cfg, x, pe = llama()
    ml = sh.from_module(LlamaAttention(cfg, 0).double().eval(), (x,),
                        {"position_embeddings": pe, "attention_mask": causal_additive()})
    with pytest.raises(InputError, match="captured with 4"):
        ml.batch(torch.randn(B, L + 1, D, dtype=torch.float64))


# ----------------------------------------------------------------------------- command line
FACTORIES = '''
import torch
from torch import nn

def block():
    torch.manual_seed(0)
    m = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True, norm_first=True)
    return m.double().eval(), (torch.randn(2, 4, 8, dtype=torch.float64),)

mha = nn.MultiheadAttention(8, 1, bias=False, batch_first=True).double()

def training():
    return nn.MultiheadAttention(8, 2, dropout=0.5), (torch.randn(2, 4, 8),) * 3
'''


def test_command_line_takes_module_factories(tmp_path, capsys):
    from symhess.cli.main import main
    (tmp_path / "mods.py").write_text(FACTORIES)
    spec = str(tmp_path / "mods.py")
    code = main(["derive", f"{spec}:block", "--block", "norm1_weight,linear2_bias", "--part", "outer",
                 "--format", "text"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("H_outer(norm1_weight, linear2_bias) = ")
    code = main(["verify", f"{spec}:mha"])
    out = capsys.readouterr().out
    assert code == 0 and "all blocks agree with autograd" in out and "in_proj_weight_3" in out
    code = main(["report", f"{spec}:mha", "--loss", "mse", "-o", str(tmp_path / "mha.tex")])
    tex = (tmp_path / "mha.tex").read_text()
    assert code == 0 and r"\begin{document}" in tex and "in_proj_weight" in tex.replace(r"\_", "_")
    code = main(["spectrum", f"{spec}:mha", "--block", "out_proj_weight,out_proj_weight", "--part",
                 "full", "--k", "2", "--batches", "1", "--batch", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "(out_proj_weight, out_proj_weight)" in out
    code = main(["derive", f"{spec}:training"])
    err = capsys.readouterr().err
    assert code == 2 and "dropout 0.5 in training mode is random; call module.eval()" in err
    assert len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- the op table
class Zoo(nn.Module):
    """Many table entries in one forward: chunk, var, div, sqrt, baddbmm with a (B, L, L)
    additive mask, where (a boolean mask to −∞), masked_fill with a finite value, stack and a
    sum over the stacked axis, cat, repeat_interleave of heads, rsub, reciprocal, square, sin,
    cos, erf, pow of a number, log_softmax."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2 * D)
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, D // 2, bias=False)
        self.gamma = nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, x, bias, keep, fill):
        a, b = self.lin(x).chunk(2, -1)
        gate = (1 - torch.sigmoid(a)) * torch.sin(b) + torch.cos(a) * torch.erf(b).square()
        var = x.var(-1, keepdim=True, unbiased=False)
        n = (x - x.mean(-1, keepdim=True)) / torch.sqrt(var + 1e-5) * self.gamma
        q = self.q(n).view(B, L, 2, D // 2).transpose(1, 2)              # 2 query heads
        k = self.k(n).view(B, L, 1, D // 2).transpose(1, 2)              # 1 key head
        k = k.repeat_interleave(2, dim=1)
        s = torch.baddbmm(bias, q.reshape(B * 2, L, D // 2), k.reshape(B * 2, L, D // 2).transpose(1, 2))
        s = torch.where(keep, s.view(B, 2, L, L), torch.tensor(-torch.inf, dtype=s.dtype))
        att = torch.softmax(s, -1) @ q
        mixed = torch.stack([att[:, 0], att[:, 1]], 1).sum(1)
        mixed = torch.cat([mixed, 2 * mixed[..., :2], -mixed[..., 2:]], -1)
        out = mixed.masked_fill(fill, 0.25) + torch.reciprocal(2.0 + gate ** 2) + 2.0 ** (0.1 * gate)
        return torch.log_softmax(out, -1)


def test_a_module_of_many_ops():
    torch.manual_seed(9)
    x = hidden()
    bias = torch.randn(B * 2, L, L, dtype=torch.float64)
    keep = torch.tril(torch.ones(L, L, dtype=torch.bool)) | (torch.rand(B, 1, L, L) > 0.5)
    fill = torch.zeros(B, L, D, dtype=torch.bool)
    fill[0, 1, 2] = True
    ml = check(Zoo().double(), (x, bias, keep, fill))
    assert {v.name[0] for v in ml.layer.inputs[1:]} >= {"M", "C"}


def test_the_docs_list_every_op():
    """docs/modules.md names every entry of the op table."""
    from pathlib import Path

    from symhess.layers.capture.aten import OPS
    text = (Path(__file__).resolve().parent.parent / "docs" / "modules.md").read_text()
    table = text[text.index("| ATen op | declares |"):text.index("## Module-level constructs")]
    missing = [n for n in OPS if n != "<built-in function getitem>" and
               f"`{n.split('.')[1]}" not in table and f"`{n.removeprefix('aten.')}`" not in table]
    assert not missing


def test_parts_hold_one_array_for_what_they_both_define():
    """A variant rendered in parts (here 16 declared pieces) names each part's own leaves and
    compacts by their content: the blocks of two pieces downstream of the same LayerNorm and
    MLP hold one Compact, formed once, and every diagonal of one pass still equals autograd's."""
    torch.manual_seed(3)
    m = nn.TransformerEncoderLayer(D, 1, DFF, dropout=0.0, activation="gelu", batch_first=True,
                                   norm_first=True).double().eval()
    x = hidden()
    ml = sh.from_module(m, (x,))
    y = torch.randn(tuple(ml.module_forward(x).shape), generator=torch.Generator().manual_seed(4),
                    dtype=torch.float64)
    st = sh.kernel(ml.layer, "torch", "mse").prepare(ml.values((x, y)))
    names = ml.layer.param_names

    def compacts(p):
        return {id(op): op for n in st.nets(p, p) for op in n.ops if isinstance(op, Compact)}

    bias, weight = (next(p for p in names if p.startswith(f"self_attn_out_proj_{w}")) for w in ("bias", "weight"))
    shared = compacts(bias).keys() & compacts(weight).keys()
    assert shared and all(compacts(bias)[k].shape[-1] == D for k in shared)
    ref = Reference(ml, x, y)
    off = ml.module_positions()
    got = st.diagonals()
    for p in names:
        want = np.diag(ref.H)[off[p]]
        assert close(got[p].numpy(), want, np.linalg.norm(want), 1e-4 * np.linalg.norm(ref.H)), p

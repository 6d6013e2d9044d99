"""torch modules as declared layers: ``symhess.from_module(module)``.

Recognised modules and the declarations they map to (X ∈ R^{L×d}, c = 1/√d_h, d_h = d/H,
1 the all-ones column, D_h = diag(1 on head h's columns) the head projector, a constant):

* ``nn.MultiheadAttention`` (self-attention, ``query = key = value = x``):

      Q = X W_Q + 1 b_Q,  K = X W_K + 1 b_K,  V = X W_V + 1 b_V
      F = Σ_h softmax_rows(c Q D_h Kᵀ [causal]) V D_h W_O + 1 b_O

  with W_Q, W_K, W_V the row blocks of ``in_proj_weight`` transposed (or ``q_proj_weight`` …
  transposed), b_Q, b_K, b_V the pieces of ``in_proj_bias``, W_O = ``out_proj.weight``ᵀ,
  b_O = ``out_proj.bias`` (biases only when the module has them).  One head needs no D_h.
* a Transformer block: ``nn.TransformerEncoderLayer`` (``norm_first`` picks pre-LN) or a
  plain GPT-style block with attributes ``ln_1``, ``attn`` (an ``nn.MultiheadAttention``),
  ``ln_2`` (``nn.LayerNorm``), ``mlp`` (``nn.Sequential(Linear, ReLU | GELU, Linear)``, dropout
  layers allowed) and a bool ``pre_ln`` (or ``norm_first``):

      pre-LN:   Y = X + SA(LN_1(X)),   Z = Y + MLP(LN_2(Y))
      post-LN:  Y = LN_1(X + SA(X)),   Z = LN_2(Y + MLP(Y))
      MLP(U) = σ(U W_1 + 1 b_1) W_2 + 1 b_2,   LN(U) = (U − mean) ∘ (var + ε)^{−1/2} ∘ 1γ + 1β

  (γ, β of each LayerNorm are parameters; σ is ReLU, GELU or tanh-GELU as the module says).

Conventions: an ``nn.Linear`` computes x Aᵀ + b, so the declared W = Aᵀ (d_in × d_out, the
layer multiplies from the right, F = X W); biases are 1 × n rows; every declared parameter is
a 2-D matrix in vec_r (row-major) order.  ``ModuleLayer.index`` maps each declared entry to the
module's flat parameter vector (``module.parameters()`` order, C order inside a Parameter),
so results go back per ``nn.Parameter`` (``to_parameters``) and Hessians to the module's
order (``to_module_matrix``).

A user's block is recognised by its attributes; ``from_module`` then checks that the
declaration's forward equals the module's forward on random input (float64, ≤ 1e-10 relative)
and refuses it otherwise.  What the engine cannot declare yet (dropout in training mode,
attention masks other than causal, key-padding masks, bias_k/bias_v, zero attention, cross
attention with kdim/vdim ≠ d, LayerNorm without γ but with β, other activations) is a
``DeclarationError`` naming it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import sympy as sp

from ..expr import nodes as E
from ..errors import DeclarationError, InputError
from ..expr.layer import Layer
from .transformer import layer_norm

CHECK_TOLERANCE = 1e-10


# ----------------------------------------------------------------------------- declarations
def _rows(L, b):
    return E.ones(L, 1) @ b


def _attention(U, L, d, heads, dh, bias, causal, params, consts):
    """Multi-head self-attention of U (L × d) as in the module docstring (d_h = ``dh``)."""
    W_Q, W_K, W_V, W_O = (E.param(n, d, d) for n in ("W_Q", "W_K", "W_V", "W_O"))
    params += [W_Q, W_K, W_V]
    q, k, v = U @ W_Q, U @ W_K, U @ W_V
    if bias:
        b_Q, b_K, b_V = (E.param(n, 1, d) for n in ("b_Q", "b_K", "b_V"))
        params += [b_Q, b_K, b_V]
        q, k, v = q + _rows(L, b_Q), k + _rows(L, b_K), v + _rows(L, b_V)
    params.append(W_O)
    c = 1 / sp.sqrt(sp.Integer(dh))
    terms, inter = [], {}
    for h in range(1, heads + 1):
        if heads == 1:
            T = c * (q @ k.T)
            A = E.softmax_rows(T, causal=causal)
            terms.append(A @ v @ W_O)
        else:
            D = E.const(f"D_{h}", d, d, rf"\mathbf D_{{{h}}}")
            consts.append(D)
            T = c * (q @ D @ k.T)
            A = E.softmax_rows(T, causal=causal)
            terms.append(A @ v @ D @ W_O)
        inter[f"T{h}" if heads > 1 else "T"] = T
        inter[f"A{h}" if heads > 1 else "A"] = A
    F = E.add(*terms)
    if bias:
        b_O = E.param("b_O", 1, d)
        params.append(b_O)
        F = F + _rows(L, b_O)
    return F, inter


@dataclass
class _Spec:
    """What a recognised module is: sizes, options, and where each declared parameter lives."""

    kind: str
    d: int
    heads: int
    bias: bool
    causal: bool
    batch_first: bool
    attn_prefix: str = ""
    mlp: dict = field(default_factory=dict)        # block only
    norms: tuple = ()                              # block only: (ln_1 prefix, ln_2 prefix)
    pre_ln: bool = False
    eps: tuple = ()
    affine: tuple = ()                             # per LN: (has γ, has β)
    activation: str = "relu"


def _declare(spec: _Spec):
    """(Layer, [const names]) for a recognised module."""
    L, d_s, f_s = E.dims("L d d_ff")
    d = spec.d
    X = E.matrix("X", L, d_s)
    params, consts = [], []
    if spec.kind == "multihead_attention":
        F, inter = _attention(X, L, d_s, spec.heads, d // spec.heads, spec.bias, spec.causal, params, consts)
        _fix_dims(d, spec.heads)
        lay = Layer("module_mha", F, params, (X, *consts), inter,
                    {"heads": spec.heads, "bias": spec.bias, "causal": spec.causal},
                    "nn.MultiheadAttention (self-attention)")
        return lay
    checks = []

    def norm(U, i, label):
        g = b = None
        has_g, has_b = spec.affine[i]
        if has_g:
            g = E.param(f"gamma_{i + 1}", 1, d_s)
            params.append(g)
        if has_b:
            b = E.param(f"beta_{i + 1}", 1, d_s)
            params.append(b)
        out, check = layer_norm(U, spec.eps[i], g, b, label=label)
        if check is not None:
            checks.append(check)
        return out

    def mlp(U):
        W1 = E.param("W_1", d_s, f_s)
        params.append(W1)
        H = U @ W1
        if spec.mlp["bias1"]:
            b1 = E.param("b_1", 1, f_s)
            params.append(b1)
            H = H + _rows(L, b1)
        W2 = E.param("W_2", f_s, d_s)
        params.append(W2)
        out = E.elementwise(spec.activation, H) @ W2
        if spec.mlp["bias2"]:
            b2 = E.param("b_2", 1, d_s)
            params.append(b2)
            out = out + _rows(L, b2)
        return out, H

    if spec.pre_ln:
        N1 = norm(X, 0, "N_1")
        att, inter = _attention(N1, L, d_s, spec.heads, d // spec.heads, spec.bias, spec.causal, params, consts)
        Y = E.named(X + att, "R", r"\mathbf R")
        N2 = norm(Y, 1, "N_2")
        out, H = mlp(N2)
        Z = Y + out
    else:
        att, inter = _attention(X, L, d_s, spec.heads, d // spec.heads, spec.bias, spec.causal, params, consts)
        Y = norm(X + att, 0, "N_1")
        out, H = mlp(Y)
        Z = norm(Y + out, 1, "N_2")
    inter = dict(inter, H=H)
    return Layer("module_block", Z, params, (X, *consts), inter,
                 {"heads": spec.heads, "pre_ln": spec.pre_ln, "causal": spec.causal},
                 "Transformer block from a torch module", tuple(checks))


def _fix_dims(d, heads):
    if d % heads:
        raise DeclarationError(f"embed_dim {d} is not divisible by num_heads {heads}")


# ----------------------------------------------------------------------------- recognition
def _nn():
    import torch.nn as nn
    return nn


def _check_mha(m, prefix):
    nn = _nn()
    if not isinstance(m, nn.MultiheadAttention):
        raise DeclarationError(f"{prefix or 'the module'} is a {type(m).__name__}, not an "
                               f"nn.MultiheadAttention")
    what = prefix.rstrip(".") or "the attention"
    if m.bias_k is not None or m.bias_v is not None:
        raise DeclarationError(f"{what}: add_bias_kv (bias_k, bias_v) cannot be declared yet")
    if m.add_zero_attn:
        raise DeclarationError(f"{what}: add_zero_attn cannot be declared yet")
    if m.kdim != m.embed_dim or m.vdim != m.embed_dim:
        raise DeclarationError(f"{what}: kdim/vdim ({m.kdim}, {m.vdim}) differ from embed_dim "
                               f"{m.embed_dim}; only self-attention can be declared")
    if m.dropout and m.training:
        raise DeclarationError(f"{what}: dropout {m.dropout} in training mode is random; call "
                               f"module.eval() or set dropout=0")
    _fix_dims(m.embed_dim, m.num_heads)
    return m.in_proj_bias is not None


def _activation(act, what):
    nn = _nn()
    import torch.nn.functional as Fn
    if isinstance(act, str):
        name = act
    elif act is Fn.relu or isinstance(act, nn.ReLU):
        name = "relu"
    elif act is Fn.gelu:
        name = "gelu"
    elif isinstance(act, nn.GELU):
        name = "gelu_tanh" if act.approximate == "tanh" else "gelu"
    else:
        raise DeclarationError(f"{what}: activation {act!r} cannot be declared yet; valid: "
                               f"ReLU, GELU (exact or tanh)")
    if name not in ("relu", "gelu", "gelu_tanh"):
        raise DeclarationError(f"{what}: activation {name!r} cannot be declared yet; valid: relu, gelu")
    return name


def _norm_info(ln, what):
    nn = _nn()
    if not isinstance(ln, nn.LayerNorm):
        raise DeclarationError(f"{what} is a {type(ln).__name__}, not an nn.LayerNorm")
    if len(ln.normalized_shape) != 1:
        raise DeclarationError(f"{what}: LayerNorm over {tuple(ln.normalized_shape)}; only the "
                               f"last axis can be declared")
    g, b = ln.weight is not None, getattr(ln, "bias", None) is not None
    if b and not g:
        raise DeclarationError(f"{what}: a LayerNorm with β but without γ cannot be declared yet")
    return float(ln.eps), (g, b)


def _dropout_ok(m, p, what):
    if p and m.training:
        raise DeclarationError(f"{what}: dropout {p} in training mode is random; call "
                               f"module.eval() or set it to 0")


def _causal_from(attn_mask, is_causal, causal):
    if attn_mask is None:
        return bool(causal or is_causal)
    import torch
    m = torch.as_tensor(attn_mask)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise DeclarationError(f"attn_mask of shape {tuple(m.shape)}: only the causal (L × L) "
                               f"mask can be declared")
    n = m.shape[0]
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool, device=m.device), 1)
    masked = m if m.dtype == torch.bool else torch.isneginf(m)
    if m.dtype != torch.bool and bool(((m != 0) & ~torch.isneginf(m)).any()):
        raise DeclarationError("attn_mask has finite non-zero entries (an additive bias); only "
                               "the causal mask can be declared")
    if not bool((masked == upper).all()):
        raise DeclarationError("attn_mask is not the causal mask (entries j > i masked); other "
                               "masks cannot be declared yet")
    return True


def _recognise(module, causal):
    nn = _nn()
    if isinstance(module, nn.MultiheadAttention):
        bias = _check_mha(module, "")
        return _Spec("multihead_attention", module.embed_dim, module.num_heads, bias, causal,
                     module.batch_first)
    if isinstance(module, nn.TransformerEncoderLayer):
        what = "nn.TransformerEncoderLayer"
        bias = _check_mha(module.self_attn, "self_attn.")
        for name in ("dropout", "dropout1", "dropout2"):
            _dropout_ok(module, getattr(module, name).p, f"{what}.{name}")
        e1, a1 = _norm_info(module.norm1, f"{what}.norm1")
        e2, a2 = _norm_info(module.norm2, f"{what}.norm2")
        act = _activation(module.activation, f"{what}.activation")
        return _Spec("block", module.self_attn.embed_dim, module.self_attn.num_heads, bias,
                     causal, module.self_attn.batch_first, "self_attn.",
                     {"lin1": "linear1.", "lin2": "linear2.",
                      "bias1": module.linear1.bias is not None, "bias2": module.linear2.bias is not None},
                     ("norm1.", "norm2."), bool(module.norm_first), (e1, e2), (a1, a2), act)
    names = ("ln_1", "attn", "ln_2", "mlp")
    if all(hasattr(module, n) for n in names):
        what = type(module).__name__
        pre = getattr(module, "pre_ln", getattr(module, "norm_first", None))
        if not isinstance(pre, bool):
            raise DeclarationError(f"{what}: a GPT-style block needs a bool attribute pre_ln "
                                   f"(or norm_first) saying whether LayerNorm comes first")
        bias = _check_mha(module.attn, "attn.")
        e1, a1 = _norm_info(module.ln_1, f"{what}.ln_1")
        e2, a2 = _norm_info(module.ln_2, f"{what}.ln_2")
        layers = [(i, m) for i, m in enumerate(module.mlp)] if isinstance(module.mlp, nn.Sequential) else []
        core = [(i, m) for i, m in layers if not isinstance(m, nn.Dropout)]
        for i, m in layers:
            if isinstance(m, nn.Dropout):
                _dropout_ok(module, m.p, f"{what}.mlp.{i}")
        if len(core) != 3 or not isinstance(core[0][1], nn.Linear) or not isinstance(core[2][1], nn.Linear):
            raise DeclarationError(f"{what}.mlp must be nn.Sequential(Linear, ReLU | GELU, Linear) "
                                   f"(dropout allowed), got {module.mlp!r:.120}")
        act = _activation(core[1][1], f"{what}.mlp.{core[1][0]}")
        (i1, l1), (i2, l2) = core[0], core[2]
        return _Spec("block", module.attn.embed_dim, module.attn.num_heads, bias, causal,
                     module.attn.batch_first, "attn.",
                     {"lin1": f"mlp.{i1}.", "lin2": f"mlp.{i2}.", "bias1": l1.bias is not None,
                      "bias2": l2.bias is not None},
                     ("ln_1.", "ln_2."), pre, (e1, e2), (a1, a2), act)
    raise DeclarationError(
        f"cannot declare a {type(module).__name__}: from_module takes nn.MultiheadAttention, "
        f"nn.TransformerEncoderLayer, or a GPT-style block with attributes ln_1, attn, ln_2, "
        f"mlp and pre_ln")


# ----------------------------------------------------------------------------- extraction
def _extractors(spec: _Spec, module):
    """[(declared name, fn(get) → 2-D tensor)], get(module parameter name) → tensor."""
    d = spec.d
    a = spec.attn_prefix
    mha = module.get_submodule(a.rstrip(".")) if a else module
    out = []
    if mha._qkv_same_embed_dim:
        w = lambda i: (lambda g: g(f"{a}in_proj_weight")[i * d:(i + 1) * d].T)  # noqa: E731
    else:
        w = lambda i: (lambda g: g(f"{a}{'qkv'[i]}_proj_weight").T)            # noqa: E731
    out += [("W_Q", w(0)), ("W_K", w(1)), ("W_V", w(2))]
    if spec.bias:
        bb = lambda i: (lambda g: g(f"{a}in_proj_bias")[i * d:(i + 1) * d][None])  # noqa: E731
        out += [("b_Q", bb(0)), ("b_K", bb(1)), ("b_V", bb(2))]
    out.append(("W_O", lambda g: g(f"{a}out_proj.weight").T))
    if spec.bias:
        out.append(("b_O", lambda g: g(f"{a}out_proj.bias")[None]))
    if spec.kind == "block":
        mlp = spec.mlp
        for i, prefix in enumerate(spec.norms):
            has_g, has_b = spec.affine[i]
            if has_g:
                out.append((f"gamma_{i + 1}", (lambda p: lambda g: g(f"{p}weight")[None])(prefix)))
            if has_b:
                out.append((f"beta_{i + 1}", (lambda p: lambda g: g(f"{p}bias")[None])(prefix)))
        out.append(("W_1", lambda g: g(f"{mlp['lin1']}weight").T))
        if mlp["bias1"]:
            out.append(("b_1", lambda g: g(f"{mlp['lin1']}bias")[None]))
        out.append(("W_2", lambda g: g(f"{mlp['lin2']}weight").T))
        if mlp["bias2"]:
            out.append(("b_2", lambda g: g(f"{mlp['lin2']}bias")[None]))
    return dict(out)


# ----------------------------------------------------------------------------- the result
class ModuleLayer:
    """A torch module as a declared layer (``from_module``); unpacks as (layer, values)."""

    def __init__(self, module, spec, layer):
        self.module, self.spec, self.layer = module, spec, layer
        self.batch_first = spec.batch_first
        self.causal = spec.causal
        self._extract = _extractors(spec, module)
        self.module_params = [n for n, _ in module.named_parameters()]
        self._shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        missing = [n for n in layer.param_names if n not in self._extract]
        if missing:                                      # pragma: no cover - internal
            raise RuntimeError(f"no extraction for {missing}")
        self.index = self._index()

    def __iter__(self):
        yield self.layer
        yield self.values

    def __repr__(self):
        return (f"<symhess module layer {self.layer.name}: {type(self.module).__name__}, "
                f"parameters {', '.join(self.layer.param_names)}>")

    # -- values -------------------------------------------------------------------------
    def _module_tensors(self, source):
        if source is None:
            return {n: p.detach() for n, p in self.module.named_parameters()}
        if hasattr(source, "named_parameters"):
            return {n: p.detach() for n, p in source.named_parameters()}
        src = dict(source)
        missing = [n for n in self.module_params if n not in src]
        if missing:
            raise InputError(f"params lack the module parameter(s) {', '.join(missing)}")
        return {n: (v.detach() if hasattr(v, "detach") else v) for n, v in src.items()}

    def params(self, source=None) -> dict:
        """The declared parameters (and head projectors) from the module's current
        parameters, another module of the same structure, or {module name: tensor}."""
        tensors = self._module_tensors(source)
        out = {n: f(tensors.__getitem__).contiguous() for n, f in self._extract.items()
               if n in self.layer.param_names}
        like = next(iter(out.values()))
        for h in range(1, self.spec.heads + 1):
            if self.spec.heads == 1:
                break
            D = np.zeros((self.spec.d, self.spec.d))
            dh = self.spec.d // self.spec.heads
            D[np.arange((h - 1) * dh, h * dh), np.arange((h - 1) * dh, h * dh)] = 1.0
            import torch
            out[f"D_{h}"] = torch.as_tensor(D, dtype=like.dtype, device=like.device)
        return out

    def batch(self, x, y=None) -> dict:
        """The data of a batch in the declaration's layout: X (and Y) as (N, L, d)."""
        out = {"X": self._seq_first(x, "x")}
        if y is not None:
            out["Y"] = self._seq_first(y, "y")
        return out

    def _seq_first(self, t, what):
        if not hasattr(t, "ndim") or not hasattr(t, "transpose") or isinstance(t, np.ndarray):
            try:
                t = _as_torch(t)
            except (TypeError, ValueError, RuntimeError):
                raise InputError(f"{what} must be a tensor of shape (N, L, d) or (L, d), got "
                                 f"{type(t).__name__}") from None
        if t.ndim == 2:
            return t[None]
        if t.ndim != 3:
            raise InputError(f"{what} must have shape (N, L, d) or (L, d) "
                             f"{'(batch_first)' if self.batch_first else '((L, N, d) when batch_first=False)'}, "
                             f"got {tuple(t.shape)}")
        return t if self.batch_first else t.transpose(0, 1)

    def values(self, batch, params=None) -> dict:
        """Every value a kernel of ``layer`` needs for a batch (x, y) in the module's layout
        (``params``: as ``params()``)."""
        if isinstance(batch, dict):
            data = dict(batch)
        else:
            x, y = batch
            data = self.batch(x, y)
        return {**self.params(params), **data}

    def batches(self, data):
        """``data`` (an iterable of (x, y) in the module's layout) as batches of dicts for
        ``symhess.operator`` / ``Dataset``, iterable again whenever ``data`` is (a one-shot
        iterator is refused, not hidden: ``symhess.curvature.passes``)."""
        from collections.abc import Iterator
        if isinstance(data, Iterator):
            raise InputError(f"ModuleLayer.batches needs data it can read more than once (a "
                             f"list of batches, a DataLoader), not a one-shot "
                             f"{type(data).__name__}: every product reads the data again")
        return _Mapped(data, self._pair)

    def _pair(self, b):
        if not (isinstance(b, (tuple, list)) and len(b) == 2):
            raise InputError(f"a batch of ModuleLayer.batches must be a pair (x, y), got "
                             f"{type(b).__name__}")
        return self.batch(*b)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, x, params=None):
        """The declaration's output for module input x (module layout), by the interpreter."""
        import torch
        from ..expr.evaluate import evaluate
        vals = self.params(params)
        X = self._seq_first(x, "x")
        outs = [evaluate(self.layer.output, dict(vals, X=X[i]), backend="torch")
                for i in range(X.shape[0])]
        F = torch.stack(outs)
        if x.ndim == 2:
            return F[0]
        return F if self.batch_first else F.transpose(0, 1)

    def module_forward(self, x, module=None):
        """The module's own forward on x (module layout) with the declared mask."""
        import torch
        m = self.module if module is None else module
        L = x.shape[-2] if (self.batch_first or x.ndim == 2) else x.shape[0]
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=x.device), 1) \
            if self.causal else None
        if self.spec.kind == "multihead_attention":
            return m(x, x, x, need_weights=False, attn_mask=mask)[0]
        nn = _nn()
        if isinstance(m, nn.TransformerEncoderLayer):
            return m(x, src_mask=mask, is_causal=self.causal) if mask is not None else m(x)
        return m(x)

    # -- results back to the module ---------------------------------------------------------------
    def _index(self):
        import torch
        idx, o = {}, 0
        for n in self.module_params:
            k = int(np.prod(self._shapes[n])) if self._shapes[n] else 1
            idx[n] = torch.arange(o, o + k).reshape(self._shapes[n])
            o += k
        self.module_numel = o
        parts = [self._extract[n](idx.__getitem__).reshape(-1) for n in self.layer.param_names]
        return torch.cat(parts).numpy()

    def to_parameters(self, result):
        """A flat declared vector (declared order) or {declared name: array} → {module
        parameter name: tensor of that Parameter's shape} (entries a partial result does not
        cover are 0)."""
        import torch
        flat = torch.zeros(self.module_numel, dtype=torch.float64)
        if isinstance(result, dict):
            offs, o = {}, 0
            for n in self.layer.param_names:
                k = int(np.prod(self._extract_shape(n)))
                offs[n] = (o, o + k)
                o += k
            for n, r in result.items():
                if n not in offs:
                    raise InputError(f"unknown declared parameter {n!r}; valid: "
                                     f"{', '.join(self.layer.param_names)}")
                a, b = offs[n]
                flat[self.index[a:b]] = _as_torch(r).reshape(-1).to(torch.float64).cpu()
        else:
            r = _as_torch(result).reshape(-1)
            if r.shape[0] != len(self.index):
                raise InputError(f"expected a flat vector of {len(self.index)} entries (every "
                                 f"declared parameter), got {r.shape[0]}")
            flat[self.index] = r.to(torch.float64).cpu()
        out, o = {}, 0
        for n in self.module_params:
            k = int(np.prod(self._shapes[n])) if self._shapes[n] else 1
            out[n] = flat[o:o + k].reshape(self._shapes[n])
            o += k
        return out

    def to_module_matrix(self, H):
        """A matrix over the declared parameters → the same matrix in the module's flat
        parameter order (rows/columns of entries no declared parameter covers are 0)."""
        H = np.asarray(H.detach().cpu().numpy() if hasattr(H, "detach") else H)
        out = np.zeros((self.module_numel, self.module_numel), dtype=H.dtype)
        out[np.ix_(self.index, self.index)] = H
        return out

    def _extract_shape(self, n):
        import torch
        tensors = {m: torch.zeros(s) for m, s in self._shapes.items()}
        return tuple(self._extract[n](tensors.__getitem__).shape)


class _Mapped:
    def __init__(self, data, fn):
        self.data, self.fn = data, fn

    def __iter__(self):
        for b in self.data:
            yield self.fn(b)

    def __len__(self):
        return len(self.data)


def _as_torch(x):
    import torch
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


def from_module(module, causal=False, attn_mask=None, is_causal=None, check=True) -> ModuleLayer:
    """The declared layer of a torch module (module docstring).  ``causal`` / ``attn_mask``
    / ``is_causal``: the mask the module is called with (only the causal mask can be
    declared).  ``check``: compare the declaration's forward with the module's on random
    input (a ``DeclarationError`` when they differ)."""
    nn = _nn()
    if not isinstance(module, nn.Module):
        raise DeclarationError(f"from_module takes a torch.nn.Module, got {type(module).__name__}")
    _check_tensors(module)
    causal = _causal_from(attn_mask, is_causal, causal)
    spec = _recognise(module, causal)
    ml = ModuleLayer(module, spec, _declare(spec))
    if check:
        _check_forward(ml)
    return ml


def _check_tensors(module):
    """Parameters the declaration can read: values (not the meta device), plain tensors (not
    parametrizations, whose weights are computed on each forward)."""
    from torch.nn.utils import parametrize
    meta = [n for n, p in module.named_parameters() if p.is_meta]
    if meta:
        raise DeclarationError(f"{type(module).__name__}: parameter {meta[0]} is on the meta "
                               f"device (no values); materialise the module first "
                               f"(module.to_empty(device='cpu') and initialise it)")
    para = [n for n, m in module.named_modules() if parametrize.is_parametrized(m)]
    if para:
        raise DeclarationError(f"{type(module).__name__}: {para[0] or 'the module'} has "
                               f"parametrized weights (torch.nn.utils.parametrize); remove them "
                               f"with parametrize.remove_parametrizations(..., leave_parametrized="
                               f"True) first, so the weights are plain parameters")


def _check_forward(ml):
    """The declaration's forward against the module's, float64, on a short random input."""
    import copy

    import torch
    m = copy.deepcopy(ml.module).to(torch.float64)
    L = 5
    g = torch.Generator().manual_seed(0)
    shape = (2, L, ml.spec.d) if ml.batch_first else (L, 2, ml.spec.d)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        want = ml.module_forward(x, m)
        got = ml.forward(x, params=m)
    err = float((got - want).norm() / max(float(want.norm()), 1e-300))
    if not math.isfinite(err) or err > CHECK_TOLERANCE:
        raise DeclarationError(
            f"{type(ml.module).__name__}: the declared {ml.layer.description.lower()} "
            f"({'pre' if ml.spec.pre_ln else 'post'}-LN, causal={ml.causal}) differs from the "
            f"module's forward (relative error {err:.2e}); from_module recognises blocks that "
            f"compute exactly the forms in symhess.layers.modules")


__all__ = ["from_module", "ModuleLayer"]

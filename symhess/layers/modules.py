"""torch modules as declared layers: ``symhess.from_module(module, example_inputs, kwargs)``.

The module's forward is captured as an ATen graph and translated into a declaration
(``symhess.layers.capture``; the op table: ``capture.aten``; docs/modules.md).  The result, a
``ModuleLayer``, holds the declared ``Layer`` and the maps between the declaration and the
module:

* every declared parameter is a 2-D piece of one module parameter, in vec_r order: an
  ``nn.Linear`` weight A (x Aᵀ) is declared as Aᵀ (d_in × d_out) or as the column pieces of
  Aᵀ that the heads read (``q_proj_weight_1`` … for heads 1 …), a bias or a norm's γ as a
  1 × n row; ``ModuleLayer.index`` maps every declared entry to the module's flat parameter
  vector (``module.parameters()`` order, C order inside a Parameter), so results go back per
  ``nn.Parameter`` (``to_parameters``) and Hessians to the module's order
  (``to_module_matrix``);
* the hidden states X are the data (batch, L, d); every other input (masks, rotary cos/sin)
  and what the module computes from them alone are constants of the declaration, bound to the
  example's sequence length; a constant that differs between the sequences of the example
  batch (a padding mask) is a per-sequence input, bound to the example's batch.

``from_module`` compares the declaration's forward with the module's on the example and on
a random input of its shape (float64).  The declaration states the mathematics in the
caller's dtype: dtype casts inside the module (transformers computes Llama's RMSNorm and the
eager softmax in float32 even in a float64 model) are identities of the declaration, listed
in ``ModuleLayer.casts``.  For such a module the check compares (1) with the module run with
its downcasts neutralised (``no_downcasts``: its own Python forward, every cast to a lower
precision a no-op) to 1e-10, and (2) with the module as it is to the precision it computes
in (``CAST_TOLERANCE`` times that dtype's ε).  symhess's results are the exact derivatives of
that mathematics; autograd of the module under ``no_downcasts`` is the reference they agree
with to 1e-10.
"""
from __future__ import annotations

import copy
import math
import weakref

import numpy as np

from ..errors import DeclarationError, InputError
from .precision import (CAST_TOLERANCE, CHECK_TOLERANCE, first_tensor as _first_tensor,  # noqa: F401
                        no_downcasts, rel as _rel)


def from_module(module, example_inputs=None, kwargs=None, *, causal=False, attn_mask=None,
                is_causal=None, batch_dim=None, check=True) -> "ModuleLayer":
    """The declared layer of ``module`` called as ``module(*example_inputs, **kwargs)`` (the
    first tensor of ``example_inputs`` is the hidden states).  Without ``example_inputs``,
    ``nn.MultiheadAttention`` (self-attention, ``causal``/``attn_mask``/``is_causal`` as its
    mask) and ``nn.TransformerEncoderLayer`` are called on a random (2, 5, d) input.
    ``batch_dim``: the hidden states' batch axis (default 0, or 1 for torch modules built with
    batch_first=False).  ``check``: compare the forwards (module docstring)."""
    import torch
    from torch import nn
    if not isinstance(module, nn.Module):
        raise DeclarationError(f"from_module takes a torch.nn.Module, got {type(module).__name__}")
    _check_tensors(module)
    default = None
    if example_inputs is None:
        example_inputs, kwargs = _default_call(module, causal, attn_mask, is_causal)
        if attn_mask is None:                   # the call at any length: the causal mask of it
            default = lambda x: _default_call(module, causal, None, is_causal, x)  # noqa: E731
    elif causal or attn_mask is not None or is_causal:
        raise DeclarationError("causal, attn_mask and is_causal describe the default call of "
                               "nn.MultiheadAttention / nn.TransformerEncoderLayer; with "
                               "example_inputs pass the mask in kwargs")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(kwargs or {})
    for detect, build in CALL_KINDS:            # a language model on token ids, with its loss
        found = detect(args, kwargs)
        if found is not None:
            return build(module, args, kwargs, found, check)
    from .capture import capture
    with torch.no_grad():
        cap = capture(module, args, kwargs, batch_dim)
    ml = ModuleLayer(module, cap, args, kwargs)
    ml._default = default
    _OF_LAYER[ml.layer] = ml
    if check:
        _check_forward(ml)
    return ml


_OF_LAYER = weakref.WeakKeyDictionary()

# calls captured otherwise: (detect(args, kwargs) → data or None, build(module, args, kwargs,
# data, check) → ModuleLayer); ``symhess.layers.language`` adds models called on token ids
CALL_KINDS = []


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


def module_layer_of(layer):
    """The ``ModuleLayer`` a declared layer was captured into (None for other layers): the
    command line takes the module's parameters and constants from it."""
    return _OF_LAYER.get(layer)


def _default_call(module, causal, attn_mask, is_causal, x=None):
    """(args, kwargs) of nn.MultiheadAttention / nn.TransformerEncoderLayer called on x (a
    random (2, 5, d) input when None) with the mask asked for."""
    import torch
    from torch import nn
    if isinstance(module, nn.MultiheadAttention):
        d, first = module.embed_dim, module.batch_first
    elif isinstance(module, nn.TransformerEncoderLayer):
        d, first = module.self_attn.embed_dim, module.self_attn.batch_first
    else:
        raise DeclarationError(f"from_module({type(module).__name__}) needs example_inputs (the "
                               f"hidden states, and the other arguments of its forward); without "
                               f"them it takes nn.MultiheadAttention and nn.TransformerEncoderLayer")
    if x is None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn((2, 5, d) if first else (5, 2, d), generator=g,
                        dtype=next(module.parameters()).dtype)
    L = x.shape[-2] if (first or x.ndim == 2) else x.shape[0]
    mask = _mask(attn_mask, causal or bool(is_causal), L)
    if isinstance(module, nn.MultiheadAttention):
        kw = {"need_weights": False}
        if mask is not None:
            kw["attn_mask"] = mask
        return (x, x, x), kw
    return (x,), ({"src_mask": mask, "is_causal": bool(is_causal or causal)} if mask is not None else {})


def _mask(attn_mask, causal, L):
    import torch
    if attn_mask is not None:
        return torch.as_tensor(attn_mask)
    if causal:
        return torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    return None


# ----------------------------------------------------------------------------- the result
class ModuleLayer:
    """A torch module as a declared layer (``from_module``); unpacks as (layer, values)."""

    def __init__(self, module, cap, args, kwargs):
        from ..expr.layer import Layer
        self.module, self.capture = module, cap
        self.args, self.kwargs = args, kwargs
        self._x = next((a for a in args if hasattr(a, "ndim")), None)
        self._default = None
        self.casts = list(cap.casts)
        self.loss = cap.loss           # the loss the module computes itself, or None
        self.batch_first = cap.x_perm[0] != "pos"
        self.layer = Layer(f"module_{_ident(type(module).__name__)}", cap.output, tuple(cap.params),
                           (cap.X,) + tuple(_const_vars(cap)), cap.intermediates, {},
                           f"{type(module).__name__} captured by torch.export", tuple(cap.checks))
        self.causal = any(getattr(a, "causal", False) for a in cap.intermediates.values())
        self.module_params = [n for n, _ in module.named_parameters()]
        self._shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        offs, o = {}, 0
        for n in self.module_params:
            offs[n] = o
            o += int(np.prod(self._shapes[n])) if self._shapes[n] else 1
        self.module_numel = o
        self._offsets = offs
        self.pieces = cap.pieces
        self.index = np.concatenate([offs[m] + np.asarray(idx).reshape(-1)
                                     for m, idx in (cap.pieces[p.name] for p in cap.params)])

    def __iter__(self):
        yield self.layer
        yield self.values

    def __repr__(self):
        return (f"<symhess module layer {self.layer.name}: {type(self.module).__name__}, "
                f"{len(self.layer.params)} declared parameters>")

    def describe(self) -> str:
        """One line per declared parameter: its shape and the module entries it holds."""
        lines = []
        for p in self.layer.params:
            mod, idx = self.pieces[p.name]
            shape = self._shapes[mod]
            rows = _span(np.asarray(idx), shape)
            lines.append(f"{p.name}: {p.rows} × {p.cols} = {mod}{rows}")
        return "\n".join(lines)

    def module_positions(self) -> dict:
        """{declared parameter: the positions of its entries (vec_r order) in the module's
        flat parameter vector} — the pieces of ``index``, one per declared parameter."""
        out, o = {}, 0
        for p in self.layer.params:
            k = int(np.asarray(self.pieces[p.name][1]).size)
            out[p.name] = self.index[o:o + k]
            o += k
        return out

    def declared_under(self, prefix) -> tuple:
        """The declared parameters holding entries of module parameters under ``prefix`` (a
        submodule's path, e.g. ``transformer.h.1``: one Transformer block of a whole model),
        in declared order — ``symhess.operator(kernel, data, p=[…])`` is then their
        curvature of the whole loss."""
        pre = prefix.rstrip(".") + "."
        out = tuple(p.name for p in self.layer.params
                    if self.pieces[p.name][0] == prefix or self.pieces[p.name][0].startswith(pre))
        if not out:
            mods = sorted({m.rsplit(".", 1)[0] for m in self.module_params if "." in m})
            raise InputError(f"no declared parameter lies under {prefix!r}; submodules with "
                             f"parameters: {', '.join(mods)}")
        return out

    # -- values ----------------------------------------------------------------------------
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
        """The declared parameters (and the declaration's constants) from the module's current
        parameters, another module of the same structure, or {module name: tensor}."""
        import torch
        tensors = self._module_tensors(source)
        out = {}
        for p in self.layer.params:
            mod, idx = self.pieces[p.name]
            t = torch.as_tensor(tensors[mod])
            out[p.name] = t.reshape(-1)[torch.as_tensor(idx)].contiguous()
        like = next(iter(out.values()))
        for name, v in self.capture.consts.items():
            out[name] = torch.as_tensor(v, dtype=like.dtype, device=like.device)
        return out

    def batch(self, x, y=None) -> dict:
        """The data of a batch in the declaration's layout: X (and Y) as (N, L, d), with the
        per-sequence constants of the example (the same N)."""
        X = self._layout(x, self.capture.x_perm, "x")
        out = {"X": X}
        if y is not None:
            out["Y"] = self._layout(y, self.capture.y_perm, "y")
        L = self.capture.example_length
        if (self.capture.consts or self.capture.seq_consts) and X.shape[1] != L and _uses_L(self):
            raise InputError(f"x has {X.shape[1]} tokens but the module was captured with "
                             f"{L}: its constants (masks, rotary tables) are bound to that "
                             f"length; capture it with an example of the data's length")
        if self.capture.seq_consts:
            B = self.capture.example_batch
            if X.shape[0] != B:
                raise InputError(f"x has {X.shape[0]} sequences but the module's constants "
                                 f"{', '.join(self.capture.seq_consts)} differ between the "
                                 f"{B} sequences of the example; give batches of that example")
            for name, v in self.capture.seq_consts.items():
                out[name] = _as_torch(v).to(dtype=X.dtype, device=X.device)
        return out

    def _layout(self, t, perm, what):
        try:
            t = _as_torch(t)
        except (TypeError, ValueError, RuntimeError):
            raise InputError(f"{what} must be a tensor with axes ({', '.join(perm)}), got "
                             f"{type(t).__name__}") from None
        if t.ndim == 2 and "batch" in perm:
            t = t[None] if perm[0] == "batch" else t[:, None]
        if t.ndim != len(perm) or not (2 <= t.ndim <= 3):
            raise InputError(f"{what} must have {len(perm)} axes ({', '.join(perm)}), got shape "
                             f"{tuple(t.shape)}")
        if t.ndim == 2:
            return t[None]
        order = [perm.index(k) for k in ("batch", "pos", "feat")]
        return t.permute(order)

    def values(self, batch, params=None) -> dict:
        """Every value a kernel of ``layer`` needs for a batch (x, y) in the module's layout
        (``params``: as ``params()``)."""
        data = dict(batch) if isinstance(batch, dict) else self.batch(*batch)
        return {**self.params(params), **data}

    def batches(self, data):
        """``data`` (an iterable of (x, y) in the module's layout) as batches of dicts for
        ``symhess.operator`` / ``Dataset``, iterable again whenever ``data`` is (a one-shot
        iterator is refused, not hidden: ``symhess.curvature.passes``)."""
        from .hooks import reusable
        reusable(data, "ModuleLayer.batches")
        return _Mapped(data, self._pair)

    def batches_from(self, model, data, targets="output", call=None):
        """The batches of the hidden states ``model`` feeds this module (one of its
        submodules) on each of its batches in ``data`` (a list, a DataLoader), with targets
        Y: ``"output"`` (the module's own output), ``targets(output, batch)`` or None;
        ``call(model, batch)`` runs the model.  Each call is checked against the captured
        one (``symhess.layers.hooks``)."""
        from .hooks import HookedBatches
        return HookedBatches(self, model, data, targets, call)

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
        data = self.batch(x)
        X = data.pop("X")
        outs = [evaluate(self.layer.output, dict(vals, X=X[i], **{k: v[i] for k, v in data.items()}),
                         backend="torch") for i in range(X.shape[0])]
        F = torch.stack(outs)
        return self._back(F, x)

    def _back(self, F, x):
        perm = self.capture.y_perm
        if len(perm) == 2:
            return F[0]
        if _as_torch(x).ndim == 2:
            return F[0]
        order = [("batch", "pos", "feat").index(k) for k in perm]
        return F.permute(order)

    def module_forward(self, x, module=None):
        """The module's own forward on x (module layout), called as it was captured."""
        m = self.module if module is None else module
        args, kwargs = self.call_args(x)
        out = m(*args, **kwargs)
        return _first_tensor(out)

    def call_args(self, x):
        """(args, kwargs) of the captured call with the hidden states replaced by x (the other
        tensors cast to x's dtype)."""
        from torch.utils import _pytree as pytree
        x = _as_torch(x)
        if getattr(self, "_default", None) is not None:
            return self._default(x)
        cast = lambda t: t.to(x.dtype) if hasattr(t, "is_floating_point") and t.is_floating_point() else t  # noqa: E731
        return pytree.tree_map(lambda t: x if t is self._x else cast(t), (self.args, self.kwargs))

    # -- results back to the module ---------------------------------------------------------
    def to_parameters(self, result):
        """A flat declared vector (declared order) or {declared name: array} → {module
        parameter name: tensor of that Parameter's shape} (entries a partial result does not
        cover are 0)."""
        import torch
        flat = torch.zeros(self.module_numel, dtype=torch.float64)
        if isinstance(result, dict):
            where = self.module_positions()
            for n, r in result.items():
                if n not in where:
                    raise InputError(f"unknown declared parameter {n!r}; valid: "
                                     f"{', '.join(self.layer.param_names)}")
                flat[where[n]] = _as_torch(r).reshape(-1).to(torch.float64).cpu()
        else:
            r = _as_torch(result).reshape(-1)
            if r.shape[0] != len(self.index):
                raise InputError(f"expected a flat vector of {len(self.index)} entries (every "
                                 f"declared parameter), got {r.shape[0]}")
            flat[self.index] = r.to(torch.float64).cpu()
        out = {}
        for n in self.module_params:
            o, k = self._offsets[n], int(np.prod(self._shapes[n])) if self._shapes[n] else 1
            out[n] = flat[o:o + k].reshape(self._shapes[n])
        return out

    def to_module_matrix(self, H):
        """A matrix over the declared parameters → the same matrix in the module's flat
        parameter order (rows/columns of entries no declared parameter covers are 0)."""
        H = np.asarray(H.detach().cpu().numpy() if hasattr(H, "detach") else H)
        out = np.zeros((self.module_numel, self.module_numel), dtype=H.dtype)
        out[np.ix_(self.index, self.index)] = H
        return out


def _const_vars(cap):
    from ..expr import nodes as E
    names = set(cap.consts) | set(cap.seq_consts)
    return sorted((v for v in E.walk(cap.output) if isinstance(v, E.Var) and v.name in names),
                  key=lambda v: v.name)


def _uses_L(ml):
    from ..expr import nodes as E
    L = E.dim("L")
    for v in ml.layer.inputs[1:]:
        if L in getattr(v.rows, "free_symbols", ()) or L in getattr(v.cols, "free_symbols", ()):
            return True
    return False


def _span(idx, shape):
    """'[r0:r1, c0:c1]ᵀ'-like text for the entries a piece holds."""
    if not shape:
        return ""
    pos = np.array(np.unravel_index(idx.reshape(-1), shape))
    lo, hi = pos.min(axis=1), pos.max(axis=1) + 1
    box = ", ".join(f"{a}:{b}" if b - a < s else ":" for a, b, s in zip(lo, hi, shape))
    return f"[{box}]"


def _ident(name):
    return "".join(ch if ch.isalnum() else "_" for ch in name)


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


# ----------------------------------------------------------------------------- the check
def _check_forward(ml):
    """The declaration's forward against the module's, float64, on the example and on a random
    input of its shape; with downcasts, against the module under ``no_downcasts`` (1e-10)
    and as it is (``CAST_TOLERANCE`` ε of its lowest dtype)."""
    import torch
    m = ml.module
    if any(p.dtype != torch.float64 for p in m.parameters()):
        m = copy.deepcopy(m).to(torch.float64)
    x0 = ml._x.to(torch.float64)
    g = torch.Generator().manual_seed(0)
    xs = [x0, torch.randn(x0.shape, generator=g, dtype=torch.float64)]
    worst_strict, worst_loose = 0.0, 0.0
    with torch.no_grad():
        for x in xs:
            got = ml.forward(x, params=m)
            with no_downcasts():
                want = ml.module_forward(x, m)
            worst_strict = max(worst_strict, _rel(got, want))
            if ml.casts:
                worst_loose = max(worst_loose, _rel(got, ml.module_forward(x, m)))
    name = type(ml.module).__name__
    if not math.isfinite(worst_strict) or worst_strict > CHECK_TOLERANCE:
        raise DeclarationError(f"{name}: the captured declaration differs from the module's "
                               f"forward (relative error {worst_strict:.2e} > {CHECK_TOLERANCE:g}); "
                               f"an operation was translated wrongly or is not deterministic")
    if ml.casts:
        tol = CAST_TOLERANCE * ml.capture.cast_eps
        if not math.isfinite(worst_loose) or worst_loose > tol:
            raise DeclarationError(f"{name}: with its dtype casts ({ml.casts[0]} …) the module "
                                   f"differs from the declaration by {worst_loose:.2e}, more than "
                                   f"its lower-precision steps explain ({tol:.1e})")
    ml.forward_error = worst_strict
    ml.cast_error = worst_loose


__all__ = ["from_module", "ModuleLayer", "no_downcasts"]

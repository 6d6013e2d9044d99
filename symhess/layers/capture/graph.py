"""Graph capture: a torch module's forward as a symhess declaration.

``capture(module, args, kwargs)`` exports the module with ``torch.export.export(...,
strict=False)`` (an ATen graph: every tensor operation the forward performs, with shapes,
the module path and the source line of each node; parameters, buffers and user inputs as
placeholders) and translates it node by node (``aten.OPS``, one entry per ATen op; the translation's
state is a ``context.Context``, the tensors ``tensor.Sym`` s).  torch.export, not torch.fx's symbolic tracer: it runs the real Python forward
(transformers' control flow, mask construction, dtype casts) and decomposes to a closed op
set with shapes, where fx sees only module calls and fails on data-dependent Python.

* Parameters enter as index arrays into their module parameter (``Piece``): views,
  transposes and slices act on the indices, so a declared parameter is any piece of a module
  parameter (W_Q's head h is ``q_proj.weight[h·d_h:(h+1)·d_h, :]ᵀ``) and results map back
  entry by entry (``Capture.pieces``).  Pieces of one module parameter may not overlap.
* The first positional input is the hidden states X (every placeholder bound to that same
  tensor is X too); every other tensor (masks, rotary cos/sin, position ids, buffers) and
  everything computed from them alone is a constant, computed by running the op (constant
  folding), and enters the declaration as a constant matrix (``const``) — or, where it differs
  between the sequences of the batch (a padding mask), as a per-sequence input.
* dtype casts (``to(float32)`` inside a float64 run) are identities of the declaration, which
  states the mathematics in the caller's dtype; each is recorded (``Capture.casts``).
* A language model called on token ids (``ids``): X is their one-hot matrix, their embedding
  X W_E, the model's ``cross_entropy_loss`` ends the graph (``Capture.loss``); ops that only
  rearrange the ids run on the example's ids, ops that read their values are refused; a
  parameter listed under two names (a tied head) is one parameter (``symhess.layers.language``).

Errors are ``DeclarationError`` s naming the ATen op, the module path and the source line.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from ...expr import nodes as E
from ...errors import DeclarationError
from . import ops as O
from . import tensor as S
from . import aten_math  # noqa: F401  (registers the arithmetic entries of OPS)
from .aten import OPS, VIEWS
from .context import Context, op_name, _ident, _param_tex, _where
from .tensor import Atom, Piece, Sym


@dataclass
class Capture:
    """The result: the declaration's parts and the maps back to the module."""

    output: E.Expr
    X: E.Var
    params: list                    # declared parameter Vars, ordered
    pieces: dict                    # declared name → (module parameter name, flat index array 2-D)
    consts: dict                    # const name → value (2-D ndarray)
    seq_consts: dict                # per-sequence input name → value (B × r × c ndarray)
    casts: list                     # (description) of each dtype cast made an identity
    checks: list
    intermediates: dict
    x_perm: tuple                   # the example input's axes as (batch, pos, feat) positions
    y_perm: tuple                   # the output's axes likewise
    example_batch: int
    example_length: int
    dims: dict = field(default_factory=dict)   # symbol name → size at capture
    cast_eps: float = 0.0           # ε of the lowest precision a cast reaches (0: none)
    loss: str = None                # the loss the model computes itself (registered name)


# ----------------------------------------------------------------------------- the driver
def capture(module, args, kwargs=None, batch_dim=None, ids=None) -> Capture:
    """Export ``module(*args, **kwargs)`` and translate its graph (module docstring).
    ``ids``: the token ids (B × L integers) of a language model called on them; the data X is
    then their one-hot matrix (L × V per sequence, V the rows of the embedding table)."""
    import torch
    from torch.utils import _pytree as pytree

    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    x = ids if ids is not None else next((a for a in args if isinstance(a, torch.Tensor)), None)
    if ids is None and (x is None or not x.is_floating_point()):
        raise DeclarationError("from_module needs the hidden states as the first tensor "
                               "argument of example_inputs (a floating tensor (B, L, d) or (L, d))")
    if x.ndim not in ((1, 2) if ids is not None else (2, 3)):
        raise DeclarationError(f"the hidden states must have shape (B, L, d) or (L, d), got "
                               f"{tuple(x.shape)}" if ids is None else
                               f"the token ids must have shape (B, L) or (L,), got {tuple(x.shape)}")
    f64 = lambda t: t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    x64 = f64(x)
    args64, kwargs64 = pytree.tree_map(lambda t: x64 if t is x else f64(t), (args, kwargs))
    m = module if _dtype_of(module) in (torch.float64, None) else copy.deepcopy(module).to(torch.float64)
    try:
        ep = torch.export.export(m, args64, kwargs64, strict=False)
    except Exception as exc:                     # torch's own message, on one line
        first = " ".join(str(exc).strip().splitlines()[:1])
        raise DeclarationError(f"torch.export could not capture {type(module).__name__}: "
                               f"{type(exc).__name__}: {first:.300}") from None
    flat, _ = ep._get_flat_args_with_check(args64, kwargs64)
    params, alias = _parameters(m)
    ctx = Context(params, torch.float64)
    ctx.caller_dtype = x.dtype if ids is None else torch.float64
    if ids is None:
        bdim = _batch_dim(module, x, batch_dim)
        X, xsym, x_kinds = _input(ctx, x, bdim)
    else:
        X, xsym, x_kinds = _ids_input(ctx, ids, params, ep, alias, flat)
    ctx.xsym = xsym
    inputs = iter((v, "X" if v is x64 else None) for v in flat)
    spec = {s.arg.name: s for s in ep.graph_signature.input_specs}
    env, out = {}, None
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            env[node] = _placeholder(ctx, ep, spec[node.name], inputs, xsym, params, alias)
        elif node.op == "call_function":
            ctx.where, ctx.op = _where(node), op_name(node.target)
            a = _map(node.args, env)
            k = _map(node.kwargs, env)
            env[node] = _dispatch(ctx, node, a, k, OPS, VIEWS, op_name)
        elif node.op == "output":
            out = _map(node.args[0], env)
        elif node.op == "get_attr":
            env[node] = getattr(ep.graph_module, node.target)
    ctx.where = ctx.op = ""
    return _result(ctx, out, X, x_kinds, x)


def _parameters(m):
    """({name: Parameter} without duplicates, {every name a parameter has: its first name}):
    a tied parameter (GPT-2's lm_head.weight is transformer.wte.weight) is one parameter."""
    params, alias, first = {}, {}, {}
    for n, p in m.named_parameters(remove_duplicate=False):
        if id(p) not in first:
            first[id(p)] = n
            params[n] = p
        alias[n] = first[id(p)]
    return params, alias


def _ids_input(ctx, ids, params, ep, alias, flat):
    """Token ids: the data X is their one-hot matrix, L × V per sequence, V the rows of the
    embedding table that reads them (the first ``aten.embedding`` of a parameter whose indices
    come from the ids)."""
    V, d = _table(ep, params, alias, ids, flat)
    pos = Atom("pos", ids.shape[-1])
    feat = Atom("feat", V, "V")
    ctx.size(d, "d")
    X = E.matrix("X", ctx.L, ctx.size(V, "V"))
    if ids.ndim == 2:
        dims, kinds = [[Atom("batch", ids.shape[0])], [pos], [feat]], ("batch", "pos", "feat")
    else:
        dims, kinds = [[pos], [feat]], ("pos", "feat")
    sym = S.single(S.of_expr(X), dims, pos, feat)
    ctx.ids = ids
    return X, sym, kinds


def _table(ep, params, alias, ids, flat):
    """(V, d): the shape of the embedding table the token ids index."""
    import torch.fx as fx
    spec = {s.arg.name: s for s in ep.graph_signature.input_specs}
    users = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    of_ids = {n for n, v in zip(users, flat) if v is ids}

    def source(a):                          # the placeholder an index tensor comes from
        while isinstance(a, fx.Node) and a.op == "call_function" and a.args:
            a = a.args[0]
        return a.name if isinstance(a, fx.Node) else None

    for node in ep.graph.nodes:
        if node.op == "call_function" and op_name(node.target) == "aten.embedding.default" \
                and source(node.args[1]) in of_ids:
            s = spec.get(getattr(node.args[0], "name", None))
            if s is not None and s.kind.name == "PARAMETER":
                V, d = params[alias[s.target]].shape
                return int(V), int(d)
    raise DeclarationError("the model takes token ids but no aten.embedding of a parameter "
                           "reads them; symhess declares token ids as the one-hot rows of an "
                           "embedding table")


def _dtype_of(module):
    for p in module.parameters():
        return p.dtype
    return None


def _batch_dim(module, x, batch_dim):
    """The batch axis of the hidden states: given, else 1 for torch modules built with
    batch_first=False (nn.MultiheadAttention, nn.Transformer*), else 0."""
    if x.ndim == 2:
        return None
    if batch_dim is not None:
        if batch_dim not in (0, 1):
            raise DeclarationError(f"batch_dim must be 0 or 1 (the feature axis is last), got {batch_dim!r}")
        return batch_dim
    for m in module.modules():
        if hasattr(m, "batch_first"):
            return 0 if m.batch_first else 1
    return 0


def _input(ctx, x, bdim):
    """The hidden states: X (L × d) and its symbolic tensor."""
    d = int(x.shape[-1])
    pos = Atom("pos", x.shape[1 - (bdim or 0)] if x.ndim == 3 else x.shape[0])
    feat = Atom("feat", d, "d")
    if x.ndim == 3:
        dims = [[Atom("batch", x.shape[bdim])], [pos]] if bdim == 0 else [[pos], [Atom("batch", x.shape[1])]]
        kinds = ("batch", "pos", "feat") if bdim == 0 else ("pos", "batch", "feat")
    else:
        dims, kinds = [[pos]], ("pos", "feat")
    ctx.size(d, "d")
    X = E.matrix("X", ctx.L, ctx.size(d, "d"))
    sym = S.single(S.of_expr(X), dims + [[feat]], pos, feat)
    return X, sym, kinds


def _placeholder(ctx, ep, spec, inputs, xsym, params, alias):
    import torch
    kind = spec.kind.name
    if kind == "PARAMETER":
        name = alias.get(spec.target, spec.target)
        t = params[name]
        idx = torch.arange(t.numel()).reshape(t.shape)
        return Piece(name, idx, t.detach())
    if kind == "BUFFER":
        return ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
    if kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
        return ep.constants[spec.target]
    value, mark = next(inputs)
    if mark == "X":
        return xsym if ctx.ids is None else S.Ids(value, xsym, value)
    return value


def _map(a, env):
    import torch.fx as fx
    return fx.node.map_aggregate(a, lambda v: env[v] if isinstance(v, fx.Node) else v)


def _leaves(a):
    if isinstance(a, (list, tuple)):
        for v in a:
            yield from _leaves(v)
    elif isinstance(a, dict):
        for v in a.values():
            yield from _leaves(v)
    else:
        yield a


def _dispatch(ctx, node, args, kwargs, ops, views, op_name):
    """One node: constant folding, a view of a parameter, or the op table."""
    import torch
    name = op_name(node.target)
    if name == "<built-in function getitem>":
        return args[0][args[1]]
    leaves = list(_leaves((args, kwargs)))
    if any(isinstance(v, S.Ids) for v in leaves) and name not in IDS_READERS:
        return _on_ids(ctx, node, name, args, kwargs)
    if not any(isinstance(v, (Sym, Piece)) for v in leaves):
        return node.target(*args, **kwargs)
    if not any(isinstance(v, Sym) for v in leaves) and name in views and isinstance(args[0], Piece):
        p = args[0]
        if name in ("aten.to.dtype", "aten._to_copy.default", "aten.to.dtype_layout"):
            ctx.note_cast(node, p, args[1:], kwargs)
            return p
        idx = node.target(p.idx, *args[1:], **kwargs)
        val = node.target(p.value, *args[1:], **kwargs)
        if isinstance(idx, (list, tuple)):
            return [Piece(p.name, i, v) for i, v in zip(idx, val)]
        return Piece(p.name, idx, val)
    fn = ops.get(name)
    if fn is None:
        raise ctx.fail(f"{name} cannot be declared (no rule for it); symhess declares the ATen "
                       f"ops listed in docs/modules.md")
    del torch
    return fn(ctx, node, *args, **kwargs)


# ops that rearrange token ids without reading their values (the loss's shift of the labels:
# pad, slice, view), and the ops that read them (the one-hot data, the loss's targets)
IDS_MOVES = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
             "aten.contiguous.default", "aten.clone.default", "aten.alias.default",
             "aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default",
             "aten.lift_fresh_copy.default", "aten.pad.default", "aten.constant_pad_nd.default",
             "aten.slice.Tensor"}
IDS_READERS = {"aten.embedding.default", "aten.cross_entropy_loss.default"}


def _on_ids(ctx, node, name, args, kwargs):
    """An op on the token ids: a rearrangement runs on the example's ids and stays token
    ids; a runtime check is nothing; any op that reads their values (a comparison, a mask
    made from a padding id) is refused: the declaration holds for every token sequence."""
    if name == "aten._assert_tensor_metadata.default":
        return None
    if name not in IDS_MOVES:
        raise ctx.fail(f"{name} reads the values of the token ids; a declaration holds for "
                       f"every token sequence, so only the embedding and the loss's targets "
                       f"may read them")
    ids = args[0]
    rest = [a.value if isinstance(a, S.Ids) else a for a in args[1:]]
    if any(isinstance(v, (S.Ids, Sym, Piece)) for v in _leaves((rest, kwargs))):
        raise ctx.fail(f"{name} combines the token ids with another tensor")
    return S.Ids(node.target(ids.value, *rest, **kwargs), ids.onehot, ids.original)


def _result(ctx, out, X, x_kinds, x):
    """The Capture of a translated graph (the logits of a loss the model computes itself)."""
    lo = next((v for v in _leaves(out) if isinstance(v, S.LossOut)), None)
    if ctx.ids is not None and lo is None:
        raise DeclarationError("a model called on token ids must compute its own loss (call it "
                               "with labels=input_ids): symhess declares its logits and that loss")
    sym = lo.logits if lo is not None else next((v for v in _leaves(out) if isinstance(v, Sym)), None)
    if sym is None:
        raise DeclarationError("the module's output does not depend on its input (the hidden states)")
    if sym.row is None or sym.row.kind != "pos":
        raise DeclarationError("the module's output is not one row per token; symhess declares "
                               "outputs of shape (B, L, d)")
    if sym.col is not None:
        sym = O.to_cols(ctx, sym, sym.dim_of(sym.col))
    if sym.blocks.size != 1:
        raise DeclarationError(f"the module's output has axes {sym.dims} besides the tokens and "
                               f"features")
    R, C = ctx.shape_of(sym)
    F = ctx.expr(sym.blocks.reshape(-1)[0], R, C)
    y_kinds = tuple(a.kind for d in sym.dims for a in d if a.size > 1 or a.kind == "batch")
    inter = {}
    if len(ctx.softmaxes) == 1:
        inter = {"T": ctx.softmaxes[0][0], "A": ctx.softmaxes[0][1]}
    else:
        for k, (T, A) in enumerate(ctx.softmaxes, 1):
            inter[f"T{k}"], inter[f"A{k}"] = T, A
    F, inter = _shared_projections(F, inter)
    F, inter, checks, ordered, pieces = _renamed(ctx, F, inter)
    L = x.shape[x_kinds.index("pos")]
    B = x.shape[x_kinds.index("batch")] if "batch" in x_kinds else 1
    used = {v.name for v in _vars(F)}
    return Capture(F, X, ordered, pieces,
                   {k: v for k, v in ctx.const_values.items() if k in used},
                   {k: v for k, v in ctx.seq_values.items() if k in used},
                   list(dict.fromkeys(ctx.casts)), checks, inter, x_kinds, y_kinds, B, L,
                   {str(s): n for n, s in ctx.size_syms.items()}, ctx.cast_eps,
                   lo.loss if lo is not None else None)


def _shared_projections(F, inter):
    """A projection used both as it is and times a constant (a head's query U W and its
    rotate_half U W R) becomes one named quantity P_k: the derivatives then form d(U W) once
    and multiply it by R, instead of expanding d(U W R) into products of their own."""
    nodes = {n: None for n in E.walk(F)}
    found = []
    for n in nodes:
        if isinstance(n, E.MatMul) and len(n.args) >= 3 and _const(n.args[-1]) and \
                isinstance(n.args[-2], E.Var) and n.args[-2].role == "param":
            core = E.matmul(*n.args[:-1])
            if core in nodes and core not in found:
                found.append(core)
    if not found:
        return F, inter
    mapping = {core: E.named(core, f"P_{k}", rf"\mathbf P_{{{k}}}") for k, core in enumerate(found, 1)}
    for n in nodes:
        if isinstance(n, E.MatMul) and len(n.args) >= 3 and E.matmul(*n.args[:-1]) in mapping:
            mapping[n] = E.matmul(mapping[E.matmul(*n.args[:-1])], n.args[-1])
    sub = lambda e: E.substitute(e, mapping)  # noqa: E731
    return sub(F), {k: sub(v) for k, v in inter.items()}


def _const(e):
    return isinstance(e, E.Var) and e.role == "const"


def _renamed(ctx, F, inter):
    """Declared parameters in module order (pieces of one parameter by their first entry),
    named after their module parameter (``in_proj_weight_1`` … when it is split)."""
    names = list(ctx.module_params)
    used = {v.name: v for v in _vars(F) if v.role == "param"}
    order = sorted(used, key=lambda v: (names.index(ctx.piece_info[v][0]),
                                        int(np.min(ctx.piece_info[v][1]))))
    count, seen, mapping, pieces, ordered = {}, {}, {}, {}, []
    for n in order:
        mod, idx = ctx.piece_info[n]
        count[mod] = count.get(mod, 0) + 1
    for n in order:
        mod, idx = ctx.piece_info[n]
        seen[mod] = seen.get(mod, 0) + 1
        k = None if count[mod] == 1 and idx.size == ctx.cover[mod].size else seen[mod]
        new_name = _ident(mod) if k is None else f"{_ident(mod)}_{k}"
        old = used[n]
        var = E.param(new_name, old.rows, old.cols, _param_tex(mod, k, ctx.module_params[mod].ndim))
        mapping[old] = var
        pieces[new_name] = (mod, idx)
        ordered.append(var)
    sub = lambda e: E.substitute(e, mapping)  # noqa: E731
    checks = [type(c)(c.label, sub(c.input)) for c in ctx.checks]
    return sub(F), {k: sub(v) for k, v in inter.items()}, checks, ordered, pieces


def _vars(e):
    return [v for v in E.walk(e) if isinstance(v, E.Var)]


__all__ = ["capture", "Capture"]

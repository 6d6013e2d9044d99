"""Graph capture: a torch module's forward as a symhess declaration.

``capture(module, args, kwargs)`` exports the module with ``torch.export.export(...,
strict=False)`` (an ATen graph: every tensor operation the forward performs, with shapes,
the module path and the source line of each node; parameters, buffers and user inputs as
placeholders) and translates it node by node (``symhess.aten_ops.OPS``, one entry per ATen
op).  torch.export, not torch.fx's symbolic tracer: it runs the real Python forward
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

Errors are ``DeclarationError`` s naming the ATen op, the module path and the source line.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import sympy as sp

from .expr import nodes as E
from .errors import DeclarationError
from . import symtensor as S
from .symtensor import Atom, Fn, Lin, Masked, Sym, Term

MASK_FRACTION = 0.5      # additive entries ≤ −MASK_FRACTION · max(dtype) (or −∞) mask


@dataclass
class Piece:
    """Entries of module parameter ``name``: ``idx`` (an int tensor of any shape) holds flat
    positions inside it, ``value`` the entries (for constant folding of view operations)."""

    name: str
    idx: object
    value: object


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


# ----------------------------------------------------------------------------- context
class Context:
    """The declaration being built: dimensions, parameter pieces, constants, casts."""

    def __init__(self, module_params, dtype):
        self.L = E.dim("L")
        self.module_params = module_params            # name → tensor (order = module order)
        self.dtype = dtype
        self.size_syms = {}
        self.cover = {n: np.full(int(t.numel()), -1) for n, t in module_params.items()}
        self.pieces = {}          # (name, shape, bytes) → Var
        self.piece_info = {}      # Var name → (module name, idx)
        self.piece_count = {}
        self.consts = {}          # key → Var
        self.const_values = {}
        self.seq_values = {}
        self.casts = []
        self.checks = []
        self.intermediates = {}
        self.n_norm = 0
        self.n_attn = 0
        self.where = ""
        self.memo = {}            # id(Lin) → (Lin, expression)
        self.softmaxes = []       # (T, A) of every softmax, in graph order
        self.caller_dtype = None
        self.cast_eps = 0.0

    def note_cast(self, node, x, args, kwargs):
        """Record a cast to less floating precision than the caller's dtype."""
        import torch
        dt = kwargs.get("dtype")
        for a in args:
            if isinstance(a, torch.dtype):
                dt = a
            elif isinstance(a, torch.Tensor) and dt is None:
                dt = a.dtype
        if dt is None or not dt.is_floating_point or self.caller_dtype is None:
            return
        if torch.finfo(dt).eps > torch.finfo(self.caller_dtype).eps:
            self.cast_eps = max(self.cast_eps, float(torch.finfo(dt).eps))
            self.casts.append(f"{_op_label(node)} to {str(dt).replace('torch.', '')} ({self.where})")

    # -- sizes -----------------------------------------------------------------------
    def size(self, n, hint=None):
        """The declared dimension for a concrete feature size: one symbol per size (d for the
        input's width, d_h for head widths, d_ff, d_2, … otherwise); 1 stays 1."""
        n = int(n)
        if n == 1:
            return sp.Integer(1)
        if n not in self.size_syms:
            taken = {str(s) for s in self.size_syms.values()}
            name = hint if hint and hint not in taken else None
            if name is None:
                name = "d_ff" if "d_ff" not in taken else next(
                    f"d_{k}" for k in range(2, 10 ** 6) if f"d_{k}" not in taken)
            self.size_syms[n] = E.dim(name)
        return self.size_syms[n]

    def atom_size(self, atom):
        if atom is None:
            return sp.Integer(1)
        if atom.kind == "pos":
            return self.L
        return self.size(atom.size, atom.hint)

    def shape_of(self, sym):
        return self.atom_size(sym.row), self.atom_size(sym.col)

    def fail(self, msg):
        return DeclarationError(f"{msg} ({self.where})" if self.where else msg)

    # -- parameters ------------------------------------------------------------------------
    def piece(self, name, idx):
        """The declared parameter for the entries ``idx`` (2-D) of module parameter ``name``:
        an earlier piece with the same entries (or its transpose), else a new one."""
        idx = np.ascontiguousarray(np.asarray(idx, dtype=np.int64))
        key = (name, idx.shape, idx.tobytes())
        if key in self.pieces:
            return self.pieces[key]
        tkey = (name, idx.T.shape, np.ascontiguousarray(idx.T).tobytes())
        if tkey in self.pieces:
            return E.transpose(self.pieces[tkey])
        cover = self.cover[name]
        flat = idx.reshape(-1)
        if len(np.unique(flat)) != flat.size:
            raise self.fail(f"parameter {name} is read with repeated entries; such a read "
                            f"cannot be a declared parameter")
        used = cover[flat]
        if (used >= 0).any():
            other = next(v for v in self.piece_info if self.piece_info[v][0] == name and
                         np.isin(self.piece_info[v][1], flat).any())
            raise self.fail(f"parameter {name} is read in overlapping pieces (entries already in "
                            f"the declared {other}); symhess declares each entry of a module "
                            f"parameter once")
        k = self.piece_count.get(name, 0) + 1
        self.piece_count[name] = k
        base = _ident(name)
        whole = flat.size == cover.size
        vname = base if whole else f"{base}_{k}"
        rows = self.size(idx.shape[0]) if idx.shape[0] > 1 else 1
        cols = self.size(idx.shape[1]) if idx.shape[1] > 1 else 1
        var = E.param(vname, rows, cols, _param_tex(name, None if whole else k,
                                                    self.module_params[name].ndim))
        cover[flat] = len(self.piece_info)
        self.pieces[key] = var
        self.piece_info[vname] = (name, idx)
        return var

    # -- constants ------------------------------------------------------------------------
    def const(self, value, prefix, rows, cols):
        """A constant matrix of the declaration (one Var per distinct value)."""
        value = np.ascontiguousarray(np.asarray(value, dtype=np.float64))
        key = (prefix, value.shape, value.tobytes())
        if key not in self.consts:
            name = f"{prefix}_{sum(1 for k in self.consts if k[0] == prefix) + 1}"
            self.consts[key] = E.const(name, rows, cols)
            self.const_values[name] = value
        return self.consts[key]

    def seq_const(self, value, prefix, rows, cols):
        """A constant that differs between the sequences of the batch: a per-sequence input."""
        value = np.ascontiguousarray(np.asarray(value, dtype=np.float64))
        key = ("seq", prefix, value.shape, value.tobytes())
        if key not in self.consts:
            name = f"{prefix}_{sum(1 for k in self.consts if k[:2] == ('seq', prefix)) + 1}"
            self.consts[key] = E.matrix(name, rows, cols)
            self.seq_values[name] = value
        return self.consts[key]

    def const_expr(self, value, prefix, rows, cols):
        """value (r × c, r ∈ {1, R}, c ∈ {1, C}) broadcast to rows × cols as an expression."""
        r, c = value.shape[-2:]
        if value.ndim == 3:
            core = self.seq_const(value, prefix.upper(), rows if r > 1 else 1, cols if c > 1 else 1)
        elif r == 1 and c == 1:
            return float(value[0, 0]) * E.ones(rows, cols) if value[0, 0] != 0 else E.zero(rows, cols)
        else:
            core = self.const(value, prefix, rows if r > 1 else 1, cols if c > 1 else 1)
        if r == 1 and not E.same(rows, 1):
            core = E.ones(rows, 1) @ core
        if c == 1 and not E.same(cols, 1):
            core = core @ E.ones(1, cols)
        return core

    # -- materialisation ------------------------------------------------------------------
    def expr(self, block, rows, cols):
        """A block as an expression of shape rows × cols (its own shape broadcast there)."""
        if isinstance(block, Masked):
            raise self.fail("an attention mask reaches an operation other than softmax; only "
                            "masked logits going into a softmax can be declared")
        if isinstance(block, Fn):
            e = S.apply_fn(block.f, block.base)
        elif isinstance(block, Lin):
            hit = self.memo.get(id(block))
            if hit is not None and hit[0] is block:
                e = hit[1]
            else:
                e = self._lin(block, rows)
                self.memo[id(block)] = (block, e)
        else:                                                  # pragma: no cover - internal
            raise RuntimeError(f"unknown block {block!r}")
        if E.same(e.rows, 1) and not E.same(rows, 1):
            e = E.ones(rows, 1) @ e
        if E.same(e.cols, 1) and not E.same(cols, 1):
            e = e @ E.ones(1, cols)
        return e

    def _lin(self, lin, rows):
        terms = [self._term(t, rows) for t in _merged(lin.terms)]
        terms = [t for t in terms if t is not None]
        if not terms:
            raise self.fail("a tensor is identically zero")      # pragma: no cover
        return E.add(*terms)

    def _term(self, t, rows):
        left = t.left if t.left is not None else E.ones(rows, 1)
        parts = [left]
        if t.w is not None:
            idx, a, c = np.asarray(t.w.idx), t.a, t.c
            if a is not None:
                nz = np.flatnonzero(np.any(a != 0, axis=0))
                idx, a = idx[nz, :], a[:, nz]
                a = None if S.is_identity(a) else a
            if c is not None:
                nz = np.flatnonzero(np.any(c != 0, axis=1))
                idx, c = idx[:, nz], c[nz, :]
                c = None if S.is_identity(c) else c
            if idx.size == 0:
                return None
            if a is not None:
                parts.append(self.const(a, "R", self.size(a.shape[0]), self.size(a.shape[1])))
            parts.append(self.piece(t.w.name, idx))
            if c is not None:
                parts.append(self.const(c, "R", self.size(c.shape[0]), self.size(c.shape[1])))
        elif t.c is not None:
            if t.left is None:
                parts = [E.ones(rows, 1), self.const(t.c, "c", 1, self.size(t.c.shape[1]))]
            else:
                parts = [self.columns(left, t.c)]
        e = E.matmul(*parts)
        return e if t.k == 1 else E.scale(_num(t.k), e)

    def columns(self, e, c):
        """e · c for a numeric c: a column selection is pushed into entrywise operations,
        Hadamard products, sums and a product's last factor; what is left is a constant
        (n × m, never n × n for a head's n/H columns)."""
        nz = np.flatnonzero(np.any(c != 0, axis=1))
        rest = c[nz, :]
        if len(nz) < c.shape[0]:
            e = self._select(e, nz)
        if S.is_identity(rest):
            return e
        return e @ self.const(rest, "R", self.size(rest.shape[0]), self.size(rest.shape[1]))

    def _select(self, e, cols):
        m = self.size(len(cols))
        if isinstance(e, E.Elementwise):
            return E.elementwise(e.fn, self._select(e.args[0], cols))
        if isinstance(e, (E.Hadamard, E.Add)):
            return e.rebuild(tuple(self._select(a, cols) for a in e.args))
        if isinstance(e, E.Scale):
            return E.scale(e.coef, self._select(e.args[0], cols))
        if isinstance(e, E.Ones):
            return E.ones(e.rows, m)
        if isinstance(e, E.MatMul) and isinstance(e.args[-1], E.Ones):
            return E.matmul(*e.args[:-1], E.ones(e.args[-1].rows, m))
        if isinstance(e, E.MatMul) and isinstance(e.args[-1], E.Var) and e.args[-1].role == "const":
            v = self.const_values[e.args[-1].name][:, cols]
            return E.matmul(*e.args[:-1], self.const(v, e.args[-1].name.split("_")[0], e.args[-1].rows, m))
        n = int(sp.sympify(e.cols).subs({s: k for k, s in self.size_syms.items()})) \
            if not sp.sympify(e.cols).is_number else int(e.cols)
        return e @ self.const(S.select(n, cols), "S", e.cols, m)


# ----------------------------------------------------------------------------- the driver
def capture(module, args, kwargs=None, batch_dim=None) -> Capture:
    """Export ``module(*args, **kwargs)`` and translate its graph (module docstring)."""
    import torch
    from torch.utils import _pytree as pytree
    from .aten_ops import OPS, VIEWS, op_name

    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if x is None or not x.is_floating_point():
        raise DeclarationError("from_module needs the hidden states as the first tensor "
                               "argument of example_inputs (a floating tensor (B, L, d) or (L, d))")
    if x.ndim not in (2, 3):
        raise DeclarationError(f"the hidden states must have shape (B, L, d) or (L, d), got "
                               f"{tuple(x.shape)}")
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
    params = dict(m.named_parameters())
    ctx = Context(params, torch.float64)
    ctx.caller_dtype = x.dtype
    bdim = _batch_dim(module, x, batch_dim)
    X, xsym, x_kinds = _input(ctx, x, bdim)
    inputs = iter((v, "X" if v is x64 else None) for v in flat)
    spec = {s.arg.name: s for s in ep.graph_signature.input_specs}
    env, out = {}, None
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            env[node] = _placeholder(ctx, ep, spec[node.name], inputs, xsym, params)
        elif node.op == "call_function":
            ctx.where = _where(node)
            a = _map(node.args, env)
            k = _map(node.kwargs, env)
            env[node] = _dispatch(ctx, node, a, k, OPS, VIEWS, op_name)
        elif node.op == "output":
            out = _map(node.args[0], env)
        elif node.op == "get_attr":
            env[node] = getattr(ep.graph_module, node.target)
    ctx.where = ""
    return _result(ctx, out, X, x_kinds, x)


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


def _placeholder(ctx, ep, spec, inputs, xsym, params):
    import torch
    kind = spec.kind.name
    if kind == "PARAMETER":
        t = params[spec.target]
        idx = torch.arange(t.numel()).reshape(t.shape)
        return Piece(spec.target, idx, t.detach())
    if kind == "BUFFER":
        return ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
    if kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
        return ep.constants[spec.target]
    value, mark = next(inputs)
    if mark == "X":
        return xsym
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


def _where(node):
    """'module path, file:line: code' of a node, from torch.export's metadata."""
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    path = path.replace("L['self'].", "").replace("L['self']", "") or "the module"
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    line = ""
    for i in range(len(trace) - 1, -1, -1):
        if trace[i].strip().startswith("File "):
            loc = trace[i].strip()
            code = trace[i + 1].strip() if i + 1 < len(trace) else ""
            f = loc.split('"')[1] if '"' in loc else loc
            ln = loc.split("line ")[1].split(",")[0] if "line " in loc else "?"
            line = f"{f.rsplit('/', 1)[-1]}:{ln}: {code}"
            break
    return f"in {path}" + (f", {line}" if line else "")


def _op_label(node):
    from .aten_ops import op_name
    return op_name(node.target)


def _result(ctx, out, X, x_kinds, x):
    """The Capture of a translated graph."""
    sym = next((v for v in _leaves(out) if isinstance(v, Sym)), None)
    if sym is None:
        raise DeclarationError("the module's output does not depend on its input (the hidden states)")
    if sym.row is None or sym.row.kind != "pos":
        raise DeclarationError("the module's output is not one row per token; symhess declares "
                               "outputs of shape (B, L, d)")
    from . import symops as O
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
                   {str(s): n for n, s in ctx.size_syms.items()}, ctx.cast_eps)


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


def _merged(terms):
    """Terms that differ only in their right constant merged, k₁ U W c₁ + k₂ U W c₂ =
    U W (k₁c₁ + k₂c₂): rotate_half's two halves of a head's query are one piece of W_Q times
    a signed permutation, not two pieces."""
    groups, order = {}, []
    for t in terms:
        key = (t.left, None if t.a is None else (t.a.shape, t.a.tobytes()),
               None if t.w is None else (t.w.name, np.asarray(t.w.idx).shape,
                                         np.asarray(t.w.idx).tobytes()))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(t)
    out = []
    for key in order:
        ts = groups[key]
        if len(ts) == 1 or _width(ts[0]) is None:
            out.append(ts[0])
            continue
        n = _width(ts[0])
        c = sum(t.k * (t.c if t.c is not None else np.eye(n)) for t in ts)
        out.append(Term(ts[0].left, ts[0].a, ts[0].w, c, 1.0))
    return [t for key in order if len(groups[key]) > 1 and _width(groups[key][0]) is None
            for t in groups[key][1:]] + out


def _width(t):
    if t.w is not None:
        return np.asarray(t.w.idx).shape[1]
    return t.c.shape[0] if t.c is not None else None


def _num(k):
    return S.nice(float(k))


def _ident(name):
    out = "".join(ch if ch.isalnum() else "_" for ch in name).strip("_") or "p"
    return out if not out[0].isdigit() else "p" + out


def _param_tex(name, k, ndim):
    parts = name.split(".")
    leaf, path = parts[-1], ".".join(parts[:-1])
    sub = path.replace("_", r"\_")
    if leaf == "weight":
        base = r"\mathbf W" if ndim >= 2 else r"\boldsymbol\gamma"
    elif leaf == "bias":
        base = r"\mathbf b"
    else:
        base = r"\mathbf{" + leaf.replace("_", r"\_") + "}"
    tex = base + (rf"_{{\mathrm{{{sub}}}}}" if sub else "")
    return tex + (rf"^{{({k})}}" if k is not None else "")


__all__ = ["capture", "Capture", "Piece", "Context"]

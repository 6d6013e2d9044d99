"""The translation context of graph capture: the declaration being built.

``Context`` holds what the translation of one graph accumulates — the declared dimensions
(one symbol per concrete feature size: d, d_h, d_ff, d_2 …), the declared parameters (each a
``Piece`` of a module parameter; pieces of one module parameter may not overlap), constants
(one ``const`` Var per distinct value; per-sequence inputs where a constant differs between
the sequences of the batch), the dtype casts made identities, LayerNorm batch checks, and the
node being translated (``where``: module path and source line, in every error).  Its
``expr`` turns a lazy block (``tensor.Lin``, ``Fn``) into an expression: the columns a head
reads become the declared parameter (a d × d_h piece, never a d × d projector), and what
is left of the column bookkeeping is a constant.

Errors are ``DeclarationError`` s (``Context.fail``) ending with the node's provenance.
"""
from __future__ import annotations

import operator

import numpy as np
import sympy as sp

from ...expr import nodes as E
from ...errors import DeclarationError
from . import tensor as S
from .tensor import Fn, Lin, Masked, Term


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
        self.where = ""           # the node being translated: module path, file:line: code
        self.op = ""              # … and its ATen op
        self.memo = {}            # id(Lin) → (Lin, expression)
        self.softmaxes = []       # (T, A) of every softmax, in graph order
        self.caller_dtype = None
        self.cast_eps = 0.0
        self.xsym = None          # the data X as a symbolic tensor (its row atom: the positions)
        self.ids = None           # the example's token ids (a language model's data), or None
        self.loss = None          # the loss the model computes itself (a registered name)

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
            self.casts.append(f"{op_name(node.target)} to {str(dt).replace('torch.', '')} ({self.where})")

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
        """The refusal of the node being translated: its ATen op, the message, and where the
        node comes from (module path, file:line: code)."""
        if self.op and not msg.startswith(self.op):
            msg = f"{self.op}: {msg}"
        return DeclarationError(f"{msg} ({self.where})" if self.where else msg)

    # -- parameters ------------------------------------------------------------------------
    def piece(self, name, idx, pos=False):
        """The declared parameter for the entries ``idx`` (2-D) of module parameter ``name``:
        an earlier piece with the same entries (or its transpose), else a new one; ``pos``:
        its rows are the token positions (L rows)."""
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
        rows = self.L if pos else (self.size(idx.shape[0]) if idx.shape[0] > 1 else 1)
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
        parts = [left] if t.w is None or not t.w.pos else []
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
            parts.append(self.piece(t.w.name, idx, t.w.pos))
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


# ----------------------------------------------------------------------------- provenance
PYTHON_OPS = {operator.getitem: "<built-in function getitem>"}


def op_name(target) -> str:
    """The ATen op's name of a graph node's target (``aten.linear.default``)."""
    return PYTHON_OPS.get(target, str(target))


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


# ----------------------------------------------------------------------------- helpers
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

"""Jacobians ∂vec_r F/∂vec_r W_p in compact form, read off their index networks.

The networks of a Jacobian have three output groups: the batch label (empty when F does
not read the data), F's index atoms (rows) and W_p's (columns).

* **compact axes.**  Two row/column positions share an axis when every network carries
  the same label at both (a Kronecker delta common to the whole sum): the LayerNorm input
  Jacobian, rows (i, a) and columns (i, b), is J_c[i, a, b], an L×d×d array.
* **factors.**  A single network is returned as its operands grouped into connected
  components through their summed labels, each contracted to the compact axes it carries:
  the FFN W_1 Jacobian X[i,b]·σ'(H)[i,k]·W_2[k,a] stays three small factors.  A sum of
  networks is one factor, the compact tensor itself.

``CompactJacobian.dense()`` expands to (N,) numel F × numel W_p (axes no factor carries hold
the value 1).  The factors, ``tensor()`` and ``dense()`` are checked once for NaN/inf
(``runtime.checks.finite``): finite values that overflow are an ``InputError`` naming the cause.
"""
from __future__ import annotations

from . import checks
from . import contract as C
from . import network as N


class CompactJacobian:
    """J[rows, cols] = Π_f factors[f][axes_f] where positions sharing an axis agree, else 0.

    ``row_axes``/``col_axes``: the compact axis of each atom of F / W_p; ``shape``: the
    compact shape; ``axes[f]``: the compact axes of ``factors[f]`` (after a leading batch axis
    when ``batched``)."""

    def __init__(self, state, nets, numel_f, numel_w, per_sequence, what="the Jacobian"):
        self.state, self.nets, self.what = state, list(nets), what
        self.numel_f, self.numel_w, self.per_sequence = numel_f, numel_w, per_sequence
        self.batched = bool(self.nets and self.nets[0].groups[0])
        if not self.nets:
            self.row_axes, self.col_axes, self.shape, self.axes, self.factors = (), (), (), (), ()
            return
        first = self.nets[0]
        pos = list(first.groups[1]) + list(first.groups[2])
        n_rows = len(first.groups[1])
        per_net = [list(n.groups[1]) + list(n.groups[2]) for n in self.nets]
        cls = []
        for i in range(len(pos)):
            same = next((cls[j] for j in range(i) if all(p[i] == p[j] for p in per_net)), None)
            cls.append(same if same is not None else max(cls, default=-1) + 1)
        self.row_axes, self.col_axes = tuple(cls[:n_rows]), tuple(cls[n_rows:])
        self.shape = tuple(first.sizes[pos[cls.index(k)]] for k in range(max(cls) + 1))
        if len(self.nets) == 1 and len(N.resolve(state, self.nets[0], (0, 1, 2))) == 1:
            self.axes, self.factors = self._components(self.nets[0], per_net[0], cls)
        else:
            self.axes, self.factors = (tuple(range(len(self.shape))),), (self._summed(per_net, cls),)
        for f in self.factors:
            self._finite(f)

    def _finite(self, a):
        return checks.finite(a, self.what, self.state._values, self.state.like)

    def __repr__(self):
        return (f"<CompactJacobian shape {self.shape}, rows → axes {self.row_axes}, "
                f"columns → axes {self.col_axes}, factors over {self.axes}>")

    def _axis_labels(self, labels, cls):
        """The label of each compact axis in one network."""
        return [labels[cls.index(k)] for k in range(len(self.shape))]

    def _summed(self, per_net, cls):
        st = self.state
        lead = [st.n_batch] if self.batched else []
        acc = None
        for n, labels in zip(self.nets, per_net):
            out = tuple(n.groups[0]) + tuple(self._axis_labels(labels, cls))
            m = N.Net(n.coef, n.ops, n.labels, (out,), n.sizes)
            acc = N.accumulate(st, m, (0,), acc, lead + list(self.shape))
        return acc

    def _components(self, n, labels, cls):
        """(axes, factors) of one network: operands joined through summed labels."""
        st = self.state
        (m,) = N.resolve(st, n, (0, 1, 2))
        axis_of = {lab: k for k, lab in enumerate(self._axis_labels(labels, cls))}
        batch = set(m.groups[0])
        keep = set(axis_of) | batch
        axes, factors = [], []
        for gi, members in enumerate(N.components(m.labels, lambda lab: lab not in keep)):
            carried = [lab for lab in axis_of if any(lab in m.labels[i] for i in members)]
            carried.sort(key=axis_of.get)
            has_batch = any(b in m.labels[i] for i in members for b in batch)
            out = (tuple(batch) if has_batch else ()) + tuple(carried)
            r = C.contract(st.ops, [m.ops[i] for i in members], [m.labels[i] for i in members],
                           out, st.schedule.limit, m.sizes)
            if gi == 0:
                r = r * m.coef
            if self.batched and not has_batch:
                r = st.ops.reshape(r, [1] + list(st.ops.shape(r)))
            axes.append(tuple(axis_of[lab] for lab in carried))
            factors.append(r)
        return tuple(axes), tuple(factors)

    def tensor(self):
        """The compact tensor: the factors' product broadcast over every compact axis."""
        st = self.state
        nl = 1 if self.batched else 0
        out = None
        for ax, f in zip(self.axes, self.factors):
            order = sorted(range(len(ax)), key=lambda i: ax[i])
            f = st.ops.transpose(f, list(range(nl)) + [nl + i for i in order])
            shape = list(st.ops.shape(f)[:nl]) + [self.shape[k] if k in ax else 1
                                                  for k in range(len(self.shape))]
            f = st.ops.reshape(f, shape)
            out = f if out is None else out * f
        full = ([st.n_batch] if nl else []) + list(self.shape)
        return self._finite(out + st.ops.zeros(full, like=st.like))

    def dense(self):
        """(N,) numel F × numel W_p, per sequence when the data carry a batch axis."""
        st = self.state
        if not self.nets:
            z = st.ops.zeros((self.numel_f, self.numel_w), like=st.like)
            return _per_sequence(st, z, self.per_sequence, False)
        groups = (0, 1, 2) if self.batched else (1, 2)
        out = self._finite(N.dense(st, self.nets, groups))
        return _per_sequence(st, out, self.per_sequence, self.batched)


def _per_sequence(st, a, per_sequence, batched):
    """One Jacobian per sequence when the values were batched, one otherwise."""
    if batched and not per_sequence:
        return a[0]
    if per_sequence and not batched:
        shape = (st.n_batch,) + tuple(a.shape)
        return a.expand(*shape) if hasattr(a, "expand") else _broadcast(a, shape)
    return a


def _broadcast(a, shape):
    import numpy as np
    return np.broadcast_to(a, shape)


__all__ = ["CompactJacobian"]

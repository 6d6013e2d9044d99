"""Whole language models as declared layers: a model called on token ids with its own loss.

``symhess.from_module(model, (), {"input_ids": ids, "labels": ids, "use_cache": False})``
captures a causal language model (``GPT2LMHeadModel`` built from a config) with the loss it
computes itself and returns a ``LanguageModelLayer``:

* the data X of a sequence is the one-hot matrix of its token ids (L × V, V the rows of the
  token embedding table W_E), so the token embedding is X W_E with W_E one declared parameter
  (V × d); position ids 0 … L − 1 read the rows of the position table as one L × d parameter
  P (its other rows are not part of the declaration); a tied LM head reads W_E again
  (logits U W_Eᵀ): one parameter used twice, never two copies;
* the declaration's output is the logits F (L × V), and the model's loss is the declared
  loss ``ce_weighted`` on it, the cross-entropy whose weights are the targets' entries:

      ℓ = −Σ_{i,j} Y_ij log softmax(F_i)_j,   Y_i = (N/T) one-hot(label_{i+1}),  Y_L = 0,

  with Y_i = 0 where label_{i+1} is ignored (−100); the kernels average ℓ over the N
  sequences of a batch, so the batch's loss is (1/T) Σ −log p(label_{i+1} | tokens ≤ i) over
  its T labelled next-token targets — transformers' causal LM loss exactly (T = N (L − 1)
  when the labels are the ids).  The output is the logits
  (not the scalar loss) so that the Gauss–Newton split is the usual one, H = Jᵀ H_ℓ J + Σ G ∂²F:
  the outer part is the generalised Gauss–Newton matrix of the cross-entropy over the
  logits, the functional part the rest;
* everything computed from neither the parameters nor the token ids' values (the causal mask
  built from position ids by ``arange``, ``cumsum``, ``diff``, ``index`` …) is a constant;
  an op that reads the ids' values (a mask made from a padding id) is refused by name.

Batches are token ids (``batch``, ``batches``): a tensor (N, L), a dict with ``input_ids``
(as a DataLoader over a tokenised dataset yields; ``position_ids`` 0 … L − 1 if present,
``labels`` and ``attention_mask`` optional), or (ids,) / (ids, labels); X follows the ids, Y
the labels (the ids when there are none; −100 entries ignored, as transformers' loss ignores
them).  The position parameter P binds L to the example's length.

Padding.  Captured on an example whose ``attention_mask`` pads its sequences to different
lengths, the model's mask is a per-sequence input M (L × L) of the declaration; the capture
checks that it is M_n[i, j] = [j ≤ i] · mask_n[j] (``causal_padding``), and every batch gives
its own from its ``attention_mask`` (all ones when absent), so batches of any size and
padding go in.  The first token of every sequence must be kept (right padding: with it
padded, a row of the padding has no key, a 0/0 softmax).  Captured without padding, the mask
is the causal one and a padded batch is refused.

Means.  One batch (``batch``): N/T with the batch's own N and T, so the loss, gradient and
Hessian are those of the model's loss on that batch.  A dataset (``batches``): N/T with N
and T counted over the whole data in a first pass over its labels, so with the kernels'
weighting of batches by their sequences (``symhess.curvature.dataset``: N_b/N) every result
is token-weighted — the model's loss on all the data's labelled targets at once,
(1/T) Σ over every labelled target of every batch, as transformers' Trainer takes it when it
accumulates batches (``num_items_in_batch``) — not the mean of the batches' means, which
differs from it when batches hold different numbers of labelled targets.
"""
from __future__ import annotations

import math

from ..calculus.losses import loss
from ..errors import DeclarationError, InputError
from ..expr import nodes as E
from .modules import (CALL_KINDS, CAST_TOLERANCE, CHECK_TOLERANCE, ModuleLayer, _Mapped, _as_torch,
                      _rel, no_downcasts)
from .hooks import reusable


IGNORE_INDEX = -100            # a label transformers' loss skips (its ignore_index)


@loss("ce_weighted")
def ce_weighted(f, y):
    """ℓ = −Σ_ij Y_ij log softmax(F_i)_j: Y_i a weighted one-hot target, 0 where none."""
    return E.scale(-1, E.sum_all(E.hadamard(y, E.log_softmax_rows(f))))


def ids_of_call(args, kwargs):
    """The token ids of a call (an integer first tensor, or ``input_ids``), or None."""
    import torch
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None:
        return None if first.is_floating_point() else first
    t = kwargs.get("input_ids")
    return t if isinstance(t, torch.Tensor) and not t.is_floating_point() else None


class LanguageModelLayer(ModuleLayer):
    """A language model on token ids with its own loss (module docstring); ``loss`` is the
    registered name of that loss (``sh.kernel(ml.layer, "torch", ml.loss)``)."""

    def __init__(self, module, cap, args, kwargs, ids):
        super().__init__(module, cap, args, kwargs)
        self._x = ids
        self.vocab = int(cap.dims["V"])
        self.length = int(ids.shape[-1])
        self.loss = cap.loss
        self.masks = padding_masks(cap, kwargs.get("attention_mask"), type(module).__name__)

    # -- data ---------------------------------------------------------------------------
    def ids(self, b):
        """A batch's token ids as an (N, L) integer tensor, its other fields checked."""
        return self.read(b)[0]

    def read(self, b):
        """A batch's token ids and labels, (N, L) integer tensors each (the labels are the ids
        when the batch has none), every field checked."""
        return self.fields(b)[:2]

    def fields(self, b):
        """(ids, labels, attention_mask or None) of a batch, checked (``read``)."""
        import torch
        labels = mask = None
        if isinstance(b, dict):
            if "input_ids" not in b:
                raise InputError(f"a batch dict needs input_ids, got keys {', '.join(map(str, b))}")
            ids = _as_torch(b["input_ids"])
            labels = b.get("labels")
            mask = b.get("attention_mask")
            if self.masks:
                self._check_field(mask, ids, "attention_mask", lambda t: bool(
                    ((t == 0) | (t == 1)).all() and (t.reshape(-1, t.shape[-1])[:, 0] == 1).all()),
                    "0 or 1 with the first token of every sequence kept (right padding: "
                    "with the first token padded, the rows of the padding attend to no key)")
            else:
                self._check_field(mask, ids, "attention_mask", lambda t: bool((t == 1).all()),
                                  "all ones: the model was captured without padding (its mask "
                                  "is the causal one); capture it on an example whose sequences "
                                  "are padded to different lengths to give padded batches")
            self._check_field(b.get("position_ids"), ids, "position_ids",
                              lambda t: bool((t == torch.arange(ids.shape[-1])).all()),
                              f"0 … {ids.shape[-1] - 1} in every sequence (what was captured)")
        elif isinstance(b, (tuple, list)):
            if not 1 <= len(b) <= 2:
                raise InputError(f"a batch must be ids, (ids,) or (ids, labels), got a "
                                 f"{type(b).__name__} of {len(b)}")
            ids = _as_torch(b[0])
            labels = b[1] if len(b) == 2 else None
        else:
            try:
                ids = _as_torch(b)
            except (TypeError, ValueError, RuntimeError):
                raise InputError(f"token ids must be an integer tensor (N, L), got "
                                 f"{type(b).__name__}") from None
        ids = self._tokens(ids, "token ids")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            raise InputError(f"token ids must lie in 0 … {self.vocab - 1} (the vocabulary), got "
                             f"{int(ids.min())} … {int(ids.max())}")
        if mask is not None:
            mask = _as_torch(mask).reshape(-1, ids.shape[-1])
            if mask.shape[0] not in (1, ids.shape[0]):
                raise InputError(f"attention_mask has {mask.shape[0]} rows for {ids.shape[0]} "
                                 f"sequences of ids")
            mask = mask.expand(ids.shape[0], -1)
        if labels is None:
            return ids, ids, mask
        labels = self._tokens(_as_torch(labels), "labels")
        if labels.shape != ids.shape:
            raise InputError(f"labels must have the ids' shape {tuple(ids.shape)}, got "
                             f"{tuple(labels.shape)}")
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= self.vocab))
        if bool(bad.any()):
            raise InputError(f"labels must lie in 0 … {self.vocab - 1} (the vocabulary) or be "
                             f"{IGNORE_INDEX} (ignored), got {int(labels[bad][0])}")
        return ids, labels, mask

    def _tokens(self, t, what):
        """An (N, L) long tensor of ``what`` (ids or labels) of the captured length."""
        import torch
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise InputError(f"{what} must be integers, got {t.dtype}")
        if t.ndim == 1:
            t = t[None]
        if t.ndim != 2:
            raise InputError(f"{what} must have shape (N, L) or (L,), got {tuple(t.shape)}")
        if t.shape[1] != self.length:
            raise InputError(f"the {what} have {t.shape[1]} tokens but the model was captured "
                             f"with {self.length}: its position parameter holds rows 0 … "
                             f"{self.length - 1}; capture it with an example of the data's length")
        return t.long()

    @staticmethod
    def _check_field(t, ids, name, ok, what):
        if t is None:
            return
        t = _as_torch(t)
        if t.ndim == 0 or t.shape[-1] != ids.shape[-1] or t.ndim > max(ids.ndim, 2) or not ok(t):
            raise InputError(f"{name} must be {what}")

    @staticmethod
    def targets(labels, vocab):
        """(Y, T): Y (N, L, V) with row i the one-hot of label i + 1 (0 where that label is
        ignored, and in the last row), T the number of labelled targets; unweighted."""
        import torch
        nxt = labels[:, 1:]
        keep = nxt != IGNORE_INDEX
        Y = torch.zeros(labels.shape + (vocab,), dtype=torch.float64)
        Y[:, :-1] = torch.nn.functional.one_hot(nxt.clamp(min=0), vocab).to(torch.float64) * keep[..., None]
        return Y, int(keep.sum())

    def batch(self, x, y=None, weight=None) -> dict:
        """X (N, L, V): the one-hot token ids; Y (N, L, V): row i the one-hot of label i + 1
        times ``weight`` (default N/T, T the batch's labelled targets: the model's loss on
        this batch), 0 where it is ignored and in the last row (the targets of
        ``ce_weighted``); for a model captured with padding, its masks (N, L, L) from the
        batch's attention_mask (all ones when absent)."""
        import torch
        ids, labels, mask = self.fields(x if y is None else (x, y))
        X = torch.nn.functional.one_hot(ids, self.vocab).to(torch.float64)
        Y, T = self.targets(labels, self.vocab)
        if weight is None:
            if T == 0:
                raise InputError(f"every next-token label of the batch is ignored "
                                 f"({IGNORE_INDEX}): its loss, a mean over no targets, is 0/0")
            weight = ids.shape[0] / T
        out = {"X": X, "Y": Y * weight}
        if self.masks:
            keep = torch.ones_like(ids) if mask is None else mask
            M = causal_padding(keep)
            out.update({name: M for name in self.masks})
        return out

    def values(self, batch, params=None) -> dict:
        """Every value a kernel needs for a batch of token ids (``params``: as ``params()``)."""
        data = dict(batch) if isinstance(batch, dict) and "X" in batch else self.batch(batch)
        return {**self.params(params), **data}

    def batches(self, data, distributed="auto"):
        """``data`` (a DataLoader or list of token-id batches: tensors, dicts with input_ids
        and optional labels, (ids,) or (ids, labels)) as batches of dicts for
        ``symhess.operator`` / ``Dataset``, their targets weighted N/T with N and T counted
        over all the data (one pass reading its labels): token-weighted results (module
        docstring).  Under ``torch.distributed`` the counts are summed over the processes
        (``distributed`` as ``Dataset``'s: "auto", True, False).  A one-shot iterator is
        refused (every product reads the data again)."""
        reusable(data, "LanguageModelLayer.batches", one_batch="for one batch use batch()")
        n, t = 0, 0
        for b in data:
            ids, labels = self.read(b)
            n += ids.shape[0]
            t += int((labels[:, 1:] != IGNORE_INDEX).sum())
        n, t = _summed(n, t, distributed)
        if t == 0:
            raise InputError(f"every next-token label of the data is ignored ({IGNORE_INDEX}): "
                             f"the mean over no targets is 0/0")
        w = n / t
        return _Mapped(data, lambda b: self.batch(b, weight=w))

    # -- forward --------------------------------------------------------------------------
    def forward(self, ids, params=None):
        """The declaration's logits (N, L, V) for token ids, by the interpreter."""
        import torch
        from ..expr.evaluate import evaluate
        vals = self.params(params)
        data = self.batch(ids)
        data.pop("Y")
        return torch.stack([evaluate(self.layer.output, dict(vals, **{k: v[i] for k, v in data.items()}),
                                     backend="torch") for i in range(data["X"].shape[0])])

    def loss_value(self, ids, params=None):
        """The declared loss (``ce_weighted`` of the declared logits against ``batch``'s Y), the
        mean over the sequences: the model's loss on the batch."""
        import torch
        from ..calculus.losses import get_loss
        from ..expr.evaluate import evaluate
        data = self.batch(ids)
        F = self.forward(ids, params)
        out = self.layer.output
        ell = get_loss(self.loss)(E.matrix("F", out.rows, out.cols), E.matrix("Y", out.rows, out.cols))
        return torch.stack([evaluate(ell, {"F": F[i], "Y": data["Y"][i]}, backend="torch").reshape(())
                            for i in range(F.shape[0])]).mean()

    def module_forward(self, ids, module=None):
        """(loss, logits) of the model's own forward on token ids, called as it was captured."""
        m = self.module if module is None else module
        args, kwargs = self.call_args(ids)
        out = m(*args, **kwargs)
        lo = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]
        logits = out["logits"] if isinstance(out, dict) or hasattr(out, "keys") else out[1]
        return lo, logits

    def call_args(self, ids):
        """(args, kwargs) of the captured call with the token ids (and labels) replaced."""
        from torch.utils import _pytree as pytree
        new = self.ids(ids)
        return pytree.tree_map(lambda t: new if t is self._x else t, (self.args, self.kwargs))

    def __repr__(self):
        return (f"<symhess language model {self.layer.name}: {type(self.module).__name__}, "
                f"{len(self.layer.params)} declared parameters, loss {self.loss}>")


def causal_padding(keep):
    """M (N, L, L): M_n[i, j] = 1 when j ≤ i and token j of sequence n is kept (the causal
    mask of a padded batch, as transformers builds it from ``attention_mask``), float64."""
    import torch
    L = keep.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return (causal[None] & keep.bool()[:, None, :]).to(torch.float64)


def padding_masks(cap, mask, name) -> tuple:
    """The names of the declaration's per-sequence masks when the model was captured with a
    padding ``attention_mask``: each must be ``causal_padding`` of it (else the model's mask
    is something the batches cannot rebuild, refused); a mask shared by every sequence (the
    example's sequences padded alike) is refused too — it would be a constant of the
    declaration, the same for every sequence."""
    import numpy as np
    if mask is None:
        return ()
    keep = _as_torch(mask).reshape(-1, _as_torch(mask).shape[-1])
    if bool((keep == 1).all()):
        return ()
    shared = sorted(n for n in cap.consts if n.startswith("M_"))
    if shared:
        raise DeclarationError(f"{name}: the example's sequences are padded alike, so its "
                               f"attention mask is one constant of every sequence; capture it on "
                               f"an example whose sequences are padded to different lengths")
    want = causal_padding(keep.expand(cap.example_batch, -1)).numpy()
    out = []
    for n, v in sorted(cap.seq_consts.items()):
        if not (n.startswith("M_") and np.asarray(v).shape == want.shape and np.array_equal(v, want)):
            raise DeclarationError(f"{name}: the per-sequence constant {n} is not the causal "
                                   f"mask of the example's attention_mask (j ≤ i and token j "
                                   f"kept); it cannot be rebuilt from the batches")
        out.append(n)
    return tuple(out)


def _summed(n, t, distributed):
    """(N, T) summed over the processes of an initialised torch.distributed group (unless
    ``distributed`` is False), as ``Dataset`` sums its batches' weights."""
    import torch
    if distributed not in ("auto", True, False):
        raise InputError(f"distributed must be 'auto', True or False, got {distributed!r}")
    dist = torch.distributed if torch.distributed.is_available() else None
    if distributed is False or dist is None or not dist.is_initialized():
        if distributed is True:
            raise InputError("distributed=True but torch.distributed is not initialised")
        return n, t
    both = torch.tensor([n, t], dtype=torch.float64)
    dist.all_reduce(both)
    return int(both[0]), int(both[1])


def from_language_model(module, args, kwargs, ids, check=True) -> LanguageModelLayer:
    """The declared layer of a language model called on token ids with labels (module
    docstring); ``check``: compare the declared logits and loss with the model's."""
    import torch
    from .capture import capture
    from .modules import _OF_LAYER
    if ids.ndim not in (1, 2) or ids.shape[-1] < 2:
        raise DeclarationError(f"token ids of shape {tuple(ids.shape)}: a language model is "
                               f"captured on (B, L) or (L,) ids with at least 2 tokens (its "
                               f"next-token loss of one token predicts nothing)")
    with torch.no_grad():
        cap = capture(module, args, kwargs, None, ids=ids)
    ml = LanguageModelLayer(module, cap, args, kwargs, ids)
    _OF_LAYER[ml.layer] = ml
    if check:
        _check(ml)
    return ml


def _check(ml):
    """Declared logits and loss against the model's, float64, on the example ids and on random
    ids of their shape (with the example's attention_mask): under ``no_downcasts`` to 1e-10, as the model is (its float32 loss)
    to ``CAST_TOLERANCE`` ε of float32."""
    import copy
    import torch
    m = ml.module
    if any(p.dtype != torch.float64 for p in m.parameters()):
        m = copy.deepcopy(m).to(torch.float64)
    g = torch.Generator().manual_seed(0)
    x0 = ml.ids(ml._x)
    xs = [x0, torch.randint(0, ml.vocab, tuple(x0.shape), generator=g)]
    if ml.masks:                # the example's padding with both: the call's attention_mask
        xs = [{"input_ids": x, "attention_mask": ml.kwargs["attention_mask"]} for x in xs]
    strict, loose = 0.0, 0.0
    with torch.no_grad():
        for x in xs:
            F, ell = ml.forward(x, params=m), ml.loss_value(x, params=m)
            with no_downcasts():
                want_l, want_F = ml.module_forward(x, m)
            strict = max(strict, _rel(F, want_F.reshape(F.shape)), _rel(ell, want_l))
            if ml.casts:
                loose = max(loose, _rel(ell, ml.module_forward(x, m)[0].to(torch.float64)))
    name = type(ml.module).__name__
    if not math.isfinite(strict) or strict > CHECK_TOLERANCE:
        raise DeclarationError(f"{name}: the captured declaration's logits or loss differ from the "
                               f"model's (relative error {strict:.2e} > {CHECK_TOLERANCE:g})")
    if ml.casts:
        tol = CAST_TOLERANCE * ml.capture.cast_eps
        if not math.isfinite(loose) or loose > tol:
            raise DeclarationError(f"{name}: with its dtype casts ({ml.casts[0]} …) the model's "
                                   f"loss differs from the declared one by {loose:.2e} (> {tol:.1e})")
    ml.forward_error, ml.cast_error = strict, loose


CALL_KINDS.append((ids_of_call, from_language_model))

__all__ = ["LanguageModelLayer", "from_language_model", "ce_weighted", "IGNORE_INDEX"]

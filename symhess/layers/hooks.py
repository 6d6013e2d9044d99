"""Data from a model's own forward: the inputs one of its submodules receives.

A block captured on its own (``from_module(model.transformer.h[1], args, kwargs)``) is
evaluated on the hidden states the whole model feeds it:

* ``submodule_call(model, submodule, batch)`` runs ``model`` on one batch with a forward
  pre-hook on ``submodule`` and returns the (args, kwargs) of its first call — hidden
  states, masks, rotary ``position_embeddings``, position ids, flags, exactly as the model
  passes them — the call to capture the block with;
* ``HookedBatches`` (``ModuleLayer.batches_from(model, data, targets)``) does the same for
  every batch of ``data`` each time it is iterated (one batch in memory at a time, as
  ``ModuleLayer.batches``; a one-shot iterator is refused) and yields the block's batches
  {X, Y (, per-sequence constants)} for ``symhess.operator`` / ``Dataset``.

The hook stops the model's forward once the submodule's inputs are read (the rest of the
model is not run), under ``torch.no_grad``; the model runs as it is (its dtype casts
included): the hidden states are what it computes.

**The constants.**  The declaration holds what the captured call passed besides the hidden
states (masks, rotary cos/sin, everything the block computes from them) as constants.  Each
call read from the model is compared with the captured one argument by argument: tensors
equal in value and shape, other values equal (``None`` for an absent keyword).  A call whose
tensors differ (an attention mask built for another batch size, but the same mask) is
accepted when the block's own forward on it (under ``no_downcasts``) equals the
declaration's to ``CHECK_TOLERANCE``; otherwise, and for any other difference (a cache
object, another flag), one ``InputError`` line names the argument.

**Targets** Y, in the block's output layout, are ``targets``:

* ``"output"``: the block's own output on the call (under ``no_downcasts``, so F(θ₀) = Y to
  rounding): the layer-wise reconstruction loss ‖F(θ) − F(θ₀)‖², whose gradient is 0 at θ₀
  and whose Hessian there is its Gauss–Newton part (the curvature that pruning and
  quantisation by layer-wise reconstruction use);
* a callable ``targets(output, batch)`` → Y: anything computed from that output and the
  model's batch (a distillation target, a perturbed output);
* ``None``: X only (for quantities that read no Y: Jacobians, the outer part of losses whose
  outer Hessian is free of Y).

Cost per batch and pass: the model's forward up to the submodule, the block's forward for
``"output"`` targets, and for calls that differ from the captured one the declaration's
forward (the interpreter) besides.
"""
from __future__ import annotations


from ..errors import InputError
from .precision import CHECK_TOLERANCE, first_tensor as _first_tensor, no_downcasts, rel as _rel

TARGETS = ("output", "a callable targets(output, batch)", "None")


class _Stop(Exception):
    """Raised by the pre-hook once the submodule's inputs are read: the forward ends there."""


def run_model(model, batch, call=None):
    """``call(model, batch)``, or the model on the batch: a dict as keywords, a tuple or list
    as positional arguments, anything else as the one argument."""
    if call is not None:
        return call(model, batch)
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def path_of(model, submodule) -> str:
    """``submodule``'s name inside ``model`` ("" for the model itself)."""
    from torch import nn
    if not isinstance(model, nn.Module) or not isinstance(submodule, nn.Module):
        raise InputError(f"expected torch modules (the model and one of its submodules), got "
                         f"{type(model).__name__} and {type(submodule).__name__}")
    for name, mod in model.named_modules(remove_duplicate=False):
        if mod is submodule:
            return name
    raise InputError(f"the {type(submodule).__name__} is not a submodule of the "
                     f"{type(model).__name__} (pass the model that holds it, e.g. the one "
                     f"model.transformer.h[1] was taken from)")


def submodule_call(model, submodule, batch, call=None):
    """(args, kwargs) of ``submodule``'s first call when ``model`` runs on ``batch`` (module
    docstring); ``call(model, batch)`` runs the model when given."""
    import torch
    where = path_of(model, submodule) or "the model"
    seen = []

    def hook(mod, args, kwargs):
        seen.append((args, dict(kwargs)))
        raise _Stop

    handle = submodule.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            run_model(model, batch, call)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        raise InputError(f"the {type(model).__name__}'s forward on the batch never called "
                         f"{where}")
    return seen[0]


# ----------------------------------------------------------------------------- comparison
def _leaves(args, kwargs, x_at):
    """{argument name: value} of a call's arguments other than the hidden states (positional
    ``x_at``), nested tuples and lists named by index (``position_embeddings[0]``)."""
    out = {}

    def walk(name, v):
        if isinstance(v, (tuple, list)):
            out[name] = f"a {type(v).__name__} of {len(v)}"
            for i, w in enumerate(v):
                walk(f"{name}[{i}]", w)
        elif isinstance(v, dict):
            out[name] = f"a dict of {', '.join(map(str, v))}"
            for k, w in v.items():
                walk(f"{name}[{k!r}]", w)
        else:
            out[name] = v

    for i, a in enumerate(args):
        if i != x_at:
            walk(f"argument {i}", a)
    for k, v in kwargs.items():
        walk(k, v)
    return out


def _same(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype.is_floating_point == b.dtype.is_floating_point
                and torch.equal(a.to(device=b.device, dtype=b.dtype), b))
    try:
        return bool(a == b) if type(a) is type(b) else False
    except Exception:           # objects without a truth value for ==: the same object only
        return a is b


def _show(v) -> str:
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return f"a {tuple(v.shape)} tensor"
    return type(v).__name__ if not isinstance(v, (bool, int, float, str, type(None))) else repr(v)


def differences(ml, args, kwargs) -> tuple:
    """(tensor arguments that differ, other differences as text) between a call and the one
    ``ml`` was captured with."""
    import torch
    x_at = next(i for i, a in enumerate(ml.args) if a is ml._x)
    got, had = _leaves(args, kwargs, x_at), _leaves(ml.args, ml.kwargs, x_at)
    tensors, other = [], []
    for name in list(had) + [n for n in got if n not in had]:
        a, b = got.get(name), had.get(name)
        if _same(a, b):
            continue
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            tensors.append(name)
        else:
            other.append(f"{name} = {_show(a)} where the capture had {_show(b)}")
    if len(args) != len(ml.args):
        other.insert(0, f"{len(args)} positional arguments where the capture had {len(ml.args)}")
    return tensors, other


def reusable(data, who, one_batch=None, why="every product reads the data again"):
    """``data`` unless it is a one-shot iterator (refused: ``why``) or, with ``one_batch``
    (what to do instead), a single batch (a dict or a tensor) rather than a collection."""
    from collections.abc import Iterator
    if isinstance(data, Iterator):
        raise InputError(f"{who} needs data it can read more than once (a list of batches, a "
                         f"DataLoader), not a one-shot {type(data).__name__}: {why}")
    if one_batch and (isinstance(data, dict) or hasattr(data, "dtype")):
        raise InputError(f"{who} takes a collection of batches (a list, a DataLoader), not one "
                         f"batch: {one_batch}")
    return data


# ----------------------------------------------------------------------------- the batches
class HookedBatches:
    """The block's batches on the hidden states the model feeds it (module docstring)."""

    def __init__(self, ml, model, data, targets="output", call=None):
        reusable(data, "batches_from", one_batch="wrap it in a list",
                 why="every product runs the model on the data again")
        if not (targets is None or (isinstance(targets, str) and targets == "output")
                or callable(targets)):
            raise InputError(f"targets must be one of {', '.join(TARGETS)}, got {targets!r}")
        if ml._x is None or not any(a is ml._x for a in ml.args):
            raise InputError("batches_from needs a module captured on positional hidden states "
                             "(from_module(block, args, kwargs) with the call submodule_call gives)")
        self.ml, self.model, self.data = ml, model, data
        self.targets, self.call = targets, call
        self.where = path_of(model, ml.module) or "the model"

    def __len__(self):
        return len(self.data)

    def __iter__(self):
        for b in self.data:
            yield self.read(b)

    def read(self, b) -> dict:
        """The block's data for one batch of the model: {X, Y (, per-sequence constants)}."""
        import torch
        ml = self.ml
        args, kwargs = submodule_call(self.model, ml.module, b, self.call)
        tensors, other = differences(ml, args, kwargs)
        if other:
            raise InputError(f"the model calls {self.where} with {other[0]}; the declaration "
                             f"holds the captured call: capture the block with the call "
                             f"symhess.submodule_call(model, block, batch) gives, "
                             f"and run the model the same way (call=…)")
        x = args[next(i for i, a in enumerate(ml.args) if a is ml._x)]
        out = None
        if tensors or self.targets is not None:
            with torch.no_grad(), no_downcasts():
                out = _first_tensor(ml.module(*args, **kwargs))
        if tensors:
            with torch.no_grad():
                err = _rel(ml.forward(x), out)
            if not err <= CHECK_TOLERANCE:
                raise InputError(f"the model calls {self.where} with {', '.join(tensors)} unlike "
                                 f"the captured call's, and the block's output differs from the "
                                 f"declaration's (relative {err:.1e} > {CHECK_TOLERANCE:g}): the "
                                 f"declaration holds the captured masks and rotary tables as "
                                 f"constants; capture the block on a batch like the data's")
        if self.targets is None:
            return ml.batch(x)
        y = self.targets(out, b) if callable(self.targets) else out
        return ml.batch(x, y)


__all__ = ["submodule_call", "HookedBatches", "run_model", "path_of", "differences"]

"""The exceptions symhess raises for bad input.

Every error caused by what a user passed (a declaration, an option, values, sizes, a file)
is a ``SymhessError``: the CLI prints its message as one line and exits with status 2, and
API users can catch the one base class.  Anything else that escapes is a bug.

* ``DeclarationError`` — a layer, expression, option, name or dimension that is not valid;
  * ``UnknownNameError`` — a name that is not declared (layer, loss, block, intermediate,
    elementwise function …); the message lists the valid names;
  * ``OptionError``      — an option a layer does not take, or a value it does not accept
    (``causal="maybe"``); the message lists the valid options or values;
  * ``DuplicateNameError`` — a second registration under a name already taken;
* ``ShapeError``       — shapes that do not conform (in a declaration or in the values);
* ``InputError``       — values that cannot be used (names, dtypes, non-finite entries …);
* ``BudgetError``      — work whose memory estimate exceeds the budget (the message names
  the sizes, the estimate and the budget), or that would be sliced into more pieces than
  the slicing floor allows;
* ``ProcessError``     — a reduction across ``torch.distributed`` processes failed because
  another process stopped (its own one-line error says why).

``SaturationWarning`` (a ``UserWarning``, not an error) says that a kernel met softmax rows so
close to one-hot (1 − max a below √ε of the dtype, but not exactly 0) that the Hessian terms
through that softmax (attention's W_Q/W_K blocks, a cross-entropy loss's diag(a) − a aᵀ) lose
relative accuracy (differences of nearly equal numbers); the interpreter stays accurate.

The first three are also ``ValueError`` s, ``BudgetError`` is a ``MemoryError`` and
``ProcessError`` a ``RuntimeError`` (what a failed collective raises), so code
that caught the built-in types keeps working; for the same reason ``UnknownNameError`` is also
a ``KeyError`` (a registry miss), as is ``DuplicateNameError``, and ``OptionError`` also a ``TypeError`` (what Python raises
for an unexpected keyword argument).  ``str()`` of every one of them is its message (a plain
``KeyError`` would quote it).
"""
from __future__ import annotations

__all__ = ["SymhessError", "DeclarationError", "UnknownNameError", "OptionError",
           "DuplicateNameError", "ShapeError", "InputError", "BudgetError", "ProcessError",
           "SaturationWarning"]


class SymhessError(Exception):
    """Base class: an error caused by the user's input (one line, CLI exit status 2)."""

    def __str__(self):
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class DeclarationError(SymhessError, ValueError):
    """A declaration, option, name or dimension that is not valid."""


class UnknownNameError(DeclarationError, KeyError):
    """A name that is not declared (layer, loss, block, intermediate …); lists the valid ones."""


class OptionError(DeclarationError, TypeError):
    """An option a layer does not take, or an option value it does not accept."""


class DuplicateNameError(DeclarationError, KeyError):
    """A second registration under a name that is already registered."""


class ShapeError(SymhessError, ValueError):
    """A declaration or value whose shapes do not conform."""


class InputError(SymhessError, ValueError):
    """Values that cannot be used (wrong names, shapes, dtypes, non-finite entries)."""


class BudgetError(SymhessError, MemoryError):
    """Work whose estimated memory exceeds the budget."""


class ProcessError(SymhessError, RuntimeError):
    """A reduction across processes failed: another process stopped (see its error)."""


class SaturationWarning(UserWarning):
    """Softmax rows within √ε of one-hot: kernel results lose relative accuracy there."""

"""The exceptions symhess raises for bad input.

Every error caused by what a user passed (a declaration, an option, values, sizes, a file)
is a ``SymhessError``: the CLI prints its message as one line and exits with status 2, and
API users can catch the one base class.  Anything else that escapes is a bug.

* ``DeclarationError`` — a layer, expression, option, name or dimension that is not valid;
* ``ShapeError``       — shapes that do not conform (in a declaration or in the values);
* ``InputError``       — values that cannot be used (names, dtypes, non-finite entries …);
* ``BudgetError``      — work whose memory estimate exceeds the budget (the message names
  the sizes, the estimate and the budget).

The first three are also ``ValueError`` s and ``BudgetError`` is a ``MemoryError``, so code
that caught the built-in types keeps working.
"""
from __future__ import annotations

__all__ = ["SymhessError", "DeclarationError", "ShapeError", "InputError", "BudgetError"]


class SymhessError(Exception):
    """Base class: an error caused by the user's input (one line, CLI exit status 2)."""


class DeclarationError(SymhessError, ValueError):
    """A declaration, option, name or dimension that is not valid."""


class ShapeError(SymhessError, ValueError):
    """A declaration or value whose shapes do not conform."""


class InputError(SymhessError, ValueError):
    """Values that cannot be used (wrong names, shapes, dtypes, non-finite entries)."""


class BudgetError(SymhessError, MemoryError):
    """Work whose estimated memory exceeds the budget."""

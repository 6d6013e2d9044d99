"""The schedule: every tunable of the kernels' runtime in one place, with one switch.

* ``memory_budget`` — bytes any single intermediate (and any materialised compact tensor)
  may take; a contraction that needs more is sliced, a result that alone needs more raises
  ``BudgetError``.  Default: a quarter of the memory budget (``symhess.expr.budget``: the
  available memory, or ``SYMHESS_MEMORY_BUDGET``), at most 512 MiB: a routine's peak is a
  few of its largest intermediates, and slicing contractions of that size costs little (the
  exact diagonal of attention at L = d = 512, B = 8: the same time as with 2 GiB, peak 1.6
  instead of 3.1 GB).
* ``materialise`` — compact per-token tensors (the block-diagonal moments, LayerNorm
  Jacobians): ``"auto"`` compares, at the call's sizes, the planned time
  (``contract.Plan.cost``) of computing the tensor once against inlining its networks into
  every network that uses it; ``"always"`` materialises every one that fits the budget;
  ``"never"`` inlines them all.
* ``mirror`` — a dense Hessian's blocks below the diagonal are copied from the transposed
  blocks above it (``False``: computed from their own networks).
* ``collect`` — a diagonal's networks that differ only in a sub-network are contracted once
  over a compact of their sum (``runtime.collect``; ``False``: each on its own).

``Schedule.plain()`` is the switch: no cost comparisons (compacts materialised when they fit),
no mirrored blocks, no collected networks.  The results agree with the default schedule to
rounding; the environment variable ``SYMHESS_SCHEDULE=plain`` selects it for a whole process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..errors import DeclarationError

MATERIALISE = ("auto", "always", "never")


MAX_INTERMEDIATE = 512 * 2 ** 20


def default_budget(device=None) -> int:
    """A quarter of the memory budget, at most ``MAX_INTERMEDIATE`` bytes."""
    from ..expr.budget import memory_budget
    total, _ = memory_budget(device)
    return MAX_INTERMEDIATE if total is None else max(1, min(MAX_INTERMEDIATE, total // 4))


@dataclass(frozen=True)
class Schedule:
    memory_budget: int = MAX_INTERMEDIATE
    itemsize: int = 8
    materialise: str = "auto"
    mirror: bool = True
    collect: bool = True

    def __post_init__(self):
        if self.materialise not in MATERIALISE:
            raise DeclarationError(f"unknown materialise setting {self.materialise!r}; valid: "
                                   f"{', '.join(MATERIALISE)}")
        if not isinstance(self.memory_budget, int) or self.memory_budget <= 0:
            raise DeclarationError(f"memory_budget must be a positive number of bytes, got "
                                   f"{self.memory_budget!r}")

    @property
    def limit(self) -> int:
        """Entries of the largest intermediate."""
        return max(1, self.memory_budget // self.itemsize)

    @property
    def compact_limit(self) -> int:
        """Entries of the largest compact tensor kept materialised (it lives as long as the
        prepared state, so a quarter of the intermediate limit)."""
        return max(1, self.limit // 4)

    @classmethod
    def plain(cls, **kw) -> "Schedule":
        return cls(materialise="always", mirror=False, collect=False, **kw)

    @classmethod
    def default(cls, memory_budget=None, itemsize=8, device=None) -> "Schedule":
        """The process default (``SYMHESS_SCHEDULE=plain`` selects ``plain()``)."""
        kw = {"itemsize": itemsize,
              "memory_budget": memory_budget if memory_budget is not None else default_budget(device)}
        mode = os.environ.get("SYMHESS_SCHEDULE", "tuned")
        if mode not in ("tuned", "plain"):
            raise DeclarationError(f"SYMHESS_SCHEDULE={mode!r} is not valid; valid: tuned, plain")
        return cls.plain(**kw) if mode == "plain" else cls(**kw)

    def with_itemsize(self, itemsize) -> "Schedule":
        return replace(self, itemsize=itemsize)

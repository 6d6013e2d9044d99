"""Graph capture: a torch module's forward translated into a symhess declaration.

``capture(module, args, kwargs)`` (``graph``) exports the forward with ``torch.export`` and
translates its ATen graph op by op: ``aten`` is the op table (one entry per op), ``ops`` the
operations on symbolic tensors, ``tensor`` the symbolic tensors themselves (per-head 2-D
blocks, lazy column bookkeeping, parameter pieces), ``context`` the declaration being built.
``symhess.from_module`` (``layers/modules.py``) is the public entry point.
"""
from .graph import Capture, capture

__all__ = ["capture", "Capture"]

"""What the two replay modes share: CUDA graphs (``symhess.graphs``) and traced graphs
(``symhess.traces``) each wrap a generated routine so that a recording made per call
signature is replayed, with the eager routine as the fallback, and a kernel's routine table
wraps its routines on first use."""
from __future__ import annotations

import threading
import warnings


class Replayed:
    """A generated routine ``fn`` with its recordings by call signature; ``cannot`` words
    the warning given once when a routine has to run eagerly from then on."""

    mode = "replayed routines"         # the kernels' mode, in its messages and repr
    cannot = "cannot be replayed"

    def __init__(self, fn, name=None):
        self.fn = fn
        self.__name__ = name or getattr(fn, "__name__", "routine")
        self._recorded = {}
        self._eager = False
        self._lock = threading.Lock()

    def clear(self):
        """Drop every recording (and its memory)."""
        self._recorded.clear()

    def _eager_call(self, out, kwargs):
        return self.fn(**kwargs) if out is None else self.fn(**kwargs, out=out)

    def _give_up(self, why, stacklevel):
        """Run eagerly from now on, after one warning naming the routine; ``stacklevel`` as
        for ``warnings.warn`` from here, so that it names the line calling the routine."""
        self._eager = True
        warnings.warn(f"symhess: routine {self.__name__} {self.cannot} ({why}); it runs eagerly",
                      RuntimeWarning, stacklevel=stacklevel)


class ReplayTable(dict):
    """A kernel's routine table whose callables are wrapped by ``wrap`` (a ``Replayed``
    class) on first use; other entries, such as Jacobian layouts, pass through."""

    def __init__(self, table, wrap):
        super().__init__()
        self.table, self.wrap = table, wrap

    def __missing__(self, key):
        entry = self.table[key]
        if callable(entry):
            entry = self.wrap(entry, name=getattr(entry, "__name__", repr(key)))
        self[key] = entry
        return entry

    def clear_recorded(self):
        """Drop every wrapped routine's recordings."""
        for entry in self.values():
            if isinstance(entry, Replayed):
                entry.clear()

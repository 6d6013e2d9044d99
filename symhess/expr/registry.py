"""A small registry: named entries, refusing silent overwrites, listing valid names on a miss."""
from __future__ import annotations

from ..errors import DuplicateNameError, UnknownNameError


class Registry(dict):
    """``kind`` names what is registered (for messages); keys are names or node types."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, key):
        """Decorator: register ``fn`` under ``key``; a second registration raises
        DuplicateNameError (a KeyError)."""

        def deco(fn):
            if key in self:
                raise DuplicateNameError(f"{self.kind} {_name(key)!r} is already registered")
            self[key] = fn
            return fn

        return deco

    def lookup(self, key):
        """The entry for ``key``; a miss is an UnknownNameError (a KeyError) naming the valid keys."""
        if key not in self:
            raise UnknownNameError(f"unknown {self.kind} {_name(key)!r}; valid: {', '.join(sorted(map(_name, self)))}")
        return self[key]


def _name(key):
    return getattr(key, "__name__", key)

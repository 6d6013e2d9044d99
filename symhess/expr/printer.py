"""Shared printer machinery: dispatch on the node's class name, raise on unknown nodes.

A node's text depends only on the node (and the printer's fixed settings), so ``doprint``
keeps each node's text, and ``print(expr)`` prints the nodes children first (the nodes
``shown`` reaches): every ``_print_`` method then finds its children's texts
and no call nests more than one level, so deep expressions do not depend on Python's
recursion limit.
"""
from __future__ import annotations

from .stackwalk import children_first


class Printer:
    """Subclasses define ``_print_<NodeType>(node)``; unknown node types raise.
    ``shown(node)``: the children whose text a node's text contains."""

    def doprint(self, node) -> str:
        memo = self.__dict__.setdefault("_texts", {})
        text = memo.get(node)
        if text is None:
            text = memo[node] = self._dispatch(node)
        return text

    def _dispatch(self, node) -> str:
        """The node's own text (its ``_print_`` method; not kept, names not looked up)."""
        method = getattr(self, "_print_" + type(node).__name__, None)
        if method is None:
            raise NotImplementedError(f"{type(self).__name__} cannot print {type(node).__name__}")
        return method(node)

    def shown(self, node):
        return node.args

    def print(self, expr) -> str:
        """``doprint(expr)`` with the nodes below printed first (module docstring)."""
        out = None
        for node in children_first(expr, self.shown):
            out = self.doprint(node)
        return out

    def define(self, node) -> str:
        """The node's own text (``_dispatch``, even where it has a name), its children
        printed first."""
        for child in self.children_of(node):
            self.print(child)
        return self._dispatch(node)

    def children_of(self, node):
        """The children a node's own text shows (``shown`` without names)."""
        return node.args

    def paren(self, node, parent_precedence) -> str:
        s = self.doprint(node)
        return f"{self.lparen}{s}{self.rparen}" if node.precedence < parent_precedence else s

    lparen, rparen = "(", ")"
    plus, minus = " + ", " - "

    def _print_Add(self, n):
        out = self.doprint(n.args[0])
        for t in n.args[1:]:
            s = self.doprint(t)
            out += self.minus + s[1:] if s.startswith("-") else self.plus + s
        return out

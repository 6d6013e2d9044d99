"""Shared printer machinery: dispatch on the node's class name, raise on unknown nodes."""
from __future__ import annotations


class Printer:
    """Subclasses define ``_print_<NodeType>(node)``; unknown node types raise."""

    def doprint(self, node) -> str:
        method = getattr(self, "_print_" + type(node).__name__, None)
        if method is None:
            raise NotImplementedError(f"{type(self).__name__} cannot print {type(node).__name__}")
        return method(node)

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

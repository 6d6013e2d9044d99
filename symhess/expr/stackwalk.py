"""Walks that keep the Python stack flat: a DAG of any height is visited, and a recursive rule
system is run, with an explicit stack instead of one Python frame per level.

* ``children_first(root, children, skip)``: every distinct node that ``children`` reaches
  from ``root``, once, children before parents (post-order); nodes in ``skip`` and what lies
  only below them are left out.  O(nodes + edges).
* ``run_rules(first, step)``: a rule written as a generator yields a request for each
  sub-result it needs and receives the answer; ``step(*request)`` returns the answer (a value)
  or the generator of the rule that computes it.  Generators run on one list used as a stack,
  in the order a recursive evaluation would take, so results are the same as recursion's; an
  exception is thrown into the rule that made the request (it may catch it), and leaves the
  walk from the outermost rule.  Terminates when every rule's requests terminate (each
  request is for a strictly smaller sub-problem: a child of the node).
"""
from __future__ import annotations

import inspect


def children_first(root, children, skip=()):
    """Distinct nodes below ``root`` (itself included), children before parents."""
    seen, order, stack = set(), [], [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen or node in skip:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((a, False) for a in reversed(tuple(children(node))))
    return order


def run_rules(first, step):
    """The result of the rule generator ``first`` (module docstring); ``first`` may also be a
    value, returned as it is."""
    if not inspect.isgenerator(first):
        return first
    stack, value, error = [first], None, None
    while True:
        try:
            request = stack[-1].throw(error) if error is not None else stack[-1].send(value)
        except StopIteration as stop:
            stack.pop()
            value, error = stop.value, None
            if not stack:
                return value
            continue
        except BaseException as exc:        # thrown back into the rule that asked
            stack.pop()
            if not stack:
                raise
            value, error = None, exc
            continue
        try:
            answer = step(*request)
        except BaseException as exc:        # thrown into the rule that asked
            value, error = None, exc
            continue
        if inspect.isgenerator(answer):
            stack.append(answer)
            value = None
        else:                               # a value: no sub-requests
            value = answer

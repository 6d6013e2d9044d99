"""Names of a part's own members by their content, so that parts share what they both define.

A variant rendered in parts (``render.render_part``) prints each pair's blocks as a mixin of
its own.  The leaves and compact tensors a part makes for itself (a captured block's
LayerNorm and MLP Jacobians S, the per-head ∂A/∂T) are, as printed, the same in every part
that holds the same heads' or layers' terms: a captured encoder layer's 37 declared pieces
print the same chain S (B L d² entries) 53 times.  Named after their part, each copy is
formed and kept by the state on its own (at L = d = 96, B = 4: 166 arrays of 16 distinct
values, 5.4 GB).

``by_content(members, own, suffix)`` renames every member of ``own`` (the names the part's
printer made, each ending in ``suffix``) to ``HINT__hDIGEST``: DIGEST hashes the member's
definition with its own name blanked and the names it reads already renamed, so one name is
one definition: the same code over the same operands, hence the same array (shape and form
included).  A state extended by two parts then finds one cached value under that name
(``functools.cached_property`` keeps it in the instance), and a compact that several parts'
blocks hold is one ``Compact`` (formed once, sliced once per slice in ``runtime.chunk``).
Within a part, members that come out equal are printed once.

Cost: one pass over the members' text per own name (regular-expression substitution);
the definitions form a DAG (a member reads only members printed before it was named), so the
recursion ends.
"""
from __future__ import annotations

import hashlib
import re

DIGEST = 10          # hexadecimal digits of a content name's digest


def by_content(members, own, suffix):
    """``members`` (printed member sources) with each name of ``own`` ({name: its member's
    source}) replaced by its content name; repeated definitions dropped."""
    if not own:
        return list(members)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(own, key=len, reverse=True))) + r")\b")
    final = {}

    def name_of(x):
        if x not in final:
            text = own[x]
            for y in set(pattern.findall(text)) - {x}:
                name_of(y)
            body = pattern.sub(lambda m: "@" if m.group(1) == x else final[m.group(1)], text)
            base = x[:x.index(suffix)] if suffix in x else x
            final[x] = f"{base}__h{hashlib.sha256(body.encode()).hexdigest()[:DIGEST]}"
        return final[x]

    for x in own:
        name_of(x)
    defined = {src: x for x, src in own.items()}
    out, printed = [], set()
    for src in members:
        x = defined.get(src)
        if x is not None:
            if final[x] in printed:
                continue
            printed.add(final[x])
        out.append(pattern.sub(lambda m: final[m.group(1)], src))
    return out

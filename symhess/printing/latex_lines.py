"""Break long LaTeX formulas into lines for amsmath's ``align*`` (what breqn does, without it).

A printed formula is read back as a tree: ``\\left … \\right`` pairs and plain brackets are
groups, ``{…}`` arguments and commands with their arguments are atoms, and the binary
operators are break points.  Lines are filled greedily; when the next piece would overflow
the width, the line ends at the break point of least cost in its last part (past
``MIN_FILL`` of the width): the shallowest bracket level first, then

* ``+``, ``−``, ``=`` (class 0: a new line starts with the operator),
* ``⊗``, ``⊙``, ``,``, ``;`` (class 1),
* the boundary after a closing bracket and before the next factor (class 2),

and, among equal costs, the latest.  A bracket pair whose halves end up on two lines gets
fixed-size delimiters (``\\bigl( … \\bigr)``, larger around fractions and around other
split pairs), because ``\\left`` and ``\\right`` must close on the line they open; every
line is then a complete formula.

Widths are estimates in em (1 em = 10 pt, display style) from a table of glyph widths.
They only steer the breaking: the report's tests compile documents with pdflatex and read
TeX's own measurements back.

Contract: joining the lines (with ``join``) gives the input back, up to the delimiter
sizes of split pairs; a formula this module cannot read (unbalanced brackets) comes back
as one line.  Termination: every iteration of the fill loop either adds one piece to the
line or ends a line at a break point strictly after the line's start, so the loop runs
at most twice per piece.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

MIN_FILL = 0.45     # a line ends no earlier than this fraction of its width, where possible

# -- widths (em, 10 pt Computer Modern) -------------------------------------------------------
_BIN = 1.22         # a binary operator with its medium spaces (+, −, ⊗, ⊙, ×)
_REL = 1.34         # a relation with its thick spaces (=)
_CMD_WIDTH = {
    "otimes": _BIN, "odot": _BIN, "times": _BIN, "cdot": 0.72, "partial": 0.57, "top": 0.78,
    "sum": 1.05, "quad": 1.0, "qquad": 2.0, ",": 0.17, ";": 0.28, ":": 0.22, "!": -0.17,
    " ": 0.33, "{": 0.5, "}": 0.5, "infty": 1.0, "langle": 0.39, "rangle": 0.39, "lvert": 0.28,
    "rvert": 0.28, "mid": 0.5, "to": 1.3, "le": 1.3, "ge": 1.3, "leq": 1.3, "geq": 1.3,
    "ldots": 1.2, "cdots": 1.2, "dots": 1.2,
}
_ZERO_WIDTH = {"textstyle", "displaystyle", "scriptstyle", "limits", "nolimits", "left",
               "right", "allowbreak", "phantom", "hfill"}
_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
          "iota", "kappa", "lambda", "mu", "nu", "xi", "pi", "rho", "sigma", "tau", "upsilon",
          "phi", "varphi", "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi",
          "Pi", "Sigma", "Phi", "Psi", "Omega", "ell", "imath", "jmath"}
_FONT_ONE_ARG = {"mathbf", "mathcal", "mathbb", "boldsymbol", "mathrm", "mathit", "mathsf",
                 "widetilde", "widehat", "overline", "bm", "mathfrak"}
_TEXT_ONE_ARG = {"operatorname": 0.5, "text": 0.5, "texttt": 0.525, "mathrm": 0.5}
_SIZES = ("big", "Big", "bigg", "Bigg")
_DELIMITER_COMMANDS = {"left", "right", *_SIZES, *(z + "l" for z in _SIZES), *(z + "r" for z in _SIZES)}
_OPEN, _CLOSE = {"(": ")", "[": "]", r"\{": r"\}", r"\langle": r"\rangle"}, {")", "]", r"\}", r"\rangle"}


# glyph widths of Computer Modern: bold upright (cmbx10) and math italic (cmmi10) letters
_BOLD_UPPER = dict(zip("ABCDEFGHIJKLMNOPQRSTUVWXYZ", (
    .87, .82, .83, .88, .76, .72, .90, .90, .44, .59, .90, .69, 1.09, .90, .86, .79, .86, .86,
    .64, .80, .88, .87, 1.19, .87, .87, .70)))
_ITALIC_UPPER = dict(zip("ABCDEFGHIJKLMNOPQRSTUVWXYZ", (
    .75, .76, .71, .83, .74, .64, .79, .83, .44, .55, .85, .68, .97, .80, .76, .64, .79, .76,
    .61, .58, .68, .58, .94, .83, .58, .68)))
_ITALIC_LOWER = dict(zip("abcdefghijklmnopqrstuvwxyz", (
    .53, .43, .43, .52, .47, .49, .48, .58, .34, .41, .52, .30, .88, .60, .49, .50, .45, .45,
    .47, .36, .57, .49, .72, .57, .49, .47)))


def _char_width(c: str, bold=False) -> float:
    if c.isupper():
        return _BOLD_UPPER.get(c, .86) if bold else _ITALIC_UPPER.get(c, .76)
    if c.islower():
        return 0.64 if bold else _ITALIC_LOWER.get(c, .53)
    if c.isdigit():
        return 0.575 if bold else 0.5
    return {"(": 0.39, ")": 0.39, "[": 0.28, "]": 0.28, "|": 0.28, "'": 0.28, ":": 0.28,
            ",": 0.28, ";": 0.28, ".": 0.28, "!": 0.28, "<": 1.33, ">": 1.33, "=": _REL,
            "+": _BIN, "-": _BIN, "/": 0.5, "*": 0.5, "&": 0.0, "~": 0.33}.get(c, 0.0 if c.isspace() else 0.6)


def _read_command(s: str, i: int) -> tuple[str, int]:
    """The command name at s[i] == '\\\\' and the index after it."""
    j = i + 1
    if j < len(s) and s[j].isalpha():
        while j < len(s) and s[j].isalpha():
            j += 1
        return s[i + 1:j], j
    return s[i + 1:j + 1], j + 1


def _read_braced(s: str, i: int) -> int:
    """The index after the balanced {…} starting at s[i] == '{'."""
    depth = 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError("unbalanced braces")


def _skip_spaces(s, i):
    while i < len(s) and s[i] == " ":
        i += 1
    return i


def _read_argument(s: str, i: int) -> int:
    """The index after one argument: {…}, a command (with its own argument) or a character."""
    i = _skip_spaces(s, i)
    if i >= len(s):
        return i
    if s[i] == "{":
        return _read_braced(s, i)
    if s[i] == "\\":
        name, j = _read_command(s, i)
        return _read_argument(s, j) if name in _FONT_ONE_ARG else j
    return i + 1


def _read_scripts(s: str, i: int) -> int:
    """The index after any ^…, _… and primes following s[:i]."""
    while True:
        j = _skip_spaces(s, i)
        if j < len(s) and s[j] == "'":
            i = j + 1
        elif j < len(s) and s[j] in "^_":
            i = _read_argument(s, j + 1)
        else:
            return i


CALIBRATION = 1.045   # TeX over table: mean over report rows (0.9–1.12 per row)


def width(tex: str) -> float:
    """Estimated width in em of a LaTeX math string (display style)."""
    return CALIBRATION * _width(tex)


def _width(tex: str, scale: float = 1.0) -> float:
    total, i, last_script = 0.0, 0, None
    while i < len(tex):
        c = tex[i]
        if c in "^_":
            j = _read_argument(tex, i + 1)
            arg = tex[i + 1:j].strip()
            w = _width(arg[1:-1] if arg.startswith("{") else arg, scale * (0.78 if scale > 0.9 else 0.8)) + 0.05
            if last_script is not None:            # a sub- and a superscript stack
                total += max(0.0, w - last_script)
                last_script = None
            else:
                total += w
                last_script = w
            i = j
            continue
        last_script = None
        if c == "{":
            j = _read_braced(tex, i)
            total += _width(tex[i + 1:j - 1], scale)
            i = j
            continue
        if c == "\\":
            name, j = _read_command(tex, i)
            if name in ("frac", "tfrac", "dfrac"):
                a_end = _read_argument(tex, j)
                b_end = _read_argument(tex, a_end)
                f = scale * (0.7 if name == "tfrac" or scale < 1 else 1.0)
                num, den = tex[j:a_end].strip(), tex[a_end:b_end].strip()
                total += max(_width(num[1:-1] if num.startswith("{") else num, f),
                             _width(den[1:-1] if den.startswith("{") else den, f)) + 0.24 * scale
                i = b_end
            elif name == "sqrt":
                k = _read_argument(tex, j)
                arg = tex[j:k].strip()
                total += _width(arg[1:-1] if arg.startswith("{") else arg, scale) + 0.85 * scale
                i = k
            elif name in _TEXT_ONE_ARG:
                k = _read_argument(tex, j)
                arg = tex[j:k].strip().strip("{}")
                total += (_TEXT_ONE_ARG[name] * len(re.sub(r"\\[a-zA-Z]+|[{}]", "x", arg))
                          + (0.17 if name == "operatorname" else 0.0)) * scale
                i = k
            elif name in _FONT_ONE_ARG:
                k = _read_argument(tex, j)
                arg = tex[j:k].strip()
                if arg.startswith("{"):
                    arg = arg[1:-1]
                if arg.startswith("\\"):
                    total += _width(arg, scale)
                else:
                    total += sum(_char_width(ch, bold=name in ("mathbf", "boldsymbol")) for ch in arg) * scale
                i = k
            elif name in ("left", "right", "bigl", "bigr", "Bigl", "Bigr", "biggl", "biggr",
                          "Biggl", "Biggr") + _SIZES:
                k = _skip_spaces(tex, j)
                if tex.startswith("\\", k):
                    delim, k = _read_command(tex, k)
                    delim = "\\" + delim
                else:
                    delim, k = tex[k:k + 1], k + 1
                w = 0.0 if delim == "." else _char_width(delim[-1]) if len(delim) == 1 else 0.5
                grow = {"big": 0.06, "Big": 0.12, "bigg": 0.18, "Bigg": 0.24}
                total += (w + grow.get(name.rstrip("lr"), 0.08 if name in ("left", "right") else 0.0)) * scale
                i = k
            elif name in ("exp", "log", "tanh", "sin", "cos", "max", "min", "det", "tr", "diag"):
                total += (0.5 * len(name) + 0.17) * scale
                i = j
            elif name in _GREEK:
                total += 0.6 * scale
                i = j
            elif name in _ZERO_WIDTH:
                i = j
            else:
                total += _CMD_WIDTH.get(name, 0.6) * scale
                i = j
            continue
        total += _char_width(c) * (scale if c not in "+-=<>" or scale == 1 else scale * 0.6)
        i += 1
    return total


# -- reading a formula back as a tree ---------------------------------------------------------
@dataclass(eq=False)
class _Piece:
    """One unit of a line: ``kind`` is atom, op, open or close; ``cls`` the break class of an op."""

    text: str
    kind: str
    depth: int
    cls: int = 0
    group: "_Group | None" = None
    width: float = 0.0


@dataclass(eq=False)
class _Group:
    sized: bool                       # \left … \right (resizable), else plain or fixed-size
    open: _Piece | None = None
    close: _Piece | None = None
    children: list = field(default_factory=list)
    parent: "_Group | None" = None


_BINARY = {"+": 0, "-": 0, "=": 0, r"\otimes": 1, r"\odot": 1, r"\times": 1, ",": 1, ";": 1}


def _pieces(tex: str) -> list[_Piece]:
    """Flatten a formula into pieces with group structure; raises ValueError if unbalanced."""
    out: list[_Piece] = []
    stack: list[tuple[_Group, str]] = []           # open groups and the closer they wait for
    i = 0

    def operand_before() -> bool:
        return bool(out) and out[-1].kind in ("atom", "close")

    def add(text, kind, **kw):
        out.append(_Piece(text, kind, len(stack), **kw))

    while i < len(tex):
        c = tex[i]
        if c.isspace():
            if out:
                out[-1].text += c
            else:
                add(c, "atom")
            i += 1
            continue
        start = i
        if c == "\\":
            name, j = _read_command(tex, i)
            if name in _DELIMITER_COMMANDS:
                k = _skip_spaces(tex, j)
                if tex.startswith("\\", k):
                    dname, k = _read_command(tex, k)
                    delim = "\\" + dname
                else:
                    delim, k = tex[k:k + 1], k + 1
                opening = name == "left" or name.endswith("l") or (name in _SIZES and delim in _OPEN)
                if opening:
                    g = _Group(sized=(name == "left"), parent=stack[-1][0] if stack else None)
                    if stack:
                        stack[-1][0].children.append(g)
                    add(tex[start:k], "open", group=g)
                    g.open = out[-1]
                    stack.append((g, "right" if name == "left" else "fixed"))
                    i = k
                    continue
                if not stack or (stack[-1][1] == "right") != (name == "right"):
                    raise ValueError("unbalanced delimiters")
                g, _ = stack.pop()
                k = _read_scripts(tex, k)
                add(tex[start:k], "close", group=g)
                g.close = out[-1]
                i = k
                continue
            op = "\\" + name
            if op in _BINARY and operand_before():
                add(tex[start:j], "op", cls=_BINARY[op])
                i = j
                continue
            if name in ("{", "langle") or name in ("}", "rangle"):
                c = "\\" + name                       # a plain bracket written as a command
                j0 = j
            else:
                if name in ("frac", "tfrac", "dfrac"):
                    j = _read_argument(tex, _read_argument(tex, j))
                elif name in _FONT_ONE_ARG or name in _TEXT_ONE_ARG or name == "sqrt":
                    j = _read_argument(tex, j)
                j = _read_scripts(tex, j)
                add(tex[start:j], "atom")
                i = j
                continue
        else:
            j0 = i + 1
        if c in _OPEN:
            g = _Group(sized=False, parent=stack[-1][0] if stack else None)
            if stack:
                stack[-1][0].children.append(g)
            add(tex[start:j0], "open", group=g)
            g.open = out[-1]
            stack.append((g, _OPEN[c]))
            i = j0
            continue
        if c in _CLOSE:
            if not stack or stack[-1][1] != c:
                raise ValueError("unbalanced brackets")
            g, _ = stack.pop()
            k = _read_scripts(tex, j0)
            add(tex[start:k], "close", group=g)
            g.close = out[-1]
            i = k
            continue
        if c == "{":
            j = _read_scripts(tex, _read_braced(tex, i))
            add(tex[start:j], "atom")
            i = j
            continue
        if c == ":" and tex.startswith(":=", i) and operand_before():
            add(":=", "op", cls=0)
            i += 2
            continue
        if c in _BINARY and operand_before():
            add(c, "op", cls=_BINARY[c])
            i += 1
            continue
        j = _read_scripts(tex, i + 1)
        add(tex[start:j], "atom")
        i = j
    if stack:
        raise ValueError("unclosed delimiters")
    for p in out:
        p.width = width(p.text) if p.kind != "op" else (_REL if p.text in ("=", ":=") else
                                                        0.45 if p.text in (",", ";") else _BIN)
    return out


# -- filling lines ----------------------------------------------------------------------------
def _break_cost(pieces, b):
    """(depth, class) of a break before pieces[b], or None where no break is allowed."""
    prev, cur = pieces[b - 1], pieces[b]
    if cur.kind == "op" and cur.text.strip() not in (",", ";"):
        return (cur.depth, cur.cls)
    if prev.kind == "op" and prev.text.strip() in (",", ";"):
        return (prev.depth, prev.cls)
    if prev.kind == "close" and cur.kind in ("atom", "open"):
        return (cur.depth, 2)
    return None


def _fill(pieces, widths):
    """Line start indices: greedy, ending each line at its cheapest late break point."""
    starts, start, used = [0], 0, 0.0
    budget = widths[0]
    k = 0
    while k < len(pieces):
        w = pieces[k].width
        if used + w <= budget or k == start:
            used += w
            k += 1
            continue
        cands = []
        acc = 0.0
        for b in range(start + 1, k + 1):
            acc += pieces[b - 1].width
            cost = _break_cost(pieces, b) if b < len(pieces) else None
            if cost is not None:
                cands.append((acc >= MIN_FILL * budget, cost, b))
        if not cands:                     # nothing to break at yet: the line runs over
            used += w
            k += 1
            continue
        late = [c for c in cands if c[0]] or cands
        best = min(late, key=lambda c: (c[1], -c[2]))[2]
        starts.append(best)
        start = best
        budget = widths[min(len(starts) - 1, len(widths) - 1)]
        used = sum(p.width for p in pieces[start:k])
    return starts


def _sizes(pieces, starts):
    """Fixed delimiter sizes for the groups whose brackets are on different lines."""
    line_of = {}
    for n, (a, b) in enumerate(zip(starts, starts[1:] + [len(pieces)])):
        for p in pieces[a:b]:
            line_of[id(p)] = n
    groups = {id(p.group): p.group for p in pieces if p.kind == "open" and p.group.sized}
    split = {gid for gid, g in groups.items() if line_of[id(g.open)] != line_of[id(g.close)]}
    sizes, index = {}, {id(p): n for n, p in enumerate(pieces)}

    def size(g):
        if id(g) not in sizes:
            inner = [size(c) for c in g.children if c.sized and id(c) in split]
            a, b = index[id(g.open)], index[id(g.close)]
            tall = any(r"\frac" in p.text or r"\sum" in p.text for p in pieces[a:b])
            sizes[id(g)] = max([2 if tall else 1] + [s + 1 for s in inner])
        return sizes[id(g)]
    for gid in split:
        size(groups[gid])
    return {gid: min(s, 4) for gid, s in sizes.items() if gid in split}


_SIZE_CMD = {1: "big", 2: "Big", 3: "bigg", 4: "Bigg"}


def _resized(piece, n):
    """``\\left(`` → ``\\Bigl(``, ``\\right)^\\top`` → ``\\Bigr)^\\top``."""
    cmd = _SIZE_CMD[n]
    if piece.kind == "open":
        return re.sub(r"^\\left\s*", rf"\\{cmd}l", piece.text)
    return re.sub(r"^\\right\s*", rf"\\{cmd}r", piece.text)


def break_lines(tex: str, first: float, rest: float | None = None) -> list[str]:
    """``tex`` as lines: the first at most ``first`` em wide, the others ``rest`` (where the
    break points allow)."""
    rest = first if rest is None else rest
    if width(tex) <= first:
        return [tex]
    try:
        pieces = _pieces(tex)
    except ValueError:
        return [tex]
    starts = _fill(pieces, [first, rest])
    sizes = _sizes(pieces, starts)
    lines = []
    for a, b in zip(starts, starts[1:] + [len(pieces)]):
        text = "".join(_resized(p, sizes[id(p.group)]) if p.kind in ("open", "close")
                       and p.group.sized and id(p.group) in sizes else p.text for p in pieces[a:b])
        lines.append(text)
    return lines


def join(lines) -> str:
    """The lines as one formula (delimiter sizes of split pairs stay fixed)."""
    return "".join(lines)


__all__ = ["break_lines", "width", "join", "MIN_FILL"]

"""Print a ``Program`` as the members of one generated class (a ``runtime.Forward``).

* **Leaves and shared quantities** become ``@leaf`` methods (computed once per prepared
  state), one statement each: ``T = c * mm(X, W_Q, tr(W_K), tr(X))``.  A sub-expression
  used once is written inside its user's statement; one used more than once, a named
  quantity (A, M_1, G …) or one too long for a line gets its own name.
* **Networks** are one ``net(coef, "spec", operands…)`` call each (``runtime.network``):
  the block methods return their lists, compact tensors are ``Compact`` leaves.
* **Matrix-view routines** (loss, gradient, Hessian–vector products, check inputs) are
  methods whose statements depend on their arguments (the directions V); everything that
  does not is a leaf.

The printed names are backend-neutral (``mm``, ``tr``, ``softmax_rows``, ``exp`` …): each
backend module (``runtime.numpy_ops``, ``runtime.torch_ops``) defines them.  Nodes without a
rule raise; nothing falls back to ``str()``.

The matrix rules are generators: a rule *yields* ``("code", node)`` or ``("leaf", node)`` for
each sub-expression it prints and receives its text; ``Printer.code`` and ``Printer.leaf``
run them on an explicit stack, in the order a recursive printer would, so deep expressions
do not meet Python's recursion limit.
"""
from __future__ import annotations

import inspect
import re
from functools import lru_cache

import opt_einsum as oe
import sympy as sp

from ..expr import nodes as E
from ..expr import scalarfn
from ..errors import DeclarationError
from ..expr.registry import Registry
from ..expr.stackwalk import run_rules
from ..runtime import chain
from ..expr.text import short_text

MAX_INLINE = 72        # longer sub-expressions get a name of their own
BATCH = "n"            # the batch label of printed network specs
RESERVED = {"s", "n_batch", "ops", "schedule", "like", "dims", "PARAMS", "LOSS", "OPTIONS", "STAMP"}

RULES = Registry("matrix printing rule for")
rule = RULES.register


def _ident(name):
    """A Python identifier for a display name (M_1 stays M_1, M_1^{(2)} becomes M_1_2)."""
    out = re.sub(r"[^0-9A-Za-z_]+", "_", name).strip("_") or "t"
    return out if not out[0].isdigit() else "t" + out


class Printer:
    """Prints the class members of one variant (see the module docstring)."""

    def __init__(self, program, known=None, suffix=""):
        """``known``: {node key: member name} of the leaves of the variant this program is a
        part of (a part rendered on first use reads them instead of recomputing them);
        ``suffix``: appended to every name this printer makes (parts' names never clash)."""
        self.prog = program
        self.known = dict(known or {})
        self.suffix = suffix
        d = program.derivation
        lay = d.layer
        self.variables = dict(lay.variables)
        self.variables["Y"] = d.Y
        self.data = {v for v in self.variables.values() if v.role == "input"} | {d.Y}
        self.dims = sorted({s for v in self.variables.values() for x in v.shape
                            for s in sp.sympify(x).free_symbols}, key=lambda s: s.name)
        for v in self.variables.values():
            if not v.name.isidentifier():
                raise DeclarationError(f"variable name {v.name!r} is not a Python identifier; "
                                       "kernels need identifiers")
        for s in self.dims:
            if not s.name.isidentifier():
                raise DeclarationError(f"dimension {s.name!r} is not a Python identifier; "
                                       "kernels need identifiers")
        taken = set(self.variables) | {s.name for s in self.dims}
        clash = taken & (RESERVED | _forward_members())
        if clash:
            raise DeclarationError(f"name(s) {', '.join(sorted(clash))} are reserved by the kernels; "
                                   "rename the variables or dimensions")
        self.taken = set(taken)
        self._next = {}            # hint → the number its last fresh name had (``fresh``)
        self.hints = {node: key for key, node in lay.intermediates.items()}
        self.leaf_names = {}       # node -> name (a @leaf member)
        self.leaf_defs = []        # (name, code, doc)
        self.local_names = None    # node -> name inside the routine being printed
        self.local_defs = None
        self.chain_keys = []       # the factor names of every printed product (``shared_runs``)
        self.refs = _references(program)
        for node in self.refs:              # a named quantity's definition takes its name
            if isinstance(node, E.Named):
                self.hints.setdefault(node.inner, node.name)
        self.size_subs = {s: sp.Symbol(f"s.{s.name}") for s in self.dims}
        self.size_subs[N_BATCH] = sp.Symbol("s.n_batch")
        self._coef_code = {}

    # -- names ------------------------------------------------------------------------
    def fresh(self, hint):
        """The first free name of ``hint``, ``hint_2``, ``hint_3`` …; the search for a hint
        resumes where its last one ended (names are only ever taken, so nothing before it is
        free: the same names as a search from the start, in time linear in the names)."""
        base = _ident(hint) + self.suffix
        k = self._next.get(base, 1)
        name = base if k == 1 else self._numbered(base, k)
        while name in self.taken or name in RESERVED:
            k += 1
            name = self._numbered(base, k)
        self._next[base] = k
        self.taken.add(name)
        return name

    @staticmethod
    def _numbered(base, k):
        return f"{base}_{k}" if not base.endswith(tuple("0123456789")) else f"{base}x{k}"

    def batched(self, node) -> bool:
        return bool(node.free_vars & self.data)

    def depends_on_arguments(self, node) -> bool:
        return any(v.role == "direction" for v in node.free_vars)

    def code(self, node) -> str:
        """The code of a node: a reference when it has a name, else its expression."""
        return self._run(self._code(node))

    def _run(self, top):
        """Run a rule generator and the sub-expressions it asks for on an explicit stack."""
        return run_rules(top, lambda kind, node: self._code(node) if kind == "code" else self._leaf(node))

    def _code(self, node):
        if isinstance(node, E.Var):
            return _var(self, node)
        if node in self.leaf_names:
            return f"s.{self.leaf_names[node]}"
        if self.known and not isinstance(node, E.Constant) and node.key in self.known:
            self.leaf_names[node] = self.known[node.key]
            return f"s.{self.leaf_names[node]}"
        if self.local_names is not None and node in self.local_names:
            return self.local_names[node]
        scaled = _monic_sum(node) if self.local_names is not None else None
        if scaled is not None and self.refs.get(scaled[1], 0) > 1:
            c, monic = scaled                            # c · S with S named once for all c
            return _scaled(self, c, (yield "code", monic))
        if isinstance(node, E.MatMul):                 # a product whose transpose has a name
            t = E.transpose(node)
            if t in self.leaf_names:
                return f"tr(s.{self.leaf_names[t]})"
            if self.local_names is not None and t in self.local_names:
                return f"tr({self.local_names[t]})"
        fn = RULES.get(type(node))
        if fn is None:
            raise NotImplementedError(f"the kernel printer has no rule for {type(node).__name__} "
                                      "(a structured operator in a matrix-view expression)")
        text = fn(self, node)
        if inspect.isgenerator(text):
            text = yield from text
        if self.needs_name(node, text):
            return self.define(node, text)
        return text

    def needs_name(self, node, text):
        if isinstance(node, (E.Var, E.Constant)) or re.fullmatch(r"(s\.)?\w+", text):
            return False
        if isinstance(node, (E.Transpose, E.Scale)):      # views and scalings stay inline
            return len(text) > MAX_INLINE
        return (self.refs.get(node, 0) > 1 or isinstance(node, E.Named) or node in self.hints
                or len(text) > MAX_INLINE)

    def define(self, node, text, force_leaf=False):
        hint = self.hints.get(node) or (node.name if isinstance(node, E.Named) else "t")
        if self.depends_on_arguments(node) and not force_leaf:
            name = self.fresh(hint)
            self.local_names[node] = name
            self.local_defs.append(f"{name} = {text}")
            return name
        name = self.fresh(hint)
        self.leaf_names[node] = name
        self.leaf_defs.append((name, text, _leaf_doc(node, hint)))
        return f"s.{name}"

    def leaf(self, node) -> str:
        """A named leaf (network operands are always names)."""
        return self._run(self._leaf(node))

    def _leaf(self, node):
        if isinstance(node, E.Var):
            return _var(self, node)
        if node in self.leaf_names:
            return f"s.{self.leaf_names[node]}"
        if self.known and node.key in self.known:
            self.leaf_names[node] = self.known[node.key]
            return f"s.{self.leaf_names[node]}"
        text = yield "code", node
        if re.fullmatch(r"s\.\w+", text):
            self.leaf_names[node] = text[2:]
            return text
        return self.define(node, text, force_leaf=True)

    def size(self, d) -> str:
        return self.coef(d)

    def coef(self, c) -> str:
        """A coefficient or size as Python source (cached: the same few recur in every network)."""
        key = sp.sympify(c)
        if key not in self._coef_code:
            self._coef_code[key] = _py(key.subs(self.size_subs))
        return self._coef_code[key]

    # -- members ----------------------------------------------------------------------
    def members(self):
        """The class body: (leaf members, compact members, block members, routine members)."""
        compacts = {node: self.fresh(_compact_hint(node)) for node in self.prog.compact_order}
        blocks = []
        for (p, q, part), terms in self.prog.blocks.items():
            if terms:
                blocks.append(self._block(p, q, part, terms, compacts))
        jacs = [self._jacobian(p, terms, compacts) for p, terms in self.prog.jacobians.items() if terms]
        comps = [self._compact(node, compacts) for node in self.prog.compact_order]
        routines = [self._routine(name, exprs, dirs)
                    for name, (exprs, dirs) in self.prog.routines().items()]
        leaves = [_leaf_member(name, text, doc) for name, text, doc in self.leaf_defs]
        return leaves + comps + blocks + jacs + routines

    def leaf_keys(self):
        """{node key: member name} of every leaf printed (for the parts of a variant)."""
        return {node.key: name for node, name in sorted(self.leaf_names.items(),
                                                          key=lambda kv: kv[1])}

    def _block(self, p, q, part, terms, compacts):
        nets = [self._net(t, "block", compacts) for t in terms]
        sym = {"outer": "H_o", "functional": "H_f"}[part]
        text = short_text(self.prog.derivation.block(p, q, part).expr, 240)
        doc = f"{sym}({p}, {q}) = {text}" if text is not None else \
            f"{sym}({p}, {q}): {len(terms)} networks (the formula: `symhess derive`)"
        return _method(f"block__{p}__{q}__{part}", [], doc, nets)

    def _jacobian(self, p, terms, compacts):
        nets = [self._net(t, "jacobian", compacts) for t in terms]
        return _method(f"jacobian__{p}", [], f"∂vec_r F/∂vec_r {p}, per sequence: "
                       "(batch | atoms of F | atoms of the parameter).", nets)

    def _compact(self, node, compacts):
        terms = self.prog.compacts[node]
        nets = [self._net(t, "compact", compacts, node) for t in terms]
        name = compacts[node]
        body = [f"return Compact({name!r}, ["] + [f"    {n}," for n in nets] + ["])"]
        what = {E.SoftmaxJac: "∂A/∂T", E.SoftmaxHess: "∂²A/∂T²[E]", E.Add: "A sum"}.get(
            type(node), getattr(node, "name", type(node).__name__))
        doc = f"{what} as a compact tensor ({len(nets)} network{'s' * (len(nets) > 1)})."
        return "\n".join(["@leaf", f"def {name}(s):", f'    """{doc}"""'] +
                         ["    " + b for b in body])

    def _routine(self, name, exprs, dirs):
        self.local_names, self.local_defs = {}, []
        for v in dirs:
            self.taken.add(v.name)
        outs = []
        for e in exprs:
            c = self.code(e)
            outs.append(c if name == "check_inputs" else f"mean0({c}, {self.batched(e)})")
        if name == "loss":
            ret = f"{outs[0]}[..., 0, 0]"
        else:
            ret = "(" + ", ".join(outs) + ",)"
        body = self.local_defs + [f"return {ret}"]
        self.local_names = self.local_defs = None
        doc = _ROUTINE_DOCS.get(name.split("__")[0], "").format(part=name.split("__")[-1])
        args = ", ".join(["s"] + [v.name for v in dirs])
        return "\n".join([f"def {name}({args}):", f'    """{doc}"""'] + ["    " + b for b in body])

    def shared_runs(self):
        """{run of named factors: number of printed products holding it} for the runs that
        more than one holds (the class's ``RUNS``; a run and its transpose are one)."""
        counts = {}
        for names in self.chain_keys:
            _, runs = chain.runs(" ".join(names))
            for name in {name for name, _ in runs.values()}:
                counts[name] = counts.get(name, 0) + 1
        return {k: v for k, v in sorted(counts.items()) if v > 1}

    # -- networks ---------------------------------------------------------------------
    def _net(self, t, kind, compacts, node=None):
        letters = {}
        pool = (oe.get_symbol(i) for i in range(10 ** 6))

        def letter(a):
            if a not in letters:
                ch = next(pool)
                while ch == BATCH:
                    ch = next(pool)
                letters[a] = ch
            return letters[a]

        specs, codes, batched_any, carried = [], [], False, set()
        for op in t.operands:
            if op.kind == "leaf":
                b = self.batched(op.ref)
                code = self.leaf(op.ref)
                if not (_plain(op.ref.rows, op.rows) and _plain(op.ref.cols, op.cols)):
                    rs = "(" + "".join(f"{self.size(self.prog.sizes[a])}, " for a in op.rows) + ")"
                    cs = "(" + "".join(f"{self.size(self.prog.sizes[a])}, " for a in op.cols) + ")"
                    code = f"unflat({code}, {rs}, {cs})"
                atoms = op.rows + op.cols
            elif op.kind == "compact":
                b = self.compact_batched(op.ref)
                code = f"s.{compacts[op.ref]}"
                atoms = op.rows
                if any(k != 1 for k in op.cols):      # an axis split into several atoms
                    sizes = "".join(f"{self.size(self.prog.sizes[a])}, " for a in atoms)
                    code = f"refined(s, {code}, ({sizes}), {b})"
            else:
                b, code, atoms = False, op.kind.upper(), op.rows
            batched_any |= b
            specs.append((BATCH if b else "") + "".join(letter(a) for a in atoms))
            if op.kind in ("leaf", "compact"):
                carried |= set(specs[-1])
            codes.append(code)
        groups = ["".join(letter(a) for a in g) for g in t.groups]
        coef = t.coef
        if kind == "block" and batched_any:
            coef = coef / N_BATCH
        if kind == "compact" and self.compact_batched(node):
            groups[0] = BATCH + groups[0]
        if kind == "jacobian":
            groups = [BATCH if self.jacobian_batched() else ""] + groups
        free = {}
        for a, ch in letters.items():
            if ch not in carried:
                free[ch] = self.size(self.prog.sizes[a])
        if BATCH in "".join(groups) and BATCH not in carried:
            free[BATCH] = "s.n_batch"
        spec = ",".join(specs) + "->" + "|".join(groups)
        args = [self.coef(coef), repr(spec)] + codes
        if free:
            args.append("free={" + ", ".join(f"{k!r}: {v}" for k, v in sorted(free.items())) + "}")
        return "net(" + ", ".join(args) + ")"

    def compact_batched(self, node):
        return any(self._term_batched(t) for t in self.prog.compacts[node])

    def _term_batched(self, t):
        for op in t.operands:
            if op.kind == "leaf" and self.batched(op.ref):
                return True
            if op.kind == "compact" and self.compact_batched(op.ref):
                return True
        return False

    def jacobian_batched(self):
        return self.batched(self.prog.derivation.F)


def _forward_members():
    from ..runtime.state import Forward
    return {n for n in dir(Forward) if not n.startswith("__")}


N_BATCH = sp.Symbol("n_batch", positive=True, integer=True)

_ROUTINE_DOCS = {
    "loss": "The loss, batch mean.",
    "gradient": "(∂ℓ/∂W_p for p in the parameters), batch mean.",
    "hvp": "(Σ_q H_{part}(p, q) V_q for p in the parameters), batch mean: matrix view, no block.",
    "check_inputs": "The inputs of the layer's value checks, for every sequence.",
}


def _plain(dim, atoms):
    """Whether a matrix axis enters a network as it is (one atom; not a dropped size-1 axis)."""
    return len(atoms) == 1 and not E.same(dim, 1)


def _references(program):
    """How many distinct parents (and network operands, counted once each) use each node; the
    operand of a scaling counts the scaling's users (a sum writes c · A with A inline)."""
    refs = {}
    roots = program.leaves() + [e for exprs, _ in program.routines().values() for e in exprs]
    nodes = {}
    for r in roots:                     # deterministic order (sets of nodes hash per process)
        for n in E.walk(r, skip=nodes):   # what an earlier root holds is there already
            nodes.setdefault(n, None)
    for node in nodes:
        for a in node.args:
            refs[a] = refs.get(a, 0) + 1
    for r in roots:
        refs[r] = refs.get(r, 0) + 1
    for node in nodes:             # a product and its transpose are one quantity (X V, Vᵀ Xᵀ)
        if isinstance(node, E.MatMul):
            t = E.transpose(node)
            if t in nodes and t is not node and t != node:
                refs[node] = refs[t] = refs.get(node, 0) + refs.get(t, 0)
    for node in nodes:             # c·S₁ and c′·S₁ (scalars sit on a sum's terms) share S₁
        scaled = _monic_sum(node)
        if scaled is not None:
            refs[scaled[1]] = refs.get(scaled[1], 0) + refs.get(node, 0)
    for node in nodes:             # a sum prints c · A as its term: A is used where c · A is
        if isinstance(node, E.Scale) and refs.get(node, 0) > 1:
            refs[node.args[0]] = max(refs.get(node.args[0], 0), refs[node])
    return refs


@lru_cache(maxsize=None)
def _monic_sum(node):
    """(c, S) with a sum = c·S and S's first term unscaled, or None (not a sum, or c = 1)."""
    if not isinstance(node, E.Add):
        return None
    c0 = node.args[0].coef if isinstance(node.args[0], E.Scale) else sp.Integer(1)
    if c0 == 1:
        return None
    return c0, E.add(*(E.scale(1 / c0, t) for t in node.args))


def _compact_hint(node):
    if isinstance(node, E.Named):
        return node.name
    return {E.SoftmaxJac: "dA", E.SoftmaxHess: "d2A"}.get(type(node), "S")


def _leaf_doc(node, hint):
    return ""


def _leaf_member(name, text, doc):
    lines = ["@leaf", f"def {name}(s):"]
    if doc:
        lines.append(f'    """{doc}"""')
    lines.append(f"    return {text}")
    return "\n".join(lines)


def _method(name, args, doc, nets):
    lines = [f"def {name}({', '.join(['s'] + args)}):", f'    """{doc}"""', "    return ["]
    lines += [f"        {n}," for n in nets]
    lines.append("    ]")
    return "\n".join(lines)


def _py(e) -> str:
    """Python source of a scalar sympy expression (symbols already renamed to s.<name>)."""
    return sp.pycode(e, fully_qualified_modules=True)


# ----------------------------------------------------------------------------- matrix rules
def _var(pr, n):
    if n.role == "direction":
        return n.name
    if n.role == "placeholder":
        raise NotImplementedError(f"placeholder {n.name} in a kernel expression")
    return f"s.{n.name}"


@rule(E.Named)
def _named(pr, n):
    return (yield "code", n.inner)


def _codes(nodes):
    """The codes of ``nodes``, in order (a rule's sub-expressions)."""
    out = []
    for x in nodes:
        out.append((yield "code", x))
    return out


def _factors(pr, factors):
    """(codes, chain key) of a product's factors: a factor that does not depend on the
    routine's arguments is a member (``s.name``, or ``tr(s.name)``) and is named in the key
    (``name``, ``name'``), any other one is ``_`` (``Forward.mm`` shares the products of
    named runs).  Every key is recorded for the class's ``RUNS``."""
    codes, names = [], []
    for x in factors:
        if pr.depends_on_arguments(x):
            codes.append((yield "code", x))
            names.append("_")
        elif isinstance(x, E.Transpose):
            inner = yield "leaf", x.args[0]
            codes.append(f"tr({inner})")
            names.append(inner[2:] + "'")
        else:
            codes.append((yield "leaf", x))
            names.append(codes[-1][2:])
    pr.chain_keys.append(tuple(names))
    return codes, " ".join(names)


@rule(E.MatMul)
def _matmul(pr, n):
    """Products bracketed at run time (``Forward.mm``, products of named runs shared); an
    all-ones factor becomes row/column sums: P 1 Q = rowsum(P) · colsum(Q)."""
    f = list(n.args)
    j = next((i for i, x in enumerate(f) if isinstance(x, E.Ones)), None)
    if j is None:
        codes, names = yield from _factors(pr, f)
        return f"s.mm({names!r}, " + ", ".join(codes) + ")"
    left, ones, right = f[:j], f[j], f[j + 1:]
    lv = (yield from _summed(pr, left, "sum_last")) if left else None
    rv = (yield from _summed(pr, right, "sum_rows")) if right else None
    if lv and rv:
        return f"{lv} * {rv}"
    if lv:
        return lv if E.same(ones.cols, 1) else f"bcast_last({lv}, {pr.size(ones.cols)})"
    if rv:
        return rv if E.same(ones.rows, 1) else f"bcast_rows({rv}, {pr.size(ones.rows)})"
    return f"ones(({pr.size(n.rows)}, {pr.size(n.cols)}), s.like)"


def _summed(pr, factors, how):
    """P 1 (``sum_last``) or 1ᵀ Q (``sum_rows``) of a product: the factor next to the ones is
    summed first, so the product is a vector's (1ᵀ A B = (1ᵀ A) B costs a row of A B)."""
    at = -1 if how == "sum_last" else 0
    if len(factors) == 1:
        return f"{how}({(yield 'code', E.matmul(*factors))})"
    near = f"{how}({(yield 'code', factors[at])})"
    rest = factors[:-1] if at == -1 else factors[1:]
    codes, names = yield from _factors(pr, rest)
    if at == -1:
        return f"s.mm({(names + ' _')!r}, " + ", ".join(codes + [near]) + ")"
    return f"s.mm({('_ ' + names)!r}, " + ", ".join([near] + codes) + ")"


def _shared_end(terms):
    """(side, positions) of the largest group (≥ 2) of plain product terms that share their
    last ("r") or first ("l") factor, the last factor preferred; None if there is none."""
    best = None
    for side, at in (("r", -1), ("l", 0)):
        groups = {}
        for i, t in enumerate(terms):
            core = E._split(t)[1]
            if isinstance(core, E.MatMul) and not any(isinstance(x, E.Ones) for x in core.args):
                groups.setdefault(core.args[at], []).append(i)
        for members in groups.values():
            if len(members) >= 2 and (best is None or len(members) > len(best[1])):
                best = (side, members)
    return best


@rule(E.Add)
def _add(pr, n):
    """A sum; in a routine, the product terms that share an end factor go to ``mm_sum``,
    which factors them out when that multiplies less at the call's sizes."""
    shared = _shared_end(n.args) if pr.local_names is not None else None
    if shared is not None:
        side, members = shared
        items = []
        for i in members:
            c, core = E._split(n.args[i])
            codes, names = yield from _factors(pr, core.args)
            items.append(f"({_py_coef(pr, c)}, {names!r}, " + ", ".join(codes) + ")")
        head = f"s.mm_sum({side!r}, " + ", ".join(items) + ")"
        rest = [t for i, t in enumerate(n.args) if i not in members]
        if not rest:
            return head
        return "(" + head + " + " + (yield "code", E.add(*rest)) + ")"
    out = []
    for t in n.args:
        c, core = E._split(t)
        neg = sp.sympify(c).could_extract_minus_sign()
        body = _scaled(pr, -c if neg else c, (yield "code", core))
        out.append(("- " if neg else "+ ") + body)
    text = " ".join(out)
    return "(" + (text[2:] if text.startswith("+ ") else "-" + text[2:]) + ")"


def _py_coef(pr, c):
    """A term's coefficient as Python source."""
    c = sp.sympify(c)
    return "1" if c == 1 else f"({pr.coef(c)})"


def _scaled(pr, c, code):
    c = sp.sympify(c)
    if c == 1:
        return code
    return f"{pr.coef(c)} * {code}" if c.is_Number and c > 0 else f"({pr.coef(c)}) * {code}"


@rule(E.Scale)
def _scale(pr, n):
    c = sp.sympify(n.coef)
    inner = yield "code", n.args[0]
    if c == -1:
        return f"(-{inner})"
    return _scaled(pr, c, inner)


@rule(E.Transpose)
def _transpose(pr, n):
    return f"tr({(yield 'code', n.args[0])})"


@rule(E.Hadamard)
def _hadamard(pr, n):
    return "(" + " * ".join((yield from _codes(n.args))) + ")"


@rule(E.Elementwise)
def _elementwise(pr, n):
    return scalar_code(n.fn.expr, (yield "code", n.args[0]))


@rule(E.SoftmaxRows)
def _softmax(pr, n):
    t = yield "code", n.args[0]
    extra = (", causal=True" if n.causal else "") + \
        (f", mask={(yield 'code', n.mask)}" if n.mask is not None else "")
    return f"softmax_rows({t}{extra})"


@rule(E.LogSoftmaxRows)
def _log_softmax(pr, n):
    return f"log_softmax_rows({(yield 'code', n.args[0])})"


@rule(E.SoftmaxDiff)
def _softmax_diff(pr, n):
    a, e = yield from _codes(n.args)
    return f"softmax_diff({a}, {e})"


@rule(E.SoftmaxDiff2)
def _softmax_diff2(pr, n):
    return "softmax_diff2(" + ", ".join((yield from _codes(n.args))) + ")"


@rule(E.Identity)
def _identity(pr, n):
    return f"eye({pr.size(n.rows)}, s.like)"


@rule(E.Zero)
def _zero(pr, n):
    return f"zeros(({pr.size(n.rows)}, {pr.size(n.cols)}), s.like)"


@rule(E.Ones)
def _ones(pr, n):
    return f"ones(({pr.size(n.rows)}, {pr.size(n.cols)}), s.like)"


@rule(E.CausalMask)
def _causal_mask(pr, n):
    return f"causal_mask({pr.size(n.rows)}, s.like)"


@rule(E.Diag)
def _diag(pr, n):
    return f"diag({(yield 'code', n.args[0])})"


@rule(E.DiagPart)
def _diag_part(pr, n):
    return f"diag_part({(yield 'code', n.args[0])})"


@rule(E.VecR)
def _vec_r(pr, n):
    return f"vec_r({(yield 'code', n.args[0])})"


@rule(E.UnvecR)
def _unvec_r(pr, n):
    return f"unvec_r({(yield 'code', n.args[0])}, {pr.size(n.rows)}, {pr.size(n.cols)})"


@rule(E.Kron)
def _kron(pr, n):
    return "kron(" + ", ".join((yield from _codes(n.args))) + ")"


@rule(E.KronContract)
def _kron_contract(pr, n):
    side, rows, cols = n.params
    g, c = yield from _codes(n.args)
    return f"kron_contract({g}, {c}, {side!r}, {pr.size(rows)}, {pr.size(cols)})"


@rule(E.Commutation)
def _commutation(pr, n):
    m, k = n.params
    return f"commutation({pr.size(m)}, {pr.size(k)}, s.like)"


@rule(E.DiagSelector)
def _diag_selector(pr, n):
    return f"diag_selector({pr.size(n.params[0])}, s.like)"


# ----------------------------------------------------------------------------- scalar functions
_FUNCTIONS = {"exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "cosh": "cosh",
              "sinh": "sinh", "cos": "cos", "sin": "sin", "abs": "absolute", "erf": "erf",
              "sigmoid": "sigmoid"}


def scalar_code(expr, arg):
    """An entrywise sympy function of x as code applied to ``arg``."""
    if not re.fullmatch(r"[\w.]+", arg):
        arg = f"({arg})"

    def p(e):
        if e == scalarfn.x:
            return arg
        if e.is_number:
            return repr(float(e))
        if isinstance(e, sp.Add):
            return "(" + " + ".join(p(a) for a in e.args) + ")"
        if isinstance(e, sp.Mul):
            return "(" + " * ".join(p(a) for a in e.args) + ")"
        if isinstance(e, sp.Pow):
            base, ex = e.args
            if ex == sp.Rational(1, 2):
                return f"sqrt({p(base)})"
            if ex in (2, 3):                         # a product: pow is several times slower
                b = p(base)
                return "(" + " * ".join([b] * int(ex)) + ")"
            return f"({p(base)} ** {p(ex)})"
        if isinstance(e, sp.Heaviside):
            h0 = e.args[1] if len(e.args) > 1 else sp.Rational(1, 2)
            return f"heaviside({p(e.args[0])}, {float(h0)!r})"
        name = type(e).__name__.lower()
        if name in _FUNCTIONS and len(e.args) == 1:
            return f"{_FUNCTIONS[name]}({p(e.args[0])})"
        raise NotImplementedError(f"the kernel printer cannot print {e} ({type(e).__name__}) "
                                  "in an entrywise function")
    return p(expr)

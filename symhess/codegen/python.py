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

The matrix rules are generators: a rule *yields* ``("code", node)`` (the full array),
``("ccode", node)`` (its compressed form: a per-token column or row kept as such,
``Printer.form``) or ``("leaf", node)`` for each sub-expression it prints and receives its
text; ``Printer.code``, ``ccode`` and ``leaf`` run them on an explicit stack, in the order a
recursive printer would, so deep expressions do not meet Python's recursion limit.
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
from ..expr.stackwalk import children_first, run_rules
from ..runtime import chain
from ..expr.text import short_text
from . import content

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
        ``suffix``: appended to every name this printer makes; a part's own leaves and
        compacts are then renamed by their content (``codegen.content``: what two parts both
        define, a state holds once)."""
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
        self.local_refs = None     # node -> users inside the routine being printed (``uses``)
        self.routine = None        # the name of the routine being printed
        self.chain_keys = []       # (routine or None, factor names) of every printed product
        self.forms = {}            # node -> "row" | "col" | None (``form``)
        self.full_leaf = {}        # compressed node -> name of its broadcast (full) leaf
        roots = program.leaves() + [e for exprs, _ in program.routines().values() for e in exprs]
        self.summands = _subsums(roots)
        self.refs, self.twins = _references(roots, self.summands)
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

    def uses(self, node) -> int:
        """How many users ``node`` has where it is printed: inside a routine, a node that
        depends on the routine's arguments is formed there and nowhere else, so its users in
        that routine; any other node (a leaf, shared by every routine of a state), its users
        in the whole module."""
        if self.local_refs is not None and self.depends_on_arguments(node):
            return self.local_refs.get(node, 0)
        return self.refs.get(node, 0)

    def form(self, node):
        """"row" for a matrix constant along each row (P 1ᵀ, and entrywise functions, sums
        and products of such): printed as its (…, R, 1) column and broadcast only where a full
        array is needed; "col" for one constant down each column ((…, 1, C)); None otherwise.
        Per-token reductions (row sums, variances, their powers) are then computed on R
        entries, not R·C."""
        if node not in self.forms:                # children first (those not known yet)
            for n in children_first(node, lambda n: _form_kids(self, n), skip=self.forms):
                self.forms[n] = _form(self, n)
        return self.forms[node]

    def code(self, node) -> str:
        """The code of a node as a full array (a compressed form broadcast, a view)."""
        return self._run(self._code(node))

    def ccode(self, node) -> str:
        """The code of a node in its compressed form (``form``)."""
        return self._run(self._ccode(node))

    def leaf(self, node) -> str:
        """A named leaf holding the full array (``_leaf``)."""
        return self._run(self._leaf(node))

    def _run(self, top):
        """Run a rule generator and the sub-expressions it asks for on an explicit stack
        (requests: ``("code" | "ccode" | "leaf", node)``)."""
        steps = {"code": self._code, "ccode": self._ccode, "leaf": self._leaf}
        return run_rules(top, lambda kind, node: steps[kind](node))

    def widened(self, node, text):
        f = self.form(node)
        if f == "row":
            return f"bcast_last({text}, {self.size(node.cols)})"
        if f == "col":
            return f"bcast_rows({text}, {self.size(node.rows)})"
        return text

    def _code(self, node):
        return self.widened(node, (yield "ccode", node))

    def _ccode(self, node):
        """The code of a node in its compressed form (``form``): a reference when it has a
        name, else its expression.  In a routine, a sub-expression that does not depend on
        the arguments is a leaf (computed once per prepared state)."""
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
        if scaled is not None and self.uses(scaled[1]) > 1:
            c, monic = scaled                            # c · S with S named once for all c
            text = _scaled(self, c, (yield "ccode", monic))
            if self.uses(node) > 1 and self.depends_on_arguments(node):
                return self.define(node, text)           # one pass for all its users
            return text
        twin = self.named_twin(node)
        if twin is not None:
            return f"tr({twin})"
        fn = RULES.get(type(node))
        if fn is None:
            raise NotImplementedError(f"the kernel printer has no rule for {type(node).__name__} "
                                      "(a structured operator in a matrix-view expression)")
        text = fn(self, node)
        if inspect.isgenerator(text):
            text = yield from text
        if self.needs_name(node, text):
            return self.define(node, text)
        if self.local_names is not None and not self.depends_on_arguments(node) and \
                not isinstance(node, (E.Transpose, E.Scale, E.Constant)) and \
                not re.fullmatch(r"(s\.)?\w+", text):
            return self.define(node, text, force_leaf=True)
        return text

    def named_twin(self, node):
        """The name of Pᵀ when this node is P and Pᵀ was computed already (the algebra
        pushes transposes to the leaves, so (A B)ᵀ is the separate node Bᵀ Aᵀ)."""
        t = self.twins.get(node)
        if t is None:
            return None
        if t in self.leaf_names:
            return f"s.{self.leaf_names[t]}"
        if self.local_names is not None and t in self.local_names:
            return self.local_names[t]
        return None

    def needs_name(self, node, text):
        if isinstance(node, (E.Var, E.Constant)) or re.fullmatch(r"(s\.)?\w+", text):
            return False
        if isinstance(node, (E.Transpose, E.Scale)):      # views and scalings stay inline
            return len(text) > MAX_INLINE
        return (self.uses(node) > 1 or isinstance(node, E.Named) or node in self.hints
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

    def _leaf(self, node):
        """A named leaf holding the full array (network operands and product factors are
        always names; a compressed node gets a second leaf, its broadcast view)."""
        if isinstance(node, E.Var):
            return _var(self, node)
        if self.form(node):
            if node not in self.full_leaf:
                c = yield "ccode", node
                if not re.fullmatch(r"s\.\w+", c):
                    c = self.define(node, c, force_leaf=True)
                name = self.fresh(self.hints.get(node) or "t")
                self.full_leaf[node] = name
                self.leaf_defs.append((name, self.widened(node, c), ""))
            return f"s.{self.full_leaf[node]}"
        if node in self.leaf_names:
            return f"s.{self.leaf_names[node]}"
        if self.known and node.key in self.known:
            self.leaf_names[node] = self.known[node.key]
            return f"s.{self.leaf_names[node]}"
        text = yield "ccode", node
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
        out = leaves + comps + blocks + jacs + routines
        if not self.suffix:
            return out
        own = dict(zip([name for name, _, _ in self.leaf_defs], leaves))
        own.update(zip([compacts[node] for node in self.prog.compact_order], comps))
        return content.by_content(out, own, self.suffix)

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
        self.local_refs = _references(exprs, self.summands)[0]
        self.routine = name
        for v in dirs:
            self.taken.add(v.name)
        outs = []
        params = self.prog.derivation.layer.param_names
        for i, e in enumerate(exprs):
            text = self.code(e) if name == "check_inputs" else self._run(_mean_code(self, e))
            if name in ("gradient",) or name.startswith("hvp__"):
                out = _ident(f"out_{params[i]}")
                out = out if out not in self.taken else self.fresh(out)
                self.local_defs.append(f"{out} = {text}")
                text = out
            outs.append(text)
        if name == "loss":
            ret = f"{outs[0]}[..., 0, 0]"
        else:
            ret = "(" + ", ".join(outs) + ",)"
        body = self.local_defs + [f"return {ret}"]
        self.local_names = self.local_defs = self.local_refs = self.routine = None
        doc = _ROUTINE_DOCS.get(name.split("__")[0], "").format(part=name.split("__")[-1])
        args = ", ".join(["s"] + [v.name for v in dirs])
        return "\n".join([f"def {name}({args}):", f'    """{doc}"""'] + ["    " + b for b in body])

    def shared_runs(self):
        """{run of named factors: number of printed products holding it} for the runs that
        more than one holds (the class's ``RUNS``; a run and its transpose are one).  A run
        holding a routine's local lives for one call of one routine: its count is that of the
        routine holding it most (the routines' arguments have the same names in each)."""
        counts, local = {}, {}
        for routine, names in self.chain_keys:
            _, runs = chain.runs(" ".join(names))
            for name in {name for name, _ in runs.values()}:
                if "@" in name:
                    local[routine, name] = local.get((routine, name), 0) + 1
                else:
                    counts[name] = counts.get(name, 0) + 1
        for (_, name), n in local.items():
            counts[name] = max(counts.get(name, 0), n)
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


def _references(roots, summands):
    """How many distinct parents (and roots, counted once each) use each node, a sum with
    shared sub-sums (``summands``) counting as the parent of those and of its other terms;
    the operand of a scaling counts the scaling's users (a sum writes c · A with A inline)."""
    refs, nodes = {}, {}
    stack = list(reversed(roots))
    while stack:                        # deterministic order (sets of nodes hash per process)
        node = stack.pop()
        if node in nodes:
            continue
        nodes[node] = _children(node, summands)
        stack.extend(reversed(nodes[node]))
    parents = {}
    for node, kids in nodes.items():
        for a in kids:
            parents.setdefault(a, []).append(node)
    twins = {}                     # P and Pᵀ both in the DAG: one is computed, the other is tr(…)
    for node in _children_first(roots):   # (transposes memoised children first: no deep recursion)
        if node not in nodes:
            continue
        if isinstance(node, (E.Var, E.Transpose, E.Scale, E.Constant, E.Ones, E.Identity)) or node in twins:
            continue
        t = E.transpose(node)
        if t != node and t in nodes:
            twins[node], twins[t] = t, node
    rep = {}                       # a parent and its twin are one user (the twin is tr(…) of it)
    for node in nodes:
        rep[node] = rep.get(twins.get(node), node) if node in twins else node
    for node in nodes:
        users = {rep[m] for m in parents.get(node, ())} | {rep[m] for m in parents.get(twins.get(node), ())}
        if users:
            refs[node] = len(users)
    for r in roots:
        refs[r] = refs.get(r, 0) + 1
        if r in twins:
            refs[twins[r]] = refs.get(twins[r], 0) + 1
    for node in nodes:             # c·S₁ and c′·S₁ (scalars sit on a sum's terms) share S₁
        scaled = _monic_sum(node)
        if scaled is not None:
            refs[scaled[1]] = refs.get(scaled[1], 0) + refs.get(node, 0)
    for node in nodes:             # a sum prints c · A as its term: A is used where c · A is
        if isinstance(node, E.Scale) and refs.get(node, 0) > 1:
            refs[node.args[0]] = max(refs.get(node.args[0], 0), refs[node])
    return refs, twins


def _children_first(roots):
    """Every node below ``roots`` once, children before parents (``E.walk``), in a
    deterministic order."""
    order, seen = [], {}
    for r in roots:
        for node in E.walk(r, skip=seen):
            seen[node] = None
            order.append(node)
    return order


def _children(node, summands):
    if node in summands:
        return [t for _, t in summands[node]]
    return list(node.args)


def _subsums(roots):
    """{sum: [(c, term)]} for the sums that contain another sum of the DAG up to a common
    factor: Σ_t c_t x_t = r·(Σ_{t∈S} c′_t x_t) + Σ_{t∉S} c_t x_t when some sum S has c_t = r c′_t
    on all its terms (LayerNorm's centring writes u − (1/d) rowsum(u) 1ᵀ with u's terms
    spelled out in both; the algebra spreads a scalar over a sum's terms, so 2/d·u is a sum
    of its own).  The largest such S is taken first, then the largest in what is left.
    Sums that are multiples of one monic sum S (first coefficient 1, ``_monic_sum``) that is
    no sum of the DAG refer to S when there are two or more.  A whole sum n = r·m is taken
    only for m monic and n not, so these references, like the printer's c·S for a monic S, lead to monic sums, which
    refer to none by a whole match.  The monic S of a sum c·S (which the printer writes as
    c · S when S is shared) is split like the sums of the DAG.  Terminates: each partial step
    leaves fewer terms."""
    order = [node for node in _children_first(roots) if isinstance(node, E.Add)]
    terms = {n: dict(E._split(t)[::-1] for t in n.args) for n in order}
    rank = {n: i for i, n in enumerate(order)}
    by_core = {}
    for n in order:
        for core in terms[n]:
            by_core.setdefault(core, []).append(n)

    def split(n, tn):
        left, items = dict(tn), []
        while len(left) >= 2:
            best = None
            first = {m for core in left for m in by_core.get(core, ())}
            for m in sorted(first, key=rank.get):
                tm = terms[m]
                if m is n or len(tm) < 2 or len(tm) > len(left) or (len(tm) == len(tn) and (
                        _monic_sum(n) is None or _monic_sum(m) is not None)):
                    continue                    # a whole sum: r·m for m monic, n not
                r = _ratio(left, tm)
                if r is not None and (best is None or len(tm) > len(terms[best[0]])):
                    best = (m, r)
            if best is None:
                break
            m, r = best
            items.append((r, m))
            for core in terms[m]:
                del left[core]
        return items + [(c, core) for core, c in left.items()] if items else None

    out = {}
    for n in order:
        items = split(n, terms[n])
        if items:
            out[n] = items
    for n in order:                # the monic S of c·S (printed as c · S, ``Printer._ccode``):
        ms = _monic_sum(n)         # the same shared sub-sums, by name
        if ms is not None and ms[1] not in rank and ms[1] not in out:
            items = split(ms[1], dict(E._split(t)[::-1] for t in ms[1].args))
            if items:
                out[ms[1]] = items
    monic = {}                     # c·S and c′·S with their monic S in no sum of the DAG: S
    for n in order:                # is a sum of its own, their one child
        ms = _monic_sum(n) if n not in out else None
        if ms is not None and ms[1] not in rank:
            monic.setdefault(ms[1], []).append((n, ms[0]))
    for monic_sum, users in monic.items():
        if len(users) >= 2:
            for n, c in users:
                out[n] = [(c, monic_sum)]
    return out


def _ratio(have, sub):
    """r with have[t] = r·sub[t] for every term t of ``sub`` (all in ``have``), else None."""
    r = None
    for core, c in sub.items():
        if core not in have:
            return None
        q = sp.cancel(sp.sympify(have[core]) / sp.sympify(c))
        if r is None:
            r = q
        elif sp.cancel(q - r) != 0:
            return None
    return r


def _form_kids(pr, n):
    """The nodes whose forms ``_form`` reads for ``n``."""
    if isinstance(n, (E.Scale, E.Named, E.Elementwise, E.Transpose)):
        return [n.args[0]]
    if isinstance(n, E.Add) and n in pr.summands:
        return [t for _, t in pr.summands[n]]
    if isinstance(n, (E.Add, E.Hadamard)):
        return list(n.args)
    return []


def _form(pr, n):
    """See ``Printer.form`` (the forms of ``_form_kids(n)`` are known)."""
    if isinstance(n, E.MatMul):
        f = list(n.args)
        j = next((i for i, x in enumerate(f) if isinstance(x, E.Ones)), None)
        if j is None:
            return None
        left, right = f[:j], f[j + 1:]
        if left and not right and not E.same(f[j].cols, 1):
            return "row"
        if right and not left and not E.same(f[j].rows, 1):
            return "col"
        return None
    if isinstance(n, (E.Scale, E.Named, E.Elementwise)):
        return pr.form(n.args[0])
    if isinstance(n, E.Transpose):
        return {"row": "col", "col": "row"}.get(pr.form(n.args[0]))
    if isinstance(n, (E.Add, E.Hadamard)):
        kids = pr.summands.get(n) if isinstance(n, E.Add) else None
        forms = {pr.form(a) for a in ([t for _, t in kids] if kids else n.args)}
        return forms.pop() if len(forms) == 1 else None
    return None


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
    return (yield "ccode", n.inner)


def _codes(nodes, kind="code"):
    """The codes of ``nodes``, in order (a rule's sub-expressions; ``kind``: "ccode" for
    their compressed forms)."""
    out = []
    for x in nodes:
        out.append((yield kind, x))
    return out


def _factors(pr, factors):
    """(codes, chain key) of a product's factors: a factor that does not depend on the
    routine's arguments is a member (``s.name``, or ``tr(s.name)``) and is named in the key
    (``name``, ``name'``); one that does is ``@name`` (``@name'``) when it is a local of the
    routine, else ``_`` (``Forward.mm`` shares the products of named runs, those holding a
    local within one call).  Every key is recorded for the class's ``RUNS``."""
    codes, names = [], []
    for x in factors:
        if pr.depends_on_arguments(x):
            codes.append((yield "code", x))
            local = re.fullmatch(r"(\w+)|tr\((\w+)\)", codes[-1])
            names.append("_" if local is None else f"@{local[1]}" if local[1] else f"@{local[2]}'")
        elif isinstance(x, E.Transpose) or (pr.named_twin(x) or "").startswith("s."):
            inner = (yield "leaf", x.args[0]) if isinstance(x, E.Transpose) else pr.named_twin(x)
            codes.append(f"tr({inner})")
            names.append(inner[2:] + "'")
        else:
            codes.append((yield "leaf", x))
            names.append(codes[-1][2:])
    pr.chain_keys.append((pr.routine, tuple(names)))
    return codes, " ".join(names)


@rule(E.MatMul)
def _matmul(pr, n):
    """Products bracketed at run time (``Forward.mm``, products of named runs shared).  An
    all-ones factor 1_k 1_mᵀ splits the chain: P 1 Q = (P 1_k)(1_mᵀ Q), each side a chain
    ending (starting) with a ones vector, so P 1_k is matrix–vector products from the right
    (X' A' t 1: t 1 first), never P itself; P 1 alone is kept as its column (``form``)."""
    c, f = _hoisted_factors(pr, n.args)         # scalars of shared sums onto the result
    return _scaled(pr, c, (yield from _chain_code(pr, f, n)))


def _chain_code(pr, f, n):
    """The code of the product of the factors ``f`` (of the product ``n``), all-ones factors
    split (``_matmul``)."""
    j = next((i for i, x in enumerate(f) if isinstance(x, E.Ones)), None)
    if j is None:
        codes, names = yield from _factors(pr, f)
        return f"s.mm({names!r}, " + ", ".join(codes) + ")"
    left, ones, right = f[:j], f[j], f[j + 1:]
    if left and right:
        codes, names = yield from _factors(pr, _chain_factors(pr, f))
        return f"s.mm({names!r}, " + ", ".join(codes) + ")"
    if left:
        return (yield from _ones_chain(pr, left, ones.rows, "r"))
    if right:
        return (yield from _ones_chain(pr, right, ones.cols, "l"))
    return f"ones(({pr.size(n.rows)}, {pr.size(n.cols)}), s.like)"


def _chain_factors(pr, factors):
    """The factors of a product with each all-ones factor 1_k 1_mᵀ written as its two
    vectors, so the chain's order sees the rank-one structure (P 1 1ᵀ Q costs L (d + d_ff)
    as (P 1)(1ᵀ Q), and a sum of such terms shares Q with the others, ``mm_sum``)."""
    out = []
    for x in factors:
        if not isinstance(x, E.Ones):
            out.append(x)
            continue
        for v in ((E.ones(x.rows, 1),) if E.same(x.cols, 1) else (E.ones(1, x.cols),) if E.same(x.rows, 1)
                  else (E.ones(x.rows, 1), E.ones(1, x.cols))):
            pr.hints.setdefault(v, "one")
            out.append(v)
    return out


def _ones_chain(pr, factors, k, side):
    """F₁⋯F_j 1_k (``side`` "r") or 1_kᵀ F₁⋯F_j ("l") as one chain."""
    if E.same(k, 1):
        return (yield "code", E.matmul(*factors))
    one = E.ones(k, 1) if side == "r" else E.ones(1, k)
    pr.hints.setdefault(one, "one")
    chain = list(factors) + [one] if side == "r" else [one] + list(factors)
    codes, names = yield from _factors(pr, chain)
    return f"s.mm({names!r}, " + ", ".join(codes) + ")"


def _shared_end(pr, terms):
    """(side, positions) of the largest group (≥ 2) of product terms that share their last
    ("r") or first ("l") factor (all-ones factors split, ``_chain_factors``), the last factor
    preferred; None if there is none.  Per-token columns and rows (``form``) stay out."""
    best = None
    for side, at in (("r", -1), ("l", 0)):
        groups = {}
        for i, t in enumerate(terms):
            core = E._split(t)[1]
            if isinstance(core, E.MatMul) and pr.form(core) is None:
                groups.setdefault(_chain_factors(pr, core.args)[at], []).append(i)
        for members in groups.values():
            if len(members) >= 2 and (best is None or len(members) > len(best[1])):
                best = (side, members)
    return best


@rule(E.Add)
def _add(pr, n):
    """A sum, its shared sub-sums by name (``_subsums``).  In a routine, the product terms
    that share an end factor go to ``mm_sum``, which factors them out when that multiplies
    less at the call's sizes.  The other terms are one ``lin`` call: a fresh array and one
    in-place pass per term (c·x ∘ y included), instead of a pass per scaling, product and +."""
    return (yield from _sum_code(pr, n))


def _sum_code(pr, n, mean=False):
    """The code of the sum ``n``; ``mean``: of its batch mean, each product's batch folded
    into its last product (``Forward.mm(…, mean=True)``)."""
    items = pr.summands.get(n) or [E._split(t) for t in n.args]
    head = None
    shared = _shared_end(pr, [E.scale(c, t) for c, t in items]) if pr.local_names is not None else None
    if shared is not None:
        side, members = shared
        parts = []
        for i in members:
            c, core = items[i]
            c2, factors = _hoisted_factors(pr, _chain_factors(pr, core.args))
            codes, names = yield from _factors(pr, factors)
            c = sp.sympify(c) * c2
            parts.append(f"({_py_coef(pr, c)}, {names!r}, " + ", ".join(codes) + ")")
        flag = ", mean=True" if mean else ""
        head = f"s.mm_sum({side!r}, " + ", ".join(parts) + flag + ")"
        items = [it for i, it in enumerate(items) if i not in members]
        if not items:
            return head

    def code(t):
        return (yield from _mean_code(pr, t)) if mean else (yield "ccode", t)
    if head is None and len(items) == 2 and all(sp.sympify(c) in (1, -1) for c, _ in items) \
            and sp.sympify(items[0][0]) == 1 and (mean or not any(_deferred(pr, t) or
                                                                  _fused(pr, t) for _, t in items)):
        a = yield from code(items[0][1])
        b = yield from code(items[1][1])
        return f"({a} {'+' if sp.sympify(items[1][0]) == 1 else '-'} {b})"
    if head is None and len(items) == 1:
        return _scaled(pr, items[0][0], (yield from code(items[0][1])))
    terms = []
    for c, t in items:
        terms.append((yield from _lin_term(pr, c, t, mean)))
    if head is not None:
        terms.insert(0, f"(1, {head})")
    return "lin(" + ", ".join(terms) + ")"


def _mean_code(pr, e):
    """The code of the batch mean of a routine's output: a product (or a sum of products)
    without a name of its own folds the batch into its last product, so the per-sequence
    products (n × rows × columns) are never written (a weight gradient Σ_n X_nᵀ G_n as one
    product over the n·L tokens)."""
    if not pr.batched(e):
        return (yield "code", e)
    c, core = E._split(e)
    if pr.form(core):
        return _scaled(pr, c, pr.widened(core, f"mean0({(yield 'ccode', core)}, True)"))
    named = (core in pr.leaf_names or (pr.local_names is not None and core in pr.local_names)
             or pr.uses(core) > 1 or core in pr.hints)
    if not named and pr.form(core) is None:
        if isinstance(core, E.MatMul) and not any(isinstance(x, E.Ones) for x in core.args):
            codes, names = yield from _factors(pr, core.args)
            return _scaled(pr, c, f"s.mm({names!r}, " + ", ".join(codes) + ", mean=True)")
        if isinstance(core, E.Add):
            return _scaled(pr, c, (yield from _sum_code(pr, core, mean=True)))
    return f"mean0({(yield 'code', e)}, True)"


def _lin_term(pr, c, t, mean=False):
    """One term of ``lin``: (c, x) or (c, x, y) for c·x ∘ y (the factors of a product that
    has no name of its own, per-token columns first); ``mean``: of the batch mean."""
    coef = pr.coef(c)
    if mean:
        return f"({coef}, {(yield from _mean_code(pr, t))})"
    scaled = _monic_sum(t) if pr.local_names is not None and t not in pr.local_names else None
    if scaled is not None and pr.uses(scaled[1]) > 1:       # c·(c′·S) as (c c′, S)
        return f"({pr.coef(sp.sympify(c) * scaled[0])}, {(yield 'ccode', scaled[1])})"
    if _deferred(pr, t):
        c2, factors = _hoisted_factors(pr, t.args)
        coef = pr.coef(sp.sympify(c) * c2) if c2 != 1 else coef
        codes, names = yield from _factors(pr, factors)
        return f"({coef}, s.prod({names!r}, " + ", ".join(codes) + "))"
    if _fused(pr, t):
        c2, t = _hoisted(pr, t)
        c3, fs = _hadamard_factors(pr, t)
        coef = pr.coef(sp.sympify(c) * c2 * c3) if c2 * c3 != 1 else coef
        codes = yield from _codes(fs, "ccode")
        x = codes[0] if len(codes) == 2 else _product(codes[:-1])
        return f"({coef}, {x}, {codes[-1]})"
    return f"({coef}, {(yield 'ccode', t)})"


def _fused(pr, t):
    """Whether the term t of a sum is an entrywise product without a name of its own: ``lin``
    takes it as (c, x, y) and adds x ∘ y in the pass that adds it (``addcmul``), never as an
    array of its own."""
    return isinstance(t, E.Hadamard) and not (pr.uses(t) > 1 or t in pr.hints or t in pr.leaf_names
                                              or (pr.local_names is not None and t in pr.local_names))


def _hoisted(pr, node):
    """(c, node′) with node = c · node′, where node′ writes each factor c′ · S of a routine's
    product (a multiple of a shared monic sum S, which ``_ccode`` prints as c′ · S) as S: the
    scalar then scales the product's result or its term's coefficient, not a pass of its own
    over S.  (1, node) when there is none."""
    one = sp.Integer(1)
    if pr.local_names is None or node in pr.local_names or not pr.depends_on_arguments(node):
        return one, node
    if isinstance(node, E.Hadamard):
        c, fs = one, []
        for f in node.args:
            cf, g = _hoisted(pr, f) if not isinstance(f, E.Hadamard) else (one, f)
            c, fs = c * cf, fs + [g]
        return (c, E.hadamard(*fs)) if c != 1 else (one, node)
    items = pr.summands.get(node) if isinstance(node, E.Add) else None
    if items and len(items) == 1:                       # a sum printed as c · S
        return items[0]
    scaled = _monic_sum(node)
    if scaled is not None and pr.uses(scaled[1]) > 1:
        return scaled
    return one, node


def _hoisted_factors(pr, factors):
    """(c, factors′): the product of ``factors`` is c times that of factors′, each factor
    ``_hoisted``."""
    c, out = sp.Integer(1), []
    for x in factors:
        cx, g = _hoisted(pr, x)
        c, out = c * cx, out + [g]
    return c, out


def _deferred(pr, t):
    """Whether the term t of a routine's sum is a product to accumulate into the sum
    (``Forward.prod``): it depends on the arguments, has no name of its own and no all-ones
    factor, and is a full array."""
    return (pr.local_names is not None and isinstance(t, E.MatMul) and pr.depends_on_arguments(t)
            and not any(isinstance(x, E.Ones) for x in t.args) and pr.form(t) is None
            and not (pr.uses(t) > 1 or t in pr.hints or t in pr.local_names
                     or pr.named_twin(t) is not None))


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
    inner = yield "ccode", n.args[0]
    if c == -1:
        return f"(-{inner})"
    return _scaled(pr, c, inner)


@rule(E.Transpose)
def _transpose(pr, n):
    return f"tr({(yield 'ccode', n.args[0])})"


@rule(E.Hadamard)
def _hadamard(pr, n):
    """A ∘ B ∘ …, the per-token columns (``form``) multiplied first (on R entries); three or
    more factors as ``mul`` (one fresh array, the rest multiplied in place).  The scalars of
    the factors (``_pulled``) scale the first factor, a per-token column where there is one."""
    c, fs = _hadamard_factors(pr, n)
    codes = yield from _codes(fs, "ccode")
    if c != 1:
        codes[0] = _scaled(pr, c, codes[0])
    return _product(codes)


def _hadamard_factors(pr, n):
    """(c, factors) of A ∘ B ∘ … = c · (F₁ ∘ F₂ ∘ ⋯), each factor's scalar pulled out
    (``_pulled``), per-token columns first; in a routine, the factors that do not depend on
    its arguments are one factor (their product a leaf, formed once per prepared state) when
    the others do."""
    fs = list(n.args)
    if pr.local_names is not None:
        fixed = [a for a in fs if not pr.depends_on_arguments(a)]
        if 2 <= len(fixed) < len(fs):
            fs = [E.hadamard(*fixed)] + [a for a in fs if pr.depends_on_arguments(a)]
    c = sp.Integer(1)
    out = []
    for f in fs:
        cf, g = _pulled(pr, f)
        c, out = c * cf, out + [g]
    return c, sorted(out, key=lambda a: pr.form(a) is None)


def _pulled(pr, node):
    """(c, node′) with node = c · node′ for a factor of an entrywise product that has no name
    of its own: a scaled array c · A, or a sum printed as a multiple c · S of a shared sum.
    Its scalar then joins the product's (on a per-token column, or a ``lin`` coefficient)
    instead of a pass of its own over A or S.  (1, node) otherwise."""
    one = sp.Integer(1)
    if node in pr.leaf_names or (pr.local_names is not None and node in pr.local_names):
        return one, node
    if isinstance(node, E.Scale):
        return sp.sympify(node.coef), node.args[0]
    items = pr.summands.get(node) if isinstance(node, E.Add) else None
    if items and len(items) == 1:
        return sp.sympify(items[0][0]), items[0][1]
    scaled = _monic_sum(node)
    if scaled is not None and pr.uses(scaled[1]) > 1:
        return scaled
    return one, node


@rule(E.Elementwise)
def _elementwise(pr, n):
    """f(A) entrywise; the library functions g(u(x)) inside f's expression (σ in σ' = σ(1 − σ),
    tanh(√(2/π)(x + 0.044715 x³)) in GELU_tanh, GELU_tanh' and GELU_tanh'') are leaves of
    their own, g(u(A)) formed once for every f that holds it: f, f' and f'' of one operand
    evaluate each inner function once (GELU_tanh'' spelled out applies tanh 7 times)."""
    a = n.args[0]
    subs = {}
    if not pr.depends_on_arguments(a):
        for g in _inner_functions(n.fn.expr):
            node = E.elementwise(_inner_fn(g), a)
            code = yield "ccode", node
            subs[g] = code if re.fullmatch(r"s\.\w+", code) else pr.define(node, code, force_leaf=True)
    return scalar_code(n.fn.expr, (yield "ccode", a), subs)


def _inner_functions(expr):
    """The applications g(u(x)) of library functions in ``expr`` other than ``expr`` itself
    and steps (Heaviside: a comparison, cheaper than a lookup), in a deterministic order."""
    return [g for g in sorted(expr.atoms(sp.Function), key=str)
            if g != expr and len(g.args) == 1 and g.args[0].has(scalarfn.x)
            and not isinstance(g, sp.Heaviside)]


def _inner_fn(g):
    """The entrywise function g(u(x)) as a ``ScalarFn``: a library one when u(x) = x (σ, tanh),
    else one named by its sympy text (the same g in f, f' and f'' gives the same node)."""
    for k, (e, _) in scalarfn.FUNCTIONS.items():
        if e == g:
            return scalarfn.get_function(k)
    name = type(g).__name__.lower()
    if g.args == (scalarfn.x,):
        return scalarfn.ScalarFn(name, g, "")
    return scalarfn.ScalarFn(f"{name}({sp.sstr(g.args[0])})", g, "")


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


def _fewest_ops(expr):
    """``expr`` or its factored form, whichever has fewer operations (σ'' = σ(1 − σ)(1 − 2σ),
    4 passes instead of 11), the factored one only if it applies no function that ``expr``
    does not (no exp(x²/2) from factoring out exp(−x²/2))."""
    try:
        f = sp.factor(expr)
    except (sp.PolynomialError, NotImplementedError):
        return expr
    if sp.count_ops(f) < sp.count_ops(expr) and f.atoms(sp.Function) <= expr.atoms(sp.Function):
        return f
    return expr


def _product(codes):
    """x₁ ∘ x₂ ∘ ⋯ of array codes: three or more as ``mul`` (one fresh array, the rest
    multiplied in place)."""
    return f"mul({', '.join(codes)})" if len(codes) > 2 else "(" + " * ".join(codes) + ")"


def scalar_code(expr, arg, subs=None):
    """An entrywise sympy function of x as code applied to ``arg``; ``subs``: code for
    sub-expressions already at hand."""
    if not re.fullmatch(r"[\w.]+", arg):
        arg = f"({arg})"
    subs = subs or {}
    expr = _fewest_ops(expr)

    def p(e):
        if e in subs:
            return subs[e]
        if e == scalarfn.x:
            return arg
        if e.is_number:
            return repr(float(e))
        if isinstance(e, sp.Add):
            terms = sorted(e.args, key=lambda a: a.could_extract_minus_sign())
            out = p(terms[0])
            for a in terms[1:]:
                out += f" - {p(-a)}" if a.could_extract_minus_sign() else f" + {p(a)}"
            return f"({out})"
        if isinstance(e, sp.Mul) and e.has(scalarfn.x):
            c, rest = e.as_independent(scalarfn.x, as_Add=False)
            if c != 1:                          # the constants as one number: one pass
                return f"({p(c)} * {p(rest)})"
        if isinstance(e, sp.Mul) and e.could_extract_minus_sign():
            return f"(-{p(-e)})"
        if isinstance(e, sp.Mul):
            steps = [a for a in e.args if isinstance(a, sp.Heaviside)]
            if len(e.args) == 2 and len(steps) == 1 and steps[0].args[0] in e.args:
                return f"relu({p(steps[0].args[0])})"         # y H(y) = max(y, 0), any H(0)
            return _product([p(a) for a in e.args])
        if isinstance(e, sp.Pow):
            base, ex = e.args
            if ex == sp.Rational(1, 2):
                return f"sqrt({p(base)})"
            if ex in (2, 3):                         # a product: pow is several times slower
                b = p(base)
                if re.fullmatch(r"[\w.]+", b):
                    return _product([b] * int(ex))
                if ex == 2:                          # a composite base evaluated once
                    return f"square({b})"
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

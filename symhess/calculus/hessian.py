"""Gauss–Newton split of the loss Hessian, derived from a layer declaration.

For parameters p, q with directions D_p, D_q and output gradient G = ∂ℓ/∂F:

* gradient (matrix view):  g_p = adjoint of dF[D_p], applied to G;
* functional part:         H_f(p, q) = vec-Jacobian of d g_p[D_q] with G frozen;
* outer-product part:      H_o(p, q) = vec-Jacobian of g_p with G ← ∂²ℓ[dF[D_q]];
* full:                    H = H_o + H_f;
* Hessian–vector products: Σ_q H(p, q) V_q = d g_p[V], the g_p of all p from one reverse
  pass over dF[D_1, …, D_P] (``gradients``), so a cotangent that several parameters' paths
  share (a head's score cotangent, for the projections and a norm before them) is one node.

The split can also be taken at a named intermediate N (e.g. the logits T): then G_N =
∂ℓ/∂N is frozen and only N's own second derivative contributes (the T-functional term).
"""
from __future__ import annotations

from functools import cached_property

from ..expr import nodes as E
from .adjoint import adjoint, adjoints
from .kron import vec_jacobian
from ..expr.layer import Layer
from .losses import get_loss
from .rules import differential
from .simplify import Simplifier, definitions, simplify
from ..errors import DeclarationError, UnknownNameError
from ..expr.evaluate import InputError, bind_dims, check_values, evaluate

PARTS = ("outer", "functional", "full")


def _direction(var, tag=""):
    return E.Var(f"d{tag}{var.name}", var.rows, var.cols, "direction")


class Derivation:
    """All Hessian blocks of ``loss(layer.output, Y)``; blocks are derived on demand and cached."""

    def __init__(self, layer: Layer, loss: str = "mse"):
        self.layer = layer
        self.loss = loss
        F = layer.output
        self.F = F
        self.Y = E.matrix("Y", F.rows, F.cols)
        self._loss_fn = get_loss(loss)
        self._cache = {}
        self._simplifier = Simplifier(layer)     # blocks share sub-expressions: rewrite once

    # -- the loss side -------------------------------------------------------------------
    @cached_property
    def _loss_parts(self):
        """(G(F), H_ℓ[dF]) as expressions in a placeholder F, then substituted."""
        Fp = E.Var("F", self.F.rows, self.F.cols, "placeholder")
        ell = self._loss_fn(Fp, self.Y)
        dF = _direction(Fp)
        grad = adjoint(differential(ell, {Fp: dF}), dF, E.identity(1))
        dF2 = _direction(Fp, "2")
        hess_map = differential(grad, {Fp: dF2})
        return Fp, grad, dF2, hess_map

    @cached_property
    def loss_expr(self):
        Fp = self._loss_parts[0]
        return E.substitute(self._loss_fn(Fp, self.Y), {Fp: self.F})

    @cached_property
    def output_gradient(self):
        """G = ∂ℓ/∂F, frozen (held constant by the differentiator)."""
        Fp, grad, _, _ = self._loss_parts
        f = E.named(self.F, "F", r"\mathbf F")
        return E.named(E.substitute(grad, {Fp: f}), "G", r"\mathbf G", frozen=True)

    def loss_hessian_map(self, dF):
        """∂²ℓ/∂F² applied to dF."""
        Fp, _, dF2, hmap = self._loss_parts
        return E.substitute(hmap, {dF2: dF, Fp: self.F})

    # -- first order ---------------------------------------------------------------------
    def param(self, name):
        return self.layer.param(name)

    def jacobian(self, p):
        """∂vec_r F/∂vec_r W_p (Kronecker view)."""
        key = ("jacobian", p)
        if key not in self._cache:
            w = self.param(p)
            d = _direction(w)
            self._cache[key] = simplify(vec_jacobian(differential(self.F, {w: d}), d), self.layer, self._simplifier)
        return self._cache[key]

    def gradient(self, p, cot=None):
        """g_p = (∂F/∂W_p)ᵀ G as a matrix expression (no Kronecker product); cached, since
        every block (p, ·) and every Hessian–vector product starts from it."""
        key = ("gradient", p, cot)
        if key not in self._cache:
            w = self.param(p)
            d = _direction(w)
            self._cache[key] = adjoint(differential(self.F, {w: d}), d,
                                       self.output_gradient if cot is None else cot)
        return self._cache[key]

    def gradients(self, cot=None):
        """{p: g_p} of every parameter from one reverse pass over the differential in all
        parameters' directions (``adjoints``): the intermediates' cotangents are shared
        nodes, not one backward pass per parameter (``gradient``)."""
        key = ("gradients", cot)
        if key not in self._cache:
            ws = [self.param(p) for p in self.layer.param_names]
            ds = [_direction(w) for w in ws]
            got = adjoints(differential(self.F, dict(zip(ws, ds))), ds,
                           self.output_gradient if cot is None else cot)
            self._cache[key] = {p: got[d] for p, d in zip(self.layer.param_names, ds)}
        return self._cache[key]

    def _dF(self, q, dq):
        """dF[D_q] and ∂²ℓ[dF[D_q]] (cached per q: shared by the blocks (·, q))."""
        key = ("dF", q, dq)
        if key not in self._cache:
            dF = differential(self.F, {self.param(q): dq})
            self._cache[key] = self.loss_hessian_map(dF)
        return self._cache[key]

    def hvp_directions(self):
        """The direction variables V_q (one per parameter) used by ``hvp_expressions``."""
        return {w.name: E.Var(f"V_{w.name}", w.rows, w.cols, "direction") for w in self.layer.params}

    def hvp_expressions(self, part="full"):
        """{p: Σ_q H_part(p, q) V_q} as matrix expressions (matrix view, no Kronecker product).

        The direction variables are ``hvp_directions()``; the result for p has W_p's shape.
        """
        check_part(part)
        key = ("hvp", part)
        if key in self._cache:
            return self._cache[key]
        vs = self.hvp_directions()
        dirs = {self.param(q): v for q, v in vs.items()}
        g = self.output_gradient
        out, memo = {}, {}            # one memo: the gradients share their backward pass
        if part == "outer":
            hdF = self.loss_hessian_map(differential(self.F, dirs))
        grads = self.gradients(cot=g.inner if part == "full" else None)
        for p in self.layer.param_names:
            if part == "outer":
                out[p] = E.substitute(grads[p], {g: hdF}, memo)
            else:
                out[p] = differential(grads[p], dirs, memo)
        self._cache[key] = out
        return out

    # -- second order --------------------------------------------------------------------
    def raw_block(self, p, q, part="full", at=None):
        """The block before display simplification (what verification evaluates too)."""
        check_part(part)
        key = ("raw", p, q, part, at)
        if key in self._cache:
            return self._cache[key]
        wq = self.param(q)
        dq = _direction(wq, "q")
        if at is not None:
            out = self._functional_at(p, q, at, dq) if part != "outer" else None
            if out is None:
                raise DeclarationError("a split at an intermediate gives the functional part "
                                       "only; use part='functional'")
        elif part == "functional":
            out = vec_jacobian(differential(self.gradient(p), {wq: dq}), dq)
        elif part == "outer":
            g = self.output_gradient
            lin = E.substitute(self.gradient(p), {g: self._dF(q, dq)})
            out = vec_jacobian(lin, dq)
        else:
            out = E.add(self.raw_block(p, q, "outer"), self.raw_block(p, q, "functional"))
        self._cache[key] = out
        return out

    def _functional_at(self, p, q, at, dq):
        node = self.layer.intermediates.get(at)
        if node is None:
            raise UnknownNameError(f"unknown intermediate {at!r}; valid: "
                           f"{', '.join(self.layer.intermediates) or 'none'}")
        hole = E.Var(f"__{at}", node.rows, node.cols, "placeholder")
        dn = _direction(hole)
        f_hole = E.substitute(self.F, {node: hole})
        if not f_hole.depends_on(hole):   # else the split would silently give Zero
            raise DeclarationError(f"intermediate {at!r} is not a node of the output (canonicalisation "
                             f"merged it into a larger product); declare it with expr.named(...)")
        g_node = adjoint(differential(f_hole, {hole: dn}), dn, self.output_gradient.inner)
        g_node = E.named(E.substitute(g_node, {hole: node}), f"G_{at}",
                         rf"\frac{{\partial\ell}}{{\partial\mathbf {at}}}", frozen=True)
        w = self.param(p)
        d = _direction(w)
        grad = adjoint(differential(node, {w: d}), d, g_node)
        return vec_jacobian(differential(grad, {self.param(q): dq}), dq)

    def block(self, p, q, part="full", at=None) -> "Block":
        """The (p, q) Hessian block in vec_r layout, simplified for display."""
        key = ("block", p, q, part, at)
        if key not in self._cache:
            self._cache[key] = Block(simplify(self.raw_block(p, q, part, at), self.layer, self._simplifier), self, (p, q, part))
        return self._cache[key]

    @cached_property
    def latex_names(self):
        """LaTeX symbols for the layer's named intermediates (e.g. A, T)."""
        from ..expr.latex import intermediate_tex
        from .simplify import simplify as simp
        names = {}
        for key, node in self.layer.intermediates.items():
            for form in (node, simp(node, self.layer)):
                names[form] = intermediate_tex(key)
                names.setdefault(E.transpose(form), _transposed(intermediate_tex(key)))
        return names

    @property
    def variable_names(self):
        return sorted(set(self.layer.variables) | {"Y"})

    def dimension_env(self, values, check_finite=True):
        """Bind the symbolic dimensions from every layer variable present in ``values``, after
        checking every value (also those a block does not read, like Y in H_o) against the
        value policy (``evaluate.check_values``) and the layer's own checks."""
        arrays = check_values(values, check_finite)
        unknown = sorted(set(arrays) - set(self.variable_names))
        if unknown:
            raise InputError(f"unknown value name(s) {', '.join(unknown)} for layer "
                             f"{self.layer.name!r}; valid: {', '.join(self.variable_names)}")
        vars_ = [v for v in list(self.layer.variables.values()) + [self.Y] if v.name in arrays]
        env = bind_dims(vars_, arrays)
        self.layer.validate(values)
        return env

    def blocks(self, part="full"):
        names = self.layer.param_names
        return {(p, q): self.block(p, q, part) for p in names for q in names}


class Block:
    """A derived Hessian block: ``expr`` (vec_r layout), printable and evaluable."""

    def __init__(self, expr, derivation, label):
        self.expr = expr
        self.derivation = derivation
        self.label = label

    @property
    def is_zero(self) -> bool:
        return self.expr.is_zero

    @property
    def shape(self):
        return self.expr.shape

    def latex(self) -> str:
        return self.expr.latex(self.derivation.latex_names)

    def text(self) -> str:
        return repr(self.expr)

    def definitions(self):
        return definitions(self.expr)

    def evaluate(self, values, backend="numpy", check_finite=True):
        """Dense (numel(p) × numel(q)) array for the given values (``evaluate.check_values``:
        float32/float64 of one dtype; ``check_finite=False`` skips the NaN/inf scans)."""
        env = self.derivation.dimension_env(values, check_finite)
        p, q, part = self.label
        return evaluate(self.expr, values, backend=backend, env=env, check_finite=check_finite,
                        what=f"the {part} block ({p}, {q})")

    def __repr__(self):
        p, q, part = self.label
        return f"<block H_{part[0]}({p}, {q}) = {self.expr!r}>"


def _transposed(tex):
    """A symbol with ᵀ (a symbol that has a superscript is braced first)."""
    return ("{" + tex + "}" if "^" in tex else tex) + r"^\top"


def check_part(part):
    if part not in PARTS:
        raise UnknownNameError(f"unknown part {part!r}; valid: {', '.join(PARTS)}")


def derive(layer, loss: str = "mse") -> Derivation:
    """Derive the Hessian of ``loss(layer.output, Y)`` (blocks are computed on demand); a
    registered layer by name is ``symhess.derive`` (``symhess.layers.derive``)."""
    if not isinstance(layer, Layer):
        raise DeclarationError(f"derive needs a symhess Layer or a registered layer's name, "
                               f"got {type(layer).__name__} {layer!r:.40}")
    get_loss(loss)
    return Derivation(layer, loss)

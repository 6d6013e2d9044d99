"""Numerical verification of derived blocks against torch autograd in float64.

The reference differentiates the *forward* evaluation of the same declaration with
torch.func (reverse-over-reverse, which is also safe for LayerNorm), so it shares no
derivative code with the engine.  H_o is J_pᵀ (∂²ℓ/∂F²) J_q from autograd Jacobians and
H_f = H − H_o.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy as sp

from ..expr import nodes as E
from ..expr.budget import check_budget
from ..errors import DeclarationError
from ..expr.evaluate import check_values, evaluate
from .hessian import PARTS, Derivation

TOLERANCE = 1e-10


def dimension_symbols(derivation: Derivation):
    syms = set()
    for v in list(derivation.layer.variables.values()) + [derivation.Y]:
        for d in v.shape:
            syms |= sp.sympify(d).free_symbols
    return sorted(syms, key=lambda s: s.name)


def _check_derivation(derivation, who):
    if not isinstance(derivation, Derivation):
        raise DeclarationError(f"{who} takes a derivation (symhess.derive(layer, loss)), got "
                               f"{type(derivation).__name__}")


def random_sizes(derivation, seed=0, low=2, sizes=None):
    """Distinct sizes for distinct dimensions (so a swapped K_{m,n} cannot pass); ``sizes``
    ({name: int}) fixes some of them (names the layer does not have are ignored, so that one
    dict serves several layers)."""
    _check_derivation(derivation, "random_sizes")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DeclarationError(f"seed must be a non-negative integer, got {seed!r}")
    if sizes is not None and not isinstance(sizes, dict):
        raise DeclarationError(f"sizes must be a dict of dimension sizes by name (e.g. "
                               f"{{'L': 4}}), got {type(sizes).__name__}")
    rng = np.random.default_rng(seed)
    syms = dimension_symbols(derivation)
    pool = rng.permutation(np.arange(low, low + max(5, len(syms))))
    env = {s: int(pool[i]) for i, s in enumerate(syms)}
    for name, value in (sizes or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise DeclarationError(f"size {name} must be a positive integer, got {value!r}")
        env[E.dim(name)] = int(value)
    return env


def random_values(derivation, seed=0, sizes=None, scale=None):
    """Random float64 inputs, parameters and targets for a derivation; ``scale``: {value
    name: standard deviation} for some of them (finite numbers >= 0).  Sizes whose values
    would exceed the memory budget raise ``BudgetError`` before anything is drawn."""
    _check_derivation(derivation, "random_values")
    env = random_sizes(derivation, seed, sizes=sizes)
    variables = sorted(derivation.layer.variables.values(), key=lambda v: v.name)
    scale = _check_scale(scale, [v.name for v in variables])
    shapes = {v.name: tuple(int(sp.sympify(d).subs(env)) for d in v.shape)
              for v in variables + [derivation.Y]}
    check_budget(8 * sum(m * n for m, n in shapes.values()), "the random values",
                 ", ".join(f"{k} = {v}" for k, v in sorted(env.items(), key=lambda kv: str(kv[0]))))
    rng = np.random.default_rng(seed + 1)
    values = {}
    for v in variables:
        m, n = shapes[v.name]
        s = 1.0 if v.role == "input" else 1.0 / np.sqrt(max(m, 1))
        values[v.name] = rng.standard_normal((m, n)) * scale.get(v.name, s)
    m, n = shapes[derivation.Y.name]
    if derivation.loss == "ce":
        y = rng.random((m, n)) + 0.1
        values["Y"] = y / y.sum(1, keepdims=True)
    else:
        values["Y"] = rng.standard_normal((m, n))
    return values


def _check_scale(scale, names):
    if scale is None:
        return {}
    if not isinstance(scale, dict):
        raise DeclarationError(f"scale must be a dict of standard deviations by value name "
                               f"(e.g. {{'X': 2.0}}), got {type(scale).__name__}")
    for name, s in scale.items():
        if name not in names:
            raise DeclarationError(f"scale {name!r}: no such value; valid: {', '.join(names)}")
        if isinstance(s, bool) or not isinstance(s, (int, float, np.integer, np.floating)) \
                or not 0 <= s < float("inf"):
            raise DeclarationError(f"scale {name} must be a finite number >= 0, got {s!r}")
    return scale


def _numel(var, env) -> int:
    r, c = (int(sp.sympify(d).subs(env)) for d in var.shape)
    return r * c


def verification_bytes(derivation: Derivation, env) -> int:
    """What ``autograd_blocks`` keeps alive at the sizes ``env``, in bytes (float64): the
    values, the Hessian (P × P for P parameter entries) with its outer and functional parts
    and their NumPy copies, the output Jacobian (numel F × P) and the loss Hessian in F."""
    variables = list(derivation.layer.variables.values()) + [derivation.Y]
    n_values = sum(_numel(v, env) for v in variables)
    n_params = sum(_numel(p, env) for p in derivation.layer.params)
    n_out = _numel(derivation.Y, env)
    return 8 * (n_values + 5 * n_params ** 2 + 2 * n_out * n_params + n_out ** 2)


def _check_verification_budget(derivation, env):
    sizes = ", ".join(f"{k} = {v}" for k, v in sorted(env.items(), key=lambda kv: str(kv[0])))
    check_budget(verification_bytes(derivation, env),
                 f"verifying {derivation.layer.name!r} against autograd", sizes)


def autograd_blocks(derivation: Derivation, values: dict):
    """{(p, q, part): array} from torch.func, float64 (values follow ``check_values``)."""
    import torch
    from torch.func import jacrev

    check_values(values)
    _check_verification_budget(derivation, derivation.dimension_env(values))
    names = derivation.layer.param_names
    tv = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in values.items()}
    params = tuple(tv[p] for p in names)

    def with_params(ps):
        d = dict(tv)
        d.update(zip(names, ps))
        return d

    def loss(*ps):
        return evaluate(derivation.loss_expr, with_params(ps), backend="torch")[0, 0]

    def output(*ps):
        return evaluate(derivation.F, with_params(ps), backend="torch")

    fp = derivation._loss_parts[0]
    loss_of_f = derivation._loss_fn(fp, derivation.Y)

    env = derivation.dimension_env(values)   # F's shape may be a product (m·q) of dimensions

    def loss_f(f):
        return evaluate(loss_of_f, {"F": f, "Y": tv["Y"]}, backend="torch", env=env)[0, 0]

    argnums = tuple(range(len(names)))
    hess = jacrev(jacrev(loss, argnums=argnums), argnums=argnums)(*params)
    jac = jacrev(output, argnums=argnums)(*params)
    f_val = output(*params)
    h_f = jacrev(jacrev(loss_f))(f_val).reshape(f_val.numel(), f_val.numel())
    out = {}
    for i, p in enumerate(names):
        ji = jac[i].reshape(f_val.numel(), -1)
        for j, q in enumerate(names):
            jj = jac[j].reshape(f_val.numel(), -1)
            full = hess[i][j].reshape(ji.shape[1], jj.shape[1])
            outer = ji.T @ h_f @ jj
            out[(p, q, "full")] = full.numpy()
            out[(p, q, "outer")] = outer.numpy()
            out[(p, q, "functional")] = (full - outer).numpy()
    return out


# a block is compared at least at this fraction of the whole Hessian's norm: a block that is
# zero in exact arithmetic without being a structural Zero (H(W_Q, b_K) of attention with
# biases: a key bias shifts every logit of a softmax row by the same amount) is rounding
# noise on both sides, and its error is that noise against the Hessian it belongs to
WHOLE_FRACTION = 1e-4


def relative_error(got, ref, scale):
    """‖got − ref‖_F / max(‖ref‖_F, scale): scale is the block's full-Hessian norm (at least
    ``WHOLE_FRACTION`` of the whole Hessian's)."""
    den = max(float(np.linalg.norm(ref)), scale, 1e-300)
    return float(np.linalg.norm(got - ref)) / den


@dataclass
class Check:
    block: tuple
    part: str
    error: float
    zero: bool

    @property
    def ok(self):
        return self.error <= TOLERANCE


def verify(derivation: Derivation, seed=0, sizes=None, progress=False):
    """Compare every ordered block pair and part with autograd; returns a list of Checks.

    Refuses sizes whose memory estimate exceeds the budget (``BudgetError``) before
    allocating; ``progress`` shows a bar over the blocks on stderr when it is a terminal (tqdm)."""
    from tqdm import tqdm

    _check_derivation(derivation, "verify")
    _check_verification_budget(derivation, random_sizes(derivation, seed, sizes=sizes))
    values = random_values(derivation, seed, sizes)
    ref = autograd_blocks(derivation, values)
    names = derivation.layer.param_names
    checks = []
    pairs = [(p, q) for p in names for q in names]
    whole = WHOLE_FRACTION * float(np.sqrt(sum(np.linalg.norm(ref[(p, q, "full")]) ** 2
                                               for p, q in pairs)))
    label = f"verify {derivation.layer.name} ({derivation.loss})"
    for p, q in tqdm(pairs, desc=label, unit="block", disable=None if progress else True, leave=False):
        scale = max([float(np.linalg.norm(ref[(p, q, part)])) for part in PARTS] + [whole])
        for part in PARTS:
            b = derivation.block(p, q, part)
            got = b.evaluate(values)
            checks.append(Check((p, q), part, relative_error(got, ref[(p, q, part)], scale), b.is_zero))
    return checks, values

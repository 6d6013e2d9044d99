"""Random hostile input at every public entry point: non-finite, complex, mis-typed and
mis-shaped values, vectors, batches and settings (kernels, prepared states, the interpreter,
operators, datasets, shards, spectra, densities, random values, modules).  Each call must either raise a one-line
``SymhessError`` or return the right number (torch autograd of the declaration, float64);
never a wrong number, never another exception.  Sizes are tiny (attention, L = 3)."""
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import symhess as sh
from symhess.curvature import distributed as D
from symhess.curvature.dataset import Dataset
from symhess.errors import SaturationWarning, SymhessError
from symhess.calculus.verify import random_values

PARAMS = ("W_Q", "W_K", "W_V")
DATA = ("X", "Y")
SETTINGS = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
                    deadline=None)
DERIVATION = sh.derive(sh.layer("attention"), "mse")


def _loss(t):
    """ℓ(W_Q, W_K, W_V) of attention with MSE at the data of ``t`` (torch, float64)."""
    def loss(W_Q, W_K, W_V):
        X = t["X"]
        A = torch.softmax(X @ W_Q @ W_K.T @ X.T / W_Q.shape[1] ** 0.5, -1)
        return ((A @ X @ W_V - t["Y"]) ** 2).mean()
    return loss


def _tensors(values):
    return {k: torch.as_tensor(np.asarray(v, dtype=np.float64)) for k, v in values.items()}


def reference(values):
    """The whole Hessian from torch.func (float64, parameters in declared order), or None
    when it is not finite."""
    t = _tensors(values)
    loss = _loss(t)
    shapes = [t[p].shape for p in PARAMS]
    flat = torch.cat([t[p].reshape(-1) for p in PARAMS])

    def of_flat(w):
        parts, o = [], 0
        for s in shapes:
            parts.append(w[o:o + s.numel()].reshape(s))
            o += s.numel()
        return loss(*parts)

    H = torch.func.hessian(of_flat)(flat).numpy()
    return H if np.isfinite(H).all() else None


def output_jacobian(values, p="W_Q"):
    """∂vec_r F/∂vec_r W_p of the attention output F = softmax(X W_Q W_Kᵀ Xᵀ/√d_K) X W_V
    from torch.func (float64), shape (numel F, numel W_p)."""
    t = _tensors(values)

    def out(w):
        ws = {**{q: t[q] for q in PARAMS}, p: w}
        X = t["X"]
        A = torch.softmax(X @ ws["W_Q"] @ ws["W_K"].T @ X.T / ws["W_Q"].shape[1] ** 0.5, -1)
        return A @ X @ ws["W_V"]

    J = torch.func.jacrev(out)(t[p])
    return J.reshape(out(t[p]).numel(), t[p].numel()).numpy()


def loss_and_gradient(values):
    """(ℓ, [∂ℓ/∂W_p]) from torch.func, float64."""
    t = _tensors(values)
    ws = [t[p] for p in PARAMS]
    grads = torch.func.grad(_loss(t), argnums=(0, 1, 2))(*ws)
    return float(_loss(t)(*ws)), [g.numpy() for g in grads]


BASE = random_values(DERIVATION, seed=7, sizes={"L": 3, "d_V": 3, "d_K": 2})
H_BASE = reference(BASE)
N_PARAMS = H_BASE.shape[0]


def outcome(call):
    """("error", message) for a SymhessError, ("ok", result) otherwise; any other exception
    fails the test.  Numerical warnings are silenced; a SaturationWarning is reported."""
    with warnings.catch_warnings(record=True) as caught, np.errstate(all="ignore"):
        warnings.simplefilter("always")
        try:
            out = call()
        except SymhessError as exc:
            msg = str(exc)
            assert msg and "\n" not in msg, msg
            return "error", msg
    saturated = any(issubclass(w.category, SaturationWarning) for w in caught)
    return ("saturated" if saturated else "ok"), out


def _host(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def close(got, want, scale):
    got = _host(got)
    return got.shape == np.shape(want) and np.abs(got - want).max() <= 1e-8 * max(scale, 1e-300)


# ----------------------------------------------------------------------------- mutations
BREAK = ("nan", "inf", "complex", "int", "float16", "text", "transposed", "row more", "flat",
         "empty")
KEEP = ("as is", "scaled", "list", "batch of one", "requires grad")


@st.composite
def mutated(draw, a, name):
    """(kind, value): ``a`` broken (must be refused) or kept (the same numbers, maybe scaled)."""
    kind = draw(st.sampled_from(BREAK + KEEP))
    a = np.array(a, dtype=np.float64)
    if kind in ("nan", "inf"):
        idx = tuple(draw(st.integers(0, s - 1)) for s in a.shape)
        a[idx] = np.nan if kind == "nan" else draw(st.sampled_from([np.inf, -np.inf]))
    elif kind == "complex":
        a = a + 1j * draw(st.sampled_from([0.0, 1e-3]))
    elif kind == "int":
        a = a.astype(np.int64)
    elif kind == "float16":
        a = a.astype(np.float16)
    elif kind == "text":
        a = a.astype(str)
    elif kind == "transposed":
        a = a.T if a.shape[0] != a.shape[1] else a[:, :-1]
    elif kind == "row more":
        a = np.vstack([a, a[:1]])
    elif kind == "flat":
        a = a.reshape(-1)
    elif kind == "empty":
        a = a[:0]
    elif kind == "scaled":
        a = a * 10.0 ** draw(st.integers(-320, 300))
    elif kind == "list":
        a = a.tolist()
    elif kind == "batch of one":
        a = a[None] if name in DATA else a
    return kind, a


def as_backend(backend, x, kind):
    if backend == "numpy" or kind in ("list", "text"):
        return x
    t = torch.as_tensor(x)
    if kind == "requires grad":
        t.requires_grad_(True)
    return t


# ----------------------------------------------------------------------------- kernels
ENTRY = ("loss", "gradient", "hvp", "diag", "trace", "frobenius_norm", "hessian_block",
         "hessian", "frobenius_split", "jacobian", "state.hvp", "state.block_hvp", "state.diag",
         "state.diagonals", "state.trace", "interpreter")


@SETTINGS
@given(data=st.data(), backend=st.sampled_from(["numpy", "torch"]),
       name=st.sampled_from(PARAMS + DATA), entry=st.sampled_from(ENTRY))
def test_kernel_methods_and_prepared_states_refuse_or_are_right(data, backend, name, entry):
    kind, bad = data.draw(mutated(BASE[name], name))
    values = {k: as_backend(backend, v, "as is") for k, v in BASE.items()}
    values[name] = as_backend(backend, bad, kind)
    k = sh.kernel("attention", backend, "mse")
    v = np.linspace(-1, 1, N_PARAMS)
    vb = as_backend(backend, v, "as is")
    calls = {"loss": lambda: k.loss(values), "gradient": lambda: k.gradient(values),
             "hvp": lambda: k.hvp(values, vb), "diag": lambda: k.diag(values, "W_Q"),
             "trace": lambda: k.trace(values, "W_K"),
             "frobenius_norm": lambda: k.frobenius_norm(values, "W_Q", "W_V"),
             "hessian_block": lambda: k.hessian_block(values, "W_K", "W_Q"),
             "hessian": lambda: k.hessian(values),
             "frobenius_split": lambda: k.frobenius_split(values, "W_Q", "W_V")["full"],
             "jacobian": lambda: k.jacobian(values, "W_Q"),
             "state.hvp": lambda: k.prepare(values).hvp(vb),
             "state.block_hvp": lambda: k.prepare(values).block_hvp("W_Q", "W_V", vb[12:]),
             "state.diag": lambda: k.prepare(values).diag("W_V"),
             "state.diagonals": lambda: k.prepare(values).diagonals()["W_V"],
             "state.trace": lambda: k.prepare(values).trace("W_V"),
             "interpreter": lambda: DERIVATION.block("W_K", "W_Q").evaluate(values, backend=backend)}
    status, out = outcome(calls[entry])
    if kind in BREAK:
        assert status == "error", (kind, name, entry)
        return
    if status == "error":   # refused: where the numbers overflow, or one datum alone batched
        assert (kind == "scaled" and ("not finite" in out or "non-finite" in out)) or \
            (kind == "batch of one" and "same leading batch size" in out) or \
            (kind == "batch of one" and entry == "interpreter" and "must be a 2-D array" in out), out
        return
    clean = {**BASE, name: np.reshape(np.asarray(bad, dtype=np.float64), BASE[name].shape)}
    if entry == "jacobian":
        with np.errstate(all="ignore"):
            J = output_jacobian(clean)
        assert np.isfinite(J).all(), (kind, name, entry)   # autograd overflows: refuse
        got = _host(out)
        assert close(np.reshape(got, J.shape) if got.size == J.size else got, J, np.abs(J).max())
        return
    if entry in ("loss", "gradient"):
        with np.errstate(all="ignore"):
            ell, grad = loss_and_gradient(clean)
        got = [out] if entry == "loss" else [out[p] for p in PARAMS]
        want = [ell] if entry == "loss" else grad
        for g, w in zip(got, want):
            assert np.isfinite(w).all(), (kind, name, entry)   # autograd overflows: refuse
            if status == "ok":
                assert close(np.asarray(_host(g)), np.asarray(w), np.abs(w).max())
        return
    H = reference(clean)
    assert H is not None, (kind, name, entry)        # autograd overflows: we must refuse
    if status == "saturated":
        return
    if entry in ("hvp", "state.hvp"):
        assert close(out, H @ v, np.abs(H).max() * np.abs(v).sum())
    elif entry == "state.block_hvp":
        assert close(out, H[:6, 12:] @ v[12:], np.abs(H).max() * np.abs(v).sum())
    elif entry in ("diag", "state.diag", "state.diagonals"):
        sl = slice(0, 6) if entry == "diag" else slice(12, 21)
        assert close(out, np.diag(H)[sl], np.abs(H).max())
    elif entry in ("hessian_block", "interpreter"):
        assert close(out, H[6:12, :6], np.abs(H).max())
    elif entry == "hessian":
        assert close(out, H, np.abs(H).max())
    elif entry == "frobenius_split":
        assert abs(float(out) - np.linalg.norm(H[:6, 12:])) <= 1e-8 * np.abs(H).max() * 10
    elif entry == "trace":
        assert abs(float(out) - np.trace(H[6:12, 6:12])) <= 1e-8 * np.abs(H).max() * 6
    elif entry == "state.trace":
        assert abs(float(out) - np.trace(H[12:, 12:])) <= 1e-8 * np.abs(H).max() * 9


# ----------------------------------------------------------------------------- operators
@st.composite
def vectors(draw, n):
    kind = draw(st.sampled_from(["nan", "inf", "complex", "short", "long", "text", "rank 3",
                                 "huge", "matrix k=0", "ok", "list", "column", "float32",
                                 "matrix", "tensor"]))
    v = np.linspace(-1, 1, n) * draw(st.sampled_from([1.0, 1e-3, 1e3]))
    if kind in ("nan", "inf"):
        v[draw(st.integers(0, n - 1))] = np.nan if kind == "nan" else np.inf
    return kind, {"complex": v * (1 + 1j), "short": v[:-1], "long": np.r_[v, 1.0],
                  "text": v.astype(str), "rank 3": v[:, None, None], "huge": v * 1e305,
                  "matrix k=0": np.ones((n, 0)), "list": v.tolist(), "column": v[:, None],
                  "float32": v.astype(np.float32), "matrix": np.stack([v, -2 * v], 1),
                  "tensor": torch.as_tensor(v)}.get(kind, v)


@SETTINGS
@given(data=st.data(), backend=st.sampled_from(["numpy", "torch"]),
       block=st.sampled_from([(None, None), ("W_Q", None), ("W_Q", "W_K"), ("W_V", "W_V")]),
       how=st.sampled_from(["@", "matvec", "rmatvec", "matmat", "dot"]))
def test_operator_products_refuse_or_are_right(data, backend, block, how):
    values = {k: as_backend(backend, v, "as is") for k, v in BASE.items()}
    op = sh.operator(sh.kernel("attention", backend, "mse"), values, *block)
    offs = {"W_Q": slice(0, 6), "W_K": slice(6, 12), "W_V": slice(12, 21), None: slice(0, 21)}
    rows, cols = offs[block[0]], offs[block[1]]
    H = H_BASE[rows, cols]
    if how in ("rmatvec",):
        H = H.T
    kind, x = data.draw(vectors(H.shape[1]))
    call = {"@": lambda: op @ x, "matvec": lambda: op.matvec(x), "rmatvec": lambda: op.rmatvec(x),
            "matmat": lambda: op.matmat(x), "dot": lambda: op.dot(x)}[how]
    status, out = outcome(call)
    xs = None if kind in ("nan", "inf", "complex", "short", "long", "text", "rank 3") \
        else np.asarray(_host(x), dtype=np.float64)
    if xs is None or (how == "matmat" and xs.ndim != 2) or xs.size == 0 or \
            (how in ("matvec", "rmatvec") and xs.ndim == 2 and xs.shape[1] != 1) or \
            not np.isfinite(xs).all():
        assert status == "error", (kind, how)
        return
    with np.errstate(all="ignore"):
        want = H @ xs
    if not np.isfinite(want).all() or status == "error":
        # H x overflows: it must be refused; and near the largest float an intermediate
        # of the product may overflow while H x would not: refused, naming the overflow
        assert status == "error" and "overflowed" in out and (
            kind == "huge" or not np.isfinite(want).all()), (kind, how, out)
        return
    assert close(np.reshape(_host(out), np.shape(want)), want, np.abs(H).max() * np.abs(xs).sum())
    assert isinstance(out, torch.Tensor) == (kind == "tensor")


# ----------------------------------------------------------------------------- datasets
def module_case():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(3, 1, batch_first=True, bias=False).double()
    return sh.from_module(mha)


ML = module_case()


@SETTINGS
@given(data=st.data(), wrapper=st.sampled_from(["list", "ModuleLayer.batches", "shard"]),
       which=st.sampled_from([0, 1]), at=st.integers(0, 2))
def test_datasets_refuse_bad_batches_or_are_right(data, wrapper, which, at):
    """One batch's x or y (N, L, d) mutated; the dataset's loss is the module's own mean loss."""
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randn(2, 3, 3, generator=g, dtype=torch.float64) for _ in range(2)]
               for _ in range(3)]
    kind, bad = data.draw(mutated(batches[at][which].numpy(), "batch"))
    batches[at][which] = as_backend("torch", bad, kind)
    batches = [tuple(b) for b in batches]
    k = sh.kernel(ML.layer, "torch", "mse")
    source = {"list": list, "ModuleLayer.batches": ML.batches,
              "shard": lambda b: D.shard(b, 0, 1)}[wrapper]

    def run():
        ds = Dataset(k, source(batches), params=ML.params())
        return ds.loss(), ds.gradient()

    status, out = outcome(run)
    if kind in BREAK:
        assert status == "error", (kind, wrapper, which)
        return
    if status == "error":
        assert kind == "scaled" and "finite" in out, out
        return
    X, Y = (torch.cat([torch.as_tensor(np.asarray(_host(b[i]), dtype=np.float64)) for b in batches])
            for i in (0, 1))
    with torch.no_grad():
        want = ((ML.module_forward(X) - Y) ** 2).mean()
    assert torch.isfinite(want), (kind, out)        # the module overflows: we must refuse
    if status == "ok":
        assert abs(out[0] - float(want)) <= 1e-10 * float(want)


def _sequences():
    """Two batches of two sequences (BASE's parameters) and the Hessian of their mean loss:
    the mean of the four per-sequence Hessians (torch.func, float64)."""
    rng = np.random.default_rng(3)
    X, Y = rng.standard_normal((2, 2, 3, 3)), rng.standard_normal((2, 2, 3, 3))
    H = np.mean([reference({**BASE, "X": X[b, i], "Y": Y[b, i]}) for b in range(2) for i in range(2)], 0)
    return X, Y, H


SEQ_X, SEQ_Y, H_DATA = _sequences()
MAY_REFUSE = ("list", "column", "float32", "matrix", "tensor")    # exact types are asked for


@SETTINGS
@given(data=st.data(), backend=st.sampled_from(["numpy", "torch"]),
       entry=st.sampled_from(["hvp", "row_hvp", "block_hvp", "block_hvp matview", "operator @",
                              "block operator matvec"]))
def test_dataset_products_refuse_bad_vectors_or_are_right(data, backend, entry):
    """A dataset's products and its operators with a hostile vector: a one-line error or the
    mean Hessian's product (torch.func over every sequence)."""
    conv = (lambda a: a) if backend == "numpy" else torch.as_tensor
    batches = [{"X": conv(SEQ_X[b]), "Y": conv(SEQ_Y[b])} for b in range(2)]
    k = sh.kernel("attention", backend, "mse")
    params = {p: conv(BASE[p]) for p in PARAMS}
    ds = Dataset(k, batches, params=params)
    rows, cols = {"hvp": (slice(0, 21), slice(0, 21)), "row_hvp": (slice(12, 21), slice(0, 21)),
                  "operator @": (slice(0, 21), slice(0, 21))}.get(entry, (slice(0, 6), slice(6, 12)))
    H = H_DATA[rows, cols]
    kind, x = data.draw(vectors(H.shape[1]))
    call = {"hvp": lambda: ds.hvp(x), "row_hvp": lambda: ds.row_hvp("W_V", x),
            "block_hvp": lambda: ds.block_hvp("W_Q", "W_K", x),
            "block_hvp matview": lambda: ds.block_hvp("W_Q", "W_K", x, method="matview"),
            "operator @": lambda: sh.operator(k, batches, params=params) @ x,
            "block operator matvec": lambda: sh.operator(k, batches, "W_Q", "W_K", params=params).matvec(x)}[entry]
    status, out = outcome(call)
    xs = None if kind in ("nan", "inf", "complex", "short", "long", "text", "rank 3", "matrix k=0") \
        else np.asarray(_host(x), dtype=np.float64)
    if xs is None:
        assert status == "error", (kind, entry)
        return
    if status == "error" and kind in MAY_REFUSE:
        return
    with np.errstate(all="ignore"):
        want = H @ xs
    if not np.isfinite(want).all() or status == "error":
        assert status == "error" and "not finite" in out and kind == "huge", (kind, entry, out)
        return
    assert close(np.reshape(_host(out), np.shape(want)), want, np.abs(H).max() * np.abs(xs).sum())


@st.composite
def settings_of(draw, good, bad):
    """Keyword settings: valid ones from ``good`` ({name: values}), at most two of them
    replaced by hostile ones from ``bad`` (so that valid calls are drawn as often)."""
    out = {name: draw(st.sampled_from(vals)) for name, vals in good.items()}
    for name in draw(st.sets(st.sampled_from(sorted(bad)), max_size=2)):
        out[name] = draw(st.sampled_from(bad[name]))
    return out


@SETTINGS
@given(kw=settings_of({"name": ["L", "d_V", "d_K", "d_Z"], "size": [1, 2, 3], "seed": [0, 5],
                       "scale": [None, {"X": 2.0}, {"W_V": 0.0}]},
                      {"name": [3, ""], "size": [0, -1, 1.5, float("nan"), True, "3", None, 10 ** 12],
                       "seed": [-1, 1.5, None, "0", True],
                       "scale": [{"X": float("nan")}, {"X": -1.0}, {"Z": 1.0}, 2.0, "X"]}))
def test_random_values_refuse_bad_settings_or_have_the_asked_shapes(kw):
    """sizes, seed and scale of ``sh.random_values``: a one-line error or finite values of the
    asked sizes (names of dimensions the layer lacks are ignored, so one dict serves several
    layers) and standard deviations."""
    name, size, seed, scale = kw["name"], kw["size"], kw["seed"], kw["scale"]
    status, out = outcome(lambda: sh.random_values(DERIVATION, seed=seed, sizes={name: size}, scale=scale))
    if status == "error":
        return
    assert isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0
    assert isinstance(size, int) and not isinstance(size, bool) and 1 <= size < 10 ** 12
    assert scale is None or (isinstance(scale, dict) and set(scale) <= set(BASE)
                             and all(0 <= s < np.inf for s in scale.values()))
    assert all(np.isfinite(a).all() for a in out.values())
    axis = {"L": ("X", 0), "d_V": ("W_V", 1), "d_K": ("W_Q", 1)}.get(name)
    if axis:
        assert out[axis[0]].shape[axis[1]] == size
    if scale == {"W_V": 0.0}:
        assert not out["W_V"].any()


@SETTINGS
@given(kw=settings_of({"num_points": [2, 16], "ncv": [2, 5, 50, None], "num_repeats": [1, 2],
                       "kappa": [3.0, 1.5], "margin": [0.05, 0.0], "boundaries": [None, (-1.0, 2.0)],
                       "tol": [1e-2, 1e-6]},
                      {"num_points": [1, 0, 2.5, float("nan")], "ncv": [1, 0, 2.5],
                       "num_repeats": [0, -1, 1.5], "kappa": [1.0, 0.5, 0.0, float("nan"), float("inf")],
                       "margin": [-0.1, float("inf")],
                       "boundaries": [(2.0, -1.0), (float("nan"), 1.0), (0.0,), "ab"],
                       "tol": [0.0, float("nan"), -1.0]}))
def test_density_refuses_bad_settings_or_is_a_density(kw):
    """``sh.density`` settings: a one-line error or a finite, non-negative density on an
    increasing grid that spans the block's eigenvalues (or the boundaries given)."""
    op = sh.operator(sh.kernel("attention", "numpy", "mse"), BASE, "W_V", "W_V")
    status, out = outcome(lambda: sh.density(op, **kw))
    if status == "error":
        return
    grid, dens = out
    n = kw["num_points"]
    assert isinstance(n, int) and n >= 2 and len(grid) == len(dens) == n
    assert np.isfinite(grid).all() and np.isfinite(dens).all() and (dens >= 0).all()
    assert (np.diff(grid) > 0).all()
    ev = np.linalg.eigvalsh(H_BASE[12:, 12:])
    lo, hi = kw["boundaries"] if kw["boundaries"] is not None else (ev[0], ev[-1])
    assert grid[0] <= lo + 1e-6 * (hi - lo) and grid[-1] >= hi - 1e-6 * (hi - lo)


@SETTINGS
@given(rank=st.sampled_from([0, 1, 2, -1, 1.5, True, "0", None]),
       world=st.sampled_from([1, 2, 3, 0, -2, 2.0, False, None]))
def test_shard_refuses_bad_ranks_or_takes_every_world_th_batch(rank, world):
    status, out = outcome(lambda: list(D.shard(list(range(7)), rank, world)))
    if rank is None or world is None:           # no process group: the whole data
        assert status == "ok" and out == list(range(7))
        return
    valid = all(isinstance(x, int) and not isinstance(x, bool) for x in (rank, world)) \
        and world >= 1 and 0 <= rank < world
    if not valid:
        assert status == "error"
        return
    assert out == list(range(rank, 7, world))


# ----------------------------------------------------------------------------- spectra
@SETTINGS
@given(k=st.sampled_from([-1, 0, 1, 2, 8, 9, 2.0, True]),
       which=st.sampled_from(["LA", "SA", "LM", "BE", "XX"]),
       method=st.sampled_from(["auto", "eigsh", "eigh", "lanczos"]),
       tol=st.sampled_from([0.0, 1e-12, float("nan"), float("inf"), -1.0]),
       ncv=st.sampled_from([None, 0, 1, 3, 9, 10, 2.5]),
       maxiter=st.sampled_from([None, 0, -3, 1000, 1.5]))
def test_spectrum_refuses_bad_settings_or_is_right(k, which, method, tol, ncv, maxiter):
    op = sh.operator(sh.kernel("attention", "numpy", "mse"), BASE, "W_V", "W_V")
    status, out = outcome(lambda: sh.spectrum(op, k=k, which=which, method=method, tol=tol,
                                             ncv=ncv, maxiter=maxiter))
    if status == "error":
        return                            # every refusal is a one-line SymhessError
    assert isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 9
    ev = np.linalg.eigvalsh(H_BASE[12:, 12:])
    pick = {"LA": ev[::-1][:k], "SA": ev[:k], "LM": ev[np.argsort(np.abs(ev))[::-1][:k]],
            "BE": np.r_[ev[::-1][:k - k // 2], ev[:k // 2]]}[which]
    assert np.allclose(np.sort(out.values), np.sort(pick), atol=1e-7 * np.abs(ev).max())


# ----------------------------------------------------------------------------- modules
@pytest.mark.parametrize("how", ["meta", "parametrized"])
def test_modules_without_plain_values_are_refused(how):
    from torch.nn.utils import parametrize

    class Same(nn.Module):
        def forward(self, w):
            return w

    mha = nn.MultiheadAttention(4, 2, batch_first=True, device="meta" if how == "meta" else None)
    if how == "parametrized":
        parametrize.register_parametrization(mha.out_proj, "weight", Same())
    with pytest.raises(SymhessError, match="meta device" if how == "meta" else "parametrized weights"):
        sh.from_module(mha)

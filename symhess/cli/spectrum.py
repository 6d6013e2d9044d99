"""``symhess spectrum LAYER``: extreme eigenvalues of every Hessian block and part over a dataset.

For each block (the diagonal blocks by default; ``--block P,Q``; ``--block all``: every block
p ≤ q and the whole Hessian) and part (outer, functional, full), the k largest eigenvalues by
Lanczos (``symhess.curvature.spectra.spectrum``) and the one of largest magnitude, the spectral norm
‖H‖₂; an off-diagonal block's k largest singular values (‖H‖₂ the
first).  Where the layer has a published spectral-norm bound (the single attention layer with
MSE: Theorem 1's per-block terms, ``symhess.cli.bounds.theorem1_terms``) the table shows it
beside the exact norm and their ratio; for a dataset the bound is the mean of the per-sequence
bounds (‖mean_n H_n‖ ≤ mean_n ‖H_n‖ ≤ mean_n bound_n).

Data (``--data``): ``random`` (seeded normal inputs and targets, distributions for
cross-entropy; parameters as in ``symhess verify``) or ``addition`` (the experiments'
one-block model on digit-addition batches, ``addition_block`` only).  ``--batches B --batch N``
sequences of length ``--length``.  Under ``torchrun --nproc-per-node N`` every process builds
the same batches, keeps every N-th one (``symhess.curvature.distributed.shard``) and the products are
all-reduced; process 0 prints and writes.

Output: the table on stdout; with ``--out DIR``: ``spectrum.csv``, ``spectrum.png`` (the
eigenvalues of every block and part) and, with ``--density``, ``density.png`` (spectral
densities by stochastic Lanczos quadrature).
"""
from __future__ import annotations

import csv
import math
import os

import numpy as np

from ..codegen.files import atomic_open, save_figure
from ..errors import OptionError

PARTS = ("outer", "functional", "full")
BOUND_KEYS = {("W_V", "W_V"): "VV", ("W_Q", "W_Q"): "QQ", ("W_V", "W_Q"): "VQ",
              ("W_Q", "W_V"): "VQ", ("W_Q", "W_K"): "QK", ("W_K", "W_Q"): "QK", (None, None): "M"}


def add_parser(sub, layer_args, positive_int, nonnegative_int):
    from .args import nonnegative_float
    p = sub.add_parser("spectrum", help="top eigenvalues of every Hessian block and part over "
                       "a dataset (Lanczos), beside the layer's spectral-norm bound")
    layer_args(p)
    p.add_argument("--data", default="random", choices=("random", "addition"),
                   help="random normal data, or digit-addition batches (addition_block)")
    p.add_argument("--batches", type=positive_int, default=2, help="number of batches")
    p.add_argument("--batch", type=positive_int, default=4, help="sequences per batch")
    p.add_argument("--length", type=positive_int, default=8, help="sequence length L (random data)")
    p.add_argument("--size", action="append", metavar="DIM=N",
                   help="a dimension's size, e.g. d_V=16 (repeatable; others as in verify)")
    p.add_argument("--sigma", type=nonnegative_float, default=0.0,
                   help="embedding std of the addition model; 0: 0.8/sqrt(d) (default: 0)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the data and parameters")
    p.add_argument("--block", default="diag", help="P,Q; diag (every diagonal block); or all "
                   "(every block p<=q and the whole Hessian)")
    p.add_argument("--part", default="all", help="outer, functional, full or all")
    p.add_argument("--k", type=positive_int, default=5, help="eigenvalues per block and part")
    p.add_argument("--tol", type=nonnegative_float, default=1e-8, help="eigsh's relative tolerance")
    p.add_argument("--density", action="store_true", help="also the spectral densities (SLQ)")
    p.add_argument("--ncv", type=positive_int, default=64, help="Lanczos steps of the density")
    p.add_argument("--backend", default="torch", choices=("torch", "numpy"),
                   help="the kernels' backend")
    p.add_argument("--out", default=None, help="directory for the CSV and PNG files")
    p.set_defaults(func=cmd_spectrum)
    return p


# ----------------------------------------------------------------------------- data
def _sizes(items):
    out = {}
    for item in items or []:
        key, eq, val = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise OptionError(f"--size expects DIM=N (e.g. d_V=16), got {item!r}")
        try:
            n = int(val)
        except ValueError:
            raise OptionError(f"--size {key}: {val!r} is not an integer") from None
        if n < 1:
            raise OptionError(f"--size {key} must be a positive integer, got {n}")
        out[key.strip()] = n
    return out


def check_sizes(sizes, valid, what):
    """An OptionError for a --size naming no dimension of ``what`` (``valid``: the names)."""
    bad = sorted(set(sizes) - set(valid))
    if bad:
        raise OptionError(f"--size {bad[0]}: {what} has no dimension {bad[0]}; its dimensions: "
                          f"{', '.join(sorted(valid))}")


def random_dataset(derivation, sizes, length, batches, batch, seed):
    """(params, [batch dicts]): parameters as ``symhess.calculus.verify.random_values``, data normal
    (targets: row distributions for cross-entropy), all float64; a captured language model's
    data are random token ids (``LanguageModelLayer.batch``) under its own loss only.  Sizes must name the
    layer's dimensions; the arrays are checked against the memory budget before any is made."""
    import sympy as sp

    from ..layers.modules import module_layer_of
    from ..calculus.verify import dimension_symbols, random_sizes, random_values
    from ..expr.budget import check_budget
    lay = derivation.layer
    check_sizes(sizes, [s.name for s in dimension_symbols(derivation)], f"layer {lay.name!r}")
    dims = dict(sizes)
    ml = module_layer_of(lay)
    if ml is not None:                     # a captured module: its own sizes and parameters
        if ml.capture.seq_consts:
            raise OptionError(f"{lay.name}: constants that differ between the example's "
                              f"sequences ({', '.join(ml.capture.seq_consts)}) have no random data")
        dims = {**ml.capture.dims, **dims}
        if ml.capture.consts or ml.loss is not None:
            dims["L"] = ml.capture.example_length
        if ml.loss is not None and derivation.loss != ml.loss:
            raise OptionError(f"{lay.name}: the model computes its own loss, {ml.loss}; pass "
                              f"--loss {ml.loss}")
    dims.setdefault("L", length)
    env = random_sizes(derivation, seed, sizes=dims)
    data_names = [v.name for v in lay.inputs if v.role == "input"] + ["Y"]
    numel = {v.name: int(sp.sympify(v.rows * v.cols).subs(env))
             for v in list(lay.variables.values()) + [derivation.Y]}
    entries = sum(n * (batches * batch + 1 if k in data_names else 1) for k, n in numel.items())
    check_budget(8 * entries, f"the random dataset ({batches} batches of {batch} sequences)",
                 ", ".join(f"{k} = {v}" for k, v in sorted(env.items(), key=lambda kv: str(kv[0]))))
    vals = random_values(derivation, seed, sizes=dims)
    if ml is not None:
        vals.update({k: v.detach().to(torch_float64()).numpy() for k, v in ml.params().items()})
    params = {k: v for k, v in vals.items() if k not in data_names}
    rng = np.random.default_rng(seed + 1000)
    if ml is not None and ml.loss is not None:         # a language model: random token ids
        import torch
        return params, [{k: v.numpy() for k, v in ml.batch(torch.as_tensor(
            rng.integers(0, ml.vocab, (batch, ml.length)))).items()} for _ in range(batches)]
    out = []
    for _ in range(batches):
        b = {}
        for n in data_names:
            shape = vals[n].shape
            if n == "Y" and derivation.loss not in ("mse", "mse_sum"):
                y = rng.random((batch,) + shape) + 0.1
                b[n] = y / y.sum(-1, keepdims=True)
            else:
                b[n] = rng.standard_normal((batch,) + shape)
        out.append(b)
    return params, out


def torch_float64():
    import torch
    return torch.float64


def addition_dataset(layer, sizes, batches, batch, seed, sigma):
    """(params, [batch dicts]) of the experiments' model on digit-addition data."""
    from . import experiments as X
    opts = layer.options
    if layer.name != "addition_block" or opts.get("depth", 1) != 1:
        raise OptionError("--data addition is the experiments' one-block model: use LAYER "
                          "addition_block (depth 1)")
    check_sizes(sizes, ("d", "d_h", "d_m"), "the addition model")
    d = sizes.get("d", 16)
    cfg = X.Config(d_model=d, d_head=sizes.get("d_h", d), d_mlp=sizes.get("d_m", 4 * d),
                   attention=opts.get("attention", "softmax"), norm=opts.get("norm", "none"),
                   batch=batch)
    cfg.validate()
    cfg.check_memory(f"the addition model's data ({batches} batches of {batch} sequences)")
    sig = sigma if sigma else 0.8 / math.sqrt(d)
    params = X.init_values(cfg, sig, seed)
    out = []
    for i in range(batches):
        O, Y = X.batch_arrays(cfg, seed * 1000 + i)
        out.append({"O": O, "Y": Y})
    return params, out, cfg.loss


# ----------------------------------------------------------------------------- bounds
def bounds_for(layer, loss, params, batches):
    """{block key: bound} for the single attention layer with MSE (else {})."""
    if layer.name != "attention" or loss != "mse" or layer.options.get("causal") \
            or layer.options.get("scale") is not None:
        return {}
    from .bounds import theorem1_terms
    acc, n = {}, 0
    for b in batches:
        X, Y = b["X"], b["Y"]
        for i in range(X.shape[0]):
            t = theorem1_terms(_np(X[i]), _np(params["W_Q"]), _np(params["W_K"]),
                               _np(params["W_V"]), _np(Y[i]))
            for key, v in t.items():
                acc[key] = acc.get(key, 0.0) + v
            n += 1
    return {k: v / n for k, v in acc.items()}


def _np(a):
    return a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)


# ----------------------------------------------------------------------------- the command
def _blocks(layer, block):
    names = layer.param_names
    if block == "diag":
        return [(p, p) for p in names]
    if block == "all":
        return [(p, q) for i, p in enumerate(names) for q in names[i:]] + [(None, None)]
    parts = [b.strip() for b in block.split(",")]
    if len(parts) != 2:
        raise OptionError(f"--block expects P,Q, diag or all, got {block!r}; valid names: "
                          f"{', '.join(names)}")
    for b in parts:
        layer.param(b)
    return [tuple(parts)]


def _label(p, q):
    return "H (all)" if p is None else f"({p}, {q})"


def cmd_spectrum(args):
    from tqdm import tqdm

    from ..curvature import distributed as D
    from .args import layer_from_args
    from ..calculus.hessian import derive
    from ..curvature.kernels import kernel
    from ..curvature.operators import operator
    from ..curvature.spectra import density, require_curvlinops, spectrum
    from ..runtime.memory import retain_freed_memory

    if args.density:
        require_curvlinops()            # before any work: the density needs it
    retain_freed_memory()               # this command owns its process: reuse freed temporaries
    rank, world = D.init_from_env()
    lay = layer_from_args(args)
    sizes = _sizes(args.size)
    parts = PARTS if args.part == "all" else (args.part,)
    for part in parts:
        if part not in PARTS:
            raise OptionError(f"unknown part {part!r}; valid: {', '.join(PARTS)}, all")
    blocks = _blocks(lay, args.block)
    loss = args.loss
    if args.data == "addition":
        params, batches, loss_default = addition_dataset(lay, sizes, args.batches, args.batch,
                                                         args.seed, args.sigma)
        if loss == "mse":
            loss = loss_default
    else:
        params, batches = random_dataset(derive(lay, loss), sizes, args.length, args.batches,
                                         args.batch, args.seed)
    if args.out and rank == 0:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise OptionError(f"--out {args.out} is a file, not a directory")
        os.makedirs(args.out, exist_ok=True)
    k = kernel(lay, args.backend, loss)
    bounds = bounds_for(lay, loss, params, batches)
    if args.backend == "torch":
        import torch
        conv = lambda a: torch.as_tensor(a)          # noqa: E731
    else:
        conv = lambda a: a                           # noqa: E731
    params = {n: conv(v) for n, v in params.items()}
    mine = D.shard([{n: conv(v) for n, v in b.items()} for b in batches], rank, world)
    from ..curvature.dataset import Dataset
    ds = Dataset(k, mine, params=params)
    tasks = [(p, q, part) for p, q in blocks for part in parts]
    rows, dens = [], {}
    for p, q, part in tqdm(tasks, desc="spectrum", unit="block",
                           disable=None if rank == 0 else True):   # None: a terminal only
        op = operator(k, ds, p, q, part)
        if op.is_zero:
            rows.append(_row(p, q, part, np.zeros(min(args.k, min(op.shape))), 0.0,
                             "eigenvalues" if op.symmetric else "singular values", bounds, zero=True))
            continue
        kk = min(args.k, min(op.shape) - 1) if min(op.shape) > 1 else 1
        top = spectrum(op, k=max(kk, 1), which="LA" if op.symmetric else "LM", tol=args.tol,
                       seed=args.seed)
        if op.symmetric:    # ‖H‖₂ = |λ| of largest magnitude (one Lanczos run)
            norm = abs(spectrum(op, k=1, which="LM", tol=args.tol, seed=args.seed).values[0])
        else:
            norm = top.values[0]
        rows.append(_row(p, q, part, top.values, norm, top.kind, bounds))
        if args.density and op.symmetric:
            # the density's support: λ_min to 1 % (s − H's top: fast also when many
            # eigenvalues sit near 0), λ_max from above
            low = spectrum(op, k=1, which="SA", tol=1e-2, seed=args.seed).values[0]
            dens[(p, q, part)] = density(op, ncv=min(args.ncv, op.shape[0]), seed=args.seed,
                                         boundaries=(float(low), float(top.values[0])))
    if rank != 0:
        return 0
    total = sum(_sequences(b) for b in batches)      # every process built every batch
    header = (f"{lay.name} · loss={loss} · {total} sequences in {args.batches} batches"
              f"{f' · {world} processes' if world > 1 else ''} · {args.backend} · k={args.k}")
    print(header)
    _print_table(rows, args.k)
    if args.out:
        _write_csv(rows, os.path.join(args.out, "spectrum.csv"))
        path = os.path.join(args.out, "spectrum.png")
        plot_eigenvalues(rows, path, header)
        print(f"wrote {os.path.join(args.out, 'spectrum.csv')}")
        print(f"wrote {path}")
        if dens:
            path = os.path.join(args.out, "density.png")
            plot_densities(dens, path, header)
            print(f"wrote {path}")
    return 0


def _sequences(batch):
    """The number of sequences of a batch (its data's leading axis)."""
    return int(next(iter(batch.values())).shape[0])


def _row(p, q, part, values, norm, kind, bounds, zero=False):
    key = BOUND_KEYS.get((p, q)) if part == "full" else None
    bound = bounds.get(key) if key else None
    return {"block": _label(p, q), "p": p, "q": q, "part": part, "kind": kind,
            "values": np.asarray(values, dtype=float), "norm": float(norm), "zero": zero,
            "bound": bound, "ratio": (bound / norm if bound is not None and norm > 0 else None)}


def _print_table(rows, k):
    head = f"  {'block':<16}{'part':<12}{'top eigenvalues (singular values off the diagonal)':<56}" \
           f"{'‖H‖₂':>11}{'bound':>11}{'bound/‖H‖₂':>12}"
    print(head)
    for r in rows:
        vals = "≡0 (structural zero)" if r["zero"] else \
            " ".join(f"{v:.4e}" for v in r["values"][:k])
        b = f"{r['bound']:.4e}" if r["bound"] is not None else "—"
        ratio = f"{r['ratio']:.3g}" if r["ratio"] is not None else "—"
        print(f"  {r['block']:<16}{r['part']:<12}{vals:<56}{r['norm']:>11.4e}{b:>11}{ratio:>12}")


def _write_csv(rows, path):
    with atomic_open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["block", "part", "kind", "rank", "value", "spectral_norm", "bound", "ratio"])
        for r in rows:
            for i, v in enumerate(r["values"]):
                w.writerow([r["block"], r["part"], r["kind"], i + 1, f"{v:.12g}",
                            f"{r['norm']:.12g}", "" if r["bound"] is None else f"{r['bound']:.12g}",
                            "" if r["ratio"] is None else f"{r['ratio']:.6g}"])


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


COLORS = {"outer": "tab:blue", "functional": "tab:orange", "full": "tab:green"}


def plot_eigenvalues(rows, path, title):
    """Top eigenvalues per block (x) and part (colour), symmetric-log scale; bounds as bars."""
    plt = _plt()
    blocks = list(dict.fromkeys(r["block"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(blocks) + 2), 4.2))
    offs = {"outer": -0.22, "functional": 0.0, "full": 0.22}
    for r in rows:
        if r["zero"]:
            continue
        x = blocks.index(r["block"]) + offs[r["part"]]
        ax.scatter(np.full(len(r["values"]), x), r["values"], s=14, color=COLORS[r["part"]],
                   marker="o" if r["kind"] == "eigenvalues" else "s")
        if r["bound"] is not None:
            ax.plot([x - 0.1, x + 0.1], [r["bound"]] * 2, color="k", lw=1.5)
    for part, c in COLORS.items():
        ax.scatter([], [], color=c, s=14, label=part)
    if any(r["bound"] is not None for r in rows):
        ax.plot([], [], color="k", lw=1.5, label="spectral-norm bound")
    ax.set_xticks(range(len(blocks)))
    ax.set_xticklabels(blocks, rotation=30, ha="right", fontsize=8)
    vals = np.concatenate([r["values"] for r in rows if not r["zero"]]
                          + [np.array([r["bound"]]) for r in rows if r["bound"] is not None]
                          or [np.ones(1)])
    nz = np.abs(vals[vals != 0])
    hi = 3 * float(nz.max()) if nz.size else 1.0
    if np.all(vals > 0):
        ax.set_yscale("log")
        ax.set_ylim(float(nz.min()) / 3, hi)
    else:
        ax.set_yscale("symlog", linthresh=float(nz.min()) if nz.size else 1e-12)
        ax.set_ylim(-3 * float(np.abs(vals[vals < 0]).max()) if np.any(vals < 0) else 0, hi)
    ax.set_ylabel("top eigenvalues (singular values off the diagonal)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def plot_densities(dens, path, title):
    """One panel per block: the SLQ spectral density of each part (log scale)."""
    plt = _plt()
    blocks = list(dict.fromkeys((p, q) for p, q, _ in dens))
    n = len(blocks)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (p, q) in zip(axes.ravel(), blocks):
        for part in PARTS:
            if (p, q, part) in dens:
                grid, d = dens[(p, q, part)]
                ax.semilogy(grid, np.maximum(d, 1e-12), color=COLORS[part], label=part, lw=1)
        ax.set_title(_label(p, q), fontsize=9)
        ax.set_xlabel("λ")
        ax.set_ylim(bottom=1e-6)
        ax.legend(fontsize=7)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    fig.suptitle(title + " · spectral density (SLQ)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


__all__ = ["add_parser", "cmd_spectrum", "random_dataset", "addition_dataset", "bounds_for"]

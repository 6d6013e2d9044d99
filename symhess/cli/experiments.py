"""The curvature experiments of Ormaniec et al. as commands (docs/experiments.md).

    symhess experiment scaling   [--sigmas ...] [--seeds 3] [--batch 64] [--depth N] [--out DIR] ...
    symhess experiment histogram [--d-model 16] [--out DIR] ...
    symhess experiment bounds    [--trials 5] ...

Every Hessian number is exact and comes from the engine: the block's matrix-view
Hessian-vector product H_part(p, p)·V is derived from the ``addition_block`` declaration
(symhess.layers.models) and evaluated by the interpreter, vectorised with ``torch.func.vmap`` over
the batch and over the basis directions V = e_i.  The columns H e_i give the dense block
(histograms) or are reduced chunk by chunk to ‖H‖_F without keeping the block (scaling).
A block the engine derives as the Zero node is reported as a structural zero, not computed.

``--depth N`` stacks N blocks (``addition_block(depth=N)``, parameters W_Q_1 … W_V_N) and
sweeps the W_Q and W_V blocks of every layer.  Their norms come from the engine's block
columns (``exact_norms``): rendering the deep model's kernels on demand took 385 s at depth 2
(the one-block model's kernels render in seconds), the columns ≈ 0.5 s per block and part.
"""
from __future__ import annotations

import csv
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from . import data
from ..expr import nodes as E
from ..layers import models  # noqa: F401  (registers addition_block and the answer losses)
from ..expr.budget import check_budget
from ..errors import OptionError
from ..expr.evaluate import Interpreter, _Torch
from ..calculus.hessian import derive
from ..codegen.files import atomic_open, save_figure
from .bounds import theorem1_terms
from ..expr.layer import check_count
from ..layers.registry import layer
from ..runtime.memory import retain_freed_memory
from ..calculus.rules import differential

PARTS = ("outer", "functional", "full")
PART_LABEL = {"outer": "H_o", "functional": "H_f", "full": "H"}
BLOCKS = ("W_Q", "W_V")
# The papers' predicted small-σ slopes (experiments.md §1.3–1.4), drawn as dashed reference
# lines and printed next to the fitted slopes.  They are the claims under test, not inputs.
REFERENCE_SLOPES = {
    "softmax": {("W_V", "outer"): 2, ("W_V", "full"): 2, ("W_Q", "outer"): 6,
                ("W_Q", "functional"): 5, ("W_Q", "full"): 5},
    "linear": {("W_V", "outer"): 6, ("W_V", "full"): 6, ("W_Q", "outer"): 6, ("W_Q", "full"): 6},
    "pre": {},
}


def reference_slopes(kind, depth=1):
    """{(block kind, part): slope} predicted for every layer of a depth-n model (§1.3–1.4):
    softmax with residuals keeps 2 / 6 / 5; linear attention without residual outputs
    ~X^{3^n}, so every H_o block grows as σ^{2·3^n}."""
    if depth == 1:
        return REFERENCE_SLOPES.get(kind, {})
    if kind == "linear":
        return {("W_V", "outer"): 2 * 3 ** depth, ("W_Q", "outer"): 2 * 3 ** depth}
    if kind == "softmax":
        return {("W_V", "outer"): 2, ("W_Q", "outer"): 6, ("W_Q", "functional"): 5}
    return {}


def block_names(depth=1):
    """The swept blocks: W_Q, W_V (one block) or W_Q_k, W_V_k of every layer k."""
    if depth == 1:
        return BLOCKS
    return tuple(f"{p}_{k}" for k in range(1, depth + 1) for p in BLOCKS)


def block_kind(p):
    """'W_Q' for W_Q and W_Q_k (the reference-slope key), likewise W_V."""
    return p[:3]


def layer_of(p):
    """The layer index of a swept block (1 for the one-block names)."""
    return int(p.rsplit("_", 1)[1]) if p.count("_") == 2 else 1


# ----------------------------------------------------------------------------- configuration
@dataclass
class Config:
    """A model configuration: sizes, attention kind, normalisation, loss and dtype."""

    d_model: int = 128
    d_head: int = 128
    d_mlp: int = 512
    attention: str = "softmax"
    norm: str = "none"
    batch: int = 64
    device: str = "cpu"
    dtype: str = "float64"
    chunk: int = 0                      # directions per vmap call (0: automatic)
    depth: int = 1                      # stacked blocks
    extra: dict = field(default_factory=dict)

    @property
    def loss(self):
        """Cross-entropy on the answers; the summed MSE variant for linear attention (§1.4)."""
        return "mse_sum" if self.attention == "linear" else "ce_answer"

    @property
    def kind(self):
        return "pre" if self.norm == "pre" else self.attention

    @property
    def model_name(self):
        """How a figure names the model: "softmax attention", "pre-LN softmax attention" …"""
        return ("pre-LN " if self.norm == "pre" else "") + f"{self.attention} attention"

    def validate(self):
        for name in ("d_model", "d_head", "d_mlp", "batch", "depth"):
            if int(getattr(self, name)) < 1:
                raise OptionError(f"--{name.replace('_', '-')} must be a positive integer")
        check_count("depth", self.depth, 6, "addition_block")      # 6 parameters per block
        if self.device not in ("cpu", "cuda"):
            raise OptionError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise OptionError("--device cuda requested but torch sees no CUDA device")

    def memory_bytes(self, dense_blocks=()) -> int:
        """Bytes of the experiment's own arrays: the parameters, embeddings and masks, one
        batch, and the dense blocks ``dense_blocks`` (three block-sized arrays each while it
        is assembled: the columns, their concatenation and the NumPy copy)."""
        item = 4 if self.dtype == "float32" else 8
        numel = {n: r * c for n, (r, c) in shapes(self).items()}
        n = sum(numel.values()) + (data.VOCAB + data.N_CTX) * self.d_model + 2 * data.N_CTX ** 2
        n += 2 * self.batch * data.N_CTX * data.VOCAB
        n += sum(3 * numel[p] ** 2 for p in dense_blocks)
        return n * item

    def check_memory(self, what, dense_blocks=()):
        """A BudgetError, before anything is allocated, when ``memory_bytes`` exceeds the budget."""
        sizes = (f"--d-model {self.d_model}, --d-head {self.d_head}, --d-mlp {self.d_mlp}, "
                 f"--batch {self.batch}")
        check_budget(self.memory_bytes(dense_blocks), what, sizes, device=self.device)


def shapes(cfg: Config) -> dict:
    """Parameter shapes of addition_block for ``cfg`` (layer by layer, then W_U)."""
    d, h, m, v = cfg.d_model, cfg.d_head, cfg.d_mlp, data.VOCAB
    block = {"W_Q": (d, h), "W_K": (d, h), "W_V": (d, h), "W_O": (h, d), "W_1": (d, m), "W_2": (m, d)}
    if cfg.depth == 1:
        return {**block, "W_U": (d, v)}
    out = {f"{n}_{k}": s for k in range(1, cfg.depth + 1) for n, s in block.items()}
    return {**out, "W_U": (d, v)}


def init_values(cfg: Config, sigma: float, seed: int) -> dict:
    """GPT-2 init N(0, (0.8/√d)²) for weights; embeddings N(0, σ²) (σ only rescales, §1.3)."""
    rng = np.random.default_rng(1234 + seed)
    std = 0.8 / math.sqrt(cfg.d_model)
    vals = {n: std * rng.standard_normal(s) for n, s in shapes(cfg).items()}
    vals["W_E"] = sigma * rng.standard_normal((data.VOCAB, cfg.d_model))
    vals["P"] = sigma * rng.standard_normal((data.N_CTX, cfg.d_model))
    if cfg.attention == "linear":
        masks = ["M"] if cfg.depth == 1 else [f"M_{k}" for k in range(1, cfg.depth + 1)]
        for m in masks:
            vals[m] = np.tril(np.ones((data.N_CTX, data.N_CTX)))
        vals["R"] = data.answer_mask()
    return vals


def batch_arrays(cfg: Config, seed: int):
    """(O, Y): one-hot tokens and target rows of one batch of addition data, shape (B, 18, 12)."""
    (tokens,) = data.addition_batches(1, cfg.batch, seed=seed)
    targets = data.same_position_targets if cfg.attention == "linear" else data.next_token_targets
    return data.one_hot(tokens), targets(tokens)


# ----------------------------------------------------------------------------- exact blocks
class BlockColumns:
    """Columns of the diagonal block H_part(p, p) of the batch-mean loss, from the engine.

    The matrix view H_part(p, p)[V] is derived with one direction V on W_p only:
    functional: d g_p[V] with G frozen; outer: g_p with G ← ∂²ℓ[dF[V]].
    """

    def __init__(self, derivation, p, part):
        self.derivation, self.p, self.part = derivation, p, part
        w = derivation.param(p)
        self.direction = E.Var(f"V_{p}", w.rows, w.cols, "direction")
        self.expr = self._derive(w)

    def _derive(self, w):
        d, v = self.derivation, self.direction
        if self.part == "functional":
            return differential(d.gradient(self.p), {w: v})
        if self.part == "outer":
            g = d.output_gradient
            return E.substitute(d.gradient(self.p), {g: d.loss_hessian_map(differential(d.F, {w: v}))})
        return differential(d.gradient(self.p, cot=d.output_gradient.inner), {w: v})

    @property
    def is_zero(self):
        return self.expr.is_zero

    def columns(self, values, O, Y, dirs, env):
        """mean_b H_b dirs: dirs (n, r, c) → (n, r, c); O, Y carry the batch in dim 0."""
        import torch
        xp = _Torch(values[self.p])
        expr, vname = self.expr, self.direction.name

        def one(o, y, v):
            arrays = dict(values, O=o, Y=y)
            arrays[vname] = v
            return Interpreter(xp, env, arrays).run(expr)

        f = torch.func.vmap(torch.func.vmap(one, in_dims=(None, None, 0)), in_dims=(0, 0, None))
        return f(O, Y, dirs).mean(0)


class Experiment:
    """One derived model (cfg) whose W_Q / W_V blocks can be evaluated exactly."""

    def __init__(self, cfg: Config):
        cfg.validate()
        cfg.check_memory("the model's parameters and one batch")
        self.cfg = cfg
        depth = {"depth": cfg.depth} if cfg.depth != 1 else {}
        self.derivation = derive(layer("addition_block", attention=cfg.attention, norm=cfg.norm,
                                       **depth), cfg.loss)
        self.blocks = block_names(cfg.depth)
        self._cols = {}
        self._kernel = None

    def columns_for(self, p, part):
        if (p, part) not in self._cols:
            self._cols[(p, part)] = BlockColumns(self.derivation, p, part)
        return self._cols[(p, part)]

    def structural_zero(self, p, part):
        """True when the engine derives H_part(p, p) as the Zero node (full: both parts Zero)."""
        if part == "full":
            return all(self.columns_for(p, q).is_zero for q in ("outer", "functional"))
        return self.columns_for(p, part).is_zero

    def tensors(self, sigma, seed):
        import torch
        cfg = self.cfg
        dt = getattr(torch, cfg.dtype)
        vals = {k: torch.as_tensor(v, dtype=dt, device=cfg.device) for k, v in init_values(cfg, sigma, seed).items()}
        O, Y = (torch.as_tensor(a, dtype=dt, device=cfg.device) for a in batch_arrays(cfg, seed))
        env = self.derivation.dimension_env({**vals, "O": O[0], "Y": Y[0]})
        return vals, O, Y, env

    def _chunk(self, n):
        if self.cfg.chunk:
            return self.cfg.chunk
        # keep the vmapped intermediates (batch × chunk × L × d_mlp) around 2·10⁷ numbers
        per = self.cfg.batch * data.N_CTX * max(self.cfg.d_mlp, data.N_CTX * data.N_CTX) * 8
        return max(1, min(n, int(2e7 // per)))

    def iter_columns(self, p, sigma, seed, parts=("outer", "functional")):
        """Yields {part: (chunk, r, c) tensor of block columns}, chunk by chunk over e_i."""
        import torch
        vals, O, Y, env = self.tensors(sigma, seed)
        r, c = vals[p].shape
        n = r * c
        step = self._chunk(n)
        for start in range(0, n, step):
            idx = torch.arange(start, min(n, start + step), device=vals[p].device)
            dirs = torch.zeros((len(idx), n), dtype=vals[p].dtype, device=vals[p].device)
            dirs[torch.arange(len(idx)), idx] = 1
            dirs = dirs.reshape(len(idx), r, c)
            out = {}
            for part in parts:
                cols = self.columns_for(p, part)
                out[part] = (torch.zeros_like(dirs) if cols.is_zero
                             else cols.columns(vals, O, Y, dirs, env))
            yield out

    def kernel(self):
        """The generated torch kernels of this configuration's model (rendered on first use)."""
        if self._kernel is None:
            from ..curvature.kernels import kernel
            self._kernel = kernel("addition_block", "torch", self.cfg.loss,
                                  attention=self.cfg.attention, norm=self.cfg.norm)
        return self._kernel

    def exact_norms(self, p, sigma, seed):
        """{part: ‖H_part(p, p)‖_F}, exact: the generated reduction for one block, the block
        columns of the engine's matrix-view products for a stack (its kernels would have to be
        rendered on demand, minutes per configuration)."""
        if self.cfg.depth == 1:
            return self.frobenius_norms(p, sigma, seed)
        return self.frobenius_norms_by_columns(p, sigma, seed)

    def frobenius_norms(self, p, sigma, seed):
        """{part: ‖H_part(p, p)‖_F} exact, from the generated structure-aware reduction: the
        block's index networks paired with themselves (Σ over pairs of sequences), no block."""
        vals, O, Y, _ = self.tensors(sigma, seed)
        norms = self.kernel().frobenius_split(dict(vals, O=O, Y=Y), p, p)
        return {part: float(v) for part, v in norms.items()}

    def frobenius_norms_by_columns(self, p, sigma, seed):
        """{part: ‖H_part(p, p)‖_F} from block columns H e_i (the slow cross-check route)."""
        sq = dict.fromkeys(PARTS, 0.0)
        for cols in self.iter_columns(p, sigma, seed):
            full = cols["outer"] + cols["functional"]
            for part, t in (("outer", cols["outer"]), ("functional", cols["functional"]), ("full", full)):
                sq[part] += float((t * t).sum())
        return {part: math.sqrt(v) for part, v in sq.items()}

    def dense_block(self, p, sigma, seed, part="full"):
        """The dense (numel × numel) block H_part(p, p) as a NumPy array (vec_r layout)."""
        import torch
        rows = []
        for cols in self.iter_columns(p, sigma, seed):
            t = cols["outer"] + cols["functional"] if part == "full" else cols[part]
            rows.append(t.reshape(t.shape[0], -1))
        return torch.cat(rows).T.cpu().numpy()


# ----------------------------------------------------------------------------- scaling
def fit_slope(sigmas, norms, sigma_max):
    """Least-squares slope of log ‖H‖ against log σ over σ ≤ sigma_max (finite, positive points)."""
    s, v = np.asarray(sigmas, float), np.asarray(norms, float)
    keep = (s <= sigma_max * (1 + 1e-12)) & (v > 0) & np.isfinite(v)
    if keep.sum() < 2:
        return float("nan")
    return float(np.polyfit(np.log(s[keep]), np.log(v[keep]), 1)[0])


def scaling(cfg: Config, sigmas, seeds, progress=True):
    """Rows (sigma, seed, block, part, norm, structural_zero) over the σ × seed grid;
    ``progress``: a bar on stderr when it is a terminal."""
    from tqdm import tqdm
    exp = Experiment(cfg)
    rows = []
    grid = [(s, r) for r in seeds for s in sigmas]
    for sigma, seed in tqdm(grid, desc=f"scaling {cfg.kind}", unit="σ",
                            disable=None if progress else True):   # None: a terminal only
        for p in exp.blocks:
            norms = exp.exact_norms(p, sigma, seed)
            for part in PARTS:
                rows.append({"sigma": sigma, "seed": seed, "block": p, "part": part,
                             "norm": norms[part], "structural_zero": exp.structural_zero(p, part)})
    return rows


def summarise(rows, sigma_max):
    """{(block, part): (sigmas, mean, sem, slope, structural_zero)} averaged over seeds."""
    out = {}
    for p in dict.fromkeys(r["block"] for r in rows):
        for part in PARTS:
            sel = [r for r in rows if r["block"] == p and r["part"] == part]
            sigmas = sorted({r["sigma"] for r in sel})
            vals = [np.array([r["norm"] for r in sel if r["sigma"] == s]) for s in sigmas]
            mean = np.array([v.mean() for v in vals])
            sem = np.array([v.std(ddof=1) / math.sqrt(len(v)) if len(v) > 1 else 0.0 for v in vals])
            zero = all(r["structural_zero"] for r in sel)
            slope = float("nan") if zero else fit_slope(sigmas, mean, sigma_max)
            out[(p, part)] = (np.array(sigmas), mean, sem, slope, zero)
    return out


def write_csv(rows, path):
    with atomic_open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def plot_scaling(summary, kind, path, title, depth=1):
    """2 × 3 log-log panels (W_V, W_Q × H_o, H_f, H): mean ± SEM, one curve per layer, dashed
    reference slopes (a guide anchored at the first layer's smallest σ, not a fit)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(12, 7), sharex=True)
    ref = reference_slopes(kind, depth)
    blocks = list(dict.fromkeys(p for p, _ in summary))
    for i, kind_p in enumerate(("W_V", "W_Q")):
        layer_blocks = [p for p in blocks if block_kind(p) == kind_p]
        for j, part in enumerate(("outer", "functional", "full")):
            ax = axes[i, j]
            ax.set_xscale("log")
            ax.axvline(1.0, color="grey", ls=":", lw=0.8)
            ax.set_title(f"‖{PART_LABEL[part]}({kind_p})‖_F" + (" per layer" if depth > 1 else ""))
            curves = [(p, summary[(p, part)]) for p in layer_blocks]
            if all(c[4] for _, c in curves):
                ax.text(0.5, 0.5, "identically 0\n(structural Zero)", ha="center", va="center",
                        transform=ax.transAxes)
                ax.set_yticks([])
                continue
            ax.set_yscale("log")
            for p, (s, mean, sem, slope, zero) in curves:
                if zero:
                    continue
                who = f"layer {layer_of(p)}: " if depth > 1 else ""
                ax.errorbar(s, mean, yerr=sem, fmt="o-", ms=3, capsize=2,
                            label=f"{who}fit slope {slope:.2f}")
            k = ref.get((kind_p, part))
            s, mean = curves[0][1][0], curves[0][1][1]
            finite = np.isfinite(mean) & (mean > 0)
            if k is not None and finite.any():
                i0 = int(np.argmax(finite))
                ax.plot(s, mean[i0] * (s / s[i0]) ** k, "k--", lw=0.8, label=f"slope {k} (paper)")
            ax.legend(fontsize=8)
            if i == 1:
                ax.set_xlabel("embedding std σ")
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=110, metadata={"Title": title})
    plt.close(fig)


def scaling_stem(cfg) -> str:
    """scaling_<kind> for one block, scaling_<kind>_depth<N> for a stack."""
    return f"scaling_{cfg.kind}" + (f"_depth{cfg.depth}" if cfg.depth > 1 else "")


def scaling_title(cfg, seeds) -> str:
    """The scaling figure's title: the model and its sizes."""
    layers = f"{cfg.depth} layers, " if cfg.depth > 1 else ""
    return (f"{cfg.model_name}, {layers}d_model={cfg.d_model}, d_head={cfg.d_head}, "
            f"d_mlp={cfg.d_mlp}, batch={cfg.batch}, {seeds} seed(s)")


def cmd_scaling(args):
    cfg = config_from(args)
    sigmas = parse_sigmas(args.sigmas)
    if sum(s <= args.fit_max * (1 + 1e-12) for s in sigmas) < 2:
        raise OptionError(f"--fit-max {args.fit_max:g} keeps fewer than two of the σ values "
                          f"({min(sigmas):g} … {max(sigmas):g}); a slope needs two")
    seeds = [args.seed + r for r in range(args.seeds)]
    os.makedirs(args.out, exist_ok=True)       # before the sweep: a bad --out fails at once
    t0 = time.perf_counter()
    rows = scaling(cfg, sigmas, seeds, progress=not args.quiet)
    elapsed = time.perf_counter() - t0
    stem = os.path.join(args.out, scaling_stem(cfg))
    write_csv(rows, stem + ".csv")
    summary = summarise(rows, args.fit_max)
    plot_scaling(summary, cfg.kind, stem + ".png", scaling_title(cfg, len(seeds)), cfg.depth)
    ref = reference_slopes(cfg.kind, cfg.depth)
    print(f"fitted slopes for σ ≤ {args.fit_max:g} ({cfg.kind}; {elapsed:.1f} s):")
    for p in block_names(cfg.depth):
        for part in PARTS:
            _, _, _, slope, zero = summary[(p, part)]
            shown = "identically 0 (structural Zero)" if zero else f"{slope:6.3f}"
            r = ref.get((block_kind(p), part))
            print(f"  {PART_LABEL[part]:>3}({p}): {shown}" + (f"   (paper: {r})" if r is not None else ""))
    print(f"wrote {stem}.csv and {stem}.png")
    return 0


# ----------------------------------------------------------------------------- histogram
def cmd_histogram(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(args.out, exist_ok=True)
    # Fig. 1 is at initialisation: embeddings have the GPT-2 std 0.8/√d_model unless given
    sigma = args.sigma if args.sigma else 0.8 / math.sqrt(args.d_model)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    medians = {}
    for ax, attention in zip(axes, ("softmax", "linear")):
        cfg = config_from(args, attention=attention, norm="none")
        cfg.check_memory("the dense W_Q and W_V blocks of the histogram", dense_blocks=BLOCKS)
        exp = Experiment(cfg)
        bins = np.logspace(-16, 1, 70)
        for p, color in (("W_V", "tab:blue"), ("W_Q", "tab:orange")):
            h = np.abs(exp.dense_block(p, sigma, args.seed))
            medians[(attention, p)] = float(np.median(h))
            ax.hist(np.clip(h.ravel(), bins[0], None), bins=bins, alpha=0.6, color=color,
                    label=f"|H({p},{p})| entries, median {np.median(h):.1e}")
        ax.set_xscale("log")
        ax.set_title(f"{attention} attention (d_model={cfg.d_model}, batch {cfg.batch}, σ={sigma:g})")
        ax.set_xlabel("|Hessian entry|")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("count")
    fig.tight_layout()
    path = os.path.join(args.out, "histogram.png")
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    for attention in ("softmax", "linear"):
        v, q = medians[(attention, "W_V")], medians[(attention, "W_Q")]
        print(f"{attention:>7}: median |H(V,V)| = {v:.3e}, median |H(Q,Q)| = {q:.3e}, "
              f"ratio V/Q = {v / q:.3g}")
    print(f"wrote {path}")
    return 0


# ----------------------------------------------------------------------------- bounds
def cmd_bounds(args):
    """Exact spectral norms of the single-attention-layer MSE Hessian blocks vs Theorem 1."""
    from ..calculus.verify import random_values
    d = derive(layer("attention"), "mse")
    names = d.layer.param_names
    pairs = {"VV": ("W_V", "W_V"), "QQ": ("W_Q", "W_Q"), "VQ": ("W_V", "W_Q"), "QK": ("W_Q", "W_K")}
    sizes = {"L": args.length, "d_V": args.d_model, "d_K": args.d_head}
    n = 2 * args.d_model * args.d_head + args.d_model ** 2      # entries of W_Q, W_K, W_V
    check_budget(8 * 2 * n * n, "the full attention Hessian of the bounds experiment",
                 f"--length {args.length}, --d-model {args.d_model}, --d-head {args.d_head}")
    print(f"single attention layer, MSE, L={args.length}, d_V={args.d_model}, d_K={args.d_head}; "
          "norms are spectral; ratio = bound / exact")
    print(f"{'trial':>5} {'block':>5} {'exact':>11} {'bound':>11} {'ratio':>9}")
    ratios = {k: [] for k in list(pairs) + ["M"]}
    for trial in range(args.trials):
        vals = random_values(d, seed=args.seed + trial, sizes=sizes)
        vals["X"] = vals["X"] * args.sigma
        bound = theorem1_terms(vals["X"], vals["W_Q"], vals["W_K"], vals["W_V"], vals["Y"])
        full = np.block([[d.block(p, q, "full").evaluate(vals) for q in names] for p in names])
        exact = {k: float(np.linalg.norm(d.block(p, q, "full").evaluate(vals), 2)) for k, (p, q) in pairs.items()}
        exact["M"] = float(np.linalg.norm(full, 2))
        for k in ratios:
            ratio = bound[k] / exact[k] if exact[k] > 0 else float("inf")
            ratios[k].append(ratio)
            print(f"{trial:>5} {k:>5} {exact[k]:11.4e} {bound[k]:11.4e} {ratio:9.3g}")
    print("bound/exact over trials (min … max): " + ", ".join(
        f"{k} {min(v):.3g}…{max(v):.3g}" for k, v in ratios.items()))
    violated = [k for k, v in ratios.items() if min(v) < 1]
    print("bound violated for: " + (", ".join(violated) if violated else "none"))
    return 0


# ----------------------------------------------------------------------------- CLI
DEFAULT_SIGMAS = "logspace:-2:1:20"


def parse_sigmas(text):
    """'logspace:a:b:n' (10**linspace(a, b, n)) or a comma-separated list of positive numbers."""
    try:
        if text.startswith("logspace:"):
            a, b, n = text.split(":")[1:]
            out = list(10 ** np.linspace(float(a), float(b), int(n)))
        else:
            out = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise OptionError(f"--sigmas: expected 'logspace:A:B:N' or 's1,s2,...', got {text!r}") from None
    if not out or not all(math.isfinite(s) and s > 0 for s in out):
        raise OptionError(f"--sigmas must be finite positive numbers, got {text!r}")
    return out


def config_from(args, **over) -> Config:
    kw = dict(d_model=args.d_model, d_head=args.d_head or args.d_model, d_mlp=args.d_mlp,
              attention=getattr(args, "attention", "softmax"), norm=getattr(args, "norm", "none"),
              batch=args.batch, device=args.device, chunk=args.chunk, depth=getattr(args, "depth", 1))
    kw.update(over)
    return Config(**kw)


def build_parser():
    from .args import ArgumentParser, nonnegative_float, nonnegative_int, positive_float, positive_int
    p = ArgumentParser(prog="symhess experiment", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="EXPERIMENT")

    def common(sp, d_model, d_mlp, batch):
        sp.add_argument("--seed", type=nonnegative_int, default=0, help="first model/data seed (model seed 1234+seed)")
        sp.add_argument("--out", default="experiments_out", help="output directory")
        sp.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where torch computes")
        sp.add_argument("--d-model", type=positive_int, default=d_model, help="model (residual) width")
        sp.add_argument("--d-head", type=nonnegative_int, default=0, help="attention head width; 0: d_model")
        sp.add_argument("--d-mlp", type=positive_int, default=d_mlp, help="MLP hidden width")
        sp.add_argument("--batch", type=positive_int, default=batch, help="sequences per Hessian (one batch)")
        sp.add_argument("--chunk", type=nonnegative_int, default=0, help="basis directions per vectorised call (0: automatic)")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")

    s = sub.add_parser("scaling", help="‖H‖, ‖H_o‖, ‖H_f‖ of the W_Q, W_V blocks against σ (Fig. 3)")
    common(s, 128, 512, 64)
    s.add_argument("--sigmas", default=DEFAULT_SIGMAS, help="'logspace:A:B:N' or 's1,s2,...'")
    s.add_argument("--seeds", type=positive_int, default=3, help="seeds per σ (seed, seed+1, …)")
    s.add_argument("--attention", default="softmax", choices=("softmax", "linear"), help="the attention of the model")
    s.add_argument("--norm", default="none", choices=("none", "pre"), help="no LayerNorm, or pre-LN")
    s.add_argument("--fit-max", type=positive_float, default=0.1, help="fit slopes over σ ≤ this")
    s.add_argument("--depth", type=positive_int, default=1, help="stacked blocks (the W_Q, W_V blocks of every layer)")
    s.set_defaults(func=cmd_scaling)

    h = sub.add_parser("histogram", help="|entries| of the W_Q, W_V blocks, softmax vs linear (Fig. 1a/4)")
    common(h, 16, 64, 64)
    h.add_argument("--sigma", type=nonnegative_float, default=0.0, help="embedding std; 0: 0.8/√d_model (default: 0)")
    h.set_defaults(func=cmd_histogram)

    b = sub.add_parser("bounds", help="exact spectral norms vs the published Theorem 1 bound")
    b.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the first trial")
    b.add_argument("--trials", type=positive_int, default=3, help="random (X, W, Y) draws")
    b.add_argument("--length", type=positive_int, default=6, help="sequence length L")
    b.add_argument("--d-model", type=positive_int, default=5, help="token width d_V")
    b.add_argument("--d-head", type=positive_int, default=4, help="query/key width d_K")
    b.add_argument("--sigma", type=positive_float, default=1.0, help="scale of the random X")
    b.set_defaults(func=cmd_bounds)
    from .language_model import add_parser
    add_parser(sub)
    return p


def run_experiment(argv) -> int:
    """``symhess experiment ARGV…``: bad input raises a SymhessError (the CLI prints it)."""
    args = build_parser().parse_args(argv)
    out = getattr(args, "out", None)       # bounds only prints
    if out is not None and os.path.exists(out) and not os.path.isdir(out):
        raise OptionError(f"--out {out} is a file, not a directory")
    retain_freed_memory()         # this command owns its process: reuse freed temporaries
    return args.func(args)

"""A GPT-2 trained on digit addition: its exact curvature, block by block, before and after.

``symhess experiment language-model`` (needs the ``modules`` and ``spectra`` extras:
``transformers`` and ``curvlinops``, checked before any work):

1. builds a ``GPT2LMHeadModel`` from a config (vocabulary 12, context 18, dropout 0,
   float64) and draws the training and the held-out sequences of the digit-addition task
   (``symhess.cli.data``) from two seeds;
2. captures the model once with its own loss (``symhess.from_module`` on token ids: one-hot
   tokens, the tied embedding one parameter, the loss ``ce_weighted``) and renders its kernels;
3. at initialisation and after ``--steps`` AdamW steps on the model's own loss, forms the
   whole Hessian H of the held-out loss exactly, N columns for N parameters, by the kernel's
   Hessian-vector products (``operator(...).matmat``, columns vectorised), and reads off
   every quantity from it:

   * the top eigenvalues (Lanczos on H, ``symhess.spectrum``) and the spectral density
     (stochastic Lanczos quadrature, ``symhess.density``);
   * per parameter group — each layer's Q, K, V (the columns of ``c_attn`` with their
     biases), O (``attn.c_proj``), MLP (``c_fc`` and ``mlp.c_proj``), LN (``ln_1``, ``ln_2``),
     and the model's embedding (tied with the head), positions and final LayerNorm — the
     diagonal block H(G, G): its diagonal, Frobenius norm and spectral norm, and the
     Frobenius norms of every pair of groups;
   * beside each attention head's exact spectral norm ‖H(θ_h, θ_h)‖₂ (θ_h its W_Q, W_K, W_V
     columns), Theorem 1 of Ormaniec et al. evaluated at the head's input (the ``ln_1``
     output of each held-out sequence, the mean over sequences of the per-sequence bounds)
     and weights, with no target (T = 0).  That theorem bounds a single attention layer
     under a mean-squared error on its own output; inside a language model trained with
     cross-entropy through later layers its hypotheses do not hold, so it is a reference
     scale, not a guarantee, and the table says so.

Cost: capture and rendering once (seconds); per state N whole products in vectorised chunks
(N = 7 072 parameters at the defaults) and Lanczos on the dense H (O(N²) per step).  Writes
``language_model.csv`` (one row per group and state), ``language_model_pairs.csv`` (the
Frobenius norms of every pair of groups) and ``language_model.png`` to ``--out``.
"""
from __future__ import annotations

import csv
import math
import os
import re
import time

import numpy as np

from .data import N_CTX, PREDICT_POSITIONS, VOCAB, addition_batches
from ..errors import OptionError

STATES = ("initial", "trained")
KINDS = ("Q", "K", "V", "O", "MLP", "LN")


def require_transformers():
    """transformers' GPT-2 classes, or a one-line error saying how to install them."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging
    except ImportError:
        raise OptionError("the language-model experiment needs transformers: "
                          "pip install 'symhess[modules]'") from None
    logging.set_verbosity_error()
    return GPT2Config, GPT2LMHeadModel


def build_model(args):
    """The GPT-2 language model of the experiment (float64, eval mode, eager attention)."""
    import torch
    GPT2Config, GPT2LMHeadModel = require_transformers()
    if args.d_model % args.heads:
        raise OptionError(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=N_CTX, n_embd=args.d_model,
                     n_layer=args.layers, n_head=args.heads, n_inner=args.d_mlp,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=None,
                     eos_token_id=None, attn_implementation="eager")
    torch.manual_seed(1234 + args.seed)
    return GPT2LMHeadModel(cfg).double().eval()


def group_of(module_name, flat, d):
    """(layer or None, kind) of entry ``flat`` of a GPT-2 parameter (module docstring)."""
    m = re.match(r"transformer\.h\.(\d+)\.(.*)", module_name)
    if m is None:
        return None, {"transformer.wte.weight": "embedding", "transformer.wpe.weight": "positions",
                      "transformer.ln_f.weight": "final LN", "transformer.ln_f.bias": "final LN"}[module_name]
    layer, rest = int(m.group(1)), m.group(2)
    if rest == "attn.c_attn.weight":             # Conv1D: (d, 3d), columns Q | K | V
        return layer, "QKV"[(flat % (3 * d)) // d]
    if rest == "attn.c_attn.bias":
        return layer, "QKV"[flat // d]
    kind = {"attn.c_proj": "O", "mlp.c_fc": "MLP", "mlp.c_proj": "MLP", "ln_1": "LN", "ln_2": "LN"}
    return layer, kind[rest.rsplit(".", 1)[0]]


def groups(ml, d, d_h):
    """{(layer, kind): positions in H (declared order)}, and per (layer, head) the positions
    of the head's W_Q, W_K, W_V columns."""
    out, heads, o = {}, {}, 0
    for p in ml.layer.params:
        mod, idx = ml.pieces[p.name]
        idx = np.asarray(idx).reshape(-1)
        for j, flat in enumerate(idx):
            key = group_of(mod, int(flat), d)
            out.setdefault(key, []).append(o + j)
            if mod.endswith("attn.c_attn.weight"):
                col = int(flat) % (3 * d)
                heads.setdefault((key[0], (col % d) // d_h), []).append(o + j)
        o += idx.size
    return ({k: np.array(v) for k, v in out.items()}, {k: np.array(v) for k, v in heads.items()})


def train(model, args, log):
    """AdamW on the model's own loss over fresh addition batches; the last loss."""
    import torch
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = addition_batches(args.steps, args.batch, seed=args.seed + 1)
    loss = float("nan")
    for step, ids in enumerate(data):
        ids = torch.as_tensor(ids)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        loss = float(out.loss.detach())
        if (step + 1) % max(1, args.steps // 5) == 0:
            log(f"  step {step + 1:>4}: training loss {loss:.4f}")
    model.eval()
    return loss


def answer_accuracy(model, held):
    """Fraction of the answer digits the model predicts (greedy, teacher-forced)."""
    import torch
    with torch.no_grad():
        logits = torch.cat([model(input_ids=torch.as_tensor(b), use_cache=False).logits for b in held])
    ids = torch.cat([torch.as_tensor(b) for b in held])
    pos = list(PREDICT_POSITIONS)
    return float((logits[:, pos].argmax(-1) == ids[:, [p + 1 for p in pos]]).double().mean())


def dense_hessian(op, chunk, progress):
    """H as a dense NumPy matrix, ``chunk`` unit columns per product call."""
    n = op.shape[0]
    H = np.empty((n, n))
    starts = range(0, n, chunk)
    if progress:
        from tqdm import tqdm
        starts = tqdm(starts, desc="Hessian columns", unit="chunk", leave=False,
                      disable=None)     # None: a terminal only
    for a in starts:
        b = min(n, a + chunk)
        E = np.zeros((n, b - a))
        E[np.arange(a, b), np.arange(b - a)] = 1.0
        H[:, a:b] = op.matmat(E)
    return (H + H.T) / 2          # symmetric to rounding; the mean removes its last bits


def head_bounds(model, ml, held, d, n_heads):
    """{(layer, head): mean over held-out sequences of Theorem 1's M} (module docstring)."""
    import torch
    from .bounds import theorem1_terms
    d_h = d // n_heads
    inputs = {}
    hooks = [blk.ln_1.register_forward_hook(
        lambda m, a, out, l=l: inputs.setdefault(l, []).append(out.detach()))
        for l, blk in enumerate(model.transformer.h)]
    try:
        with torch.no_grad():
            for b in held:
                model(input_ids=torch.as_tensor(b), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for l, blk in enumerate(model.transformer.h):
        W = blk.attn.c_attn.weight.detach().numpy()
        X = torch.cat(inputs[l]).numpy()
        for h in range(n_heads):
            cols = [slice(k * d + h * d_h, k * d + (h + 1) * d_h) for k in range(3)]
            W_Q, W_K, W_V = (W[:, c] for c in cols)
            Ms = [theorem1_terms(x, W_Q, W_K, W_V, np.zeros((x.shape[0], d_h)))["M"] for x in X]
            out[(l, h)] = float(np.mean(Ms))
    return out


def measure(model, ml, data, held, grouped, args, log):
    """Every quantity of one state of the model (module docstring) on the held-out
    ``data`` (a ``Dataset`` of ``held``); ``grouped``: ``groups(ml, …)``."""
    from ..curvature.operators import operator
    from ..curvature.spectra import density, spectrum
    t0 = time.perf_counter()
    op = operator(data.kernel, data, p=list(ml.layer.param_names))
    H = dense_hessian(op, args.chunk, not args.quiet)
    t_dense = time.perf_counter() - t0
    top = spectrum(H, k=args.k, which="LA").values
    bottom = spectrum(H, k=1, which="SA").values
    grid, dens = density(H, ncv=min(args.ncv, H.shape[0]), boundaries=(bottom[0], top[0]))
    gs, heads = grouped
    rows = {}
    for key, idx in gs.items():
        B = H[np.ix_(idx, idx)]
        dg = np.diag(B)
        rows[key] = {"numel": idx.size, "frobenius": float(np.linalg.norm(B)),
                     "spectral": float(np.abs(np.linalg.eigvalsh(B)).max()),
                     "trace": float(dg.sum()), "diag_mean_abs": float(np.abs(dg).mean()),
                     "diag_max_abs": float(np.abs(dg).max()), "diag": dg}
    pairs = {(a, b): float(np.linalg.norm(H[np.ix_(gs[a], gs[b])])) for a in gs for b in gs}
    exact_heads = {k: float(np.abs(np.linalg.eigvalsh(H[np.ix_(i, i)])).max()) for k, i in heads.items()}
    bounds = head_bounds(model, ml, held, args.d_model, args.heads)
    log(f"  dense Hessian {H.shape[0]} × {H.shape[1]} in {t_dense:.1f} s; top eigenvalues "
        + ", ".join(f"{v:.4g}" for v in top) + f"; smallest {bottom[0]:.4g}")
    return {"top": top, "bottom": float(bottom[0]), "grid": grid, "density": dens, "rows": rows,
            "pairs": pairs, "heads": exact_heads, "bounds": bounds, "seconds": t_dense,
            "frobenius": float(np.linalg.norm(H))}


def label(key):
    layer, kind = key
    return kind if layer is None else f"{layer}.{kind}"


def ordered(keys):
    """Groups in model order: embedding, positions, then each layer's KINDS, final LN."""
    first = [k for k in keys if k[0] is None and k[1] in ("embedding", "positions")]
    layers = sorted({k[0] for k in keys if k[0] is not None})
    mid = [(l, kd) for l in layers for kd in KINDS if (l, kd) in keys]
    return sorted(first, key=lambda k: k[1]) + mid + [k for k in keys if k == (None, "final LN")]


def write_outputs(results, args, info):
    from ..codegen.files import atomic_open, save_figure
    os.makedirs(args.out, exist_ok=True)
    keys = ordered(list(results["initial"]["rows"]))
    path = os.path.join(args.out, "language_model.csv")
    with atomic_open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["state", "group", "entries", "frobenius", "spectral_norm", "trace",
                    "mean_abs_diagonal", "max_abs_diagonal"])
        for s in STATES:
            for k in keys:
                r = results[s]["rows"][k]
                w.writerow([s, label(k), r["numel"]] + [f"{r[c]:.17g}" for c in
                           ("frobenius", "spectral", "trace", "diag_mean_abs", "diag_max_abs")])
    pairs_path = os.path.join(args.out, "language_model_pairs.csv")
    with atomic_open(pairs_path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["state", "group_a", "group_b", "frobenius"])
        for s in STATES:
            for a in keys:
                for b in keys:
                    w.writerow([s, label(a), label(b), f"{results[s]['pairs'][(a, b)]:.17g}"])
    fig_path = os.path.join(args.out, "language_model.png")
    save_figure(figure(results, keys, info), fig_path, dpi=110)
    return [path, pairs_path, fig_path]


def figure(results, keys, info):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 2, figsize=(13, 8.5))
    colours = {"initial": "tab:blue", "trained": "tab:orange"}
    a = ax[0, 0]
    for s in STATES:
        r = results[s]
        a.semilogy(r["grid"], np.maximum(r["density"], 1e-12), color=colours[s],
                   label=f"{s}: λ_max = {r['top'][0]:.3g}")
        for v in r["top"]:
            a.axvline(v, color=colours[s], lw=0.6, ls=":")
    a.set_ylim(bottom=1e-7)
    a.set(xlabel="eigenvalue λ", ylabel="density", title="spectral density of H (SLQ on the exact H)")
    a.legend(fontsize=8)
    x = np.arange(len(keys))
    for j, (col, title) in enumerate((("frobenius", "‖H(G, G)‖_F per group"),
                                      ("diag_mean_abs", "mean |diag H(G, G)| per group"))):
        a = ax[0, 1] if j == 0 else ax[1, 0]
        for i, s in enumerate(STATES):
            a.bar(x + (i - 0.5) * 0.4, [results[s]["rows"][k][col] for k in keys], 0.4,
                  color=colours[s], label=s)
        a.set_yscale("log")
        a.set_xticks(x, [label(k) for k in keys], rotation=60, fontsize=7)
        a.set_title(title)
        a.legend(fontsize=8)
    a = ax[1, 1]
    hk = sorted(results["initial"]["heads"])
    xs = np.arange(len(hk))
    for i, s in enumerate(STATES):
        a.scatter(xs + (i - 0.5) * 0.2, [results[s]["heads"][k] for k in hk], color=colours[s],
                  marker="o", label=f"{s}: exact ‖H(θ_h, θ_h)‖₂")
        a.scatter(xs + (i - 0.5) * 0.2, [results[s]["bounds"][k] for k in hk], color=colours[s],
                  marker="_", s=200, label=f"{s}: Theorem 1 at the head (reference scale)")
    a.set_yscale("log")
    a.set_xticks(xs, [f"layer {l} head {h}" for l, h in hk], rotation=30, fontsize=7)
    a.set_title("attention heads: exact spectral norm and the single-layer bound")
    a.legend(fontsize=7)
    fig.suptitle(info, fontsize=9)
    fig.tight_layout()
    return fig


def cmd_language_model(args):
    """Train a small GPT-2 on digit addition; its exact curvature before and after."""
    import torch
    from ..curvature.dataset import Dataset
    from ..curvature.kernels import kernel as make_kernel
    from ..layers.modules import from_module
    from ..curvature.spectra import require_curvlinops
    from ..runtime.memory import retain_freed_memory
    require_transformers()
    require_curvlinops()            # the density, checked before any work
    retain_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    model = build_model(args)
    held = addition_batches(args.eval_batches, args.eval_batch, seed=args.seed + 2)
    example = torch.as_tensor(held[0])
    t0 = time.perf_counter()
    ml = from_module(model, (), {"input_ids": example, "labels": example, "use_cache": False})
    kernel = make_kernel(ml.layer, "torch", ml.loss)
    n = len(ml.index)
    log(f"GPT-2, {args.layers} layers, d_model {args.d_model}, {args.heads} heads, d_mlp "
        f"{args.d_mlp}: {n} parameters ({len(ml.layer.params)} declared pieces); captured and "
        f"rendered in {time.perf_counter() - t0:.1f} s; held-out: {args.eval_batches} × "
        f"{args.eval_batch} sequences")
    grouped = groups(ml, args.d_model, args.d_model // args.heads)
    results, acc, losses = {}, {}, {}
    for s in STATES:
        if s == "trained":
            log(f"training: {args.steps} AdamW steps of {args.batch} sequences, lr {args.lr}")
            train(model, args, log)
        acc[s] = answer_accuracy(model, held)
        data = Dataset(kernel, ml.batches(held), params=ml.params(model))
        losses[s] = float(data.loss())
        log(f"{s}: held-out loss {losses[s]:.4f}, answer-digit accuracy {acc[s]:.3f}")
        results[s] = measure(model, ml, data, held, grouped, args, log)
    info = (f"GPT-2 on 5-digit addition: {args.layers} layers, d_model {args.d_model}, "
            f"{args.heads} heads, d_mlp {args.d_mlp}, {n} parameters; held-out loss "
            f"{losses['initial']:.3f} → {losses['trained']:.3f}, answer accuracy "
            f"{acc['initial']:.2f} → {acc['trained']:.2f} after {args.steps} steps")
    table(results, log)
    for p in write_outputs(results, args, info):
        log(f"wrote {p}")
    log(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


def table(results, log):
    keys = ordered(list(results["initial"]["rows"]))
    log(f"{'group':>11} {'entries':>7} | {'‖H(G,G)‖_F initial':>19} {'trained':>11} | "
        f"{'mean |diag| initial':>19} {'trained':>11}")
    for k in keys:
        a, b = results["initial"]["rows"][k], results["trained"]["rows"][k]
        log(f"{label(k):>11} {a['numel']:>7} | {a['frobenius']:19.4e} {b['frobenius']:11.4e} | "
            f"{a['diag_mean_abs']:19.4e} {b['diag_mean_abs']:11.4e}")
    log("attention heads: exact ‖H(θ_h, θ_h)‖₂ and Theorem 1 at the head (single-layer MSE "
        "bound: a reference scale here, its hypotheses do not hold inside the model)")
    for k in sorted(results["initial"]["heads"]):
        cells = []
        for s in STATES:
            e, bd = results[s]["heads"][k], results[s]["bounds"][k]
            cells.append(f"{s} {e:.4e} (bound {bd:.3e}, ×{bd / e:.3g})" if e > 0 else f"{s} 0")
        log(f"  layer {k[0]} head {k[1]}: " + "; ".join(cells))


def add_parser(sub):
    """The ``language-model`` experiment's options on ``symhess experiment``'s subparsers."""
    from .args import nonnegative_int, positive_float, positive_int
    p = sub.add_parser("language-model", help="train a small GPT-2 on digit addition; its exact "
                       "curvature before and after (needs transformers)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="model seed 1234+seed; data seeds seed+1 (training), seed+2 (held out)")
    p.add_argument("--out", default="experiments_out", help="output directory")
    p.add_argument("--layers", type=positive_int, default=2, help="Transformer blocks")
    p.add_argument("--d-model", type=positive_int, default=16, help="model (residual) width")
    p.add_argument("--heads", type=positive_int, default=2, help="attention heads")
    p.add_argument("--d-mlp", type=positive_int, default=64, help="MLP hidden width")
    p.add_argument("--steps", type=positive_int, default=300, help="training steps")
    p.add_argument("--batch", type=positive_int, default=64, help="sequences per training step")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--eval-batches", type=positive_int, default=2, help="held-out batches")
    p.add_argument("--eval-batch", type=positive_int, default=4, help="sequences per held-out batch")
    p.add_argument("--k", type=positive_int, default=5, help="top eigenvalues")
    p.add_argument("--ncv", type=positive_int, default=128, help="Lanczos steps of the density")
    p.add_argument("--chunk", type=positive_int, default=256, help="Hessian columns per product call")
    p.add_argument("--threads", type=nonnegative_int, default=1,
                   help="torch threads (0: torch's default; the model's products are small, and "
                   "one thread per process is fastest at these sizes)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_language_model)
    return p

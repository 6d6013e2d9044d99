"""The ``symhess`` command line: layers, derive, verify, report, generate, run."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__
from .hessian import PARTS, derive
from .layers import LAYERS, layer, layer_options
from .losses import LOSSES


GENERATED = Path(__file__).resolve().parent.parent / "generated"


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def _parse_value(text):
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def options_from_args(args) -> dict:
    """Layer options from --causal and --set KEY=VALUE (validated against the layer)."""
    options = {}
    for item in args.set or []:
        if "=" not in item:
            raise CLIError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        options[key.strip()] = _parse_value(value.strip())
    if getattr(args, "causal", False):
        options["causal"] = True
    layer(args.layer, **options)  # validate names and options early
    return options


def layer_from_args(args):
    return layer(args.layer, **options_from_args(args))


def _losses(choice):
    """'both' means the two standard losses (MSE and cross-entropy)."""
    return ["mse", "ce"] if choice == "both" else [choice]


def cmd_layers(args):
    for name in sorted(LAYERS):
        lay = layer(name)
        opts = ", ".join(f"{k}={v!r}" for k, v in layer_options(name).items()) or "none"
        print(f"{name}")
        print(f"  parameters: {', '.join(f'{p.name} ({p.rows}×{p.cols})' for p in lay.params)}")
        print(f"  inputs:     {', '.join(f'{v.name} ({v.rows}×{v.cols})' for v in lay.inputs)}")
        print(f"  options:    {opts}")
        if lay.description:
            print(f"  {lay.description.strip().splitlines()[0]}")
    return 0


def _pairs(lay, block):
    names = lay.param_names
    if block in (None, "all"):
        return [(p, q) for p in names for q in names]
    parts = [b.strip() for b in block.split(",")]
    if len(parts) != 2:
        raise CLIError(f"--block expects P,Q (e.g. W_Q,W_K), got {block!r}; valid names: {', '.join(names)}")
    for b in parts:
        lay.param(b)
    return [tuple(parts)]


def block_label(lay, p, q, part) -> str:
    """H_o(W_p, W_q), H_f(…) or H(…) in LaTeX."""
    sub = {"outer": "_o", "functional": "_f", "full": ""}[part]
    return rf"\mathbf H{sub}({lay.param(p).latex()},{lay.param(q).latex()})"


def cmd_derive(args):
    lay = layer_from_args(args)
    d = derive(lay, args.loss)
    parts = PARTS if args.part == "all" else [args.part]
    for part in parts:
        if part not in PARTS:
            raise CLIError(f"unknown part {part!r}; valid: {', '.join(PARTS)}, all")
    keys = [(p, q, part) for p, q in _pairs(lay, args.block) for part in parts]
    if args.format == "latex":
        print_latex_blocks(d, keys)
    else:
        for p, q, part in keys:
            print(f"H_{part}({p}, {q}) = {d.block(p, q, part).text()}")
    if args.format == "latex" and args.definitions:
        from .notation import definitions
        for n in definitions([d.block(*k).expr for k in keys], d.latex_names):
            print(f"{n.symbol} := {n.tex}{n.note or ''}")
    return 0


def print_latex_blocks(d, keys):
    """Print the blocks ``keys`` ((p, q, part) …) of a derivation as LaTeX; when some term is
    too long to read, recurring sub-expressions are named and their definitions come first."""
    from .printing.latex_cse import jacobian_names, latex, share_if_long
    from .report import MAX_TERM_CHARS

    blocks = {k: d.block(*k) for k in keys}
    shared, names = share_if_long([b.expr for b in blocks.values()], d.latex_names,
                                  MAX_TERM_CHARS, hints=lambda: jacobian_names(d))
    for sub in shared:
        print(f"{sub.symbol} := {sub.tex}")
    for (p, q, part), b in blocks.items():
        tex = latex(b.expr, names, shared) if shared else b.latex()
        print(f"{block_label(d.layer, p, q, part)} = {tex}")


def verification_table(lay_name, losses, seed, options, out=print, derived=None):
    """Run verify for the given settings; returns True when every error is within tolerance.

    ``derived``: {(loss, sorted option items): Derivation} already made (not derived again).
    """
    from .verify import TOLERANCE, verify

    ok = True
    settings = [{}]
    if "causal" in layer_options(lay_name) and "causal" not in options:
        settings = [{"causal": False}, {"causal": True}]
    for loss in losses:
        for extra in settings:
            key = (loss, tuple(sorted({**options, **extra}.items())))
            d = (derived or {}).get(key)
            if d is None:
                d = derive(layer(lay_name, **{**options, **extra}), loss)
            checks, values = verify(d, seed=seed)
            shapes = ", ".join(f"{k} {v.shape[0]}×{v.shape[1]}" for k, v in sorted(values.items()))
            label = ", ".join(f"{k}={v}" for k, v in {**options, **extra}.items()) or "defaults"
            out(f"\n{lay_name} · loss={loss} · {label} · seed={seed} · {shapes}")
            out(f"  {'block':<18}{'part':<12}{'rel. error':>12}  {'':<6}")
            for c in checks:
                status = "ok" if c.ok else "FAIL"
                zero = "  (structural zero)" if c.zero else ""
                out(f"  {'(' + ', '.join(c.block) + ')':<18}{c.part:<12}{c.error:>12.2e}  {status}{zero}")
                ok &= c.ok
    out(f"\n{'all blocks agree with autograd' if ok else 'SOME BLOCKS DISAGREE'} "
        f"(tolerance {TOLERANCE:.0e}, float64)")
    return ok


def cmd_verify(args):
    ok = verification_table(args.layer, _losses(args.loss), args.seed, options_from_args(args))
    return 0 if ok else 1


def cmd_report(args):
    from .report import write_report

    lay = layer_from_args(args)
    path = write_report(lay, args.output, losses=_losses(args.loss), pdf=args.pdf)
    print(f"wrote {path}")
    return 0


def cmd_generate(args):
    try:
        from .codegen import main_generate
    except ImportError as exc:  # pragma: no cover - until code generation lands
        raise CLIError(f"code generation is not available: {exc}")
    return main_generate(check=args.check, out_dir=GENERATED)


def cmd_run(args):
    """The main job: derive every block, print LaTeX, verify against autograd, check that the
    layer's committed kernels are current (the other layers are left to ``generate --check``)."""
    import time

    opts = options_from_args(args)
    lay = layer(args.layer, **opts)
    derived = {}
    for loss in _losses(args.loss):
        t0 = time.perf_counter()
        d = derive(lay, loss)
        derived[(loss, tuple(sorted(opts.items())))] = d
        blocks = {(p, q, part): d.block(p, q, part) for p in lay.param_names
                  for q in lay.param_names for part in PARTS}
        dt = time.perf_counter() - t0
        print(f"% {lay.name}, loss={loss}: derived {len(blocks)} blocks in {dt:.2f} s")
        print_latex_blocks(d, [k for k in blocks if k[2] != "full"])
    ok = verification_table(args.layer, _losses(args.loss), args.seed, opts, derived=derived)
    status = 0 if ok else 1
    print()
    from .codegen import main_check_layer
    return status or main_check_layer(args.layer, out_dir=GENERATED)


def cmd_experiment(args):
    try:
        from .experiments import main_experiment
    except ImportError as exc:  # pragma: no cover - until the experiments land
        raise CLIError(f"experiments are not available: {exc}")
    return main_experiment(args.rest)


def build_parser():
    ap = argparse.ArgumentParser(prog="symhess", description="Derive exact loss Hessians of "
                                 "Transformer sub-layers symbolically, print LaTeX, verify, generate kernels.")
    ap.add_argument("--version", action="version", version=f"symhess {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    def layer_args(p, loss_default="mse"):
        p.add_argument("layer", help="layer name (see `symhess layers`)")
        p.add_argument("--loss", default=loss_default, help="mse, ce" + (" or both" if loss_default == "both" else ""))
        p.add_argument("--causal", action="store_true", help="use the causal mask")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="layer option (repeatable)")

    sub.add_parser("layers", help="list the declared layers").set_defaults(func=cmd_layers)

    p = sub.add_parser("derive", help="print Hessian blocks")
    layer_args(p)
    p.add_argument("--block", default="all", help="P,Q (e.g. W_Q,W_K) or all")
    p.add_argument("--part", default="full", help="outer, functional, full or all")
    p.add_argument("--format", default="latex", choices=["latex", "text"])
    p.add_argument("--definitions", action="store_true", help="also print the named quantities")
    p.set_defaults(func=cmd_derive)

    p = sub.add_parser("verify", help="compare every block with torch autograd (float64)")
    layer_args(p, "both")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("report", help="write a LaTeX document with every block")
    layer_args(p, "both")
    p.add_argument("-o", "--output", required=True, help="output .tex file")
    p.add_argument("--pdf", action="store_true", help="also compile with pdflatex")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("generate", help="write NumPy and torch kernels into generated/")
    p.add_argument("--check", action="store_true", help="only check that generated/ is up to date")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("experiment", help="the papers' curvature experiments (scaling, histogram, bounds)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_experiment)

    p = sub.add_parser("run", help="main job: derive + LaTeX + verify (+ kernel check)")
    layer_args(p, "both")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_run)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "loss") and args.loss not in (*LOSSES, "both"):
        print(f"symhess: error: unknown loss {args.loss!r}; valid: {', '.join(sorted(LOSSES))}"
              + (", both" if args.command in ("verify", "report", "run") else ""), file=sys.stderr)
        return 2
    if getattr(args, "loss", None) == "both" and args.command == "derive":
        print("symhess: error: derive takes one loss: mse or ce", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `symhess verify … | head`
        return 0
    except (CLIError, KeyError, ValueError, TypeError, NotImplementedError, OSError) as exc:
        msg = exc.args[0] if exc.args else str(exc)
        print(f"symhess: error: {msg}", file=sys.stderr)
        return 2

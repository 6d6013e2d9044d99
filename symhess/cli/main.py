"""The ``symhess`` command line: layers, derive, verify, report, generate, run, experiment.

A LAYER argument is a registered layer name (``symhess layers``) or a user's declaration,
``FILE.py:ATTR`` or ``package.module:ATTR``, where ATTR is a ``Layer`` or a factory returning
one (``--set KEY=VALUE`` options are passed to the factory; ``symhess.layers.specs``).

Exit status: 0 done; 1 a check failed (a block disagrees with autograd, a committed kernel
is stale); 2 bad input — one line ``symhess: error: …`` on stderr that names the problem
(a ``symhess.errors.SymhessError``, an operating-system error with its path, or a usage
error); 3 an internal error — the traceback, and a request to report it.

``symhess spectrum LAYER`` (``symhess.cli.spectrum``): the top eigenvalues of every Hessian
block and part over a dataset, beside the layer's spectral-norm bound; it runs under
``torchrun --nproc-per-node N`` too.

Long work (verify, report, spectrum) shows a progress bar on stderr when stderr is a terminal.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

from .._version import __version__
from ..errors import SymhessError
from ..calculus.hessian import PARTS, derive
from ..layers.specs import is_user_spec
from ..layers.registry import LAYERS
from ..layers.specs import resolve_layer, spec_options
from .args import (BUG, EXIT_BAD_INPUT, EXIT_BUG, ArgumentParser, CLIError, _progress,
                   layer_from_args, nonnegative_int, options_from_args, positive_int)
from ..calculus.losses import LOSSES


GENERATED = Path(__file__).resolve().parents[2] / "generated"


def _losses(choice):
    """'both' means the two standard losses (MSE and cross-entropy)."""
    return ["mse", "ce"] if choice == "both" else [choice]


def cmd_layers(args):
    specs = args.layers or sorted(LAYERS)
    for spec in specs:
        lay = resolve_layer(spec, {})
        opts = ", ".join(f"{k}={v!r}" for k, v in spec_options(spec).items()) or "none"
        print(f"{spec}" if spec == lay.name else f"{spec} ({lay.name})")
        print(f"  parameters: {', '.join(f'{p.name} ({p.rows}×{p.cols})' for p in lay.params)}")
        print(f"  inputs:     {', '.join(f'{v.name} ({v.rows}×{v.cols})' for v in lay.inputs) or 'none'}")
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
        from ..printing.notation import definitions
        for n in definitions([d.block(*k).expr for k in keys], d.latex_names):
            print(f"{n.symbol} := {n.tex}{n.note or ''}")
    return 0


def print_latex_blocks(d, keys):
    """Print the blocks ``keys`` ((p, q, part) …) of a derivation as LaTeX; when some term is
    too long to read, recurring sub-expressions are named and their definitions come first."""
    from ..printing.latex_cse import jacobian_names, latex, share_if_long
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

    ``lay_name``: a layer spec (``resolve_layer``).  ``derived``: {(loss, sorted option
    items): Derivation} already made (not derived again).
    """
    from ..calculus.verify import TOLERANCE, verify

    ok = True
    settings = [{}]
    if "causal" in spec_options(lay_name) and "causal" not in options:
        settings = [{"causal": False}, {"causal": True}]
    for loss in losses:
        for extra in settings:
            key = (loss, tuple(sorted({**options, **extra}.items())))
            d = (derived or {}).get(key)
            if d is None:
                d = derive(resolve_layer(lay_name, {**options, **extra}), loss)
            checks, values = verify(d, seed=seed, progress=_progress())
            shapes = ", ".join(f"{k} {v.shape[0]}×{v.shape[1]}" for k, v in sorted(values.items()))
            label = _options_label(d.layer, spec_options(lay_name), {**options, **extra})
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


def _options_label(lay, defaults, given) -> str:
    """The options a layer was built with: those given and those that differ from the spec's
    defaults (a Layer object named by FILE.py:ATTR has none, so all of its own are shown)."""
    missing = object()
    shown = dict(given)
    shown.update((k, v) for k, v in lay.options.items()
                 if k not in given and defaults.get(k, missing) != v)
    return ", ".join(f"{k}={v}" for k, v in shown.items()) or "defaults"


def cmd_verify(args):
    ok = verification_table(args.layer, _losses(args.loss), args.seed, options_from_args(args))
    return 0 if ok else 1


def _check_writable(path: Path):
    """A CLIError naming the path when it is a directory or a parent of it is a file."""
    if path.is_dir():
        raise CLIError(f"cannot write {path}: it is a directory")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CLIError(f"cannot write {path}: {parent} is a file, not a directory")
            return


def cmd_report(args):
    from .report import compile_pdf, write_report

    lay = layer_from_args(args)
    out = Path(args.output)
    _check_writable(out)
    try:
        path = write_report(lay, out, losses=_losses(args.loss), progress=_progress())
    except OSError as exc:    # the temporary file's name would say less than -o's
        raise CLIError(f"cannot write {out}: {exc.strerror or exc}") from exc
    print(f"wrote {path}")
    if args.pdf:
        print(f"wrote {compile_pdf(path)}")
    return 0


def cmd_generate(args):
    """Without LAYER: every committed module into generated/ (a source tree only).  With
    LAYER: that declaration's module, one file for both backends, as DIR/NAME.py (with
    --check: compare DIR/NAME.py with a fresh rendering instead; exit status 1 if it differs)."""
    from ..codegen.render import main_generate, render_module, render_variant, write_atomic
    progress = None
    if _progress():
        from tqdm import tqdm

        def progress(xs):
            return tqdm(xs, desc="generate", unit="layer", file=sys.stderr)
    if args.layer is None:
        if args.out is not None:
            raise CLIError("--out needs a LAYER (the committed modules go to generated/)")
        if not GENERATED.is_dir():
            raise CLIError(f"no generated/ beside the installed package ({GENERATED}); "
                           "give a LAYER and --out DIR")
        return main_generate(check=args.check, out_dir=GENERATED, progress=progress)
    opts = options_from_args(args)
    lay = resolve_layer(args.layer, opts)
    if not is_user_spec(args.layer):      # the variant key symhess.kernel(name, …) looks up
        opts = {**spec_options(args.layer), **opts}
    items = [(loss, tuple(sorted(opts.items()))) for loss in _losses(args.loss)]
    entries = [render_variant(lay, loss, o) for loss, o in (progress(items) if progress else items)]
    path = Path(args.out or ".") / f"{lay.name}.py"
    text = render_module(lay.name, entries, " ".join((lay.description or "").split()))
    if args.check:
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            print(f"{path} is up to date")
            return 0
        print(f"stale: {path}" if path.exists() else f"missing: {path}")
        return 1
    write_atomic(path, text)
    print(f"written: {path}")
    return 0


def cmd_run(args):
    """The main job: derive every block, print LaTeX, verify against autograd, check that the
    layer's committed kernels are current (the other layers are left to ``generate --check``)."""
    import time

    opts = options_from_args(args)
    lay = resolve_layer(args.layer, opts)
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
    if is_user_spec(args.layer):
        print(f"{args.layer}: a declaration outside the registry has no committed kernels")
        return status
    if not GENERATED.is_dir():          # an installed package: no committed modules beside it
        from ..codegen.render import BACKENDS, cache_dir
        from ..curvature.kernels import kernel
        for backend in BACKENDS:
            for loss in _losses(args.loss):
                kernel(lay, backend, loss).variant       # renders (or loads) the module
        print(f"kernels of {lay.name} rendered and loaded from the user cache {cache_dir()} "
              "(no generated/ beside the installed package)")
        return status
    from ..codegen.render import main_check_layer
    return status or main_check_layer(args.layer, out_dir=GENERATED)


def loss_help(both: bool) -> str:
    names = ", ".join(sorted(LOSSES))
    return f"the loss: {names}" + (", or both (mse and ce)" if both else "")


def build_parser():
    ap = ArgumentParser(prog="symhess", description="Derive exact loss Hessians of Transformer "
                        "sub-layers symbolically, print LaTeX, verify, generate kernels.")
    ap.add_argument("--version", action="version", version=f"symhess {__version__}",
                    help="print the version and exit")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    layer_help = "a registered layer (see `symhess layers`), FILE.py:ATTR or MODULE:ATTR"

    def layer_args(p, loss_default="mse"):
        p.add_argument("layer", metavar="LAYER", help=layer_help)
        p.add_argument("--loss", default=loss_default, help=loss_help(loss_default == "both"))
        p.add_argument("--causal", action="store_true", help="use the causal mask")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="a layer option, e.g. scale=0.5 (repeatable; `symhess layers` lists them)")

    p = sub.add_parser("layers", help="list the declared layers")
    p.add_argument("layers", nargs="*", metavar="LAYER", help=layer_help + " (default: all registered)")
    p.set_defaults(func=cmd_layers)

    p = sub.add_parser("derive", help="print Hessian blocks")
    layer_args(p)
    p.add_argument("--block", default="all", help="P,Q (e.g. W_Q,W_K) or all")
    p.add_argument("--part", default="full", help="outer, functional, full or all")
    p.add_argument("--format", default="latex", choices=["latex", "text"],
                   help="LaTeX (paper notation) or plain text")
    p.add_argument("--definitions", action="store_true", help="also print the named quantities")
    p.set_defaults(func=cmd_derive)

    p = sub.add_parser("verify", help="compare every block with torch autograd (float64)")
    layer_args(p, "both")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random values")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("report", help="write a LaTeX document with every block")
    layer_args(p, "both")
    p.add_argument("-o", "--output", required=True, help="output .tex file")
    p.add_argument("--pdf", action="store_true", help="also compile it with pdflatex")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("generate", help="write NumPy and torch kernels: every committed layer "
                       "into generated/, or one LAYER into --out DIR")
    p.add_argument("layer", metavar="LAYER", nargs="?", default=None,
                   help=layer_help + "; omitted: every committed layer into generated/")
    p.add_argument("--loss", default="both", help=loss_help(True) + " (with LAYER)")
    p.add_argument("--causal", action="store_true", help="use the causal mask (with LAYER)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="a layer option (repeatable; with LAYER)")
    p.add_argument("--out", "-o", metavar="DIR", default=None,
                   help="with LAYER: write (or with --check compare) DIR/NAME.py (default: the current folder)")
    p.add_argument("--check", action="store_true", help="only check: generated/ (without LAYER) or DIR/NAME.py (with LAYER) is up to date; exit status 1 if not")
    p.set_defaults(func=cmd_generate)

    # `symhess experiment …` is dispatched before parsing (main), to its own parser
    sub.add_parser("experiment", help="the papers' curvature experiments (scaling, histogram, "
                   "bounds); see `symhess experiment --help`", add_help=False)

    from .spectrum import add_parser as add_spectrum
    add_spectrum(sub, layer_args, positive_int, nonnegative_int)

    p = sub.add_parser("run", help="main job: derive + LaTeX + verify (+ kernel check)")
    layer_args(p, "both")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random values")
    p.set_defaults(func=cmd_run)
    return ap


def _check_loss(args):
    if not hasattr(args, "loss"):
        return
    both = args.command in ("verify", "report", "run", "generate")
    if args.loss not in LOSSES and not (both and args.loss == "both"):
        raise CLIError(f"unknown loss {args.loss!r}; valid: {', '.join(sorted(LOSSES))}"
                       + (", both" if both else ""))


def _os_error(exc: OSError) -> str:
    """An OS error as one line with its path(s) and reason."""
    if exc.filename is None:
        return str(exc) or type(exc).__name__
    path = str(exc.filename) + (f" -> {exc.filename2}" if exc.filename2 else "")
    return f"{path}: {exc.strerror or type(exc).__name__}"


def _dispatch(argv):
    if argv[:1] == ["experiment"]:
        from .experiments import run_experiment
        return run_experiment(argv[1:])
    args = build_parser().parse_args(argv)
    _check_loss(args)
    return args.func(args)


def main(argv=None) -> int:
    """The console entry point; returns the exit status (module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _dispatch(argv)
    except SystemExit as exc:   # argparse: --help, --version (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_BAD_INPUT)
    except BrokenPipeError:  # e.g. `symhess verify … | head`
        return 0
    except SymhessError as exc:
        print(f"symhess: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        print(f"symhess: error: {_os_error(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("symhess: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print(BUG, file=sys.stderr)
        return EXIT_BUG

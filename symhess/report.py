"""A LaTeX document with every Hessian block of a layer (rendered from a Jinja template)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jinja2

from . import __version__
from .hessian import derive
from .notation import definitions
from .printing.latex import intermediate_tex
from .printing.latex_cse import jacobian_names, share_if_long, terms
from .printing.latex_cse import latex as shared_latex

TEMPLATES = Path(__file__).resolve().parent / "templates"

LOSS_TITLES = {"mse": "mean squared error", "ce": "row-wise cross-entropy"}


def template_env() -> jinja2.Environment:
    """Jinja with LaTeX-friendly delimiters (\\VAR{…}, \\BLOCK{…})."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        block_start_string=r"\BLOCK{", block_end_string="}",
        variable_start_string=r"\VAR{", variable_end_string="}",
        comment_start_string=r"\#{", comment_end_string="}",
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        autoescape=False, undefined=jinja2.StrictUndefined)


MAX_TERM_CHARS = 4000  # wider terms exceed TeX's largest dimension even before scaling


def _terms(block, p, q, names=None, shared=()):
    """A block's LaTeX, one line per term of a sum; a term too long to typeset is summarised."""
    names = block.derivation.latex_names if names is None else names
    out = []
    for t in terms(block.expr):
        tex = shared_latex(t, names, shared)
        if len(tex) > MAX_TERM_CHARS:
            cmd = f"symhess derive {block.derivation.layer.name} --block {p},{q}".replace("_", "\\_")
            tex = rf"\text{{[a term of {len(tex):,} LaTeX characters; print it with \texttt{{{cmd}}}]}}"
        out.append(tex)
    return out


def _parts(d, progress=False):
    """{(p, q): (H_o block, H_f block)} for every ordered pair of parameters."""
    from tqdm import tqdm
    names = d.layer.param_names
    pairs = [(p, q) for p in names for q in names]
    return {(p, q): (d.block(p, q, "outer"), d.block(p, q, "functional"))
            for p, q in tqdm(pairs, desc=f"report {d.layer.name} ({d.loss})", unit="block",
                             disable=not progress, leave=False)}


def report_expressions(d) -> list:
    """What a report section prints with symbols: the layer's intermediates and every block."""
    return list(d.layer.intermediates.values()) + [b.expr for bs in _parts(d).values() for b in bs]


def _section(lay, loss, progress=False):
    d = derive(lay, loss)
    parts = _parts(d, progress)
    pairs = list(parts)
    shared, tex_names = share_if_long([b.expr for bs in parts.values() for b in bs], d.latex_names,
                                      MAX_TERM_CHARS, hints=lambda: jacobian_names(d))
    blocks = []
    for p, q in pairs:
        bo, bf = parts[p, q]
        blocks.append({"p": lay.param(p).latex(), "q": lay.param(q).latex(),
                       "outer": _terms(bo, p, q, tex_names, shared),
                       "functional": _terms(bf, p, q, tex_names, shared)})
    defs = [{"lhs": n.symbol, "rhs": n.tex, "note": n.note}
            for n in definitions(report_expressions(d), d.latex_names)]
    fp = d._loss_parts[0]
    return {"title": LOSS_TITLES.get(loss, r"\texttt{" + loss.replace("_", r"\_") + "}"), "loss": d._loss_fn(fp, d.Y).latex(),
            "blocks": blocks, "definitions": defs,
            "shared": [{"lhs": s.symbol, "rhs": s.tex} for s in shared]}


def render_report(lay, losses=("mse", "ce"), progress=False) -> str:
    """The LaTeX document; ``progress`` shows a bar per loss over the blocks on stderr."""
    opts = ", ".join(f"{k}={v}" for k, v in lay.options.items() if v not in (None, False))
    return template_env().get_template("report.tex.j2").render(
        version=__version__, layer_name=lay.name, layer_tt=lay.name.replace("_", r"\_"),
        options_text=f" ({opts})" if opts else "",
        output=lay.output.latex({v: intermediate_tex(k) for k, v in lay.intermediates.items()}),
        params=", ".join(p.latex() for p in lay.params),
        sections=[_section(lay, loss, progress) for loss in losses])


def write_report(lay, path, losses=("mse", "ce"), pdf=False, progress=False) -> Path:
    """Write the .tex file atomically; with ``pdf`` compile it with pdflatex."""
    path = Path(path)
    text = render_report(lay, losses, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tex.tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
    if pdf:
        compile_pdf(path)
    return path


def compile_pdf(tex_path: Path) -> Path:
    """Run pdflatex (twice not needed: no references) in a scratch directory."""
    exe = shutil.which("pdflatex")
    if exe is None:
        raise OSError("pdflatex not found; install texlive-latex-base and texlive-latex-recommended")
    tex_path = Path(tex_path).resolve()
    with tempfile.TemporaryDirectory() as work:
        proc = subprocess.run([exe, "-interaction=nonstopmode", "-halt-on-error", str(tex_path)],
                              cwd=work, capture_output=True, text=True, timeout=300)
        pdf = Path(work) / (tex_path.stem + ".pdf")
        if proc.returncode != 0 or not pdf.exists():
            tail = "\n".join(proc.stdout.splitlines()[-15:])
            raise OSError(f"pdflatex failed on {tex_path}:\n{tail}")
        out = tex_path.with_suffix(".pdf")
        shutil.move(str(pdf), out)
    return out

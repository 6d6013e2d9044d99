"""A LaTeX document with every Hessian block of a layer (rendered from a Jinja template)."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import jinja2

from .._version import __version__
from ..calculus.hessian import derive
from ..codegen.files import write_atomic
from ..printing.notation import GLOSSARY, definitions, glossary
from ..expr.latex import intermediate_tex
from ..printing.latex_cse import jacobian_names, named_sums, share_if_long, terms
from ..printing.latex_cse import latex as shared_latex
from ..printing.latex_lines import break_lines, width

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


MAX_TERM_CHARS = 4000  # a longer term is summarised (print it with `symhess derive`)
SHARE_CHARS = 1200     # where a term is longer (≈ two lines), recurring sub-expressions are named
# the page: US letter landscape (11 in wide) with 2 cm margins, 10 pt type (1 em = 10 pt)
PAPER, MARGIN_CM = "letterpaper", 2
LINE_EM = (11 * 72.27 - 2 * MARGIN_CM / 2.54 * 72.27) / 10   # the text width in em: 68.1
FILL = 0.9             # lines are broken at this fraction of the width (widths are estimates)
INDENT_EM = 1.0        # \quad before a further term, \qquad\quad before a term's continuation


def align_rows(lhs, rel, terms_tex, lhs_width=None):
    """Rows of an ``align*`` for ``lhs rel t_1 + t_2 + …``: one term per row, a term too wide
    for the line continued on further rows (``symhess.printing.latex_lines``)."""
    avail = FILL * LINE_EM - (width(lhs) if lhs_width is None else lhs_width)
    rows = []
    for k, t in enumerate(terms_tex):
        if k == 0:
            head, first = f"{lhs} &{rel} ", avail - width(rel)
        else:
            t = t if t.startswith("-") else "+" + t
            head, first = r"&\quad ", avail - INDENT_EM
        lines = break_lines(t, first, avail - 3 * INDENT_EM)
        rows.append(head + lines[0])
        rows.extend(r"&\qquad\quad " + line for line in lines[1:])
    return rows


def align(rows) -> str:
    """The body of an ``align*`` environment."""
    return " \\\\\n".join(rows)


def _terms(block, p, q, names=None, shared=()):
    """A block's LaTeX, one line per term of a sum; a term too long to typeset is summarised."""
    names = block.derivation.latex_names if names is None else names
    out = []
    for t in terms(block.expr):
        tex = shared_latex(t, names, shared, named_sums(block.derivation.latex_names))
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
                             disable=None if progress else True, leave=False)}


def report_expressions(d) -> list:
    """What a report section prints with symbols: the layer's intermediates and every block."""
    return list(d.layer.intermediates.values()) + [b.expr for bs in _parts(d).values() for b in bs]


def layer_definition(lay):
    """The document's first display, the layer as declared: every named quantity its output
    is built from (intermediates such as T and A, a LayerNorm's M_Y, P_Y, Ỹ …), each defined
    after the ones it uses, then F = the output in those symbols; so a layer whose output is
    itself a name (post-LN's Z) is stated in full, like every other.

    Returns (rows of an ``align*``, the symbols defined there)."""
    names = {v: intermediate_tex(k) for k, v in lay.intermediates.items()}
    pairs = [(n.symbol, ":=", n.tex + (n.note or "")) for n in definitions([lay.output], names)]
    pairs.append((r"\mathbf F", "=", shared_latex(lay.output, names, sums=named_sums(names))))
    lhs_width = max(width(lhs) for lhs, _, _ in pairs)
    rows = [row for lhs, rel, rhs in pairs for row in align_rows(lhs, rel, [rhs], lhs_width)]
    return rows, {lhs for lhs, _, _ in pairs}


def _section(lay, loss, progress=False, defined=()):
    d = derive(lay, loss)
    parts = _parts(d, progress)
    pairs = list(parts)
    shared, tex_names = share_if_long([b.expr for bs in parts.values() for b in bs], d.latex_names,
                                      SHARE_CHARS, hints=lambda: jacobian_names(d),
                                      sums=named_sums(d.latex_names))
    blocks = []
    for p, q in pairs:
        bo, bf = parts[p, q]
        tp, tq = lay.param(p).latex(), lay.param(q).latex()
        rows = []
        for part, b in (("o", bo), ("f", bf)):
            lhs = rf"\mathbf H_{part}({tp},{tq})"
            rows += align_rows(lhs, "=", _terms(b, p, q, tex_names, shared))
        blocks.append({"p": tp, "q": tq, "align": align(rows)})
    printed = report_expressions(d)
    defs = [n for n in definitions(printed, d.latex_names) if n.symbol not in defined]
    loss_expr = d._loss_fn(d._loss_parts[0], d.Y)
    section = {"title": LOSS_TITLES.get(loss, r"\texttt{" + loss.replace("_", r"\_") + "}"),
               "loss": align(align_rows(r"\ell", "=", [loss_expr.latex()])),
               "blocks": blocks,
               "definitions": _definition_rows([(n.symbol, n.tex + (n.note or "")) for n in defs]),
               "shared": _definition_rows([(s.symbol, s.tex) for s in shared])}
    return section, printed + [loss_expr], d.latex_names


def _definition_rows(pairs) -> str:
    """``symbol := definition`` rows aligned at :=, long definitions continued on further rows."""
    if not pairs:
        return ""
    lhs_width = max(width(lhs) for lhs, _ in pairs)
    return align([row for lhs, rhs in pairs for row in align_rows(lhs, ":=", [rhs], lhs_width)])


def render_report(lay, losses=("mse", "ce"), progress=False) -> str:
    """The LaTeX document; ``progress`` shows a bar per loss over the blocks on stderr
    when it is a terminal.

    Its notation paragraph explains exactly the notation that the document prints
    (``symhess.printing.notation.glossary`` over every printed expression of every section)."""
    opts = ", ".join(f"{k}={v}" for k, v in lay.options.items() if v not in (None, False))
    sections, notation = [], set()
    layer_rows, defined = layer_definition(lay)
    for loss in losses:
        section, printed, names = _section(lay, loss, progress, defined)
        sections.append(section)
        notation.update(glossary(printed, names))
    return template_env().get_template("report.tex.j2").render(
        version=__version__, layer_name=lay.name, layer_tt=lay.name.replace("_", r"\_"),
        options_text=f" ({opts})" if opts else "", paper=PAPER, margin=f"{MARGIN_CM}cm",
        output=align(layer_rows),
        params=", ".join(f"${p.latex()}$" for p in lay.params),
        notation=[text for text in GLOSSARY.values() if text in notation], sections=sections)


def write_report(lay, path, losses=("mse", "ce"), pdf=False, progress=False) -> Path:
    """Write the .tex file atomically; with ``pdf`` compile it with pdflatex."""
    path = Path(path)
    text = render_report(lay, losses, progress)
    write_atomic(path, text)
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
        out = write_atomic(tex_path.with_suffix(".pdf"), pdf.read_bytes())
    return out

"""`symhess report`: a whole LaTeX document that a real TeX engine compiles."""
import os
import shutil

import pytest

import symhess as sh
from symhess.cli.main import main
from symhess.cli.report import render_report

NEED_TEX = os.environ.get("CI") == "true"


def test_report_has_every_block_and_both_losses():
    text = render_report(sh.layer("attention"), losses=("mse", "ce"))
    assert text.count(r"\mathbf H_o(") == 18 and text.count(r"\mathbf H_f(") == 18
    assert "mean squared error" in text and "cross-entropy" in text
    assert r"\mathbf M_2 &:=" in text and r"\mathbf Z_1 &:=" in text
    assert text == render_report(sh.layer("attention"), losses=("mse", "ce"))  # deterministic


@pytest.mark.skipif(shutil.which("pdflatex") is None and not NEED_TEX, reason="pdflatex not installed")
def test_report_compiles_to_pdf(tmp_path, capsys):
    out = tmp_path / "attention.tex"
    assert main(["report", "attention", "--causal", "-o", str(out), "--pdf"]) == 0
    pdf = out.with_suffix(".pdf")
    assert pdf.exists() and pdf.read_bytes()[:5] == b"%PDF-"
    assert "causal=True" in out.read_text()


def test_terms_too_wide_to_typeset_are_summarised(monkeypatch):
    import symhess.cli.report as rep
    monkeypatch.setattr(rep, "MAX_TERM_CHARS", 200)
    text = render_report(sh.layer("attention"), losses=("mse",))
    assert "LaTeX characters; print it with" in text and r"symhess derive attention --block W\_Q,W\_K" in text
    # every term of a block is a row of its align*, a further term starting with '+'
    assert "\n&\\quad +" in text


def test_templates_ship_inside_the_package():
    """The report's template lies in the package and the wheel's package data covers it."""
    import fnmatch
    import tomllib
    from pathlib import Path

    import symhess.cli.report as rep

    package = Path(sh.__file__).resolve().parent
    assert rep.TEMPLATES.resolve().parent == package / "cli"
    assert (rep.TEMPLATES / "report.tex.j2").is_file()
    root = package.parent
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["symhess"]
    for path in rep.TEMPLATES.iterdir():
        rel = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(rel, pat) for pat in data), rel
    assert not (root / "templates").exists()

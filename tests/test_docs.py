"""README.md and docs/*.md as written: every fenced block is checked.

* ```python blocks of a document run in order in one namespace, in a scratch folder (nothing
  lands in the checkout); a ```text block right after one is exactly what it prints.
* ```bash and ```console blocks: every ``symhess …`` command parses with the real command
  line (layer, options and loss resolved); other commands name files that exist. A console
  block's ``$ symhess …`` lines run, and print the lines shown ("..." stands for any lines,
  blank lines aside; numbers agree to 6 digits, round-off-sized ones (< 1e-12) only in size).
* Markers in an HTML comment before a fence: ``<!-- docs-test: slow (why) -->`` runs the
  block in the slow profile only (a python block with the rest of its document, a command
  shown with its output by itself; its parse check stays fast); ``<!-- docs-test: excerpt
  PATH -->`` says the block is an excerpt of PATH ("…" stands for any text), checked line by line.
* A fence without a language is a diagram: it may hold no command.
* Example commands never write into docs/: the committed figures come from
  ``scripts/figures.sh`` alone, which writes exactly the committed files of docs/img.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

import symhess.cli.experiments as X
from symhess.cli.args import options_from_args
from symhess.cli.main import _check_loss, build_parser, main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"(?:<!-- docs-test: (?P<mark>\w+)(?: (?P<arg>[^>]*?))? -->\n)?"
                   r"^```(?P<lang>\w*)\n(?P<body>.*?)^```", re.S | re.M)
NUMBER = re.compile(r"[-+]?\d+\.\d+(?:e[-+]?\d+)?|[-+]?\d+e[-+]?\d+")


@dataclass
class Block:
    doc: Path
    lang: str
    body: str
    mark: str | None
    arg: str | None
    line: int
    output: str | None = None     # the text block that follows a python or bash block

    @property
    def name(self):
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc):
    text = doc.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        b = Block(doc, m["lang"], m["body"], m["mark"], m["arg"], text.count("\n", 0, m.start("lang")) + 1)
        prev = out[-1] if out else None
        between = text[prev_end:m.start()] if prev else ""
        if b.lang in ("text", "") and prev and prev.lang in ("python", "bash") and prev.output is None \
                and not between.strip():
            prev.output = b.body
            b.lang = "output"
        out.append(b)
        prev_end = m.end()
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]
PYTHON_DOCS = [doc for doc in DOCS if any(b.lang == "python" and b.mark != "excerpt" for b in blocks(doc))]


def test_every_fence_is_one_the_test_knows():
    assert len(ALL) > 30
    for b in ALL:
        assert b.lang in ("python", "bash", "console", "text", "output", ""), f"{b.name}: ```{b.lang}"
        assert b.mark in (None, "slow", "excerpt"), f"{b.name}: unknown marker {b.mark}"
        if b.lang in ("", "text"):    # a diagram or a table of output: no command to check there
            assert not re.search(r"^\s*(\$ )?symhess ", b.body, re.M), f"{b.name}: a command outside ```bash"


# ----------------------------------------------------------------------------- python
def _run_document(doc, tmp_path, with_slow):
    """Run the document's python blocks in order (cwd: tmp_path); check printed outputs."""
    ns = {"__name__": f"docs_{doc.stem}"}
    ran = 0
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for b in blocks(doc):
            if b.lang != "python" or b.mark == "excerpt" or (b.mark == "slow" and not with_slow):
                continue
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(compile(b.body, b.name, "exec"), ns)
            ran += 1
            if b.output is not None:
                assert buf.getvalue().rstrip() == b.output.rstrip(), f"{b.name} prints otherwise"
    finally:
        os.chdir(cwd)
    assert ran, f"{doc.name}: no python block ran"


@pytest.mark.parametrize("doc", PYTHON_DOCS, ids=[d.name for d in PYTHON_DOCS])
def test_python_blocks_run_as_written(doc, tmp_path):
    _run_document(doc, tmp_path, with_slow=False)


SLOW_DOCS = [doc for doc in PYTHON_DOCS if any(b.mark == "slow" for b in blocks(doc))]


@pytest.mark.slow
@pytest.mark.parametrize("doc", SLOW_DOCS, ids=[d.name for d in SLOW_DOCS])
def test_python_blocks_run_as_written_with_the_slow_ones(doc, tmp_path):
    _run_document(doc, tmp_path, with_slow=True)


@pytest.mark.parametrize("block", [b for b in ALL if b.mark == "excerpt"],
                         ids=lambda b: b.name)
def test_excerpts_are_in_the_file_they_quote(block):
    source = [line.strip() for line in (ROOT / block.arg).read_text().splitlines()]
    at = 0
    for line in (ln.strip() for ln in block.body.splitlines()):
        if line in ("", "…"):
            continue
        pattern = re.compile(re.escape(line).replace("…", ".*"))
        hit = next((i for i in range(at, len(source)) if pattern.fullmatch(source[i])), None)
        assert hit is not None, f"{block.name}: {line!r} is not in {block.arg} (after line {at})"
        at = hit + 1


# ----------------------------------------------------------------------------- shell commands
def _commands(body):
    """Every simple command of a bash or console block, as argument lists."""
    text = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        elif body.lstrip().startswith("$ "):
            continue                         # a console block's output line
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        for part in line.split("&&"):
            if part.strip():
                out.append(shlex.split(part))
    return out


def symhess_args(argv):
    """The arguments after `symhess` (an entry point or `-m symhess`), or None."""
    for i, tok in enumerate(argv):
        if tok == "symhess" or tok.endswith("/symhess"):
            return argv[i + 1:]
        if tok == "-m" and i + 1 < len(argv) and argv[i + 1] == "symhess":
            return argv[i + 2:]
    return None


def parse(args):
    """The parsed arguments of `symhess ARGS` (an experiment: its own parser), after the
    checks that need no work: the layer, its options and the loss."""
    if args[0] == "experiment":
        return X.build_parser().parse_args(args[1:])
    ns = build_parser().parse_args(args)
    _check_loss(ns)
    if getattr(ns, "layer", None):
        options_from_args(ns)
    return ns


SHELL = [b for b in ALL if b.lang in ("bash", "console")]


FILE_BLOCK = re.compile(r"# (?P<file>\w+\.py)\n")


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.name)
def test_shell_commands_are_real(block, tmp_path, monkeypatch):
    """(In a scratch folder holding the files the document shows: a python block whose first
    line is ``# NAME.py`` is that file.)"""
    monkeypatch.chdir(tmp_path)
    for b in blocks(block.doc):
        m = FILE_BLOCK.match(b.body) if b.lang == "python" else None
        if m:
            (tmp_path / m["file"]).write_text(b.body)
    commands = _commands(block.body)
    assert commands, f"{block.name}: no command"
    for argv in commands:
        args = symhess_args(argv)
        if args is not None:
            try:
                ns = parse(args)
            except SystemExit:
                pytest.fail(f"{block.name}: `symhess {' '.join(args)}` does not parse")
            out = getattr(ns, "out", None) or getattr(ns, "output", None)
            assert out is None or not Path(out).parts[:1] == ("docs",), \
                f"{block.name}: an example writes into {out} (the figures come from scripts/figures.sh)"
        elif argv[0] == "bash":
            assert (ROOT / argv[1]).is_file(), f"{block.name}: {argv[1]} does not exist"
        elif argv[0] in ("python", ".venv/bin/python") and argv[1] == "-m":
            if argv[2] != "pytest":
                assert (ROOT / (argv[2].replace(".", "/") + ".py")).is_file(), argv
        elif argv[0] in ("python", ".venv/bin/python"):
            assert (ROOT / argv[1]).is_file(), f"{block.name}: {argv[1]} does not exist"
        else:
            pytest.fail(f"{block.name}: a command the test does not know: {argv}")


def _same(expected, got):
    """Lines equal up to numbers: 6 significant digits, or both round-off sized (< 1e-12)."""
    if NUMBER.sub("#", expected).rstrip() != NUMBER.sub("#", got).rstrip():
        return False
    for a, b in zip(map(float, NUMBER.findall(expected)), map(float, NUMBER.findall(got))):
        if not (abs(a - b) <= 1e-6 * max(abs(a), abs(b)) or max(abs(a), abs(b)) < 1e-12):
            return False
    return True


def _matches(expected, got):
    """The expected lines in order, "..." standing for any number of lines (blank lines aside)."""
    exp = [line for line in expected.splitlines() if line.strip()]
    out = [line for line in got.splitlines() if line.strip()]

    def match(i, j):
        if i == len(exp):
            return j == len(out)
        if exp[i].strip() == "...":
            return any(match(i + 1, k) for k in range(j, len(out) + 1))
        return j < len(out) and _same(exp[i], out[j]) and match(i + 1, j + 1)
    return match(0, 0)


def _examples():
    """pytest params (name, argv, expected output) of every command shown with its output."""
    out = []
    for b in SHELL:
        marks = pytest.mark.slow if b.mark == "slow" else ()
        if b.lang == "console":
            parts = re.split(r"^\$ ", b.body, flags=re.M)[1:]
            for part in parts:
                cmd, _, shown = part.partition("\n")
                argv = shlex.split(cmd)
                out.append(pytest.param(b.name, argv, shown, marks=marks, id=f"{b.name} {' '.join(argv[1:3])}"))
        elif b.output is not None:
            (argv,) = _commands(b.body)
            out.append(pytest.param(b.name, argv, b.output, marks=marks, id=f"{b.name} {' '.join(argv[1:3])}"))
    return out


EXAMPLES = _examples()


@pytest.mark.parametrize("name,argv,shown", EXAMPLES)
def test_commands_print_what_the_doc_shows(name, argv, shown, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = symhess_args(argv)
    assert args is not None and main(args) == 0, name
    got = capsys.readouterr().out
    assert _matches(shown, got), f"{name}: `symhess {' '.join(args)}` prints\n{got}"


# ----------------------------------------------------------------------------- figures
def figure_commands():
    """The symhess commands of scripts/figures.sh, its output folder written as docs/img."""
    lines = (ROOT / "scripts" / "figures.sh").read_text().splitlines()
    return [shlex.split(line.replace('"$symhess"', "symhess").replace('"$out', '"docs/img'))
            for line in lines if line.startswith('"$symhess"')]


def _written(args):
    """The files `symhess ARGS` writes (from the commands' own naming)."""
    ns = parse(args)
    if args[:2] == ["experiment", "scaling"]:
        stem = X.scaling_stem(X.config_from(ns))
        return {f"{ns.out}/{stem}.csv", f"{ns.out}/{stem}.png"}
    if args[:2] == ["experiment", "histogram"]:
        return {f"{ns.out}/histogram.png"}
    if args[:2] == ["experiment", "language-model"]:
        return {f"{ns.out}/{f}" for f in ("language_model.csv", "language_model_pairs.csv",
                                          "language_model.png")}
    if args[0] == "spectrum":
        return {f"{ns.out}/spectrum.csv", f"{ns.out}/spectrum.png"} | (
            {f"{ns.out}/density.png"} if ns.density else set())
    raise AssertionError(f"figures.sh runs {args}, which writes no figure")


def test_figures_script_writes_exactly_the_committed_figures():
    written = set()
    for argv in figure_commands():
        written |= _written(symhess_args(argv))
    committed = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "img").rglob("*") if p.is_file()}
    assert written == committed
    for doc in DOCS:                   # every picture a document shows is one of them
        for ref in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", doc.read_text()):
            assert (doc.parent / ref).resolve().relative_to(ROOT).as_posix() in committed, ref


def test_the_regeneration_command_is_documented():
    text = (ROOT / "docs" / "experiments.md").read_text()
    assert "bash scripts/figures.sh" in text
    assert "bash scripts/figures.sh" in (ROOT / "README.md").read_text()


def test_readme_states_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/symhess run attention" in text
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest" in ci


def test_readme_layer_table_names_real_parameters():
    """Parameter names the layer table quotes are the layers' own (W_Q_1 of a stack, W_Q1 of
    a head)."""
    import symhess as sh
    rows = re.findall(r"^\| `(\w+)` \|(.*)$", (ROOT / "README.md").read_text(), re.M)
    checked = 0
    for name, rest in rows:
        if name not in sh.LAYERS:
            continue
        params = set(sh.layer(name).param_names)
        for quoted in re.findall(r"`([^`]*)`", rest):
            for token in re.findall(r"\bW_\w+", quoted):
                assert token in params, f"README: {name} has no parameter {token}"
                checked += 1
    assert checked >= 6

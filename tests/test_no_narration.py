"""The project speaks of the software only.

Every tracked text file under symhess/, tests/, docs/, scripts/, benchmarks/ and README.md,
BENCHMARKS.md, pyproject.toml is searched for narration of how the software was developed
(the kinds listed in ``NARRATION``) and for references that point outside the repository
(``OUTSIDE``).  Each pattern is written so that it does not match its own source text
(``sess(?:ion)`` cannot match the characters "sess(?:ion)"), and the examples below are
written with a "|" that ``_`` removes, so this file is checked like any other.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCOPE = ("symhess", "tests", "docs", "scripts", "benchmarks", "README.md", "BENCHMARKS.md",
         "pyproject.toml")
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            r"\d+(?:st|nd|rd|th)")

NARRATION = {
    "a work period": re.compile(r"\bsess(?:ion)s?\b", re.I),
    "a numbered ticket": re.compile(r"\bissues?[-\s]*#?\s*\d+", re.I),
    "a ticket by number sign": re.compile(r"\bissue\s*#", re.I),
    "a filed ticket's": re.compile(r"\bthe issue[']s\b", re.I),
    "a work iteration": re.compile(r"\brounds? of (?:work|development|changes)\b", re.I),
    "an ordinal round": re.compile(rf"\b(?:{ORDINALS})[ ](?:round|iteration)s?\b(?!-)", re.I),
    "what was tried and dropped": re.compile(r"\btried and not[ ]kept\b", re.I),
}
OUTSIDE = {
    "a link to the folder above the repository": re.compile(r"\.\./shared\b"),
    "an absolute path of the development machine": re.compile(r"(?<![\w.])/work(?=[/`'\"\s])"),
    "the reference notes or design notes outside the repository": re.compile(r"\bshared/(?:reference|DESIGN)"),
}
BINARY = (".png", ".csv", ".pdf", ".npz", ".npy", ".pkl")


def tracked_files():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return []
    out = subprocess.run(["git", "ls-files", "--", *SCOPE], cwd=ROOT, capture_output=True,
                         text=True, check=False)
    return [f for f in out.stdout.splitlines() if f and not f.endswith(BINARY)]


FILES = tracked_files()


def findings(text: str, patterns: dict) -> list[str]:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in patterns.items():
            m = pattern.search(line)
            if m:
                out.append(f"line {number}: {what}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return out


@pytest.mark.skipif(not FILES, reason="not a git checkout")
@pytest.mark.parametrize("path", FILES)
def test_file_speaks_of_the_software_only(path):
    file = ROOT / path
    if not file.exists():
        pytest.skip("deleted in the working tree")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        pytest.skip("not text")
    found = findings(text, {**NARRATION, **OUTSIDE})
    assert not found, f"{path}:\n" + "\n".join(found)


def _(text):
    """An example with its "|" removed (so the example's source does not match)."""
    return text.replace("|", "")


@pytest.mark.parametrize("text", [
    "## Eleventh sess|ion (2026-12-01): blocks copied", "a helper sess|ion measured it",
    "Iss|ue 2 item 9 asks for 20 expressions", "the iss|ue-3 target", "see iss|ue #12",
    "at the iss|ue's sizes", "the second ro|und of work", "in the third ro|und",
    "Tried and not k|ept: x", "formulas in `..|/shared/ref|erence`", "a `/wo|rk/main` checkout",
    "(`shared/DE|SIGN.md`)",
])
def test_patterns_find_narration(text):
    assert findings(_(text), {**NARRATION, **OUTSIDE})


@pytest.mark.parametrize("text", [
    "module helpers: _empty(shape, like)", "LayerNorm's forward-over-reverse issue",
    "rounds of the interleaved timing", "the first round-off error", "a second rounding pass",
    "import os.path; Path('work/x')", "a framework/workload split",
])
def test_patterns_spare_ordinary_words(text):
    assert not findings(text, {**NARRATION, **OUTSIDE})

"""Run docs/variants.md: every python block executes and prints exactly its text block."""
import contextlib
import io
import pathlib
import re

import pytest

import symhess

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "variants.md"
FENCE = re.compile(r"(<!-- docs-test: requires (?P<req>[\w.]+) -->\n)?```(?P<lang>\w+)\n(?P<body>.*?)```",
                   re.S)


def blocks():
    """[(python source, expected output or None, requirement or None)] in document order."""
    out = []
    for m in FENCE.finditer(DOC.read_text(encoding="utf-8")):
        if m["lang"] == "python":
            out.append([m["body"], None, m["req"]])
        elif m["lang"] == "text" and out and out[-1][1] is None:
            out[-1][1] = m["body"]
    return out


def available(requirement):
    module, _, attr = requirement.rpartition(".")
    return module == "symhess" and hasattr(symhess, attr)


@pytest.fixture(scope="module")
def walkthrough():
    """Execute the always-runnable blocks once (they register a layer) and keep the namespace."""
    ns, results = {}, []
    for i, (src, expected, req) in enumerate(blocks()):
        if req:
            continue
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(src, f"{DOC.name} block {i}", "exec"), ns)
        results.append((i, buf.getvalue(), expected))
    return ns, results


def test_walkthrough_has_code_and_outputs():
    bl = blocks()
    assert len(bl) >= 5 and sum(e is not None for _, e, _ in bl) >= 5
    assert any(r == "symhess.kernel" for _, _, r in bl)


def test_walkthrough_prints_what_the_doc_shows(walkthrough):
    _, results = walkthrough
    for i, got, expected in results:
        if expected is not None:
            assert got.rstrip() == expected.rstrip(), f"block {i} output differs from the doc"


def test_kernel_block(walkthrough):
    ns, _ = walkthrough
    todo = [(src, req) for src, _, req in blocks() if req]
    for src, req in todo:
        if not available(req):
            pytest.skip(f"{req} does not exist yet")
        exec(compile(src, f"{DOC.name} ({req})", "exec"), ns)

"""The README's Python examples run as written."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(code):
    exec(compile(code, str(README), "exec"), {})


def test_readme_states_the_two_commands():
    text = README.read_text()
    assert "bash scripts/setup.sh && .venv/bin/symhess run attention" in text
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest" in ci

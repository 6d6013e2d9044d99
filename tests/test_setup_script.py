"""scripts/setup.sh on a copy of the project whose `python3` is a recording stand-in: a fresh
checkout gets the environment and every install; a second call changes nothing and prints
nothing; a changed pyproject.toml (or a failed install) installs again."""
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# `python3 -m venv DIR` makes DIR/bin/python, which records its arguments, prints a version,
# creates the entry point on the editable install and fails an install when told to
PYTHON3 = r"""#!/bin/sh
echo "python3 $*" >> "$SETUP_LOG"
mkdir -p "$3/bin"
cat > "$3/bin/python" <<'EOF'
#!/bin/sh
echo "python $*" >> "$SETUP_LOG"
case "$*" in
  --version) echo "Python 3.11.2" ;;
  *" -e "*) [ -n "$SETUP_FAIL" ] && exit 1
            printf '#!/bin/sh\n' > "$(dirname "$0")/symhess"; chmod +x "$(dirname "$0")/symhess" ;;
esac
EOF
chmod +x "$3/bin/python"
"""


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for rel in ("pyproject.toml", "scripts/setup.sh", "scripts/constraints.txt"):
        shutil.copy(ROOT / rel, root / rel)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(PYTHON3)
    (bin_dir / "python3").chmod(stat.S_IRWXU)
    return root, bin_dir, tmp_path / "log"


def run_setup(checkout, **env):
    root, bin_dir, log = checkout
    before = log.read_text() if log.exists() else ""
    proc = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], capture_output=True,
                          text=True, timeout=60, cwd="/",
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                               "SETUP_LOG": str(log), **env})
    calls = (log.read_text() if log.exists() else "")[len(before):].splitlines()
    return proc, [c for c in calls if c != "python --version"]


def test_a_fresh_checkout_gets_everything_and_a_second_call_does_nothing(checkout):
    proc, calls = run_setup(checkout)
    assert proc.returncode == 0, proc.stderr
    assert calls[0].startswith("python3 -m venv")
    installs = [c for c in calls if c.startswith("python -m pip install")]
    assert len(installs) == 3 and "torch==2.13.0" in installs[1] and '.[test]' in installs[2]
    proc, calls = run_setup(checkout)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "" and calls == []


def test_a_changed_pyproject_installs_again(checkout):
    root = checkout[0]
    assert run_setup(checkout)[0].returncode == 0
    with open(root / "pyproject.toml", "a") as fh:
        fh.write("\n# a new dependency would go here\n")
    proc, calls = run_setup(checkout)
    assert proc.returncode == 0 and sum(c.startswith("python -m pip install") for c in calls) == 3
    assert run_setup(checkout)[1] == []


def test_a_failed_install_is_tried_again(checkout):
    proc, _ = run_setup(checkout, SETUP_FAIL="1")
    assert proc.returncode != 0
    proc, calls = run_setup(checkout)
    assert proc.returncode == 0 and any(".[test]" in c for c in calls)
    assert run_setup(checkout)[1] == []

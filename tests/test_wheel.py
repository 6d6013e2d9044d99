"""The wheel, installed in a fresh virtual environment and used from another folder.

The wheel is built from the source tree and installed (without dependencies) into a new
venv whose only view of third-party packages is a ``.pth`` line naming the test
environment's site-packages (an editable symhess there is not importable that way: its finder
is installed by a ``.pth`` file, which a path added by ``.pth`` does not process).  From an
empty folder, ``symhess run attention`` must derive, verify and render the kernels into the
user cache, and a layer declared in a user's script must give kernels that agree with autograd.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import symhess as sh

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow     # a wheel build and a fresh environment: the package data check
                                  # stays fast in tests/test_report.py

SCRIPT = '''
import numpy as np, torch
import symhess as sh
from symhess import expr as E
from symhess.calculus.verify import autograd_blocks, random_values

X = E.matrix("X", "L", "d")
W_1, W_2 = E.param("W_1", "d", "h"), E.param("W_2", "h", "d")
lay = sh.Layer("mine", E.hadamard(X @ W_1, X @ W_1) @ W_2 + X, params=(W_2, W_1), inputs=(X,))
d = sh.derive(lay, "mse")
values = random_values(d, seed=2)
auto = autograd_blocks(d, values)
k = sh.kernel(lay, "torch", "mse")
tv = {n: torch.as_tensor(v) for n, v in values.items()}
worst = 0.0
parts = ("outer", "functional", "full")
for p in ("W_1", "W_2"):
    for q in ("W_1", "W_2"):
        scale = max(np.abs(auto[(p, q, part)]).max() for part in parts)
        for part in parts:
            got = np.asarray(k.hessian_block(tv, p, q, part)).reshape(auto[(p, q, part)].shape)
            worst = max(worst, float(np.abs(got - auto[(p, q, part)]).max() / scale))
print("FILE", sh.__file__)
print("WORST", worst)
'''


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """(python of a fresh venv with the wheel installed, a folder outside the source tree)."""
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    wheels = list(dist.glob("symhess-*.whl"))
    assert len(wheels) == 1, wheels
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "test-dependencies.pth").write_text("\n".join(sorted(here)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheels[0])], check=True, capture_output=True, timeout=600)
    work = base / "elsewhere"
    work.mkdir()
    return python, work, Path(purelib)


def _env(work):
    return {**os.environ, "SYMHESS_CACHE_DIR": str(work / "cache"), "PYTHONPATH": ""}


def test_wheel_holds_the_templates_and_runs_the_main_job(fresh):
    python, work, purelib = fresh
    assert (purelib / "symhess" / "codegen" / "templates" / "kernels.py.j2").is_file()
    proc = subprocess.run([str(python.parent / "symhess"), "run", "attention", "--loss", "mse"],
                          cwd=work, env=_env(work), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "all blocks agree with autograd" in proc.stdout
    assert "rendered and loaded from the user cache" in proc.stdout
    (module,) = (work / "cache").rglob("attention-mse-*.py")      # one file for both backends
    assert module.parent.name == sh.__version__
    assert not (purelib / "generated").exists()


def test_a_user_declared_kernel_from_another_folder(fresh):
    python, work, purelib = fresh
    (work / "mine.py").write_text(SCRIPT)
    proc = subprocess.run([str(python), "mine.py"], cwd=work, env=_env(work),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert Path(lines["FILE"]).is_relative_to(purelib)
    assert float(lines["WORST"]) <= 1e-10

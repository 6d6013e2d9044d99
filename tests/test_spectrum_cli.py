"""``symhess spectrum``: the table, the files, the bound column, one-line errors."""
import csv
import os
import subprocess
import sys

import numpy as np
import pytest

import symhess as sh
from symhess.cli.main import main
from symhess.curvature.dataset import Dataset
from symhess.calculus.hessian import derive
from symhess.cli.spectrum import random_dataset


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_spectrum_table_files_and_bounds(capsys, tmp_path):
    argv = ["spectrum", "attention", "--size", "d_V=4", "--size", "d_K=3", "--length", "5",
            "--batches", "2", "--batch", "3", "--k", "2", "--block", "all", "--out", str(tmp_path)]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "attention · loss=mse · 6 sequences in 2 batches" in out
    assert "(W_V, W_V)      functional  ≡0 (structural zero)" in out
    for f in ("spectrum.csv", "spectrum.png"):
        assert (tmp_path / f).stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "spectrum.csv").read_text().splitlines()))
    # every eigenvalue in the CSV is the exact one of the dataset-mean block (eigh)
    d = derive(sh.layer("attention"), "mse")
    params, batches = random_dataset(d, {"d_V": 4, "d_K": 3}, 5, 2, 3, 0)
    ds = Dataset(sh.kernel("attention", "numpy", "mse"), batches, params=params)
    for r in rows:
        if r["block"] != "(W_Q, W_Q)" or r["part"] != "full":
            continue
        op = sh.operator(ds.kernel, ds, "W_Q", "W_Q", "full")
        ev = np.linalg.eigvalsh(op.to_dense())[::-1]
        assert abs(float(r["value"]) - ev[int(r["rank"]) - 1]) <= 1e-10 * abs(ev[0])
        assert abs(float(r["spectral_norm"]) - np.abs(ev).max()) <= 1e-10 * abs(ev[0])
        assert float(r["bound"]) >= float(r["spectral_norm"])       # Theorem 1 holds here
    assert {r["block"] for r in rows} >= {"(W_Q, W_K)", "H (all)"}
    kinds = {r["block"]: r["kind"] for r in rows}
    assert kinds["(W_Q, W_K)"] == "singular values" and kinds["H (all)"] == "eigenvalues"


def test_spectrum_addition_model_with_density(capsys, tmp_path):
    code, out, err = run(capsys, "spectrum", "addition_block", "--data", "addition", "--size",
                         "d=4", "--size", "d_h=4", "--size", "d_m=8", "--batches", "2",
                         "--batch", "2", "--block", "W_V,W_V", "--k", "2", "--density",
                         "--ncv", "8", "--out", str(tmp_path))
    assert code == 0, err
    assert "loss=ce_answer · 4 sequences" in out and "(W_V, W_V)" in out
    assert (tmp_path / "density.png").stat().st_size > 0


@pytest.mark.parametrize("argv, needle", [
    (("--block", "W_Z,W_Q"), "unknown block 'W_Z'"),
    (("--block", "W_Q"), "--block expects P,Q, diag or all"),
    (("--part", "bogus"), "unknown part 'bogus'"),
    (("--data", "addition"), "--data addition is the experiments' one-block model"),
    (("--size", "d_V"), "--size expects DIM=N"),
])
def test_bad_input_is_one_line(capsys, argv, needle):
    code, out, err = run(capsys, "spectrum", "attention", *argv)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_torchrun_two_processes(tmp_path):
    """`torchrun --nproc-per-node 2 symhess spectrum …` prints the one-process table."""
    args = ["spectrum", "attention", "--size", "d_V=4", "--size", "d_K=3", "--batches", "4",
            "--batch", "2", "--k", "2", "--part", "full"]
    one = subprocess.run([sys.executable, "-m", "symhess", *args], capture_output=True,
                         text=True, timeout=300)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", "29533", "-m", "symhess", *args],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    table = lambda s: [ln for ln in s.splitlines() if ln.startswith("  (")]  # noqa: E731
    assert table(one.stdout) == table(two.stdout)
    assert "2 processes" in two.stdout


def test_header_counts_the_sequences_when_every_block_is_a_structural_zero(capsys):
    """No product is computed for a structural zero; the header still counts the data."""
    code, out, err = run(capsys, "spectrum", "attention", "--block", "W_V,W_V", "--part",
                         "functional", "--batches", "3", "--batch", "2")
    assert code == 0, err
    assert "attention · loss=mse · 6 sequences in 3 batches" in out and "None" not in out
    assert "≡0 (structural zero)" in out


def test_density_without_curvlinops_fails_before_any_work(capsys, tmp_path, monkeypatch):
    """A missing optional dependency is reported at once: nothing is computed or written
    (with it, these sizes take a minute to compute)."""
    monkeypatch.setitem(sys.modules, "curvlinops", None)       # `import curvlinops` fails
    out_dir = tmp_path / "new"
    code, out, err = run(capsys, "spectrum", "attention", "--size", "d_V=64", "--size",
                         "d_K=32", "--length", "64", "--batches", "8", "--batch", "8",
                         "--density", "--out", str(out_dir))
    assert code == 2 and "curvlinops" in err and len(err.strip().splitlines()) == 1
    assert out == "" and not out_dir.exists()

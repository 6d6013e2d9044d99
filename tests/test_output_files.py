"""Every file symhess writes: atomic, never through a symbolic link, the umask's mode; the
user cache repairs corrupt modules and leaves other processes' writes alone."""
import os
import re
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import symhess as sh
from symhess.codegen import files, render as codegen
from symhess.cli.main import main
from symhess.calculus.verify import autograd_blocks, random_values

PACKAGE = Path(sh.__file__).resolve().parent


@pytest.fixture
def umask():
    def set_(mask):
        os.umask(mask)
    old = os.umask(0o022)
    yield set_
    os.umask(old)


def test_spectrum_out_replaces_a_symlink_instead_of_writing_through_it(tmp_path, umask, capsys):
    umask(0o002)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "spectrum.csv").symlink_to(precious)
    (out / "spectrum.png").symlink_to(tmp_path / "dangling")
    argv = ["spectrum", "attention", "--size", "d_V=3", "--size", "d_K=2", "--length", "3",
            "--batches", "1", "--batch", "2", "--k", "1", "--block", "W_V,W_V", "--part", "outer",
            "--backend", "numpy", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    assert precious.read_text() == "keep me\n" and not (tmp_path / "dangling").exists()
    for name in ("spectrum.csv", "spectrum.png"):
        p = out / name
        assert not p.is_symlink() and p.stat().st_size > 0
        assert p.stat().st_mode & 0o777 == 0o664
    assert (out / "spectrum.csv").read_text().startswith("block,part,kind")
    assert [p.name for p in out.iterdir() if p.name.startswith(files.TMP_PREFIX)] == []


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_report_is_written_with_the_umask_mode(tmp_path, umask, capsys, mask, mode):
    umask(mask)
    path = tmp_path / "ffn.tex"
    assert main(["report", "ffn", "--loss", "mse", "-o", str(path)]) == 0
    assert path.stat().st_mode & 0o777 == mode
    assert "\\documentclass" in path.read_text() and path.read_text().endswith("\\end{document}\n")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("old\n")
    with pytest.raises(RuntimeError, match="disk full"):
        with files.atomic_open(path) as fh:
            fh.write("half a new ")
            raise RuntimeError("disk full")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["table.csv"]
    files.write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"


WRITERS = re.compile(r"(?<!atomic_)open\([^)]*['\"][wax]b?['\"]|\.write_text\(|\.write_bytes\(|savefig\(|"
                     r"mkstemp\(|to_csv\(|shutil\.(move|copy)")


def test_every_file_symhess_writes_goes_through_the_atomic_helper():
    """No module but symhess.codegen.files opens a file for writing, saves a figure or moves a file."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "files.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if WRITERS.search(line) and not line.lstrip().startswith("#"):
                found.append(f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}")
    assert found == []


def _cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SYMHESS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(codegen, "_LOADED", {})
    monkeypatch.setattr(codegen, "GENERATED", tmp_path / "none")
    return tmp_path / "cache"


def test_a_corrupt_cached_module_is_detected_and_rendered_afresh(monkeypatch, tmp_path):
    cache = _cache(monkeypatch, tmp_path)
    d = sh.derive(sh.layer("attention"), "mse")
    values = random_values(d, seed=4)
    want = autograd_blocks(d, values)[("W_Q", "W_K", "full")]
    sh.kernel("attention", "numpy", "mse").loss(values)
    (path,) = cache.rglob("attention-mse-*.py")
    path.write_bytes(np.random.default_rng(0).bytes(4096))          # not even UTF-8
    monkeypatch.setattr(codegen, "_LOADED", {})
    with pytest.warns(UserWarning, match="is not UTF-8 text"):
        got = sh.kernel("attention", "numpy", "mse").hessian_block(values, "W_Q", "W_K")
    assert np.abs(got - want).max() <= 1e-10 * np.abs(want).max()
    assert codegen._checksum_ok(path.read_text())                    # repaired in place
    monkeypatch.setattr(codegen, "_LOADED", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sh.kernel("attention", "numpy", "mse").loss(values)          # loads without a word


def test_another_process_write_in_progress_is_left_alone(monkeypatch, tmp_path):
    """A young temporary in the cache folder may be another process's write: rendering beside
    it neither removes it (the other write would fail) nor warns; an hour-old one is removed."""
    cache = _cache(monkeypatch, tmp_path)
    folder = cache / sh.__version__
    folder.mkdir(parents=True)
    young, old = folder / (files.TMP_PREFIX + "young"), folder / (files.TMP_PREFIX + "old")
    young.write_text("being written")
    old.write_text("left by a killed run")
    hour = time.time() - 3601
    os.utime(old, (hour, hour))
    values = random_values(sh.derive(sh.layer("attention"), "mse"), seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sh.kernel("attention", "numpy", "mse").loss(values)
    assert young.read_text() == "being written" and not old.exists()
    assert len(list(folder.glob("attention-mse-*.py"))) == 1

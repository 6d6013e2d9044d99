"""The installed ``symhess`` entry point, run as a separate process: exit statuses, one-line
errors on stderr, help texts, progress bars and the bug report path."""
from __future__ import annotations

import fcntl
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from symhess.calculus.losses import LOSSES

SYMHESS = Path(sys.executable).parent / "symhess"
if not SYMHESS.exists():                      # an installation outside a virtual environment
    SYMHESS = Path(shutil.which("symhess") or SYMHESS)
pytestmark = pytest.mark.skipif(not SYMHESS.exists(), reason="the symhess entry point is not installed")

BUG = "this is a bug in symhess; please report it with the command and the traceback"


def symhess(*argv, env=None, cwd=None, timeout=300):
    """(exit status, stdout, stderr) of ``symhess ARGV…``."""
    proc = subprocess.run([str(SYMHESS), *map(str, argv)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def afile(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "afile"
    path.write_text("not a directory\n")
    return path


# one row per user error: (argv, extra environment, what the one stderr line must contain)
USER_ERRORS = {
    "unknown layer": (["derive", "nolayer"], {}, "unknown layer 'nolayer'; valid: addition_block, attention"),
    "unknown block": (["derive", "attention", "--block", "W_X,W_Q"], {},
                      "unknown block 'W_X' for layer 'attention'; valid: W_Q, W_K, W_V"),
    "unknown part": (["derive", "attention", "--part", "bogus"], {}, "unknown part 'bogus'; valid: outer, functional, full"),
    "unknown loss": (["derive", "attention", "--loss", "l1"], {}, "unknown loss 'l1'; valid: " + ", ".join(sorted(LOSSES))),
    "unknown option": (["derive", "attention", "--set", "heads=2"], {},
                       "unknown option(s) 'heads' for layer 'attention'; valid: causal, scale"),
    "causal where none": (["derive", "ffn", "--causal"], {}, "unknown option(s) 'causal' for layer 'ffn'"),
    "causal=maybe": (["derive", "attention", "--set", "causal=maybe"], {}, "option causal expects true or false, got 'maybe'"),
    "empty --set key": (["derive", "attention", "--set", "=1"], {},
                        "--set expects KEY=VALUE with a non-empty KEY, got '=1'; options of attention: causal, scale"),
    "bad option value": (["derive", "multihead_attention", "--set", "heads=0"], {}, "heads must be a positive integer, got 0"),
    "bad scale": (["derive", "attention", "--set", "scale=abc"], {}, "scale 'abc' uses abc, which this layer does not have (valid: L, d_K, d_V, d_model)"),
    "negative seed": (["verify", "attention", "--seed", "-1"], {},
                      "argument --seed: must be a non-negative integer, got '-1' (see 'symhess verify --help')"),
    "missing layer": (["derive"], {}, "the following arguments are required: LAYER"),
    "no command": ([], {}, "the following arguments are required: COMMAND"),
    "bad format": (["derive", "attention", "--format", "pdf"], {}, "argument --format: invalid choice: 'pdf'"),
    "--block P": (["derive", "attention", "--block", "W_Q"], {}, "--block expects P,Q"),
    "layers: unknown": (["layers", "attn"], {}, "unknown layer 'attn'"),
    "report into a file": (["report", "attention", "-o", "{afile}/x.tex"], {},
                           "cannot write {afile}/x.tex: {afile} is a file, not a directory"),
    "report onto a directory": (["report", "attention", "-o", "{dir}"], {}, "cannot write {dir}: it is a directory"),
    "report where nothing can be written": (["report", "attention", "-o", "/proc/x.tex"], {},
                                            "cannot write /proc/x.tex: No such file or directory"),
    "verify beyond the budget": (["verify", "attention", "--loss", "mse"], {"SYMHESS_MEMORY_BUDGET": "1KiB"},
                                 "verifying 'attention' against autograd would take about"),
    "bad budget": (["verify", "attention"], {"SYMHESS_MEMORY_BUDGET": "lots"}, "SYMHESS_MEMORY_BUDGET='lots' is not a size"),
    "generate: --out without a layer": (["generate", "--out", "{dir}"], {},
                                        "--out needs a LAYER (the committed modules go to generated/)"),
    "generate: unknown layer": (["generate", "nolayer"], {}, "unknown layer 'nolayer'; valid: addition_block"),
    "experiment: negative seed": (["experiment", "scaling", "--seed", "-1"], {},
                                  "argument --seed: must be a non-negative integer, got '-1' "
                                  "(see 'symhess experiment scaling --help')"),
    "experiment: zero batch": (["experiment", "scaling", "--batch", "0"], {}, "argument --batch: must be a positive integer"),
    "experiment: bad sigmas": (["experiment", "scaling", "--sigmas", "abc"], {}, "--sigmas: expected 'logspace:A:B:N'"),
    "experiment: unknown": (["experiment", "bogus"], {}, "argument EXPERIMENT: invalid choice: 'bogus'"),
    "experiment: none": (["experiment"], {}, "the following arguments are required: EXPERIMENT"),
    "experiment: --out a file": (["experiment", "scaling", "--out", "{afile}"], {}, "--out {afile} is a file, not a directory"),
    "experiment: huge d_model": (["experiment", "scaling", "--d-model", "100000"], {"SYMHESS_MEMORY_BUDGET": "64GiB"},
                                 "the model's parameters and one batch would take about 298.8 GiB at --d-model "
                                 "100000, --d-head 100000, --d-mlp 512, --batch 64, more than the memory budget "
                                 "of 64.0 GiB"),
    "experiment: huge bounds": (["experiment", "bounds", "--d-model", "300", "--d-head", "300"],
                                {"SYMHESS_MEMORY_BUDGET": "1GiB"},
                                "the full attention Hessian of the bounds experiment would take about 1.1 TiB "
                                "at --length 6, --d-model 300, --d-head 300"),
    "experiment: huge histogram": (["experiment", "histogram", "--d-model", "200"], {"SYMHESS_MEMORY_BUDGET": "8GiB"},
                                   "the dense W_Q and W_V blocks of the histogram would take about"),
    "experiment: --fit-max nan": (["experiment", "scaling", "--fit-max", "nan"], {},
                                  "argument --fit-max: must be a finite number > 0, got 'nan'"),
    "experiment: --fit-max below every σ": (["experiment", "scaling", "--fit-max", "1e-9"], {},
                                            "--fit-max 1e-09 keeps fewer than two of the σ values"),
    "experiment: bounds --sigma 0": (["experiment", "bounds", "--sigma", "0"], {},
                                     "argument --sigma: must be a finite number > 0, got '0'"),
    "experiment: bounds --sigma nan": (["experiment", "bounds", "--sigma", "nan"], {},
                                       "argument --sigma: must be a finite number > 0, got 'nan'"),
    "experiment: bounds --sigma inf": (["experiment", "bounds", "--sigma", "inf"], {},
                                       "argument --sigma: must be a finite number > 0, got 'inf'"),
    "experiment: absurd depth": (["experiment", "scaling", "--depth", "100000000"], {},
                                 "depth=100000000 for addition_block would declare"),
    "spectrum: no such dimension": (["spectrum", "attention", "--size", "d_Z=4"], {},
                                    "--size d_Z: layer 'attention' has no dimension d_Z; its dimensions: L, d_K, d_V"),
    "spectrum: huge data": (["spectrum", "attention", "--length", "100000", "--batch", "100000"],
                            {"SYMHESS_MEMORY_BUDGET": "64GiB"},
                            "the random dataset (2 batches of 100000 sequences) would take about"),
    "spectrum: huge size": (["spectrum", "attention", "--size", "d_V=100000000"], {"SYMHESS_MEMORY_BUDGET": "64GiB"},
                            "the random dataset (2 batches of 4 sequences) would take about"),
    "spectrum: tol nan": (["spectrum", "attention", "--tol", "nan"], {},
                          "argument --tol: must be a finite number >= 0, got 'nan'"),
    "absurd depth": (["derive", "attention_stack", "--set", "depth=100000000"], {},
                     "depth=100000000 for stack 'attention_stack' would declare 300,000,000 parameters; "
                     "at most 128 are derived (depth <= 42)"),
    "absurd heads": (["derive", "multihead_attention", "--set", "heads=1000000"], {},
                     "heads=1000000 for multihead_attention would declare"),
    "budget beyond any machine": (["verify", "attention"], {"SYMHESS_MEMORY_BUDGET": "1e400"},
                                  "SYMHESS_MEMORY_BUDGET='1e400' is beyond any machine"),
    "a declaration that exits": (["derive", "{exits}:layer"], {},
                                 "loading {exits} failed: it called sys.exit(0) (exits.py, line 2); "
                                 "a declaration must define layers, not end the program"),
    "a file without :ATTR": (["verify", "{exits}"], {},
                             "unknown layer '{exits}': a declaration in a file or module is named "
                             "with its attribute, {exits}:ATTR"),
}


# these rows also run through the installed entry point, each in its own process (the others
# call the function the entry point calls: the same code without a process start each)
THROUGH_THE_ENTRY_POINT = ("unknown layer", "negative seed", "experiment: huge d_model")


@pytest.fixture(scope="module")
def user_errors(afile, tmp_path_factory):
    """The THROUGH_THE_ENTRY_POINT rows run once, four processes at a time."""
    d = tmp_path_factory.mktemp("outdir")

    def one(key):
        argv, env, needle = USER_ERRORS[key]
        fill = {"afile": afile, "dir": d, "exits": _exits(d)}
        rc, out, err = symhess(*(a.format(**fill) for a in argv), env=env, cwd=d)
        return key, (rc, out, err, needle.format(**fill))

    with ThreadPoolExecutor(4) as pool:
        return dict(pool.map(one, THROUGH_THE_ENTRY_POINT))


def _exits(d):
    """A declaration file that calls sys.exit when it is loaded."""
    exits = d / "exits.py"
    exits.write_text("import sys\nsys.exit(0)\n")
    return exits


def _in_process(key, afile, tmp_path, monkeypatch, capsys):
    from symhess.cli.main import main
    argv, env, needle = USER_ERRORS[key]
    fill = {"afile": afile, "dir": tmp_path, "exits": _exits(tmp_path)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    rc = main([a.format(**fill) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err, needle.format(**fill)


@pytest.mark.parametrize("key", list(USER_ERRORS))
def test_user_errors_are_one_line_and_exit_2(key, afile, tmp_path, monkeypatch, capsys, request):
    if key in THROUGH_THE_ENTRY_POINT:
        rc, out, err, needle = request.getfixturevalue("user_errors")[key]
    else:
        rc, out, err, needle = _in_process(key, afile, tmp_path, monkeypatch, capsys)
    lines = err.splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("symhess: error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in err and out == ""


def test_experiment_help_exits_0_and_shows_defaults(capsys):
    from symhess.cli.main import main
    rc, out, err = symhess("experiment", "--help")
    assert rc == 0 and err == "" and "scaling" in out and "histogram" in out and "bounds" in out
    assert main(["experiment", "-h"]) == 0 and capsys.readouterr().out == out
    assert main(["experiment", "scaling", "--help"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    for needle in ("--d-model D_MODEL model (residual) width (default: 128)",
                   "--seeds SEEDS seeds per σ (seed, seed+1, …) (default: 3)",
                   "(default: logspace:-2:1:20)", "--batch BATCH sequences per Hessian (one batch) (default: 64)"):
        assert needle in flat, needle


def test_loss_help_lists_every_registered_loss():
    rc, out, _ = symhess("verify", "--help")
    flat = " ".join(out.split())
    assert rc == 0 and f"{', '.join(sorted(LOSSES))}, or both" in flat and "(default: both)" in flat


def test_layers_prints_none_for_a_layer_without_inputs():
    rc, out, err = symhess("layers", "layernorm", "attention")
    assert rc == 0 and err == ""
    assert "inputs:     none" in out and "inputs:     X (L×d_V)" in out
    assert "inputs:     \n" not in out


def test_report_prints_the_pdf_path(tmp_path):
    """A stand-in pdflatex (first on PATH) writes the PDF; the command names both files."""
    tools = tmp_path / "bin"
    tools.mkdir()
    fake = tools / "pdflatex"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do f="$a"; done\n'
                    'printf "%%PDF-1.4 stand-in" > "$(basename "$f" .tex).pdf"\n')
    fake.chmod(0o755)
    out_tex = tmp_path / "doc" / "attention.tex"
    rc, out, err = symhess("report", "attention", "--loss", "mse", "-o", out_tex, "--pdf",
                           env={"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"})
    assert rc == 0, err
    assert out.splitlines() == [f"wrote {out_tex}", f"wrote {out_tex.with_suffix('.pdf')}"]
    assert out_tex.with_suffix(".pdf").read_bytes().startswith(b"%PDF")


@pytest.mark.parametrize("exc", ["RuntimeError('boom')",
                                 pytest.param("ValueError('an internal check')", marks=pytest.mark.slow),
                                 pytest.param("KeyError('internal')", marks=pytest.mark.slow)])
def test_an_internal_error_shows_its_traceback_and_asks_for_a_report(tmp_path, exc):
    """Bare ValueError/KeyError are no longer turned into one-line 'user errors'."""
    (tmp_path / "broken.py").write_text(
        "import symhess as sh\nfrom symhess import expr as E\nfrom symhess.calculus import hessian\n"
        "def fail(self, *a, **k):\n"
        f"    raise {exc}\n"
        "hessian.Derivation.block = fail\n"
        "X = E.matrix('X', 2, 3)\nW = E.param('W', 3, 2)\n"
        "lay = sh.Layer('lay', X @ W, (W,), (X,))\n")
    rc, out, err = symhess("derive", "broken.py:lay", cwd=tmp_path)
    assert rc == 3
    assert "Traceback (most recent call last)" in err and exc.split("(")[0] in err
    assert err.strip().splitlines()[-1] == BUG


def _on_a_terminal(argv):
    """stderr of ``symhess ARGV…`` written to a pseudo-terminal (tqdm draws only there)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # 24 × 100
    proc = subprocess.Popen([str(SYMHESS), *argv], stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=300)
    os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_verify_shows_progress_on_a_terminal(capsys):
    from symhess.cli.main import main
    rc, err = _on_a_terminal(["verify", "attention", "--loss", "mse", "--set", "causal=false"])
    assert rc == 0 and "verify attention (mse)" in err and "/9 [" in err
    assert main(["verify", "attention", "--loss", "mse", "--set", "causal=false"]) == 0
    assert capsys.readouterr().err == ""                  # not a terminal: no bar


@pytest.mark.slow
def test_report_shows_progress_on_a_terminal(tmp_path):
    rc, err = _on_a_terminal(["report", "attention", "--loss", "ce", "-o", str(tmp_path / "a.tex")])
    assert rc == 0 and "report attention (ce)" in err


def test_generate_writes_a_user_declaration_kernels_byte_identical(tmp_path, monkeypatch):
    """``generate FILE.py:ATTR --out DIR`` writes the declaration's module (one file for both
    backends); a second run gives the same bytes, ``--check`` finds it current and then stale
    after an edit, and ``symhess.kernel(…, module=PATH)`` loads it on either backend with the
    loss the interpreter computes."""
    (tmp_path / "mymodels.py").write_text(
        "import symhess as sh\nfrom symhess import expr as E\n"
        "X = E.matrix('X', 'L', 'd')\n"
        "W_1, W_3, W_2 = E.param('W_1', 'd', 'h'), E.param('W_3', 'd', 'h'), E.param('W_2', 'h', 'd')\n"
        "gated = sh.Layer('gated', E.hadamard(X @ W_1, X @ W_3) @ W_2, params=(W_3, W_1, W_2), inputs=(X,))\n")
    rc, out, err = symhess("generate", "mymodels.py:gated", "--loss", "mse", "--out", "k", cwd=tmp_path)
    assert rc == 0, err
    path = tmp_path / "k" / "gated.py"
    assert out.split() == ["written:", "k/gated.py"]
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == ["gated.py"]
    first = path.read_bytes()
    assert symhess("generate", "mymodels.py:gated", "--loss", "mse", "-o", "k", cwd=tmp_path)[0] == 0
    assert path.read_bytes() == first
    rc, out, _ = symhess("generate", "mymodels.py:gated", "--loss", "mse", "--out", "k", "--check", cwd=tmp_path)
    assert (rc, out.strip()) == (0, "k/gated.py is up to date")
    import numpy as np
    import torch

    import symhess as sh
    from symhess.expr.evaluate import evaluate
    from symhess.calculus.verify import random_values
    import importlib.util
    spec = importlib.util.spec_from_file_location("mymodels_gen", tmp_path / "mymodels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("SYMHESS_CACHE_DIR", str(tmp_path / "cache"))
    values = random_values(sh.derive(mod.gated, "mse"), seed=1)
    want = np.asarray(evaluate(sh.derive(mod.gated, "mse").loss_expr, values)).item()
    got_np = np.asarray(sh.kernel(mod.gated, "numpy", "mse", module=path).loss(values)).item()
    kt = sh.kernel(mod.gated, "torch", "mse", module=path)
    got_t = kt.loss({k: torch.as_tensor(v) for k, v in values.items()}).item()
    assert abs(got_np - want) <= 1e-12 * abs(want) and abs(got_t - want) <= 1e-12 * abs(want)
    assert not (tmp_path / "cache").exists()          # the given module was used, nothing rendered
    cached_k = sh.kernel(mod.gated, "numpy", "mse")
    assert abs(np.asarray(cached_k.loss(values)).item() - want) <= 1e-12 * abs(want)
    assert [c.read_bytes() for c in (tmp_path / "cache").rglob("gated-mse-*.py")] == [first]
    path.write_text(path.read_text().replace("return ", "return 2 * ", 1))
    rc, out, _ = symhess("generate", "mymodels.py:gated", "--loss", "mse", "--out", "k", "--check", cwd=tmp_path)
    assert (rc, out.strip()) == (1, "stale: k/gated.py")


def test_progress_bars_are_drawn_on_a_terminal_only(tmp_path, capsys):
    """A log file gets no bar (one long line of carriage returns): every command with a bar
    draws it only when stderr is a terminal, the experiments included."""
    from symhess.cli.main import main
    argv = ["experiment", "scaling", "--d-model", "4", "--d-mlp", "8", "--batch", "2",
            "--sigmas", "0.1,0.2", "--seeds", "1", "--fit-max", "1", "--out", str(tmp_path)]
    rc, err = _on_a_terminal(argv)
    assert rc == 0 and "scaling softmax" in err and "2/2" in err
    assert main(argv) == 0                      # stderr captured: not a terminal
    err = capsys.readouterr().err
    assert "\r" not in err and "scaling" not in err, err
    assert main(["spectrum", "attention", "--block", "W_V,W_V", "--k", "1"]) == 0
    assert capsys.readouterr().err == ""


def test_dataset_progress_bar_stays_out_of_a_log(capsys):
    import numpy as np
    import symhess as sh
    from symhess.curvature.dataset import Dataset
    d = sh.derive(sh.layer("attention"), "mse")
    values = sh.random_values(d, seed=0)
    params = {p: values[p] for p in d.layer.param_names}
    batches = [{"X": values["X"][None], "Y": values["Y"][None]}] * 2
    ds = Dataset(sh.kernel("attention", "numpy", "mse"), batches, params=params, progressbar=True)
    assert np.isfinite(ds.loss())
    assert capsys.readouterr().err == ""          # stderr is not a terminal here

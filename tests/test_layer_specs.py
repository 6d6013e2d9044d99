"""A user's declaration named on the command line: FILE.py:ATTR and MODULE:ATTR
(symhess.layers.specs.resolve_layer), through the API and the command line."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

import symhess as sh
from symhess.errors import DeclarationError, OptionError, UnknownNameError
from symhess.layers.specs import resolve_layer, spec_options

from symhess.cli.main import main

MODELS = textwrap.dedent('''
    import symhess as sh
    from symhess import expr as E

    L, d, h = E.dims("L d h")
    X = E.matrix("X", L, d)
    W_1, W_2, W_3 = E.param("W_1", d, h), E.param("W_2", d, h), E.param("W_3", h, d)


    def gated(act: str = "tanh", bias: bool = False):
        """Gated unit (tanh(X W_1) ∘ sigmoid(X W_2)) W_3."""
        F = (E.elementwise(act, X @ W_1) * E.elementwise("sigmoid", X @ W_2)) @ W_3
        return sh.Layer("gated", F, params=(W_1, W_2, W_3), inputs=(X,))


    plain = gated()
    number = 3


    def not_a_layer():
        return 42


    def broken():
        return 1 / 0


    def needs(act):
        return gated(act)
''')


LINE = MODELS.splitlines().index("    return 1 / 0") + 1     # where broken() raises


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    (root / "mymodels.py").write_text(MODELS)
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "mymodels.py").write_text(MODELS)
    (root / "syntax.py").write_text("def f(:\n")
    return root


def test_a_factory_from_a_file_with_options(project):
    lay = resolve_layer(f"{project}/mymodels.py:gated", {"act": "relu"})
    assert isinstance(lay, sh.Layer) and lay.param_names == ("W_1", "W_2", "W_3")
    assert "relu" in repr(lay.output)
    assert spec_options(f"{project}/mymodels.py:gated") == {"act": "tanh", "bias": False}
    assert spec_options(f"{project}/mymodels.py:plain") == {}
    assert resolve_layer(f"{project}/mymodels.py:plain") is resolve_layer(f"{project}/mymodels.py:plain")


def test_a_module_spec(project, monkeypatch):
    monkeypatch.chdir(project)
    lay = resolve_layer("mypkg.mymodels:plain")
    assert lay.name == "gated"
    assert resolve_layer("attention", {"causal": True}).options["causal"] is True


@pytest.mark.parametrize("spec, options, error, needle", [
    ("nofile.py:gated", {}, DeclarationError, "cannot load layer file nofile.py: it does not exist"),
    ("{p}:gated", {}, DeclarationError, "cannot load layer file {p}: it is a directory"),
    ("{p}/mymodels.py:gatd", {}, UnknownNameError,
     "{p}/mymodels.py has no attribute 'gatd'; layers and functions there: gated, plain, not_a_layer, broken, needs"),
    ("{p}/mymodels.py:number", {}, DeclarationError,
     "{p}/mymodels.py:number is not a symhess Layer or a factory returning one (it is int 3)"),
    ("{p}/mymodels.py:not_a_layer", {}, DeclarationError, "not_a_layer returned int 42, not a symhess Layer"),
    ("{p}/mymodels.py:broken", {}, DeclarationError,
     "{p}/mymodels.py:broken failed: ZeroDivisionError: division by zero (mymodels.py, line {line})"),
    ("{p}/mymodels.py:plain", {"act": "relu"}, OptionError, "is a Layer, which takes no options (got act)"),
    ("{p}/mymodels.py:gated", {"zzz": 1}, OptionError, "unknown option(s) 'zzz' for {p}/mymodels.py:gated; valid: act, bias"),
    ("{p}/mymodels.py:gated", {"bias": "no"}, OptionError, "bias must be True or False"),
    ("{p}/mymodels.py:needs", {}, OptionError, "missing a required argument: 'act'"),
    ("{p}/syntax.py:f", {}, DeclarationError, "loading {p}/syntax.py failed: SyntaxError: "),
    ("nomodule.sub:x", {}, UnknownNameError, "no module named 'nomodule.sub'"),
    (":x", {}, DeclarationError, "expected NAME, FILE.py:ATTR or MODULE:ATTR"),
])
def test_bad_specs_are_one_line_errors(project, spec, options, error, needle):
    with pytest.raises(error) as err:
        resolve_layer(spec.format(p=project), options)
    msg = str(err.value)
    assert needle.format(p=project, line=LINE) in msg and "\n" not in msg, msg


def test_the_cli_derives_verifies_reports_and_lists_a_user_layer(project, tmp_path, capsys, monkeypatch):
    def symhess(*argv, cwd):
        monkeypatch.chdir(cwd)
        rc = main([str(a) for a in argv])
        out = capsys.readouterr()
        return rc, out.out, out.err

    rc, out, err = symhess("derive", "mymodels.py:gated", "--block", "W_3,W_3", "--part", "functional",
                           "--format", "text", cwd=project)
    assert rc == 0 and out.strip() == "H_functional(W_3, W_3) = 0[d*hxd*h]", err
    rc, out, err = symhess("verify", "mypkg.mymodels:gated", "--loss", "mse", "--set", "act=gelu", cwd=project)
    assert rc == 0 and "all blocks agree with autograd" in out and "act=gelu" in out, err
    rc, out, err = symhess("report", "mymodels.py:plain", "--loss", "mse", "-o", tmp_path / "g.tex", cwd=project)
    assert rc == 0 and (tmp_path / "g.tex").read_text().count(r"\mathbf H_f(") == 9, err
    rc, out, err = symhess("layers", "mymodels.py:gated", "attention", cwd=project)
    assert rc == 0 and "mymodels.py:gated (gated)" in out and "options:    act='tanh', bias=False" in out
    rc, out, err = symhess("run", "mymodels.py:gated", "--loss", "mse", cwd=project)
    assert rc == 0 and "has no committed kernels" in out, err


@pytest.mark.parametrize("argv, needle", [
    (["derive", "nofile.py:gated"], "cannot load layer file nofile.py: it does not exist"),
    (["derive", "mymodels.py:gatd"], "mymodels.py has no attribute 'gatd'"),
    (["verify", "mymodels.py:number"], "mymodels.py:number is not a symhess Layer or a factory"),
    (["report", "mymodels.py:not_a_layer", "-o", "x.tex"], "returned int 42, not a symhess Layer"),
    (["layers", "mymodels.py:broken"], "ZeroDivisionError: division by zero (mymodels.py, line {line})"),
    (["derive", "mymodels.py:gated", "--set", "bias=maybe"], "option bias expects true or false, got 'maybe'"),
])
def test_cli_spec_errors_are_one_line(project, argv, needle, capsys, monkeypatch):
    monkeypatch.chdir(project)
    rc = main(argv)                # what the entry point runs (tests/test_cli_entry.py runs it)
    err = capsys.readouterr().err
    needle = needle.format(line=LINE)
    assert rc == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err, err


def test_user_layer_blocks_match_autograd(project):
    """The resolved declaration is an ordinary Layer: its blocks verify in float64."""
    from symhess.calculus.verify import verify
    checks, _ = verify(sh.derive(resolve_layer(f"{project}/mymodels.py:gated", {"act": "tanh"}), "ce"), seed=5)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert max(c.error for c in checks) < 1e-10 and np.isfinite([c.error for c in checks]).all()


def test_verify_names_the_options_a_layer_object_was_built_with(tmp_path, capsys):
    """A Layer built with options and named by FILE.py:ATTR is verified as built, and the
    table's header says so (not "defaults")."""
    from symhess.cli.main import main
    (tmp_path / "built.py").write_text("import symhess as sh\n"
                                       "lay = sh.layer('attention', causal=True, scale=0.5)\n")
    assert main(["verify", f"{tmp_path / 'built.py'}:lay", "--loss", "mse"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith(str(tmp_path)))
    assert "· causal=True, scale=0.5 ·" in header and "defaults" not in out
    assert out.count("loss=mse") == 1        # the layer as built: no causal=False run is added

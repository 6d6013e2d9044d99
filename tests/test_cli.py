"""The command line: every subcommand, exit codes and one-line errors."""
import pytest

from symhess.cli.main import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_layers_lists_parameters_and_options(capsys):
    code, out, _ = run(capsys, "layers")
    assert code == 0
    assert "attention" in out and "W_Q (d_V×d_K)" in out and "causal=False" in out


def test_derive_prints_latex_and_text(capsys):
    code, out, _ = run(capsys, "derive", "attention", "--block", "W_Q,W_K", "--part", "functional", "--loss", "ce")
    assert code == 0 and r"\mathbf Z_2" in out and r"\mathbf H_f(\mathbf W_{Q},\mathbf W_{K})" in out
    code, out, _ = run(capsys, "derive", "attention", "--block", "W_V,W_V", "--part", "functional", "--format", "text")
    assert code == 0 and "0[d_V**2xd_V**2]" in out


def test_derive_definitions(capsys):
    code, out, _ = run(capsys, "derive", "attention", "--block", "W_Q,W_Q", "--part", "outer", "--definitions")
    assert code == 0 and r"\mathbf M_2 :=" in out


@pytest.mark.parametrize("argv, needle", [
    (("derive", "nolayer"), "unknown layer 'nolayer'; valid: "),
    (("derive", "attention", "--block", "W_X,W_Q"), "unknown block 'W_X' for layer 'attention'; valid: W_Q, W_K, W_V"),
    (("derive", "attention", "--part", "bogus"), "unknown part 'bogus'; valid: outer, functional, full"),
    (("derive", "attention", "--loss", "l1"), "unknown loss 'l1'; valid: ce, "),
    (("derive", "attention", "--set", "dropout=1"), "unknown option(s) 'dropout' for layer 'attention'"),
    (("derive", "attention", "--block", "W_Q"), "--block expects P,Q"),
])
def test_bad_input_is_one_readable_line(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_verify_prints_a_table_and_passes(capsys):
    code, out, _ = run(capsys, "verify", "attention", "--loss", "mse", "--seed", "3")
    assert code == 0
    assert out.count("causal=") == 2          # with and without the mask
    assert "(W_V, W_V)" in out and "structural zero" in out
    assert "all blocks agree with autograd" in out


def test_verify_exits_one_when_a_block_is_wrong(capsys, monkeypatch):
    import symhess.calculus.verify as v
    real = v.relative_error
    monkeypatch.setattr(v, "relative_error", lambda got, ref, scale: real(got, ref, scale) + 1.0)
    code, out, _ = run(capsys, "verify", "attention", "--loss", "ce")
    assert code == 1 and "FAIL" in out and "SOME BLOCKS DISAGREE" in out


def test_run_checks_only_its_own_layer_kernels(capsys, monkeypatch, tmp_path):
    """`symhess run LAYER` (the README's main job) verifies the blocks and checks that the
    layer's committed modules are current; a stale one is named and the exit code is 1."""
    import shutil

    from symhess.cli import main as cli
    code, out, _ = run(capsys, "run", "ffn", "--loss", "mse")
    assert code == 0
    assert "all blocks agree with autograd" in out
    assert "generated/ffn.py is up to date" in out
    copy = tmp_path / "generated"
    shutil.copytree(cli.GENERATED, copy)
    stale = copy / "ffn.py"
    stale.write_text(stale.read_text().replace("return ", "return 1 * ", 1))
    (copy / "attention.py").write_text("")      # another layer's file: not checked
    monkeypatch.setattr(cli, "GENERATED", copy)
    code, out, _ = run(capsys, "run", "ffn", "--loss", "mse")
    assert code == 1
    assert f"stale: {stale}" in out and "attention.py" not in out


def test_run_on_a_layer_without_committed_kernels_says_so(capsys):
    from symhess.codegen import render as codegen
    assert codegen.check_layer("addition_block") == []
    assert codegen.main_check_layer("addition_block") == 0
    assert "not committed" in capsys.readouterr().out

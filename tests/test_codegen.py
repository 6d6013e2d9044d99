"""Generated kernels against torch autograd, the interpreter, each other, and their own source."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

import symhess as sh
from symhess import codegen
from symhess.evaluate import InputError
from symhess.hessian import PARTS
from symhess.verify import autograd_blocks, random_values

ROOT = Path(__file__).resolve().parent.parent
CASES = [("mse", False), ("mse", True), ("ce", False), ("ce", True)]
TOL64, TOL32 = 1e-10, 1e-4


@lru_cache(maxsize=None)
def case(loss, causal, seed=0):
    """(derivation, float64 values, autograd blocks) with distinct sizes d_K != d_V."""
    d = sh.derive(sh.layer("attention", causal=causal), loss)
    values = random_values(d, seed=seed + 11)
    assert values["W_Q"].shape[1] != values["X"].shape[1]
    return d, values, autograd_blocks(d, values)


def full(d, ref, part):
    names = d.layer.param_names
    return np.block([[ref[(p, q, part)] for q in names] for p in names])


def rel(got, want, scale):
    got = got.detach().cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    return float(np.linalg.norm(got - want)) / max(float(np.linalg.norm(want)), scale, 1e-300)


def tensors(values, dtype=torch.float64):
    return {k: torch.tensor(v, dtype=dtype) for k, v in values.items()}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("loss,causal", CASES)
def test_every_kernel_matches_autograd(backend, loss, causal):
    d, values, ref = case(loss, causal)
    k = sh.kernel("attention", backend, loss, causal=causal)
    vals = tensors(values) if backend == "torch" else values
    names = d.layer.param_names
    rng = np.random.default_rng(1)
    for part in PARTS:
        H = full(d, ref, part)
        scale = np.linalg.norm(full(d, ref, "full"))
        assert rel(k.hessian(vals, part), H, scale) <= TOL64
        v = rng.standard_normal(H.shape[0])
        vv = torch.tensor(v) if backend == "torch" else v
        assert rel(k.hvp(vals, vv, part), H @ v, scale * np.linalg.norm(v)) <= TOL64
        norms = k.frobenius_norms(vals, part)
        for p in names:
            B = ref[(p, p, part)]
            assert rel(k.diag(vals, p, part), np.diag(B), scale) <= TOL64
            assert abs(float(k.trace(vals, p, part)) - np.trace(B)) <= TOL64 * max(scale, abs(np.trace(B)))
            for q in names:
                B = ref[(p, q, part)]
                assert rel(k.hessian_block(vals, p, q, part), B, scale) <= TOL64, (p, q, part)
                f = float(k.frobenius_norm(vals, p, q, part))
                assert abs(f - np.linalg.norm(B)) <= TOL64 * scale, (p, q, part)
                assert abs(float(norms[(p, q)]) - np.linalg.norm(B)) <= TOL64 * scale


@pytest.mark.parametrize("loss,causal", [("mse", True), ("ce", False)])
def test_kernels_agree_with_interpreter_and_each_other(loss, causal):
    d, values, _ = case(loss, causal)
    kn = sh.kernel("attention", "numpy", loss, causal=causal)
    kt = sh.kernel("attention", "torch", loss, causal=causal)
    tv = tensors(values)
    for p, q in [("W_Q", "W_K"), ("W_V", "W_Q")]:
        for part in PARTS:
            interp = d.block(p, q, part).evaluate(values)
            a, b = kn.hessian_block(values, p, q, part), kt.hessian_block(tv, p, q, part)
            scale = np.linalg.norm(interp) + 1e-12
            assert rel(a, interp, scale) <= TOL64
            assert rel(b, a, scale) <= TOL64
    assert abs(float(kt.loss(tv)) - float(d.loss_expr.evaluate(values)[0, 0])) <= 1e-12
    for p, g in kn.gradient(values).items():
        assert rel(g, d.gradient(p).evaluate(values), 1e-12) <= TOL64


def test_structural_zero_block_is_exactly_zero():
    d, values, _ = case("mse", False)
    k = sh.kernel("attention", "numpy", "mse")
    assert d.block("W_V", "W_V", "functional").is_zero
    assert not np.any(k.hessian_block(values, "W_V", "W_V", "functional"))
    assert k.frobenius_norm(values, "W_V", "W_V", "functional") == 0.0
    # the zero norm is an array/tensor of the inputs' dtype like every other result
    kt = sh.kernel("attention", "torch", "mse")
    tv = {n: torch.tensor(v, dtype=torch.float32) for n, v in values.items()}
    for z in (kt.frobenius_norm(tv, "W_V", "W_V", "functional"),
              kt.frobenius_split(tv, "W_V", "W_V")["functional"],
              kt.frobenius_norms(tv, "functional")[("W_V", "W_V")]):
        assert isinstance(z, torch.Tensor) and z.dtype == torch.float32 and z.shape == ()
        assert float(z) == 0.0


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_float32(loss):
    d, values, ref = case(loss, True)
    k = sh.kernel("attention", "torch", loss, causal=True)
    tv = tensors(values, torch.float32)
    scale = np.linalg.norm(full(d, ref, "full"))
    H = k.hessian(tv, "full")
    assert H.dtype == torch.float32
    assert rel(H, full(d, ref, "full"), scale) <= TOL32
    assert abs(float(k.frobenius_norm(tv, "W_Q", "W_K", "outer")) - np.linalg.norm(ref[("W_Q", "W_K", "outer")])) <= TOL32 * scale
    v = np.random.default_rng(2).standard_normal(H.shape[0])
    got = k.hvp(tv, torch.tensor(v, dtype=torch.float32), "functional")
    assert rel(got, full(d, ref, "functional") @ v, scale * np.linalg.norm(v)) <= TOL32


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_batch_axis_gives_the_mean_hessian(loss):
    """Loss = mean over N sequences, so every kernel output is the mean of the per-sequence ones."""
    d = sh.derive(sh.layer("attention"), loss)
    seqs = [random_values(d, seed=s, sizes={"L": 4, "d_V": 3, "d_K": 5}) for s in range(3)]
    for s in seqs[1:]:
        for p in d.layer.param_names:
            s[p] = seqs[0][p]
    refs = [autograd_blocks(d, s) for s in seqs]
    batch = {n: torch.tensor(np.stack([s[n] for s in seqs]) if n in ("X", "Y") else seqs[0][n])
             for n in seqs[0]}
    k = sh.kernel("attention", "torch", loss)
    names = d.layer.param_names
    want = np.mean([full(d, r, "full") for r in refs], axis=0)
    scale = np.linalg.norm(want)
    assert rel(k.hessian(batch, "full"), want, scale) <= TOL64
    v = np.random.default_rng(3).standard_normal(want.shape[0])
    assert rel(k.hvp(batch, torch.tensor(v)), want @ v, scale * np.linalg.norm(v)) <= TOL64
    wq = np.mean([r[("W_Q", "W_K", "functional")] for r in refs], axis=0)
    assert abs(float(k.frobenius_norm(batch, "W_Q", "W_K", "functional")) - np.linalg.norm(wq)) <= TOL64 * scale
    assert rel(k.diag(batch, "W_Q", "outer"), np.diag(np.mean([r[("W_Q", "W_Q", "outer")] for r in refs], 0)), scale) <= TOL64
    # numpy accepts the same batch axis
    kn = sh.kernel("attention", "numpy", loss)
    assert rel(kn.hessian({n: t.numpy() for n, t in batch.items()}, "full"), want, scale) <= TOL64
    assert names == ("W_Q", "W_K", "W_V")


def test_kernel_for_options_that_were_not_generated():
    """scale=1 is not in generated/: rendered in memory, still exact."""
    d = sh.derive(sh.layer("attention", scale=1), "mse")
    values = random_values(d, seed=5)
    ref = autograd_blocks(d, values)
    k = sh.kernel("attention", "numpy", "mse", scale=1)
    assert rel(k.hessian(values, "full"), full(d, ref, "full"), 1e-12) <= TOL64


# ----------------------------------------------------------------------------- the source
def sources():
    return {p.name + "/" + p.parent.name: p.read_text() for p in (ROOT / "generated").rglob("*.py")}


def test_generated_source_has_no_dense_structure():
    src = sources()
    assert src, "generated/ is empty"
    for name, text in src.items():
        body = text.split('"""', 2)[2]            # skip the module docstring
        assert not re.search(r"\bkron\b", body), name
        assert "commutation" not in body.lower(), name
        for m in re.finditer(r"\beye\(([^)]*)\)", body):
            assert "*" not in m.group(1), (name, m.group(0))       # no I of a product size
        for m in re.finditer(r"(?:empty|zeros|ones)\(\(([^)]*)\)", body):
            assert "L**2" not in m.group(1) and "L*L" not in m.group(1), (name, m.group(0))
        for m in re.finditer(r"# (\w+): compact tensor \(([^)]*)\)", body):
            # ∂A/∂T is kept as its L row blocks (L×L×L), never as the dense L²×L² (an L⁴)
            assert m.group(2).count("'L'") <= 3, (name, m.group(0))
            if m.group(1).startswith(("M_2", "M_3")):
                assert m.group(2).count("'L'") == 1, (name, m.group(0))  # M_2 is L×d×d
        if name.startswith("attention.py"):     # softmax attention: M_2, M_3 are compact tensors
            assert re.search(r"# M_2: compact tensor .*\nM_2 = ", body.replace("    ", ""))
            assert re.search(r"# M_3: compact tensor .*\nM_3 = ", body.replace("    ", ""))


def test_each_moment_is_computed_once_per_routine():
    text = (ROOT / "generated" / "numpy" / "attention.py").read_text()
    fn = text.split("def mse_causal0__hessian__full(")[1].split("\ndef ")[0]
    assert fn.count("M_2 = ") == 1 and fn.count("M_3 = ") == 1
    assert fn.count("M_1 = ") == 1


_RENDER_ALL = codegen.render_all


@lru_cache(maxsize=None)
def rendered():
    return _RENDER_ALL()


def test_generate_check_on_committed_folder(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(codegen, "render_all", rendered)
    assert codegen.generate(ROOT / "generated", check=True) == []
    assert codegen.main_generate(True, out_dir=ROOT / "generated") == 0
    # a modified and an extra file are both reported, and --check exits 1
    out = tmp_path / "generated"
    assert len(codegen.generate(out)) == len(rendered())
    target = out / "numpy" / "attention.py"
    target.write_text(target.read_text().replace("return out", "return out * 1", 1))
    (out / "torch" / "extra.py").write_text("")
    stale = codegen.generate(out, check=True)
    assert sorted(stale) == sorted([str(target), str(out / "torch" / "extra.py")])
    assert codegen.main_generate(True, out_dir=out) == 1
    assert "stale:" in capsys.readouterr().out
    # regeneration repairs it, byte-identical to the committed folder
    codegen.generate(out)
    for rel_path, src in rendered().items():
        assert (out / rel_path).read_text() == (ROOT / "generated" / rel_path).read_text() == src


def test_generation_failure_leaves_old_files(monkeypatch, tmp_path):
    out = tmp_path / "generated"
    (out / "numpy").mkdir(parents=True)
    (out / "numpy" / "attention.py").write_text("old")

    def boom():
        raise RuntimeError("printer failed")

    monkeypatch.setattr(codegen, "render_all", boom)
    with pytest.raises(RuntimeError):
        codegen.generate(out)
    assert (out / "numpy" / "attention.py").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["generated"]


def test_generation_is_deterministic_across_processes():
    """A fresh interpreter with another hash seed renders the committed bytes."""
    code = ("import sys; from symhess import codegen; "
            "sys.stdout.write(codegen.render_module('attention', 'torch', "
            "only=[('ce', (('causal', True), ('scale', None)))]))")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(ROOT))
    a = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    b = codegen.render_module("attention", "torch", only=[("ce", (("causal", True), ("scale", None)))])
    assert a == b
    committed = (ROOT / "generated" / "torch" / "attention.py").read_text()
    fn = "def ce_causal1__frobenius__W_Q__W_K__full("
    assert a.split(fn)[1].split("\ndef ")[0] == committed.split(fn)[1].split("\ndef ")[0]


# ----------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors():
    d, values, _ = case("mse", False)
    k = sh.kernel("attention", "numpy", "mse")
    kt = sh.kernel("attention", "torch", "mse")
    with pytest.raises(InputError, match=r"unknown value name\(s\) W_O.*valid: W_K, W_Q, W_V, X, Y"):
        k.hessian({**values, "W_O": values["W_V"]})
    with pytest.raises(InputError, match="missing value"):
        k.hessian({n: v for n, v in values.items() if n != "Y"})
    bad = dict(values, W_K=values["W_K"].T)
    with pytest.raises(InputError, match=r"shape mismatch: W_K has shape"):
        k.hessian(bad)
    with pytest.raises(InputError, match="int64; expected float32 or float64"):
        k.hessian(dict(values, X=values["X"].astype(np.int64)))
    with pytest.raises(InputError, match="one dtype"):
        kt.hessian(dict(tensors(values), X=torch.tensor(values["X"], dtype=torch.float32)))
    with pytest.raises(InputError, match="flat vector of length"):
        k.hvp(values, np.ones(3))
    with pytest.raises(KeyError, match="unknown block 'W_O'.*valid: W_Q, W_K, W_V"):
        k.hessian_block(values, "W_O", "W_Q")
    with pytest.raises(ValueError, match="unknown part"):
        k.trace(values, "W_Q", "outr")
    with pytest.raises(ValueError, match="unknown backend"):
        sh.kernel("attention", "jax")
    with pytest.raises(KeyError, match="unknown loss"):
        sh.kernel("attention", loss="l1")
    with pytest.raises(TypeError, match="unknown option"):
        sh.kernel("attention", causall=True)
    with pytest.raises(InputError, match="batch size"):
        kt.hessian(dict(tensors(values), X=torch.zeros((2,) + values["X"].shape, dtype=torch.float64)))
    with pytest.raises(InputError, match="torch tensor"):
        k.hessian(tensors(values))


def test_mismatched_devices_are_named():
    kt = sh.kernel("attention", "torch", "mse")
    _, values, _ = case("mse", False)
    tv = tensors(values)
    tv["W_Q"] = tv["W_Q"].to("meta")
    with pytest.raises(InputError, match="one device.*meta"):
        kt.hessian(tv)


def test_block_only_hessians_copy_lower_blocks_of_more_than_one_network(monkeypatch):
    """The block-by-block version of a full Hessian as printed (attention's only one: no slab
    pays) copies every block below the diagonal with more than ``MIRROR_MIN_TERMS_BLOCKS``
    networks from its transpose; the slab-or-block comparisons still count blocks by
    ``MIRROR_MIN_TERMS``."""
    seen = []
    real = codegen.Variant._row

    def spy(self, rt, i, names, part, block, offs, mirror_terms=codegen.MIRROR_MIN_TERMS):
        got = real(self, rt, i, names, part, block, offs, mirror_terms)
        seen.append((mirror_terms, len(got)))
        return got

    monkeypatch.setattr(codegen.Variant, "_row", spy)
    v = codegen.Variant(codegen.lowered("attention", "mse", (("causal", False),)),
                        codegen.TARGETS["torch"], "x")
    fn = v.make(("hessian", "full"))
    copies = sum(n for t, n in seen if t == codegen.MIRROR_MIN_TERMS_BLOCKS)
    assert copies > 0 and "\n".join(fn.lines).count("_transpose_into(") == copies
    names = v.d.layer.param_names

    def lower_blocks_copied(min_terms):
        return sum(1 for i in range(len(names)) for j in range(i)
                   if codegen._mirrored(v.low.terms(names[i], names[j], "full")[0], min_terms))

    assert copies == lower_blocks_copied(codegen.MIRROR_MIN_TERMS_BLOCKS)
    assert copies > lower_blocks_copied(codegen.MIRROR_MIN_TERMS)     # more than the old rule

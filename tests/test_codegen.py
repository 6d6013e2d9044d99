"""Generated kernels against torch autograd, the interpreter, each other, and their own source."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

import symhess as sh
from symhess.codegen import render as codegen
from symhess.expr.evaluate import InputError
from symhess.calculus.hessian import PARTS
from symhess.calculus.verify import autograd_blocks, random_values

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
        out = np.full(H.shape, np.nan)                     # every entry written, none read
        out = torch.tensor(out) if backend == "torch" else out
        assert rel(k.hessian(vals, part, out=out), H, scale) <= TOL64
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
    kt = sh.kernel("attention", "torch", "mse")
    tv = {n: torch.tensor(v, dtype=torch.float32) for n, v in values.items()}
    assert kt.frobenius_split(tv, "W_V", "W_V")["functional"] == 0.0
    assert kt.frobenius_norms(tv, "functional")[("W_V", "W_V")] == 0.0


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
    return {p.name: p.read_text() for p in (ROOT / "generated").rglob("*.py")}


def test_generated_source_is_compact_and_has_no_dense_structure():
    """Networks only: no Kronecker product, commutation matrix or identity of a product size
    is ever built; every committed module together stays small."""
    src = sources()
    assert src, "generated/ is empty"
    assert sum(len(t.encode()) for t in src.values()) <= 3 * 2 ** 20
    for name, text in src.items():
        body = text.split('"""', 2)[2]            # skip the module docstring
        assert not re.search(r"\b(kron|commutation|diag_selector)\(", body), name
        for m in re.finditer(r"\beye\(([^,)]*)", body):
            assert "*" not in m.group(1), (name, m.group(0))
        assert "net(" in body and "class " in body


def test_each_moment_is_one_leaf():
    """M_1, M_2, M_3 are defined once per variant and shared by every routine."""
    text = (ROOT / "generated" / "attention.py").read_text()
    first = text.split("\nclass ")[1]
    for name in ("M_1", "M_2", "M_3"):
        assert first.count(f"def {name}(s):") == 1, name
        assert f"s.{name}" in first


_RENDER_ALL = codegen.render_all


@lru_cache(maxsize=None)
def rendered():
    return _RENDER_ALL()


def test_every_committed_module_is_current(monkeypatch, tmp_path):
    """Each committed variant loads from generated/: its checksum holds and its stamp (symhess
    version, the engine's code-generating sources, the declaration) is the current one, so
    nothing is rendered into the (empty) cache and no stale-module warning is raised.  The
    full regeneration, byte for byte, is the slow test below (and `symhess generate --check`)."""
    import warnings
    monkeypatch.setenv("SYMHESS_CACHE_DIR", str(tmp_path / "cache"))
    count = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in codegen.committed_layers():
            for loss, options in codegen.variants(name):
                for backend in codegen.BACKENDS:
                    assert sh.kernel(name, backend, loss, **dict(options)).variant is not None
                    count += 1
    assert count >= 2 * len(codegen.committed_layers()) and not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_generate_check_on_committed_folder(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(codegen, "render_all", lambda progress=None: rendered())
    assert codegen.generate(ROOT / "generated", check=True) == []
    assert codegen.main_generate(True, out_dir=ROOT / "generated") == 0
    # a modified and an extra file are both reported, and --check exits 1
    out = tmp_path / "generated"
    assert len(codegen.generate(out)) == len(rendered())
    target = out / "attention.py"
    target.write_text(target.read_text().replace("return [", "return [  ", 1))
    (out / "torch").mkdir()
    (out / "torch" / "extra.py").write_text("")     # the per-backend layout is no longer generated
    stale = codegen.generate(out, check=True)
    assert sorted(stale) == sorted([str(target), str(out / "torch" / "extra.py")])
    assert codegen.main_generate(True, out_dir=out) == 1
    assert "stale:" in capsys.readouterr().out
    # regeneration repairs it, byte-identical to the committed folder
    codegen.generate(out)
    assert not (out / "torch").exists()
    for rel_path, src in rendered().items():
        assert (out / rel_path).read_text() == (ROOT / "generated" / rel_path).read_text() == src


def test_generation_failure_leaves_old_files(monkeypatch, tmp_path):
    out = tmp_path / "generated"
    out.mkdir()
    (out / "attention.py").write_text("old")

    def boom(progress=None):
        raise RuntimeError("printer failed")

    monkeypatch.setattr(codegen, "render_all", boom)
    with pytest.raises(RuntimeError):
        codegen.generate(out)
    assert (out / "attention.py").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["generated"]


def test_writes_are_atomic_keep_the_umask_and_clean_up(tmp_path):
    """Each file is replaced in one step; modes follow the umask; temporaries that a killed
    run left behind (an hour ago) are removed by the next one."""
    out = tmp_path / "generated"
    (out / "numpy").mkdir(parents=True)
    stale = out / "numpy" / (codegen.TMP_PREFIX + "abc")
    stale.write_text("left behind")
    hour = time.time() - 3601
    os.utime(stale, (hour, hour))             # older than any write still in progress
    old = os.umask(0o022)
    try:
        codegen.write_atomic(out / "numpy" / "x.py", "x = 1\n")
        codegen.remove_stale_temporaries(out)
    finally:
        os.umask(old)
    assert (out / "numpy" / "x.py").read_text() == "x = 1\n"
    assert (out / "numpy" / "x.py").stat().st_mode & 0o777 == 0o644
    assert not stale.exists()
    assert [p.name for p in (out / "numpy").iterdir()] == ["x.py"]


def test_generation_is_deterministic_across_processes():
    """A fresh interpreter with another hash seed renders the committed bytes."""
    code = ("import sys; from symhess.codegen import render as codegen; "
            "sys.stdout.write(codegen.render_layer('attention')['attention.py'])")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(ROOT))
    a = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True).stdout
    assert a == (ROOT / "generated" / "attention.py").read_text()


def _cached(monkeypatch, tmp_path):
    monkeypatch.setenv("SYMHESS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(codegen, "_LOADED", {})
    return tmp_path / "cache"


def test_a_modified_module_is_refused_and_rendered_afresh(monkeypatch, tmp_path):
    """A hand edit (its CHECKSUM no longer matches) is not loaded: a warning names the file and
    the numbers come from a fresh rendering."""
    cache = _cached(monkeypatch, tmp_path)
    monkeypatch.setattr(codegen, "GENERATED", tmp_path / "none")
    d, values, ref = case("mse", False)
    k = sh.kernel("attention", "numpy", "mse")
    want = k.loss(values)
    (path,) = cache.rglob("attention-mse-*.py")
    path.write_text(path.read_text().replace("return mean0(", "return 2 * mean0(", 1))
    monkeypatch.setattr(codegen, "_LOADED", {})
    with pytest.warns(UserWarning, match="modified after it was generated"):
        got = sh.kernel("attention", "numpy", "mse").loss(values)
    assert got == want
    assert codegen._checksum_ok(path.read_text())     # the cache holds the fresh file again


def test_a_module_of_another_declaration_is_refused(monkeypatch, tmp_path):
    """A module whose STAMP belongs to another declaration (or symhess) is not used."""
    _cached(monkeypatch, tmp_path)
    gen = tmp_path / "generated"
    gen.mkdir()
    monkeypatch.setattr(codegen, "GENERATED", gen)
    text = (ROOT / "generated" / "attention.py").read_text()
    body = text.rpartition('CHECKSUM = "')[0]
    stamp = re.search(r'STAMP = "(\w+)"', body).group(1)
    (gen / "attention.py").write_text(codegen._with_checksum(body.replace(stamp, "0" * len(stamp))))
    _, values, _ = case("mse", False)
    with pytest.warns(UserWarning, match="another declaration or symhess version"):
        sh.kernel("attention", "numpy", "mse").loss(values)


def test_user_layers_render_into_the_cache(monkeypatch, tmp_path):
    cache = _cached(monkeypatch, tmp_path)
    from symhess.expr import nodes as E
    L, d_ = E.dims("L d")
    X, W = E.matrix("X", L, d_), E.param("W", d_, d_)
    lay = sh.Layer("mine", E.elementwise("tanh", X @ W), params=(W,), inputs=(X,))
    k = sh.kernel(lay, "numpy", "mse")
    vals = random_values(sh.derive(lay, "mse"), seed=0)
    k.loss(vals)
    (path,) = cache.rglob("mine-mse-*.py")
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def test_the_numpy_backend_imports_neither_torch_nor_numba():
    code = ("import sys; import numpy as np; import symhess as sh; "
            "from symhess.calculus.verify import random_values; "
            "d = sh.derive(sh.layer('attention'), 'mse'); v = random_values(d, seed=0); "
            "sh.kernel('attention', 'numpy', 'mse').hessian(v); "
            "print('torch' in sys.modules, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


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
    with pytest.raises(InputError, match="int64"):
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


def test_one_module_serves_both_backends(monkeypatch, tmp_path):
    """A committed module names the backends' operations without importing them; loaded for
    NumPy and for torch it gives the same numbers as autograd (and as each other)."""
    _cached(monkeypatch, tmp_path)
    text = (ROOT / "generated" / "attention.py").read_text()
    assert not re.search(r"^(import|from) ", text, re.M)
    d, values, ref = case("mse", True)
    kn = sh.kernel("attention", "numpy", "mse", causal=True)
    kt = sh.kernel("attention", "torch", "mse", causal=True)
    assert kn.variant is not kt.variant and kn.variant.__name__ == kt.variant.__name__
    assert not (tmp_path / "cache").exists()             # both came from generated/attention.py
    tv = {k: torch.as_tensor(v) for k, v in values.items()}
    want = full(d, ref, "full")
    assert rel(kn.hessian(values, "full"), want, 1e-12) <= TOL64
    assert rel(kt.hessian(tv, "full").numpy(), want, 1e-12) <= TOL64


def test_a_given_module_must_hold_the_declaration(tmp_path):
    """``kernel(…, module=PATH)`` never falls back to rendering: a missing, edited or foreign
    file is a one-line DeclarationError naming it."""
    src = (ROOT / "generated" / "attention.py").read_text()
    with pytest.raises(sh.DeclarationError, match="does not exist"):
        sh.kernel("attention", "numpy", "mse", module=tmp_path / "none.py")
    edited = tmp_path / "edited.py"
    edited.write_text(src.replace("return ", "return 2 * ", 1))
    with pytest.raises(sh.DeclarationError, match="was modified after it was generated"):
        sh.kernel("attention", "numpy", "mse", module=edited)
    with pytest.raises(sh.DeclarationError, match="holds no variant of this declaration"):
        sh.kernel("attention", "numpy", "mse", scale=2, module=ROOT / "generated" / "attention.py")
    with pytest.raises(sh.DeclarationError, match="holds no variant"):
        sh.kernel("ffn", "torch", "ce", module=ROOT / "generated" / "attention.py")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_results_are_of_the_backend(dtype):
    """Every result is the backend's type in the data's dtype: torch tensors (0-d for scalars,
    so nothing waits for the device) and NumPy arrays or NumPy scalars, never Python floats."""
    d, values, _ = case("mse", False)
    values = {k: v.astype(dtype) for k, v in values.items()}
    tv = {k: torch.as_tensor(v) for k, v in values.items()}
    for backend, vals, kind in (("numpy", values, (np.ndarray, np.generic)), ("torch", tv, torch.Tensor)):
        st = sh.kernel("attention", backend, "mse").prepare(vals)
        v = st.gradient() if hasattr(st, "gradient") else None
        results = {"loss": st.loss(), "trace": st.trace("W_Q", "outer"),
                   "trace after diag": (st.diag("W_K"), st.trace("W_K"))[1],
                   "frobenius_norm": st.frobenius_norm("W_Q", "W_K"),
                   **{f"split {k}": x for k, x in st.frobenius_split("W_V", "W_Q").items()},
                   "zero block": st.frobenius_norm("W_V", "W_V", "functional")}
        for what, x in results.items():
            assert isinstance(x, kind) and str(x.dtype).endswith(dtype), (backend, what, type(x))
            assert np.ndim(x) == 0, (backend, what)
        assert float(results["zero block"]) == 0.0


def test_content_names_follow_the_definitions_and_what_they_read():
    """One name per definition: equal definitions (after renaming what they read) share a
    name and are printed once; a changed dependency changes its readers' names."""
    import re
    from symhess.codegen.content import by_content

    def named(defs, suffix):
        own = {n: f"@leaf\ndef {n}(s):\n    return {b}" for n, b in defs}
        user = "def block(s):\n    return [" + ", ".join("s." + n for n, _ in defs) + "]"
        out = by_content(list(own.values()) + [user], own, suffix)
        return out, re.findall(r"s\.(\w+)", out[-1])

    a, (ta, sa, sa2) = named([("t__P", "ones(s.d)"), ("S__P", "mm(s.t__P, s.X)"),
                              ("S__Px2", "mm(s.t__P, s.X)")], "__P")
    b, (tb, sb) = named([("t__Q", "ones(s.d)"), ("S__Q", "mm(s.t__Q, s.X)")], "__Q")
    c, (tc, sc) = named([("t__R", "ones(s.L)"), ("S__R", "mm(s.t__R, s.X)")], "__R")
    assert sa == sa2 and len(a) == 3                 # equal definitions: one member
    assert (ta, sa) == (tb, sb)                      # the same content in another part
    assert tc != tb and sc != sb                     # t differs, so does S, which reads it
    assert ta.startswith("t__h") and sa.startswith("S__h") and f"def {sa}(s)" in a[1]

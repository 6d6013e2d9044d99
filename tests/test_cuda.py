"""The torch kernels on a CUDA device: the same numbers as on CPU and as autograd there.

Skipped without CUDA.  ``SYMHESS_TEST_DEVICE=cpu`` runs every test on that device
instead (CPU against CPU is trivial, but it exercises the test code paths on a machine
without a GPU).  Oracles: the CPU kernel (itself checked against autograd in
test_codegen.py / test_jacobian_kernels.py) and torch.func autograd run on the device.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch.func import hessian, jacrev

import symhess as sh
from symhess.expr.evaluate import InputError, evaluate
from symhess.calculus.hessian import PARTS
from symhess.runtime.jacobian import CompactJacobian
from symhess.calculus.verify import random_values
from test_codegen import CASES, TOL32, TOL64, case as attention_case, tensors
from test_jacobian_kernels import case as jacobian_case, key

DEVICE = os.environ.get("SYMHESS_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = pytest.mark.skipif(DEVICE is None, reason="no CUDA device "
                                "(SYMHESS_TEST_DEVICE=cpu runs these tests on CPU)")


def to(values, device=None, dtype=torch.float64):
    """{name: tensor} on ``device`` (default: the device under test)."""
    return {n: v.to(device or DEVICE, dtype) if isinstance(v, torch.Tensor)
            else torch.tensor(v, dtype=dtype, device=device or DEVICE) for n, v in values.items()}


def leaves(out):
    """The tensors of a kernel output (dict, tuple, CompactJacobian or tensor), in order."""
    if isinstance(out, dict):
        return [t for k in sorted(out, key=str) for t in leaves(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in leaves(o)]
    if isinstance(out, CompactJacobian):
        return leaves(list(out.factors)) + [out.dense()]
    return [out]


def agree(got, want, tol=TOL64, scale=0.0, dtype=torch.float64):
    """Every tensor of ``got`` is on the device under test, has ``dtype`` and matches
    ``want`` to ``tol`` relative to max(‖want‖, scale)."""
    g, w = leaves(got), leaves(want)
    assert len(g) == len(w)
    dev = torch.device(DEVICE)
    for a, b in zip(g, w):
        assert isinstance(a, torch.Tensor), type(a)     # scalars too: 0-d tensors on the device
        assert a.device.type == dev.type and (dev.index is None or a.device == dev), a.device
        assert a.dtype == dtype, a.dtype
        assert a.shape == b.shape, (a.shape, b.shape)
        a, b = a.detach().cpu().double(), b.detach().cpu().double()
        err = float((a - b).norm()) / max(float(b.norm()), scale, 1e-300)
        assert err <= tol, err


def calls(k, names, n, rng):
    """(label, fn(values, device) → output) for every Kernel method and every part."""
    out = [("loss", lambda v, dev: k.loss(v)), ("gradient", lambda v, dev: k.gradient(v))]
    for part in PARTS:
        vec = rng.standard_normal(n)
        out += [(f"hessian {part}", lambda v, dev, part=part: k.hessian(v, part)),
                (f"hvp {part}", lambda v, dev, part=part, vec=vec:
                    k.hvp(v, torch.tensor(vec, dtype=v["X"].dtype, device=dev), part)),
                (f"frobenius_norms {part}", lambda v, dev, part=part: k.frobenius_norms(v, part))]
        for p in names:
            out += [(f"diag {p} {part}", lambda v, dev, p=p, part=part: k.diag(v, p, part)),
                    (f"trace {p} {part}", lambda v, dev, p=p, part=part: k.trace(v, p, part))]
            for q in names:
                out += [(f"block {p} {q} {part}",
                         lambda v, dev, p=p, q=q, part=part: k.hessian_block(v, p, q, part)),
                        (f"frobenius {p} {q} {part}",
                         lambda v, dev, p=p, q=q, part=part: k.frobenius_norm(v, p, q, part))]
    for p in names:
        for q in names:
            out.append((f"frobenius_split {p} {q}",
                        lambda v, dev, p=p, q=q: k.frobenius_split(v, p, q)))
        for compact in (False, True):
            out.append((f"jacobian {p} compact={compact}",
                        lambda v, dev, p=p, c=compact: k.jacobian(v, p, compact=c)))
    return out


def autograd_hessian(d, tv, names):
    """The full Hessian over ``names`` (flat, declared order) by torch.func.hessian
    (forward-over-reverse) of the interpreted loss, on the tensors' device."""
    shapes = [tv[p].shape for p in names]
    sizes = [int(np.prod(s)) for s in shapes]

    def loss(w):
        parts = dict(zip(names, (c.reshape(s) for c, s in zip(torch.split(w, sizes), shapes))))
        return evaluate(d.loss_expr, {**tv, **parts}, backend="torch")[0, 0]

    return hessian(loss)(torch.cat([tv[p].reshape(-1) for p in names]))


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("loss,causal", CASES)
def test_attention_kernels_match_cpu_and_device_autograd(loss, causal):
    d, values, _ = attention_case(loss, causal)
    k = sh.kernel("attention", "torch", loss, causal=causal)
    names = d.layer.param_names
    cpu, dev = tensors(values), to(values)
    H_cpu = k.hessian(cpu, "full")
    scale = float(H_cpu.norm())
    # torch.func.hessian on the device: the full Hessian, independent of the CPU run
    H_auto = autograd_hessian(d, dev, names)
    assert H_auto.device.type == torch.device(DEVICE).type
    agree(k.hessian(dev, "full"), H_auto, scale=scale)
    for label, fn in calls(k, names, H_cpu.shape[0], np.random.default_rng(1)):
        want = fn(cpu, "cpu")
        small = label.startswith(("loss", "gradient", "jacobian"))
        try:
            agree(fn(dev, DEVICE), want, scale=0.0 if small else scale)
        except AssertionError as e:
            raise AssertionError(f"{label}: {e}") from e


@pytest.mark.parametrize("loss,causal", [("mse", True), ("ce", False)])
def test_float32_on_device_matches_float64(loss, causal):
    d, values, _ = attention_case(loss, causal)
    k = sh.kernel("attention", "torch", loss, causal=causal)
    names = d.layer.param_names
    v64, v32 = to(values), to(values, dtype=torch.float32)
    H = k.hessian(v64, "full")
    scale = float(H.norm())
    vec = np.random.default_rng(2).standard_normal(H.shape[0])
    checks = [lambda v: k.hessian(v, "full"), lambda v: k.hessian(v, "functional"),
              lambda v: k.hvp(v, torch.tensor(vec, dtype=v["X"].dtype, device=DEVICE), "full"),
              lambda v: k.frobenius_norms(v, "outer"),
              lambda v: k.frobenius_split(v, "W_Q", "W_K"),
              lambda v: [k.diag(v, p, "full") for p in names],
              lambda v: [k.trace(v, p, "outer") for p in names]]
    for i, fn in enumerate(checks):
        try:
            agree(fn(v32), fn(v64), tol=TOL32, scale=scale, dtype=torch.float32)
        except AssertionError as e:
            raise AssertionError(f"check {i}: {e}") from e
    agree(k.gradient(v32), k.gradient(v64), tol=TOL32, dtype=torch.float32)


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_batched_data_on_device(loss):
    """X, Y with a leading batch axis N: the same mean Hessian (and per-sequence Jacobians)
    as on CPU, and the same as autograd of the batch-mean loss on the device."""
    d = sh.derive(sh.layer("attention"), loss)
    seqs = [random_values(d, seed=s, sizes={"L": 4, "d_V": 3, "d_K": 5}) for s in range(3)]
    batch = {n: np.stack([s[n] for s in seqs]) if n in ("X", "Y") else seqs[0][n] for n in seqs[0]}
    k = sh.kernel("attention", "torch", loss)
    names = d.layer.param_names
    cpu, dev = tensors(batch), to(batch)
    assert dev["X"].shape[0] == 3
    H_cpu = k.hessian(cpu, "full")
    scale = float(H_cpu.norm())
    # autograd of the mean loss, one sequence at a time, on the device
    per_seq = [autograd_hessian(d, {**dev, "X": dev["X"][i], "Y": dev["Y"][i]}, names)
               for i in range(3)]
    agree(k.hessian(dev, "full"), torch.stack(per_seq).mean(0), scale=scale)
    vec = torch.tensor(np.random.default_rng(3).standard_normal(H_cpu.shape[0]))
    agree(k.hvp(dev, vec.to(DEVICE)), k.hvp(cpu, vec), scale=scale)
    agree(k.frobenius_norms(dev, "functional"), k.frobenius_norms(cpu, "functional"), scale=scale)
    agree(k.diag(dev, "W_Q", "outer"), k.diag(cpu, "W_Q", "outer"), scale=scale)
    agree(k.hessian_block(dev, "W_V", "W_K", "full"), k.hessian_block(cpu, "W_V", "W_K", "full"),
          scale=scale)
    for p in names:
        J = k.jacobian(dev, p)
        assert J.shape[0] == 3
        agree(J, k.jacobian(cpu, p))
        agree(k.jacobian(dev, p, compact=True), k.jacobian(cpu, p, compact=True))


# ----------------------------------------------------------------------------- other layers
JACOBIAN_CASES = [("layernorm", {}), ("layernorm", {"eps": 0.25, "affine": "param"}),
                  ("ffn", {}), ("ffn", {"activation": "gelu", "bias": True}),
                  ("ffn", {"bias": True, "residual": True})]


@pytest.mark.parametrize("name,opts", JACOBIAN_CASES,
                         ids=[f"{n}-{key(o) or 'default'}" for n, o in JACOBIAN_CASES])
def test_layer_jacobians_on_device(name, opts):
    """Dense and compact Jacobians on the device against the CPU kernel and jacrev (CPU)."""
    d, values, ref = jacobian_case(name, key(opts))
    k = sh.kernel(name, "torch", "mse", **opts)
    vals = {n: v for n, v in values.items() if n != "Y"}
    cpu, dev = tensors(vals), to(vals)
    for p in d.layer.param_names:
        for compact in (False, True):
            got = k.jacobian(dev, p, compact=compact)
            agree(got, k.jacobian(cpu, p, compact=compact))
            dense = got.dense() if compact else got
            agree(dense, torch.tensor(ref[p]))


def test_post_ln_block_hessian_block_on_device():
    """One block of the (committed) post-LN block kernels, against CPU and device autograd."""
    d = sh.derive(sh.layer("post_ln_block"), "mse")
    values = random_values(d, seed=1, sizes={"L": 4, "d_V": 8, "d_K": 6, "d_ff": 16})
    k = sh.kernel("post_ln_block", "torch", "mse")
    cpu, dev = tensors(values), to(values)
    got = k.hessian_block(dev, "W_V", "W_1", "full")
    agree(got, k.hessian_block(cpu, "W_V", "W_1", "full"), tol=1e-9)

    # reverse-over-reverse (LayerNorm's forward-over-reverse issue), on the device
    def loss(wv, w1):
        return evaluate(d.loss_expr, {**dev, "W_V": wv, "W_1": w1}, backend="torch")[0, 0]

    ref = jacrev(jacrev(loss, argnums=0), argnums=1)(dev["W_V"], dev["W_1"])
    agree(got, ref.reshape(got.shape), tol=1e-9)


# ----------------------------------------------------------------------------- bad input
def test_mismatched_devices_are_named():
    _, values, _ = attention_case("mse", False)
    k = sh.kernel("attention", "torch", "mse")
    other = "cpu" if torch.device(DEVICE).type != "cpu" else "meta"
    dev = to(values)
    mixed = dict(dev, X=dev["X"].to(other))
    here = str(dev["W_Q"].device)
    with pytest.raises(InputError, match=rf"one device.*X: {other}.*{here}"):
        k.hessian(mixed)
    with pytest.raises(InputError, match=rf"one device.*X: {other}"):
        k.jacobian({n: v for n, v in mixed.items() if n != "Y"}, "W_Q")
    n = sum(dev[p].numel() for p in k.params)
    with pytest.raises(InputError, match=rf"v is on {other} but the values are on {here}"):
        k.hvp(dev, torch.zeros(n, dtype=torch.float64, device=other))


"""Committed modules load lazily: each function compiles on its first call, same results,
tracebacks into the generated file at the right lines."""
import traceback

import numpy as np
import pytest

from symhess import codegen, kernels
from symhess.verify import random_values
import symhess as sh

PATH = codegen.ROOT / "generated" / "numpy" / "attention.py"


def whole_module():
    ns = {"__name__": "whole"}
    exec(compile(PATH.read_text(), str(PATH), "exec"), ns)
    return ns


def test_lazy_module_has_the_same_table_and_compiles_nothing_up_front():
    lazy = kernels.lazy_module(PATH.read_text(), str(PATH), "lazy")
    whole = whole_module()
    assert lazy["VARIANTS"].keys() == whole["VARIANTS"].keys()
    for variant, table in whole["VARIANTS"].items():
        got = lazy["VARIANTS"][variant]
        assert got.keys() == table.keys()
        for key, fn in table.items():
            if callable(fn):
                assert got[key].__name__ == fn.__name__, key
                assert not got[key].compiled, key
            else:
                assert got[key] == fn, key          # layouts and other data entries


def test_lazy_functions_compute_what_the_whole_module_computes():
    lazy = kernels.lazy_module(PATH.read_text(), str(PATH), "lazy")
    whole = whole_module()
    d = sh.derive(sh.layer("attention"), "mse")
    values = random_values(d, seed=5)
    variant = next(iter(whole["VARIANTS"]))
    for key in [("hessian", "full"), ("frobenius_all", "outer"), ("gradient",)]:
        fn, ref = lazy["VARIANTS"][variant][key], whole["VARIANTS"][variant][key]
        args = [values[a][None] if a in ("X", "Y") else values[a]
                for a in ref.__code__.co_varnames[:ref.__code__.co_argcount - len(ref.__defaults__ or ())]]
        got, want = fn(*args), ref(*args)
        assert fn.compiled
        for g, w in zip(np.atleast_1d(got) if not isinstance(got, tuple) else got,
                        np.atleast_1d(want) if not isinstance(want, tuple) else want):
            np.testing.assert_array_equal(g, w)
    untouched = lazy["VARIANTS"][variant][("hvp", "outer")]
    assert not untouched.compiled


def _failing_line(fn):
    """(function name, line) of the generated file's frame where ``fn`` fails on bad shapes."""
    with pytest.raises(Exception) as info:
        fn(*([np.zeros((1, 2, 3))] * 5))     # X, W_Q, W_K, W_V, Y of clashing shapes
    frames = [f for f in traceback.extract_tb(info.value.__traceback__) if f.filename == str(PATH)]
    assert frames
    return frames[-1].name, frames[-1].lineno


def test_tracebacks_point_into_the_generated_file_at_the_same_lines():
    lazy = kernels.lazy_module(PATH.read_text(), str(PATH), "lazy")
    whole = whole_module()
    variant = next(iter(lazy["VARIANTS"]))
    for key in [("hessian", "full"), ("block", "W_V", "W_Q", "outer")]:
        fn = lazy["VARIANTS"][variant][key]
        name, line = _failing_line(fn)
        assert (name, line) == _failing_line(whole["VARIANTS"][variant][key])
        assert name == fn.__name__


def test_a_module_without_a_table_is_named_in_the_error():
    with pytest.raises(RuntimeError, match="no VARIANTS table"):
        kernels.lazy_module("import math\n\n\ndef f(x):\n    return x\n", "broken.py", "broken")


def test_a_module_without_functions_loads():
    ns = kernels.lazy_module('"""doc"""\nimport math\n\n\nVARIANTS = {\n    1: {(\'x\',): math.pi},\n}\n',
                             "tiny.py", "tiny")
    assert ns["VARIANTS"] == {1: {("x",): __import__("math").pi}}


def test_first_calls_from_several_threads_compile_once():
    from concurrent.futures import ThreadPoolExecutor
    lazy = kernels.lazy_module(PATH.read_text(), str(PATH), "lazy")
    variant = next(iter(lazy["VARIANTS"]))
    fn = lazy["VARIANTS"][variant][("hessian", "full")]
    d = sh.derive(sh.layer("attention"), "mse")
    values = random_values(d, seed=7)
    args = [values[a][None] if a in ("X", "Y") else values[a] for a in ("X", "W_Q", "W_K", "W_V", "Y")]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: fn(*args), range(8)))
    assert fn.compiled
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def test_torch_module_helpers_stay_eager_and_outputs_are_ordinary_tensors():
    """The torch modules define ``_empty`` before the routines (CPU outputs from NumPy's
    allocator, which asks for huge pages): it is a plain function of the namespace, not a
    lazy routine, and what the kernels return are writable tensors of the inputs' dtype."""
    import torch
    path = codegen.ROOT / "generated" / "torch" / "ffn.py"
    lazy = kernels.lazy_module(path.read_text(), str(path), "lazy_torch")
    assert callable(lazy["_empty"]) and not isinstance(lazy["_empty"], kernels.LazyFunction)
    d = sh.derive(sh.layer("ffn"), "mse")
    values = random_values(d, seed=2)
    k = sh.kernel("ffn", "torch", "mse")
    want = sh.kernel("ffn", "numpy", "mse").hessian(values, "full")
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-4)):
        h = k.hessian({n: torch.tensor(v, dtype=dtype) for n, v in values.items()}, "full")
        assert h.dtype == dtype and h.device.type == "cpu"
        assert np.allclose(h.numpy(), want, rtol=tol, atol=tol * np.abs(want).max())
        h.mul_(2)                                     # writable like any other tensor

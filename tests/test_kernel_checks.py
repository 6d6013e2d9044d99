"""Kernels run the layer's own value checks: a zero-variance LayerNorm row is an error, not NaN."""
import pytest
import torch

import symhess as sh
from symhess.evaluate import InputError
from symhess.verify import random_values


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_zero_variance_row_is_rejected_by_the_kernel(backend):
    d = sh.derive(sh.layer("layernorm"), "mse")
    values = random_values(d, seed=0)
    values["X"][1] = 3.0
    if backend == "torch":
        values = {k: torch.as_tensor(v) for k, v in values.items()}
    k = sh.kernel("layernorm", backend, "mse")
    with pytest.raises(InputError, match=r"row 1 \(0-based\).*zero variance"):
        k.hessian(values, "full")

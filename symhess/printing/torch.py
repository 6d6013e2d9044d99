"""The torch target: data only (module name and function map) for ``printing.code``."""

TORCH = {
    "name": "torch",
    "imports": ["import math", "", "import numpy as np", "import opt_einsum as oe", "import torch"],
    # module-level helpers after the imports
    "preamble": [
        "from symhess.smallk import matmul_into as _matmul_into",
        "from symhess.smallk import transpose_into as _transpose_into",
        "",
        "_NUMPY_DTYPES = {torch.float64: np.float64, torch.float32: np.float32}",
        "",
        "",
        "def _empty(shape, like):",
        '    """An uninitialised tensor of ``like``\'s dtype and device.  On the CPU it comes from',
        "    NumPy's allocator, which asks the OS for transparent huge pages for large arrays:",
        '    writing a fresh 63 MB Hessian then faults in 7 ms instead of 25 (BENCHMARKS.md)."""',
        "    if like.device.type == \"cpu\" and like.dtype in _NUMPY_DTYPES:",
        "        return torch.from_numpy(np.empty(shape, dtype=_NUMPY_DTYPES[like.dtype]))",
        "    return torch.empty(shape, dtype=like.dtype, device=like.device)",
    ],
    # a dimension read from an argument's shape: a Python int, also while torch.jit.trace
    # records a routine (its sizes would otherwise be traced as tensors, and the scalar
    # coefficients computed from them in the default dtype, float32; symhess.traces)
    "size": "int({0}.shape[{1}])",
    "T": "{0}.transpose(-1, -2)",
    "sum_last": "{0}.sum(-1, keepdim=True)",
    "sum_rows": "{0}.sum(-2, keepdim=True)",
    "max_last": "{0}.amax(-1, keepdim=True)",
    "mean_batch": "{0}.mean(0)",
    "bcast_last": "{0}.expand(*{0}.shape[:-1], {1})",
    "bcast_rows": "{0}.expand(*{0}.shape[:-2], {1}, {0}.shape[-1])",
    "bcast_lead": "{0}.expand(*{1}, *{0}.shape[-2:])",
    "zeros": "torch.zeros({0}, dtype={like}.dtype, device={like}.device)",
    "empty": "_empty({0}, {like})",
    # a temporary the routine frees again (a slab operand, a dense block for a norm): torch's
    # own allocator (the NumPy-backed _empty, for huge pages on fresh results, cost 4-5 % of
    # the post-LN Hessian here: BENCHMARKS.md, eighth session)
    "scratch": "torch.empty({0}, dtype={like}.dtype, device={like}.device)",
    "ones": "torch.ones({0}, dtype={like}.dtype, device={like}.device)",
    "eye": "torch.eye({0}, dtype={like}.dtype, device={like}.device)",
    "triu_mask": "torch.triu(torch.ones(({0}, {0}), dtype=torch.bool, device={like}.device), 1)",
    "tril_ones": "torch.tril(torch.ones(({0}, {0}), dtype={like}.dtype, device={like}.device))",
    "where": "torch.where({0}, {1}, {2})",
    # {0} restricted to {2} … {2} + {3} along axis {1} (< 0); {4}: ", :" per later axis
    "narrow": "{0}.narrow({1}, {2}, {3})",
    "view": "{0}.view({1})",
    "mul_into": "torch.mul({0}, {1}, out={2})",
    "addmul_into": "{2}.addcmul_({0}, {1})",
    # products written (or added) into rows of the Hessian: a loop nest for short inner
    # dimensions on the CPU, BLAS otherwise (symhess.smallk)
    "matmul_into": "_matmul_into({0}, {1}, {2})",
    # one call per slab GEMM whatever its rows: the loop nest computes four at a time anyway,
    # and the BLAS fallback splits them into blocks of smallk.BLAS_ROWS (MKL's best)
    "slab_gemm_rows": None,
    "mm_into": "_matmul_into({0}, {1}, {2})",
    "addmm_into": "_matmul_into({0}, {1}, {2}, add=True)",
    "bmm_into": "_matmul_into({0}, {1}, {2})",
    "addbmm_into": "_matmul_into({0}, {1}, {2}, add=True)",
    # {1}[...] = {0}ᵀ for two blocks of the Hessian (one copied from its transpose): 8 × 8
    # tiles transposed in registers (symhess.smallk), ≈ 6× the strided copy
    "transpose_into": "_transpose_into({0}, {1})",
    "reshape": "{0}.reshape({1})",
    "permute": "{0}.permute({1})",
    "flatten_mats": "{0}.reshape(*{0}.shape[:-2], {1}, 1)",
    "unflatten_mats": "{0}.reshape(*{0}.shape[:-2], {1}, {2})",
    "diag_part": "torch.diagonal({0}, 0, -2, -1)[..., None]",
    "sqrt_pos": "torch.sqrt(torch.clamp({0}, min=0.0))",
    "norm": "torch.linalg.norm({0})",
    "concat": "torch.cat({0})",
    "concat_last": "torch.cat([{0}], dim=-1)",
    "concat_rows": "torch.cat([{0}], dim=-2)",
    "merge_last": "{0}.reshape(*{0}.shape[:{1}], -1)",
    "fn": {"sigmoid": "torch.sigmoid({0})", "exp": "torch.exp({0})", "log": "torch.log({0})",
           "tanh": "torch.tanh({0})", "sqrt": "torch.sqrt({0})", "cosh": "torch.cosh({0})",
           "sinh": "torch.sinh({0})", "cos": "torch.cos({0})", "sin": "torch.sin({0})",
           "abs": "torch.abs({0})", "erf": "torch.special.erf({0})",
           "heaviside": "torch.heaviside({0}, torch.full_like({0}, {1}))"},
}

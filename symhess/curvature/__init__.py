"""Exact curvature on data: kernels of a layer (``kernels``: prepared states, Hessian–vector
products, diagonals, traces, Frobenius norms, dense blocks), matrix-view block products with
the forward kept (``matview``), datasets and SciPy operators (``dataset``, ``operators``),
spectra and densities (``spectra``), and the same across processes (``distributed``)."""

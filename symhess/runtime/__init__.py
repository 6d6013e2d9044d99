"""The kernels' runtime: index networks contracted at the sizes of each call.

* ``network`` — networks as data (``net``, ``Compact``) and the reductions over them
  (dense blocks, diagonals, traces, Frobenius inner products);
* ``contract`` — plan (opt_einsum orders for the actual shapes, cached), slice to the memory
  budget, execute as batched matrix products;
* ``chain`` — matrix-chain brackets for the matrix-view routines;
* ``schedule`` — the budget and the tunables, with one switch;
* ``state`` — ``Forward``, the base class of every generated variant (prepared values);
* ``numpy_ops`` / ``torch_ops`` — the backends (the NumPy one imports no torch);
* ``memory`` — keeping freed memory for reuse in long runs (glibc).
"""

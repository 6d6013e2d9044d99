"""The calculus: one differential rule per node type (``rules``), its matrix view (``adjoint``:
gradients and Hessian–vector products as matrix expressions) and Kronecker view (``kron``:
vec_r Jacobians), the losses, the Gauss–Newton split of every Hessian block (``hessian``),
the simplifier that names the attention moments (``simplify``), and the reference that checks
every block against torch autograd (``verify``)."""

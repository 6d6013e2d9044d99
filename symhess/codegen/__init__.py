"""Code generation: a derivation lowered to index networks (``program``, ``index``), emitted as
the members of one readable class per variant (``python``, ``templates/kernels.py.j2``), and
rendered into ``generated/`` or the user cache (``render``).  The emitted code runs on
``symhess.runtime``."""

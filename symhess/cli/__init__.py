"""The ``symhess`` command (``main``), its shared argument handling (``args``), the spectrum
command (``spectrum``), LaTeX reports (``report``), and the papers' experiments
(``experiments``, ``scaling``, ``data``)."""

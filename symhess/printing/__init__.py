"""LaTeX documents of derivations: breaking long formulas into lines (``latex_lines``), naming
large recurring sub-expressions once (``latex_cse``), and the notation a report explains
(``notation``).  The LaTeX and text forms of one expression are ``symhess.expr.latex`` and
``symhess.expr.text``."""

"""The version of symhess (the single source: pyproject.toml reads it)."""
__version__ = "0.1.0"

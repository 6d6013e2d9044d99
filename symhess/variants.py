"""Attention variants declared with the public API (filled in by the variants work)."""

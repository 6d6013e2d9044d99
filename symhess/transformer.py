"""LayerNorm, FFN and full Transformer blocks (filled in by the full-block work)."""

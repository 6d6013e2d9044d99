"""Five-digit addition as next-token prediction (the task of Quirke & Barez).

A sequence is ``XXXXX+YYYYY=ZZZZZZ`` (18 tokens, vocabulary 12: digits 0–9, '+' = 10,
'=' = 11); the answer has 6 digits (the leading one is the carry) at positions 12–17, and
the logits at positions 11–16 predict them.  In a fraction ``enrich_prob`` of batches, a
fraction ``enrich_frac`` of the digit pairs is forced to sum to 9 (the "UseSum9" cases).
Everything is drawn from ``numpy.random.default_rng(seed)``, so a seed fixes the data.
"""
from __future__ import annotations

import numpy as np

N_DIGITS = 5
N_CTX = 18
VOCAB = 12
PLUS, EQUALS = 10, 11
ANSWER_POSITIONS = tuple(range(12, 18))      # answer tokens
PREDICT_POSITIONS = tuple(range(11, 17))     # logits predicting them
N_ANSWER = len(ANSWER_POSITIONS)


def _digits(n, width):
    """Most-significant-first decimal digits of the integers n (shape (B,) → (B, width))."""
    powers = 10 ** np.arange(width - 1, -1, -1)
    return (n[:, None] // powers) % 10


def addition_batch(batch, rng, enrich_prob=0.2, enrich_frac=0.2):
    """A (batch, 18) int array of addition sequences drawn from ``rng``."""
    if batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch}")
    a = rng.integers(0, 10, size=(batch, N_DIGITS))
    b = rng.integers(0, 10, size=(batch, N_DIGITS))
    if rng.random() < enrich_prob:
        # force a fraction of the digit pairs to sum to 9 (b = 9 − a there)
        force = rng.random((batch, N_DIGITS)) < enrich_frac
        b = np.where(force, 9 - a, b)
    powers = 10 ** np.arange(N_DIGITS - 1, -1, -1)
    total = a @ powers + b @ powers
    out = np.empty((batch, N_CTX), dtype=np.int64)
    out[:, :5] = a
    out[:, 5] = PLUS
    out[:, 6:11] = b
    out[:, 11] = EQUALS
    out[:, 12:] = _digits(total, N_DIGITS + 1)
    return out


def addition_batches(n_batches, batch, seed=0, enrich_prob=0.2, enrich_frac=0.2):
    """A list of ``n_batches`` batches, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    return [addition_batch(batch, rng, enrich_prob, enrich_frac) for _ in range(n_batches)]


def decode(seq) -> str:
    """'12345+67890=080235' from a token sequence."""
    chars = "0123456789+="
    return "".join(chars[int(t)] for t in seq)


def one_hot(tokens, vocab=VOCAB):
    """(…, L) integer tokens → (…, L, vocab) float64 one-hot rows."""
    tokens = np.asarray(tokens)
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(f"tokens must lie in 0..{vocab - 1}")
    return np.eye(vocab)[tokens]


def next_token_targets(tokens, vocab=VOCAB):
    """Target rows Y (…, L, vocab): row t is onehot(tokens[t+1]) for t in 11–16, zero elsewhere."""
    tokens = np.asarray(tokens)
    y = np.zeros(tokens.shape + (vocab,))
    for t in PREDICT_POSITIONS:
        y[..., t, :] = one_hot(tokens[..., t + 1], vocab)
    return y


def same_position_targets(tokens, vocab=VOCAB):
    """The MSE variant's targets (§1.1): row t is onehot(tokens[t]) for t in 11–16, zero elsewhere."""
    tokens = np.asarray(tokens)
    y = np.zeros(tokens.shape + (vocab,))
    for t in PREDICT_POSITIONS:
        y[..., t, :] = one_hot(tokens[..., t], vocab)
    return y


def answer_mask(vocab=VOCAB):
    """(L, vocab) 0/1 matrix: ones on the predicting rows 11–16."""
    m = np.zeros((N_CTX, vocab))
    m[list(PREDICT_POSITIONS), :] = 1.0
    return m

"""Digit-addition data: format, determinism, sums, enrichment."""
import numpy as np
import pytest

from symhess.cli import data


def _number(digits):
    return int("".join(str(int(d)) for d in digits))


def test_format_and_sums():
    (batch,) = data.addition_batches(1, 256, seed=3)
    assert batch.shape == (256, 18)
    assert (batch[:, 5] == data.PLUS).all() and (batch[:, 11] == data.EQUALS).all()
    digit_cols = [i for i in range(18) if i not in (5, 11)]
    assert batch[:, digit_cols].max() <= 9 and batch[:, digit_cols].min() >= 0
    for row in batch:
        assert _number(row[:5]) + _number(row[6:11]) == _number(row[12:])
    assert data.decode(batch[0])[5] == "+" and len(data.decode(batch[0])) == 18


def test_determinism_per_seed():
    a = data.addition_batches(3, 16, seed=7)
    b = data.addition_batches(3, 16, seed=7)
    c = data.addition_batches(3, 16, seed=8)
    assert all((x == y).all() for x, y in zip(a, b))
    assert any((x != y).any() for x, y in zip(a, c))


def test_enrichment_frequency():
    batches = data.addition_batches(400, 200, seed=0)
    frac = [float(((b[:, :5] + b[:, 6:11]) == 9).mean()) for b in batches]
    # without enrichment a pair sums to 9 with probability 0.1; enriched batches reach 0.1 + 0.2·0.9
    enriched = np.array(frac) > 0.19
    assert abs(enriched.mean() - 0.2) < 0.06
    assert abs(np.mean(np.array(frac)[enriched]) - 0.28) < 0.02
    assert abs(np.mean(np.array(frac)[~enriched]) - 0.10) < 0.01


def test_targets_and_mask():
    (batch,) = data.addition_batches(1, 4, seed=1)
    y = data.next_token_targets(batch)
    assert y.shape == (4, 18, 12)
    assert (y.sum(-1)[:, 11:17] == 1).all() and y.sum() == 4 * 6
    assert (y[:, 11:17].argmax(-1) == batch[:, 12:18]).all()
    assert data.answer_mask().sum() == 6 * 12
    with pytest.raises(ValueError, match="batch"):
        data.addition_batch(0, np.random.default_rng(0))

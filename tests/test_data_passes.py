"""Data read by datasets and operators: one-shot sources refused or read without losing a
batch, every pass the same data (else a clear error), nothing read that is not used.
Numbers are compared with torch autograd of the declaration on the whole data."""
import numpy as np
import pytest
import torch
from torch import nn

import symhess as sh
from symhess.curvature import distributed as D
from symhess.curvature.dataset import Dataset
from symhess.errors import InputError
from symhess.calculus.hessian import derive
from symhess.calculus.verify import autograd_blocks

L, DM, DK, N, B = 4, 3, 2, 2, 3          # 3 batches of 2 sequences


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(N, L, DM, generator=g, dtype=torch.float64),
                torch.randn(N, L, DM, generator=g, dtype=torch.float64)) for _ in range(B)]
    W = {n: torch.randn(DM, k, generator=g, dtype=torch.float64) / DM ** 0.5
         for n, k in (("W_Q", DK), ("W_K", DK), ("W_V", DM))}
    return batches, W


def autograd_block(batches, W, p="W_Q", q="W_Q", part="full"):
    """The dataset-mean block from autograd, sequence by sequence."""
    d = derive(sh.layer("attention"), "mse")
    blocks, n = 0, 0
    for X, Y in batches:
        for i in range(X.shape[0]):
            vals = {"X": X[i].numpy(), "Y": Y[i].numpy(), **{k: v.numpy() for k, v in W.items()}}
            blocks = blocks + autograd_blocks(d, vals)[(p, q, part)]
            n += 1
    return blocks / n, n


class Counted:
    """A re-iterable source that counts the batches it hands out."""

    def __init__(self, batches):
        self.batches, self.read = batches, 0

    def __iter__(self):
        for b in self.batches:
            self.read += 1
            yield b


class OneShot(torch.utils.data.IterableDataset):
    """An IterableDataset that can be iterated once (its __iter__ returns one iterator)."""

    def __init__(self, batches):
        self.it = iter(batches)

    def __iter__(self):
        return self.it


@pytest.fixture(scope="module")
def case():
    batches, W = make()
    H, n = autograd_block(batches, W)
    return batches, W, H, n


def test_one_shot_generator_is_refused_before_any_batch_is_consumed(case):
    batches, W, _, _ = case
    k = sh.kernel("attention", "torch", "mse")
    src = Counted(batches)
    gen = iter(src)
    with pytest.raises(InputError, match="read more than once.*not a one-shot generator"):
        Dataset(k, gen, params=W)
    with pytest.raises(InputError, match="read more than once"):
        sh.operator(k, gen, "W_Q", "W_Q", params=W)
    assert src.read == 0


def test_wrappers_do_not_hide_one_shot_sources(case):
    batches, W, _, _ = case
    mha = nn.MultiheadAttention(DM, 1, batch_first=True, bias=False).double()
    ml = sh.from_module(mha)
    src = Counted(batches)
    with pytest.raises(InputError, match="ModuleLayer.batches needs data it can read more than once"):
        ml.batches(iter(src))
    with pytest.raises(InputError, match="shard needs data it can read more than once"):
        D.shard(iter(src), 0, 1)
    with pytest.raises(InputError, match="shard needs data"):
        D.shard(b for b in batches)
    assert src.read == 0
    # re-iterable sources pass through the wrappers (and are read again on every pass)
    assert len(list(ml.batches(batches))) == B and len(list(D.shard(batches, 1, 2))) == 1


def test_the_size_probe_consumes_no_batch(case):
    """Building an operator reads one batch to learn the sizes; the first pass goes on from
    it, so a source read once per pass hands out each batch once per pass."""
    batches, W, H, n = case
    k = sh.kernel("attention", "torch", "mse")
    src = Counted(batches)
    op = sh.operator(k, src, "W_Q", "W_Q", params=W, keep=0)
    assert src.read == 1
    v = torch.linspace(-1, 1, op.shape[1], dtype=torch.float64)
    got = op @ v
    assert src.read == B and op.num_data == n
    assert torch.allclose(got, torch.as_tensor(H) @ v, rtol=1e-12, atol=1e-14)
    op @ v
    assert src.read == 2 * B


@pytest.mark.parametrize("keep", [None, 0])
def test_dataloader_over_a_one_shot_iterable_dataset_never_drops_a_batch(case, keep):
    """Kept (the default): every batch is read once and kept, the spectrum is the whole
    data's; not kept: the second pass finds the source empty and says so."""
    batches, W, H, n = case
    k = sh.kernel("attention", "torch", "mse")
    loader = torch.utils.data.DataLoader(OneShot(batches), batch_size=None)
    op = sh.operator(k, loader, "W_Q", "W_Q", params=W, keep=keep)
    if keep is None:
        top = sh.spectrum(op, k=2, method="eigsh", tol=1e-12)
        assert op.num_data == n == N * B
        want = np.linalg.eigvalsh(H)[::-1][:2]
        assert np.allclose(top.values, want, rtol=1e-9, atol=1e-13)
        return
    v = torch.ones(op.shape[1], dtype=torch.float64)
    op @ v                                        # the first pass reads every batch
    assert op.num_data == n
    with pytest.raises(InputError, match=rf"held {n} sequences in an earlier pass and 0 now"):
        op @ v


class Augmented:
    """Every pass yields the same number of sequences with fresh noise added."""

    def __init__(self, batches):
        self.batches, self.g = batches, torch.Generator().manual_seed(1)

    def __iter__(self):
        for x, y in self.batches:
            yield x + 1e-3 * torch.randn(x.shape, generator=self.g, dtype=x.dtype), y


def test_data_that_change_between_passes_are_refused(case):
    batches, W, _, _ = case
    k = sh.kernel("attention", "torch", "mse")
    op = sh.operator(k, Augmented(batches), "W_Q", "W_Q", params=W, keep=0)
    v = torch.ones(op.shape[1], dtype=torch.float64)
    op @ v
    with pytest.raises(InputError, match="values changed since an earlier pass"):
        op @ v
    with pytest.raises(InputError, match="values changed"):
        sh.spectrum(sh.operator(k, Augmented(batches), "W_Q", "W_Q", params=W, keep=0), k=1,
                    method="eigsh")
    ds = Dataset(k, Augmented(batches), params=W, keep=0)
    ds.loss()
    with pytest.raises(InputError, match="values changed"):
        ds.loss()


class Reshuffled:
    """The same sequences every pass, grouped into batches in a new random order."""

    def __init__(self, batches):
        self.X = torch.cat([b[0] for b in batches])
        self.Y = torch.cat([b[1] for b in batches])
        self.g = torch.Generator().manual_seed(2)

    def __iter__(self):
        perm = torch.randperm(len(self.X), generator=self.g)
        for i in range(0, len(perm), 3):
            j = perm[i:i + 3]
            yield self.X[j], self.Y[j]


def test_reshuffled_batches_of_the_same_sequences_are_the_same_dataset(case):
    """The mean does not depend on the grouping, so a shuffling loader is accepted and exact."""
    batches, W, H, n = case
    k = sh.kernel("attention", "torch", "mse")
    op = sh.operator(k, Reshuffled(batches), "W_Q", "W_Q", params=W, keep=0)
    dense = op.to_dense()
    assert np.abs(dense - H).max() <= 1e-12 * np.abs(H).max()
    top = sh.spectrum(op, k=1, method="eigsh", tol=1e-12)
    assert abs(top.values[0] - np.linalg.eigvalsh(H)[-1]) <= 1e-9 * abs(top.values[0])

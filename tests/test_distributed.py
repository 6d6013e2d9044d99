"""Two gloo processes on the CPU give the single-process dataset results (≤ 1e-12, float64)."""
import os
import socket

import numpy as np
import pytest
import torch

import symhess as sh
from symhess.curvature import distributed as D
from symhess.curvature.dataset import Dataset

L, DM, DK, N, B = 5, 4, 3, 3, 5        # 5 batches of 3 sequences: shards of 3 and 2 batches


def data():
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(N, L, DM, generator=g, dtype=torch.float64),
                torch.randn(N, L, DM, generator=g, dtype=torch.float64)) for _ in range(B)]
    W = {n: torch.randn(DM, k, generator=g, dtype=torch.float64) / DM ** 0.5
         for n, k in (("W_Q", DK), ("W_K", DK), ("W_V", DM))}
    return batches, W


def results(ds, k):
    """Every dataset quantity (same calls in every process)."""
    v = torch.linspace(-1, 1, 40, dtype=torch.float64)
    out = {"loss": ds.loss(), "gradient": ds.gradient().numpy(),
           "hvp": (sh.operator(k, ds) @ v).numpy(),
           "block": (sh.operator(k, ds, "W_Q", "W_K", "functional") @ v[:12]).numpy(),
           "row": (sh.operator(k, ds, "W_V", part="outer") @ v).numpy(),
           "diag": ds.diag("W_K").numpy(), "trace": ds.trace("W_Q", "outer"),
           "fro_dense": ds.frobenius_norm("W_Q", "W_K", "full", "dense"),
           "fro_pairs": ds.frobenius_norm("W_Q", "W_K", "full", "pairs"),
           "top": sh.spectrum(sh.operator(k, ds, "W_Q", "W_Q"), k=2, method="eigsh").values}
    return out


def worker(rank, world, port, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        batches, W = data()
        k = sh.kernel("attention", backend="torch", loss="mse")
        ds = Dataset(k, D.shard(batches), params=W)
        assert ds.reducer.world == world
        out = results(ds, k)
        out["total"] = ds._total
        if rank == 0:
            np.save(path, out, allow_pickle=True)
    finally:
        torch.distributed.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_equal_one(tmp_path):
    path = str(tmp_path / "rank0.npy")
    torch.multiprocessing.spawn(worker, args=(2, _free_port(), path), nprocs=2, join=True)
    got = np.load(path, allow_pickle=True).item()
    batches, W = data()
    k = sh.kernel("attention", backend="torch", loss="mse")
    want = results(Dataset(k, batches, params=W, distributed=False), k)
    assert got["total"] == N * B
    for key, w in want.items():
        g = got[key]
        scale = max(np.max(np.abs(w)), 1e-300)
        assert np.max(np.abs(np.asarray(g) - np.asarray(w))) <= 1e-12 * scale, key


def test_shard_and_reducer_without_a_group():
    assert list(D.shard(list(range(7)), 1, 3)) == [1, 4]
    assert len(D.shard(list(range(7)), 0, 3)) == 3
    assert isinstance(D.reducer("auto"), D.Local)
    with pytest.raises(sh.InputError, match="not initialised"):
        D.reducer(True)

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
           "diagonals": np.concatenate([d.numpy().ravel() for d in ds.diagonals("outer").values()]),
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


# ----------------------------------------------------------------------------- disagreement
def _scenario(name, rank, batches, W, k):
    """The first call of a dataset (or its operator) under one disagreement between ranks."""
    if name == "parameters differ":
        Wr = dict(W, W_Q=W["W_Q"] + (1e-9 if rank == 1 else 0.0))
        return sh.operator(k, D.shard(batches), "W_Q", "W_Q", params=Wr)
    if name == "dtypes differ":
        f = (lambda t: t.float()) if rank == 1 else (lambda t: t)
        Wr = {n: f(w) for n, w in W.items()}
        return Dataset(k, D.shard([(f(x), f(y)) for x, y in batches]), params=Wr).loss()
    if name == "shapes differ":
        Wr = dict(W, W_Q=W["W_Q"][:, :2], W_K=W["W_K"][:, :2]) if rank == 1 else W
        return Dataset(k, D.shard(batches), params=Wr).gradient()
    if name == "fewer batches than processes":
        return sh.spectrum(sh.operator(k, D.shard(batches[:1]), "W_V", "W_V", params=W), k=1)
    if name == "agreeing":
        return Dataset(k, D.shard(batches), params=W).loss()
    raise AssertionError(name)


SCENARIOS = {"parameters differ": "parameter W_Q has different values in processes 0 and 1",
             "dtypes differ": "has different dtypes in processes 0 and 1 (float64 and float32)",
             "shapes differ": "has different shapes in processes 0 and 1 ((4, 3) and (4, 2))",
             "fewer batches than processes": "process 1 of 2: the data hold no batch in this "
                                             "process (fewer batches than processes?)"}


class _Changing:
    """Rank 1's data change between passes (augmentation); rank 0's do not."""

    def __init__(self, batches, rank):
        self.batches, self.rank, self.n = batches, rank, 0

    def __iter__(self):
        self.n += 1
        for x, y in self.batches:
            yield (x + 1e-3 * self.n if self.rank == 1 else x), y


def disagreeing_worker(rank, world, port, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    batches, W = data()
    k = sh.kernel("attention", backend="torch", loss="mse")
    got = {}
    for name in list(SCENARIOS) + ["agreeing"]:
        try:
            got[name] = ("ok", _scenario(name, rank, batches, W, k) is not None)
        except sh.SymhessError as exc:
            got[name] = (type(exc).__name__, str(exc))
    # a later error in one process only: the other's reduction fails with a ProcessError
    ds = Dataset(k, _Changing(D.shard(batches), rank), params=W, keep=0)
    ds.loss()
    try:
        ds.loss()
        got["later"] = ("ok", None)
    except sh.SymhessError as exc:
        got["later"] = (type(exc).__name__, str(exc))
    np.save(f"{path}.{rank}.npy", got, allow_pickle=True)
    if rank == 1:
        os._exit(0)                 # stops without leaving the group: rank 0 sees it fail
    torch.distributed.destroy_process_group()


def test_processes_that_disagree_all_raise_the_same_one_line_error(tmp_path):
    path = str(tmp_path / "rank")
    torch.multiprocessing.spawn(disagreeing_worker, args=(2, _free_port(), path), nprocs=2, join=True)
    got = [np.load(f"{path}.{r}.npy", allow_pickle=True).item() for r in range(2)]
    for name, needle in SCENARIOS.items():
        for r in range(2):
            kind, msg = got[r][name]
            assert kind == "InputError" and needle in msg, (r, name, msg)
    assert got[0]["agreeing"] == got[1]["agreeing"] == ("ok", True)
    assert got[1]["later"][0] == "InputError" and "values changed" in got[1]["later"][1]
    assert got[0]["later"][0] == "ProcessError", got[0]["later"]
    assert "process 0 of 2: a reduction across the processes failed" in got[0]["later"][1]

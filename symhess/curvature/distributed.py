"""Dataset reductions across processes with ``torch.distributed``.

Each process passes its own shard of the data (``shard`` below, or a ``DistributedSampler``);
``symhess.curvature.dataset.Dataset`` sums the weighted per-batch results of its shard and reduces them
with **one all-reduce per product**: the results and the shard's number of sequences are packed
into one flat buffer (the values' dtype, on their device; NumPy kernels use the CPU, so the
process group must be gloo), summed over the processes, and unpacked.  Every process then holds
the dataset mean, so an eigensolver runs the same iteration in every process; it must be given
the same starting vector everywhere (``symhess.curvature.spectra`` seeds it).

The Frobenius norm of a mean block by pairs of batches needs batches of other processes: each
process sends its batches in turn (``broadcast_object_list``), every process pairs them with
its own, and the partial sums are all-reduced once.

Before its first reduction a dataset checks once that the processes agree
(``symhess.curvature.passes``: the kernel, every parameter's shape, dtype and checksum, and that each
process has a batch); a difference raises the same ``InputError`` on every process before a
collective with mismatched buffers could abort or hang.  An error that only one process meets
later (its data changed between passes) is raised there; the others' reduction then fails
and raises ``ProcessError`` instead of a backend traceback.

``init_from_env()`` starts the process group the way ``torchrun`` describes it (WORLD_SIZE,
RANK, MASTER_ADDR …): NCCL when CUDA is available, gloo otherwise.
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import InputError, ProcessError

MODES = ("auto", True, False)


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:          # pragma: no cover - torch without distributed support
        return None
    return dist if dist.is_available() else None


def initialised() -> bool:
    dist = _dist()
    return bool(dist is not None and dist.is_initialized())


def reducer(mode="auto"):
    """``Local()`` or ``Processes()``: "auto" uses the process group when one is initialised
    with more than one process; True requires one; False ignores it."""
    if mode not in MODES:
        raise InputError(f"distributed must be 'auto', True or False, got {mode!r}")
    if mode is False:
        return Local()
    if not initialised():
        if mode is True:
            raise InputError("distributed=True but torch.distributed is not initialised "
                             "(call torch.distributed.init_process_group, or run under torchrun)")
        return Local()
    world = _dist().get_world_size()
    return Processes() if world > 1 or mode is True else Local()


class Local:
    """One process: reductions are the identity."""

    world, rank = 1, 0

    def sum(self, acc, n, like=None):
        return acc, n

    def scalar(self, x):
        return x

    def each_batch(self, batches):
        yield from batches

    def gather(self, item):
        """Every process's ``item`` pair, as two lists in rank order."""
        return [item[0]], [item[1]]


class Processes:
    """The default process group: one all-reduce per reduction.  A collective that fails
    (another process stopped: gloo's "connection closed", NCCL's abort) raises
    ``ProcessError`` naming this process, so the one real error is the failing process's."""

    def __init__(self):
        dist = _dist()
        self.dist = dist
        self.world, self.rank = dist.get_world_size(), dist.get_rank()

    def _run(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except RuntimeError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ProcessError(f"process {self.rank} of {self.world}: a reduction across the "
                               f"processes failed ({first[:160]}); another process stopped, "
                               f"and its own error says why") from None

    def _device(self, like):
        if like is not None and hasattr(like, "device"):
            return like.device
        import torch
        if self.dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def sum(self, acc, n, like=None):
        """(Σ_processes acc, Σ_processes n) with one all-reduce of one packed buffer."""
        import torch
        dtype = like.dtype if isinstance(like, torch.Tensor) else \
            getattr(torch, str(getattr(like, "dtype", "float64")))
        device = self._device(like if isinstance(like, torch.Tensor) else None)
        pieces, kinds = [], []
        for a in acc:
            if isinstance(a, torch.Tensor):
                kinds.append(("tensor", tuple(a.shape)))
                pieces.append(a.reshape(-1).to(device=device, dtype=dtype))
            elif isinstance(a, np.ndarray):
                kinds.append(("numpy", a.shape))
                pieces.append(torch.from_numpy(np.ascontiguousarray(a).reshape(-1)).to(device=device, dtype=dtype))
            else:
                kinds.append(("float", ()))
                pieces.append(torch.tensor([float(a)], dtype=dtype, device=device))
        pieces.append(torch.tensor([float(n)], dtype=dtype, device=device))
        buf = torch.cat(pieces)
        self._run(self.dist.all_reduce, buf)
        out, o = [], 0
        for kind, shape in kinds:
            k = int(np.prod(shape)) if shape else 1
            part = buf[o:o + k]
            o += k
            if kind == "tensor":
                out.append(part.reshape(shape))
            elif kind == "numpy":
                out.append(part.cpu().numpy().reshape(shape).copy())
            else:
                out.append(float(part[0]))
        return out, int(round(float(buf[o])))

    def gather(self, item):
        """Every process's ``item`` pair (picklable), as two lists in rank order."""
        out = [None] * self.world
        self._run(self.dist.all_gather_object, out, item)
        return [x[0] for x in out], [x[1] for x in out]

    def scalar(self, x):
        import torch
        t = torch.tensor([float(x)], dtype=torch.float64, device=self._device(None))
        self._run(self.dist.all_reduce, t)
        return float(t[0])

    def each_batch(self, batches):
        """Every process's batches, process by process, in every process (sent as objects)."""
        it = iter(batches)
        device = self._device(None) if self.dist.get_backend() == "nccl" else None
        for src in range(self.world):
            while True:
                box = [next(it, None) if self.rank == src else None]
                self._run(self.dist.broadcast_object_list, box, src=src, device=device)
                if box[0] is None:
                    break
                yield box[0]


def init_from_env():
    """Start the default process group from torchrun's environment when WORLD_SIZE > 1 and
    none is running; returns (rank, world size)."""
    dist = _dist()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist is None or world <= 1:
        return 0, 1
    if not dist.is_initialized():
        import torch
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


class shard:
    """Every ``world``-th batch of ``batches`` from ``rank`` on (defaults: this process),
    iterable again whenever ``batches`` is (a one-shot iterator is refused: ``passes``)."""

    def __init__(self, batches, rank=None, world=None):
        if rank is None or world is None:
            if initialised():
                d = _dist()
                rank, world = d.get_rank(), d.get_world_size()
            else:
                rank, world = 0, 1
        from .passes import refuse_one_shot
        refuse_one_shot(batches, "symhess.distributed.shard")
        for name, x in (("rank", rank), ("world", world)):
            if isinstance(x, bool) or not isinstance(x, int):
                raise InputError(f"{name} must be an integer, got {x!r}")
        if world < 1:
            raise InputError(f"world must be a positive integer, got {world}")
        if not (0 <= rank < world):
            raise InputError(f"rank must lie in 0 … {world - 1}, got {rank}")
        self.batches, self.rank, self.world = batches, rank, world

    def __iter__(self):
        for i, b in enumerate(self.batches):
            if i % self.world == self.rank:
                yield b

    def __len__(self):
        n = len(self.batches)
        return (n - self.rank + self.world - 1) // self.world


__all__ = ["reducer", "Local", "Processes", "init_from_env", "shard", "initialised"]

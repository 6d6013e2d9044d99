"""Checks that every pass over a dataset reads the same data, and that processes agree.

An iterative method (Lanczos, CG, a spectral density) reads the data once per product and
treats the results as products with *one* matrix.  Data that differ between passes (a
one-shot generator that is empty the second time, random augmentation, a sampler that drops
a different remainder) would make it mix matrices silently.  So:

* **one-shot sources are refused** where they can be seen (``one_shot``): an iterator or
  generator (``iter(x) is x``) given as data, or to a wrapper (``ModuleLayer.batches``,
  ``distributed.shard``) that would otherwise hide it;
* **every complete pass is fingerprinted** (``Fingerprint``) and compared with the first:
  the number of sequences and Σ_s h(s) mod 2⁶⁴, h a 64-bit BLAKE2b hash of one sequence's data
  (every data array's bytes, dtype and shape).  The sum does not depend on the order of the
  sequences or on how they are grouped into batches, so a shuffling ``DataLoader`` (the same
  sequences, other batches: the dataset mean is the same) passes, while a changed sequence
  (augmentation) or a missing one (a one-shot ``IterableDataset`` behind a ``DataLoader``)
  raises ``InputError`` at the end of the pass, before its result is used.  Passes served from
  the kept prepared batches read no data and need no check.

  Cost: one hash over the data's bytes per pass (BLAKE2b, ≈ 1 GB/s on one core; data on a
  GPU are copied to the host for it): O(N L d) per pass, against the O(N L² d) and more of
  every kernel quantity.

* **processes agree** (``agreement``): before its first reduction a dataset compares, across
  the processes of a ``torch.distributed`` group, the kernel (layer, loss, backend), the
  parameters' names, shapes, dtypes and a checksum of their values, and whether each
  process has a batch at all.  Any difference — or an error on any process — raises the
  same one-line ``InputError`` on every process (naming the process), before a collective
  with mismatched buffers could abort or hang.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np

from ..errors import InputError

MASK = 2 ** 64 - 1


def one_shot(data) -> bool:
    """Whether ``data`` is an iterator (a generator, ``iter(list)``): iterable once only.
    Checked without calling ``iter`` (which would start a DataLoader's workers)."""
    return isinstance(data, Iterator)


def refuse_one_shot(data, what):
    """An InputError when ``data`` is one-shot (``what`` names the receiver)."""
    if one_shot(data):
        raise InputError(f"{what} needs data it can read more than once (a list of batches, a "
                         f"DataLoader), not a one-shot {type(data).__name__}: every product "
                         f"reads the data again")


def _host(a):
    if hasattr(a, "detach"):
        a = a.detach()
        if a.device.type != "cpu":
            a = a.cpu()
        return np.ascontiguousarray(a.numpy())
    return np.ascontiguousarray(np.asarray(a))


def _digest(parts):
    h = hashlib.blake2b(digest_size=8)
    for a in parts:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return int.from_bytes(h.digest(), "little")


class Fingerprint:
    """(sequences, Σ_s h(s) mod 2⁶⁴) of one pass (module docstring)."""

    def __init__(self):
        self.count, self.total = 0, 0

    def add(self, arrays):
        """One batch: its data arrays, each with a leading batch axis of the same size."""
        hosts = [_host(a) for a in arrays]
        n = hosts[0].shape[0]
        for i in range(n):
            self.total = (self.total + _digest([a[i] for a in hosts])) & MASK
        self.count += n

    def key(self):
        return self.count, self.total

    def check_against(self, earlier):
        """InputError when this pass's data differ from an ``earlier`` pass's."""
        if earlier is None or earlier.key() == self.key():
            return
        if earlier.count != self.count:
            raise InputError(f"the data held {earlier.count} sequences in an earlier pass and "
                             f"{self.count} now; every pass must read the same data (a one-shot "
                             f"source such as a generator or an IterableDataset that cannot "
                             f"restart, or a sampler that drops a different remainder, cannot "
                             f"be read again; give a list of batches)")
        raise InputError(f"the data hold {self.count} sequences in every pass but their values "
                         f"changed since an earlier pass (random augmentation or sampling?); "
                         f"every pass must read the same sequences: fix the randomness or keep "
                         f"the batches in a list")


def checksum(a) -> str:
    """A short hash of an array's dtype, shape and bytes."""
    h = _host(a)
    return f"{_digest([h]):016x}"


def describe(kernel, params):
    """What processes must agree on: the kernel and every parameter's shape, dtype, checksum."""
    out = {"kernel": (kernel.layer.name, kernel.loss_name, kernel.backend)}
    for name in sorted(params, key=str):
        a = params[name]
        shape = tuple(getattr(a, "shape", ()))
        dtype = str(getattr(a, "dtype", type(a).__name__)).removeprefix("torch.")
        try:
            out[name] = (shape, dtype, checksum(a))
        except (TypeError, ValueError):
            out[name] = (shape, dtype, None)
    return out


def agreement(descs, errors):
    """The InputError to raise on every process, or None: ``descs`` and ``errors`` (a
    message or None) are every process's, in rank order."""
    world = len(descs)
    for rank, err in enumerate(errors):
        if err is not None:
            return InputError(f"process {rank} of {world}: {err}")
    ref = descs[0]
    for rank, d in enumerate(descs[1:], 1):
        if d == ref:
            continue
        for key in sorted(set(ref) | set(d), key=str):
            a, b = ref.get(key), d.get(key)
            if a == b:
                continue
            if key == "kernel":
                return InputError(f"processes 0 and {rank} use different kernels "
                                  f"({'/'.join(a)} and {'/'.join(b)}); every process must make "
                                  f"the same calls")
            if a is None or b is None:
                return InputError(f"parameter {key} is given in process {0 if b is None else rank} "
                                  f"only; every process needs the same parameters")
            what = ("shapes" if a[0] != b[0] else "dtypes" if a[1] != b[1] else "values")
            shown = {"shapes": (a[0], b[0]), "dtypes": (a[1], b[1]),
                     "values": (f"checksum {a[2]}", f"checksum {b[2]}")}[what]
            return InputError(f"parameter {key} has different {what} in processes 0 and {rank} "
                              f"({shown[0]} and {shown[1]}); every process must hold the same "
                              f"parameters (broadcast them from process 0)")
    return None


__all__ = ["one_shot", "refuse_one_shot", "Fingerprint", "describe", "agreement", "checksum"]

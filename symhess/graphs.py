"""CUDA-graph replay of generated torch routines: ``kernel(...).with_cuda_graphs()``.

A generated routine is a long run of small tensor statements (hundreds for a full
Transformer block). On a GPU each statement is one or a few kernel launches of a few
microseconds of work, so an eager call is bound by launch overhead. With CUDA graphs a
routine is captured once per input signature (names, shapes, dtype, device) and then
replayed: the inputs are copied into the graph's static buffers, the recorded kernels run
back to back, and the outputs are cloned out of the graph's memory, so every call returns
fresh tensors as the eager routine does (or copied into the caller's ``out`` array).

Calls whose tensors are not all on one CUDA device run eagerly (on the CPU a graph has
nothing to offer). A routine that cannot be captured (an operation that synchronises with
the host) also runs eagerly, after one warning that names it.
"""
from __future__ import annotations

import torch

from .replay import Replayed


class _Capture:
    """One captured graph: its static inputs and outputs."""

    __slots__ = ("graph", "inputs", "outputs")

    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


def _clone(out):
    """Fresh tensors with the structure of a routine's output (tuples, lists, dicts)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o) for o in out)
    if isinstance(out, dict):
        return {k: _clone(v) for k, v in out.items()}
    return out


def _cuda_device(kwargs):
    """The one CUDA device all tensor arguments are on, else None (run eagerly)."""
    devices = {v.device for v in kwargs.values() if isinstance(v, torch.Tensor)}
    if len(devices) != 1:
        return None
    (dev,) = devices
    if dev.type != "cuda" or not all(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    return dev


def capture(fn, device, warmup=2):
    """(graph, output) of one CUDA-graph capture of the zero-argument ``fn`` on ``device``:
    ``warmup`` eager calls on a side stream first (cuBLAS sets up its workspaces there, as
    capture requires). Raises what the capture raises (an operation that synchronises
    with the host, say), after waiting for the device."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = fn()
        except Exception:
            torch.cuda.synchronize(device)
            raise
    return graph, out


class GraphedFunction(Replayed):
    """A generated routine replayed from CUDA graphs, one graph per input signature.

    Each capture is made by ``capture`` on copies of the call's inputs. The static buffers
    of a graph are shared by its calls, so a lock lets one call at a time copy in, replay
    and copy out.
    """

    mode = "CUDA graphs"
    cannot = "cannot be captured in a CUDA graph"

    def __init__(self, fn, name=None, warmup=2):
        super().__init__(fn, name)
        self.warmup = warmup

    @property
    def captured(self) -> int:
        """How many graphs (input signatures) this routine holds."""
        return len(self._recorded)

    def __call__(self, out=None, **kwargs):
        dev = None if self._eager else _cuda_device(kwargs)
        if dev is None:
            return self._eager_call(out, kwargs)
        sig = tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in sorted(kwargs.items()))
        with self._lock:
            cap = self._recorded.get(sig)
            if cap is None:
                cap = self._capture(dev, kwargs)
                if cap is None:
                    return self._eager_call(out, kwargs)
                self._recorded[sig] = cap
            for k, buf in cap.inputs.items():
                buf.copy_(kwargs[k])
            cap.graph.replay()
            if out is not None:          # a caller's array (Kernel.hessian(..., out=)): filled
                return out.copy_(cap.outputs)
            return _clone(cap.outputs)

    def _capture(self, dev, kwargs):
        static = {k: v.detach().clone() for k, v in kwargs.items()}
        try:
            graph, out = capture(lambda: self.fn(**static), dev, self.warmup)
        except Exception as e:          # an operation that cannot be captured
            self._give_up(f"{type(e).__name__}: {e}", 4)     # _capture, __call__, caller
            return None
        return _Capture(graph, static, out)

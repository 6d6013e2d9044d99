"""Cost of the default scaling sweep (paper config), measured on a subset and extrapolated.

    python benchmarks/bench_experiments.py [--d-model 128 --d-mlp 512 --batch 64 --cols 32]

Both routes compute exact columns H e_i of the W_Q / W_V blocks of the batch-mean loss:
  * symhess: the engine's matrix-view block HVP, vmapped over batch and directions;
  * autograd: torch.func.jvp(grad(loss)) of an independent torch forward, vmapped the same way.
A full sweep needs numel(W_Q) + numel(W_V) columns per (σ, seed), 20 σ × 3 seeds.
"""
import argparse
import math
import sys
import time

import torch

sys.path.insert(0, ".")
from symhess.experiments import Config, Experiment  # noqa: E402


def forward(v, x_o):
    X = x_o @ v["W_E"] + v["P"]
    T = X @ v["W_Q"] @ v["W_K"].T @ X.T / math.sqrt(v["W_Q"].shape[1])
    L = T.shape[0]
    A = torch.softmax(T.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), -math.inf), 1)
    X1 = X + A @ X @ v["W_V"] @ v["W_O"]
    return (X1 + torch.relu(X1 @ v["W_1"]) @ v["W_2"]) @ v["W_U"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-mlp", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cols", type=int, default=32)
    a = ap.parse_args()
    cfg = Config(d_model=a.d_model, d_head=a.d_model, d_mlp=a.d_mlp, batch=a.batch, chunk=a.cols)
    exp = Experiment(cfg)
    vals, O, Y, env = exp.tensors(0.1, 0)
    n = {p: vals[p].numel() for p in ("W_Q", "W_V")}
    print(f"d_model=d_head={a.d_model}, d_mlp={a.d_mlp}, batch={a.batch}, torch threads {torch.get_num_threads()}")
    total = {"symhess": 0.0, "autograd": 0.0}
    for p in ("W_Q", "W_V"):
        r, c = vals[p].shape
        dirs = torch.eye(r * c, dtype=torch.float64)[: a.cols].reshape(a.cols, r, c)
        parts = [q for q in ("outer", "functional") if not exp.columns_for(p, q).is_zero]
        exp.columns_for(p, parts[0]).columns(vals, O, Y, dirs[:2], env)        # warm-up
        t = time.perf_counter()
        for q in parts:
            exp.columns_for(p, q).columns(vals, O, Y, dirs, env)
        ts = (time.perf_counter() - t) / a.cols

        def loss_w(w, o, y):
            z = forward(dict(vals, **{p: w}), o)
            return -(y * torch.log_softmax(z, 1)).sum() / 6

        def hvp(v, o, y):
            return torch.func.jvp(lambda w: torch.func.grad(loss_w)(w, o, y), (vals[p],), (v,))[1]
        f = torch.func.vmap(torch.func.vmap(hvp, in_dims=(0, None, None)), in_dims=(None, 0, 0))
        f(dirs[:2], O, Y)
        t = time.perf_counter()
        f(dirs, O, Y).mean(0)
        ta = (time.perf_counter() - t) / a.cols
        # the autograd route needs the full H and H_o (GGN) columns; count 2 HVP kinds for it
        ta *= 2 if p == "W_Q" else 1
        total["symhess"] += ts * n[p]
        total["autograd"] += ta * n[p]
        print(f"{p}: per column  symhess {ts * 1e3:8.2f} ms ({', '.join(parts)})   autograd {ta * 1e3:8.2f} ms")
    for k, v in total.items():
        print(f"{k:>8}: per (σ, seed) {v:9.1f} s   default sweep (60) {v * 60 / 3600:7.2f} h")
    print(f"ratio autograd / symhess: {total['autograd'] / total['symhess']:.2f}")


if __name__ == "__main__":
    main()

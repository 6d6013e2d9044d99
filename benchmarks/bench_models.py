"""Whole language models: capture, derivation and products of a GPT-2 language model with
its own loss, by depth, against torch.func on the model itself.

    python -m benchmarks.bench_models [--layers 1,2,3] [--L 8] [--batch 4] [--d 16]
                                      [--heads 2] [--vocab 13] [--rounds 5] [--block-layer N]

For each depth a fresh process builds ``GPT2LMHeadModel`` from a config (n_embd d, n_head
heads, d_ff = 4d, vocabulary V, n_positions 16, no dropout, float64, eval mode, SDPA
attention) and measures

* capture: ``from_module(model, (), {input_ids, labels=input_ids, use_cache=False})`` —
  torch.export, the translation and the check of the logits and loss against the model's;
* hvp routines: deriving the Hessian–vector products of the model's loss (``ce_weighted`` on the
  logits) for the three parts and rendering them (the kernel's first use, fresh cache);
* hvp: one product of every declared parameter (full part, prepared state) against
  ``torch.func.jvp(grad(loss))`` of the model's own loss (``functional_call``), side by side,
  interleaved rounds, minimum; and their relative difference;
* block: the first use of one derived block, H(W_Q head 1 of the last Transformer block
  (or of block ``--block-layer``), itself) and against the tied embedding W_E (derivation, lowering, rendering and
  evaluation);
* columns (``--columns K``): K unit columns of the whole Hessian in one ``matmat`` of the
  operator (the columns vectorised, ``torch.func.vmap`` over chunks) against
  ``torch.func.vmap`` of ``jvp(grad(loss))`` over the same K tangents, and both against K
  single products (``--skip-blocks`` leaves out the block timings);
* peak RSS of the process (``resource.getrusage``: interpreter and imports included).

Threads are pinned to 1.  transformers' float32 loss step is neutralised in the reference
(``no_downcasts``) so both sides compute the same float64 mathematics.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def build(n_layer, d, heads, vocab, L, B, seed=0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_embd=d, n_head=heads, n_layer=n_layer, n_inner=4 * d, vocab_size=vocab,
                     n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).double().eval()
    ids = torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(seed))
    return model, ids


def _note(what):
    print(f"[bench_models] {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def child(opts):
    os.environ["SYMHESS_CACHE_DIR"] = tempfile.mkdtemp(prefix="symhess-bench-models-")
    import torch
    from torch.func import functional_call, grad, jvp
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import symhess as sh
    from symhess.layers.modules import no_downcasts
    from benchmarks.timing import interleaved
    torch.set_num_threads(1)
    row = {"layers": opts["layers"]}
    model, ids = build(opts["layers"], opts["d"], opts["heads"], opts["vocab"], opts["L"], opts["batch"])
    t = time.perf_counter()
    ml = sh.from_module(model, (), {"input_ids": ids, "labels": ids, "use_cache": False})
    row["capture"] = time.perf_counter() - t
    _note("capture done")
    row["params"] = len(ml.layer.params)
    row["entries"] = len(ml.index)
    t = time.perf_counter()
    k = sh.kernel(ml.layer, "torch", ml.loss)
    st = k.prepare(ml.values(ids))
    v = torch.randn(len(ml.index), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for part in ("outer", "functional", "full"):
        st.hvp(v, part)
    row["hvp_routines"] = time.perf_counter() - t
    _note("hvp_routines done")

    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    vm = torch.zeros_like(theta)
    vm[ml.index] = v

    def loss(th):
        ps, o = {}, 0
        for n, s in zip(names, shapes):
            c = s.numel()
            ps[n] = th[o:o + c].reshape(s)
            o += c
        with no_downcasts(), sdpa_kernel(SDPBackend.MATH):
            return functional_call(model, ps, (), {"input_ids": ids, "labels": ids,
                                                   "use_cache": False}).loss

    ref = lambda: jvp(grad(loss), (theta,), (vm,))[1]  # noqa: E731
    mine = lambda: st.hvp(v, "full")  # noqa: E731
    want = ref()[ml.index]
    row["hvp_error"] = float((mine() - want).norm() / want.norm())
    times = interleaved({"symhess": mine, "torch.func": ref}, rounds=opts["rounds"])
    row["hvp"], row["hvp_ref"] = times["symhess"], times["torch.func"]
    _note("hvp done")
    if opts.get("columns"):
        K = min(opts["columns"], len(ml.index))
        op = sh.operator(k, ml.batches([ids]), p=list(ml.layer.param_names), params=ml.params())
        E = torch.zeros(len(ml.index), K, dtype=torch.float64)
        E[torch.arange(K), torch.arange(K)] = 1.0
        T = torch.zeros(K, theta.numel(), dtype=torch.float64)
        T[torch.arange(K), ml.index[:K]] = 1.0
        cols_ref = lambda: torch.func.vmap(lambda t: jvp(grad(loss), (theta,), (t,))[1])(T)  # noqa: E731
        cols = lambda: op.matmat(E)  # noqa: E731
        want = cols_ref()[:, ml.index].T
        row["columns_error"] = float((cols() - want).norm() / want.norm())
        times = interleaved({"symhess": cols, "torch.func": cols_ref,
                             "single": lambda: [st.hvp(E[:, j], "full") for j in range(16)]},
                            rounds=max(1, opts["rounds"] // 2))
        row["columns"], row["columns_ref"] = K, times["torch.func"]
        row["columns_time"], row["single_col"] = times["symhess"], times["single"] / 16
        _note("columns done")
    if opts.get("skip_blocks"):
        row["block_qq"] = row["block_qe"] = float("nan")
        row["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        print(json.dumps(row))
        return
    at = opts["layers"] - 1 if opts.get("block_layer") is None else opts["block_layer"]
    p = f"transformer_h_{at}_attn_c_attn_weight_1"
    t = time.perf_counter()
    st.hessian_block(p, p, "full")
    row["block_qq"] = time.perf_counter() - t
    _note("block_qq done")
    t = time.perf_counter()
    st.hessian_block(p, "transformer_wte_weight", "full")
    row["block_qe"] = time.perf_counter() - t
    _note("block_qe done")
    row["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(json.dumps(row))


def run(opts):
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_models", "--child",
                          json.dumps(opts)], stdout=subprocess.PIPE, text=True)
    if out.returncode:
        raise SystemExit(f"depth {opts['layers']}: the child failed (its error above)")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["wall"] = time.perf_counter() - t
    return row


def main(argv):
    if argv[:1] == ["--child"]:
        child(json.loads(argv[1]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="1,2,3")
    ap.add_argument("--L", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=13)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-layer", type=int, default=None,
                    help="the Transformer block whose W_Q head 1 the block timings use (default: the last)")
    ap.add_argument("--columns", type=int, default=0, help="also time K unit columns (matmat)")
    ap.add_argument("--skip-blocks", action="store_true", help="leave out the derived-block timings")
    a = ap.parse_args(argv)
    print(f"{'layers':>6}{'params':>8}{'entries':>9}{'capture':>9}{'hvp routines':>14}"
          f"{'hvp':>10}{'torch.func':>12}{'ratio':>7}{'rel. diff':>11}{'block Q,Q':>11}"
          f"{'block Q,W_E':>13}{'peak RSS':>10}{'process':>9}")
    for n in [int(s) for s in a.layers.split(",")]:
        r = run({"layers": n, "L": a.L, "batch": a.batch, "d": a.d, "heads": a.heads,
                 "vocab": a.vocab, "rounds": a.rounds, "block_layer": a.block_layer,
                 "columns": a.columns, "skip_blocks": a.skip_blocks})
        print(f"{n:>6}{r['params']:>8}{r['entries']:>9}{r['capture']:>8.1f}s{r['hvp_routines']:>13.1f}s"
              f"{r['hvp'] * 1e3:>8.1f}ms{r['hvp_ref'] * 1e3:>10.1f}ms{r['hvp_ref'] / r['hvp']:>7.2f}"
              f"{r['hvp_error']:>11.1e}{r['block_qq']:>10.1f}s{r['block_qe']:>12.1f}s"
              f"{r['peak_gb']:>8.2f}GB{r['wall']:>8.1f}s", flush=True)
        if "columns" in r:
            c = r["columns"]
            print(f"{'':>6} {c} columns: symhess matmat {r['columns_time']:.3f} s "
                  f"({r['columns_time'] / c * 1e3:.2f} ms each), torch.func vmap(jvp(grad)) "
                  f"{r['columns_ref']:.3f} s, ratio {r['columns_ref'] / r['columns_time']:.2f}; "
                  f"single products {r['single_col'] * 1e3:.1f} ms each "
                  f"({r['single_col'] * c / r['columns_time']:.1f}x slower); rel. diff "
                  f"{r['columns_error']:.1e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

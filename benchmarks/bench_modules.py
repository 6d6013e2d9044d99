"""Captured torch modules: capture, derive and render times, and exact curvature against
torch.func on the module itself.

    python -m benchmarks.bench_modules [MODULE ...] [--L 128] [--d 128] [--batch 4] [--heads 4]
                                       [--what setup,blocks,hvp,profile,diag] [--rounds 3]
                                       [--probes 100] [--probes-run K] [--diag-budget S]
                                       [--diag-skip NAME,...] [--no-retain]

MODULE ∈ mha (nn.MultiheadAttention), encoder (nn.TransformerEncoderLayer, pre-LN, GELU),
gpt2 (GPT2Block), bert (BertLayer), llama (LlamaDecoderLayer, grouped-query attention with
heads/2 key-value heads, rotary embeddings, RMSNorm, SwiGLU); d_ff = 4d; causal masks for
gpt2 and llama; float64, eval mode, eager attention for transformers' blocks.

* setup: ``from_module`` (torch.export capture, translation, the forward check), then the
  kernels' first use in a fresh cache: derivation and rendering of the routines (a variant
  of more than 8 declared parameters renders its blocks on first use, ``symhess.codegen.render``);
  with ``blocks`` also the rendering of every block at once (``all_blocks``, what
  ``hessian()`` needs; a smaller variant rendered everything with its routines);
* hvp: a stateless ``Kernel.hvp`` against ``torch.func.jvp(grad(loss))`` of the module
  (``functional_call`` over its parameters, MSE of its output), relative error of the two;
  also a prepared state's later calls (forward quantities and products of named factors
  kept, as in Lanczos or CG);
* profile: one stateless hvp and one ``jvp(grad)`` counted: the flops symhess planned
  (``symhess.runtime.cost``) and those ``torch.utils.flop_counter`` counts for ``jvp(grad)``,
  and the ATen calls of each side (matrix products: ``mm``, ``bmm``, ``addmm(_)``,
  ``baddbmm(_)``; element-wise: the arithmetic and entrywise functions; views not counted);
* diag: the exact diagonals of every declared parameter (but ``--diag-skip``) in one pass,
  ``Forward.diagonals`` of a fresh prepared state, its parts rendered beforehand and timed
  apart (rendering stops once ``--diag-budget`` seconds are spent, and then so does the
  measurement), against a 100-probe Hutchinson estimate by the same jvp(grad) (with
  ``--probes-run K``: K probes timed and the time scaled to 100; each probe is one
  jvp(grad) and a product, so the time is linear in the probes); peak resident memory
  added by the exact pass.

Both sides run in one process, threads pinned to 1, interleaved rounds, minimum
(``benchmarks.timing``), freed memory kept for reuse (``--no-retain``: glibc's default).
Llama's float32 steps are neutralised in the reference
(``symhess.layers.modules.no_downcasts``) so that both compute the same float64 mathematics.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch.func import functional_call, grad, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import symhess as sh
from symhess.layers.modules import no_downcasts
from symhess.runtime.cost import counting

from .timing import add_memory_option, apply_memory_option, interleaved, peak_mb, timed

MODULES = ("mha", "encoder", "gpt2", "bert", "llama")


def build(name, L, d, heads, B, seed=0):
    """(module, example args, kwargs) in float64, eval mode."""
    torch.manual_seed(seed)
    x = torch.randn(B, L, d, dtype=torch.float64)
    causal = torch.triu(torch.full((L, L), torch.finfo(torch.float64).min, dtype=torch.float64), 1)
    causal = causal[None, None].expand(B, 1, L, L)
    if name == "mha":
        m = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        return m.double().eval(), (x, x, x), {"need_weights": False}
    if name == "encoder":
        m = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=True)
        return m.double().eval(), (x,), {}
    if name == "gpt2":
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        cfg = GPT2Config(n_embd=d, n_head=heads, n_inner=4 * d, n_layer=1, n_positions=max(L, 8),
                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        cfg._attn_implementation = "eager"
        return GPT2Block(cfg).double().eval(), (x,), {"attention_mask": causal}
    if name == "bert":
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertLayer
        cfg = BertConfig(hidden_size=d, num_attention_heads=heads, intermediate_size=4 * d,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        cfg._attn_implementation = "eager"
        return BertLayer(cfg).double().eval(), (x,), {}
    if name == "llama":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
        cfg = LlamaConfig(hidden_size=d, num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1),
                          intermediate_size=4 * d, max_position_embeddings=max(L, 8))
        cfg._attn_implementation = "eager"
        rot = LlamaRotaryEmbedding(cfg).double()
        cos, sin = rot(x, torch.arange(L)[None].expand(B, L))
        return (LlamaDecoderLayer(cfg, 0).double().eval(), (x,),
                {"position_embeddings": (cos, sin), "attention_mask": causal})
    raise SystemExit(f"unknown module {name!r}; valid: {', '.join(MODULES)}")


class Reference:
    """The module's MSE loss over its parameters, and torch.func products of it."""

    def __init__(self, ml, x, y):
        self.m, self.ml, self.y = ml.module, ml, y
        self.names = [n for n, _ in self.m.named_parameters()]
        self.params = tuple(p.detach() for _, p in self.m.named_parameters())
        self.args, self.kwargs = ml.call_args(x)
        self.grad = grad(self.loss)

    def loss(self, params):
        with no_downcasts(), sdpa_kernel(SDPBackend.MATH):
            out = functional_call(self.m, dict(zip(self.names, params)), self.args, self.kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return ((out - self.y) ** 2).mean()

    def hvp(self, v):
        return jvp(self.grad, (self.params,), (v,))[1]


def _module_vector(ml, v_decl):
    """A declared-order vector as the module's parameter tuple (entries no piece covers: 0)."""
    per = ml.to_parameters(v_decl)
    return tuple(per[n] for n, _ in ml.module.named_parameters())


def run(name, args):
    m, xargs, kwargs = build(name, args.L, args.d, args.heads, args.batch)
    x = xargs[0]
    y = torch.randn(ml_shape(m, xargs, kwargs), dtype=torch.float64)
    t = time.perf_counter()
    ml = sh.from_module(m, xargs, kwargs)
    t_capture = time.perf_counter() - t
    k = sh.kernel(ml.layer, "torch", "mse")
    values = ml.values((x, y))
    P = len(ml.layer.params)
    print(f"{name}: {type(m).__name__}, {P} declared parameters, L = {args.L}, d = {args.d}, "
          f"heads = {args.heads}, B = {args.batch}")
    what = args.what.split(",")
    if "setup" in what:
        t = time.perf_counter()
        st = k.prepare(values)
        t_render = time.perf_counter() - t
        line = f"  capture + check {t_capture:.1f} s, derive + render routines {t_render:.1f} s"
        if "blocks" in what:
            t = time.perf_counter()
            st.all_blocks()
            line += f", render every block {time.perf_counter() - t:.1f} s"
        print(line)
    ref = Reference(ml, x, y)
    vals = ml.params()
    n = sum(vals[p].numel() for p in ml.layer.param_names)
    v = torch.randn(n, dtype=torch.float64)
    vm = _module_vector(ml, v)
    if "hvp" in what:
        ours = k.hvp(values, v)
        theirs = torch.cat([t.reshape(-1) for t in ref.hvp(vm)])
        mine = torch.zeros(ml.module_numel, dtype=torch.float64)
        mine[torch.as_tensor(ml.index)] = ours
        err = float((mine - theirs).norm() / theirs.norm())
        prepared = k.prepare(values)
        tm = interleaved({"symhess hvp": lambda: k.hvp(values, v), "jvp(grad)": lambda: ref.hvp(vm),
                          "prepared": lambda: prepared.hvp(v)}, rounds=args.rounds)
        print(f"  hvp {tm['symhess hvp']:.3f} s vs jvp(grad) {tm['jvp(grad)']:.3f} s → "
              f"{tm['jvp(grad)'] / tm['symhess hvp']:.2f}×  (rel. error {err:.1e}); a prepared "
              f"state's later calls {tm['prepared']:.3f} s → {tm['jvp(grad)'] / tm['prepared']:.2f}×")
    if "profile" in what:
        profile(k, values, v, ref, vm)
    if "diag" in what:
        diag(ml, k, values, ref, args)


_PRODUCTS = {"mm", "bmm", "addmm", "addmm_", "baddbmm", "baddbmm_"}
_ENTRYWISE = {"mul", "mul_", "add", "add_", "sub", "sub_", "div", "div_", "addcmul", "addcmul_",
              "rsub", "neg", "pow", "tanh", "exp", "erf", "sigmoid", "sqrt", "rsqrt", "square",
              "where", "masked_fill", "clone", "copy_"}


class _Calls(TorchDispatchMode):
    """The number of matrix products and element-wise operations dispatched."""

    def __init__(self):
        super().__init__()
        self.products = self.entrywise = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.products += name in _PRODUCTS
        self.entrywise += name in _ENTRYWISE
        return func(*args, **(kwargs or {}))


def profile(k, values, v, ref, vm):
    """Planned and counted flops, and the calls of each side, for one stateless hvp."""
    with counting() as planned:
        k.hvp(values, v)
    with FlopCounterMode(display=False) as counted:
        ref.hvp(vm)
    ours, theirs = _Calls(), _Calls()
    with ours:
        k.hvp(values, v)
    with theirs:
        ref.hvp(vm)
    print(f"  profile: planned flops {planned.flops:.2g} (symhess), counted {counted.get_total_flops():.2g} "
          f"(jvp(grad)); matrix products {ours.products} / {theirs.products}, element-wise "
          f"{ours.entrywise} / {theirs.entrywise} (symhess / jvp(grad))")


def diag(ml, k, values, ref, args):
    """Exact diagonals of the declared parameters in one pass (parts rendered first, timed
    apart; rendering stops after ``--diag-budget`` seconds) against the Hutchinson estimate
    of all of them."""
    skip = set(filter(None, args.diag_skip.split(",")))
    names = [p for p in ml.layer.param_names if p not in skip]
    t = time.perf_counter()
    st = k.prepare(values)
    done_render = []
    for p in names:
        st.nets(p, p)                                       # render the parts beforehand
        done_render.append(p)
        if time.perf_counter() - t > args.diag_budget:
            break
    t_render = time.perf_counter() - t
    print(f"  render the diagonal blocks' parts {t_render:.1f} s ({len(done_render)} of {len(names)})")
    if len(done_render) < len(names):
        print("  rendering exceeded --diag-budget: no exact pass")
        return
    del st
    s = k.prepare(values)
    (_, exact), peak = peak_mb(lambda: timed(lambda: s.diagonals(params=names)))
    del s
    g = torch.Generator().manual_seed(0)
    run_k = min(args.probes_run or args.probes, args.probes)
    probes = [tuple(torch.randint(0, 2, p.shape, generator=g, dtype=torch.float64) * 2 - 1
                    for p in ref.params) for _ in range(run_k)]

    def hutchinson():
        acc = [torch.zeros_like(p) for p in ref.params]
        for z in probes:
            hz = ref.hvp(z)
            for a, zi, hi in zip(acc, z, hz):
                a += zi * hi
        return [a / len(probes) for a in acc]

    ref.hvp(probes[0])                                      # warm
    t = time.perf_counter()
    hutchinson()
    hutch = (time.perf_counter() - t) * args.probes / run_k
    scaled = "" if run_k == args.probes else f" ({run_k} probes timed, × {args.probes / run_k:g})"
    print(f"  diagonals of {len(names)} of {len(ml.layer.param_names)} parameters, one pass: "
          f"{exact:.2f} s (peak RSS +{peak:.0f} MB) vs {args.probes}-probe Hutchinson of all "
          f"{hutch:.2f} s{scaled} → {hutch / exact:.2f}×")
    if skip:
        print(f"  skipped: {', '.join(sorted(skip))}")


def ml_shape(m, xargs, kwargs):
    with torch.no_grad(), no_downcasts():
        out = m(*xargs, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return tuple(out.shape)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", default=list(MODULES))
    ap.add_argument("--L", type=int, default=128)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--what", default="setup,blocks,hvp,diag")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probes", type=int, default=100)
    ap.add_argument("--diag-budget", type=float, default=600,
                    help="seconds after which the exact diagonals stop (rendering, then computing)")
    ap.add_argument("--diag-skip", default="",
                    help="declared parameters whose exact diagonal is left out (comma-separated)")
    ap.add_argument("--probes-run", type=int, default=0,
                    help="time this many Hutchinson probes and scale to --probes (each probe is "
                         "one jvp(grad); 0: run them all)")
    add_memory_option(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(apply_memory_option(args))
    os.environ.setdefault("SYMHESS_CACHE_DIR", tempfile.mkdtemp(prefix="symhess-bench-"))
    for name in args.modules:
        run(name, args)


if __name__ == "__main__":
    main()

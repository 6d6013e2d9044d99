"""A block captured on its own, evaluated on the hidden states its model feeds it
(``symhess.submodule_call``, ``ModuleLayer.batches_from``): the dataset's loss and
Hessian–vector products (full and Gauss–Newton) against autograd of the block's loss on the
same inputs, collected here by a hook of the test's own and differentiated through
``functional_call`` (float64, ≤ 1e-10, the block's float32 steps neutralised by
``no_downcasts``); calls that differ from the captured one are accepted when the block
computes the same on them and refused otherwise.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call, jvp, vjp
from torch.nn.attention import SDPBackend, sdpa_kernel

import symhess as sh
from symhess.curvature.dataset import Dataset
from symhess.errors import InputError
from symhess.layers.modules import no_downcasts
from flat_params import double_backward_hvp, unflat

transformers = pytest.importorskip("transformers")

TOL = 1e-10
L, D, V = 5, 8, 11


pytestmark = pytest.mark.usefixtures("one_thread")


def gpt2():
    cfg = transformers.GPT2Config(n_embd=D, n_head=2, n_layer=2, n_inner=12, vocab_size=V,
                                  n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def llama():
    cfg = transformers.LlamaConfig(hidden_size=D, num_attention_heads=2, num_key_value_heads=1,
                                   num_hidden_layers=2, intermediate_size=12, vocab_size=V,
                                   max_position_embeddings=32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def ids(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n, L), generator=g) for n in sizes]


def no_cache(model, b):
    return model(input_ids=b, use_cache=False)


def shifted(out, batch):
    """A target unlike the block's output (the residual, and so the functional part, ≠ 0)."""
    return 0.5 * out.flip(-1)


# ----------------------------------------------------------------------------- the reference
def hooked_calls(model, block, batches, run):
    """The block's (args, kwargs) on every batch, read by a hook of the test's own over the
    model's whole forward."""
    calls = []
    handle = block.register_forward_pre_hook(lambda m, a, k: calls.append((a, dict(k))), with_kwargs=True)
    try:
        with torch.no_grad():
            for b in batches:
                run(model, b)
    finally:
        handle.remove()
    return calls


class Reference:
    """Autograd of the block's mse loss over the hooked calls, (1/N) Σ_sequences ‖F − Y‖²/(L d),
    as a function of the block's flat parameters (``parameters()`` order)."""

    def __init__(self, block, calls, targets):
        self.block, self.calls = block, calls
        self.names = [n for n, _ in block.named_parameters()]
        self.shapes = [p.shape for _, p in block.named_parameters()]
        self.theta = torch.cat([p.detach().reshape(-1) for p in block.parameters()])
        self.Y = [targets(self.out(self.theta, c).detach(), None) for c in calls]
        self.N = sum(c[0][0].shape[0] for c in calls)

    def out(self, th, call):
        ps = unflat(th, self.names, self.shapes)
        with no_downcasts(), sdpa_kernel(SDPBackend.MATH):
            out = functional_call(self.block, ps, call[0], call[1])
        return out[0] if isinstance(out, tuple) else out

    @staticmethod
    def mse(F, Y):
        return ((F - Y) ** 2).sum() / (F.shape[-2] * F.shape[-1])

    def loss(self, th):
        return sum(self.mse(self.out(th, c), y) for c, y in zip(self.calls, self.Y)) / self.N

    def hvp(self, v, part):
        full = double_backward_hvp(self.loss, self.theta, v)
        if part == "full":
            return full
        outer = torch.zeros_like(full)
        for c, y in zip(self.calls, self.Y):
            F, Jv = jvp(lambda t: self.out(t, c), (self.theta,), (v,))
            _, HJv = jvp(lambda f: torch.func.grad(lambda u: self.mse(u, y) / self.N)(f),
                         (F.detach(),), (Jv,))
            outer += vjp(lambda t: self.out(t, c), self.theta)[1](HJv)[0]
        return outer


def close(got, want):
    return np.linalg.norm(np.asarray(got) - np.asarray(want)) <= TOL * max(np.linalg.norm(want), 1e-300)


def check_against_autograd(ml, model, batches, run, targets):
    """The dataset's loss and hvp (full, outer) of ``ml.batches_from`` against the reference."""
    data = ml.batches_from(model, batches, targets=targets,
                           call=None if run is None else run)
    ref = Reference(ml.module, hooked_calls(model, ml.module, batches,
                                            run or (lambda m, b: m(**b))),
                    (lambda out, b: out) if targets == "output" else targets)
    k = sh.kernel(ml.layer, "torch", "mse")
    with torch.no_grad():
        want_loss = float(ref.loss(ref.theta))
    assert abs(float(Dataset(k, data, params=ml.params()).loss()) - want_loss) <= TOL * max(want_loss, 1e-12)
    g = torch.Generator().manual_seed(3)
    v = torch.randn(len(ml.index), generator=g, dtype=torch.float64)
    vm = torch.zeros(ref.theta.numel(), dtype=torch.float64)
    vm[ml.index] = v
    got = {}
    for part in ("full", "outer"):
        want = ref.hvp(vm, part).numpy()[ml.index]
        got[part] = sh.operator(k, data, part=part, params=ml.params()) @ v.numpy()
        assert close(got[part], want), part
    return want_loss, got


# ----------------------------------------------------------------------------- the tests
def test_gpt2_block_on_its_models_hidden_states():
    """Block 1 of a GPT-2 language model, on the hidden states block 0 gives it (batches as the
    model's keyword dicts, of 2 and 3 sequences): the mse loss against a target unlike the
    output, and against the block's own output (loss 0, Hessian = its Gauss–Newton part)."""
    model = gpt2()
    block = model.transformer.h[1]
    batches = [{"input_ids": t, "use_cache": False} for t in ids((2, 3), seed=0)]
    args, kwargs = sh.submodule_call(model, block, batches[0])
    assert args[0].shape == (2, L, D) and "position_ids" in kwargs
    ml = sh.from_module(block, args, kwargs)
    loss, got = check_against_autograd(ml, model, batches, None, shifted)
    assert loss > 1e-3 and not close(got["full"], got["outer"])     # the functional part counts
    loss, got = check_against_autograd(ml, model, batches, None, "output")
    assert loss <= 1e-25 and close(got["full"], got["outer"])


def test_llama_layer_with_rotary_constants_and_masks():
    """A Llama decoder layer (rotary cos/sin and its mask passed by the model, GQA, float32
    casts) from a DataLoader of batches of 2, 2 and 1 sequences: the model's mask for a batch of
    another size is another tensor, accepted because the layer computes the same with it."""
    from torch.utils.data import DataLoader
    model = llama()
    block = model.model.layers[1]
    loader = DataLoader(torch.cat(ids((5,), seed=1)), batch_size=2)
    ml = sh.from_module(block, *sh.submodule_call(model, block, next(iter(loader)), no_cache))
    assert {"position_embeddings", "attention_mask"} <= set(ml.kwargs) and ml.capture.consts
    check_against_autograd(ml, model, loader, no_cache, shifted)


def test_calls_unlike_the_captured_one_are_refused():
    """Constants that differ from the captured ones (rotary tables of other relative positions,
    a padding mask), a cache object, one-shot data, a block outside the model and bad targets:
    one InputError line each."""
    model = llama()
    block = model.model.layers[1]
    batches = ids((2, 2), seed=2)
    ml = sh.from_module(block, *sh.submodule_call(model, block, batches[0], no_cache))
    k = sh.kernel(ml.layer, "torch", "mse")

    def run(**extra):
        return lambda m, b: m(input_ids=b, use_cache=False, **extra)

    # positions shifted by a constant: the rotary tables differ, attention does not (relative)
    same = ml.batches_from(model, batches, call=run(position_ids=torch.arange(3, 3 + L)[None]))
    assert [b["X"].shape[0] for b in same] == [2, 2]
    wrong = [run(position_ids=(2 * torch.arange(L))[None]),
             run(attention_mask=torch.tensor([[1] * (L - 1) + [0]] * 2))]
    for call, what in zip(wrong, ["position_embeddings", "attention_mask"]):
        with pytest.raises(InputError, match=rf"the model calls model\.layers\.1 with .*{what}.* "
                                             r"unlike the captured call's, and the block's output "
                                             r"differs from the declaration's"):
            sh.operator(k, ml.batches_from(model, batches, call=call), params=ml.params()).matvec(
                np.ones(len(ml.index)))
    with pytest.raises(InputError, match="with cache = DynamicCache where the capture had None"):
        list(ml.batches_from(model, batches))
    with pytest.raises(InputError, match="one-shot list_iterator"):
        ml.batches_from(model, iter(batches))
    with pytest.raises(InputError, match="not one batch"):
        ml.batches_from(model, batches[0])
    with pytest.raises(InputError, match="is not a submodule of the LlamaModel"):
        ml.batches_from(llama().model, batches, call=no_cache)      # another model's
    with pytest.raises(InputError, match="targets must be one of output"):
        ml.batches_from(model, batches, targets="labels")
    with pytest.raises(InputError, match="never called model.layers.1"):
        sh.submodule_call(model, block, batches[0], call=lambda m, b: m.model.embed_tokens(b))

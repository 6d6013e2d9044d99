"""Whole language models captured on token ids with their own loss (GPT2LMHeadModel built from
a config): the declaration's logits and loss, its gradient, every parameter block's Hessian
(outer, functional, full), diagonals and traces against autograd of the model's own loss
(``model(input_ids=ids, labels=ids)`` differentiated through ``functional_call`` over its
parameters, float64, the float32 step of transformers' loss neutralised by ``no_downcasts``);
token-id batches and their refusals.

Every block (p, q) is checked through the kernel's exact Hessian–vector product with a random
vector supported on q: the product's p-slice is H(p, q) v_q, compared with autograd's
(double backward for the full Hessian, Jᵀ H_ℓ J v by jvp/vjp for the Gauss–Newton part).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call, jvp, vjp
from torch.nn.attention import SDPBackend, sdpa_kernel

import symhess as sh
from symhess.errors import DeclarationError, InputError
from symhess.layers.modules import no_downcasts
from flat_params import double_backward_hvp, hessian_rows, unflat

transformers = pytest.importorskip("transformers")

TOL = 1e-10
B, L, V, D, HEADS, DFF = 2, 5, 7, 8, 2, 12


pytestmark = pytest.mark.usefixtures("one_thread")


def gpt2(n_layer=1, vocab=V, d=D, heads=HEADS, d_ff=DFF, seed=0, impl="sdpa", tie=True):
    cfg = transformers.GPT2Config(n_embd=d, n_head=heads, n_layer=n_layer, n_inner=d_ff,
                                  vocab_size=vocab, n_positions=16, attn_pdrop=0.0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, tie_word_embeddings=tie)
    cfg._attn_implementation = impl
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def token_ids(shape=(B, L), vocab=V, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def capture(model, ids):
    return sh.from_module(model, (), {"input_ids": ids, "labels": ids, "use_cache": False})


# ----------------------------------------------------------------------------- the reference
class Reference:
    """Autograd of the model's own loss over its flat parameters (``parameters()`` order)."""

    def __init__(self, model, ids, labels=None, attention_mask=None):
        self.model, self.ids = model, ids
        self.labels = ids if labels is None else labels
        self.extra = {} if attention_mask is None else {"attention_mask": attention_mask}
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def _params(self, th):
        return unflat(th, self.names, self.shapes)

    def out(self, th):
        with no_downcasts(), sdpa_kernel(SDPBackend.MATH):
            return functional_call(self.model, self._params(th), (),
                                   {"input_ids": self.ids, "labels": self.labels, "use_cache": False,
                                    **self.extra})

    def loss(self, th):
        return self.out(th).loss

    def gradient(self):
        th = self.theta.clone().requires_grad_(True)
        return torch.autograd.grad(self.loss(th), th)[0]

    def hvp(self, v, part):
        """H v (full: double backward; outer: Jᵀ H_ℓ J v with J = ∂logits/∂θ)."""
        full = double_backward_hvp(self.loss, self.theta, v)
        if part == "full":
            return full
        logits = lambda t: self.out(t).logits  # noqa: E731
        F, Jv = jvp(logits, (self.theta,), (v,))
        targets = torch.nn.functional.pad(self.labels, (0, 1), value=-100)[:, 1:]

        def lossF(f):
            return torch.nn.functional.cross_entropy(f.reshape(-1, f.shape[-1]), targets.reshape(-1))

        _, HJv = jvp(lambda f: torch.func.grad(lossF)(f), (F.detach(),), (Jv,))
        _, back = vjp(logits, self.theta)
        outer = back(HJv)[0]
        return outer if part == "outer" else full - outer


def close(got, want, scale):
    return np.linalg.norm(np.asarray(got) - np.asarray(want)) <= TOL * max(scale, 1e-300)


def check_blocks(ml, ids, ref, params=None, parts=("outer", "functional", "full")):
    """For every declared q (or those in ``params``) and part: hvp with a random v_q against
    autograd, slice by slice (every block (p, q)), to 1e-10 of the slice or of the rounding
    level of the whole Hessian (1e-4 ‖H‖ ‖v_q‖: blocks that are zero up to rounding, as a key
    bias's, which shifts each softmax row by a constant); the entries no declared parameter
    holds (position rows beyond L) have zero curvature."""
    k = sh.kernel(ml.layer, "torch", ml.loss)
    st = k.prepare(ml.values(ids))
    off = ml.module_positions()
    names = ml.layer.param_names
    n = len(ml.index)
    covered = np.zeros(ref.theta.numel(), bool)
    covered[ml.index] = True
    g = torch.Generator().manual_seed(5)
    v_all = torch.zeros(ref.theta.numel(), dtype=torch.float64)
    v_all[ml.index] = torch.randn(n, generator=g, dtype=torch.float64)
    gain = float(ref.hvp(v_all, "full").norm() / v_all.norm())     # the Hessian's scale
    for q in (names if params is None else params):
        vq = torch.zeros(n, dtype=torch.float64)
        lo = sum(len(off[p]) for p in names[:names.index(q)])
        vq[lo:lo + len(off[q])] = torch.randn(len(off[q]), generator=g, dtype=torch.float64)
        vm = torch.zeros(ref.theta.numel(), dtype=torch.float64)
        vm[ml.index] = vq
        for part in parts:
            want = ref.hvp(vm, part).numpy()
            assert not want[~covered].any(), "curvature outside the declared entries"
            got = st.hvp(vq, part).numpy()
            floor = 1e-4 * gain * float(vq.norm())   # rounding level: H(W_Q, b_K) ≈ 0
            o = 0
            for p in names:
                m = len(off[p])
                w = want[off[p]]
                assert close(got[o:o + m], w, max(np.linalg.norm(w), floor)), (p, q, part)
                o += m
    return st, off


# ----------------------------------------------------------------------------- capture
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_gpt2_lm_declaration(impl):
    """One embedding parameter used twice, the positions' rows as one L × d parameter, the
    logits as the output and the model's loss as ce_weighted; the loss, logits and gradient are
    the model's (SDPA and eager attention)."""
    m, ids = gpt2(impl=impl), token_ids()
    ml = capture(m, ids)
    names = ml.layer.param_names
    assert names[:2] == ("transformer_wte_weight", "transformer_wpe_weight_1")
    wte = ml.layer.param("transformer_wte_weight")
    assert (wte.rows, wte.cols) == (sh.expr.dim("V"), sh.expr.dim("d"))
    wpe = ml.layer.param("transformer_wpe_weight_1")
    assert (wpe.rows, wpe.cols) == (sh.expr.dim("L"), sh.expr.dim("d"))
    assert ml.pieces["transformer_wpe_weight_1"][1].shape == (L, D)    # rows 0 … L − 1 only
    assert not any("lm_head" in n for n in names)                   # tied: W_E, not a copy
    assert ml.loss == "ce_weighted" and ml.causal and not ml.layer.inputs[1:]
    assert any("to float32" in c for c in ml.casts)
    with torch.no_grad(), no_downcasts():
        out = m(input_ids=ids, labels=ids, use_cache=False)
    assert torch.allclose(ml.forward(ids), out.logits, rtol=0, atol=1e-12)
    assert abs(float(ml.loss_value(ids)) - float(out.loss)) <= 1e-13
    st = sh.kernel(ml.layer, "torch", ml.loss).prepare(ml.values(ids))
    assert abs(float(st.loss()) - float(out.loss)) <= 1e-13
    ref = Reference(m, ids)
    want = ref.gradient().numpy()
    got = np.zeros_like(want)
    got[ml.index] = st.gradient_flat().detach().numpy()
    assert close(got, want, np.linalg.norm(want))


def test_untied_head():
    """Without tied embeddings the head is a parameter of its own (d × V: x Aᵀ declares Aᵀ)."""
    m = gpt2(seed=4, tie=False)
    ids = token_ids(seed=4)
    ml = capture(m, ids)
    head = ml.layer.param("lm_head_weight")
    assert (head.rows, head.cols) == (sh.expr.dim("d"), sh.expr.dim("V"))
    check_blocks(ml, ids, Reference(m, ids), params=["lm_head_weight", "transformer_wte_weight"],
                 parts=("full",))


def test_gpt2_lm_every_block():
    """Every block (p, q) of one layer's model, outer, functional and full, against autograd
    of the model's loss; blocks derived on their own (a key head against the tied
    embedding), diagonals and traces."""
    m, ids = gpt2(), token_ids()
    ml = capture(m, ids)
    ref = Reference(m, ids)
    st, off = check_blocks(ml, ids, ref)
    wanted = ["transformer_h_0_attn_c_attn_weight_3", "transformer_wte_weight", "transformer_ln_f_weight"]
    both = hessian_rows(ref.loss, ref.theta, np.concatenate([off[p] for p in wanted[::2]])).numpy()
    rows = dict(zip(wanted[::2], np.split(both, [len(off[wanted[0]])])))
    for p, q in [wanted[:2], (wanted[0], wanted[0]), (wanted[2], wanted[0])]:
        want = rows[p][:, off[q]]
        assert close(st.hessian_block(p, q, "full").numpy(), want, np.linalg.norm(want)), (p, q)
    for p in wanted[::2]:
        d = np.diag(rows[p][:, off[p]])
        assert close(st.diag(p).numpy(), d, np.linalg.norm(d)), p
        assert close(float(st.trace(p)), d.sum(), np.abs(d).sum()), p


@pytest.mark.slow
def test_gpt2_lm_two_layers():
    """The 2-layer model of n_embd 16, 2 heads, 13 tokens: every block (p, q), outer,
    functional and full, against autograd of the model's own loss."""
    m = gpt2(n_layer=2, vocab=13, d=16, heads=2, d_ff=64, seed=1)
    ids = token_ids((2, 6), vocab=13, seed=1)
    ml = capture(m, ids)
    assert len(ml.layer.params) == 2 + 2 * 23 + 2          # W_E, W_P[0:L], 23 per block, ln_f
    check_blocks(ml, ids, Reference(m, ids))


def test_one_block_inside_the_model():
    """The curvature of block 0's parameters of the whole model's loss (block 1, the final
    LayerNorm and the tied head downstream): H(S, S) as an operator, against autograd of the
    model's loss, outer and full; its dense form for two parameters; refusals."""
    m, ids = gpt2(n_layer=2, seed=2), token_ids(seed=2)
    ml = capture(m, ids)
    S = ml.declared_under("transformer.h.0")
    assert len(S) == 23 and all(n.startswith("transformer_h_0_") for n in S)
    k = sh.kernel(ml.layer, "torch", ml.loss)
    ref = Reference(m, ids)
    off = ml.module_positions()
    idx = np.concatenate([off[n] for n in S])
    g = torch.Generator().manual_seed(7)
    for part in ("outer", "full"):
        op = sh.operator(k, ml.batches([ids]), p=list(S), part=part, params=ml.params())
        assert op.shape == (len(idx), len(idx)) and op.symmetric
        v = torch.randn(len(idx), generator=g, dtype=torch.float64)
        vm = torch.zeros(ref.theta.numel(), dtype=torch.float64)
        vm[idx] = v
        want = ref.hvp(vm, part).numpy()[idx]
        assert close(op @ v.numpy(), want, np.linalg.norm(want)), part
    two = ["transformer_h_0_ln_1_weight", "transformer_h_0_mlp_c_proj_bias"]
    dense = sh.operator(k, ml.batches([ids]), p=two, params=ml.params()).to_dense()
    cols = np.concatenate([off[n] for n in two])
    want = hessian_rows(ref.loss, ref.theta, cols).numpy()[:, cols]
    assert close(dense, want, np.linalg.norm(want))
    with pytest.raises(InputError, match="unknown parameter 'nope'"):
        sh.operator(k, ml.batches([ids]), p=["nope"], params=ml.params())
    with pytest.raises(InputError, match="no declared parameter lies under"):
        ml.declared_under("transformer.h.7")


# ----------------------------------------------------------------------------- data
def test_token_batches():
    """Batches of token ids (tensors, HF-style dicts, (ids,) and (ids, labels)) from a list or a
    DataLoader: X and Y follow the ids, and the dataset's loss and hvp are the mean of the
    model's over the batches; one-shot iterators and what cannot be declared are refused."""
    from torch.utils.data import DataLoader, TensorDataset
    m, ids = gpt2(), token_ids()
    ml = capture(m, ids)
    data = token_ids((6, L), seed=3)
    loader = DataLoader(TensorDataset(data), batch_size=2)
    dicts = [{"input_ids": data[i:i + 3], "attention_mask": torch.ones(3, L, dtype=torch.long),
              "position_ids": torch.arange(L).expand(3, L), "labels": data[i:i + 3]} for i in (0, 3)]
    k = sh.kernel(ml.layer, "torch", ml.loss)
    v = torch.randn(len(ml.index), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    vm = torch.zeros(sum(p.numel() for p in m.parameters()), dtype=torch.float64)
    vm[ml.index] = v
    ref = Reference(m, data)
    want = ref.hvp(vm, "full").numpy()[ml.index]
    for source in (loader, dicts, [(data[:4],), (data[4:], data[4:])]):
        batches = ml.batches(source)
        b = next(iter(batches))
        assert set(b) == {"X", "Y"} and b["X"].shape[1:] == (L, V)
        first = next(iter(source))
        first = first["input_ids"] if isinstance(first, dict) else first[0]
        assert torch.equal(b["X"].argmax(-1), first)
        assert torch.equal(b["Y"][:, :-1].argmax(-1), first[:, 1:]) and not b["Y"][:, -1].any()
        got = sh.operator(k, batches, params=ml.params()).matvec(v.numpy())
        assert close(got, want, np.linalg.norm(want)), type(source).__name__
    with pytest.raises(InputError, match="one-shot"):
        ml.batches(iter([data]))
    with pytest.raises(InputError, match="tokens but the model was captured with 5"):
        ml.batch(token_ids((2, 4)))
    with pytest.raises(InputError, match="attention_mask must be all ones"):
        ml.batch({"input_ids": data[:2], "attention_mask": torch.tensor([[1] * L, [1] * (L - 1) + [0]])})
    with pytest.raises(InputError, match="position_ids must be 0"):
        ml.batch({"input_ids": data[:2], "position_ids": torch.arange(1, L + 1)[None]})
    with pytest.raises(InputError, match="must lie in 0"):
        ml.batch(torch.full((2, L), V))
    with pytest.raises(InputError, match="must be integers"):
        ml.batch(torch.zeros(2, L))


def answer_labels(ids, answer, seed=0):
    """Labels that score only the last ``answer[n]`` tokens of sequence n (-100 before), and
    at some of those a token other than the input's (labels need not be the ids)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.full_like(ids, -100)
    for n, a in enumerate(answer):
        labels[n, ids.shape[1] - a:] = ids[n, ids.shape[1] - a:]
    other = torch.randint(0, V, ids.shape, generator=g)
    swap = (torch.rand(ids.shape, generator=g) < 0.4) & (labels != -100)
    labels = torch.where(swap, other, labels)
    labels[0, -1] = (ids[0, -1] + 1) % V
    return labels


def test_labels_with_ignored_positions():
    """Labels with -100 entries and labels unlike the ids: the loss, gradient and Hessian–vector
    products (full and Gauss–Newton) of one batch are those of the model's own loss (the mean
    over the batch's labelled next-token targets); given as (ids, labels) or as a dict."""
    m, ids = gpt2(seed=6), token_ids((3, L), seed=6)
    ml = capture(m, ids)
    labels = answer_labels(ids, (2, 3, 5), seed=6)
    assert (labels == -100).any() and ((labels != ids) & (labels != -100)).any()
    ref = Reference(m, ids, labels)
    with torch.no_grad():
        want_loss = float(ref.loss(ref.theta))
    k = sh.kernel(ml.layer, "torch", ml.loss)
    Y = ml.batch(ids, labels)["Y"]
    assert int(Y.sum(-1).count_nonzero()) == 2 + 3 + 4          # the labelled targets
    assert abs(float(ml.loss_value((ids, labels))) - want_loss) <= 1e-13
    g = torch.Generator().manual_seed(1)
    v = torch.randn(len(ml.index), generator=g, dtype=torch.float64)
    vm = torch.zeros(ref.theta.numel(), dtype=torch.float64)
    vm[ml.index] = v
    grad = ref.gradient().numpy()[ml.index]
    for batch in ((ids, labels), {"input_ids": ids, "labels": labels}):
        st = k.prepare(ml.values(batch))
        assert abs(float(st.loss()) - want_loss) <= 1e-13
        assert close(st.gradient_flat().numpy(), grad, np.linalg.norm(grad))
        for part in ("full", "outer"):
            want = ref.hvp(vm, part).numpy()[ml.index]
            assert close(st.hvp(v, part).numpy(), want, np.linalg.norm(want)), part


def test_right_padding_as_ignored_labels():
    """A right-padded batch with its attention mask and labels -100 on the padding: the same
    ids without the mask, under the same labels, give the model's loss and Hessian–vector
    products exactly (no labelled target sees a later token); the mask itself is refused."""
    m, ids = gpt2(seed=9), token_ids((3, L), seed=9)
    ml = capture(m, ids)
    mask = (torch.arange(L)[None] < torch.tensor([[5], [3], [4]])).long()
    labels = torch.where(mask.bool(), ids, -100)
    ref = Reference(m, ids, labels, attention_mask=mask)
    st = sh.kernel(ml.layer, "torch", ml.loss).prepare(ml.values((ids, labels)))
    with torch.no_grad():
        assert abs(float(st.loss()) - float(ref.loss(ref.theta))) <= 1e-13
    v = torch.randn(len(ml.index), generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    vm = torch.zeros(ref.theta.numel(), dtype=torch.float64)
    vm[ml.index] = v
    want = ref.hvp(vm, "full").numpy()[ml.index]
    assert close(st.hvp(v).numpy(), want, np.linalg.norm(want))
    with pytest.raises(InputError, match="attention_mask must be all ones"):
        ml.batch({"input_ids": ids, "attention_mask": mask, "labels": labels})


def padded(ids, lengths):
    """(attention_mask, labels): the first ``lengths[n]`` tokens of sequence n kept, the
    padding labelled -100 (as a data collator pads to the right)."""
    mask = (torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]).long()
    return mask, torch.where(mask.bool(), ids, -100)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_padded_batches(impl):
    """A model captured on an example padded to different lengths holds its mask as a
    per-sequence input, rebuilt from every batch's attention_mask (any batch size, padding or
    none): one batch's loss and Hessian–vector products, and a dataset's, against autograd of
    the model's own loss with its mask; left padding and masks shared by the example refused."""
    m = gpt2(seed=11, impl=impl)
    ids = token_ids((3, L), seed=11)
    mask, _ = padded(ids, [5, 3, 4])
    ml = sh.from_module(m, (), {"input_ids": ids, "labels": ids, "attention_mask": mask,
                                "use_cache": False})
    assert ml.masks == ("M_1",) and [v.name for v in ml.layer.inputs] == ["X", "M_1"]
    k = sh.kernel(ml.layer, "torch", ml.loss)
    a, b = token_ids((2, L), seed=12), token_ids((4, L), seed=13)
    (ma, la), (mb, lb) = padded(a, [2, 5]), padded(b, [4, 1, 5, 3])
    batches = [{"input_ids": a, "attention_mask": ma, "labels": la},
               {"input_ids": b, "attention_mask": mb, "labels": lb}]
    v = torch.randn(len(ml.index), generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    def agree(ref, got_loss, hvp):
        vm = torch.zeros(ref.theta.numel(), dtype=torch.float64)
        vm[ml.index] = v
        with torch.no_grad():
            assert abs(got_loss - float(ref.loss(ref.theta))) <= 1e-13
        for part in ("full", "outer"):
            want = ref.hvp(vm, part).numpy()[ml.index]
            assert close(hvp(part), want, np.linalg.norm(want)), part

    st = k.prepare(ml.values(batches[1]))
    agree(Reference(m, b, lb, attention_mask=mb), float(st.loss()), lambda part: st.hvp(v, part).numpy())
    plain = k.prepare(ml.values({"input_ids": a}))               # no mask: every token kept
    agree(Reference(m, a), float(plain.loss()), lambda part: plain.hvp(v, part).numpy())
    ds = sh.Dataset(k, ml.batches(batches), params=ml.params())
    agree(Reference(m, torch.cat([a, b]), torch.cat([la, lb]), attention_mask=torch.cat([ma, mb])),
          float(ds.loss()), lambda part: sh.operator(k, ds, part=part) @ v.numpy())
    with pytest.raises(InputError, match="first token of every sequence kept"):
        ml.batch({"input_ids": a, "attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1] * L])})
    with pytest.raises(InputError, match="attention_mask has 4 rows for 2 sequences"):
        ml.batch({"input_ids": a, "attention_mask": mb})
    with pytest.raises(DeclarationError, match="padded alike"):
        sh.from_module(m, (), {"input_ids": ids, "labels": ids, "attention_mask": padded(ids, [3] * 3)[0],
                               "use_cache": False})


def test_labelled_dataset_is_token_weighted():
    """Over several batches whose labelled targets differ in number, every result is the
    model's loss on all the data at once (the mean over every labelled target), not the mean
    of the batches' means; refusals of bad labels."""
    from symhess.curvature.dataset import Dataset
    m, ids = gpt2(seed=7), token_ids(seed=7)
    ml = capture(m, ids)
    data = token_ids((5, L), seed=8)
    labels = answer_labels(data, (1, 4, 2, 4, 3), seed=8)
    batches = [(data[:2], labels[:2]), {"input_ids": data[2:], "labels": labels[2:]}]
    ref = Reference(m, data, labels)
    k = sh.kernel(ml.layer, "torch", ml.loss)
    ds = Dataset(k, ml.batches(batches), params=ml.params())
    with torch.no_grad():
        whole = float(ref.loss(ref.theta))
        means = [float(Reference(m, data[s], labels[s]).loss(ref.theta)) for s in (slice(0, 2), slice(2, 5))]
    assert abs(float(ds.loss()) - whole) <= 1e-13
    assert abs(whole - sum(means) / 2) > 1e-6 and abs(whole - (2 * means[0] + 3 * means[1]) / 5) > 1e-6
    v = torch.randn(len(ml.index), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    vm = torch.zeros(ref.theta.numel(), dtype=torch.float64)
    vm[ml.index] = v
    for part in ("full", "outer"):
        want = ref.hvp(vm, part).numpy()[ml.index]
        got = sh.operator(k, ml.batches(batches), part=part, params=ml.params()) @ v.numpy()
        assert close(got, want, np.linalg.norm(want)), part
    with pytest.raises(InputError, match=r"labels must lie in 0 … 6 \(the vocabulary\) or be -100"):
        ml.batch(data[:2], torch.full((2, L), -1))
    with pytest.raises(InputError, match="labels must have the ids' shape"):
        ml.batch(data[:2], data[:1])
    with pytest.raises(InputError, match="labels must be integers"):
        ml.batch(data[:2], data[:2].double())
    ignored = torch.full((2, L), -100)
    ignored[:, 0] = 1                       # the first label is never a target
    with pytest.raises(InputError, match="every next-token label of the batch is ignored"):
        ml.batch(data[:2], ignored)
    with pytest.raises(InputError, match="every next-token label of the data is ignored"):
        ml.batches([(data[:2], ignored)])


def labelled_shards():
    """Three labelled batches of 2 sequences whose labelled targets differ in number (4, 8, 3)."""
    data = token_ids((6, L), seed=10)
    labels = answer_labels(data, (1, 3, 5, 4, 2, 1), seed=10)
    return [(data[i:i + 2], labels[i:i + 2]) for i in (0, 2, 4)]


def sharded_worker(rank, world, port, path):
    import os
    from symhess.curvature import distributed as D
    from symhess.curvature.dataset import Dataset
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        m = gpt2(seed=7)
        ml = capture(m, token_ids(seed=7))
        k = sh.kernel(ml.layer, "torch", ml.loss)
        ds = Dataset(k, ml.batches(D.shard(labelled_shards())), params=ml.params())
        v = torch.linspace(-1, 1, len(ml.index), dtype=torch.float64)
        out = {"loss": float(ds.loss()), "hvp": (sh.operator(k, ds) @ v).numpy()}
        if rank == 0:
            np.save(path, out, allow_pickle=True)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_token_counts_summed_over_processes(tmp_path):
    """Two gloo processes with shards of labelled batches (4 sequences and 7 labelled targets,
    2 and 8): the counts are summed over the processes before the weights are set (6/15, not
    4/7 and 2/8), so the results are the single process's token-weighted ones."""
    import socket
    from symhess.curvature.dataset import Dataset
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = str(tmp_path / "rank0.npy")
    torch.multiprocessing.spawn(sharded_worker, args=(2, port, path), nprocs=2, join=True)
    got = np.load(path, allow_pickle=True).item()
    m = gpt2(seed=7)
    ml = capture(m, token_ids(seed=7))
    k = sh.kernel(ml.layer, "torch", ml.loss)
    ds = Dataset(k, ml.batches(labelled_shards()), params=ml.params(), distributed=False)
    v = torch.linspace(-1, 1, len(ml.index), dtype=torch.float64)
    assert abs(got["loss"] - float(ds.loss())) <= 1e-12 * abs(float(ds.loss()))
    want = (sh.operator(k, ds) @ v).numpy()
    assert close(got["hvp"], want, np.linalg.norm(want))


def test_refusals():
    """A model called without its loss, and ops reading the ids' values, are one-line errors."""
    m, ids = gpt2(), token_ids()
    with pytest.raises(DeclarationError, match="labels=input_ids"):
        sh.from_module(m, (), {"input_ids": ids, "use_cache": False})
    with pytest.raises(DeclarationError, match="the same tensor"):
        sh.from_module(m, (), {"input_ids": ids, "labels": ids.clone(), "use_cache": False})
    one = token_ids((2, 1))
    with pytest.raises(DeclarationError, match="at least 2 tokens"):
        sh.from_module(m, (), {"input_ids": one, "labels": one, "use_cache": False})

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(V, D, dtype=torch.float64)

        def forward(self, input_ids):
            return self.emb(input_ids) * (input_ids != 0)[..., None]

    with pytest.raises(DeclarationError, match=r"aten\.ne\.Scalar reads the values of the token "
                                               r"ids; .*test_language_models\.py"):
        sh.from_module(Masked(), (ids,))


def test_spectrum_command_takes_the_model_loss(tmp_path, capsys):
    """``symhess spectrum FILE.py:factory`` on a language model: random token ids as data,
    and only under the model's own loss (another is refused with one line)."""
    from symhess.cli.main import main
    f = tmp_path / "lm.py"
    f.write_text("import torch\n"
                 "def gpt2_lm():\n"
                 "    from transformers import GPT2Config, GPT2LMHeadModel\n"
                 f"    cfg = GPT2Config(n_embd={D}, n_head={HEADS}, n_layer=1, n_inner={DFF}, "
                 f"vocab_size={V}, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)\n"
                 "    torch.manual_seed(0)\n"
                 f"    ids = torch.randint(0, {V}, (2, {L}))\n"
                 "    return GPT2LMHeadModel(cfg).double().eval(), (), "
                 "{'input_ids': ids, 'labels': ids, 'use_cache': False}\n")
    block = "transformer_ln_f_bias,transformer_ln_f_bias"
    assert main(["spectrum", f"{f}:gpt2_lm", "--block", block, "--k", "2", "--loss", "mse"]) == 2
    assert "computes its own loss, ce_weighted; pass --loss ce_weighted" in capsys.readouterr().err
    assert main(["spectrum", f"{f}:gpt2_lm", "--block", block, "--k", "2", "--loss", "ce_weighted"]) == 0
    assert "loss=ce_weighted" in capsys.readouterr().out

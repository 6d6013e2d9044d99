"""Products that several terms share, named once (``codegen.share``): also where a term holds
one's operands inside a larger product, with every compact listed after those it holds."""
from __future__ import annotations

import functools
import itertools
from functools import lru_cache

import numpy as np
import pytest
import torch

import symhess as sh
from symhess.calculus.verify import random_values
from symhess.codegen.program import Program
from symhess.expr import nodes as E
from symhess.runtime import network as N

LAYERS = ("attention", "post_ln_block", "pre_ln_block", "modern_block")


@lru_cache(maxsize=None)
def program(name):
    return Program.build(sh.derive(sh.layer(name), "mse"))


def test_the_mlps_jacobian_pair_contracts_the_shared_products():
    """The modern block's residual around the MLP puts (I + J)ᵀ(I + J) between attention and
    the loss; its JᵀJ term held the chain N S W_2 W_2ᵀ Sᵀ Nᵀ (W_2 twice), whose halves the J
    and Jᵀ terms share as a product: it holds that product twice instead."""
    prog = program("modern_block")
    twice = [key for key, terms in prog.blocks.items() for t in terms
             if sum(op.kind == "leaf" and isinstance(op.ref, E.Var) and op.ref.name == "W_2"
                    for op in t.operands) > 1]
    assert not twice


@pytest.mark.parametrize("name", LAYERS)
def test_compacts_follow_the_compacts_they_hold(name):
    prog = program(name)
    position = {node: i for i, node in enumerate(prog.compact_order)}
    assert len(position) == len(prog.compacts)
    for node in prog.compact_order:
        for t in prog.compacts[node]:
            for op in t.operands:
                if op.kind == "compact":
                    assert position[op.ref] < position[node], (node, op.ref)


@pytest.mark.parametrize("name", LAYERS)
def test_no_compact_is_another_transposed(name):
    """A compact whose networks are another's with its axes permuted (the modern block's
    SwiGLU Jacobian and its transpose, a LayerNorm Jacobian and its transpose) is read from
    that one: materialised at small sizes, no two of a kernel's compacts that differ agree
    under a permutation of their axes."""
    der = sh.derive(sh.layer(name), "mse")
    values = random_values(der, 1, sizes={"L": 3, "d_V": 5, "d_K": 2, "d_ff": 7})
    st = sh.kernel(name, "torch", "mse").prepare({k: torch.as_tensor(v) for k, v in values.items()})
    arrays = {}
    for attr in dir(type(st)):
        if isinstance(getattr(type(st), attr, None), functools.cached_property):
            c = getattr(st, attr)
            if isinstance(c, N.Compact):
                arrays[attr] = c.array(st).numpy()
    assert len(arrays) >= 3
    for (a, x), (b, y) in itertools.combinations(arrays.items(), 2):
        if x.shape == y.shape and np.allclose(x, y, rtol=1e-12, atol=1e-14):
            continue                    # equal as they stand (two forms of one tensor)
        for perm in itertools.permutations(range(y.ndim)):
            if perm != tuple(range(y.ndim)) and y.transpose(perm).shape == x.shape:
                assert not np.allclose(x, y.transpose(perm), rtol=1e-12, atol=1e-14), (a, b, perm)

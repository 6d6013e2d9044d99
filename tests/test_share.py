"""Products that several terms share, named once (``codegen.share``): also where a term holds
one's operands inside a larger product, with every compact listed after those it holds."""
from __future__ import annotations

from functools import lru_cache

import pytest

import symhess as sh
from symhess.codegen.program import Program
from symhess.expr import nodes as E

LAYERS = ("attention", "post_ln_block", "pre_ln_block", "modern_block")


@lru_cache(maxsize=None)
def program(name):
    return Program.build(sh.derive(sh.layer(name), "mse"))


def test_the_mlps_jacobian_pair_contracts_the_shared_products():
    """The modern block's residual around the MLP puts (I + J)ᵀ(I + J) between attention and
    the loss; its JᵀJ term held the chain S_3 (S_5 W_2)(W_2ᵀ S_6ᵀ) S_7, W_2 twice, whose halves
    the J and Jᵀ terms share as products: it holds those two products instead."""
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

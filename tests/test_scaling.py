"""The generated small-σ scaling table: up to date, and the derived exponents match the reference."""
import pathlib

import pytest

from symhess.cli import scaling

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_scaling_doc_is_up_to_date():
    on_disk = (ROOT / "docs" / "scaling.md").read_text(encoding="utf-8")
    assert on_disk == scaling.markdown(), "run: python docs/scaling_table.py"


def test_softmax_exponents_match_reference_section_8():
    t = scaling.layer_table("attention")
    exp = {(p, q, part): s.exponent for (p, q), r in t.items() for part, s in r.items()}
    assert exp[("W_V", "W_V", "outer")] == 2
    assert exp[("W_Q", "W_Q", "outer")] == 6
    assert exp[("W_Q", "W_Q", "functional")] == 5
    assert exp[("W_K", "W_V", "outer")] == 4 and exp[("W_K", "W_V", "functional")] == 3
    assert exp[("W_Q", "W_K", "at T")] == 3 and exp[("W_Q", "W_K", "functional")] == 3
    assert t[("W_V", "W_V")]["functional"].slope is None      # the Zero node


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_outer_blocks_all_scale_as_sigma_6(causal):
    t = scaling.layer_table("linear_attention", causal=causal)
    assert {r["outer"].exponent for r in t.values()} == {6}


def test_slope_rounding():
    assert scaling.Slope("a", "b", "outer", 4.98).cell() == "5"
    assert scaling.Slope("a", "b", "outer", 4.5).cell() == "4.50"
    assert scaling.Slope("a", "b", "outer", None).cell() == "≡0"


@pytest.mark.parametrize("name", ["attention", "linear_attention", "single_matrix_attention",
                                  "value_output_attention"])
def test_causal_mask_leaves_exponents_unchanged(name):
    plain, causal = scaling.layer_table(name), scaling.layer_table(name, causal=True)
    assert {k: {c: s.cell() for c, s in r.items()} for k, r in plain.items()} == \
           {k: {c: s.cell() for c, s in r.items()} for k, r in causal.items()}

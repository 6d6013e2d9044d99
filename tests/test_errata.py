"""The errata evidence: symhess's derived forms match autograd, the published forms do not.

The published (wrong) forms live only in docs/errata_evidence.py, as objects under test.
"""
import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "docs" / "errata_evidence.py"
REQUIRED = ("E1", "E3", "E5", "E6", "E7", "E10", "E11", "E12", "E13", "E15")


@lru_cache(maxsize=None)
def evidence():
    spec = importlib.util.spec_from_file_location("errata_evidence", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod, {ev.key: ev for ev in mod.collect()}


def test_required_items_are_covered():
    _, evs = evidence()
    assert set(REQUIRED) <= set(evs)


@pytest.mark.parametrize("key", [f"E{i}" for i in range(1, 17)])
def test_symhess_passes_and_published_fails(key):
    mod, evs = evidence()
    ev = evs[key]
    assert ev.symhess and all(err <= mod.PASS for err in ev.symhess.values()), ev.symhess
    assert ev.published, key
    for label, res in ev.published.items():
        if isinstance(res, str):   # a non-conforming product, a wrong constant, or no formula at all
            assert res.startswith(("shape error", "absent", "off by")), (label, res)
        else:
            assert res > mod.FAIL, (label, res)


def test_errata_page_is_current():
    mod, evs = evidence()
    page = (PATH.parent / "errata.md").read_text()
    for key in evs:
        assert f"\n## {key}\n" in page


def test_evidence_labels_do_not_repeat_the_column():
    """Labels print after "published" / "symhess": they do not start with the same word again."""
    _, evs = evidence()
    for ev in evs.values():
        assert not any(k.lower().startswith("symhess") for k in ev.symhess), ev.key
        assert not any(k.lower().startswith("published") for k in ev.published), ev.key
    page = (PATH.parent / "errata.md").read_text()
    assert "symhess symhess" not in page and "symhess, symhess" not in page

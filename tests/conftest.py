import os

import pytest

from hypothesis import settings

# Fixed, derandomised Hypothesis profiles: property tests are reproducible in CI
# ("symhess"); "symhess-long" runs many more examples locally.
settings.register_profile("symhess", derandomize=True, max_examples=15, deadline=None,
                          print_blob=True)
settings.register_profile("symhess-long", derandomize=True, max_examples=300, deadline=None,
                          print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "symhess"))


@pytest.fixture
def one_thread():
    """Tiny products: one torch thread (a shared 2-core machine makes thread pools slow)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

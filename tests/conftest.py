import os

from hypothesis import settings

# A fixed, derandomised Hypothesis profile: property tests are reproducible in CI.
settings.register_profile("symhess", derandomize=True, max_examples=15, deadline=None,
                          print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "symhess"))

"""Shared test helpers: the tests directory is importable (``from helpers import ...``).

``HYPOTHESIS_PROFILE=ci`` (what ``.ci/run`` sets) runs every property test on the same
examples each time (``derandomize``: drawn from a seed fixed by the test itself), so a
run's result depends on the code alone; without it each run draws new examples."""

import os
import sys

from hypothesis import settings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

settings.register_profile("ci", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

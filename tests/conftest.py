"""Shared test helpers: the tests directory is importable (``from helpers import ...``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

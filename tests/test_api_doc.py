"""docs/api.md is generated from the code and must match it (python docs/make_api.py)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_api_reference_is_current():
    spec = importlib.util.spec_from_file_location("make_api", os.path.join(ROOT, "docs", "make_api.py"))
    make_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_api)
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        assert f.read() == make_api.render(), "docs/api.md is stale: run python docs/make_api.py"

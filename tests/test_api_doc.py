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


def test_a_star_import_gives_the_public_api_but_not_open():
    """``lcckpt.open`` (named after safetensors' ``safe_open``) would shadow the builtin
    ``open`` in a module that does ``from lcckpt import *``."""
    import types

    import lcckpt
    ns: dict = {}
    exec("from lcckpt import *", ns)
    assert "open" not in ns and ns["save"] is lcckpt.save
    public = {n for n in dir(lcckpt) if not n.startswith("_")
              and not (isinstance(getattr(lcckpt, n), types.ModuleType) and n != "schedule")}
    assert set(lcckpt.__all__) == public - {"open"}

"""Write docs/api.md, the API reference, from the public names' signatures and docstrings.

    python docs/make_api.py

tests/test_api_doc.py fails when docs/api.md differs from what this writes, so the
reference cannot fall behind the code.
"""

import inspect
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
SECTIONS = [
    ("lcckpt", "The package: codec, files, chains, training loop, errors"),
    ("lcckpt.schedule", "When to checkpoint"),
    ("lcckpt.distributed", "Many ranks on torch.distributed.checkpoint"),
    ("lcckpt.training.hf", "Hugging Face Trainer"),
    ("lcckpt.training.lightning", "PyTorch Lightning"),
]


# public, but kept out of the module's __all__ on purpose (it would shadow a builtin)
NOT_STARRED = {"lcckpt": ["open"]}


def public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in dir(module) if not n.startswith("_")]
    names = [n for n in names if not isinstance(getattr(module, n), types.ModuleType)]
    names += NOT_STARRED.get(module.__name__, [])
    return sorted(names, key=lambda n: (not n[0].isupper(), n.lower()))


def summary(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def signature(name: str, obj) -> str:
    if not callable(obj):
        return ""
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    if len(sig) < 90:
        return f"`{name}{sig}`"
    params, star = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        params.append(str(p))
    ret = sig[sig.rindex(")") + 1:] if sig.rstrip().endswith(("]", "'", '"')) or " -> " in \
        sig[sig.rindex(")"):] else ""
    body = ",\n".join(f"    {p}" for p in params)
    return f"```python\n{name}(\n{body},\n){ret}\n```"


def render() -> str:
    import importlib
    out = ["# API reference", "",
           "Generated from the code by `python docs/make_api.py` (a test keeps it current). "
           "Each entry: the signature and the first paragraph of the docstring; "
           "`help(lcckpt.NAME)` has the rest.", ""]
    for modname, title in SECTIONS:
        module = importlib.import_module(modname)
        out += [f"## {modname}: {title}", ""]
        for name in public_names(module):
            obj = getattr(module, name)
            kind = "class" if inspect.isclass(obj) else ("function" if inspect.isroutine(obj)
                                                         else "value")   # a policy instance
            out.append(f"### {modname}.{name} ({kind})")
            sig = signature(name, obj) if kind != "value" else ""
            if sig:
                out += ["", sig]
            text = summary(obj) if kind != "value" else f"`{obj!r}`"[:300]
            if text:
                out += ["", text]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    with open(os.path.join(HERE, "api.md"), "w") as f:
        f.write(render())

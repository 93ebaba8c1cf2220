"""The import graph of the package: no cycles, no upward imports, no benchmark code below.

Every import of an lcckpt module counts, at module level or inside a function. The layers
are those of docs/architecture.md, lowest first; a module may import its own layer and
those below it.
"""

import ast
import os

import lcckpt

ROOT = os.path.dirname(lcckpt.__file__)

LAYERS = [
    {"errors", "limits", "util"},          # below everything
    {"codec"},                             # the tensor codec and its kernels
    {"format", "numcodecs", "zarr3"},      # the file format; the codecs for zarr
    {"chain"},                             # delta chains
    {"interop"},                           # lazy reads of files and chains, conversion
    {"schedule", "training", "distributed"},   # what builds on chains
    {"cli", "bench", "__main__"},          # the command line and the benchmarks
]


def _modules() -> dict[str, str]:
    out = {}
    for base, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(base, f), ROOT)[:-3].replace(os.sep, ".")
                out["lcckpt" + ("" if rel == "__init__" else "." + rel.removesuffix(".__init__"))] = \
                    os.path.join(base, f)
    return out


def _imports(name: str, path: str, modules) -> set[str]:
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lcckpt")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("lcckpt"):
                for a in node.names:             # `from . import x` imports module x
                    found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {d for d in _imports(m, p, mods) if d in mods and d != m}
            for m, p in mods.items()}


def _top(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(mod: str) -> int:
    top = _top(mod)
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{mod} is in no layer of LAYERS (docs/architecture.md): add it")


def test_every_module_has_a_layer_and_imports_none_above_it():
    up = []
    for mod, deps in _graph().items():
        if mod == "lcckpt":
            continue
        for d in deps:
            if d != "lcckpt" and _layer(d) > _layer(mod):
                up.append(f"{mod} -> {d}")
    assert not up, up


def test_below_the_top_layer_nothing_imports_the_package_root():
    """``lcckpt/__init__`` re-exports everything; importing it from below would tie every
    module to all the others (the distributed writer once did)."""
    users = sorted(m for m, deps in _graph().items()
                   if "lcckpt" in deps and m != "lcckpt" and _layer(m) < len(LAYERS) - 1)
    assert not users, users


def test_nothing_outside_the_benchmarks_imports_them():
    users = sorted(f"{m} -> {d}" for m, deps in _graph().items() for d in deps
                   if _top(d) == "bench" and _top(m) != "bench" and _top(m) != "cli")
    assert not users, users


def test_the_import_graph_has_no_cycle():
    graph = {m: {d for d in deps if d != "lcckpt"} for m, deps in _graph().items()
             if m != "lcckpt"}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in graph.get(m, ()):
            if state.get(d) == 1:
                raise AssertionError(" -> ".join(path + [m, d]))
            if d not in state:
                visit(d, path + [m])
        state[m] = 2
    for m in graph:
        if m not in state:
            visit(m, [])


def test_no_function_outside_the_kernels_runs_over_80_lines():
    """Functions do one thing each (a Numba kernel is one loop)."""
    long = []
    for mod, path in _modules().items():
        if ".kernels." in mod or mod.endswith(".crc32c"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{mod}.{node.name}: {n} lines")
    assert not long, long


def test_no_module_outside_the_kernels_runs_over_520_lines():
    """A room holds modules of one job each; a module past ~500 lines does several."""
    long = [f"{mod}: {n} lines" for mod, path in _modules().items()
            if ".kernels." not in mod and (n := len(open(path).read().splitlines())) > 520]
    assert not long, long

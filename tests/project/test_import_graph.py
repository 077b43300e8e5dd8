"""The import rules, read from the code: no module cycle, no upward import between the layers,
and the third-party boundaries (the trainer never touches DuckDB or mitmproxy, the store never
touches torch or the addons, the loop never touches mitmproxy or DuckDB itself)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "polar_mitm"

# Lower layers first; a module may import its own layer's modules and any lower layer's.
LAYERS = [
    {"polar_mitm.session_ids", "polar_mitm.session_auth", "polar_mitm.trainer_input", "polar_mitm.janitor",
     "polar_mitm.models"},   # the shared kernel: the only modules at the top
    {"polar_mitm.adapters", "polar_mitm.grpo", "polar_mitm.vllm_ext"},
    {"polar_mitm.store"},
    {"polar_mitm.addons", "polar_mitm.rollout"},
    {"polar_mitm.stack", "polar_mitm.cluster", "polar_mitm.loop", "polar_mitm.dashboard"},
    {"polar_mitm.cli"},   # the commands, above everything they run
]

FORBIDDEN = [  # (importer prefix, imported prefix)
    ("polar_mitm.grpo", "duckdb"), ("polar_mitm.grpo", "mitmproxy"),
    ("polar_mitm.grpo", "polar_mitm.store"),
    ("polar_mitm.store", "torch"), ("polar_mitm.store", "polar_mitm.addons"),
    ("polar_mitm.store", "mitmproxy"), ("polar_mitm.store", "polar_mitm.grpo"),
    ("polar_mitm.adapters", "mitmproxy"), ("polar_mitm.adapters", "duckdb"),
    ("polar_mitm.loop", "mitmproxy"), ("polar_mitm.loop", "duckdb"),
    ("polar_mitm.rollout", "polar_mitm.addons"), ("polar_mitm.addons", "polar_mitm.rollout"),
    ("polar_mitm.vllm_ext", "polar_mitm"),   # it runs under vLLM's Python, which lacks polar_mitm
]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _targets(mods: dict[str, Path], current: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        parts = current.split(".")
        keep = len(parts) - node.level + (1 if mods[current].name == "__init__.py" else 0)
        base = ".".join(parts[:keep] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    subs = [f"{base}.{alias.name}" for alias in node.names]
    # `from pkg import module` depends on that module, not on the package's __init__
    return [t for t in subs if t in mods] or [base]


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = _modules()
    internal: dict[str, set[str]] = {}
    every: dict[str, set[str]] = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(_targets(mods, name, node))
        every[name] = found
        internal[name] = {t for t in found if t in mods and t != name}
    return internal, every


def _layer(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in layer):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_cycle():
    internal, _ = _graph()
    assert _cycles(internal) == []


def test_no_upward_import():
    internal, _ = _graph()
    upward = [f"{m} -> {t}" for m, deps in internal.items() for t in deps if _layer(t) > _layer(m)]
    assert upward == []


def test_forbidden_imports():
    _, every = _graph()
    bad = [f"{m} -> {t}" for m, deps in every.items() for t in deps
           for importer, imported in FORBIDDEN if _under(m, importer) and _under(t, imported)]
    assert bad == []


def test_the_checker_sees_a_cycle_and_an_upward_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer("polar_mitm.store.db") < _layer("polar_mitm.addons.model_calls")


def test_only_the_kernel_sits_at_the_top():
    """Every other module lives in a package named by its job; the top holds six modules at most."""
    top = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")
    assert {f"polar_mitm.{m}" for m in top} == LAYERS[0]
    assert len(top) + 1 <= 6   # with __init__.py

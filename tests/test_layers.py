"""The package's layers hold: no module imports one above it, and no two files import each other.

Layers, bottom to top; a module may import modules of its own layer and of layers below:
  pure helpers (sizes, cli_env, version, spec, tables, uploads, ports) < models < engine and preflight < kvpool
  < llm (the offline facade: engine + pool connector), integrations (other engines' connectors) < serve < bench, validate, generate_cli
  < cli, __main__, the package's own __init__ (the public re-exports).

What counts:
- the layer rule reads EVERY import statement of a module: module level, inside functions
  (the lazy imports of CLI handlers) and under `if TYPE_CHECKING:`;
- the cycle rule reads only imports that run when the module is imported: module level,
  outside functions and outside `if TYPE_CHECKING:` blocks (a lazy or type-only import
  cannot deadlock an import).
`from kvshare.x import y` depends on the module kvshare.x.y when that is a module, else on kvshare.x.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "kvshare"

LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "kvshare.sizes",
        "kvshare.cli_env",
        "kvshare.version",
        "kvshare.spec",
        "kvshare.tables",
        "kvshare.uploads",
        "kvshare.ports",
    ),
    ("kvshare.models",),
    ("kvshare.engine", "kvshare.preflight"),
    ("kvshare.kvpool",),
    ("kvshare.llm", "kvshare.integrations"),
    ("kvshare.serve",),
    ("kvshare.bench", "kvshare.validate", "kvshare.generate_cli"),
    ("kvshare.cli", "kvshare.__main__", "kvshare"),
)

# Imports against the order that are known and owned by work in flight; each must still
# exist (the test fails once it is gone, so the list only shrinks).
KNOWN_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset(
    {
        # check_up's type annotation (UpConfig); the check reads the launcher's argv, which
        # the engine-option plumbing rework is reshaping.
        ("kvshare.preflight", "kvshare.serve.launcher"),
    }
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def unit_of(module: str) -> str:
    """The most specific entry of LAYERS that `module` belongs to."""
    best = ""
    for layer in LAYERS:
        for unit in layer:
            if (module == unit or module.startswith(unit + ".")) and len(unit) > len(best):
                best = unit
    if not best:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best


def rank_of(module: str) -> int:
    unit = unit_of(module)
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(
    path: Path, modules: dict[str, Path], *, eager_only: bool, source: str | None = None
) -> Iterator[tuple[int, str]]:
    """(line, imported kvshare module) for each import of the file; `eager_only`: only those
    that run at import time (not in a function, not under `if TYPE_CHECKING:`)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]

    def visit(node: ast.AST) -> Iterator[tuple[int, str]]:
        for child in ast.iter_child_nodes(node):
            if eager_only and isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            ):
                continue
            if eager_only and isinstance(child, ast.If) and _is_type_checking(child.test):
                yield from (hit for stmt in child.orelse for hit in visit_stmt(stmt))
                continue
            yield from visit_stmt(child)

    def visit_stmt(child: ast.AST) -> Iterator[tuple[int, str]]:
        if isinstance(child, ast.Import):
            for alias in child.names:
                yield child.lineno, alias.name
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in child.names:
                sub = f"{base}.{alias.name}"
                yield child.lineno, sub if sub in modules else base
        else:
            yield from visit(child)

    for line, target in visit(ast.parse(path.read_text() if source is None else source, str(path))):
        if target == "kvshare" or target.startswith("kvshare."):
            yield line, target


def layer_violations() -> list[str]:
    modules = all_modules()
    found = []
    for me, path in modules.items():
        for line, target in imports_of(path, modules, eager_only=False):
            mine, theirs = unit_of(me), unit_of(target)
            if mine == theirs or (me, target) in KNOWN_EXCEPTIONS:
                continue
            if rank_of(target) > rank_of(me):
                found.append(
                    f"{path.relative_to(PACKAGE_ROOT.parent)}:{line}: {me} ({mine}) imports "
                    f"{target} ({theirs}), a higher layer"
                )
    return found


def import_cycles() -> list[list[str]]:
    """Strongly connected components of more than one file in the eager import graph."""
    modules = all_modules()
    graph = {
        me: sorted(
            {t for _, t in imports_of(path, modules, eager_only=True) if t in modules and t != me}
        )
        for me, path in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan; the package's graph is shallow enough to recurse
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            connect(node)
    return cycles


def test_every_module_is_in_a_layer() -> None:
    for module in all_modules():
        unit_of(module)


def test_no_import_points_up_the_layers() -> None:
    assert layer_violations() == []


def test_known_exceptions_are_still_needed() -> None:
    modules = all_modules()
    present = {
        (me, target)
        for me, path in modules.items()
        for _, target in imports_of(path, modules, eager_only=False)
    }
    assert present >= KNOWN_EXCEPTIONS, "an exception is gone: remove it from KNOWN_EXCEPTIONS"


def test_no_import_cycle_between_files() -> None:
    assert import_cycles() == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def f():\n    from kvshare.kvpool.connector import PoolConnector\n", True),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvshare.kvpool import client\n",
            True,
        ),
        ("import kvshare.serve.server\n", True),
        ("from kvshare.models import loader\n", False),
    ],
)
def test_an_engine_import_of_a_higher_layer_is_seen(source: str, expected: bool) -> None:
    """The parser sees lazy and type-only imports (the old engine/llm.py -> kvpool import)."""
    fake = PACKAGE_ROOT / "engine" / "llm.py"
    modules = {**all_modules(), "kvshare.engine.llm": fake}
    targets = [t for _, t in imports_of(fake, modules, eager_only=False, source=source)]
    assert any(rank_of(t) > rank_of("kvshare.engine.llm") for t in targets) == expected


# The router's admin of `vllm serve` replicas: they run no kvshare engine, so there is no
# KVConnector to ask; the pool switch, clear and stats go to the daemon's own admin API.
DAEMON_ADMIN = frozenset({("kvshare.serve.replica_admin", "kvshare.kvpool.client")})


def test_serve_reaches_the_pool_only_through_the_connector_interface() -> None:
    """serve asks the engine's KVConnector (wait_idle, close, pool admin), never PoolConnector;
    only the router's admin of other engines' replicas talks to the daemon itself."""
    modules = all_modules()
    reaching = [
        f"{me} -> {target}"
        for me, path in modules.items()
        if unit_of(me) == "kvshare.serve"
        for _, target in imports_of(path, modules, eager_only=False)
        if target in ("kvshare.kvpool.connector", "kvshare.kvpool.client")
        and (me, target) not in DAEMON_ADMIN
    ]
    assert reaching == []


# The fault-injection switches; production code reads them only off an injected object.
FAULT_SWITCHES = frozenset(
    {
        "break_order",
        "load_delay",
        "skip_checksums",
        "skip_state_restore",
        "keep_lost_lease_restores",
        "verify",
    }
)
# Where faults are built: their definition, the checks, and `kvshare serve`'s hidden flags.
FAULT_OWNERS = ("kvshare.kvpool.faults", "kvshare.validate", "kvshare.serve.cli")


def switch_mentions(source: str) -> list[str]:
    """Names, arguments, keywords and attributes named like a switch, except an attribute
    read off an object whose name ends in `faults`; and strings naming a test-only option
    (a config key read outside the fault object)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and str(node.value).startswith("test_only"):
            found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Attribute):
            owner = node.value
            owner_name = (
                owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            )
            if node.attr in FAULT_SWITCHES and not owner_name.endswith("faults"):
                found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in FAULT_SWITCHES:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.arg) and node.arg in FAULT_SWITCHES:
            found.append(f"{node.lineno}: parameter {node.arg}")
        elif isinstance(node, ast.keyword) and node.arg in FAULT_SWITCHES:
            found.append(f"{node.lineno}: {node.arg}=")
    return found


def test_production_code_sees_fault_switches_only_through_the_injected_object() -> None:
    offending = {
        me: hits
        for me, path in all_modules().items()
        if not any(me == o or me.startswith(o + ".") for o in FAULT_OWNERS)
        and (hits := switch_mentions(path.read_text()))
    }
    assert offending == {}


def test_a_switch_outside_the_injected_object_is_seen() -> None:
    assert switch_mentions("def f(verify=True):\n    return options.skip_state_restore\n") == [
        "1: parameter verify",
        "2: .skip_state_restore",
    ]
    assert switch_mentions("def f(self):\n    return self.faults.break_order\n") == []
    assert switch_mentions("skip = extra.get('test_only_skip_state_load')\n") == [
        "1: 'test_only_skip_state_load'"
    ]

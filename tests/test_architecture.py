"""The component graph of docs/architecture.md, read from the source.

No server and no event loop: every module of the product is parsed (not
imported) and its imports, lazy ones included, checked against the rules the
architecture promises:

- a component imports only the components :data:`LAYERS` allows it, so the
  graph has no cycle (``contracts`` <- ``core`` <- the services <- ``sdk``,
  ``gateway``, ``cli``; see the document for why the engine sits above the
  journal and the journal above inputs);
- no module imports another component's private module (``dagnats.sdk._rpc``
  from the gateway): what components share is in ``core`` or public API;
- no module imports its way back to itself (no import cycle inside a component);
- a rule module (:data:`RULE_MODULES`) reaches no ``grpc``, ``nats`` or
  ``asyncio`` in its import closure: rules take data and return decisions;
- only the adapters (:data:`NATS_MODULES`) import ``nats``: every JetStream and
  NATS call of a service goes through its one adapter;
- every guard of ``tests/guards.py`` still names code that exists, once.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import guards

ROOT = Path(__file__).resolve().parent.parent
# Source root of each package (pyproject's [tool.setuptools.package-dir]).
PACKAGES = {
    "dagnats.core": "core/dagnats/core",
    "dagnats.cli": "cli/dagnats/cli",
    "dagnats.sdk": "sdk/dagnats/sdk",
    "dagnats.integrations": "sdk/dagnats/integrations",
    "dagnats.engine": "services/engine/dagnats/engine",
    "dagnats.journal": "services/journal/dagnats/journal",
    "dagnats.inputs": "services/inputs/dagnats/inputs",
    "dagnats.gateway": "services/gateway/dagnats/gateway",
}
# Which components each component may import (its own modules always).
LAYERS: dict[str, frozenset[str]] = {
    "contracts": frozenset(),
    "core": frozenset({"contracts"}),
    "inputs": frozenset({"core", "contracts"}),
    "journal": frozenset({"inputs", "core", "contracts"}),
    "engine": frozenset({"journal", "inputs", "core", "contracts"}),
    "sdk": frozenset({"core", "contracts"}),
    "integrations": frozenset({"sdk", "core", "contracts"}),
    "gateway": frozenset({"sdk", "journal", "inputs", "core", "contracts"}),
    "testing": frozenset({"gateway", "engine", "journal", "inputs", "sdk", "core", "contracts"}),
    "cli": frozenset(
        {"testing", "gateway", "engine", "journal", "inputs", "integrations", "sdk"}
        | {"core", "contracts"}
    ),
}
# Data in, decisions out: no transport, no event loop.
RULE_MODULES = (
    "dagnats.core.errors",
    "dagnats.core.ids",
    "dagnats.core.durations",
    "dagnats.core.approvals",
    "dagnats.engine.rules",
    "dagnats.engine.model",
    "dagnats.engine.definition",
    "dagnats.engine.graph",
    "dagnats.engine.access",
    "dagnats.journal.replay",
    "dagnats.journal.audit",
    "dagnats.journal.model",
    "dagnats.journal.limits",
    "dagnats.inputs.rules",
    "dagnats.core.partitions",
    "dagnats.engine.partition_rules",
)
FORBIDDEN_IN_RULES = frozenset({"grpc", "nats", "asyncio"})
# The modules that may import nats-py: the adapters, the NATS endpoints of the
# inputs service, core's connection, provisioning and server fixture, and the
# partition leases (the replicas' beats and the PARTITIONS bucket).
NATS_MODULES = frozenset(
    {
        "dagnats.core.jetstream",
        "dagnats.core.natsauth",
        "dagnats.engine.store",
        "dagnats.engine.server",
        "dagnats.engine.ownership",
        "dagnats.journal.store",
        "dagnats.inputs.store",
        "dagnats.inputs.natsapi",
    }
)
# Known departures from the rules above, each to be removed by the change that
# fixes it: (rule, importer, imported).
KNOWN: frozenset[tuple[str, str, str]] = frozenset()


@dataclass(frozen=True, slots=True)
class Import:
    importer: str
    name: str  # the module imported, or for ``from m import x`` m.x when it is a module
    line: int
    typing_only: bool  # under ``if TYPE_CHECKING:``: never run


def component(module: str) -> str | None:
    """The component a dagnats module belongs to; None outside the product."""
    parts = module.split(".")
    if parts[0] != "dagnats" or len(parts) < 2:
        return None
    if len(parts) > 2 and parts[2] == "v1":
        return "contracts"
    if module == "dagnats.sdk.testing" or module.startswith("dagnats.sdk.testing."):
        return "testing"
    return parts[1] if f"dagnats.{parts[1]}" in PACKAGES else None


def modules() -> dict[str, Path]:
    """Every hand-written module of the product, by name."""
    found = {}
    for package, root in PACKAGES.items():
        for path in sorted((ROOT / root).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = path.relative_to(ROOT / root).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


MODULES = modules()


def _imports(name: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    typing_only = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in node.body
        for child in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        only = id(node) in typing_only
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, alias.name, node.lineno, only)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            submodules = [f"{base}.{a.name}" for a in node.names]
            submodules = [s for s in submodules if s in MODULES or _is_contract(s)]
            # ``from package import module`` imports the module, not what the
            # package's __init__ re-exports.
            if len(submodules) < len(node.names):
                yield Import(name, base, node.lineno, only)
            for sub in submodules:
                yield Import(name, sub, node.lineno, only)


def _is_contract(name: str) -> bool:
    return component(name) == "contracts"


IMPORTS = {name: list(_imports(name, path)) for name, path in MODULES.items()}


def _known(rule: str, found: list[tuple[str, str, str]]) -> list[str]:
    return [f"{a} -> {b}" for r, a, b in found if (rule, a, b) not in KNOWN]


def test_every_component_imports_only_what_its_layer_allows() -> None:
    found = []
    for name, imports in IMPORTS.items():
        own = component(name)
        assert own is not None, name
        for imp in imports:
            other = component(imp.name)
            if other is None or other == own:
                continue
            if other not in LAYERS[own]:
                found.append(("layer", name, imp.name))
    assert _known("layer", found) == []


def test_the_layers_have_no_cycle() -> None:
    def reaches(start: str, target: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(
            c == target or (c not in seen and reaches(c, target, seen | {c})) for c in LAYERS[start]
        )

    assert [c for c in LAYERS if reaches(c, c)] == []


def test_no_component_imports_another_components_private_module() -> None:
    found = []
    for name, imports in IMPORTS.items():
        for imp in imports:
            parts = imp.name.split(".")
            if parts[0] != "dagnats" or component(imp.name) in (None, "contracts"):
                continue
            private = any(p.startswith("_") and not p.startswith("__") for p in parts[2:])
            if private and parts[:2] != name.split(".")[:2]:
                found.append(("private", name, imp.name))
    assert _known("private", found) == []


def test_no_module_imports_its_way_back_to_itself() -> None:
    graph = {
        name: {
            i.name for i in imports if i.name in MODULES and i.name != name and not i.typing_only
        }
        for name, imports in IMPORTS.items()
    }
    cycles = _strongly_connected(graph)
    assert [sorted(c) for c in cycles if len(c) > 1] == []


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of ``graph``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.add(member)
                if member == node:
                    break
            found.append(members)

    for node in graph:
        if node not in index:
            visit(node)
    return found


def closure(module: str) -> dict[str, str]:
    """Every module ``module`` imports, directly or through other dagnats
    modules, each with the dagnats module that imports it."""
    reached: dict[str, str] = {}
    todo = [module]
    while todo:
        current = todo.pop()
        for imp in IMPORTS.get(current, ()):
            if imp.name not in reached:
                reached[imp.name] = current
                if imp.name in MODULES:
                    todo.append(imp.name)
    return reached


@pytest.mark.parametrize("rule_module", RULE_MODULES)
def test_a_rule_module_reaches_no_transport_and_no_event_loop(rule_module: str) -> None:
    assert rule_module in MODULES
    found = sorted(
        f"{name} (imported by {by})"
        for name, by in closure(rule_module).items()
        if name.split(".")[0] in FORBIDDEN_IN_RULES
        and ("rule", rule_module, name.split(".")[0]) not in KNOWN
    )
    assert found == []


def test_only_the_adapters_import_nats() -> None:
    found = [
        ("nats", name, imp.name)
        for name, imports in IMPORTS.items()
        for imp in imports
        if imp.name.split(".")[0] == "nats" and name not in NATS_MODULES
    ]
    assert sorted(set(_known("nats", found))) == []


def test_every_known_departure_is_still_there() -> None:
    """An entry of ``KNOWN`` that no longer happens is removed with its fix."""
    happening = set()
    for name, imports in IMPORTS.items():
        for imp in imports:
            top = imp.name.split(".")[0]
            happening |= {
                ("layer", name, imp.name),
                ("private", name, imp.name),
                ("nats", name, imp.name),
            }
            if top in FORBIDDEN_IN_RULES:
                happening |= {("rule", r, top) for r in RULE_MODULES if name in closure(r)}
            if name in RULE_MODULES and top in FORBIDDEN_IN_RULES:
                happening.add(("rule", name, top))
    assert sorted(KNOWN - happening) == []


@pytest.mark.parametrize("guard", guards.GUARDS, ids=lambda g: g.name)
def test_every_guard_still_names_its_code_once(guard: guards.Guard) -> None:
    text = (ROOT / guard.file).read_text()
    assert text.count(guard.guard) == 1, f"{guard.file} no longer holds the guard's code"
    for test in guard.tests:
        path, _, name = test.partition("::")
        function = name.partition("[")[0]  # a parametrized case names its function first
        assert f"def {function}(" in (ROOT / path).read_text(), test

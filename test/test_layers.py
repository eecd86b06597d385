"""The package's stages import only the stages below them (docs/design.md, "Stages")."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torch_xla_bridge"

# Each module, and the package modules it may import (at module level or inside a function).
ALLOWED = {
    "backend": {
        "fused_step", "accumulation", "rollback", "deferred", "dynamo_bridge", "optimizer_sync", "dynamo_fallback",
        "spmd_tracing", "grad_sync", "in_flight", "host_scalars", "decompositions", "counting", "_private", "names",
    },
    "replay": {"fused_step", "deferred", "host_tape", "counting", "_private", "names"},
    "fused_step": {
        "accumulation", "rollback", "deferred", "dynamo_bridge", "optimizer_sync", "dynamo_fallback", "grad_sync",
        "in_flight", "counting", "_private", "names",
    },
    "accumulation": {"deferred", "grad_sync", "counting", "_private", "names"},
    "rollback": {"grad_sync", "program_memory", "counting", "_private", "names"},
    "deferred": {"grad_sync", "host_scalars", "counting", "_private", "names"},
    "dynamo_bridge": {"grad_sync", "_private", "names"},
    "optimizer_sync": {"dynamo_fallback", "grad_sync", "in_flight", "rollback", "counting", "_private", "names"},
    "dynamo_fallback": {"grad_sync", "counting", "_private", "names"},
    "spmd_tracing": {"_private", "names"},
    "grad_sync": {"counting", "_private", "names"},
    "in_flight": {"_private", "names"},
    "host_scalars": set(),
    "host_tape": {"_private"},
    "program_memory": set(),
    "decompositions": set(),
    "counting": {"_private", "names"},
    "_private": {"names"},
    "names": set(),
}


def package_imports(path: pathlib.Path) -> set[str]:
    """The package modules ``path`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch_xla_bridge"):
            found.add(node.module.split(".")[1] if "." in node.module else node.names[0].name)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("torch_xla_bridge."))
    return found


def test_every_core_module_is_in_the_table():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(ALLOWED)


def test_each_stage_imports_only_the_stages_below_it():
    for module, allowed in ALLOWED.items():
        imported = package_imports(PACKAGE / f"{module}.py")
        assert imported <= allowed, f"{module}.py imports {sorted(imported - allowed)}"


def test_the_names_module_is_a_leaf_importing_nothing():
    tree = ast.parse((PACKAGE / "names.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_no_core_module_imports_the_explain_tool():
    for module in ALLOWED:
        assert "explain" not in package_imports(PACKAGE / f"{module}.py"), module

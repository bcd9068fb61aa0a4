"""``gateway`` imports only itself, ``common``, ``protos`` and third-party packages: never
torch, ``worker``, ``inflight`` (the CLI layer) or ``stack`` (the gateway image installs
no torch, and the layers below must not depend on the ones above)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import gateway
from tests.helpers.source_ast import parse_file

FORBIDDEN = ("torch", "worker", "inflight", "stack")
GATEWAY_DIR = pathlib.Path(gateway.__file__).parent


def _imported(tree: ast.AST) -> set[str]:
    """Top-level package names of every absolute import in ``tree``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_gateway_module_names_a_forbidden_package():
    found = {str(path.relative_to(GATEWAY_DIR)): sorted(_imported(parse_file(path)) & set(FORBIDDEN))
             for path in GATEWAY_DIR.rglob("*.py")}
    assert {path: names for path, names in found.items() if names} == {}


def test_importing_the_gateway_loads_none_of_them():
    code = ("import sys, gateway.main, gateway.rest.app, gateway.grpc_server\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=GATEWAY_DIR.parent, check=True).stdout
    assert out.strip() == "[]"

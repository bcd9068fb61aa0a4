"""The layout's import rules (README "Layout", docs/DESIGN.md): which package may import
which, the worker's three rooms, and no import cycle anywhere. Read from the source with
``ast`` (imports inside functions count too), so nothing is imported to check it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest
from tests.helpers.source_ast import parse_file

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protos", "common", "inflight_kernels", "gateway", "worker", "stack", "bench", "inflight", "nginx")
#: package -> the project packages it may import (the ground floor first, the CLI last).
MAY_IMPORT = {
    "protos": set(),
    "nginx": set(),
    "common": {"protos"},
    "inflight_kernels": {"common"},
    "gateway": {"common", "protos"},
    "worker": {"common", "inflight_kernels", "protos"},
    "stack": {"common", "protos", "nginx"},
    "bench": {"common", "inflight_kernels", "protos", "stack", "worker"},
    "inflight": {"bench", "common", "gateway", "nginx", "protos", "stack", "worker"},
}
#: worker room -> the worker rooms it may import (worker/runner_io.py is the engine <-> runner contract).
WORKER_MAY_IMPORT = {
    "worker.runner_io": set(),
    "worker.engine": {"worker.runner_io"},
    "worker.model": {"worker.runner_io"},
    "worker.serve": {"worker.engine", "worker.model", "worker.runner_io"},
}
#: third-party packages a package must never import.
FORBIDDEN_LIBS = {"gateway": {"torch"}, "common": {"torch"}, "stack": {"torch"}}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module ``path`` imports (``from pkg import mod`` resolved to ``pkg.mod``)."""
    found = set()
    for node in ast.walk(parse_file(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) for name, path in modules.items()}


def _top(name: str) -> str:
    return name.split(".")[0]


def test_packages_import_only_the_floors_below(graph):
    bad = sorted(f"{mod} imports {dep}" for mod, deps in graph.items() for dep in deps
                 if _top(dep) in MAY_IMPORT and _top(dep) != _top(mod) and _top(dep) not in MAY_IMPORT[_top(mod)])
    assert not bad, "\n".join(bad)


def test_forbidden_libraries(graph):
    bad = sorted(f"{mod} imports {dep}" for mod, deps in graph.items() for dep in deps
                 if _top(dep) in FORBIDDEN_LIBS.get(_top(mod), ()))
    assert not bad, "\n".join(bad)


def _room(name: str) -> str | None:
    return next((room for room in WORKER_MAY_IMPORT if name == room or name.startswith(room + ".")), None)


def test_worker_rooms(graph):
    bad = []
    for mod, deps in graph.items():
        room = _room(mod)
        for dep in deps:
            target = _room(dep)
            if room and target and target != room and target not in WORKER_MAY_IMPORT[room]:
                bad.append(f"{mod} imports {dep}")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles(graph):
    """Depth-first search for a back edge in the module graph (packages' ``__init__``
    count as modules; an import of ``a.b.c`` also runs ``a`` and ``a.b``)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, deps in graph.items():
        edges[mod] = {d for d in deps if d in graph and d != mod and not mod.startswith(d + ".")}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else path + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            pytest.fail("import cycle: " + " -> ".join(cycle))


#: gateway part -> gateway parts it must never import: admission decides before anything is
#: queued, so it names the streams through common/redis_keys.py, not the queue (issue 50 item 6).
GATEWAY_MUST_NOT_IMPORT = {"gateway.admission": {"gateway.queue"}}


def test_gateway_admission_does_not_reach_into_the_queue(graph):
    bad = sorted(f"{mod} imports {dep}" for mod, deps in graph.items() for dep in deps
                 for part, banned in GATEWAY_MUST_NOT_IMPORT.items()
                 if (mod == part or mod.startswith(part + ".")) and any(dep == b or dep.startswith(b + ".")
                                                                         for b in banned))
    assert not bad, "\n".join(bad)


#: inflight_kernels' backend queries the worker must not branch on: the choice of path is the
#: kernels' own (attention: inflight_kernels.decode_attention, decode_plan, prefill_as_decode,
#: decode_stack, compiled_step_gaps; the fused layer ops: fused_layer_ops; the sampler:
#: fused_sampler, which hand out the compiled op or None; issue 50 item 3).
KERNEL_CHOICES = {"attention_backend", "layer_ops_backend", "sampler_backend"}


def test_the_worker_does_not_ask_which_backend_runs():
    bad = sorted(f"{path.relative_to(ROOT)}:{node.lineno} {node.attr}" for path in (ROOT / "worker").rglob("*.py")
                 for node in ast.walk(parse_file(path))
                 if isinstance(node, ast.Attribute) and node.attr in KERNEL_CHOICES)
    bad += sorted(f"{path.relative_to(ROOT)} imports {alias.name}" for path in (ROOT / "worker").rglob("*.py")
                  for node in ast.walk(parse_file(path)) if isinstance(node, ast.ImportFrom)
                  for alias in node.names if alias.name in KERNEL_CHOICES)
    assert not bad, "\n".join(bad)

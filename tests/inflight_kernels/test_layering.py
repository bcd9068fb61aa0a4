"""The import direction of issue 22: the model reaches the kernels through
``inflight_kernels.*`` only (never a backend module), and ``kernels`` imports nothing
from ``worker``. Parsed with ast, so nothing is imported."""

import ast
from pathlib import Path

import pytest
from tests.helpers.source_ast import parse_file

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(parse_file(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "inflight_kernels").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_import_nothing_from_worker(path):
    assert not [n for n in _imports(path) if n == "worker" or n.startswith("worker.")]


@pytest.mark.parametrize("path", sorted((ROOT / "worker" / "model").glob("*.py")), ids=lambda p: p.name)
def test_the_model_calls_kernels_through_the_package_only(path):
    backends = {n for n in _imports(path) if n.startswith("kernels.")
                and not (n == "inflight_kernels.reference" or n.startswith("inflight_kernels.reference."))}
    assert not backends  # the torch reference (shared layer math) is the one module allowed besides the package


def test_importing_kernels_leaves_the_build_module_to_python_m():
    """``python -m inflight_kernels.cpu.build`` (make install, the worker image) runs a
    second copy of the module, with its own load cache, if ``import inflight_kernels``
    already imported it."""
    import subprocess
    import sys

    code = "import sys, kernels, worker.model.llama; assert 'inflight_kernels.cpu.build' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)

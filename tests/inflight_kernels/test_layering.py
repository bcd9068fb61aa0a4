"""The import direction of issue 22: the model reaches the kernels through the
``inflight_kernels`` package's own names only (never a backend module such as
``inflight_kernels.cpu`` or ``inflight_kernels.dispatch``), and ``inflight_kernels``
imports nothing from ``worker``. Parsed with ast, so nothing is imported."""

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


PACKAGE = "inflight_kernels"
# The torch reference (shared layer math) is the one module allowed besides the package.
ALLOWED_SUBMODULES = {"reference"}
SUBMODULES = {p.stem for p in (ROOT / PACKAGE).iterdir()
              if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}


def _backend_imports(names: set[str]) -> set[str]:
    """The names in ``names`` that reach a submodule of ``inflight_kernels`` other than
    the reference: ``inflight_kernels.cpu``, ``inflight_kernels.cuda.ops.x``,
    ``inflight_kernels.dispatch``. ``inflight_kernels.rms_norm`` (a package name) is not one."""
    found = set()
    for name in names:
        parts = name.split(".")
        if parts[0] == PACKAGE and len(parts) > 1 and parts[1] in SUBMODULES - ALLOWED_SUBMODULES:
            found.add(name)
    return found


def test_the_backend_filter_sees_backend_imports():
    """The filter below is not vacuous: it knows the package's backends and flags them."""
    assert {"cpu", "cuda", "dispatch", "reference"} <= SUBMODULES
    assert _backend_imports({"inflight_kernels", "inflight_kernels.rms_norm", "inflight_kernels.reference.silu_mul",
                             "inflight_kernels.cpu", "inflight_kernels.cuda.ops.paged_attention",
                             "inflight_kernels.dispatch", "kernels.cpu"}) == {
        "inflight_kernels.cpu", "inflight_kernels.cuda.ops.paged_attention", "inflight_kernels.dispatch"}


@pytest.mark.parametrize("path", sorted((ROOT / "worker" / "model").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT / "worker" / "model")))
def test_the_model_calls_kernels_through_the_package_only(path):
    assert not _backend_imports(_imports(path))


def test_importing_kernels_leaves_the_build_module_to_python_m():
    """``python -m inflight_kernels.cpu.build`` (make install, the worker image) runs a
    second copy of the module, with its own load cache, if ``import inflight_kernels``
    already imported it. (``import kernels`` would load Hugging Face's ``kernels``
    package, a dependency of transformers, not ours: the file is checked too.)"""
    import subprocess
    import sys

    code = ("import sys, inflight_kernels, worker.model.llama; "
            f"assert inflight_kernels.__file__ == {str(ROOT / PACKAGE / '__init__.py')!r}, inflight_kernels.__file__; "
            "assert 'inflight_kernels.cpu.build' not in sys.modules, 'build imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)

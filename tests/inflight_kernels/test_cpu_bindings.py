"""The compiled CPU ops' Python bindings."""

from __future__ import annotations

from pathlib import Path


def test_every_compiled_cpu_op_releases_the_gil():
    """Each binding in the extension's module block carries the GIL-release guard
    (inflight_kernels/cpu/paged_attention.cpp): a kernel holding the GIL stalls the worker's
    asyncio thread for its whole run."""
    source = (Path(__file__).parents[2] / "inflight_kernels" / "cpu" / "paged_attention.cpp").read_text()
    block = source[source.index("PYBIND11_MODULE"):]
    defs = [line for line in block.splitlines() if "m.def(" in line]
    assert len(defs) >= 6 and all("release_gil()" in line for line in defs)

"""The compiled CPU ops' Python bindings."""

from __future__ import annotations

from pathlib import Path

from inflight_kernels.cpu import build

CPU = Path(__file__).parents[2] / "inflight_kernels" / "cpu"


def test_every_compiled_cpu_op_releases_the_gil():
    """Each binding in the extension's module block carries the GIL-release guard
    (inflight_kernels/cpu/module.cpp): a kernel holding the GIL stalls the worker's
    asyncio thread for its whole run."""
    source = (CPU / "module.cpp").read_text()
    block = source[source.index("PYBIND11_MODULE"):]
    defs = [line for line in block.splitlines() if "m.def(" in line]
    assert len(defs) >= 6 and all("release_gil()" in line for line in defs)


def test_the_module_block_lives_in_module_cpp_alone():
    """No op's source holds the module block (issue 50: paged_attention.cpp's block called
    decode_stack.cpp's registration while decode_stack.cpp called paged_attention.cpp's op, a
    loop between two op files). module.cpp binds every op and calls DecodeStack's own class
    binding; nothing else calls that."""
    assert CPU / "module.cpp" in build.SOURCES
    for source in build.SOURCES:
        text = source.read_text()
        if source.name == "module.cpp":
            assert "PYBIND11_MODULE" in text and "register_decode_stack(m)" in text
        else:
            assert "PYBIND11_MODULE" not in text, source.name
            assert "register_decode_stack(m)" not in text, source.name

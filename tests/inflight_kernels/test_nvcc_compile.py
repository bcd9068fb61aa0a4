"""Every CUDA source compiles with nvcc for sm_80 and sm_90, warnings as errors.

One nvcc run per (.cu, arch) instantiates every (dtype, head size, block size)
configuration (-DINFLIGHT_INSTANTIATE_ALL). A last run takes the address of each
runtime name expression (inflight_kernels.cuda.build.kernel_names) so the strings CuPy hands
to NVRTC are checked to name real instantiations.
"""

from __future__ import annotations

import shutil
import subprocess
from itertools import product

import pytest

from inflight_kernels.cuda import build

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CUDA toolkit absent)")

ARCHS = ("sm_80", "sm_90")


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", sorted(build.SOURCES))
def test_compiles_all_configs(op, arch, tmp_path):
    out = tmp_path / f"{op}.{arch}.cubin"
    _run(build.nvcc_command(op, arch, out))
    assert out.stat().st_size > 0


def test_runtime_name_expressions_instantiate(tmp_path):
    refs = []
    for op, dtype, head, block in product(build.SOURCES, build.DTYPES, build.HEAD_SIZES, build.BLOCK_SIZES):
        refs += [f"  (void*)&{name}," for name in build.kernel_names(op, dtype, head, block).values()]
    src = tmp_path / "names.cu"
    src.write_text('#include "paged_attention.cu"\n#include "reshape_and_cache.cu"\n'
                   "void* inflight_kernel_table[] = {\n" + "\n".join(refs) + "\n};\n")
    _run(["nvcc", *build.runtime_options(), "-arch=sm_90", "-ptx", "-Werror", "all-warnings",
          "-o", str(tmp_path / "names.ptx"), str(src)])
    assert "paged_attention_reduce_kernel" in (tmp_path / "names.ptx").read_text()

"""The compiled CPU kernels (``kernels/cpu/*.cpp``: paged decode attention, the
K/V cache write and the fused element-wise layer ops), built on first use with
``torch.utils.cpp_extension.load`` and cached on disk.

The build takes about a minute on 2 cores the first time (``make install``
does it ahead: ``python -m kernels.cpu.build``); later loads take well under a
second. Instruction sets are turned on one by one from the CPU's flags
(AVX-512 F/BW/VL/DQ/VNNI/BF16, AVX2, FMA, F16C) rather than with ``-march=native``: under a
hypervisor the CPUID flags and what the vCPU executes can disagree (a
``GGML_NATIVE=ON`` llama.cpp build died here with an illegal instruction), so
the build never asks the compiler for more than those flags, and a fresh build
is run once in a child process on a tiny case before this process loads it. The
cache directory is keyed by the CPU's flags, so another CPU builds its own
copy. ``INFLIGHT_CPU_ISA=avx2`` or ``=scalar`` builds for at most that
instruction set (to test or time another build on this CPU, or to build for an
older fleet). Without a C++ compiler, when the smoke run fails, or with
``INFLIGHT_CPU_KERNELS=0``, :func:`available` is False and callers keep the
torch code paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

SOURCES = tuple(Path(__file__).resolve().parent / name for name in ("paged_attention.cpp", "layer_ops.cpp", "q8_gemm.cpp"))
HEADERS = tuple(Path(__file__).resolve().parent / name  # in the cache key, not compiled alone
                for name in ("scalar.h", "simd_avx512.h", "simd_avx2.h", "simd_exp.h", "attention_simd.h",
                             "attention_scalar.h"))
ENV_SWITCH = "INFLIGHT_CPU_KERNELS"  # "0" turns the compiled kernels off
CACHE_ENV = "INFLIGHT_CPU_KERNELS_DIR"  # default ~/.cache/inflight/cpu_kernels
HEAD_DIMS = (32, 64, 96, 128, 256)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MODULE_NAME = "inflight_cpu_kernels"
# /proc/cpuinfo flag -> gcc option; the AVX-512 code paths need all of the first four, the Q8_0
# GEMM's vpdpbusd path also VNNI, the bf16 attention scores' vdpbf16ps path BF16.
ISA_OPTIONS = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
               "avx512dq": "-mavx512dq", "avx512_vnni": "-mavx512vnni", "avx512_bf16": "-mavx512bf16",
               "avx2": "-mavx2", "fma": "-mfma", "f16c": "-mf16c"}
ISA_ENV = "INFLIGHT_CPU_ISA"  # "avx2" or "scalar": the most the build may use; unset = all the CPU lists
ISA_CAPS = {"avx512": lambda flag: True, "avx2": lambda flag: not flag.startswith("avx512"),
            "scalar": lambda flag: flag not in ISA_OPTIONS}
SMOKE_TIMEOUT_S = 600  # build (about a minute on 2 cores) plus the smoke run, in the child
STALE_LOCK_S = 900  # torch's build lock left by a killed build waits forever; older than this, it is removed
log = logging.getLogger(__name__)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _isa_flags() -> set[str]:
    """The CPU's flags, less those above ``$INFLIGHT_CPU_ISA``.

    Raises:
        ValueError: ``INFLIGHT_CPU_ISA`` is set to something other than avx512, avx2 or scalar.
    """
    cap = os.environ.get(ISA_ENV, "avx512").strip().lower() or "avx512"
    if cap not in ISA_CAPS:
        raise ValueError(f"{ISA_ENV}={cap!r}: expected one of {', '.join(ISA_CAPS)}")
    return {flag for flag in _cpu_flags() if ISA_CAPS[cap](flag)}


def compile_options() -> list[str]:
    """gcc options: -O3, OpenMP, and the ISA options whose flags the CPU lists
    (capped by ``$INFLIGHT_CPU_ISA``).
    ``-ffp-contract=off``: no implicit fused multiply-adds, so the element-wise
    ops round like the torch ops they replace (explicit FMA intrinsics stay).
    ``-fopenmp`` because ``at::parallel_for`` is a header template (without it
    the kernel runs on one thread); ``libgomp.so.1`` then resolves to the copy
    torch already loaded, so both share one thread pool."""
    flags = _isa_flags()
    return ["-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off", "-fopenmp",
            *(opt for flag, opt in ISA_OPTIONS.items() if flag in flags)]


def build_dir() -> Path:
    """Where the built module lives: ``$INFLIGHT_CPU_KERNELS_DIR`` or
    ``~/.cache/inflight/cpu_kernels``, then a folder per torch version, CPU,
    compile options and sources (path and contents)."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "inflight" / "cpu_kernels")
    # The sources' paths and contents too: torch rebuilds a module whose build folder last saw other
    # sources, so two checkouts sharing one folder would rebuild on every alternate use.
    sources = [f"{p}:{hashlib.sha256(p.read_bytes()).hexdigest()}" for p in SOURCES + HEADERS]
    key = "\n".join([platform.machine(), *sorted(_cpu_flags()), *compile_options(), *sources])
    return root / f"torch-{torch.__version__}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _build(folder: Path) -> ModuleType:
    from torch.utils.cpp_extension import load as load_extension

    lock = folder / "lock"  # torch.utils.file_baton.FileBaton: a killed build leaves it behind
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            log.warning("removed a stale CPU-kernel build lock (%s)", lock)
    except FileNotFoundError:
        pass
    venv_bin = str(Path(sys.executable).parent)  # the `ninja` wheel's binary, when the venv is not activated
    if shutil.which("ninja") is None and (Path(venv_bin) / "ninja").exists():
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")

    return load_extension(name=MODULE_NAME, sources=[str(p) for p in SOURCES], extra_cflags=compile_options(),
                          extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)


SMOKE_MISMATCH_EXIT = 3  # the child's exit status when an op disagrees with torch


def _smoke_ok(folder: Path) -> bool:
    """Build (if needed) and run the kernel on a tiny case in a child process,
    once per build (stamp file); an illegal instruction kills only the child.

    A build whose ops disagree with torch, or whose child died of a signal
    (e.g. SIGILL), is remembered in ``smoke-failed-<digest>`` beside it, so
    later starts skip the minute of building and checking; delete that file
    to try again. A timeout or a compile error is not remembered (a loaded
    machine or a missing compiler can change)."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()[:12]
    stamp, failed = folder / f"smoke-ok-{digest}", folder / f"smoke-failed-{digest}"
    if stamp.exists():
        return True
    if failed.exists():
        log.warning("CPU kernels failed their smoke run before (%s: %s); using the torch paths; "
                    "delete that file to try again", failed, failed.read_text().strip())
        return False
    code = (f"import kernels.cpu.ops as c, sys; sys.exit(0 if c._smoke_in_process() else {SMOKE_MISMATCH_EXIT})")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SOURCES[0].parents[2]), os.environ.get("PYTHONPATH", "")]))
    try:
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                timeout=SMOKE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("CPU kernels: build + smoke run took over %d s; using the torch paths", SMOKE_TIMEOUT_S)
        return False
    if result.returncode != 0:
        reason = (f"exit {result.returncode}: "
                  f"{(result.stderr.strip().splitlines() or ['results differ from torch'])[-1]}")
        log.warning("CPU kernels failed their smoke run (%s)", reason)
        if result.returncode == SMOKE_MISMATCH_EXIT or result.returncode < 0:
            failed.write_text(reason + "\n")
        return False
    stamp.touch()
    return True


def _smoke_in_process() -> bool:
    """Every compiled op once on random data against the torch code it
    replaces: three pages (16-row tiles and a partial page, so the vector
    tile reduction, exp and softmax loops all run), each dtype."""
    from kernels import reference
    from worker.model.layers import rms_norm as torch_rms_norm
    from worker.model.layers import swiglu

    module = _build(build_dir())
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        q = torch.randn(2, 6, 64, generator=g).to(dtype)
        kc, vc = (torch.randn(4, 2, 16, 64, generator=g).to(dtype) for _ in range(2))
        tables = torch.tensor([[2, 0, 3], [1, 3, 0]], dtype=torch.int32)
        lens = torch.tensor([40, 33], dtype=torch.int32)
        out = torch.empty_like(q)
        module.paged_attention_decode(out, q, kc, vc, tables, lens, 0.125)
        ref = reference.paged_attention(q.float(), kc.float(), vc.float(), tables, lens, 0.125)
        x, w = torch.randn(3, 64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
        normed = torch.empty_like(x)
        module.rms_norm(normed, x, w, 1e-5)
        gate_up = torch.randn(3, 128, generator=g).to(dtype)
        act = torch.empty(3, 64, dtype=dtype)
        module.silu_mul(act, gate_up)
        if not (torch.allclose(out.float(), ref, atol=tol, rtol=tol)
                and torch.allclose(normed.float(), torch_rms_norm(x, w, 1e-5).float(), atol=tol, rtol=tol)
                and torch.allclose(act.float(), swiglu(gate_up).float(), atol=tol, rtol=tol)):
            return False
    return _smoke_float32_query(module, g) and _smoke_q8(module, g)


def _smoke_float32_query(module: ModuleType, g: torch.Generator) -> bool:
    """The float32-query-over-float16-cache instantiation (``--kv-cache-dtype
    auto`` under float32 compute) against the oracle on the widened cache."""
    from kernels import reference

    q = torch.randn(2, 6, 64, generator=g)
    kc, vc = (torch.randn(4, 2, 16, 64, generator=g).half() for _ in range(2))
    tables = torch.tensor([[2, 0, 3], [1, 3, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 33], dtype=torch.int32)
    out = torch.empty_like(q)
    module.paged_attention_decode(out, q, kc, vc, tables, lens, 0.125)
    ref = reference.paged_attention(q, kc.float(), vc.float(), tables, lens, 0.125)
    return torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def _smoke_q8(module: ModuleType, g: torch.Generator) -> bool:
    """The Q8_0 GEMM (a partial column tile and a partial row group) against its oracle."""
    from kernels import reference

    x, w = torch.randn(6, 64, generator=g), torch.randn(13, 64, generator=g)
    packed, scales = module.q8_pack_weight(w)
    out = torch.empty(6, 13)
    module.q8_linear(out, x, packed, scales)
    return torch.allclose(out, reference.q8_0_linear(x, w), atol=1e-4, rtol=1e-4)


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None when turned off, when the build fails or
    when its smoke run fails (logged once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        if not _smoke_ok(folder):
            return None
        module = _build(folder)
        log.info("CPU kernels loaded from %s", folder)
        return module
    except Exception as exc:  # no compiler / ninja, or a compile error: keep the torch paths
        log.warning("CPU kernels unavailable (%s: %s); using the torch paths", type(exc).__name__,
                    (str(exc).splitlines() or [""])[0])
        return None


def available() -> bool:
    """True when the compiled kernels load on this machine."""
    return load() is not None


def vector_isa() -> str | None:
    """The instruction set the decode attention was compiled for: "avx512",
    "avx2" (with FMA and F16C) or "scalar"; None when the kernels are not
    :func:`available`."""
    module = load()
    return None if module is None else str(getattr(module, "vector_isa", "scalar"))


def fast_attention() -> bool:
    """True when the compiled kernels are :func:`available` and their decode
    attention is a vector build, AVX-512 or AVX2 (see :func:`supports`)."""
    return available() and vector_isa() in ("avx512", "avx2")


def bf16_dot() -> bool:
    """True when the compiled decode attention has the AVX-512 BF16 path
    (``vdpbf16ps``) for a bfloat16 query over a bfloat16 cache."""
    module = load()
    return module is not None and bool(getattr(module, "bf16_dot", False))


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """True when :func:`paged_attention` handles these dtypes and head size
    and was compiled with AVX-512 or AVX2 (its portable scalar build is
    correct but slower than the torch paths, so those keep the job on other
    CPUs)."""
    return (fast_attention() and not query.is_cuda
            and key_cache.dtype in DTYPES and query.shape[-1] in HEAD_DIMS and key_cache.shape[1] > 0
            and query.shape[1] % key_cache.shape[1] == 0 and query.shape[1] // key_cache.shape[1] <= 64)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    out: torch.Tensor) -> torch.Tensor:
    """Paged decode attention in C++ (``kernels/cpu/paged_attention.cpp``),
    contract of :func:`kernels.reference.paged_attention`.

    ``query`` ``[S, H, D]`` (in the cache dtype, or float32: another dtype
    is widened to float32, never rounded to the cache's), caches
    ``[num_blocks, KVH, block_size, D]`` (float32, bfloat16 or float16),
    ``block_tables`` ``[S, max_blocks]`` and ``context_lens`` ``[S]`` (made
    int32 and contiguous here), ``out`` ``[S, H, D]``. Scores, softmax and
    ``P V`` accumulate in float32; the result is rounded once to ``out``'s
    dtype. Work is proportional to ``Σ context_lens`` (no padding); context
    lengths are clamped to ``max_blocks * block_size`` and 0 gives zeros.

    Raises:
        RuntimeError: kernels unavailable (check :func:`available` first) or
            mismatched shapes/dtypes (from the C++ checks).
    """
    module = _module()
    q_dtype = query.dtype if query.dtype == key_cache.dtype else torch.float32  # widening loses nothing
    q = query.to(q_dtype).contiguous()
    target = out if out.dtype == q_dtype and out.is_contiguous() else torch.empty_like(q)
    module.paged_attention_decode(target, q, key_cache, value_cache, block_tables.to(torch.int32).contiguous(),
                                  context_lens.to(torch.int32).contiguous(), float(scale))
    if target is not out:
        out.copy_(target)
    return out


def _module() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("CPU kernels are not available")
    return module


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Contract of :func:`kernels.reference.reshape_and_cache` (in place),
    in C++: ``key``/``value`` ``[N, KVH, D]`` (rows may be strided, e.g.
    views into a fused qkv; cast to the cache dtype), caches
    ``[num_blocks, KVH, block_size, D]``, ``slot_mapping`` ``[N]`` int
    (negative = skip).

    Raises:
        RuntimeError: kernels unavailable, a slot beyond the cache, or
            mismatched shapes/dtypes.
    """
    key, value = (t.to(key_cache.dtype) for t in (key, value))
    if key.stride(-1) != 1 or key.stride(1) != key.shape[2]:
        key = key.contiguous()
    if value.stride(-1) != 1 or value.stride(1) != value.shape[2]:
        value = value.contiguous()
    _module().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.to(torch.int64).contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`worker.model.layers.rms_norm` in one pass: ``x`` ``[N, hidden]``
    (rows may be strided), ``weight`` ``[hidden]``, same dtype; returns a new
    ``[N, hidden]`` tensor. Raises RuntimeError on mismatched shapes/dtypes."""
    out = torch.empty(x.shape, dtype=x.dtype)
    _module().rms_norm(out, x, weight, float(eps))
    return out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += delta`` in place (rounded to its dtype, as torch's add),
    then :func:`rms_norm` of the sum, returned as a new tensor; all
    ``[N, hidden]`` (``weight`` ``[hidden]``), one dtype."""
    out = torch.empty(residual.shape, dtype=residual.dtype)
    _module().add_rms_norm(residual, delta, out, weight, float(eps))
    return out


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """:func:`worker.model.layers.apply_rope` in place on the first ``heads``
    heads of each fused row of ``qkv`` ``[N, >= heads * head_dim]`` (the q
    heads then the k heads); ``cos``/``sin`` ``[N, head_dim]`` in qkv's dtype."""
    _module().rope_qk(qkv, cos, sin, int(heads), int(head_dim))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`worker.model.layers.swiglu` in one pass: ``gate_up``
    ``[N, 2 * inter]`` -> new ``[N, inter]``, same dtype."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    _module().silu_mul(out, gate_up)
    return out


def q8_pack_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0-quantize ``weight`` ``[N, K]`` (float; K a multiple of 32) and pack
    it for :func:`q8_linear`: int8 ``[ceil(N/8), K/32, 288]`` (per tile and
    block 256 weight bytes, then 8 int32 ``-128 * sum(w)`` for the VNNI path) and float32
    scales ``[ceil(N/8), K/32, 8]`` (``kernels/cpu/q8_gemm.cpp``; padding
    columns are zero). Raises RuntimeError on another K or the kernels missing."""
    return tuple(_module().q8_pack_weight(weight.float().contiguous()))


def q8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """Contract of :func:`kernels.reference.q8_0_linear`: ``x`` ``[M, K]``
    (rows may be strided; cast to float32) against a :func:`q8_pack_weight`
    weight of ``out_features`` rows; returns a new float32 ``[M, out_features]``.
    Raises RuntimeError on mismatched shapes."""
    x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    _module().q8_linear(out, x, packed, scales)
    return out


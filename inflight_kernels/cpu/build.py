"""Build and load the compiled CPU kernels (``inflight_kernels/cpu/*.cpp``: paged decode
attention, the K/V cache write, the fused element-wise layer ops, the Q8_0
GEMM and the token sampler) with ``torch.utils.cpp_extension.load``, cached on disk. The op wrappers
are in :mod:`inflight_kernels.cpu.ops`, the smoke self-test in :mod:`inflight_kernels.cpu.selftest`.

``python -m inflight_kernels.cpu.build`` builds them ahead of the first worker start
(``make install`` and the worker image run it); exit status 1 when they are not
available on this machine (the worker would fall back to the torch paths).

The build takes about a minute on 2 cores the first time; later loads take
well under a second. Instruction sets are turned on one by one from the CPU's
flags (AVX-512 F/BW/VL/DQ/VNNI/BF16, AVX2, FMA, F16C) rather than with
``-march=native``: under a hypervisor the CPUID flags and what the vCPU
executes can disagree (a ``GGML_NATIVE=ON`` llama.cpp build died here with an
illegal instruction), so the build never asks the compiler for more than those
flags, and a fresh build is run once in a child process on a tiny case before
this process loads it. The cache directory is keyed by the CPU's flags, so
another CPU builds its own copy. ``INFLIGHT_CPU_ISA=avx2`` or ``=scalar``
builds for at most that instruction set (to test or time another build on this
CPU, or to build for an older fleet). Without a C++ compiler, when the smoke
run fails, or with ``INFLIGHT_CPU_KERNELS=0``, :func:`load` returns None and
:mod:`inflight_kernels.dispatch` keeps the torch code paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

SOURCES = tuple(Path(__file__).resolve().parent / name for name in ("paged_attention.cpp", "layer_ops.cpp", "q8_gemm.cpp",
                                                                 "q4_gemm.cpp", "dequant_gemm.cpp", "dequant_gemm_bf16.cpp",
                                                                 "sampler.cpp", "decode_stack.cpp",
                                                                 "bf16_gemm.cpp", "kquant_gemm.cpp", "lora_gemm.cpp",
                                                                 "module.cpp"))
HEADERS = tuple(Path(__file__).resolve().parent / name  # in the cache key, not compiled alone
                for name in ("aten_headers.h", "bf16_micro.h", "kquant_avx512.h", "kquant_bf16.h", "kquant_f32.h", "kquant_planes.h", "ops.h", "q8_block.h", "packed_tiles.h", "scalar.h", "simd_avx512.h", "simd_avx2.h", "simd_exp.h", "attention_simd.h",
                             "attention_scalar.h"))
ENV_SWITCH = "INFLIGHT_CPU_KERNELS"  # "0" turns the compiled kernels off
CACHE_ENV = "INFLIGHT_CPU_KERNELS_DIR"  # default ~/.cache/inflight/cpu_kernels
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


def build_module(folder: Path) -> ModuleType:
    """Compile (or, when ``folder`` already holds a build of these sources and
    options, just import) the extension in ``folder`` and return it, without
    the smoke run: :func:`load` is the checked entry point; the self-test
    (:mod:`inflight_kernels.cpu.selftest`) calls this in its child process.

    Raises:
        Exception: whatever ``torch.utils.cpp_extension.load`` raises (no
            compiler or ninja, a compile error).
    """
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
    code = (f"import inflight_kernels.cpu.build as b; b.exit_with_parent({os.getpid()}); "
            f"import inflight_kernels.cpu.selftest as t, sys; sys.exit(0 if t.run() else {SMOKE_MISMATCH_EXIT})")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SOURCES[0].parents[2]), os.environ.get("PYTHONPATH", "")]))
    try:
        result = _run_with_progress([sys.executable, "-c", code], env, folder)
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


def _compiled(folder: Path) -> int:
    """How many of :data:`SOURCES` have an object file in ``folder`` newer than the source
    (ninja writes ``<name>.o`` beside ``build.ninja``)."""
    count = 0
    for source in SOURCES:
        obj = folder / f"{source.stem}.o"
        try:
            count += obj.stat().st_mtime >= source.stat().st_mtime
        except FileNotFoundError:
            pass
    return count


def _run_with_progress(argv: list[str], env: dict[str, str], folder: Path) -> subprocess.CompletedProcess:
    """Run the build-and-smoke child, reporting the sources compiled so far
    (:class:`common.progress.Progress`: a bar on a terminal, a log line every few seconds
    otherwise), since a first build takes minutes on a small machine.

    Raises:
        subprocess.TimeoutExpired: the child ran past :data:`SMOKE_TIMEOUT_S` (it is killed).
    """
    from common.progress import Progress

    with Progress("building the CPU kernels", total=len(SOURCES), unit="sources") as progress:
        started = time.time()
        # its own session, so a timeout kills the compilers (ninja's children) with it
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        deadline = time.monotonic() + SMOKE_TIMEOUT_S
        while True:
            try:
                out, err = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                progress.update(_compiled(folder))
                if time.monotonic() > deadline:
                    _kill_build(proc, folder, started)
                    raise subprocess.TimeoutExpired(argv, SMOKE_TIMEOUT_S) from None
            except BaseException:  # Ctrl-C, SystemExit: the build dies with its caller
                _kill_build(proc, folder, started)
                raise
        progress.update(_compiled(folder))
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def exit_with_parent(parent: int, period_s: float = 1.0) -> None:
    """In the build-and-smoke child (its own session, so a timeout can kill the compilers with
    it): watch for the death of ``parent`` (the process that started the build: a worker, ``make
    install``, a test) and then kill its whole session (:func:`kill_session`), compilers included. Without it a
    parent killed by a signal that runs no cleanup (SIGTERM, SIGKILL) left the compilers running
    as orphans, each holding a gigabyte or more. A daemon thread polling ``os.getppid`` every
    ``period_s`` seconds."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        if os.getsid(0) == os.getpid():  # the leader of its own session, as the build starts it
            kill_session(os.getpid())
        else:  # never the caller's whole session: only this process group
            os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (the build-and-smoke child started with
    ``start_new_session``, so ``sid`` is its pid): the child, ninja and the compilers. A kill
    of the child's process group alone missed the compilers, which ninja starts in process
    groups of their own (``POSIX_SPAWN_SETPGROUP``, so that Ctrl-C reaches only ninja) but in
    the same session: they ran on as orphans. Linux's ``/proc`` lists the session's processes;
    elsewhere only the child's process group is killed. The calling process, when it belongs
    to the session, is killed last."""
    me = os.getpid()
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                if os.getsid(int(entry.name)) == sid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        os.killpg(sid, signal.SIGKILL)  # the leader's group: all there is without /proc
    except (ProcessLookupError, PermissionError):
        pass


def _kill_build(proc: subprocess.Popen, folder: Path, started: float) -> None:
    """Kill the build-and-smoke child and everything it started, and remove torch's build lock
    when that child took it (created at or after ``started``, a ``time.time()``): a lock left by
    a killed build makes every later build wait on it forever (torch's FileBaton has no owner
    check). A lock older than ``started`` belongs to another process's build and is kept."""
    kill_session(proc.pid)
    proc.communicate()
    lock = folder / "lock"
    try:
        if lock.stat().st_mtime >= started:
            lock.unlink()
            log.warning("removed the CPU-kernel build lock of the build that timed out (%s)", lock)
    except FileNotFoundError:
        pass


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
        module = build_module(folder)
        log.info("CPU kernels loaded from %s", folder)
        return module
    except Exception as exc:  # no compiler / ninja, or a compile error: keep the torch paths
        log.warning("CPU kernels unavailable (%s: %s); using the torch paths", type(exc).__name__,
                    (str(exc).splitlines() or [""])[0])
        return None


def main() -> int:
    """Build (or find) the extension, run its smoke check, print where it lives."""
    logging.basicConfig(level=logging.INFO)
    ok = load() is not None
    print(f"CPU kernels {'built' if ok else 'NOT available'} in {build_dir()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Build llama.cpp's `llama-server` for `inflight bench --peer llama-server PATH`, and
# `llama-quantize` from the same tree and build dir (for `python -m bench.real_shapes`).
#
# Usage: bench/peers/build_llama_server.sh [OUT_DIR]   (default ~/.cache/inflight/llama-server)
# Env:   LLAMA_CPP_PYTHON_VERSION (default below), JOBS (default 2), PYTHON (default python3).
#
# Source: the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI (vendor/llama.cpp),
# fetched with `pip download`, so the build needs only pip's index, cmake and a C++17 compiler.
# Idempotent: the sdist, the unpacked tree and the build dir are reused; a second run only
# re-runs cmake (a no-op when nothing changed). stdout: `llama-quantize`'s path, then, on the
# last line, `llama-server`'s path (so `| tail -n1` gives the server); both sit in the same bin/.
#
# CPU flags: GGML_NATIVE=OFF with explicit x86 options. A GGML_NATIVE=ON build (-march=native)
# died here with an illegal instruction (the hypervisor's CPUID and what the vCPU executes
# disagree, e.g. AMX); so each AVX/AVX-512 option is turned on only when /proc/cpuinfo lists its
# flag, and the AMX options are always off.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
OUT="${1:-$HOME/.cache/inflight/llama-server}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python3}"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SDIST="$OUT/llama_cpp_python-$VERSION.tar.gz"
SRC="$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$OUT/build-$VERSION"
BIN="$BUILD/bin/llama-server"
QUANTIZE="$BUILD/bin/llama-quantize"

if [[ ! -f "$SDIST" ]]; then
    echo "== downloading llama-cpp-python==$VERSION sdist" >&2
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT" >&2
fi
if [[ ! -f "$SRC/tools/server/CMakeLists.txt" ]]; then
    echo "== unpacking $SDIST" >&2
    tar -xzf "$SDIST" -C "$OUT"
fi

# ON when /proc/cpuinfo's flags line lists $1, else OFF.
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]] && echo ON || echo OFF; }

cpu_opts=(
    -DGGML_NATIVE=OFF
    -DGGML_AVX="$(has avx)"
    -DGGML_AVX2="$(has avx2)"
    -DGGML_FMA="$(has fma)"
    -DGGML_F16C="$(has f16c)"
    -DGGML_BMI2="$(has bmi2)"
    -DGGML_AVX_VNNI="$(has avx_vnni)"
    -DGGML_AVX512="$(has avx512f)"
    -DGGML_AVX512_VBMI="$(has avx512vbmi)"
    -DGGML_AVX512_VNNI="$(has avx512_vnni)"
    -DGGML_AVX512_BF16="$(has avx512_bf16)"
    -DGGML_AMX_TILE=OFF
    -DGGML_AMX_INT8=OFF
    -DGGML_AMX_BF16=OFF
)
echo "== cmake options: ${cpu_opts[*]}" >&2

# LLAMA_OPENSSL/UI off: no HTTPS model downloads, no web UI (and no fetch of its prebuilt
# assets from Hugging Face at build time); the bench only needs the OpenAI-compatible API.
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    "${cpu_opts[@]}" \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2

start=$(date +%s)
cmake --build "$BUILD" --config Release --target llama-server llama-quantize -j "$JOBS" >&2
echo "== built in $(( $(date +%s) - start )) s" >&2

"$BIN" --version >&2
echo "$QUANTIZE"
echo "$BIN"

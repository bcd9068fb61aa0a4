// bfloat16 linear layer for CPUs with AVX-512 BF16: y = x @ W.T (+ bias), bf16 in and
// out, float32 accumulation, one rounding to bf16 at the end.
//
// Why our own: on a 2-vCPU Xeon with AVX-512 BF16 and no AMX, oneDNN's bf16 GEMM
// (torch's mkldnn linear, packed or not) ran SmolLM2's gate_up projection at 32 rows
// slower than its own float32 and read the weights slowly at one row (bench/RESULTS.md
// run 27 and "Measurements first recorded in docstrings"); every one of its calls also
// costs a fixed overhead (run 22). vdpbf16ps multiplies 32 bf16 pairs and adds them into
// 16 float32 lanes in one instruction.
//
// Layout: the weight [N, K] is packed once into tiles of 16 output columns; within a
// tile, for each pair of inputs (k, k + 1), 64 bytes hold (w[c][k], w[c][k + 1]) for
// c = 0..15, so one zmm load meets a broadcast of the activation pair (x[k], x[k + 1])
// and vdpbf16ps adds both products into column c's lane. K must be even; columns past
// N are zero. Each output sums its products pair by pair in k order whatever the row
// count and the row or column blocking, so a row's result does not depend on the
// other rows of the batch (batch-invariant by construction).
//
// Source of the instruction semantics: Intel Intrinsics Guide, _mm512_dpbf16_ps.

#include "aten_headers.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16_micro.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define INFLIGHT_BF16_GEMM 1
#endif

namespace {

using bf16_micro::kCols;

#if defined(INFLIGHT_BF16_GEMM)
using bf16_micro::micro_any;
using bf16_micro::Out;
constexpr int kRows = 4;   // activation rows per micro-kernel
constexpr int kTiles = 4;  // column tiles per micro-kernel: 16 accumulators
constexpr int64_t kRowBlock = 64;  // activation rows per pass over a tile group (kept in L1/L2)
#endif

}  // namespace

bool bf16_gemm_compiled() {
#if defined(INFLIGHT_BF16_GEMM)
  return true;
#else
  return false;
#endif
}

// w bfloat16 [N, K] (K even) -> bfloat16 [ceil(N/16), K/2, 32]: per tile and input pair,
// (w[c][k], w[c][k + 1]) for the tile's 16 columns; padding columns are zero.
at::Tensor bf16_pack_weight(at::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2, "bf16_pack_weight: w must be bfloat16 [N, K]");
  TORCH_CHECK(w.size(1) % 2 == 0, "bf16_pack_weight: K=", w.size(1), " is not even");
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), tiles = (n + kCols - 1) / kCols;
  at::Tensor packed = at::zeros({tiles, k / 2, 2 * kCols}, at::kBFloat16);
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, n, 64, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      uint16_t* tile = dst + (c / kCols) * k * kCols;
      for (int64_t p = 0; p < k / 2; ++p) {
        tile[p * 2 * kCols + 2 * (c % kCols)] = src[c * k + 2 * p];
        tile[p * 2 * kCols + 2 * (c % kCols) + 1] = src[c * k + 2 * p + 1];
      }
    }
  });
  return packed;
}

// out [M, N] = x @ W.T (+ bias float32 [N], or an empty tensor) for x bfloat16 [M, K] with
// contiguous rows and a bf16_pack_weight weight; out bfloat16 (the float32 sums rounded once)
// or float32 (the sums as they are).
void bf16_linear(at::Tensor out, at::Tensor x, at::Tensor packed, at::Tensor bias) {
  TORCH_CHECK(bf16_gemm_compiled(), "bf16_linear: built without AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "bf16_linear: x must be bfloat16 [M, K] with contiguous rows");
  const bool float_out = out.scalar_type() == at::kFloat;
  TORCH_CHECK((float_out || out.scalar_type() == at::kBFloat16) && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "bf16_linear: out must be bfloat16 or float32 [M, N] with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.size(2) == 2 * kCols &&
                  packed.is_contiguous(),
              "bf16_linear: packed weight must be bfloat16 [tiles, K/2, 32], contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), tiles = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(k == 2 * pairs && (n + kCols - 1) / kCols == tiles, "bf16_linear: shapes disagree: x ", x.sizes(),
              ", out ", out.sizes(), ", packed ", packed.sizes());
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n),
              "bf16_linear: bias must be float32 [N] or empty");
#if defined(INFLIGHT_BF16_GEMM)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* op = static_cast<char*>(out.data_ptr());
  const int64_t out_bytes = float_out ? 4 : 2;
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0), os = out.stride(0), tile_stride = pairs * 2 * kCols;
  // Each thread takes an equal run of tiles, then walks it in groups of kTiles (the last one
  // possibly smaller): SmolLM2's o and down projections have 36 tiles, 9 groups, which split
  // by whole groups gave one thread 5 and the other 4 (bench/RESULTS.md run 35).
  for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
    const int64_t m1 = std::min(m, m0 + kRowBlock);
    at::parallel_for(0, tiles, kTiles, [&](int64_t first, int64_t last) {
      for (int64_t t0 = first; t0 < last; t0 += kTiles) {
        const int nt = static_cast<int>(std::min<int64_t>(kTiles, last - t0));
        const int64_t c0 = t0 * kCols;
        for (int64_t r = m0; r < m1; r += kRows) {
          const int nr = static_cast<int>(std::min<int64_t>(kRows, m1 - r));
          micro_any(nr, nt, xp + r * xs, xs, wp + t0 * tile_stride, tile_stride, pairs, bp ? bp + c0 : nullptr,
                    Out{op + (r * os + c0) * out_bytes, float_out, os}, n - c0);
        }
      }
    });
  }
#endif
}

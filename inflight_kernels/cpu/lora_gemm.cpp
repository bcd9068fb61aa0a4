// The batched LoRA product of one step on the CPU, grouped by adapter (the SGMV shape of
// Punica, Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving"; S-LoRA, Sheng et al. 2023):
// each row (token) of the step has an adapter slot (-1: the base model), and only its own
// adapter's columns are computed for it:
//
//   for every row r with slot s >= 0, for every piece p of slot s:
//     shrink = x[r] @ a_t[:, col_start_p : col_end_p]                  (rank values)
//     out[r, out_start_p : out_end_p] += shrink @ b_t_p                (the module's outputs)
//
// A piece is one adapted module of one adapter within a fused projection (q, k, v of qkv;
// gate, up of gate_up); a_t holds every piece's A side by side ([in, R_total]) and each
// piece has its own B ([rank, out width], the scaling folded in: worker/model/lora_batch.py).
// Base rows are never touched, so their bits are the base model's.
//
// Rows are grouped by slot and taken up to kRows at a time, so each A and B value loaded is
// used for every row of the group (the weights are read once per group, not once per row).
// A row's sums run over the reduction index in the same order whatever its group holds, so a
// row's result does not depend on the batch it runs in. float32 only; the worker takes the
// torch path (a masked product) for other dtypes and devices.

#include "aten_headers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;  // rows of one adapter sharing each weight load

struct Piece {
  int64_t slot, out_start, out_end, col_start, col_end;
  const float* b;    // [col_end - col_start, out_end - out_start], rows b_stride apart
  int64_t b_stride;
};

// One group: up to kRows rows (their indices) of one slot.
struct Group {
  int64_t slot, count;
  int64_t rows[kRows];
};

// dst[g][c] = sum_i src_rows[g][i] * w[i * w_stride + c] for c < width, g < G: the
// shrink (src = x rows, w = a_t's columns) and the expand (src = shrink rows, w = B) alike.
// Each output lane sums over i in order, whatever G is.
template <int G>
void rows_times(const float* const* src, int64_t depth, const float* w, int64_t w_stride, int64_t width,
                float* const* dst, bool accumulate) {
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; c + 16 <= width; c += 16) {
    __m256 acc[G][2];
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < depth; ++i) {
      const __m256 w0 = _mm256_loadu_ps(w + i * w_stride + c), w1 = _mm256_loadu_ps(w + i * w_stride + c + 8);
      for (int g = 0; g < G; ++g) {
        const __m256 s = _mm256_set1_ps(src[g][i]);
        acc[g][0] = _mm256_fmadd_ps(s, w0, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(s, w1, acc[g][1]);
      }
    }
    for (int g = 0; g < G; ++g) {
      float* d = dst[g] + c;
      if (accumulate) {
        acc[g][0] = _mm256_add_ps(acc[g][0], _mm256_loadu_ps(d));
        acc[g][1] = _mm256_add_ps(acc[g][1], _mm256_loadu_ps(d + 8));
      }
      _mm256_storeu_ps(d, acc[g][0]);
      _mm256_storeu_ps(d + 8, acc[g][1]);
    }
  }
  for (; c + 8 <= width; c += 8) {
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < depth; ++i) {
      const __m256 w0 = _mm256_loadu_ps(w + i * w_stride + c);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(src[g][i]), w0, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      float* d = dst[g] + c;
      _mm256_storeu_ps(d, accumulate ? _mm256_add_ps(acc[g], _mm256_loadu_ps(d)) : acc[g]);
    }
  }
#endif
  for (; c < width; ++c) {
    for (int g = 0; g < G; ++g) {
      float acc = 0.0f;
      for (int64_t i = 0; i < depth; ++i) acc = std::fma(src[g][i], w[i * w_stride + c], acc);
      dst[g][c] = accumulate ? dst[g][c] + acc : acc;
    }
  }
}

void rows_times_count(int64_t count, const float* const* src, int64_t depth, const float* w, int64_t w_stride,
                      int64_t width, float* const* dst, bool accumulate) {
  switch (count) {
    case 4: return rows_times<4>(src, depth, w, w_stride, width, dst, accumulate);
    case 3: return rows_times<3>(src, depth, w, w_stride, width, dst, accumulate);
    case 2: return rows_times<2>(src, depth, w, w_stride, width, dst, accumulate);
    default: return rows_times<1>(src, depth, w, w_stride, width, dst, accumulate);
  }
}

// The step's rows grouped by slot (ascending slot, rows in order within it), kRows at most a group.
std::vector<Group> group_rows(const int64_t* slots, int64_t n) {
  std::vector<int64_t> order;
  for (int64_t r = 0; r < n; ++r)
    if (slots[r] >= 0) order.push_back(r);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return slots[a] < slots[b]; });
  std::vector<Group> groups;
  for (int64_t r : order) {
    if (groups.empty() || groups.back().slot != slots[r] || groups.back().count == kRows)
      groups.push_back({slots[r], 0, {}});
    groups.back().rows[groups.back().count++] = r;
  }
  return groups;
}

std::vector<Piece> check_pieces(const at::Tensor& pieces, const std::vector<at::Tensor>& b_ts, int64_t r_total,
                                int64_t out_width) {
  TORCH_CHECK(pieces.scalar_type() == at::kLong && pieces.dim() == 2 && pieces.size(1) == 5 && pieces.is_contiguous(),
              "lora_apply: pieces must be a contiguous int64 [P, 5] (slot, out_start, out_end, col_start, col_end)");
  TORCH_CHECK(static_cast<int64_t>(b_ts.size()) == pieces.size(0), "lora_apply: one B per piece");
  const int64_t* p = pieces.data_ptr<int64_t>();
  std::vector<Piece> out;
  for (int64_t i = 0; i < pieces.size(0); ++i) {
    const int64_t* f = p + 5 * i;
    const at::Tensor& b = b_ts[i];
    TORCH_CHECK(f[0] >= 0 && 0 <= f[1] && f[1] < f[2] && f[2] <= out_width && 0 <= f[3] && f[3] < f[4] &&
                    f[4] <= r_total,
                "lora_apply: piece ", i, " out of range");
    TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == at::kFloat && b.dim() == 2 && b.stride(1) == 1 &&
                    b.size(0) == f[4] - f[3] && b.size(1) == f[2] - f[1],
                "lora_apply: B of piece ", i, " must be a CPU float32 [", f[4] - f[3], ", ", f[2] - f[1],
                "] with contiguous rows");
    out.push_back({f[0], f[1], f[2], f[3], f[4], b.data_ptr<float>(), b.stride(0)});
  }
  return out;
}

}  // namespace

// out float32 [N, O] (contiguous rows, rows may be strided) += each row's adapter delta, for
// x float32 [N, in] (contiguous rows), row_slots int64 [N] (-1: base row, left as it is),
// a_t float32 [in, R_total] contiguous, and the pieces described at the top of this file.
void lora_apply(at::Tensor out, at::Tensor x, at::Tensor row_slots, at::Tensor a_t, at::Tensor pieces,
                std::vector<at::Tensor> b_ts) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "lora_apply: x must be a CPU float32 [N, in] with contiguous rows");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "lora_apply: out must be a CPU float32 [N, O] with contiguous rows");
  TORCH_CHECK(row_slots.device().is_cpu() && row_slots.scalar_type() == at::kLong && row_slots.dim() == 1 &&
                  row_slots.size(0) == x.size(0) && row_slots.is_contiguous(),
              "lora_apply: row_slots must be a contiguous CPU int64 [N]");
  TORCH_CHECK(a_t.device().is_cpu() && a_t.scalar_type() == at::kFloat && a_t.dim() == 2 && a_t.is_contiguous() &&
                  a_t.size(0) == x.size(1),
              "lora_apply: a_t must be a contiguous CPU float32 [in, R_total] with in = x's columns");
  const std::vector<Piece> all = check_pieces(pieces, b_ts, a_t.size(1), out.size(1));
  const std::vector<Group> groups = group_rows(row_slots.data_ptr<int64_t>(), x.size(0));
  if (groups.empty()) return;
  int64_t widest = 0;
  for (const Piece& p : all) widest = std::max(widest, p.col_end - p.col_start);
  const float* xp = x.data_ptr<float>();
  const float* ap = a_t.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0), depth = x.size(1), r_total = a_t.size(1);
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t first, int64_t last) {
    std::vector<float> shrink(kRows * widest);
    for (int64_t gi = first; gi < last; ++gi) {
      const Group& group = groups[gi];
      const float* src[kRows];
      float* shr[kRows];
      float* dst[kRows];
      for (int64_t g = 0; g < group.count; ++g) {
        src[g] = xp + group.rows[g] * xs;
        shr[g] = shrink.data() + g * widest;
      }
      for (const Piece& p : all) {
        if (p.slot != group.slot) continue;
        const int64_t rank = p.col_end - p.col_start;
        rows_times_count(group.count, src, depth, ap + p.col_start, r_total, rank, shr, false);
        for (int64_t g = 0; g < group.count; ++g) dst[g] = op + group.rows[g] * os + p.out_start;
        rows_times_count(group.count, shr, rank, p.b, p.b_stride, p.out_end - p.out_start, dst, true);
      }
    }
  });
}

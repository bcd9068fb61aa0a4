// The K-quant product for steps of many rows on CPUs with AVX2 and FMA but without AVX-512 (the
// AVX2-only EPYCs): each thread dequantizes a group of kF32GroupRows rows of W (a run of at most
// kF32ChunkBlocks super-blocks of K at a time) into float32 in its own buffer (192 KB, kept in L2),
// and multiplies the activation rows, as they are (float32, not rounded), with it. The activations
// are first packed transposed, 16 rows to a panel (k-major: the 16 rows' values at one k are two
// vectors), so the micro-kernel keeps a 6 x 16 block of outputs in 12 registers and per k loads two
// activation vectors and broadcasts one weight per row of W: 12 FMAs for 8 loads, the register
// blocking of BLIS's Haswell sgemm micro-kernel (6 x 16; Van Zee and van de Geijn, "BLIS: A
// Framework for Rapidly Instantiating BLAS Functionality", ACM TOMS 41(3), 2015) with the roles
// of the operands swapped, so that W is dequantized row by row, in its own order, with no
// transpose. Nothing is kept between calls: memory still follows the file. Included by
// kquant_gemm.cpp inside its anonymous namespace, after its AVX2 sources.
//
// Why: at many rows a step is bound by arithmetic. The int16 products read one activation
// vector per vpmaddwd and fold and scale every super-block's sums per row; on a Zen 3 EPYC
// vpmaddwd issues once a cycle (16 multiply-adds) where two FMAs do (16), and single-thread the
// int16 products ran a 4096 x 2048 Q4_K at 26 G multiply-adds/s from 32 rows, Q6_K at 19, with
// the FMA peak at 44; on 2 threads the float32 path runs the 1B file's products 1.16-1.23x the
// int16 ones at 32 rows and 1.2-1.6x at 64-512 (bench/RESULTS.md run 43, bench/kquant_products.py).
// Dequantizing costs about 5 instructions per 8 weights per call, shared by every row.
//
// Numerics: the weights are the float32 values ggml's dequantize_row_q*_K gives (w = s u - o in
// one rounding: s u is exact in float32), the activations are not rounded at all, and each
// output is one float32 sum in k order (a chain of fused multiply-adds over the whole of K, its
// running sums kept per thread between runs of K and written to out once): more exact than the int16 products (whose activations keep 15 bits per 256 values), and
// a row's result does not depend on the other rows of its step. It does differ from the int16
// products', so a row's result depends on whether its step had `dense_min_rows` rows or more
// (--deterministic turns this path off, as it does the bfloat16 tiles and the dense copies).

#if defined(__AVX2__) && defined(__FMA__) && !KQUANT_AVX512
#define KQUANT_F32 1

constexpr int64_t kF32GroupRows = 48;   // rows of W dequantized together: 8 blocks of 6, or 4 of 12
constexpr int64_t kF32ChunkBlocks = 4;  // super-blocks of K per pass: 48 x 1024 float32 = 192 KB
constexpr int64_t kF32PanelRows = 16;   // activation rows per packed panel (two vectors)
// Floats between the buffer's rows of W beyond the run's own: rows 4 KB apart share one L1 set,
// and the 12 rows one micro-kernel call reads overflowed its 8 ways (8 rows: 24 G multiply-adds/s
// where the padded buffer runs 35, single thread, Zen 3).
constexpr int64_t kF32RowPad = 16;

#define F32_INLINE inline __attribute__((always_inline))

// The 8 x 8 transpose of float32 lanes: in[i] lane j -> out[j] lane i.
F32_INLINE void transpose8(__m256* v) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // s[q] (q < 4): 128-bit halves of columns q and q + 4, rows 0-3; s[q + 4]: rows 4-7
  for (int q = 0; q < 4; ++q) {
    v[q] = _mm256_permute2f128_ps(s[q], s[q + 4], 0x20);
    v[q + 4] = _mm256_permute2f128_ps(s[q], s[q + 4], 0x31);
  }
}

// One super-block in the common shape as 256 float32 values in natural order: w = s u - o.
template <int G>
F32_INLINE void floats_of(const Unpacked& u, float* out) {
  for (int g = 0; g < kSuper / G; ++g) {
    const __m256 s = _mm256_set1_ps(u.scale[g]), o = _mm256_set1_ps(u.offset[g]);
    for (int i = G * g; i < G * (g + 1); i += 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u.u + i));
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
      _mm256_store_ps(out + i, _mm256_fmsub_ps(v, s, o));
    }
  }
}

// Super-blocks b0 .. b1 - 1 of one row of W (file bytes `w`, ggml type `type`) as float32 at `out`.
void dequantize_row_f32(int64_t type, const uint8_t* w, int64_t b0, int64_t b1, float* out) {
  const int64_t bytes = block_bytes(type);
  Unpacked u;
  for (int64_t b = b0; b < b1; ++b, out += kSuper) {
    switch (type) {
      case kQ4K: unpack_from<32>(Q4KFile{w, bytes}, b, u); break;
      case kQ5K: unpack_from<32>(Q5KFile{w, bytes}, b, u); break;
      case kQ6K: unpack_from<16>(Q6KFile{w, bytes}, b, u); break;
      default: unpacker(type)(w + b * bytes, u); break;  // Q2_K, Q3_K: the scalar unpack
    }
    if (group_size(type) == 32) floats_of<32>(u, out);
    else floats_of<16>(u, out);
  }
}

// A panel of activation rows packed k-major: rows r0 .. r0 + rows - 1 of x, padded with zeros
// to `width` (8 or 16) lanes, at data[k * width + lane].
struct XPanel {
  int64_t r0, rows, width;
  int64_t offset;  // of data in the packed store, in floats
  const float* data;
};

// x float32 [m, k] (rows x_stride apart) -> panels of 16 rows, the last of 8 when 8 or fewer
// rows remain, into `store` (allocated here: 64-byte aligned).
std::vector<XPanel> pack_activations(const float* x, int64_t x_stride, int64_t m, int64_t k, at::Tensor& store) {
  std::vector<XPanel> panels;
  int64_t floats = 0;
  for (int64_t r = 0; r < m;) {
    const int64_t width = m - r <= 8 ? 8 : kF32PanelRows, rows = std::min(width, m - r);
    panels.push_back({r, rows, width, floats, nullptr});
    floats += width * k;
    r += rows;
  }
  store = at::empty({floats}, at::kFloat);
  for (XPanel& p : panels) p.data = store.data_ptr<float>() + p.offset;
  at::parallel_for(0, static_cast<int64_t>(panels.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const XPanel& p = panels[i];
      float* dst = const_cast<float*>(p.data);
      for (int64_t half = 0; half < p.width / 8; ++half)
        for (int64_t k0 = 0; k0 < k; k0 += 8) {
          __m256 v[8];
          for (int64_t j = 0; j < 8; ++j) {
            const int64_t r = 8 * half + j;
            v[j] = r < p.rows ? _mm256_loadu_ps(x + (p.r0 + r) * x_stride + k0) : _mm256_setzero_ps();
          }
          transpose8(v);  // v[i]: rows 8 half .. 8 half + 7 at k0 + i
          for (int64_t i = 0; i < 8; ++i) _mm256_store_ps(dst + (k0 + i) * p.width + 8 * half, v[i]);
        }
    }
  });
  return panels;
}

// tile[c][lane] += sum over k < kc of w[c * ws + k] * xt[k * 8 XV + lane], for CW rows of W and
// 8 XV activation rows, one fused multiply-add per k in k order, the sums carried in `tile`
// from the previous run of K (`resume`) or started at zero: each output is one FMA chain over
// the whole of K, whichever runs it was cut into.
template <int XV, int CW>
__attribute__((noinline)) void f32_micro(const float* xt, const float* w, int64_t ws, int64_t kc, float* tile,
                                         bool resume) {
  __m256 acc[CW][XV];
#pragma GCC unroll 12
  for (int c = 0; c < CW; ++c)
#pragma GCC unroll 2
    for (int i = 0; i < XV; ++i) acc[c][i] = resume ? _mm256_load_ps(tile + c * 8 * XV + 8 * i) : _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m256 xv[XV];
#pragma GCC unroll 2
    for (int i = 0; i < XV; ++i) xv[i] = _mm256_load_ps(xt + (k * XV + i) * 8);
#pragma GCC unroll 12
    for (int c = 0; c < CW; ++c) {
      const __m256 b = _mm256_broadcast_ss(w + c * ws + k);
#pragma GCC unroll 2
      for (int i = 0; i < XV; ++i) acc[c][i] = _mm256_fmadd_ps(b, xv[i], acc[c][i]);
    }
  }
#pragma GCC unroll 12
  for (int c = 0; c < CW; ++c)
#pragma GCC unroll 2
    for (int i = 0; i < XV; ++i) _mm256_store_ps(tile + c * 8 * XV + 8 * i, acc[c][i]);
}

constexpr int64_t kF32TileFloats = 96;  // one micro-kernel call's sums: 6 x 16 or 12 x 8
constexpr int64_t kF32PanelTiles = kF32GroupRows / 6;  // a panel's tiles per group of W (at most)

// W rows per micro-kernel call for a panel: 12 accumulators either way.
inline int64_t rows_per_call(const XPanel& p) { return p.width == 8 ? 12 : 6; }

// The sums of panel p against `cols` rows of W (float32 at w, ws apart) over kc values of K, carried
// in p's tiles (kF32PanelTiles x kF32TileFloats floats).
void f32_panel(const XPanel& p, const float* xt, const float* w, int64_t ws, int64_t kc, int64_t cols, float* tiles,
               bool resume) {
  const int64_t cw = rows_per_call(p);
  for (int64_t c0 = 0, t = 0; c0 < cols; c0 += cw, ++t) {
    if (p.width == 8) f32_micro<1, 12>(xt, w + c0 * ws, ws, kc, tiles + t * kF32TileFloats, resume);
    else f32_micro<2, 6>(xt, w + c0 * ws, ws, kc, tiles + t * kF32TileFloats, resume);
  }
}

// out[p.r0 + j, c] = panel p's sums for its rows j and the group's columns c < cols, row by row.
void f32_panel_store(const XPanel& p, const float* tiles, int64_t cols, float* out, int64_t os) {
  const int64_t cw = rows_per_call(p);
  for (int64_t j = 0; j < p.rows; ++j) {
    float* o = out + (p.r0 + j) * os;
    for (int64_t c = 0; c < cols; ++c) o[c] = tiles[(c / cw) * kF32TileFloats + (c % cw) * p.width + j];
  }
}

// out[m, n] (float32, rows os apart) = x @ W.T with W's rows given by `row_of(col)` (bytes,
// type) for col < n: the many-rows product through float32 dequantized in each call.
template <class RowOf>
void kquant_f32_product(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t n, const RowOf& row_of,
                        float* out, int64_t os) {
  at::Tensor xt_store;
  const std::vector<XPanel> panels = pack_activations(x, x_stride, m, k, xt_store);
  const int64_t sblocks = k / kSuper, groups = (n + kF32GroupRows - 1) / kF32GroupRows;
  const int64_t panel_floats = kF32PanelTiles * kF32TileFloats, np = static_cast<int64_t>(panels.size());
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    const at::Tensor buffer_owner = at::empty({kF32GroupRows * (kF32ChunkBlocks * kSuper + kF32RowPad)}, at::kFloat);
    const at::Tensor tiles_owner = at::empty({np * panel_floats}, at::kFloat);  // the sums, across runs of K
    float* buffer = buffer_owner.data_ptr<float>();
    float* tiles = tiles_owner.data_ptr<float>();
    for (int64_t g = first; g < last; ++g) {
      const int64_t c0 = g * kF32GroupRows, cols = std::min(kF32GroupRows, n - c0);
      const uint8_t* rows[kF32GroupRows];
      int64_t types[kF32GroupRows];
      for (int64_t c = 0; c < cols; ++c) row_of(c0 + c, rows[c], types[c]);
      for (int64_t b0 = 0; b0 < sblocks; b0 += kF32ChunkBlocks) {
        const int64_t b1 = std::min(sblocks, b0 + kF32ChunkBlocks), kc = (b1 - b0) * kSuper, ws = kc + kF32RowPad;
        for (int64_t c = 0; c < kF32GroupRows; ++c) {
          if (c < cols) dequantize_row_f32(types[c], rows[c], b0, b1, buffer + c * ws);
          else std::fill(buffer + c * ws, buffer + c * ws + kc, 0.0f);  // a last group's padding
        }
        for (int64_t i = 0; i < np; ++i)
          f32_panel(panels[i], panels[i].data + b0 * kSuper * panels[i].width, buffer, ws, kc, cols,
                    tiles + i * panel_floats, b0 > 0);
      }
      for (int64_t i = 0; i < np; ++i) f32_panel_store(panels[i], tiles + i * panel_floats, cols, out + c0, os);
    }
  });
}

#else
#define KQUANT_F32 0
#endif

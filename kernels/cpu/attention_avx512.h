// AVX-512 pieces of the paged decode attention (paged_attention.cpp): 16-lane
// loads from the cache dtype, exp, the 16-token tile reduction, the per-chunk
// scores and P.V loops. Included by paged_attention.cpp inside its namespace,
// after Pages, load_f and exp_approx.
#pragma once

// 16 floats from 16 elements of the cache dtype.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp_approx on 16 lanes: same polynomial, 2^n applied with scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Lane L of row_sums16(v) = sum of the 16 lanes of v[L]. Four halving steps
// (segment halves 8, 4, 2, 1); each adds the two halves of every segment of a
// pair (x, y), picked by permutex2var with these indices (16+ = from y).
alignas(64) static const int32_t kHalves[4][2][16] = {
    {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
     {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
    {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
     {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},
    {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
     {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}},
    {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
     {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}}};

inline __m512 combine(__m512 x, __m512 y, int step) {
  return _mm512_add_ps(_mm512_permutex2var_ps(x, _mm512_load_si512(kHalves[step][0]), y),
                       _mm512_permutex2var_ps(x, _mm512_load_si512(kHalves[step][1]), y));
}

inline __m512 row_sums16(__m512* v) {
  for (int step = 0, n = 16; step < 4; ++step, n /= 2)
    for (int i = 0; i < n / 2; ++i) v[i] = combine(v[2 * i], v[2 * i + 1], step);
  return v[0];
}

inline void prefetch_page(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// scores[h * ctx + t] = scale * q_h . k_t for G heads (q already scaled, [G, D]).
template <typename T, int D, int G>
void chunk_scores(const Pages<T>& keys, const float* q, float* scores) {
  constexpr int V = D / 16;
  __m512 qv[G][V];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v) qv[h][v] = _mm512_loadu_ps(q + h * D + 16 * v);
  const int64_t pages = keys.count(), ctx = keys.ctx;
  for (int64_t i = 0; i < pages; ++i) {
    const T* rows = keys.page(i);
    const int64_t n = keys.rows(i), t0 = i * keys.block_size;
    if (i + 1 < pages) prefetch_page(keys.page(i + 1), keys.block_size * D * sizeof(T));
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {  // 16 tokens converted once, then per head 16 dot products reduced together
      alignas(64) float tile[16 * D];
      for (int r = 0; r < 16; ++r)
        for (int v = 0; v < V; ++v) _mm512_store_ps(tile + r * D + 16 * v, load16(rows + (j + r) * D + 16 * v));
      for (int h = 0; h < G; ++h) {
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) {
          __m512 a = _mm512_mul_ps(qv[h][0], _mm512_load_ps(tile + r * D));
          for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(qv[h][v], _mm512_load_ps(tile + r * D + 16 * v), a);
          acc[r] = a;
        }
        _mm512_storeu_ps(scores + h * ctx + t0 + j, row_sums16(acc));
      }
    }
    for (; j < n; ++j) {
      __m512 k[V];
      for (int v = 0; v < V; ++v) k[v] = load16(rows + j * D + 16 * v);
      for (int h = 0; h < G; ++h) {
        __m512 a = _mm512_mul_ps(qv[h][0], k[0]);
        for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(qv[h][v], k[v], a);
        scores[h * ctx + t0 + j] = _mm512_reduce_add_ps(a);
      }
    }
  }
}

// out_h = sum_t p_h[t] v_t for G heads, accumulators in registers; inv_sum[h] normalises.
template <typename T, int D, int G>
void chunk_values(const Pages<T>& values, const float* probs, const float* inv_sum, float* out) {
  constexpr int V = D / 16;
  __m512 acc[G][V];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v) acc[h][v] = _mm512_setzero_ps();
  const int64_t pages = values.count(), ctx = values.ctx;
  for (int64_t i = 0; i < pages; ++i) {
    const T* rows = values.page(i);
    const int64_t n = values.rows(i), t0 = i * values.block_size;
    if (i + 1 < pages) prefetch_page(values.page(i + 1), values.block_size * D * sizeof(T));
    for (int64_t j = 0; j < n; ++j) {
      __m512 val[V];
      for (int v = 0; v < V; ++v) val[v] = load16(rows + j * D + 16 * v);
      for (int h = 0; h < G; ++h) {
        const __m512 p = _mm512_set1_ps(probs[h * ctx + t0 + j]);
        for (int v = 0; v < V; ++v) acc[h][v] = _mm512_fmadd_ps(p, val[v], acc[h][v]);
      }
    }
  }
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < V; ++v)
      _mm512_storeu_ps(out + h * D + 16 * v, _mm512_mul_ps(acc[h][v], _mm512_set1_ps(inv_sum[h])));
}

// In place s[t] = exp(s[t] - max s); returns the sum.
inline float softmax_numerators(float* s, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  float mx = _mm512_reduce_max_ps(m);
  for (int64_t i = t; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  float total = _mm512_reduce_add_ps(sum);
  for (; t < n; ++t) {
    s[t] = exp_approx(s[t] - mx);
    total += s[t];
  }
  return total;
}

// Heads per chunk: the chunk's accumulators (G * D / 16 registers) stay in the 32 zmm registers.
template <int D>
constexpr int kMaxChunk = (16 / (D / 16)) < 8 ? (16 / (D / 16) > 0 ? 16 / (D / 16) : 1) : 8;

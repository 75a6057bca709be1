// Decode attention over a paged KV cache, on the CPU.
//
// A decoding sequence has one new token: its query attends to the context's keys and values,
// which sit in the cache's blocks in the order its block table lists, and to its own new key and
// value. The reference gathers every sequence's blocks into one padded batch and runs a masked
// attention over it: the cache is read once to gather, the copy written, then read again. This
// kernel reads each block where it lies, once: one work item per sequence computes every head's
// scores (grouped-query attention shares the keys), a softmax in the accumulation type, and the
// weighted sum of the values, walking each cache slot's row of K * E elements from end to end.
// A sliding window starts the walk at the first slot the window reaches; soft-capped scores pass
// through cap * tanh(s / cap) before the softmax.
// Work items are shared out over OpenMP threads; the inner loops are SIMD reductions, compiled
// for AVX-512, AVX2 and plain x86-64, the best one chosen when the library loads.
//
// Beside it, for the same steps: RMSNorm and the rotary embedding of contiguous rows, each one
// call in place of the eager reference's several operators, and the product of a few rows with
// a weight stored [in, out] that streams the weight once (colfunc.ops.cpu_rows).
//
// The Python side (colfunc.ops.cpu_attention) validates every tensor and passes raw addresses:
// this file needs only pybind11, which keeps its compile to seconds.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define COLFUNC_X86 1
#endif

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define COLFUNC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define COLFUNC_CLONES
#endif

struct Shape {
  int64_t heads;       // H: query heads
  int64_t kv_heads;    // K: key/value heads (H is a multiple)
  int64_t dim;         // E: head dim
  int64_t block_size;  // B: slots per cache block
  int64_t table_width; // M: columns of the block table
};

// One sequence: every head. A slot of the cache holds all K heads' keys (values) in one row of
// K * E elements, so each row is read once, from end to end.
template <typename T>
COLFUNC_CLONES void decode_one(T* out, const T* q, const T* k_new, const T* v_new,
                               const T* k_cache, const T* v_cache, const int32_t* table,
                               int64_t context, const Shape& s, double scale,
                               int64_t window, double softcap, std::vector<T>& scores,
                               std::vector<T>& acc) {
  const int64_t E = s.dim, K = s.kv_heads, H = s.heads, B = s.block_size;
  // under a sliding window the new token (at position `context`) sees its last `window`
  // tokens: the blocks before them may have been given back, and are not read
  const int64_t first = window > 0 ? std::max<int64_t>(0, context - window + 1) : 0;
  const int64_t G = H / K, L = context + 1 - first, row = K * E;
  scores.resize(static_cast<size_t>(H * L));
  acc.assign(static_cast<size_t>(H * E), static_cast<T>(0));
  const T sc = static_cast<T>(scale), cap = static_cast<T>(softcap);
  auto slot = [&](const T* cache, const T* fresh, int64_t t) {
    return t < context ? cache + (static_cast<int64_t>(table[t / B]) * B + t % B) * row : fresh;
  };
  // scores[h, t] = q_h . k_t * scale (soft-capped: cap * tanh(s / cap)), k_t the t-th key the
  // token sees: of the context, then the new one
  for (int64_t t = 0; t < L; ++t) {
    const T* kt = slot(k_cache, k_new, first + t);
    for (int64_t h = 0; h < H; ++h) {
      const T* qh = q + h * E;
      const T* kh = kt + (h / G) * E;
      T dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t e = 0; e < E; ++e) dot += qh[e] * kh[e];
      const T x = dot * sc;
      scores[h * L + t] = cap > 0 ? cap * std::tanh(x / cap) : x;
    }
  }
  // softmax over t, per head
  for (int64_t h = 0; h < H; ++h) {
    T* p = scores.data() + h * L;
    T top = -std::numeric_limits<T>::infinity();
    for (int64_t t = 0; t < L; ++t) top = std::max(top, p[t]);
    T total = 0;
    for (int64_t t = 0; t < L; ++t) {
      p[t] = std::exp(p[t] - top);
      total += p[t];
    }
    const T inv = static_cast<T>(1) / total;
    for (int64_t t = 0; t < L; ++t) p[t] *= inv;
  }
  // out_h = sum_t p[h, t] * v_t
  for (int64_t t = 0; t < L; ++t) {
    const T* vt = slot(v_cache, v_new, first + t);
    for (int64_t h = 0; h < H; ++h) {
      const T p = scores[h * L + t];
      const T* vh = vt + (h / G) * E;
      T* a = acc.data() + h * E;
#pragma omp simd
      for (int64_t e = 0; e < E; ++e) a[e] += p * vh[e];
    }
  }
  std::copy(acc.begin(), acc.end(), out);
}

template <typename T>
void decode(uintptr_t out, uintptr_t q, uintptr_t k_new, uintptr_t v_new, uintptr_t k_cache,
            uintptr_t v_cache, uintptr_t tables, const std::vector<int64_t>& seqs,
            const std::vector<int64_t>& rows, const std::vector<int64_t>& contexts,
            const Shape& s, double scale, int64_t window, double softcap, int threads) {
  const int64_t n = static_cast<int64_t>(seqs.size());
  const int64_t q_row = s.heads * s.dim, kv_row = s.kv_heads * s.dim;
  T* o = reinterpret_cast<T*>(out);
  const T* qp = reinterpret_cast<const T*>(q);
  const T* kn = reinterpret_cast<const T*>(k_new);
  const T* vn = reinterpret_cast<const T*>(v_new);
  const T* kc = reinterpret_cast<const T*>(k_cache);
  const T* vc = reinterpret_cast<const T*>(v_cache);
  const int32_t* tb = reinterpret_cast<const int32_t*>(tables);
#pragma omp parallel num_threads(threads)
  {
    std::vector<T> scores, acc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = rows[i];
      decode_one<T>(o + r * q_row, qp + r * q_row, kn + r * kv_row, vn + r * kv_row, kc, vc,
                    tb + seqs[i] * s.table_width, contexts[i], s, scale, window, softcap,
                    scores, acc);
    }
  }
}

void paged_decode(uintptr_t out, uintptr_t q, uintptr_t k_new, uintptr_t v_new, uintptr_t k_cache,
                  uintptr_t v_cache, uintptr_t tables, std::vector<int64_t> seqs,
                  std::vector<int64_t> rows, std::vector<int64_t> contexts, int64_t heads,
                  int64_t kv_heads, int64_t dim, int64_t block_size, int64_t table_width,
                  bool fp64, double scale, int64_t window, double softcap, int threads) {
  const Shape s{heads, kv_heads, dim, block_size, table_width};
  if (fp64)
    decode<double>(out, q, k_new, v_new, k_cache, v_cache, tables, seqs, rows, contexts, s, scale,
                   window, softcap, threads);
  else
    decode<float>(out, q, k_new, v_new, k_cache, v_cache, tables, seqs, rows, contexts, s, scale,
                  window, softcap, threads);
}

// RMSNorm of contiguous rows of `dim` elements: out = w * (x / sqrt(mean(x^2) + eps)), the
// statistics in the element type (fp32 or fp64, as the reference computes them); no weight
// where `w` is null. One pass per row for the sum of squares, one for the output: the eager
// reference's six operators over the whole tensor, each a dispatch, in one call.
template <typename T>
COLFUNC_CLONES void rms_rows(T* out, const T* x, const T* w, int64_t first, int64_t last,
                             int64_t dim, double eps) {
  for (int64_t r = first; r < last; ++r) {
    const T* xr = x + r * dim;
    T* o = out + r * dim;
    T ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < dim; ++d) ss += xr[d] * xr[d];
    const T inv = static_cast<T>(1) / std::sqrt(ss / static_cast<T>(dim) + static_cast<T>(eps));
    if (w != nullptr) {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] = w[d] * (xr[d] * inv);
    } else {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] = xr[d] * inv;
    }
  }
}

// Rotary embedding (rotate-half) of rows laid out [..., T, H, E] contiguous: row r is position
// r / H % T of the tables cos, sin [T, E / 2]; out[:K] = x1 c - x2 s, out[K:] = x2 c + x1 s.
template <typename T>
COLFUNC_CLONES void rope_rows(T* out, const T* x, const T* cos, const T* sin, int64_t first,
                              int64_t last, int64_t heads, int64_t positions, int64_t dim) {
  const int64_t K = dim / 2;
  for (int64_t r = first; r < last; ++r) {
    const T* c = cos + (r / heads % positions) * K;
    const T* s = sin + (r / heads % positions) * K;
    const T* x1 = x + r * dim;
    const T* x2 = x1 + K;
    T* o = out + r * dim;
#pragma omp simd
    for (int64_t k = 0; k < K; ++k) {
      o[k] = x1[k] * c[k] - x2[k] * s[k];
      o[K + k] = x2[k] * c[k] + x1[k] * s[k];
    }
  }
}

// Rows shared out over `threads` OpenMP threads in contiguous runs (one run where the work is
// small: a decoding step's few rows are not worth waking a thread for).
template <typename F>
void over_rows(int64_t rows, int64_t dim, int threads, F body) {
  const int n = rows * dim >= (1 << 16) ? std::max(1, threads) : 1;
  if (n == 1) {
    body(0, rows);
    return;
  }
#pragma omp parallel num_threads(n)
  {
    const int64_t t = omp_get_thread_num(), m = omp_get_num_threads();
    body(rows * t / m, rows * (t + 1) / m);
  }
}

void rms_norm(uintptr_t out, uintptr_t x, uintptr_t w, int64_t rows, int64_t dim, double eps,
              bool fp64, int threads) {
  over_rows(rows, dim, threads, [&](int64_t a, int64_t b) {
    if (fp64)
      rms_rows<double>(reinterpret_cast<double*>(out), reinterpret_cast<const double*>(x),
                       reinterpret_cast<const double*>(w), a, b, dim, eps);
    else
      rms_rows<float>(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(x),
                      reinterpret_cast<const float*>(w), a, b, dim, eps);
  });
}

void rope(uintptr_t out, uintptr_t x, uintptr_t cos, uintptr_t sin, int64_t rows, int64_t heads,
          int64_t positions, int64_t dim, bool fp64, int threads) {
  over_rows(rows, dim, threads, [&](int64_t a, int64_t b) {
    if (fp64)
      rope_rows<double>(reinterpret_cast<double*>(out), reinterpret_cast<const double*>(x),
                        reinterpret_cast<const double*>(cos), reinterpret_cast<const double*>(sin),
                        a, b, heads, positions, dim);
    else
      rope_rows<float>(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(x),
                       reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin), a,
                       b, heads, positions, dim);
  });
}


// The product y = x w (+ b) of a few rows x [M, K] with a weight w [K, N] stored row-major, as a
// decoding step multiplies its tokens by each projection. A general matmul repacks w for every
// call, which for a few rows costs more than the arithmetic; here w is read where it lies, once:
// each tile of columns keeps the M rows' sums in vector registers and walks down w's rows,
// one load of w feeding M multiply-adds. Tiles are shared out over the threads. Rows past 8 are
// taken 8 at a time. AVX-512 or AVX2 with FMA (the caller asks `linear_isa` first).
#ifdef COLFUNC_X86
template <int M, int V, bool FULL>
__attribute__((target("avx512f"))) void tile512(const float* x, int64_t K, const float* w,
                                                 int64_t N, const float* b, float* y,
                                                 int64_t j0, int64_t cols) {
  __m512 acc[M][V];
  __mmask16 mask[V];
  for (int v = 0; v < V; ++v) {
    const int64_t rem = cols - 16 * v;
    mask[v] = rem >= 16 ? 0xFFFF : rem <= 0 ? 0 : static_cast<__mmask16>((1u << rem) - 1);
  }
  for (int v = 0; v < V; ++v) {
    const __m512 init = b == nullptr ? _mm512_setzero_ps()
                        : FULL       ? _mm512_loadu_ps(b + j0 + 16 * v)
                                     : _mm512_maskz_loadu_ps(mask[v], b + j0 + 16 * v);
    for (int m = 0; m < M; ++m) acc[m][v] = init;
  }
  const float* wp = w + j0;
  for (int64_t k = 0; k < K; ++k, wp += N) {
    __m512 wv[V];
    for (int v = 0; v < V; ++v)
      wv[v] = FULL ? _mm512_loadu_ps(wp + 16 * v) : _mm512_maskz_loadu_ps(mask[v], wp + 16 * v);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      for (int v = 0; v < V; ++v) acc[m][v] = _mm512_fmadd_ps(xv, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) {
      float* out = y + m * N + j0 + 16 * v;
      if (FULL)
        _mm512_storeu_ps(out, acc[m][v]);
      else
        _mm512_mask_storeu_ps(out, mask[v], acc[m][v]);
    }
}

template <int M, int V, bool FULL>
__attribute__((target("avx2,fma"))) void tile256(const float* x, int64_t K, const float* w,
                                                  int64_t N, const float* b, float* y,
                                                  int64_t j0, int64_t cols) {
  __m256 acc[M][V];
  __m256i mask[V];
  for (int v = 0; v < V; ++v) {
    alignas(32) int32_t lanes[8];
    for (int i = 0; i < 8; ++i) lanes[i] = 8 * v + i < cols ? -1 : 0;
    mask[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  }
  for (int v = 0; v < V; ++v) {
    const __m256 init = b == nullptr ? _mm256_setzero_ps()
                        : FULL       ? _mm256_loadu_ps(b + j0 + 8 * v)
                                     : _mm256_maskload_ps(b + j0 + 8 * v, mask[v]);
    for (int m = 0; m < M; ++m) acc[m][v] = init;
  }
  const float* wp = w + j0;
  for (int64_t k = 0; k < K; ++k, wp += N) {
    __m256 wv[V];
    for (int v = 0; v < V; ++v)
      wv[v] = FULL ? _mm256_loadu_ps(wp + 8 * v) : _mm256_maskload_ps(wp + 8 * v, mask[v]);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_set1_ps(x[m * K + k]);
      for (int v = 0; v < V; ++v) acc[m][v] = _mm256_fmadd_ps(xv, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) {
      float* out = y + m * N + j0 + 8 * v;
      if (FULL)
        _mm256_storeu_ps(out, acc[m][v]);
      else
        _mm256_maskstore_ps(out, mask[v], acc[m][v]);
    }
}

// M rows (1-8) over every tile of N columns; a tile is W vectors of the ISA's width.
template <int M, int V, int WIDTH>
void rows_by_tiles(const float* x, int64_t K, const float* w, int64_t N, const float* b, float* y,
                   int threads) {
  constexpr int64_t TILE = V * WIDTH;
  const int64_t tiles = (N + TILE - 1) / TILE;
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tiles)));
#pragma omp parallel for num_threads(n) schedule(static) if (n > 1)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t j0 = t * TILE, cols = std::min(TILE, N - j0);
    if (WIDTH == 16) {
      if (cols == TILE)
        tile512<M, V, true>(x, K, w, N, b, y, j0, cols);
      else
        tile512<M, V, false>(x, K, w, N, b, y, j0, cols);
    } else {
      if (cols == TILE)
        tile256<M, V, true>(x, K, w, N, b, y, j0, cols);
      else
        tile256<M, V, false>(x, K, w, N, b, y, j0, cols);
    }
  }
}

template <int WIDTH>
void rows_linear(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* b,
                 float* y, int threads) {
  // (the tile widths keep the sums and one row of w within the ISA's registers: 32 or 16)
  constexpr bool Z = WIDTH == 16;
  for (int64_t r = 0; r < M; r += 8) {
    const float* xr = x + r * K;
    float* yr = y + r * N;
    switch (std::min<int64_t>(8, M - r)) {
      case 1: rows_by_tiles<1, Z ? 4 : 4, WIDTH>(xr, K, w, N, b, yr, threads); break;
      case 2: rows_by_tiles<2, Z ? 4 : 4, WIDTH>(xr, K, w, N, b, yr, threads); break;
      case 3: rows_by_tiles<3, Z ? 4 : 3, WIDTH>(xr, K, w, N, b, yr, threads); break;
      case 4: rows_by_tiles<4, Z ? 4 : 2, WIDTH>(xr, K, w, N, b, yr, threads); break;
      case 5: rows_by_tiles<5, Z ? 4 : 2, WIDTH>(xr, K, w, N, b, yr, threads); break;
      case 6: rows_by_tiles<6, Z ? 4 : 1, WIDTH>(xr, K, w, N, b, yr, threads); break;
      case 7: rows_by_tiles<7, Z ? 3 : 1, WIDTH>(xr, K, w, N, b, yr, threads); break;
      default: rows_by_tiles<8, Z ? 3 : 1, WIDTH>(xr, K, w, N, b, yr, threads); break;
    }
  }
}

// The same product with the weight stored [out, in] (a Hugging Face projection, or an embedding
// table as the head: y = x t^T): each group of R of t's rows keeps its M x R sums in vector
// registers along the input dim, one load of t feeding M multiply-adds, then reduces each.
template <int M, int R>
__attribute__((target("avx512f"))) void dots512(const float* x, int64_t K, const float* t,
                                                 const float* b, float* y, int64_t N,
                                                 int64_t n0) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 tv[R];
    for (int r = 0; r < R; ++r) tv[r] = _mm512_loadu_ps(t + (n0 + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, tv[r], acc[m][r]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 tv[R];
    for (int r = 0; r < R; ++r) tv[r] = _mm512_maskz_loadu_ps(mask, t + (n0 + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, tv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r)
      y[m * N + n0 + r] = _mm512_reduce_add_ps(acc[m][r]) + (b != nullptr ? b[n0 + r] : 0.f);
}

__attribute__((target("avx2,fma"))) inline float sum256(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

template <int M, int R>
__attribute__((target("avx2,fma"))) void dots256(const float* x, int64_t K, const float* t,
                                                  const float* b, float* y, int64_t N,
                                                  int64_t n0) {
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 tv[R];
    for (int r = 0; r < R; ++r) tv[r] = _mm256_loadu_ps(t + (n0 + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, tv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float v = sum256(acc[m][r]);
      for (int64_t j = k; j < K; ++j) v += x[m * K + j] * t[(n0 + r) * K + j];
      y[m * N + n0 + r] = v + (b != nullptr ? b[n0 + r] : 0.f);
    }
}

// M rows (1-8) against every group of R of t's rows (the last groups one row at a time).
template <int M, int R, int WIDTH>
void rows_by_dots(const float* x, int64_t K, const float* t, int64_t N, const float* b, float* y,
                  int threads) {
  const int64_t groups = N / R;
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, groups / 16)));
#pragma omp parallel for num_threads(n) schedule(static) if (n > 1)
  for (int64_t g = 0; g < groups; ++g) {
    if (WIDTH == 16)
      dots512<M, R>(x, K, t, b, y, N, g * R);
    else
      dots256<M, R>(x, K, t, b, y, N, g * R);
  }
  for (int64_t n0 = groups * R; n0 < N; ++n0) {
    if (WIDTH == 16)
      dots512<M, 1>(x, K, t, b, y, N, n0);
    else
      dots256<M, 1>(x, K, t, b, y, N, n0);
  }
}

template <int WIDTH>
void rows_linear_t(const float* x, int64_t M, int64_t K, const float* t, int64_t N,
                   const float* b, float* y, int threads) {
  constexpr bool Z = WIDTH == 16;
  for (int64_t r = 0; r < M; r += 8) {
    const float* xr = x + r * K;
    float* yr = y + r * N;
    switch (std::min<int64_t>(8, M - r)) {
      case 1: rows_by_dots<1, Z ? 8 : 4, WIDTH>(xr, K, t, N, b, yr, threads); break;
      case 2: rows_by_dots<2, Z ? 8 : 4, WIDTH>(xr, K, t, N, b, yr, threads); break;
      case 3: rows_by_dots<3, Z ? 6 : 3, WIDTH>(xr, K, t, N, b, yr, threads); break;
      case 4: rows_by_dots<4, Z ? 4 : 2, WIDTH>(xr, K, t, N, b, yr, threads); break;
      case 5: rows_by_dots<5, Z ? 4 : 2, WIDTH>(xr, K, t, N, b, yr, threads); break;
      case 6: rows_by_dots<6, Z ? 4 : 1, WIDTH>(xr, K, t, N, b, yr, threads); break;
      case 7: rows_by_dots<7, Z ? 3 : 1, WIDTH>(xr, K, t, N, b, yr, threads); break;
      default: rows_by_dots<8, Z ? 3 : 1, WIDTH>(xr, K, t, N, b, yr, threads); break;
    }
  }
}
#endif

// Which vector unit the few-row product runs on: 16 (AVX-512), 8 (AVX2 with FMA), 0 (none: the
// caller runs torch's matmul).
int linear_isa() {
#ifdef COLFUNC_X86
  if (__builtin_cpu_supports("avx512f")) return 16;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 8;
#endif
  return 0;
}

// `transposed`: w is stored [out, in].
void linear(uintptr_t y, uintptr_t x, uintptr_t w, uintptr_t b, int64_t rows, int64_t in,
            int64_t out, bool transposed, int threads) {
#ifdef COLFUNC_X86
  static const int isa = linear_isa();
  const auto* xp = reinterpret_cast<const float*>(x);
  const auto* wp = reinterpret_cast<const float*>(w);
  const auto* bp = reinterpret_cast<const float*>(b);
  auto* yp = reinterpret_cast<float*>(y);
  if (isa == 16 && transposed)
    rows_linear_t<16>(xp, rows, in, wp, out, bp, yp, threads);
  else if (isa == 16)
    rows_linear<16>(xp, rows, in, wp, out, bp, yp, threads);
  else if (isa == 8 && transposed)
    rows_linear_t<8>(xp, rows, in, wp, out, bp, yp, threads);
  else if (isa == 8)
    rows_linear<8>(xp, rows, in, wp, out, bp, yp, threads);
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rope", &rope, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear", &linear, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_isa", &linear_isa);
}

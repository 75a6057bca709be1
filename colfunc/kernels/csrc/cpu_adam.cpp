// AdamW on the CPU for optimizer states offloaded to host memory.
//
// One pass over each parameter reads param, grad and the two fp32 moments and writes param and
// moments (and, optionally, a bf16 copy of the param for the device to fetch), so the update runs
// at memory bandwidth. The tensors are cut into fixed-size chunks shared out over OpenMP threads;
// each chunk runs an AVX2/FMA loop when the CPU has those (checked at run time, so one binary runs
// everywhere) or a portable scalar loop. The arithmetic follows torch.optim.AdamW.
//
// The Python side (colfunc.ops.cpu_adam) validates every tensor and passes raw addresses: this
// file needs only pybind11, which keeps its compile to seconds. Built with -ffp-contract=off: a
// multiply and add that the compiler fused would round differently from torch.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define COLFUNC_X86 1
#endif

namespace {

constexpr int64_t kChunk = 1 << 14;  // elements per work item: 64 KB of fp32, a multiple of 8

// Scalars as torch.optim.AdamW rounds them: computed in double on the host, then cast to float.
struct Hyper {
  float decay;          // 1 - lr * weight_decay
  float lerp_weight;    // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
};

struct Tensors {
  float* param;
  const void* grad;     // float or bf16
  float* exp_avg;
  float* exp_avg_sq;
  uint16_t* param_bf16;  // nullptr when no copy is wanted
  bool grad_bf16;
};

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += ((bits >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>(bits >> 16);
}

// Operation for operation as torch's CPU kernels: mul_ (decay); lerp_ as one fused multiply-add
// from the nearer end; mul_ then addcmul_ (fused); sqrt, div, add_; addcdiv_ as p + (c * m) / d.
// Matching the roundings keeps the result within an ulp or two of torch at any learning rate.
void update_scalar(const Tensors& t, const Hyper& h, int64_t begin, int64_t end) {
  const bool near_start = h.lerp_weight < 0.5f;
  const float coeff = near_start ? h.lerp_weight : h.lerp_weight - 1.0f;
  const float* g32 = static_cast<const float*>(t.grad);
  const uint16_t* g16 = static_cast<const uint16_t*>(t.grad);
  for (int64_t i = begin; i < end; ++i) {
    const float g = t.grad_bf16 ? bf16_to_float(g16[i]) : g32[i];
    const float m_old = t.exp_avg[i];
    const float m = std::fma(coeff, g - m_old, near_start ? m_old : g);
    const float v = std::fma(h.one_minus_beta2 * g, g, t.exp_avg_sq[i] * h.beta2);
    const float denom = std::sqrt(v) / h.bc2_sqrt + h.eps;
    const float p = t.param[i] * h.decay + (h.neg_step_size * m) / denom;
    t.param[i] = p;
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    if (t.param_bf16) t.param_bf16[i] = float_to_bf16(p);
  }
}

#ifdef COLFUNC_X86
__attribute__((target("avx2,fma"))) inline __m256 load_bf16x8(const uint16_t* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,fma"))) inline void store_bf16x8(uint16_t* dst, __m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
}

__attribute__((target("avx2,fma"))) void update_avx2(const Tensors& t, const Hyper& h,
                                                      int64_t begin, int64_t end) {
  const bool near_start = h.lerp_weight < 0.5f;
  const __m256 coeff = _mm256_set1_ps(near_start ? h.lerp_weight : h.lerp_weight - 1.0f);
  const __m256 decay = _mm256_set1_ps(h.decay);
  const __m256 beta2 = _mm256_set1_ps(h.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(h.one_minus_beta2);
  const __m256 eps = _mm256_set1_ps(h.eps);
  const __m256 neg_step_size = _mm256_set1_ps(h.neg_step_size);
  const __m256 bc2_sqrt = _mm256_set1_ps(h.bc2_sqrt);
  const float* g32 = static_cast<const float*>(t.grad);
  const uint16_t* g16 = static_cast<const uint16_t*>(t.grad);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = t.grad_bf16 ? load_bf16x8(g16 + i) : _mm256_loadu_ps(g32 + i);
    const __m256 m_old = _mm256_loadu_ps(t.exp_avg + i);
    const __m256 m = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, m_old), near_start ? m_old : g);
    const __m256 v_old = _mm256_mul_ps(_mm256_loadu_ps(t.exp_avg_sq + i), beta2);
    const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, v_old);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt), eps);
    const __m256 p = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(t.param + i), decay),
                                   _mm256_div_ps(_mm256_mul_ps(neg_step_size, m), denom));
    _mm256_storeu_ps(t.param + i, p);
    _mm256_storeu_ps(t.exp_avg + i, m);
    _mm256_storeu_ps(t.exp_avg_sq + i, v);
    if (t.param_bf16) store_bf16x8(t.param_bf16 + i, p);
  }
  update_scalar(t, h, i, end);
}

bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
bool cpu_has_avx2() { return false; }
#endif

// Updates every tensor in place. Addresses and sizes come from Python, which checked them.
void adamw_step(const std::vector<uint64_t>& params, const std::vector<uint64_t>& grads,
                const std::vector<uint64_t>& exp_avgs, const std::vector<uint64_t>& exp_avg_sqs,
                const std::vector<uint64_t>& params_bf16, const std::vector<int64_t>& numels,
                const std::vector<bool>& grads_bf16, const Hyper& h, bool simd,
                int num_threads) {
  std::vector<Tensors> tensors;
  struct Item {
    int64_t tensor, begin, end;
  };
  std::vector<Item> items;
  for (size_t k = 0; k < params.size(); ++k) {
    tensors.push_back(Tensors{reinterpret_cast<float*>(params[k]),
                              reinterpret_cast<const void*>(grads[k]),
                              reinterpret_cast<float*>(exp_avgs[k]),
                              reinterpret_cast<float*>(exp_avg_sqs[k]),
                              reinterpret_cast<uint16_t*>(params_bf16[k]), grads_bf16[k]});
    for (int64_t b = 0; b < numels[k]; b += kChunk) {
      items.push_back(Item{static_cast<int64_t>(k), b, std::min(b + kChunk, numels[k])});
    }
  }
  const bool use_avx2 = simd && cpu_has_avx2();
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t j = 0; j < n; ++j) {
    const Item& it = items[j];
#ifdef COLFUNC_X86
    if (use_avx2) {
      update_avx2(tensors[it.tensor], h, it.begin, it.end);
      continue;
    }
#endif
    update_scalar(tensors[it.tensor], h, it.begin, it.end);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "AdamW over fp32 states in host memory, AVX2/FMA or scalar, on OpenMP threads";
  pybind11::class_<Hyper>(m, "Hyper")
      .def(pybind11::init<float, float, float, float, float, float, float>(),
           pybind11::arg("decay"), pybind11::arg("lerp_weight"), pybind11::arg("beta2"),
           pybind11::arg("one_minus_beta2"), pybind11::arg("eps"), pybind11::arg("neg_step_size"),
           pybind11::arg("bc2_sqrt"));
  m.def("adamw_step", &adamw_step, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("cpu_has_avx2", &cpu_has_avx2, "Whether this CPU runs the AVX2/FMA loop");
}

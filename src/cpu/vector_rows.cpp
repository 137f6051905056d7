// cpu/vector_rows.h: the loops, once, multiversioned.
#include "cpu/vector_rows.h"

#include <cmath>
#include "core/cross_entropy_math.h"  // host_exp

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FUSEDLOSS_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FUSEDLOSS_VECTOR_CLONES
#endif

namespace fusedloss::cpu {

FUSEDLOSS_VECTOR_CLONES
void span_stats(const float* v, int64_t n, float* max, float* sum_exp, float* sum) {
  float m = -INFINITY, s = 0.0f, sx = 0.0f;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = v[i] > m ? v[i] : m;
  const float ref = m == -INFINITY ? 0.0f : m;  // a span of -inf adds 0, shifted by 0
#pragma omp simd reduction(+ : s, sx)
  for (int64_t i = 0; i < n; ++i) {
    s += core::host_exp(v[i] - ref);  // (+inf: inf - inf, NaN, as the kernels' online sums)
    sx += v[i];
  }
  *max = m, *sum_exp = s, *sum = sx;
}

FUSEDLOSS_VECTOR_CLONES
void softmax_grad_span(const float* x, float* out, int64_t n, float lse, float scale, float shift) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = scale * core::host_exp(x[i] - lse) - shift;
}

}  // namespace fusedloss::cpu

// The cross-entropy math, once, for every backend. Scalar fp32 functions on host and device.
//
// Notation per row: x_j the logits of the whole vocabulary (V_global columns), m = max_j x_j,
// s = sum_j exp(x_j - m), lse = m + log s, T = x_target, SX = sum_j x_j.
//   loss = (1 - a)(lse - T) + a (lse - SX / K) + z lse^2
//   dloss/dx_j = p_j (1 + 2 z lse) - (1 - a)[j == target] - a / K,   p_j = exp(x_j - lse)
// with a the effective smoothing and K the number of columns it averages over.
#pragma once
#include <cstring>
#include <cmath>
#include <cstdint>
#include "core/platform.h"
#include "fusedloss/options.h"  // RowStats

namespace fusedloss::core {

// exp(x). On the GPU the hardware ex2 approximation (rel. error ~2^-22) of x log2(e), with
// results below 2^-126 flushed to zero: two instructions (__expf adds three more to keep
// subnormal results, which no softmax term needs), so that a kernel doing two passes' math
// over one read of the logits stays memory-bound; on the host libm's expf (host_exp where a
// loop is written to vectorise: a scalar host_exp is slower than expf).
constexpr float kLog2e = 1.4426950408889634f;

// exp(x) on the host as straight-line float arithmetic that a compiler vectorises (libm's expf
// is a call per element, which keeps the CPU backend's row loops scalar): x = n ln 2 + r with
// n = round(x log2 e) and |r| <= ln 2 / 2 (ln 2 in two parts, Cody and Waite), e^r by Cephes
// expf's polynomial, 2^n through the exponent bits. Within 1 unit in the last place of the
// exact value for x < 88 (4 above, where n stops at 127); results below 2^-126 (x < -87.34)
// are 0, as the GPU's flush; x > 88.72 gives inf; NaN stays NaN.
inline float host_exp(float x) {
  constexpr float kLowest = -87.33654f, kHighest = 88.72283f;
  // (comparisons, not fminf / fmaxf: those are libm calls that stop vectorisation; NaN is
  // restored at the end)
  float xc = x > kLowest ? x : kLowest;
  xc = xc < kHighest ? xc : kHighest;
  // round to nearest by the 1.5 x 2^23 shift (no libm call); n <= 127 keeps 2^n finite
  float n = (xc * kLog2e + 12582912.0f) - 12582912.0f;
  n = n < 127.0f ? n : 127.0f;
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float q = 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  const float two_n = __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
  float y = (q * r * r + r + 1.0f) * two_n;
  y = x < kLowest ? 0.0f : y;
  y = x > kHighest ? INFINITY : y;
  return x != x ? x : y;
}

FL_HD float fast_exp(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * kLog2e));
  return y;
#else
  return expf(x);
#endif
}

// exp(m_old - m_new) as the factor that moves a sum-exp from reference m_old to m_new.
// Equal references (including -inf == -inf, an all-masked prefix) need no rescaling; the
// explicit test avoids exp(-inf - -inf) = NaN.
FL_HD float rescale(float m_old, float m_new) {
  return m_old == m_new ? 1.0f : fast_exp(m_old - m_new);
}

// exp(x - m) for an element, 0 for a masked (-inf) element even when m is -inf too.
FL_HD float exp_shifted(float x, float m) { return x == -INFINITY ? 0.0f : fast_exp(x - m); }

// Online softmax: fold one element into (m, s). A NaN element makes s NaN (propagates).
FL_HD void online_add(float& m, float& s, float x) {
  if (x > m) {
    s = s * rescale(m, x) + 1.0f;
    m = x;
  } else {
    s += exp_shifted(x, m);
  }
}

// Fold a chunk of N elements: one max, one rescale of the running sum, N exps.
template <int N>
FL_HD void online_add_chunk(float& m, float& s, const float* x) {
  float chunk_max = x[0];
FL_UNROLL
  for (int i = 1; i < N; ++i) chunk_max = fmaxf(chunk_max, x[i]);
  float m_new = fmaxf(m, chunk_max);
  // If m_new is -inf every element is -inf (adds 0) or NaN (adds NaN): shift by 0 instead.
  float ref = m_new == -INFINITY ? 0.0f : m_new;
  float acc = 0.0f;
FL_UNROLL
  for (int i = 0; i < N; ++i) acc += fast_exp(x[i] - ref);
  s = s * rescale(m, m_new) + acc;
  m = m_new;
}

// Merge two partial (max, sum-exp) pairs.
FL_HD void online_merge(float& m, float& s, float m2, float s2) {
  float mn = fmaxf(m, m2);
  s = s * rescale(m, mn) + s2 * rescale(m2, mn);
  m = mn;
}

// Smoothing coefficients of one row.
struct Smoothing {
  float alpha;      // effective smoothing weight a
  float inv_count;  // 1 / K
};

// PyTorch: a = ls over K = V. Megatron: a = ls * K / (K - 1) (K > 1 is validated upstream).
FL_HD Smoothing make_smoothing(float label_smoothing, bool megatron_formula, int64_t count) {
  Smoothing sm;
  sm.alpha = megatron_formula && label_smoothing > 0.0f
                 ? label_smoothing * float(count) / float(count - 1)
                 : label_smoothing;
  sm.inv_count = 1.0f / float(count);
  return sm;
}

// Per-row loss from merged statistics (max m, log s). Each difference is taken before log s is
// added, as (m - T) + log s rather than lse - T: with logits near a large offset C, lse and T
// are both ~C and their fp32 difference would carry C * 2^-24 of rounding, more than the loss
// itself for C ~ 1e4 and a confident row.
FL_HD float row_loss(float max, float log_s, float target_logit, float sum_logits, Smoothing sm,
                     float z_loss) {
  float loss = (1.0f - sm.alpha) * ((max - target_logit) + log_s);
  if (sm.alpha != 0.0f) loss += sm.alpha * ((max - sum_logits * sm.inv_count) + log_s);
  if (z_loss != 0.0f) {
    const float lse = max + log_s;
    loss += z_loss * lse * lse;
  }
  return loss;
}

// Row constants of the gradient, so the per-element work is one exp and one fma:
//   g_j = p_scale * exp(x_j - lse) - smooth - (j == target ? target_weight : 0)
struct GradRow {
  float lse;
  float lse_log2;       // lse * log2(e), for the exponent as one fma on the GPU
  float p_scale;        // dL * (1 + 2 z lse)
  float smooth;         // dL * a / K
  float target_weight;  // dL * (1 - a)
};

FL_HD GradRow make_grad_row(float lse, float grad_loss, Smoothing sm, float z_loss) {
  GradRow g;
  g.lse = lse;
  g.lse_log2 = lse * kLog2e;
  g.p_scale = grad_loss * (1.0f + 2.0f * z_loss * lse);
  g.smooth = grad_loss * sm.alpha * sm.inv_count;
  g.target_weight = grad_loss * (1.0f - sm.alpha);
  return g;
}

// Gradient of a row whose loss is 0 by definition (ignored row).
FL_HD GradRow zero_grad_row() { return GradRow{0.0f, 0.0f, 0.0f, 0.0f, 0.0f}; }

// Whether a row's non-target columns may take their exponent in one fma (softmax_p<true>):
// lse log2(e) must be finite, which fails for |lse| beyond FLT_MAX / log2(e) ~ 2.36e38 (a row
// of logits near the bottom of fp32's range, such as a vocabulary all masked with
// finfo(dtype).min): there the difference x - lse is still exact and the fma form would give
// inf. A NaN row takes the difference too (NaN either way).
FL_HD bool fma_exponent(const GradRow& g) { return fabsf(g.lse_log2) <= 3.0e38f; }

// p_j = exp(x_j - lse). kFma (non-target columns of a row where fma_exponent holds; GPU only):
// ex2(x_j log2(e) - lse log2(e)) in one fma and one ex2, half the instructions of the
// subtraction, multiply and ex2 (the kernels that write the gradient in the forward are bound by
// their instruction issue as much as by memory). The rounding of lse log2(e) adds |lse| 2^-24 to
// the exponent's error, the size of the error lse itself carries as one fp32 value, and the
// same for every column of the row. Otherwise the exponential of the exact difference (the
// host: expf).
template <bool kFma = false>
FL_HD float softmax_p(const GradRow& g, float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (kFma) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(fmaf(x, kLog2e, -g.lse_log2)));
    return y;
  }
#endif
  return fast_exp(x - g.lse);
}

// The target's column always keeps the exact difference x_t - lse, whose gradient p_t - 1
// cancels in a confident row: where lse rounds to x_t (one column, or a target far above the
// rest) p_t is exactly 1 and the gradient exactly 0, where the fma form would leave its rounding
// residue. The kernels pass kFma = true (and is_target = false) for the vectors without the
// target in rows where fma_exponent holds, and the default elsewhere.
template <bool kFma = false>
FL_HD float grad_element(const GradRow& g, float x, bool is_target) {
  if (is_target) return (g.p_scale * fast_exp(x - g.lse) - g.smooth) - g.target_weight;
  return g.p_scale * softmax_p<kFma>(g, x) - g.smooth;
}

// Logit soft-capping (Gemma-2): the loss sees z = c tanh(x / c) for a cap c > 0; c == 0 is
// off. Linear cross-entropy sets it; the logits-level entry points leave it 0.
FL_HD float cap_logit(float x, float cap) { return cap > 0.0f ? cap * tanhf(x / cap) : x; }

// The gradient with respect to the uncapped logit x: dL/dz at z = cap_logit(x), times
// dz/dx = 1 - (z / c)^2.
FL_HD float capped_grad_element(const GradRow& g, float x, bool is_target, float cap) {
  if (cap <= 0.0f) return grad_element(g, x, is_target);
  const float z = cap * tanhf(x / cap), t = z / cap;
  return grad_element(g, z, is_target) * (1.0f - t * t);
}

// Target classification shared by every pass.
enum class TargetKind { Ignored, Local, Remote, OutOfRange };

FL_HD TargetKind classify_target(int64_t target, int64_t ignore_index, int64_t vocab_start,
                                 int64_t vocab_local, int64_t vocab_global) {
  if (target == ignore_index) return TargetKind::Ignored;
  if (target < 0 || target >= vocab_global) return TargetKind::OutOfRange;
  if (target >= vocab_start && target < vocab_start + vocab_local) return TargetKind::Local;
  return TargetKind::Remote;
}

// Merge: the owner's target logit is the one that is not the -inf placeholder
// (a NaN target logit propagates; a real -inf target logit stays -inf).
FL_HD float merge_target_logit(float t_acc, float t_part) {
  return t_part == -INFINITY ? t_acc : t_part;
}

// Row r of `parts` gathered shards ([parts][rows] RowStats) merged into one: every rank runs
// the same fixed-order merge, so every rank gets the same bits.
FL_HD RowStats merge_row(const RowStats* combined, int parts, int64_t rows, int64_t r) {
  RowStats acc = combined[r];
  for (int k = 1; k < parts; ++k) {
    const RowStats part = combined[int64_t(k) * rows + r];
    online_merge(acc.max, acc.sum_exp, part.max, part.sum_exp);
    acc.target_logit = merge_target_logit(acc.target_logit, part.target_logit);
    acc.sum_logits += part.sum_logits;
  }
  return acc;
}

// All-reduce form: this rank's row rescaled to the global max so that an element-wise SUM over
// ranks merges (the max itself travels once, from rank 0; the owner alone adds its target).
FL_HD RowStats summable_row(const RowStats& local, float global_max, bool owner, int rank) {
  return RowStats{rank == 0 ? global_max : 0.0f, local.sum_exp * rescale(local.max, global_max),
                  owner ? local.target_logit : 0.0f, local.sum_logits};
}

// The loss a row reports: 0 when ignored, NaN for an out-of-range target, else row_loss.
FL_HD float reported_loss(TargetKind kind, float max, float log_s, float target_logit,
                          float sum_logits, Smoothing sm, float z_loss) {
  if (kind == TargetKind::Ignored) return 0.0f;
  if (kind == TargetKind::OutOfRange) return NAN;
  return row_loss(max, log_s, target_logit, sum_logits, sm, z_loss);
}

// Row i's term of the targets' checksum the vocab-parallel agreement compares: the sum over
// rows of mix(t_i ^ mix(i)), wrapping mod 2^64, in any order. mix is splitmix64's finaliser,
// a bijection: a change of one target always changes the sum; permuted rows or several changes
// leave it equal only by a 2^-64 coincidence (a term linear in i would not: swapping two
// blocks of rows holding the same tokens would cancel). The Python agreement computes the same
// (fusedloss/_distributed.py).
FL_HD uint64_t checksum_mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
FL_HD uint64_t target_checksum_term(int64_t target, int64_t row) {
  return checksum_mix(uint64_t(target) ^ checksum_mix(uint64_t(row)));
}
// A row weight's term in the same sum: its bits, -0 read as 0 and every NaN as the one quiet
// NaN 0x7fc00000 (the same weight; a NaN's payload and sign are not kept alike by host and
// device arithmetic), as the row rows + row (after the targets' rows, so that a target and a
// weight cannot trade places).
FL_HD uint64_t row_weight_checksum_term(float weight, int64_t row, int64_t rows) {
  const float w = weight + 0.0f;
  int32_t bits = 0x7fc00000;
  if (w == w) memcpy(&bits, &w, sizeof(bits));
  return target_checksum_term(int64_t(bits), rows + row);
}

}  // namespace fusedloss::core

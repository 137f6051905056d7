// The CPU backend's row loops over floats that vectorise, compiled for AVX-512 and AVX2 beside
// the baseline and chosen at load time (GCC's target_clones; one build serves every x86-64 CPU):
// the exponentials of a softmax are most of a row pass's time, and 16 lanes do them 4x faster
// than the baseline's 4. Each element's math is core::host_exp's; sums are in lane order, so the
// bits depend on the CPU's widest ISA (every rank of one machine gets the same).
#pragma once
#include <cstdint>

namespace fusedloss::cpu {

// Of v[0, n): its max (NaN skipped, as fmaxf; -inf for none), then sum_j exp(v_j - max) (a NaN
// or a +inf makes it NaN, as the kernels' online sums; with max -inf it is 0) and sum_j v_j.
void span_stats(const float* v, int64_t n, float* max, float* sum_exp, float* sum);

// out_j = scale exp(x_j - lse) - shift for j in [0, n) (out may be x).
void softmax_grad_span(const float* x, float* out, int64_t n, float lse, float scale, float shift);

}  // namespace fusedloss::cpu

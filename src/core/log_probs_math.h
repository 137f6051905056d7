// The log-prob head's math, once, for every backend. Scalar fp32 functions on host and device.
//
// Per row, with y_j = z_j / T the logits at temperature T over the whole vocabulary, m = max y,
// s = sum_j exp(y_j - m), u = sum_j exp(y_j - m) (y_j - m), lse = m + log s, p_j = exp(y_j - lse):
//   log_prob = y_t - lse                       (t: the row's token)
//   entropy  = -sum_j p_j log p_j = log s - u / s
//   argmax   = the smallest j with y_j = m
// Keeping u relative to m (not sum p y) leaves no cancellation of two large terms in the
// entropy. Gradients, for upstream gradients g (of log_prob) and e (of entropy):
//   d log_prob / dz_j = ([j == t] - p_j) / T
//   d entropy  / dz_j = -p_j (log p_j + entropy) / T
#pragma once
#include <cmath>
#include <cstdint>
#include "core/cross_entropy_math.h"  // fast_exp, rescale
#include "core/platform.h"
#include "fusedloss/linear_log_probs.h"  // LogProbStats

namespace fusedloss::core {

FL_HD LogProbStats lp_empty() {
  LogProbStats s;
  s.max = -INFINITY;
  s.sum_exp = 0.0f;
  s.sum_exp_shifted = 0.0f;
  s.target = -INFINITY;
  s.argmax = INT64_MAX;
  return s;
}

// (s, u) moved from reference m_old to m_new >= m_old:
//   s' = s e^(m_old - m_new),  u' = e^(m_old - m_new) (u + (m_old - m_new) s).
FL_HD void lp_shift(LogProbStats& a, float m_new) {
  if (a.max == m_new || a.sum_exp == 0.0f) {
    a.max = a.sum_exp == 0.0f ? m_new : a.max;
    return;
  }
  const float d = a.max - m_new, f = fast_exp(d);
  a.sum_exp_shifted = f * (a.sum_exp_shifted + d * a.sum_exp);
  a.sum_exp *= f;
  a.max = m_new;
}

// Fold column `col` (global id) with scaled logit y into a. Columns folded in increasing order
// keep the smallest id of a tie; a NaN logit makes the sums NaN.
FL_HD void lp_add(LogProbStats& a, float y, int64_t col) {
  if (y > a.max) {
    lp_shift(a, y);
    a.argmax = col;
  } else if (y != y) {
    a.sum_exp = a.sum_exp_shifted = NAN;
    return;
  }
  if (y == -INFINITY) return;
  const float d = y - a.max, e = fast_exp(d);
  a.sum_exp += e;
  a.sum_exp_shifted += e * d;
}

// a and b of disjoint columns (shards, or one thread's columns and another's): order-free but
// for the argmax tie, which keeps the smaller id.
FL_HD LogProbStats lp_combine(LogProbStats a, LogProbStats b) {
  const float m = fmaxf(a.max, b.max);
  LogProbStats r;
  r.argmax = a.max > b.max ? a.argmax : b.max > a.max ? b.argmax
                                                       : (a.argmax < b.argmax ? a.argmax : b.argmax);
  if (m != -INFINITY && m == m) {  // both sums to the common reference (none yet: as they are)
    lp_shift(a, m);
    lp_shift(b, m);
  }
  r.max = m;
  r.sum_exp = a.sum_exp + b.sum_exp;
  r.sum_exp_shifted = a.sum_exp_shifted + b.sum_exp_shifted;
  r.target = fmaxf(a.target, b.target);  // one shard holds the token, the others -inf
  return r;
}

// The row's results from its merged statistics.
FL_HD float lp_lse(const LogProbStats& s) { return s.max + logf(s.sum_exp); }
FL_HD float lp_entropy(const LogProbStats& s) {
  return logf(s.sum_exp) - s.sum_exp_shifted / s.sum_exp;
}

// dz_j for the scaled logit y of column j: inv_t = 1 / T, g and e the upstream gradients of the
// row's log_prob and entropy (0 where absent), is_target whether j is the row's token.
FL_HD float lp_grad(float y, float lse, float entropy, bool is_target, float g, float e,
                    float inv_t) {
  const float logp = y - lse, p = fast_exp(logp);
  return inv_t * (g * ((is_target ? 1.0f : 0.0f) - p) - e * p * (logp + entropy));
}

}  // namespace fusedloss::core

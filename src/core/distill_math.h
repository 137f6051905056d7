// The linear distillation loss's row math (fusedloss/linear_distillation.h), once for every
// backend. Per row, over the vocabulary j, with the student's logits x_j, s_j = x_j / T, the
// teacher's t_j (already / T), q = softmax(s), p = softmax(t), w the hard-label weight:
//
//   pass 1   lse_s, lse_t (and lse_z of the raw x_j when w > 0): online max / sum-exp
//   pass 2   forward_kl  soft = sum_j p_j (log p_j - log q_j)
//            reverse_kl  soft = sum_j q_j (log q_j - log p_j)
//            jsd         soft = beta sum_j p_j log(p_j / m_j) + (1 - beta) sum_j q_j log(q_j / m_j),
//                        m = beta p + (1 - beta) q; soft_student = sum_j q_j log(q_j / m_j)
//   loss     (1 - w) soft + w (lse_z - x_target)
//
// and the gradient of g loss (g the row's upstream gradient) over x_j:
//
//   g [(1 - w) / T dsoft/ds_j + w (exp(x_j - lse_z) - [j == target])], with dsoft/ds_j =
//   forward_kl  q_j - p_j
//   reverse_kl  q_j (log q_j - log p_j - soft)                       (d/ds of sum_k q_k a_k)
//   jsd         q_j (1 - beta) (log(q_j / m_j) - soft_student)       (dL/dq_k = (1 - beta) log(q_k / m_k))
//
// A term whose probability is 0 is 0 (0 log 0 = 0); a class the student gives probability 0
// where the teacher does not makes forward_kl infinite, as the definition does.
#pragma once
#include <cmath>
#include "core/platform.h"
#include "fusedloss/linear_distillation.h"

namespace fusedloss::core {

struct DistillParams {
  Divergence divergence;
  float beta;
  float inv_t;        // 1 / temperature
  float hard_weight;  // w
};

// p log(p) - p log(r) with the convention 0 log 0 = 0, from logs.
FL_HD float p_log_ratio(float log_p, float log_r) {
  const float p = expf(log_p);
  return p > 0.0f ? p * (log_p - log_r) : 0.0f;
}

// log(beta e^a + (1 - beta) e^b) for log-probabilities a, b: the mixture's log, without
// leaving the log domain where both are tiny.
FL_HD float log_mixture(float a, float b, float beta) {
  const float hi = a > b ? a : b;
  if (hi == -INFINITY) return -INFINITY;
  return hi + logf(beta * expf(a - hi) + (1.0f - beta) * expf(b - hi));
}

// Pass 2's terms of one column: adds its share of soft and soft_student.
FL_HD void distill_soft_terms(const DistillParams& p, float log_q, float log_p, float& soft,
                              float& soft_student) {
  switch (p.divergence) {
    case Divergence::ForwardKL: soft += p_log_ratio(log_p, log_q); return;
    case Divergence::ReverseKL: soft += p_log_ratio(log_q, log_p); return;
    case Divergence::JSD: {
      const float log_m = log_mixture(log_p, log_q, p.beta);
      const float tq = p_log_ratio(log_q, log_m);
      soft += p.beta * p_log_ratio(log_p, log_m) + (1.0f - p.beta) * tq;
      soft_student += tq;
      return;
    }
  }
}

// dsoft/ds of one column (the soft term's gradient over the scaled student logit).
FL_HD float distill_soft_grad(const DistillParams& p, float log_q, float log_p,
                              const DistillRowStats& r) {
  const float q = expf(log_q);
  switch (p.divergence) {
    case Divergence::ForwardKL: return q - expf(log_p);
    case Divergence::ReverseKL: return q > 0.0f ? q * ((log_q - log_p) - r.soft) : 0.0f;
    case Divergence::JSD: {
      if (!(q > 0.0f)) return 0.0f;
      const float log_m = log_mixture(log_p, log_q, p.beta);
      return q * (1.0f - p.beta) * ((log_q - log_m) - r.soft_student);
    }
  }
  return 0.0f;
}

// The gradient over the raw student logit x of column j (is_target: j is the row's target),
// for the row's upstream gradient g; t is the teacher's logit already divided by T.
FL_HD float distill_grad(const DistillParams& p, const DistillRowStats& r, float x, float t,
                         bool is_target, float g) {
  const float log_q = x * p.inv_t - r.lse_student, log_p = t - r.lse_teacher;
  float d = (1.0f - p.hard_weight) * p.inv_t * distill_soft_grad(p, log_q, log_p, r);
  if (p.hard_weight > 0.0f) d += p.hard_weight * (expf(x - r.lse_hard) - (is_target ? 1.0f : 0.0f));
  return g * d;
}

}  // namespace fusedloss::core

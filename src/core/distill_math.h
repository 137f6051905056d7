// The linear distillation loss's row math (fusedloss/linear_distillation.h), once for every
// backend. Per row, over the vocabulary j, with the student's logits x_j, s_j = x_j / T, the
// teacher's t_j (already / T), q = softmax(s), p = softmax(t), w the hard-label weight:
//
//   pass 1   lse_s, lse_t (and lse_z of the raw x_j when w > 0): online max / sum-exp, and the
//            KL divergences in the same pass, from a cross term summed beside its sum-exp:
//            forward_kl  soft = sum_j p_j (t_j - s_j) - lse_t + lse_s = C / S_t - log S_t + log S_s,
//                          C = sum_j e^(t_j - M_t) ((t_j - M_t) - (s_j - M_s))
//            reverse_kl  the same with s and t swapped
//            (M, S: each pair's max and sum-exp). Each column's difference is taken relative
//            to both maxima, so that an offset between the two models' logits (the softmax
//            ignores it; two models' logits often differ by several units) cancels in every
//            term instead of in the fp32 sum; C moves with both maxima. Pass 1's partial statistics
//            of a part of a row (a thread's columns, a vocabulary shard) merge in any order:
//            the shards of a vocab-parallel row meet in one all-gather of DistillPartial.
//   pass 2   jsd only, over the row again with the merged lse (distill_jsd_terms):
//            soft = beta sum_j p_j log(p_j / m_j) + (1 - beta) sum_j q_j log(q_j / m_j),
//            m = beta p + (1 - beta) q; soft_student = sum_j q_j log(q_j / m_j) (both sums
//            again merge by addition across shards)
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
#include "core/cross_entropy_math.h"  // online_add, online_merge, rescale, fast_exp
#include "core/platform.h"
#include "fusedloss/linear_distillation.h"

namespace fusedloss::core {

struct DistillParams {
  Divergence divergence;
  float beta;
  float inv_t;        // 1 / temperature
  float hard_weight;  // w
};

// Pass 1's statistics of a part of a row (fusedloss::DistillPartial, 32 bytes: what a
// vocab-parallel row's shards exchange): three online (max, sum-exp) pairs, the KL's cross term
// relative to both pairs' maxima (weighted by the teacher's pair for forward_kl, the student's
// for reverse_kl; jsd: unused), and the raw student logit at the row's target if this part
// holds it (else -inf).
using fusedloss::DistillPartial;

FL_HD DistillPartial distill_empty() {
  return {-INFINITY, 0.0f, -INFINITY, 0.0f, -INFINITY, 0.0f, 0.0f, -INFINITY};
}

// One column of a KL's online statistics: w the weighting distribution's scaled logit (the
// teacher's for forward_kl), o the other's, each with its (max, sum-exp) pair, and the cross
// term c = sum_j e^(w_j - mw) ((w_j - mw) - (o_j - mo)), moved as the maxima move: a higher mo
// raises every earlier difference by the step, a higher mw lowers them by its step and scales
// their weights down. A masked column (w = -inf) adds nothing; one with weight where o = -inf
// makes c (the KL) infinite, as the definition does; NaN propagates.
FL_HD void kl_add(float& mw, float& sw, float& mo, float& so, float& c, float w, float o) {
  if (o > mo) {
    if (sw > 0.0f) c += (o - mo) * sw;
    so = so * rescale(mo, o) + 1.0f;
    mo = o;
  } else {
    so += exp_shifted(o, mo);
  }
  const float o_rel = o == -INFINITY ? -INFINITY : o - mo;  // (-inf - -inf: still -inf)
  if (w > mw) {
    const float k = rescale(mw, w);
    c = sw > 0.0f && k > 0.0f ? k * (c - (w - mw) * sw) : 0.0f;
    sw = sw * k + 1.0f;
    mw = w;
    c -= o_rel;  // this column: (w - mw) - (o - mo) with w = mw
  } else if (w != -INFINITY) {
    const float e = fast_exp(w - mw);
    if (e > 0.0f) c += e * ((w - mw) - o_rel);
    sw += e;
  }
}

// A logit divided by the temperature, rounded once. Every pass must see the same s_j (pass 1
// keeps one of them as the row's max), so on the device the product must not fuse into the
// subtraction that follows: an fma would keep the product's rounding error, up to half an ulp
// of s, and (s - max) at the row's max would be that error instead of 0.
FL_HD float scaled(float x, float inv_t) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(x, inv_t);
#else
  return x * inv_t;
#endif
}

// One column of pass 1 from the raw logits x (the student's) and y (the teacher's): s = x / T,
// t = y / T, and x itself for the hard label's lse.
FL_HD void distill_add(const DistillParams& p, DistillPartial& a, float x, float y) {
  const float s = scaled(x, p.inv_t), t = scaled(y, p.inv_t);
  switch (p.divergence) {
    case Divergence::ForwardKL: kl_add(a.max_t, a.sum_t, a.max_s, a.sum_s, a.cross, t, s); break;
    case Divergence::ReverseKL: kl_add(a.max_s, a.sum_s, a.max_t, a.sum_t, a.cross, s, t); break;
    case Divergence::JSD:
      online_add(a.max_s, a.sum_s, s);
      online_add(a.max_t, a.sum_t, t);
      break;
  }
  if (p.hard_weight > 0.0f) online_add(a.max_z, a.sum_z, x);
}

// One part's cross term moved to the merged maxima (mw, mo): its weights scale by
// e^(its mw - mw), its differences shift by (mo - its mo) - (mw - its mw).
FL_HD float cross_at(float c, float s_w, float m_w, float m_o, float mw, float mo) {
  if (!(s_w > 0.0f)) return 0.0f;
  const float k = rescale(m_w, mw);
  return k > 0.0f ? k * (c + ((mo - m_o) - (mw - m_w)) * s_w) : 0.0f;
}

// Two parts of one row (commutative up to rounding; the target is in at most one part).
FL_HD DistillPartial distill_combine(const DistillParams& p, DistillPartial a,
                                     const DistillPartial& b) {
  if (p.divergence != Divergence::JSD) {
    const bool fwd = p.divergence == Divergence::ForwardKL;  // weights: the teacher's pair
    const float aw = fwd ? a.max_t : a.max_s, ao = fwd ? a.max_s : a.max_t;
    const float bw = fwd ? b.max_t : b.max_s, bo = fwd ? b.max_s : b.max_t;
    const float mw = fmaxf(aw, bw), mo = fmaxf(ao, bo);
    a.cross = cross_at(a.cross, fwd ? a.sum_t : a.sum_s, aw, ao, mw, mo) +
              cross_at(b.cross, fwd ? b.sum_t : b.sum_s, bw, bo, mw, mo);
  }
  online_merge(a.max_s, a.sum_s, b.max_s, b.sum_s);
  online_merge(a.max_t, a.sum_t, b.max_t, b.sum_t);
  online_merge(a.max_z, a.sum_z, b.max_z, b.sum_z);
  a.target = fmaxf(a.target, b.target);
  return a;
}

// A whole row's merged statistics -> what the backward reads (soft: the KL's, or 0 for jsd
// until pass 2 adds it). Each pair's max and log-sum stay apart (see log_prob).
FL_HD DistillRowStats distill_row_stats(const DistillParams& p, const DistillPartial& a) {
  DistillRowStats r{a.max_s, logf(a.sum_s), a.max_t, logf(a.sum_t), a.max_z, logf(a.sum_z),
                    0.0f, 0.0f};
  if (p.divergence == Divergence::ForwardKL)
    r.soft = a.cross / a.sum_t - r.log_sum_teacher + r.log_sum_student;
  else if (p.divergence == Divergence::ReverseKL)
    r.soft = a.cross / a.sum_s - r.log_sum_student + r.log_sum_teacher;
  return r;
}

// log softmax at a logit v of a row with that (max, log-sum): (v - max) - log_sum. v - max is
// exact near the max (Sterbenz), so a peaked row's top classes keep fp32's relative accuracy
// whatever the logits' magnitude. A row of -inf only: NaN or +inf, as v - lse would be.
FL_HD float log_prob(float v, float max, float log_sum) { return (v - max) - log_sum; }
FL_HD float log_q_of(const DistillRowStats& r, float s) {
  return log_prob(s, r.max_student, r.log_sum_student);
}
FL_HD float log_p_of(const DistillRowStats& r, float t) {
  return log_prob(t, r.max_teacher, r.log_sum_teacher);
}

// The row's loss from its final statistics; x_target: the raw logit at the target, -inf where
// no shard holds it. A hard-label row with targets but no such logit (a device target out of
// range, which the kernels report) gets NaN, not the infinite loss of a -inf logit.
FL_HD float distill_loss(const DistillParams& p, const DistillRowStats& r, float x_target,
                         bool has_target) {
  float l = (1.0f - p.hard_weight) * r.soft;
  if (p.hard_weight > 0.0f) l += x_target == -INFINITY && has_target ? NAN
                                 : p.hard_weight * ((r.max_hard - x_target) + r.log_sum_hard);
  return l;
}

// Row r of world shards' partials ([world, rows], shard-major) -> its stats and loss.
FL_HD void distill_merge_row(const DistillParams& p, const DistillPartial* partials, int world,
                             int64_t rows, int64_t r, bool has_target, DistillRowStats& stats,
                             float& loss) {
  DistillPartial a = partials[r];
  for (int k = 1; k < world; ++k) a = distill_combine(p, a, partials[int64_t(k) * rows + r]);
  stats = distill_row_stats(p, a);
  loss = distill_loss(p, stats, a.target, has_target);
}

// jsd's mixture at one column, from the two log-probabilities: p, q and log m, m = beta p +
// (1 - beta) q (two exp and a log). m is 0 only where both p and q are (or underflow): its log
// is then -inf, and every term it enters is 0.
struct Mixture {
  float p, q, log_m;
};
FL_HD Mixture mixture(float log_p, float log_q, float beta) {
  const float p = fast_exp(log_p), q = fast_exp(log_q);
  return {p, q, logf(beta * p + (1.0f - beta) * q)};
}

// x log(x / m) from x and the logs, 0 where x is 0 (0 log 0 = 0) or m underflowed beside a
// subnormal x (whose true term is below x log(1 / beta)).
FL_HD float x_log_ratio(float x, float log_x, float log_m) {
  return x > 0.0f && log_m != -INFINITY ? x * (log_x - log_m) : 0.0f;
}

// jsd's pass-2 terms of one column (raw logits x, y; the row's merged stats r): adds its share
// of soft and soft_student.
FL_HD void distill_jsd_terms(const DistillParams& p, const DistillRowStats& r, float x, float y,
                             float& soft, float& soft_student) {
  const float log_q = log_q_of(r, scaled(x, p.inv_t)), log_p = log_p_of(r, scaled(y, p.inv_t));
  const Mixture m = mixture(log_p, log_q, p.beta);
  const float tq = x_log_ratio(m.q, log_q, m.log_m);
  soft += p.beta * x_log_ratio(m.p, log_p, m.log_m) + (1.0f - p.beta) * tq;
  soft_student += tq;
}

// dsoft/ds of one column (the soft term's gradient over the scaled student logit).
FL_HD float distill_soft_grad(const DistillParams& p, float log_q, float log_p,
                              const DistillRowStats& r) {
  switch (p.divergence) {
    case Divergence::ForwardKL: return fast_exp(log_q) - fast_exp(log_p);
    case Divergence::ReverseKL: {
      const float q = fast_exp(log_q);
      return q > 0.0f ? q * ((log_q - log_p) - r.soft) : 0.0f;
    }
    case Divergence::JSD: {
      const Mixture m = mixture(log_p, log_q, p.beta);
      return (1.0f - p.beta) * (x_log_ratio(m.q, log_q, m.log_m) - m.q * r.soft_student);
    }
  }
  return 0.0f;
}

// The gradient over the raw student logit x of column j (is_target: j is the row's target),
// for the row's upstream gradient g; y is the teacher's raw logit.
FL_HD float distill_grad(const DistillParams& p, const DistillRowStats& r, float x, float y,
                         bool is_target, float g) {
  const float log_q = log_q_of(r, scaled(x, p.inv_t)), log_p = log_p_of(r, scaled(y, p.inv_t));
  float d = (1.0f - p.hard_weight) * p.inv_t * distill_soft_grad(p, log_q, log_p, r);
  if (p.hard_weight > 0.0f)
    d += p.hard_weight * (fast_exp(log_prob(x, r.max_hard, r.log_sum_hard)) -
                          (is_target ? 1.0f : 0.0f));
  return g * d;
}

}  // namespace fusedloss::core

// The float64 reference cross-entropy, written plainly from the definitions (log-softmax),
// independent of src/core. Used by every test as the ground truth.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

namespace fusedloss::test {

struct RefOptions {
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  bool megatron_formula = false;
  double z_loss = 0.0;
};

struct RefResult {
  std::vector<double> loss;  // per row
  std::vector<double> lse;   // per row
  std::vector<double> grad;  // [rows, V], d(sum_r w_r loss_r)/dx with w = grad weights
  int64_t valid = 0;
};

// x: [rows, V] dense in double; grad_weight[r] multiplies row r's loss (the upstream gradient
// after the reduction: 1 for sum, 1/valid for mean, the given vector for none).
inline RefResult reference_cross_entropy(const std::vector<double>& x, int64_t rows, int64_t V,
                                         const std::vector<int64_t>& target, const RefOptions& o,
                                         const std::vector<double>& grad_weight) {
  RefResult res;
  res.loss.assign(rows, 0.0);
  res.lse.assign(rows, 0.0);
  res.grad.assign(rows * V, 0.0);
  double alpha = o.label_smoothing;
  if (o.megatron_formula && alpha > 0) alpha = alpha * double(V) / double(V - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = &x[r * V];
    double mx = -INFINITY;
    for (int64_t j = 0; j < V; ++j) mx = std::fmax(mx, xr[j]);
    double sum = 0.0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(xr[j] - mx);
    const double log_sum = std::log(sum);
    double lse = mx + log_sum;
    res.lse[r] = lse;
    if (target[r] == o.ignore_index) continue;
    ++res.valid;
    // log_softmax_j = (x_j - max) - log(sum): exact for logits near any offset, where x_j - lse
    // would lose log(sum) to lse's rounding (rows at -3e38, whose double ulp is ~4e22)
    auto logp = [&](int64_t j) { return (xr[j] - mx) - log_sum; };
    double logp_t = logp(target[r]);
    res.loss[r] = -(1.0 - alpha) * logp_t + o.z_loss * lse * lse;
    if (alpha > 0) {
      double mean_logp = 0.0;
      for (int64_t j = 0; j < V; ++j) mean_logp += logp(j) / double(V);
      res.loss[r] -= alpha * mean_logp;
    }
    for (int64_t j = 0; j < V; ++j) {
      double p = std::exp(logp(j));
      double g = p * (1.0 + 2.0 * o.z_loss * lse) - alpha / double(V);
      if (j == target[r]) g -= 1.0 - alpha;
      res.grad[r * V + j] = grad_weight[r] * g;
    }
  }
  return res;
}

}  // namespace fusedloss::test

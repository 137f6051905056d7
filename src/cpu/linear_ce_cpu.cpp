#include "cpu/linear_ce_cpu.h"

#include <algorithm>
#include "core/dispatch.h"
#include "core/lce_bias.h"
#include "core/row_weight.h"
#include "common/error.h"
#include "cpu/gemm_cpu.h"
#include "cpu/matrix_cpu.h"
#include "cpu/parallel.h"

namespace fusedloss::cpu {

void lce_run(const core::LcePlan& plan, const MatrixView& hidden, const MatrixView& weight,
             const core::LceSteps& steps, const core::LceGrads& grads, void* memory) {
  const bool with_grads = bool(steps.gradient);
  if (with_grads && !grads.accumulate_dweight)  // also right for N == 0: a zero gradient
    zero(grads.dweight);
  // `memory`: the chunk buffer, then the GEMMs' fp32 stage for 16-bit operands
  const size_t stage_bytes = core::lce_cpu_stage_bytes(plan);
  const GemmStage stage{stage_bytes ? reinterpret_cast<float*>(static_cast<char*>(memory) +
                                                               core::lce_cpu_stage_at(plan))
                                    : nullptr,
                        int64_t(stage_bytes / sizeof(float))};
  for (int64_t row0 = 0; row0 < plan.rows; row0 += plan.chunk) {
    const int64_t n = std::min(plan.chunk, plan.rows - row0);
    const MatrixView h = rows_of(hidden, row0, n);
    const MatrixView logits{memory, n, plan.vocab_local, plan.stride, plan.dtype, Device::CPU};
    const bool biased = steps.bias.data != nullptr;
    if (biased) lce_fill_bias(logits, steps.bias);  // the GEMM adds to it in its fp32 tile
    gemm(h, false, weight, true, logits, biased, stage);  // [n, V] (+)= h @ W^T
    core::lce_run_steps(plan, steps, logits, row0, nullptr);
    if (!with_grads) continue;
    gemm(logits, false, weight, false, rows_of(grads.dhidden, row0, n),
         grads.accumulate_dhidden, stage);                                   // G @ W
    gemm(logits, true, h, false, grads.dweight, true, stage);               // G^T @ h
  }
}

void lce_fill_bias(const MatrixView& logits, const VectorView& bias) {
  core::dispatch_dtype(logits.dtype, [&](auto kl) {
    core::dispatch_dtype(bias.dtype, [&](auto kb) {
      constexpr core::StorageKind KL = decltype(kl)::value, KB = decltype(kb)::value;
      const auto* b = static_cast<const core::Elem<KB>*>(bias.data);
#pragma omp parallel for schedule(static) if (worth_threads(logits.rows * logits.cols))
      for (int64_t r = 0; r < logits.rows; ++r) {
        auto* row = static_cast<core::Elem<KL>*>(logits.data) + r * logits.row_stride;
        for (int64_t c = 0; c < logits.cols; ++c) row[c] = core::lce_bias_start<KL, KB>(b[c]);
      }
    });
  });
}

void lce_add_column_sums(const MatrixView& g, float* acc) {
  core::dispatch_dtype(g.dtype, [&](auto kg) {
    constexpr core::StorageKind KG = decltype(kg)::value;
    const auto* data = static_cast<const core::Elem<KG>*>(g.data);
#pragma omp parallel for schedule(static) if (worth_threads(g.rows * g.cols))
    for (int64_t c = 0; c < g.cols; ++c)
      acc[c] = core::lce_column_sum<KG>(data, g.row_stride, g.rows, c, acc[c]);
  });
}

void lce_scale(const MatrixView& src, const MatrixView& dst, const float* scale, bool accumulate) {
  const float s = scale[0];
#pragma omp parallel for schedule(static) if (worth_threads(src.rows * src.cols))
  for (int64_t r = 0; r < src.rows; ++r)
    for (int64_t c = 0; c < src.cols; ++c)
      store(dst, r, c, s * load(src, r, c) + (accumulate ? load(dst, r, c) : 0.0f));
}

float lce_row_weight_scale(const float* grad_loss, const float* row_weight, int64_t n) {
  int64_t first = 0;
  while (first < n && row_weight[first] == 0.0f) ++first;
  const float c = first < n ? core::row_weight_scale(grad_loss[first], row_weight[first]) : 0.0f;
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(grad_loss[i])) return std::nanf("");
  for (int64_t i = 0; i < n; ++i)
    detail::require(core::fits_row_weight(grad_loss[i], row_weight[i], c),
                    "linear_cross_entropy_backward: grad_loss[", i, "]: got ", grad_loss[i],
                    " where row_weight[", i, "] (Python: loss_mask) is ", row_weight[i],
                    ", expected c * row_weight (here c = ", c, ", from row ", first, ")",
                    core::kNotRowWeightedWhy);
  return c;
}

}  // namespace fusedloss::cpu

// fusedloss: the option enums and the per-row statistics record, without the entry points.
// Small on purpose: the shared math (src/core) and the Python binding include it alone.
#pragma once

namespace fusedloss {

// Mean: over rows whose target != ignore_index; 0 (and zero gradients) where no row counts,
// where torch.nn.functional.cross_entropy gives NaN.
enum class Reduction { None, Sum, Mean };
enum class SmoothingFormula { PyTorch, Megatron };  // alpha = ls, or ls * K / (K - 1)
enum class SmoothingScope { Global, Partition };    // K = V_global, or this rank's V_local
enum class CollectiveForm { AllGather, AllReduce };  // 1 collective, or 2 (max, then sum)

// Per-row partial statistics of one shard. target_logit is -inf when the target lives on
// another shard or the row is ignored.
struct RowStats {
  float max;
  float sum_exp;  // sum_j exp(x_j - max)
  float target_logit;
  float sum_logits;  // sum_j x_j, used by label smoothing
};

}  // namespace fusedloss

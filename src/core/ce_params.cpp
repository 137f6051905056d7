// The cross-entropy options, checked and resolved once for every entry point.
#include "core/ce_params.h"

#include <cmath>
#include "common/error.h"
#include "fusedloss/cross_entropy.h"

namespace fusedloss::core {

CeParams resolve_params(const CrossEntropyOptions& o, int64_t rows, int64_t vocab_local) {
  using detail::require;
  require(rows >= 0, "rows: got ", rows, ", expected >= 0");
  require(vocab_local >= 1, "vocab_local: got ", vocab_local,
          ", expected >= 1 (the columns of this rank's logits)");
  CeParams p;
  p.rows = rows;
  p.vocab_local = vocab_local;
  p.vocab_global = o.vocab_global < 0 ? vocab_local : o.vocab_global;
  p.vocab_start = o.vocab_start;
  p.ignore_index = o.ignore_index;
  require(o.vocab_global == -1 || o.vocab_global >= vocab_local, "options.vocab_global: got ",
          o.vocab_global, ", expected -1 or >= the shard's columns (", vocab_local, ")");
  require(o.vocab_start >= 0 && o.vocab_start <= p.vocab_global - vocab_local,  // no overflow
          "options.vocab_start: got ", o.vocab_start, ", expected in [0, ",
          p.vocab_global - vocab_local, "] so the shard of ", vocab_local,
          " columns fits in vocab_global ", p.vocab_global);
  require(std::isfinite(o.label_smoothing) && o.label_smoothing >= 0.0f &&
              o.label_smoothing < 1.0f,
          "options.label_smoothing: got ", o.label_smoothing, ", expected in [0, 1)");
  require(std::isfinite(o.z_loss) && o.z_loss >= 0.0f, "options.z_loss: got ", o.z_loss,
          ", expected a finite value >= 0");
  require(std::isfinite(o.logit_softcap) && o.logit_softcap >= 0.0f,
          "options.logit_softcap: got ", o.logit_softcap, ", expected 0 (off) or a finite value > 0");
  require(o.reduction == Reduction::None || o.reduction == Reduction::Sum ||
              o.reduction == Reduction::Mean,
          "options.reduction: got ", int(o.reduction), ", expected None, Sum or Mean");
  require(o.smoothing_formula == SmoothingFormula::PyTorch ||
              o.smoothing_formula == SmoothingFormula::Megatron,
          "options.smoothing_formula: got ", int(o.smoothing_formula),
          ", expected PyTorch or Megatron");
  require(o.smoothing_scope == SmoothingScope::Global ||
              o.smoothing_scope == SmoothingScope::Partition,
          "options.smoothing_scope: got ", int(o.smoothing_scope), ", expected Global or Partition");
  require(o.collective == CollectiveForm::AllGather || o.collective == CollectiveForm::AllReduce,
          "options.collective: got ", int(o.collective), ", expected AllGather or AllReduce");
  p.partition_scope = o.smoothing_scope == SmoothingScope::Partition;
  int64_t count = p.partition_scope ? vocab_local : p.vocab_global;
  bool megatron = o.smoothing_formula == SmoothingFormula::Megatron;
  require(!(megatron && o.label_smoothing > 0.0f && count < 2),
          "options.label_smoothing: the Megatron formula ls*K/(K-1) needs K >= 2 columns, got K = ",
          count);
  p.smoothing = make_smoothing(o.label_smoothing, megatron, count);
  p.need_sum_logits = o.label_smoothing > 0.0f;
  p.z_loss = o.z_loss;
  p.reduction = o.reduction;
  p.softcap = o.logit_softcap + 0.0f;  // -0 is off
  return p;
}


}  // namespace fusedloss::core

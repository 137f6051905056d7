#include "core/lce_tuning.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include "fusedloss/linear_cross_entropy.h"

namespace fusedloss::core {
namespace {

// The variable's value among `choices` (index), or `fallback` when unset or empty.
int choice(const char* name, std::initializer_list<const char*> choices, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  int i = 0;
  std::string expected;
  for (const char* c : choices) {
    if (std::strcmp(v, c) == 0) return i;
    expected += (i ? " or " : "") + std::string(c);
    ++i;
  }
  throw Error(std::string(name) + ": got \"" + v + "\", expected " + expected + " (or unset)");
}

int64_t integer(const char* name, int64_t fallback, int64_t least, int64_t most) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long k = std::strtoll(v, &end, 10);
  if (*end != '\0' || k < least || k > most)
    throw Error(std::string(name) + ": got \"" + v + "\", expected an integer in [" +
                std::to_string(least) + ", " + std::to_string(most) + "] (or unset)");
  return int64_t(k);
}

std::mutex phase_mu;
LinearCePhaseTimes phase_sums;

}  // namespace

LceTuning lce_tuning() {
  LceTuning t;
  t.buffers = choice("FUSEDLOSS_LCE_BUFFERS", {"2", "1"}, 1) == 0 ? 2 : 1;
  t.dhidden_group = choice("FUSEDLOSS_LCE_DHIDDEN", {"chunk", "group"}, 0) == 1;
  t.side_stream = choice("FUSEDLOSS_LCE_SIDE_STREAM", {"1", "0"}, 0) == 0;
  t.gemm_algos = int(integer("FUSEDLOSS_LCE_GEMM_ALGOS", 1, 1, 32));
  t.dhidden_pieces = int(integer("FUSEDLOSS_LCE_DH_PIECES", 1, 1, 16));
  t.ce_rows = integer("FUSEDLOSS_LCE_CE_ROWS", 0, 0, int64_t(1) << 30);
  t.gemm_workspace_cap = size_t(integer("FUSEDLOSS_LCE_GEMM_WORKSPACE_MIB", 4, 0, 256)) << 20;
  t.teacher_rows = integer("FUSEDLOSS_DISTILL_TEACHER_ROWS", 0, 0, int64_t(1) << 30);
  t.timing = choice("FUSEDLOSS_LCE_TIMING", {"0", "1"}, 0) == 1;
  return t;
}

void lce_add_phase_times(const LinearCePhaseTimes& t) {
  std::lock_guard<std::mutex> lock(phase_mu);
  phase_sums.logits_ms += t.logits_ms;
  phase_sums.ce_ms += t.ce_ms;
  phase_sums.dhidden_ms += t.dhidden_ms;
  phase_sums.dweight_ms += t.dweight_ms;
  phase_sums.loop_ms += t.loop_ms;
  phase_sums.loops += t.loops;
}

}  // namespace fusedloss::core

namespace fusedloss {

LinearCePhaseTimes linear_cross_entropy_phase_times(bool reset) {
  std::lock_guard<std::mutex> lock(core::phase_mu);
  const LinearCePhaseTimes t = core::phase_sums;
  if (reset) core::phase_sums = LinearCePhaseTimes{};
  return t;
}

}  // namespace fusedloss

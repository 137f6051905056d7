// When the CPU backend spreads rows over OpenMP threads: only when the work pays for waking
// them (small problems run faster on the calling thread).
#pragma once
#include <cstdint>

namespace fusedloss::cpu {
inline bool worth_threads(int64_t elements) { return elements >= (int64_t(1) << 16); }
}  // namespace fusedloss::cpu

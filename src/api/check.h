// Argument checks shared by the public entry points. Each throws fusedloss::Error with a
// message that names the argument, the value and what was expected.
#pragma once
#include "common/error.h"
#include "core/ce_params.h"
#include "fusedloss/types.h"

namespace fusedloss::detail {

// A matrix view that is well formed: sizes, stride, pointer, known dtype and device.
void check_matrix(const MatrixView& m, const char* name, bool allow_fp8 = false);
void check_index(const IndexView& t, const char* name, int64_t expected_size, Device device);
// true when the two views cover overlapping memory
bool overlaps(const MatrixView& a, const MatrixView& b);
// CPU targets are checked before anything is written (throws naming the first bad row); CUDA
// kernels check them in flight, so this does nothing for CUDA targets.
void check_targets_on_host(const IndexView& target, const core::CeParams& p);

}  // namespace fusedloss::detail

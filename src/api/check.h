// Argument checks shared by the public entry points. Each throws fusedloss::Error with a
// message that names the argument, the value and what was expected.
#pragma once
#include <sstream>
#include <string>
#include "fusedloss/types.h"

namespace fusedloss::detail {

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw Error(os.str());
}

template <class... Parts>
void require(bool ok, const Parts&... parts) {
  if (!ok) fail(parts...);
}

// A matrix view that is well formed: sizes, stride, pointer, known dtype and device.
void check_matrix(const MatrixView& m, const char* name, bool allow_fp8 = false);
void check_index(const IndexView& t, const char* name, int64_t expected_size, Device device);
// true when the two views cover overlapping memory
bool overlaps(const MatrixView& a, const MatrixView& b);
int64_t element_size(DType dtype);
// The error for a CUDA view in a build without the CUDA backend.
[[noreturn]] void no_cuda(const char* what);

}  // namespace fusedloss::detail

// Runs `cpu_call` or `cuda_call` by device; in a build without the CUDA backend the CUDA branch
// is not compiled and raises instead.
#ifdef FUSEDLOSS_WITH_CUDA
#define FL_CUDA_BRANCH(what, cuda_call) cuda_call
#else
#define FL_CUDA_BRANCH(what, cuda_call) ::fusedloss::detail::no_cuda(what)
#endif
#define FL_DISPATCH(device, what, cpu_call, cuda_call) \
  do {                                                 \
    if ((device) == ::fusedloss::Device::CPU) {        \
      cpu_call;                                        \
    } else {                                           \
      FL_CUDA_BRANCH(what, cuda_call);                 \
    }                                                  \
  } while (0)

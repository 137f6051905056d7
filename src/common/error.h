// Errors for every layer (api, core, cpu, cuda, comm): the one place that builds a
// fusedloss::Error message, so no layer needs the API's argument checks to report a failure.
// Messages name the argument, the value and what was expected.
#pragma once
#include <cstdint>
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

// Bytes per element; throws for a value outside the DType enum.
int64_t element_size(DType dtype);
// The error for a CUDA view in a build without the CUDA backend.
[[noreturn]] void no_cuda(const char* what);

}  // namespace fusedloss::detail

// Runs `cpu_call` or `cuda_call` by device; in a build without the CUDA backend the CUDA branch
// is not compiled and raises instead.
#ifdef FUSEDLOSS_WITH_CUDA
#define FL_CUDA_BRANCH(fn, cuda_call) cuda_call
#else
#define FL_CUDA_BRANCH(fn, cuda_call) ::fusedloss::detail::no_cuda(fn)
#endif
#define FL_DISPATCH(device, what, cpu_call, cuda_call) \
  do {                                                 \
    if ((device) == ::fusedloss::Device::CPU) {        \
      cpu_call;                                        \
    } else {                                           \
      FL_CUDA_BRANCH(what, cuda_call);                 \
    }                                                  \
  } while (0)

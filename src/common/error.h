// Errors for every layer (api, core, cpu, cuda, comm): the one place that builds a
// fusedloss::Error message, so no layer needs the API's argument checks to report a failure.
// Messages name the argument, the value and what was expected.
#pragma once
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include "fusedloss/types.h"

namespace fusedloss::detail {

// A message part as written: floating-point values keep a decimal point (a user who passed
// 1.0 reads "1.0", not "1"); everything else as operator<< writes it.
template <class T>
void write_part(std::ostringstream& os, const T& v) {
  if constexpr (std::is_floating_point_v<T>) {
    std::ostringstream f;
    f << v;
    const std::string s = f.str();
    os << s << (s.find_first_not_of("-0123456789") == std::string::npos ? ".0" : "");
  } else {
    os << v;
  }
}

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream os;
  (write_part(os, parts), ...);
  throw Error(os.str());
}

template <class... Parts>
void require(bool ok, const Parts&... parts) {
  if (!ok) fail(parts...);
}

// The CUDA layer's error when no device can run the kernels (no GPU, a driver older than this
// build's runtime, ...). The dispatch below rethrows it as a plain Error that names the public
// function, since the CUDA layer does not know which one called it.
class NoUsableCudaDevice : public Error {
 public:
  using Error::Error;
};

// Bytes per element; throws for a value outside the DType enum.
int64_t element_size(DType dtype);
// The error for a CUDA view in a build without the CUDA backend.
[[noreturn]] void no_cuda(const char* what);

}  // namespace fusedloss::detail

// Runs `cpu_call` or `cuda_call` by device; in a build without the CUDA backend the CUDA branch
// is not compiled and raises instead.
#ifdef FUSEDLOSS_WITH_CUDA
#define FL_CUDA_BRANCH(fn, cuda_call)                               \
  try {                                                             \
    cuda_call;                                                      \
  } catch (const ::fusedloss::detail::NoUsableCudaDevice& fl_e_) {  \
    ::fusedloss::detail::fail(fn, ": ", fl_e_.what());              \
  }
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

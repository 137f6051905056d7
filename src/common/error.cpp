#include "common/error.h"

namespace fusedloss {

const char* to_string(DType d) {
  switch (d) {
    case DType::F32: return "fp32";
    case DType::F16: return "fp16";
    case DType::BF16: return "bf16";
    case DType::FP8_E4M3: return "fp8_e4m3";
  }
  return "unknown dtype";
}
const char* to_string(IndexType t) {
  switch (t) {
    case IndexType::I32: return "int32";
    case IndexType::I64: return "int64";
  }
  return "unknown index type";
}
const char* to_string(Device d) {
  switch (d) {
    case Device::CPU: return "cpu";
    case Device::CUDA: return "cuda";
  }
  return "unknown device";
}

namespace detail {

int64_t element_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::F16:
    case DType::BF16: return 2;
    case DType::FP8_E4M3: return 1;
  }
  fail("dtype: got ", int(dtype), ", expected fp32, fp16, bf16 or fp8_e4m3");
}

void no_cuda(const char* what) {
  fail(what, ": got a CUDA view, but this fusedloss build has no CUDA backend "
             "(rebuild with -DFUSEDLOSS_CUDA=ON)");
}

}  // namespace detail
}  // namespace fusedloss

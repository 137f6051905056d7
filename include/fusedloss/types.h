// fusedloss: public types. Non-owning views over memory the caller owns.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fusedloss {

// FP8_E4M3 (float8_e4m3fn: no inf, NaN = 0x7f) is only a storage format for SwiGLU's saved
// input; every other entry point takes fp32, fp16 or bf16.
enum class DType { F32, F16, BF16, FP8_E4M3 };
enum class IndexType { I32, I64 };
enum class Device { CPU, CUDA };

const char* to_string(DType);
const char* to_string(IndexType);
const char* to_string(Device);

// The one exception type of the library. Messages name the argument, the value
// and what was expected.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// The device had no memory for a call's scratch (an Error too): adapters report it as their
// framework's out-of-memory error (torch.OutOfMemoryError in Python), not as a bad argument.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// A row-major matrix: element (r, c) lives at data + (r * row_stride + c) * sizeof(dtype).
// Columns are contiguous; row_stride >= cols (in elements).
struct MatrixView {
  void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
  DType dtype = DType::F32;
  Device device = Device::CPU;
};

// A contiguous vector (a bias, per-token weights). data == nullptr means "absent".
struct VectorView {
  const void* data = nullptr;
  int64_t size = 0;
  DType dtype = DType::F32;
  Device device = Device::CPU;
};

// A contiguous vector of class indices, one per row.
struct IndexView {
  const void* data = nullptr;
  int64_t size = 0;
  IndexType type = IndexType::I64;
  Device device = Device::CPU;
};

// cudaStream_t without including the CUDA headers; nullptr is the legacy default stream.
using Stream = void*;

}  // namespace fusedloss

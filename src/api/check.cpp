#include "api/check.h"

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

void check_matrix(const MatrixView& m, const char* name, bool allow_fp8) {
  element_size(m.dtype);
  require(allow_fp8 || m.dtype != DType::FP8_E4M3, name, ".dtype: got fp8_e4m3, expected fp32, fp16 or bf16");
  require(m.device == Device::CPU || m.device == Device::CUDA, name, ".device: got ",
          int(m.device), ", expected cpu or cuda");
  require(m.rows >= 0, name, ".rows: got ", m.rows, ", expected >= 0");
  require(m.cols >= 1, name, ".cols: got ", m.cols, ", expected >= 1");
  require(m.row_stride >= m.cols || m.rows <= 1, name, ".row_stride: got ", m.row_stride,
          ", expected >= cols (", m.cols, ")");
  require(m.data != nullptr || m.rows == 0, name, ".data: got null for ", m.rows,
          " rows, expected a pointer");
}

void check_index(const IndexView& t, const char* name, int64_t expected_size, Device device) {
  require(t.type == IndexType::I32 || t.type == IndexType::I64, name, ".type: got ",
          int(t.type), ", expected int32 or int64");
  require(t.size == expected_size, name, ".size: got ", t.size, ", expected ", expected_size,
          " (one target per logits row)");
  require(t.device == device, name, ".device: got ", to_string(t.device), ", expected ",
          to_string(device), " (the logits' device)");
  require(t.data != nullptr || t.size == 0, name, ".data: got null, expected a pointer");
}

bool overlaps(const MatrixView& a, const MatrixView& b) {
  if (a.rows == 0 || b.rows == 0) return false;
  auto span = [](const MatrixView& m) {
    auto lo = static_cast<const char*>(m.data);
    auto hi = lo + ((m.rows - 1) * m.row_stride + m.cols) * element_size(m.dtype);
    return std::pair{lo, hi};
  };
  auto [alo, ahi] = span(a);
  auto [blo, bhi] = span(b);
  return alo < bhi && blo < ahi;
}

void no_cuda(const char* what) {
  fail(what, ": got a CUDA view, but this fusedloss build has no CUDA backend "
             "(rebuild with -DFUSEDLOSS_CUDA=ON)");
}

}  // namespace detail
}  // namespace fusedloss

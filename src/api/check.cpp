#include "api/check.h"

#include "cpu/cross_entropy_cpu.h"

namespace fusedloss::detail {

void require_element_aligned(const void* p, int64_t elem_bytes, const char* type, const char* name,
                             const char* field) {
  require(reinterpret_cast<uintptr_t>(p) % uintptr_t(elem_bytes) == 0, name, field,
          ": got an address that is not ", elem_bytes, "-byte aligned, expected the start of a ",
          type, " element");
}

void require_element_aligned(const void* p, DType dtype, const char* name, const char* field) {
  require_element_aligned(p, element_size(dtype), to_string(dtype), name, field);
}

void require_element_aligned(const VectorView& v, const char* name) {
  require_element_aligned(v.data, v.dtype, name);
}

void check_matrix(const MatrixView& m, const char* name, bool allow_fp8) {
  const bool known = m.dtype == DType::F32 || m.dtype == DType::F16 || m.dtype == DType::BF16 ||
                     m.dtype == DType::FP8_E4M3;
  require(known, name, ".dtype: got ", int(m.dtype), ", expected fp32, fp16 or bf16",
          allow_fp8 ? " (or fp8_e4m3)" : "");
  require(allow_fp8 || m.dtype != DType::FP8_E4M3, name, ".dtype: got fp8_e4m3, expected fp32, fp16 or bf16");
  require(m.device == Device::CPU || m.device == Device::CUDA, name, ".device: got ",
          int(m.device), ", expected cpu or cuda");
  require(m.rows >= 0, name, ".rows: got ", m.rows, ", expected >= 0");
  require(m.cols >= 1, name, ".cols: got ", m.cols, ", expected >= 1");
  require(m.row_stride >= m.cols || m.rows <= 1, name, ".row_stride: got ", m.row_stride,
          ", expected >= cols (", m.cols, ")");
  require(m.data != nullptr || m.rows == 0, name, ".data: got null for ", m.rows,
          " rows, expected a pointer");
  require_element_aligned(m.data, m.dtype, name);
  // the view's extent in bytes must be a number (the overlap checks and the kernels add it)
  int64_t elems = 0, bytes = 0;
  const bool fits = m.rows == 0 ||
                    (!__builtin_mul_overflow(m.rows - 1, m.row_stride, &elems) &&
                     !__builtin_add_overflow(elems, m.cols, &elems) &&
                     !__builtin_mul_overflow(elems, element_size(m.dtype), &bytes));
  require(fits, name, ": got [", m.rows, ", ", m.cols, "] with row_stride ", m.row_stride,
          ", expected an extent that fits in 2^63 bytes");
}

void check_index(const IndexView& t, const char* name, int64_t expected_size, Device device,
                 const char* rows_of) {
  require(t.type == IndexType::I32 || t.type == IndexType::I64, name, ".type: got ",
          int(t.type), ", expected int32 or int64");
  require(t.size == expected_size, name, ".size: got ", t.size, ", expected ", expected_size,
          " (one target per row of ", rows_of, ")");
  require(t.device == device, name, ".device: got ", to_string(t.device), ", expected ",
          to_string(device), " (", rows_of, "'s device)");
  require(t.data != nullptr || t.size == 0, name, ".data: got null, expected a pointer");
  const bool i32 = t.type == IndexType::I32;
  require_element_aligned(t.data, i32 ? 4 : 8, i32 ? "int32" : "int64", name);
}

Span span_of(const MatrixView& m, const char* name) {
  if (m.rows == 0 || m.cols == 0 || m.data == nullptr) return {nullptr, 0, name};
  return {m.data, ((m.rows - 1) * m.row_stride + m.cols) * element_size(m.dtype), name};
}

Span span_of(const IndexView& t, const char* name) {
  return {t.data, t.data ? t.size * (t.type == IndexType::I32 ? 4 : 8) : 0, name};
}

Span span_of(const VectorView& v, const char* name) {
  return {v.data, v.data ? v.size * element_size(v.dtype) : 0, name};
}

namespace {
bool meet(const Span& a, const Span& b) {
  if (!a.p || !b.p || a.bytes <= 0 || b.bytes <= 0) return false;
  auto alo = static_cast<const char*>(a.p), blo = static_cast<const char*>(b.p);
  return alo < blo + b.bytes && blo < alo + a.bytes;
}
}  // namespace

bool overlaps(const MatrixView& a, const MatrixView& b) {
  return meet(span_of(a, ""), span_of(b, ""));
}

void require_disjoint(std::initializer_list<Span> spans) {
  for (auto a = spans.begin(); a != spans.end(); ++a)
    for (auto b = a + 1; b != spans.end(); ++b)
      require(!meet(*a, *b), a->name, ": overlaps ", b->name, ", expected separate buffers");
}

void require_outputs_apart(std::initializer_list<Span> outputs, std::initializer_list<Span> inputs) {
  require_disjoint(outputs);
  for (const Span& out : outputs)
    for (const Span& in : inputs) require_disjoint({out, in});
}

void require_read_apart(const Span& written, std::initializer_list<Span> read) {
  for (const Span& r : read)
    require(!meet(written, r), written.name, ": overlaps ", r.name, ", expected a separate buffer (",
            r.name, " is read while ", written.name, " is written)");
}

void check_targets_on_host(const IndexView& target, const core::CeParams& p, const char* name) {
  if (target.device != Device::CPU) return;
  int64_t value = 0;
  int64_t row = cpu::first_bad_target(target, p, &value);
  require(row < 0, name, "[", row, "]: got ", value, ", expected in [0, ", p.vocab_global,
          ") or ignore_index (", p.ignore_index, ")");
}

}  // namespace fusedloss::detail

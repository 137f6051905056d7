// Argument checks shared by the public entry points. Each throws fusedloss::Error with a
// message that names the argument, the value and what was expected.
#pragma once
#include <initializer_list>
#include "common/error.h"
#include "core/ce_params.h"
#include "fusedloss/types.h"

namespace fusedloss::detail {

// `p` (null: absent) starts an element of `elem_bytes` bytes (a `type`): the kernels load whole
// elements, and a misaligned one is a CUDA fault, not an error the caller can read. The error
// names `name` + `field` ("logits" ".data"; a raw pointer: field "").
void require_element_aligned(const void* p, int64_t elem_bytes, const char* type, const char* name,
                             const char* field = ".data");
void require_element_aligned(const void* p, DType dtype, const char* name, const char* field = ".data");
// A vector view that is given (data not null) starts an element of its dtype.
void require_element_aligned(const VectorView& v, const char* name);
// A matrix view that is well formed: sizes, stride, pointer (element-aligned), known dtype and
// device.
void check_matrix(const MatrixView& m, const char* name, bool allow_fp8 = false);
// rows_of: the argument whose rows the targets belong to (named in the messages)
void check_index(const IndexView& t, const char* name, int64_t expected_size, Device device,
                 const char* rows_of = "logits");
// true when the two views cover overlapping memory
bool overlaps(const MatrixView& a, const MatrixView& b);
// A buffer's address range for the overlap checks: `bytes` bytes at p (null or 0: absent).
struct Span {
  const void* p;
  int64_t bytes;
  const char* name;
};
Span span_of(const MatrixView& m, const char* name);  // first to last element, padding included
Span span_of(const IndexView& t, const char* name);
Span span_of(const VectorView& v, const char* name);  // absent (null data): any dtype
// Every pair of the given buffers is disjoint (an absent one always is); else an Error naming
// the first overlapping pair.
void require_disjoint(std::initializer_list<Span> spans);
// Outputs disjoint from each other and from every input (inputs may share memory: both read).
void require_outputs_apart(std::initializer_list<Span> outputs, std::initializer_list<Span> inputs);
// Refuses a buffer a kernel writes (`written`) that shares memory with one it reads at the same
// time (`read`: targets, scales, biases, saved stats), naming both. In place over its own
// input is the caller's check; this is for the auxiliary inputs.
void require_read_apart(const Span& written, std::initializer_list<Span> read);
// CPU targets are checked before anything is written (throws naming the first bad row); CUDA
// kernels check them in flight, so this does nothing for CUDA targets.
void check_targets_on_host(const IndexView& target, const core::CeParams& p,
                           const char* name = "target");

}  // namespace fusedloss::detail

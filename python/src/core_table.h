// The core entry points that the C++ autograd nodes (torch_nodes/) call, exported by
// fusedloss._C as a table of plain function pointers.
//
// Why a table: the nodes' library is built against torch and its C++ runtime, _C is not (it
// carries its own, static). Linking the core into both would put two copies of its state in
// the process: two device error words (a bad target flagged by a node's kernel would be
// invisible to fusedloss.check_device_errors(), which reads _C's), two sets of caches, the
// kernels twice. Through the table there is one core, _C's. No C++ exception crosses the
// boundary between the two runtimes: each entry returns nullptr on success, else what the
// core threw (valid until the next failing call on the same thread).
#pragma once
#include <cstddef>
#include <cstdint>

#include "fusedloss/fusedloss.h"

namespace fusedloss::python {

// What a core call threw: an argument error (fusedloss::Error, ValueError in Python) or
// anything else (an allocation failure, a CUDA error: RuntimeError).
struct CoreFailure {
  bool argument_error;
  bool out_of_memory;  // fusedloss::OutOfMemory: torch.OutOfMemoryError
  const char* message;
};
using CoreError = const CoreFailure*;

// Raised whenever an entry is added, removed or changes its parameters (or a struct passed
// through the table changes): a library built against another layout refuses the table.
constexpr uint32_t kCoreTableVersion = 9;  // 8: swiglu_gate_up_*; 9: the linear CE's bias

struct CoreTable {
  uint32_t version = kCoreTableVersion;
  uint32_t size = sizeof(CoreTable);
  CoreError (*rms_norm_forward)(const MatrixView& x, const VectorView& weight,
                                const RmsNormOptions& options, const MatrixView& y, float* rstd,
                                const MatrixView& residual, const MatrixView& residual_out,
                                Stream stream) = nullptr;
  CoreError (*rms_norm_backward_workspace_bytes)(int64_t rows, int64_t hidden, Device device,
                                                 size_t* bytes) = nullptr;
  CoreError (*rms_norm_backward)(const MatrixView& grad_y, const MatrixView& x_or_s,
                                 const VectorView& weight, const float* rstd,
                                 const RmsNormOptions& options, const MatrixView& grad_x,
                                 void* grad_weight, DType grad_weight_dtype, void* workspace,
                                 const MatrixView& grad_residual_out, Stream stream) = nullptr;
  CoreError (*swiglu_forward)(const MatrixView& y, const VectorView& bias,
                              const VectorView& weights, const SwigluOptions& options,
                              const MatrixView& out, const MatrixView& y_fp8,
                              Stream stream) = nullptr;
  CoreError (*swiglu_backward)(const MatrixView& grad_out, const MatrixView& y,
                               const VectorView& bias, const VectorView& weights,
                               const SwigluOptions& options, const MatrixView& grad_y,
                               float* grad_weights, float* grad_bias, Stream stream) = nullptr;
  CoreError (*cross_entropy_forward)(const MatrixView& logits, const IndexView& target,
                                     const CrossEntropyOptions& options,
                                     const CrossEntropyOutputs& out, Communicator* comm,
                                     Stream stream) = nullptr;
  CoreError (*cross_entropy_forward_with_grad)(const MatrixView& logits, const IndexView& target,
                                               const CrossEntropyOptions& options,
                                               const CrossEntropyOutputs& out,
                                               const MatrixView& grad_logits, Communicator* comm,
                                               Stream stream) = nullptr;
  CoreError (*cross_entropy_backward)(const MatrixView& logits, const IndexView& target,
                                      const float* lse, const float* grad_loss,
                                      const float* valid_count, const CrossEntropyOptions& options,
                                      const MatrixView& grad_logits, Stream stream) = nullptr;
  CoreError (*cross_entropy_scale_grad)(const MatrixView& grad_logits, const float* grad_loss,
                                        Stream stream) = nullptr;
  CoreError (*linear_cross_entropy_forward)(const MatrixView& hidden, const MatrixView& weight,
                                            const IndexView& target, const CrossEntropyOptions& ce,
                                            const LinearCrossEntropyOptions& options,
                                            const LinearCrossEntropyOutputs& out,
                                            Communicator* comm, Stream stream) = nullptr;
  CoreError (*linear_cross_entropy_backward)(const MatrixView& hidden, const MatrixView& weight,
                                             const IndexView& target, const float* lse,
                                             const float* grad_loss, const float* valid_count,
                                             const CrossEntropyOptions& ce,
                                             const LinearCrossEntropyOptions& options,
                                             const LinearCrossEntropyOutputs& saved,
                                             const LinearCrossEntropyGrads& grads,
                                             Stream stream) = nullptr;
  CoreError (*set_scratch_allocator)(const ScratchAllocator* allocator) = nullptr;
  CoreError (*resolve_linear_ce_backward)(LinearCeBackward mode, Reduction reduction, DType dtype,
                                          bool row_weighted, LinearCeBackward* resolved) = nullptr;
  CoreError (*swiglu_gate_up_forward)(const MatrixView& gate, const MatrixView& up,
                                      const VectorView& bias, const VectorView& weights,
                                      const SwigluOptions& options, const MatrixView& out,
                                      const MatrixView& input_fp8, Stream stream) = nullptr;
  CoreError (*swiglu_gate_up_backward)(const MatrixView& grad_out, const MatrixView& gate,
                                       const MatrixView& up, const VectorView& bias,
                                       const VectorView& weights, const SwigluOptions& options,
                                       const MatrixView& grad_gate, const MatrixView& grad_up,
                                       float* grad_weights, float* grad_bias,
                                       Stream stream) = nullptr;
};

}  // namespace fusedloss::python

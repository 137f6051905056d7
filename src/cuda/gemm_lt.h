// Row-major GEMMs through cuBLASLt, for the linear cross-entropy (src/cuda/gemm_lt.cu).
#pragma once
#include <cstddef>
#include "fusedloss/types.h"

namespace fusedloss::cuda {

// C[m, n] = op(A)[m, k] @ op(B)[k, n] (+ C when accumulate), row-major views on the current
// device; op transposes when ta / tb. `workspace`: workspace_bytes for cuBLASLt (0 allowed:
// then only algorithms that need none). A and B: one dtype (fp32/fp16/bf16); C: that dtype or
// fp32. fp32 accumulation (TF32 tensor cores for fp32 inputs when tf32). Every cuBLASLt status
// is checked. The descriptors and the algorithm are built once per shape and cached: the
// heuristic's first answer (candidates = 1), or the fastest of its first `candidates` answers,
// timed once on this stream (a host sync; under graph capture the first answer, uncached).
// Timing (candidates > 1, a benchmarking knob) allocates a scratch copy of an accumulated C.
// `bias` (not with accumulate): null, or C.cols elements of C's dtype at a 256-byte boundary,
// added to every row of C in the fp32 epilogue before the one rounding (cuBLASLt's bias
// epilogue; beta = 1 over a 16-bit C rounds twice: core/lce_bias.h).
void gemm(const MatrixView& A, bool ta, const MatrixView& B, bool tb, const MatrixView& C,
          bool accumulate, bool tf32, void* workspace, size_t workspace_bytes, Stream stream,
          int candidates = 1, const void* bias = nullptr);

// Creates the current device's cuBLASLt handle if it does not exist yet (gemm does on first
// use): a caller that must not fail once its collectives have begun calls this before them.
void gemm_prepare();

}  // namespace fusedloss::cuda

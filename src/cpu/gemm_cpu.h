// The CPU backend's GEMMs: C (+)= op(A) @ op(B) over row-major views of fp32, fp16 or bf16.
// Each output element is rounded once into C's dtype. Two implementations, one per build:
// gemm_blas.cpp (a BLAS was found: cblas_sgemm, 16-bit operands staged as fp32 tiles, fp32
// accumulation; bf16 operands through oneDNN where the build found it: gemm_dnnl.cpp) and
// gemm_loop.cpp (no BLAS: plain loops, double accumulation).
#pragma once
#include <cstdint>
#include "fusedloss/types.h"

namespace fusedloss::cpu {

// fp32 scratch for the tiles of 16-bit operands that BLAS reads as fp32 (fp32 operands are read
// in place; the loops need none). Larger scratch gives larger tiles: fewer conversions.
struct GemmStage {
  float* data = nullptr;
  int64_t floats = 0;
};

// C[m, n] (+)= op(A)[m, k] @ op(B)[k, n]; op(X) = X^T when its flag is set. Allocates nothing
// (at TP > 1 it runs between collectives, where a rank must not fail alone). Deterministic:
// the same bits for the same shapes, stage size and thread count.
void gemm(const MatrixView& A, bool ta, const MatrixView& B, bool tb, const MatrixView& C,
          bool accumulate, GemmStage stage);

// gemm's bf16 operands (C fp32 or bf16) through oneDNN's matmul, where the CPU has bf16 dot
// products (AVX512-BF16, AMX); false, with nothing written, where it does not apply or could not
// be set up (the caller's BLAS path runs then). Builds with oneDNN only (FUSEDLOSS_DNNL).
bool gemm_bf16(const MatrixView& A, bool ta, const MatrixView& B, bool tb, const MatrixView& C,
               bool accumulate);

}  // namespace fusedloss::cpu

// Linear cross-entropy: the one home of the chunk pipeline's tuning knobs. They are read from
// the environment at every call (getenv, no caching) so that one benchmark process can measure
// every variant (bench/lce_bench.py sets them per provider); unset, each takes the default
// that ships. Also the per-phase device time the CUDA loop adds up when FUSEDLOSS_LCE_TIMING=1.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fusedloss {
struct LinearCePhaseTimes;  // include/fusedloss/linear_cross_entropy.h
}

namespace fusedloss::core {

struct LceTuning {
  // FUSEDLOSS_LCE_BUFFERS = 2 | 1. 2: the workspace holds two chunk buffers; the cross-entropy
  // of one chunk runs (side stream) under the GEMMs of the other, dweight takes both chunks in
  // one GEMM (K = 2 chunks). 1: one buffer of the whole workspace (chunks twice as long, the same
  // K per dweight GEMM, longer dhidden GEMMs), nothing to overlap within a group. 1 is the
  // default: on the H200 the longer GEMMs gained more than the overlap (bench/NOTES.md).
  int buffers = 1;
  // FUSEDLOSS_LCE_DHIDDEN = chunk | group. chunk: one dhidden GEMM per chunk ([chunk, V] @
  // [V, H]: chunk x H output tiles only, e.g. 64 tiles of 128 x 256 at 512 x 4096, under one wave
  // of an H200's 132 SMs). group: one GEMM over the buffers' chunks together (as dweight).
  bool dhidden_group = false;
  // FUSEDLOSS_LCE_DH_PIECES = p in [1, 16]: each chunk's dhidden GEMM as GEMMs over row pieces
  // of ceil(rows / p) rows, rounded up to a multiple of 64 when that is >= 64 (so fewer than p
  // pieces may run). Its output has only chunk x H tiles, so how evenly they fill the SMs'
  // waves depends on the chunk's row count (832 rows, the chunk at V = 151936 before chunks
  // were whole 256-row tiles: 7 x 32 tiles of 128 x 128 on 132 SMs, 85% of two waves); pieces
  // change that count. cuBLASLt may choose another algorithm for the shorter GEMMs, so the bits
  // may differ with p. Not used with
  // FUSEDLOSS_LCE_DHIDDEN=group. Measured, not shipped: bench/NOTES.md.
  int dhidden_pieces = 1;
  // FUSEDLOSS_LCE_SIDE_STREAM = 1 | 0: the cross-entropy steps on the side stream (overlap) or
  // on the caller's stream between the GEMMs (serial).
  bool side_stream = true;
  // FUSEDLOSS_LCE_GEMM_ALGOS = k >= 1: 1 takes cuBLASLt's heuristic first answer (for a short
  // inner dimension under a large output, the dweight GEMMs, its answer with the most waves:
  // src/cuda/gemm_lt.cu); k > 1 asks for k and times them once per shape (a host sync on first
  // use, skipped under graph capture; a GEMM that accumulates into C is timed on a zeroed
  // scratch of C's size, e.g. the fp32 [V_local, H] dweight, allocated for that first call only:
  // inside the chunk loop, so a benchmarking knob, not for TP > 1, where nothing may fail on one
  // rank once the per-chunk collectives have begun).
  int gemm_algos = 1;
  // FUSEDLOSS_LCE_CE_ROWS = r >= 0: the in-forward cross-entropy (stats, then gradient) in
  // slices of r rows (0: the whole chunk), so the gradient pass re-reads the rows from L2
  // (r rows of 2 V bytes must fit it: 128 rows at V = 128256 bf16 are 32 MiB of an H200's
  // 50 MiB): one HBM read of the logits instead of two. TP = 1 only.
  int64_t ce_rows = 0;
  // FUSEDLOSS_LCE_GEMM_WORKSPACE_MIB = m in [0, 256]: the most of workspace_bytes the GEMM
  // library may take (lce_gemm_workspace_bytes in core/linear_ce_plan.h); the chunk buffers get
  // the rest. 4: on the H200 cuBLASLt's GEMMs here ran no slower with 4 MiB (or 1) than with
  // 32, and the 28 MiB left to the buffer keep 1024-token chunks at V = 128256 within 256 MiB,
  // where 768-token chunks cost 4-15% (bench/NOTES.md).
  size_t gemm_workspace_cap = size_t(4) << 20;
  // FUSEDLOSS_DISTILL_TEACHER_ROWS = r >= 0: the linear distillation computes the teacher's
  // logits of each student chunk r rows at a time (0: the whole chunk in one GEMM), in a buffer
  // of r rows; the student's chunks take the rest of the workspace. Longer student chunks
  // (dweight's K: each dweight GEMM reads and writes the whole [V, H] gradient once; dhidden's
  // output tiles) for more teacher GEMMs, each of which reads the teacher's whole weight.
  int64_t teacher_rows = 0;
  // FUSEDLOSS_LCE_TIMING = 0 | 1: CUDA events around every phase of every chunk, summed into
  // linear_cross_entropy_phase_times (synchronises the host at the end of each loop; creates its
  // events inside the loop: a diagnostic, as gemm_algos above).
  bool timing = false;
};

// The knobs as the environment sets them now; throws Error naming the variable, its value and
// what it accepts.
LceTuning lce_tuning();

// Adds one loop's phase times to the process-wide sums.
void lce_add_phase_times(const LinearCePhaseTimes& t);

}  // namespace fusedloss::core

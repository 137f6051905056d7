// The linear heads' chunk loop, shared by the ops that run one (the linear cross-entropy, the
// log-prob head): the chunking a call's options give, and the backend loop they run in.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include "core/lce_tuning.h"
#include "api/check.h"
#include "core/linear_ce_plan.h"
#include "fusedloss/linear_cross_entropy.h"

namespace fusedloss::lce {

// The bytes of o.workspace_bytes left to the chunk buffers beside the GEMM workspace.
size_t buffer_share(const LinearCrossEntropyOptions& o, const core::LceTuning& tuning);

// What a head keeps beside the loop's chunk buffers within the same workspace_bytes: bytes per
// token of the chunk (the distillation's teacher logits) and bytes in all (its GEMM workspace).
struct Beside {
  size_t row_bytes = 0;
  size_t bytes = 0;
};

// Tokens per chunk for the buffers' share of the workspace, split into tuning.buffers chunk
// buffers of vocab_local columns and what goes beside them (o.chunk_rows when it is set).
int64_t chunk_rows_for(const LinearCrossEntropyOptions& o, int64_t rows, int64_t vocab_local,
                       DType dtype, const core::LceTuning& tuning, const Beside& beside = {});

// The chunking options of a head that runs the loop (its options' workspace_bytes, chunk_rows
// and allow_tf32), as the linear cross-entropy's loop reads them.
template <class HeadOptions>
LinearCrossEntropyOptions loop_options(const HeadOptions& o) {
  LinearCrossEntropyOptions lo;
  lo.workspace_bytes = o.workspace_bytes;
  lo.chunk_rows = o.chunk_rows;
  lo.allow_tf32 = o.allow_tf32;
  return lo;
}

// The plan of a chunk loop over hidden [N, H] and weight [V_local, H] (only o's chunking and
// allow_tf32 are read).
core::LcePlan make_plan(const MatrixView& hidden, const MatrixView& weight,
                        const LinearCrossEntropyOptions& o,
                        const core::LceTuning& tuning = core::lce_tuning(),
                        const Beside& beside = {});

// Rows [row0, row0 + rows) of t.
IndexView target_rows(const IndexView& t, int64_t row0, int64_t rows);

// The chunk loop in `memory` (core::lce_loop_bytes), or, when null, in scratch of its own.
void run_loop(Device dev, const char* fn, const core::LcePlan& plan, const MatrixView& hidden,
              const MatrixView& weight, const core::LceSteps& steps, const core::LceGrads& grads,
              Stream stream, void* memory = nullptr);

// The gradient buffers of a linear head's backward over hidden [N, H] and weight [V_local, H]:
// grads.dhidden [N, H] and grads.dweight [V_local, H], each fp32 or the inputs' dtype, on their
// device, apart from hidden, weight, each other and what the backward reads (`reads`).
void check_grads(const LinearCrossEntropyGrads& grads, const MatrixView& hidden,
                 const MatrixView& weight, std::initializer_list<detail::Span> reads);

// A caller's scratch block: at least `needed` bytes, aligned for the backend; throws Error
// naming `name` and the size function `size_fn` otherwise.
char* callers_scratch(void* scratch, size_t bytes, size_t needed, Device dev, const char* name,
                      const char* size_fn);

}  // namespace fusedloss::lce

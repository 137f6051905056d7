// The linear heads' chunk loop (api/lce_loop.h).
#include "api/lce_loop.h"

#include <algorithm>
#include <optional>
#include "api/check.h"
#include "api/vocab_parallel.h"
#include "cpu/linear_ce_cpu.h"
#ifdef FUSEDLOSS_WITH_CUDA
#include "cuda/linear_ce_cuda.h"
#endif

namespace fusedloss::lce {

using detail::require;

namespace {

// A chunk's tokens in whole GEMM tiles: the largest of 256 and 128 rows whose rounding gives up
// at most a quarter of the chunk, else 64. cuBLASLt's Hopper kernels for the logits and dhidden
// GEMMs take 256 rows a tile pair: at 16384 x 4096 x 151936 (bf16, H200) chunks of 768 tokens
// ran those GEMMs 11% and 19% faster than the 832 a 64-row rounding of 256 MiB gives, and the
// whole in_forward loop 6% faster despite two more chunks.
int64_t whole_tiles(int64_t chunk) {
  if (chunk < 64) return chunk;
  for (int64_t tile : {int64_t(256), int64_t(128)})
    if (chunk >= tile && chunk % tile <= chunk / 4) return chunk - chunk % tile;
  return chunk - chunk % 64;
}

}  // namespace

// The bytes of workspace_bytes left to the chunk buffers beside the GEMM workspace.
size_t buffer_share(const LinearCrossEntropyOptions& o, const core::LceTuning& tuning) {
  return o.workspace_bytes - core::lce_gemm_workspace_bytes(o.workspace_bytes, tuning.gemm_workspace_cap);
}

// Tokens per chunk for the buffers' share of the workspace, split into `buffers` chunk buffers
// and what a token takes beside them (`beside`).
int64_t chunk_rows_for(const LinearCrossEntropyOptions& o, int64_t rows, int64_t vocab_local,
                       DType dtype, const core::LceTuning& tuning, const Beside& beside) {
  const int64_t buffers = tuning.buffers;
  const int64_t es = detail::element_size(dtype);
  require(vocab_local <= (int64_t(1) << 40), "weight.rows (vocab_local): got ", vocab_local,
          ", expected at most 2^40 (a row of the chunk buffer must fit in memory)");
  const int64_t stride = core::round_up(std::max<int64_t>(vocab_local, 1), 16 / es);
  int64_t chunk = o.chunk_rows;
  if (chunk <= 0) {
    const size_t share = buffer_share(o, tuning);
    const size_t left = share > beside.bytes ? share - beside.bytes : 0;
    const int64_t fits = int64_t(left / size_t(buffers * stride * es + beside.row_bytes));
    chunk = fits >= rows ? rows : whole_tiles(fits);  // one chunk of every token needs no rounding
  }
  return std::max<int64_t>(1, std::min(chunk, std::max<int64_t>(rows, 1)));
}

core::LcePlan make_plan(const MatrixView& hidden, const MatrixView& weight,
                        const LinearCrossEntropyOptions& o,
                        const core::LceTuning& tuning, const Beside& beside) {
  core::LcePlan plan;
  plan.rows = hidden.rows;
  plan.hidden = hidden.cols;
  plan.vocab_local = weight.rows;
  plan.dtype = hidden.dtype;
  plan.tf32 = o.allow_tf32;
  plan.gemm_workspace = core::lce_gemm_workspace_bytes(o.workspace_bytes, tuning.gemm_workspace_cap);
  plan.tuning = tuning;
  plan.chunk = chunk_rows_for(o, hidden.rows, weight.rows, hidden.dtype, plan.tuning, beside);
  plan.stride = core::round_up(weight.rows, int64_t(16) / detail::element_size(hidden.dtype));
  return plan;
}

IndexView target_rows(const IndexView& t, int64_t row0, int64_t rows) {
  IndexView v = t;
  v.data = static_cast<const char*>(t.data) + row0 * (t.type == IndexType::I32 ? 4 : 8);
  v.size = rows;
  return v;
}

// The chunk loop in `memory` (core::lce_loop_bytes), or, when null, in scratch of its own.
void run_loop(Device dev, const char* fn, const core::LcePlan& plan, const MatrixView& hidden,
              const MatrixView& weight, const core::LceSteps& steps, const core::LceGrads& grads,
              Stream stream, void* memory) {
  std::optional<vocab_parallel::Scratch> own;
  if (!memory) memory = own.emplace(dev, core::lce_loop_bytes(plan, dev), stream, fn).as<char>();
  FL_DISPATCH(dev, fn, cpu::lce_run(plan, hidden, weight, steps, grads, memory),
              cuda::lce_run(plan, hidden, weight, steps, grads, memory, stream));
}

void check_grads(const LinearCrossEntropyGrads& grads, const MatrixView& hidden,
                 const MatrixView& weight, std::initializer_list<detail::Span> reads) {
  const int64_t H = hidden.cols;
  for (auto [g, name] : {std::pair{&grads.dhidden, "grads.dhidden"}, {&grads.dweight, "grads.dweight"}}) {
    const int64_t rows = g == &grads.dhidden ? hidden.rows : weight.rows;
    require(g->data != nullptr || rows == 0, name, ": got none, expected a [", rows, ", ", H,
            "] buffer");
    detail::check_matrix(*g, name);
    require(g->rows == rows && g->cols == H, name, ": got shape [", g->rows, ", ", g->cols,
            "], expected [", rows, ", ", H, "]");
    require(g->dtype == DType::F32 || g->dtype == hidden.dtype, name, ".dtype: got ",
            to_string(g->dtype), ", expected fp32 or ", to_string(hidden.dtype));
    require(g->device == hidden.device, name, ".device: got ", to_string(g->device), ", expected ",
            to_string(hidden.device), " (the inputs' device)");
    require(!detail::overlaps(*g, hidden) && !detail::overlaps(*g, weight), name,
            ": overlaps hidden or weight, expected a separate buffer");
    detail::require_read_apart(detail::span_of(*g, name), reads);
  }
  detail::require_disjoint({detail::span_of(grads.dhidden, "grads.dhidden"),
                            detail::span_of(grads.dweight, "grads.dweight")});
}

// A caller's scratch block: at least `needed` bytes, aligned for the backend (the GEMM
// workspace and the kernels' vector loads on CUDA; the host loop's floats and RowStats).
char* callers_scratch(void* scratch, size_t bytes, size_t needed, Device dev, const char* name,
                      const char* size_fn) {
  require(bytes >= needed, name, "_bytes: got ", bytes, ", expected at least ", needed, " (",
          size_fn, " for these arguments)");
  const uintptr_t align = dev == Device::CUDA ? core::kLceAlign : sizeof(RowStats);
  require(reinterpret_cast<uintptr_t>(scratch) % align == 0, name,
          ": got an address that is not a multiple of ", align,
          " bytes, expected an aligned block (as cudaMalloc or torch.empty returns)");
  return static_cast<char*>(scratch);
}


}  // namespace fusedloss::lce

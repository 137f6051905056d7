// Public cross-entropy entry points: validate, resolve, dispatch to a backend, run the hook.
#include "fusedloss/cross_entropy.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>
#include "api/check.h"
#include "api/vocab_parallel.h"
#include "cpu/cross_entropy_cpu.h"
#ifdef FUSEDLOSS_WITH_CUDA
#include "cuda/cross_entropy_cuda.h"
#endif

namespace fusedloss {

namespace {

using detail::check_targets_on_host;
using detail::require;

// The forward's checks, before anything is written: the logits view first (so a bad view is
// named as such), then the options against its shape, then the outputs and the targets.
core::CeParams forward_params(const MatrixView& logits, const IndexView& target,
                              const CrossEntropyOptions& options, const CrossEntropyOutputs& out) {
  detail::check_matrix(logits, "logits");
  core::CeParams p = core::resolve_params(options, logits.rows, logits.cols);
  detail::check_index(target, "target", logits.rows, logits.device);
  const int64_t nloss = p.reduction == Reduction::None ? logits.rows : 1;
  require(out.loss != nullptr || nloss == 0, "out.loss: got null, expected a float buffer of ",
          nloss, " elements");
  require(out.lse != nullptr || logits.rows == 0,
          "out.lse: got null, expected a float buffer of ", logits.rows, " elements");
  detail::require_outputs_apart({{out.loss, nloss * 4, "out.loss"}, {out.lse, logits.rows * 4, "out.lse"},
                                 {out.valid_count, 4, "out.valid_count"}},
                                {detail::span_of(logits, "logits"), detail::span_of(target, "target")});
  check_targets_on_host(target, p);
  return p;
}

// `rows` RowStats at p, for the overlap checks.
constexpr int64_t kStatsBytes = sizeof(RowStats);
detail::Span stats_span(const RowStats* p, int64_t rows, const char* name) {
  return {p, rows * kStatsBytes, name};
}

// grad_logits beside the logits: the same shape, dtype and device, and either the logits
// themselves (in place: same data and row stride) or disjoint from them.
void check_grad_logits(const MatrixView& logits, const MatrixView& grad_logits) {
  detail::check_matrix(grad_logits, "grad_logits");
  require(grad_logits.rows == logits.rows && grad_logits.cols == logits.cols,
          "grad_logits: got shape [", grad_logits.rows, ", ", grad_logits.cols, "], expected [",
          logits.rows, ", ", logits.cols, "] (the logits' shape)");
  require(grad_logits.dtype == logits.dtype, "grad_logits.dtype: got ",
          to_string(grad_logits.dtype), ", expected ", to_string(logits.dtype));
  require(grad_logits.device == logits.device, "grad_logits.device: got ",
          to_string(grad_logits.device), ", expected ", to_string(logits.device));
  const bool in_place =
      grad_logits.data == logits.data && grad_logits.row_stride == logits.row_stride;
  require(in_place || !detail::overlaps(grad_logits, logits),
          "grad_logits: overlaps the logits without being the same view; expected the logits "
          "themselves (in place) or a disjoint buffer");
}

// The buffers the gradient kernels read (or the forward writes) beside the logits: none may
// share grad_logits' memory.
// The names are the caller's: "lse", "grad_loss", "valid_count" in the backward, "out.lse",
// "out.loss", "out.valid_count" in the forward that writes the gradient.
struct GradApartNames {
  const char* lse;
  const char* grad_loss;
  const char* valid_count;
};
void check_grad_apart(const MatrixView& grad_logits, const IndexView& target, const float* lse,
                      const float* grad_loss, int64_t grad_loss_floats, const float* valid_count,
                      const GradApartNames& names) {
  detail::require_read_apart(detail::span_of(grad_logits, "grad_logits"),
                             {detail::span_of(target, "target"), {lse, grad_logits.rows * 4, names.lse},
                              {grad_loss, grad_loss_floats * 4, names.grad_loss},
                              {valid_count, 4, names.valid_count}});
}

}  // namespace

void validate_cross_entropy_options(const CrossEntropyOptions& options, int64_t rows,
                                    int64_t vocab_local) {
  core::resolve_params(options, rows, vocab_local);
}

void cross_entropy_local_stats(const MatrixView& logits, const IndexView& target,
                               const CrossEntropyOptions& options, RowStats* stats,
                               [[maybe_unused]] Stream stream) {
  detail::check_matrix(logits, "logits");
  core::CeParams p = core::resolve_params(options, logits.rows, logits.cols);
  detail::check_index(target, "target", logits.rows, logits.device);
  require(stats != nullptr || logits.rows == 0, "stats: got null, expected ", logits.rows,
          " RowStats");
  detail::require_outputs_apart({stats_span(stats, logits.rows, "stats")},
                                {detail::span_of(logits, "logits"), detail::span_of(target, "target")});
  check_targets_on_host(target, p);
  FL_DISPATCH(logits.device, "cross_entropy_local_stats",
              cpu::ce_local_stats(logits, target, p, stats),
              cuda::ce_local_stats(logits, target, p, stats, stream));
}

void cross_entropy_prepare_sum(const RowStats* local, const float* global_max,
                               const IndexView& target, const CrossEntropyOptions& options,
                               int64_t vocab_local, int rank, RowStats* summable, Device device,
                               [[maybe_unused]] Stream stream) {
  require(device == Device::CPU || device == Device::CUDA, "device: got ", int(device),
          ", expected cpu or cuda");
  require(target.size >= 0, "target.size: got ", target.size, ", expected >= 0 (one per row)");
  core::CeParams p = core::resolve_params(options, target.size, vocab_local);
  detail::check_index(target, "target", target.size, device);
  require(rank >= 0, "rank: got ", rank, ", expected >= 0");
  require((local && global_max && summable) || target.size == 0,
          "local/global_max/summable: got a null pointer, expected buffers of ", target.size,
          " rows");
  detail::require_outputs_apart({stats_span(summable, target.size, "summable")},
                                {stats_span(local, target.size, "local"),
                                 {global_max, target.size * 4, "global_max"},
                                 detail::span_of(target, "target")});
  FL_DISPATCH(device, "cross_entropy_prepare_sum",
              cpu::ce_prepare_sum(local, global_max, target, p, rank, summable),
              cuda::ce_prepare_sum(local, global_max, target, p, rank, summable, stream));
}

void cross_entropy_merge(const RowStats* combined, int parts, const RowStats* local,
                         const IndexView& target, const CrossEntropyOptions& options,
                         int64_t vocab_local, const CrossEntropyOutputs& out,
                         [[maybe_unused]] Stream stream, float* row_scratch) {
  require(target.size >= 0, "target.size: got ", target.size, ", expected >= 0 (one per row)");
  core::CeParams p = core::resolve_params(options, target.size, vocab_local);
  detail::check_index(target, "target", target.size, target.device);
  require(parts >= 1, "parts: got ", parts, ", expected >= 1");
  require(combined != nullptr || target.size == 0, "combined: got null, expected ", parts,
          " x ", target.size, " RowStats");
  require(!p.partition_scope || local != nullptr || target.size == 0,
          "local: got null, expected this rank's RowStats (SmoothingScope::Partition)");
  require(out.loss != nullptr || (p.reduction == Reduction::None && target.size == 0),
          "out.loss: got null, expected a float buffer");
  require(out.lse != nullptr || target.size == 0, "out.lse: got null, expected ", target.size,
          " floats");
  const int64_t nloss = p.reduction == Reduction::None ? target.size : 1;
  const int64_t combined_rows =  // saturated: a span past the address space overlaps anything
      target.size > INT64_MAX / kStatsBytes / parts ? INT64_MAX / kStatsBytes : parts * target.size;
  if (p.reduction == Reduction::None) row_scratch = nullptr;  // the losses go to out.loss
  detail::require_outputs_apart(
      {{out.loss, nloss * 4, "out.loss"}, {out.lse, target.size * 4, "out.lse"},
       {out.valid_count, 4, "out.valid_count"}, {row_scratch, target.size * 4, "row_scratch"}},
      {stats_span(combined, combined_rows, "combined"),
       stats_span(p.partition_scope ? local : nullptr, target.size, "local"),
       detail::span_of(target, "target")});
  check_targets_on_host(target, p);
  FL_DISPATCH(target.device, "cross_entropy_merge",
              cpu::ce_merge(combined, parts, local, target, p, out, row_scratch),
              cuda::ce_merge(combined, parts, local, target, p, out, stream, row_scratch));
}

namespace {

// TP=1: the stats are already global, so the CUDA backend merges inside the stats pass.
void forward_tp1(const MatrixView& logits, const IndexView& target, const core::CeParams& p,
                 const CrossEntropyOutputs& out, [[maybe_unused]] Stream stream) {
  std::vector<RowStats> stats(logits.device == Device::CPU ? logits.rows : 0);
  FL_DISPATCH(logits.device, "cross_entropy_forward",
              cpu::ce_local_stats(logits, target, p, stats.data());
              cpu::ce_merge(stats.data(), 1, stats.data(), target, p, out),
              cuda::ce_forward_tp1(logits, target, p, out, stream));
}

// The forward's checks and the vocab-parallel hook around run_tp1(p), the TP=1 computation.
// `more_checks` (a caller's own argument checks) run with the forward's, so that
// vocab-parallel, a rank that fails them makes every rank throw at the same call.
template <class MoreChecks, class RunTp1>
void forward_checked(const MatrixView& logits, const IndexView& target,
                     const CrossEntropyOptions& options, const CrossEntropyOutputs& out,
                     Communicator* comm, Stream stream, const char* fn,
                     MoreChecks&& more_checks, RunTp1&& run_tp1) {
  if (comm) vocab_parallel::check_communicator(*comm);
  if (!comm || comm->size() == 1) {
    core::CeParams p = forward_params(logits, target, options, out);
    more_checks();
    require(p.vocab_start == 0 && p.vocab_global == logits.cols, "options.vocab_global/start: got ",
            p.vocab_global, "/", p.vocab_start, " without a communicator of size > 1, expected ",
            logits.cols, "/0 (the whole vocabulary on one rank)");
    run_tp1(p);
    return;
  }
  // Vocab-parallel: this rank's argument errors travel to every rank instead of being thrown
  // here, so no rank waits in a collective that a peer will not join.
  vocab_parallel::ShardClaim mine;
  mine.rows = logits.rows;
  mine.vocab_local = logits.cols;
  mine.collective = options.collective;
  mine.options = vocab_parallel::fingerprint(options);
  mine.options_text = vocab_parallel::describe(options);
  mine.target = target;
  mine.fn = fn;
  core::CeParams p;
  std::optional<vocab_parallel::Scratch> scratch;  // allocated before the agreement
  vocab_parallel::claim_errors(mine, [&] {
    p = forward_params(logits, target, options, out);
    vocab_parallel::check_shard_position(p, *comm, logits.device);
    more_checks();
    scratch.emplace(logits.device,
                    vocab_parallel::forward_scratch_bytes(logits.rows, comm->size(), options.collective),
                    stream, fn);
  });
  vocab_parallel::agree_or_throw(*comm, mine, options.check_shard_agreement, stream);
  vocab_parallel::forward(logits, target, p, options.collective, out, *comm, scratch->as<char>(),
                          stream, fn);
}

}  // namespace

void cross_entropy_forward(const MatrixView& logits, const IndexView& target,
                           const CrossEntropyOptions& options, const CrossEntropyOutputs& out,
                           Communicator* comm, Stream stream) {
  forward_checked(logits, target, options, out, comm, stream, "cross_entropy_forward", [] {},
                  [&](const core::CeParams& p) { forward_tp1(logits, target, p, out, stream); });
}

void cross_entropy_backward(const MatrixView& logits, const IndexView& target, const float* lse,
                            const float* grad_loss, const float* valid_count,
                            const CrossEntropyOptions& options, const MatrixView& grad_logits,
                            [[maybe_unused]] Stream stream) {
  detail::check_matrix(logits, "logits");
  core::CeParams p = core::resolve_params(options, logits.rows, logits.cols);
  check_grad_logits(logits, grad_logits);
  detail::check_index(target, "target", logits.rows, logits.device);
  require(lse != nullptr || logits.rows == 0, "lse: got null, expected the forward's lse");
  check_grad_apart(grad_logits, target, lse, grad_loss,
                   p.reduction == Reduction::None ? logits.rows : 1, valid_count,
                   {"lse", "grad_loss", "valid_count"});
  require(valid_count != nullptr || p.reduction != Reduction::Mean || logits.rows == 0,
          "valid_count: got null, expected the forward's valid_count for Reduction::Mean");
  check_targets_on_host(target, p);
  FL_DISPATCH(logits.device, "cross_entropy_backward",
              cpu::ce_backward(logits, target, lse, grad_loss, valid_count, p, grad_logits),
              cuda::ce_backward(logits, target, lse, grad_loss, valid_count, p, grad_logits,
                                stream));
}

void cross_entropy_forward_with_grad(const MatrixView& logits, const IndexView& target,
                                     const CrossEntropyOptions& options,
                                     const CrossEntropyOutputs& out, const MatrixView& grad_logits,
                                     Communicator* comm, Stream stream) {
  auto more_checks = [&] {
    require(options.reduction != Reduction::None,
            "options.reduction: got None, expected Sum or Mean (a per-row loss has per-row "
            "upstream gradients: use cross_entropy_forward and cross_entropy_backward)");
    check_grad_logits(logits, grad_logits);
    require(options.reduction != Reduction::Mean || out.valid_count != nullptr || logits.rows == 0,
            "out.valid_count: got null, expected a float (Reduction::Mean divides by it)");
    check_grad_apart(grad_logits, target, out.lse, out.loss, 1, out.valid_count,
                     {"out.lse", "out.loss", "out.valid_count"});
  };
  // The forward, then the backward for a unit upstream gradient (grad_loss null); at TP=1 on
  // CUDA one kernel does both where that pays. Vocab-parallel the merged lse comes first.
  auto unit_backward = [&](const core::CeParams& p) {
    FL_DISPATCH(logits.device, "cross_entropy_forward_with_grad",
                cpu::ce_backward(logits, target, out.lse, nullptr, out.valid_count, p, grad_logits),
                cuda::ce_backward(logits, target, out.lse, nullptr, out.valid_count, p,
                                  grad_logits, stream));
  };
  forward_checked(logits, target, options, out, comm, stream, "cross_entropy_forward_with_grad",
                  more_checks,
                  [&](const core::CeParams& p) {
                    if (logits.device == Device::CUDA) {
                      FL_CUDA_BRANCH("cross_entropy_forward_with_grad",
                                     cuda::ce_forward_with_grad_tp1(logits, target, p, out,
                                                                    grad_logits, stream));
                    } else {
                      forward_tp1(logits, target, p, out, stream);
                      unit_backward(p);
                    }
                  });
  if (comm && comm->size() > 1)
    unit_backward(core::resolve_params(options, logits.rows, logits.cols));
}

void cross_entropy_scale_grad(const MatrixView& grad_logits, const float* grad_loss,
                              [[maybe_unused]] Stream stream) {
  detail::check_matrix(grad_logits, "grad_logits");
  require(grad_loss != nullptr || grad_logits.rows == 0,
          "grad_loss: got null, expected the loss's gradient (1 float)");
  detail::require_read_apart(detail::span_of(grad_logits, "grad_logits"), {{grad_loss, 4, "grad_loss"}});
  if (grad_logits.rows == 0 || grad_logits.cols == 0) return;
  FL_DISPATCH(grad_logits.device, "cross_entropy_scale_grad",
              cpu::ce_scale_grad(grad_logits, grad_loss),
              cuda::ce_scale_grad(grad_logits, grad_loss, stream));
}

void check_device_errors(Stream stream) {
#ifdef FUSEDLOSS_WITH_CUDA
  cuda::check_device_errors(stream);
#else
  (void)stream;
#endif
}

}  // namespace fusedloss

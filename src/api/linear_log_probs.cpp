// Public log-prob head entry points: validate, plan the chunks (api/lce_loop.h), hand the
// backend's chunk loop the head's per-chunk steps (core/log_probs_math.h).
#include "fusedloss/linear_log_probs.h"

#include <cmath>
#include <vector>
#include "api/check.h"
#include "api/lce_loop.h"
#include "api/vocab_parallel.h"
#include "cpu/log_probs_cpu.h"
#ifdef FUSEDLOSS_WITH_CUDA
#include "cuda/log_probs_cuda.h"
#endif

namespace fusedloss {

namespace {

using detail::require;

using lce::loop_options;

// The options with vocab_global resolved (0: V_local).
LinearLogProbsOptions resolved(LinearLogProbsOptions o, int64_t vocab_local) {
  if (o.vocab_global == 0) o.vocab_global = vocab_local;
  return o;
}

// Targets' range check on the host (CPU tokens), as the cross-entropy's.
void check_tokens_on_host(const IndexView& tokens, const LinearLogProbsOptions& o) {
  core::CeParams p;
  p.rows = tokens.size;
  p.vocab_global = o.vocab_global;
  p.ignore_index = o.ignore_index;
  detail::check_targets_on_host(tokens, p, "tokens");
}

LinearLogProbsOptions check_inputs(const MatrixView& hidden, const MatrixView& weight,
                                   const IndexView& tokens, const LinearLogProbsOptions& options) {
  detail::check_matrix(hidden, "hidden");
  detail::check_matrix(weight, "weight");
  require(weight.cols == hidden.cols, "weight: got shape [", weight.rows, ", ", weight.cols,
          "], expected [V_local, ", hidden.cols, "] (H = hidden.cols = ", hidden.cols, ")");
  require(weight.dtype == hidden.dtype, "weight.dtype: got ", to_string(weight.dtype),
          ", expected ", to_string(hidden.dtype), " (hidden's dtype)");
  require(weight.device == hidden.device, "weight.device: got ", to_string(weight.device),
          ", expected ", to_string(hidden.device), " (hidden's device)");
  detail::check_index(tokens, "tokens", hidden.rows, hidden.device, "hidden");
  validate_linear_log_probs_options(options, hidden.rows, weight.rows, hidden.cols);
  return resolved(options, weight.rows);
}

}  // namespace

void validate_linear_log_probs_options(const LinearLogProbsOptions& o, int64_t rows,
                                       int64_t vocab_local, int64_t hidden) {
  require(rows >= 0, "hidden.rows: got ", rows, ", expected N >= 0");
  require(hidden >= 1, "hidden.cols: got ", hidden, ", expected H >= 1");
  require(vocab_local >= 1, "weight.rows: got ", vocab_local, ", expected V_local >= 1");
  require(std::isfinite(o.temperature) && o.temperature > 0.0f, "options.temperature: got ",
          o.temperature, ", expected a finite value > 0");
  require(o.chunk_rows >= 0, "options.chunk_rows: got ", o.chunk_rows,
          ", expected 0 (from workspace_bytes) or >= 1");
  require(o.chunk_rows > 0 || o.workspace_bytes > 0,
          "options.workspace_bytes: got 0 with chunk_rows 0, expected > 0");
  const int64_t global = o.vocab_global == 0 ? vocab_local : o.vocab_global;
  require(o.vocab_start >= 0 && o.vocab_start + vocab_local <= global, "options.vocab_start: got ",
          o.vocab_start, " with V_local ", vocab_local, " and vocab_global ", global,
          ", expected a shard [vocab_start, vocab_start + V_local) within [0, vocab_global)");
  require(o.ignore_index < 0 || o.ignore_index >= global, "options.ignore_index: got ",
          o.ignore_index, ", expected a value outside [0, ", global, ") (a row's token is either",
          " a class or ignored)");
}

size_t linear_log_probs_local_stats_scratch_bytes(const MatrixView& hidden,
                                                  const MatrixView& weight,
                                                  const LinearLogProbsOptions& options) {
  validate_linear_log_probs_options(options, hidden.rows, weight.rows, hidden.cols);
  return core::lce_loop_bytes(lce::make_plan(hidden, weight, loop_options(options)),
                              hidden.device);
}

void linear_log_probs_local_stats(const MatrixView& hidden, const MatrixView& weight,
                                  const IndexView& tokens, const LinearLogProbsOptions& options,
                                  LogProbStats* stats, Stream stream, void* scratch,
                                  size_t scratch_bytes) {
  constexpr const char* kFn = "linear_log_probs_local_stats";
  const LinearLogProbsOptions o = check_inputs(hidden, weight, tokens, options);
  require(stats != nullptr || hidden.rows == 0, "stats: got null, expected ", hidden.rows,
          " LogProbStats");
  detail::require_outputs_apart(
      {{stats, hidden.rows * int64_t(sizeof(LogProbStats)), "stats"},
       {scratch, int64_t(scratch_bytes), "scratch"}},
      {detail::span_of(hidden, "hidden"), detail::span_of(weight, "weight"),
       detail::span_of(tokens, "tokens")});
  check_tokens_on_host(tokens, o);
  const core::LcePlan plan = lce::make_plan(hidden, weight, loop_options(o));
  char* memory = scratch ? lce::callers_scratch(scratch, scratch_bytes,
                                                core::lce_loop_bytes(plan, hidden.device),
                                                hidden.device, "scratch",
                                                "linear_log_probs_local_stats_scratch_bytes")
                         : nullptr;
  const float inv_t = 1.0f / o.temperature;
  core::LceSteps steps;
  steps.forward = [&](const MatrixView& logits, int64_t row0, [[maybe_unused]] Stream s) {
    const IndexView tc = lce::target_rows(tokens, row0, logits.rows);
    FL_DISPATCH(logits.device, kFn,
                cpu::lp_local_stats(logits, tc, inv_t, o.vocab_start, stats + row0),
                cuda::lp_local_stats(logits, tc, inv_t, o.vocab_start, stats + row0, s));
  };
  lce::run_loop(hidden.device, kFn, plan, hidden, weight, steps, {}, stream, memory);
}

void log_probs_merge(const LogProbStats* stats, int world, int64_t rows, const IndexView& tokens,
                     const LinearLogProbsOptions& options, const LinearLogProbsOutputs& out,
                     Device device, [[maybe_unused]] Stream stream) {
  require(world >= 1, "world: got ", world, ", expected >= 1 shards");
  require(stats != nullptr || rows == 0, "stats: got null, expected ", world, " x ", rows,
          " LogProbStats");
  require(out.lse != nullptr || rows == 0, "out.lse: got null, expected ", rows, " floats");
  detail::check_index(tokens, "tokens", rows, device, "stats");
  LinearLogProbsOptions o = options;
  require(o.vocab_global >= 1, "options.vocab_global: got ", o.vocab_global,
          ", expected the whole vocabulary (>= 1) to merge shards");
  check_tokens_on_host(tokens, o);
  const int64_t n = rows;
  detail::require_outputs_apart(
      {{out.log_probs, n * 4, "out.log_probs"}, {out.entropy, n * 4, "out.entropy"},
       {out.argmax, n * 8, "out.argmax"}, {out.lse, n * 4, "out.lse"}},
      {{stats, int64_t(world) * n * int64_t(sizeof(LogProbStats)), "stats"},
       detail::span_of(tokens, "tokens")});
  FL_DISPATCH(device, "log_probs_merge", cpu::lp_merge(stats, world, rows, tokens, o, out),
              cuda::lp_merge(stats, world, rows, tokens, o, out, stream));
}

void linear_log_probs_forward(const MatrixView& hidden, const MatrixView& weight,
                              const IndexView& tokens, const LinearLogProbsOptions& options,
                              const LinearLogProbsOutputs& out, Communicator* comm,
                              Stream stream) {
  constexpr const char* kFn = "linear_log_probs_forward";
  const LinearLogProbsOptions o = check_inputs(hidden, weight, tokens, options);
  const int world = comm ? comm->size() : 1;
  require(world == 1 || options.vocab_global > 0, "options.vocab_global: got 0 on a communicator",
          " of ", world, " ranks, expected the whole vocabulary");
  if (comm) require(comm->device() == hidden.device, "comm.device: got ", to_string(comm->device()),
                    ", expected ", to_string(hidden.device), " (hidden's device)");
  const int64_t n = hidden.rows;
  // this rank's stats, then every rank's ([world, N], this rank's at its place)
  vocab_parallel::Scratch all(hidden.device, sizeof(LogProbStats) * size_t(n * (world + 1)),
                              stream, kFn);
  LogProbStats* local = all.as<LogProbStats>(size_t(n * world));
  linear_log_probs_local_stats(hidden, weight, tokens, o, world == 1 ? all.as<LogProbStats>() : local,
                               stream);
  if (world > 1)
    comm->all_gather(local, all.as<LogProbStats>(), sizeof(LogProbStats) * size_t(n), stream);
  log_probs_merge(all.as<LogProbStats>(), world, n, tokens, o, out, hidden.device, stream);
}

void linear_log_probs_backward(const MatrixView& hidden, const MatrixView& weight,
                               const IndexView& tokens, const float* lse, const float* entropy,
                               const float* grad_log_probs, const float* grad_entropy,
                               const LinearLogProbsOptions& options,
                               const LinearCrossEntropyGrads& grads, Stream stream) {
  constexpr const char* kFn = "linear_log_probs_backward";
  const LinearLogProbsOptions o = check_inputs(hidden, weight, tokens, options);
  const int64_t n = hidden.rows;
  require(lse != nullptr || n == 0, "lse: got null, expected the forward's lse");
  require(entropy != nullptr || grad_entropy == nullptr || n == 0,
          "entropy: got null with a grad_entropy, expected the forward's entropy");
  lce::check_grads(grads, hidden, weight,
                   {{lse, n * 4, "lse"}, {entropy, n * 4, "entropy"},
                    {grad_log_probs, n * 4, "grad_log_probs"}, {grad_entropy, n * 4, "grad_entropy"},
                    detail::span_of(tokens, "tokens")});
  check_tokens_on_host(tokens, o);
  const float inv_t = 1.0f / o.temperature;
  core::LceSteps steps;
  steps.gradient = [&](const MatrixView& logits, int64_t row0, [[maybe_unused]] Stream s) {
    const IndexView tc = lce::target_rows(tokens, row0, logits.rows);
    const float* h = entropy ? entropy + row0 : nullptr;
    const float* g = grad_log_probs ? grad_log_probs + row0 : nullptr;
    const float* e = grad_entropy ? grad_entropy + row0 : nullptr;
    FL_DISPATCH(logits.device, kFn,
                cpu::lp_gradient(logits, tc, lse + row0, h, g, e, inv_t, o.vocab_start,
                                 o.ignore_index),
                cuda::lp_gradient(logits, tc, lse + row0, h, g, e, inv_t, o.vocab_start,
                                  o.ignore_index, s));
  };
  lce::run_loop(hidden.device, kFn, lce::make_plan(hidden, weight, loop_options(o)), hidden,
                weight, steps,
                core::LceGrads{grads.dhidden, grads.dweight, grads.accumulate_dweight, false},
                stream);
}

}  // namespace fusedloss

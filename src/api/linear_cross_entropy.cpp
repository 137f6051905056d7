// Public linear cross-entropy entry points: validate, plan the chunks, hand the backend's chunk
// loop the cross-entropy's own passes (and the vocab-parallel hook) as per-chunk steps.
#include "fusedloss/linear_cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <optional>
#include <sstream>
#include "api/check.h"
#include "api/lce_loop.h"
#include "api/vocab_parallel.h"
#include "core/lce_tuning.h"
#include "core/linear_ce_plan.h"
#include "cpu/cross_entropy_cpu.h"
#include "cpu/linear_ce_cpu.h"
#ifdef FUSEDLOSS_WITH_CUDA
#include "cuda/cross_entropy_cuda.h"
#include "cuda/linear_ce_cuda.h"
#endif

namespace fusedloss {

namespace {

using detail::check_targets_on_host;
using detail::require;
using lce::buffer_share;
using lce::callers_scratch;
using lce::chunk_rows_for;
using lce::make_plan;
using lce::run_loop;
using lce::target_rows;

const char* mode_name(LinearCeBackward m) {
  switch (m) {
    case LinearCeBackward::Auto: return "Auto";
    case LinearCeBackward::InForward: return "InForward";
    case LinearCeBackward::Recompute: return "Recompute";
  }
  return "unknown";
}

// The backward mode's own check (its value); what it may be for a reduction, the inputs' dtype
// and row weights is resolve_linear_ce_backward's.
void check_mode(LinearCeBackward mode) {
  require(mode == LinearCeBackward::Auto || mode == LinearCeBackward::InForward ||
              mode == LinearCeBackward::Recompute,
          "options.backward_mode: got ", int(mode), ", expected Auto, InForward or Recompute");
}

// The options' own checks, shape-only.
// The chunking options: chunk_rows >= 0, and a workspace when chunk_rows does not fix it.
void check_chunking(const LinearCrossEntropyOptions& o) {
  require(o.chunk_rows >= 0, "options.chunk_rows: got ", o.chunk_rows,
          ", expected 0 (from workspace_bytes) or >= 1");
  require(o.chunk_rows > 0 || o.workspace_bytes > 0,
          "options.workspace_bytes: got 0 with chunk_rows 0, expected > 0");
}

core::CeParams resolve(const CrossEntropyOptions& ce, const LinearCrossEntropyOptions& o,
                       int64_t rows, int64_t vocab_local, int64_t hidden) {
  require(hidden >= 1, "hidden.cols: got ", hidden, ", expected H >= 1");
  core::CeParams p = core::resolve_params(ce, rows, vocab_local);
  require(std::isfinite(o.logit_softcap) && o.logit_softcap >= 0.0f,
          "options.logit_softcap: got ", o.logit_softcap, ", expected 0 (off) or a finite value > 0");
  check_chunking(o);
  require(o.vocab_block >= 0, "options.vocab_block: got ", o.vocab_block,
          ", expected 0 (off) or >= 1 columns");
  require(o.dhidden_form == DHiddenForm::Partial, "options.dhidden_form: got ",
          int(o.dhidden_form), ", expected Partial");
  check_mode(o.backward_mode);  // the rules with the reduction: where the inputs are known
  // the cap may come with either options struct; two different caps are a contradiction
  require(!(ce.logit_softcap > 0.0f && o.logit_softcap > 0.0f && ce.logit_softcap != o.logit_softcap),
          "options.logit_softcap: got ", o.logit_softcap, " with ce.logit_softcap ",
          ce.logit_softcap, ", expected one of them 0 or both equal");
  if (o.logit_softcap > 0.0f) p.softcap = o.logit_softcap;
  return p;
}

// A gradient buffer: [rows, cols], fp32 or the inputs' dtype (fp32 inputs: fp32 only), on the
// inputs' device, not overlapping the inputs; `why` says what the call needs it for when it is
// missing.
void check_grad_view(const MatrixView& g, const char* name, int64_t rows, int64_t cols,
                     const MatrixView& hidden, const MatrixView& weight, const char* why) {
  require(g.data != nullptr || rows == 0, name, ": got none, expected a [", rows, ", ", cols,
          "] buffer: ", why);
  detail::check_matrix(g, name);
  require(g.rows == rows && g.cols == cols, name, ": got shape [", g.rows, ", ", g.cols,
          "], expected [", rows, ", ", cols, "]");
  require(g.dtype == DType::F32 || g.dtype == hidden.dtype, name, ".dtype: got ",
          to_string(g.dtype), ", expected fp32",
          hidden.dtype == DType::F32 ? " (fp32 inputs)"
                                     : (std::string(" or ") + to_string(hidden.dtype) +
                                        " (the inputs' dtype)").c_str());
  require(g.device == hidden.device, name, ".device: got ", to_string(g.device), ", expected ",
          to_string(hidden.device), " (the inputs' device)");
  for (auto [in, in_name] : {std::pair{&hidden, "hidden"}, {&weight, "weight"}})
    require(!detail::overlaps(g, *in), name, ": overlaps ", in_name, ", expected a separate buffer");
}

// The LM head's bias, when given (data not null): [V_local] of the inputs' dtype or fp32, with
// the inputs.
void check_bias(const VectorView& b, const MatrixView& hidden, const MatrixView& weight,
                const char* name) {
  if (b.data == nullptr) return;
  require(b.size == weight.rows, name, ".size: got ", b.size, ", expected V_local = weight.rows = ",
          weight.rows);
  require(b.dtype == hidden.dtype || b.dtype == DType::F32, name, ".dtype: got ",
          to_string(b.dtype), ", expected ", to_string(hidden.dtype), " (the inputs' dtype) or fp32");
  require(b.device == hidden.device, name, ".device: got ", to_string(b.device), ", expected ",
          to_string(hidden.device), " (the inputs' device)");
  detail::require_element_aligned(b, name);
}

// A bias gradient buffer (null: none asked for): only beside a bias (`bias_name`); fp32, or
// (any_dtype) the bias's dtype.
void check_dbias(const void* dbias, DType dtype, const VectorView& bias, const char* name,
                 const char* bias_name, bool any_dtype) {
  if (dbias == nullptr) return;
  require(bias.data != nullptr, name, ": got a pointer without ", bias_name,
          ", expected null (no bias, no bias gradient)");
  require(dtype == DType::F32 || (any_dtype && dtype == bias.dtype), name, " dtype: got ",
          to_string(dtype), ", expected fp32", any_dtype ? " or the bias's dtype" : "");
  detail::require_element_aligned(dbias, dtype, name, "");
}

// The bias's columns [col0, col0 + cols).
VectorView bias_columns(const VectorView& b, int64_t col0, int64_t cols) {
  VectorView v = b;
  v.data = static_cast<const char*>(b.data) + col0 * detail::element_size(b.dtype);
  v.size = cols;
  return v;
}

// The bias's columns of a vocabulary slice of V_local columns from col0 (none without a bias).
VectorView bias_of(const VectorView& bias, int64_t col0, int64_t cols) {
  return bias.data == nullptr ? VectorView{} : bias_columns(bias, col0, cols);
}

// `gradient`, then the chunk's dlogits summed into dbias32 (fp32, a float per column; null:
// `gradient` alone).
core::LceStep with_column_sums(core::LceStep gradient, float* dbias32) {
  if (dbias32 == nullptr) return gradient;
  return [gradient = std::move(gradient), dbias32](const MatrixView& g, int64_t row0,
                                                   [[maybe_unused]] Stream s) {
    gradient(g, row0, s);
    FL_DISPATCH(g.device, "linear_cross_entropy", cpu::lce_add_column_sums(g, dbias32),
                cuda::lce_add_column_sums(g, dbias32, s));
  };
}

// n floats of zeros at p, where p lives.
void zero_floats(Device dev, float* p, int64_t n, [[maybe_unused]] Stream stream) {
  FL_DISPATCH(dev, "linear_cross_entropy", std::fill(p, p + n, 0.0f),
              cuda::lce_fill(p, 0.0f, n, stream));
}

// dst (n elements of dtype) = scale[0] * src (n floats), where they live.
void scale_vector(Device dev, const float* src, void* dst, DType dtype, int64_t n,
                  const float* scale, [[maybe_unused]] Stream stream) {
  const MatrixView s{const_cast<float*>(src), 1, n, n, DType::F32, dev};
  const MatrixView d{dst, 1, n, n, dtype, dev};
  FL_DISPATCH(dev, "linear_cross_entropy", cpu::lce_scale(s, d, scale, false),
              cuda::lce_scale(s, d, scale, false, stream));
}

// The inputs' checks, shared by forward and backward.
core::CeParams check_inputs(const MatrixView& hidden, const MatrixView& weight,
                            const IndexView& target, const CrossEntropyOptions& ce,
                            const LinearCrossEntropyOptions& o) {
  detail::check_matrix(hidden, "hidden");
  detail::check_matrix(weight, "weight");
  require(weight.cols == hidden.cols, "weight: got shape [", weight.rows, ", ", weight.cols,
          "], expected [V_local, ", hidden.cols, "] (H = hidden.cols = ", hidden.cols, ")");
  require(weight.rows >= 1, "weight.rows: got ", weight.rows, ", expected V_local >= 1");
  require(weight.dtype == hidden.dtype, "weight.dtype: got ", to_string(weight.dtype),
          ", expected ", to_string(hidden.dtype), " (hidden's dtype)");
  require(weight.device == hidden.device, "weight.device: got ", to_string(weight.device),
          ", expected ", to_string(hidden.device), " (hidden's device)");
  detail::check_index(target, "target", hidden.rows, hidden.device, "hidden");
  return resolve(ce, o, hidden.rows, weight.rows, hidden.cols);
}

// The recompute backward's vocabulary block: options.vocab_block columns (at most V), or fewer,
// down to half of them, where that lets one chunk hold every token: such a block needs no fp32
// block buffer and no conversion pass (at N = 16384, H = 4096, the 8192 columns of a 128 MiB
// fp32 block leave 16128 tokens a chunk beside cuBLASLt's workspace; 8064 columns take all).
int64_t vocab_block_for(const LinearCrossEntropyOptions& o, int64_t rows, int64_t vocab_local,
                        DType dtype, const core::LceTuning& tuning) {
  const int64_t block = std::min(o.vocab_block, vocab_local);
  if (o.chunk_rows > 0 || rows <= 0 || chunk_rows_for(o, rows, block, dtype, tuning) >= rows)
    return block;
  const int64_t es = detail::element_size(dtype);
  const int64_t fit = int64_t(buffer_share(o, tuning) / size_t(tuning.buffers * rows * es)) / 8 * 8;
  return fit >= block / 2 && fit > 0 ? fit : block;
}

core::CeParams chunk_params(core::CeParams p, int64_t rows) {
  p.rows = rows;
  return p;
}

// The forward's scratch, one block at 256-byte boundaries: floats (the per-row losses of a
// Sum / Mean, the count when the caller passes none, the in-forward mode's unit upstream
// gradient), the chunk loop's memory, and at TP > 1 the vocab-parallel exchange of a chunk.
struct ForwardScratch {
  size_t loop_at = 0, exchange_at = 0, bytes = 0;
};

ForwardScratch forward_scratch(const core::LcePlan& plan, const core::CeParams& p, int world,
                               CollectiveForm form, Device dev) {
  const size_t floats = size_t((p.reduction != Reduction::None ? plan.rows : 0) + 2);
  ForwardScratch s;
  s.loop_at = core::round_up(sizeof(float) * floats, core::kLceAlign);
  s.exchange_at = core::round_up(s.loop_at + core::lce_loop_bytes(plan, dev), core::kLceAlign);
  s.bytes = s.exchange_at +
            (world > 1 ? vocab_parallel::forward_scratch_bytes(plan.chunk, world, form) : 0);
  return s;
}

// Reduction (Sum / Mean of row_loss, or null) and count into out; the count alone when
// p.reduction is None.
void reduce(Device dev, const char* fn, const float* row_loss, const IndexView& target,
            const core::CeParams& p, float* loss, float* count, [[maybe_unused]] Stream stream) {
  CrossEntropyOutputs o{loss, nullptr, count};
  FL_DISPATCH(dev, fn, cpu::ce_reduce(row_loss, target, p, o),
              cuda::ce_reduce(row_loss, target, p, o, stream));
}

// The chunk's gradient over its logits, in place: dL/dlogits for the upstream gradient
// `grad_loss` ([N] for None, else [1]) and the count (Mean).
core::LceStep gradient_step(const IndexView& target, const core::CeParams& p, const float* lse,
                            const float* grad_loss, const float* count) {
  return [=](const MatrixView& logits, int64_t row0, [[maybe_unused]] Stream s) {
    const core::CeParams pc = chunk_params(p, logits.rows);
    const IndexView tc = target_rows(target, row0, logits.rows);
    const float* gl = p.reduction == Reduction::None ? grad_loss + row0 : grad_loss;
    FL_DISPATCH(logits.device, "linear_cross_entropy",
                cpu::ce_backward(logits, tc, lse + row0, gl, count, pc, logits),
                cuda::ce_backward(logits, tc, lse + row0, gl, count, pc, logits, s));
  };
}

}  // namespace

LinearCeBackward resolve_linear_ce_backward(LinearCeBackward mode, Reduction reduction,
                                            DType dtype, bool row_weighted) {
  check_mode(mode);
  require(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16, "dtype: got ",
          to_string(dtype), ", expected F32, BF16 or F16 (the linear cross-entropy's inputs)");
  // The in-forward gradient is the unit upstream gradient's, stored in the inputs' dtype before
  // the real one (a loss scale, 1/N) reaches it: in fp16 its small entries (p / N at large
  // vocabularies) flush to zero where the recomputed gradient, scaled first, keeps them.
  const bool in_forward_reduction = reduction != Reduction::None || row_weighted;
  if (mode == LinearCeBackward::Auto)
    return !in_forward_reduction || dtype == DType::F16 ? LinearCeBackward::Recompute
                                                        : LinearCeBackward::InForward;
  require(mode != LinearCeBackward::InForward || in_forward_reduction,
          "options.backward_mode: got ", mode_name(mode),
          " with reduction None and no row weights, expected Recompute or Auto (the in-forward "
          "gradients are those of a Sum or Mean loss, or of sum(row_weight * loss))");
  require(mode != LinearCeBackward::InForward || dtype != DType::F16,
          "options.backward_mode: got ", mode_name(mode),
          " with fp16 inputs, expected Recompute or Auto (the in-forward gradient is stored in fp16 "
          "before the upstream gradient scales it, so the entries a loss scale would keep flush "
          "to zero)");
  return mode;
}

void validate_linear_cross_entropy_options(const CrossEntropyOptions& ce,
                                           const LinearCrossEntropyOptions& options, int64_t rows,
                                           int64_t vocab_local, int64_t hidden) {
  resolve(ce, options, rows, vocab_local, hidden);
}

int64_t linear_cross_entropy_chunk_rows(const LinearCrossEntropyOptions& o, int64_t rows,
                                        int64_t vocab_local, DType dtype) {
  require(rows >= 0, "rows: got ", rows, ", expected >= 0");
  require(vocab_local >= 1, "vocab_local: got ", vocab_local, ", expected >= 1");
  check_chunking(o);
  return chunk_rows_for(o, rows, vocab_local, dtype, core::lce_tuning());
}

size_t linear_cross_entropy_forward_scratch_bytes(const MatrixView& hidden,
                                                  const MatrixView& weight,
                                                  const CrossEntropyOptions& ce,
                                                  const LinearCrossEntropyOptions& options,
                                                  int comm_size) {
  require(comm_size >= 1 && comm_size <= vocab_parallel::kMaxRanks, "comm_size: got ", comm_size,
          ", expected 1..", vocab_parallel::kMaxRanks);
  const core::CeParams p = resolve(ce, options, hidden.rows, weight.rows, hidden.cols);
  return forward_scratch(make_plan(hidden, weight, options), p, comm_size, ce.collective,
                         hidden.device).bytes;
}

void linear_cross_entropy_forward(const MatrixView& hidden, const MatrixView& weight,
                                  const IndexView& target, const CrossEntropyOptions& ce,
                                  const LinearCrossEntropyOptions& options,
                                  const LinearCrossEntropyOutputs& out, Communicator* comm,
                                  Stream stream) {
  constexpr const char* kFn = "linear_cross_entropy_forward";
  if (comm) vocab_parallel::check_communicator(*comm);
  const bool parallel = comm && comm->size() > 1;
  const Device dev = hidden.device;
  const int64_t N = hidden.rows;
  core::CeParams p;
  LinearCeBackward mode = LinearCeBackward::Recompute;
  core::LcePlan plan;
  ForwardScratch layout;
  std::optional<vocab_parallel::Scratch> owned;
  char* mem = nullptr;
  // At TP > 1 this rank's argument errors, and its failure to allocate, travel to every rank
  // through the agreement, as in cross_entropy_forward: everything the call allocates is
  // allocated before it, so no rank fails alone between the per-chunk collectives.
  vocab_parallel::ShardClaim mine;
  mine.rows = hidden.rows;
  mine.vocab_local = weight.rows;
  mine.collective = ce.collective;
  mine.target = target;
  mine.fn = kFn;
  auto local = [&] {
    p = check_inputs(hidden, weight, target, ce, options);
    mine.chunk_rows = linear_cross_entropy_chunk_rows(options, N, weight.rows, hidden.dtype);
    require(out.row_weight == nullptr || p.reduction == Reduction::None,
            "out.row_weight: got a pointer with a Sum or Mean reduction, expected null (row "
            "weights weight the per-row losses of Reduction::None)");
    mode = resolve_linear_ce_backward(options.backward_mode, p.reduction, hidden.dtype,
                                      out.row_weight != nullptr);
    const int64_t nloss = p.reduction == Reduction::None ? N : 1;
    require(out.loss != nullptr || nloss == 0, "out.loss: got null, expected a float buffer of ",
            nloss, " elements");
    require(out.lse != nullptr || N == 0, "out.lse: got null, expected a float buffer of ", N,
            " elements");
    if (mode == LinearCeBackward::InForward) {
      constexpr const char* why =
          "the InForward backward mode (Auto's for Sum / Mean, and for None with row weights, "
          "on fp32 or bf16 inputs) computes the gradients in the forward; Recompute needs none";
      check_grad_view(out.dhidden, "out.dhidden", N, hidden.cols, hidden, weight, why);
      check_grad_view(out.dweight, "out.dweight", weight.rows, hidden.cols, hidden, weight, why);
    }
    check_bias(out.bias, hidden, weight, "out.bias");
    const bool grads = mode == LinearCeBackward::InForward;
    if (grads) check_dbias(out.dbias, DType::F32, out.bias, "out.dbias", "out.bias", false);
    detail::require_outputs_apart(
        {{out.loss, nloss * 4, "out.loss"}, {out.lse, N * 4, "out.lse"},
         {out.valid_count, 4, "out.valid_count"},
         detail::span_of(grads ? out.dhidden : MatrixView{}, "out.dhidden"),
         detail::span_of(grads ? out.dweight : MatrixView{}, "out.dweight"),
         {grads ? out.dbias : nullptr, weight.rows * 4, "out.dbias"},
         {out.scratch, int64_t(out.scratch_bytes), "out.scratch"}},
        {detail::span_of(hidden, "hidden"), detail::span_of(weight, "weight"),
         detail::span_of(target, "target"), detail::span_of(out.bias, "out.bias"),
         {grads ? out.row_weight : nullptr, N * 4, "out.row_weight"}});
    check_targets_on_host(target, p);
    if (parallel) {
      vocab_parallel::check_shard_position(p, *comm, dev);
    } else {
      require(p.vocab_start == 0 && p.vocab_global == weight.rows,
              "options.vocab_global/start: got ", p.vocab_global, "/", p.vocab_start,
              " without a communicator of size > 1, expected ", weight.rows,
              "/0 (the whole vocabulary on one rank)");
    }
    plan = make_plan(hidden, weight, options);
    layout = forward_scratch(plan, p, parallel ? comm->size() : 1, ce.collective, dev);
    if (out.scratch) {
      mem = callers_scratch(out.scratch, out.scratch_bytes, layout.bytes, dev, "out.scratch",
                            "linear_cross_entropy_forward_scratch_bytes");
    } else {
      mem = owned.emplace(dev, layout.bytes, stream, kFn).as<char>();
    }
    linear_cross_entropy_prepare(dev, stream);  // streams, events, the GEMM handle
  };
  if (!parallel) {
    local();
  } else {
    vocab_parallel::claim_errors(mine, local);
    // the options that change the loss or the gradients beside the cross-entropy's
    // (vocab_block only orders the local backward's sums: not among them), the bias's
    // presence, and H (the size of a caller's dhidden all-reduce)
    const int64_t more[] = {int64_t(options.allow_tf32), int64_t(mode), hidden.cols,
                            int64_t(out.bias.data != nullptr)};
    const float softcap = options.logit_softcap + 0.0f;  // -0 and 0 are one option
    uint64_t h = vocab_parallel::fingerprint(ce);
    h = vocab_parallel::fingerprint_more(h, &softcap, sizeof(float));
    mine.options = vocab_parallel::fingerprint_more(h, more, sizeof(more));
    std::ostringstream more_text;
    more_text << std::setprecision(9) << ", logit_softcap=" << softcap
              << ", allow_tf32=" << options.allow_tf32
              << ", bias=" << (out.bias.data ? "given" : "null")
              // before the mode it sets under Auto: a rank without row weights is named so
              << ", row_weight=" << (out.row_weight ? "given" : "null")
              << ", backward_mode=" << mode_name(mode)
              << ", H=" << hidden.cols;
    mine.options_text = vocab_parallel::describe(ce) + more_text.str();
    if (mode == LinearCeBackward::InForward && p.reduction == Reduction::None)
      mine.row_weight = out.row_weight;  // compared with the targets (the gradients' weights)
    vocab_parallel::agree_or_throw(*comm, mine, ce.check_shard_agreement, stream);
  }

  const bool in_forward = mode == LinearCeBackward::InForward;
  if (in_forward && !parallel) plan.step_rows = plan.tuning.ce_rows;
  const bool reduced = p.reduction != Reduction::None;
  float* floats = reinterpret_cast<float*>(mem);
  float* row_loss = reduced ? floats : out.loss;
  float* count = out.valid_count ? out.valid_count : floats + (reduced ? N : 0);
  float* one = floats + (reduced ? N : 0) + 1;
  char* exchange = mem + layout.exchange_at;

  core::LceSteps steps;
  steps.bias = bias_of(out.bias, 0, weight.rows);
  steps.forward = [&, parallel](const MatrixView& logits, int64_t row0, [[maybe_unused]] Stream s) {
    core::CeParams pc = chunk_params(p, logits.rows);
    pc.reduction = Reduction::None;  // per-row losses; reduced once after the loop
    const IndexView tc = target_rows(target, row0, logits.rows);
    const CrossEntropyOutputs oc{row_loss + row0, out.lse + row0, nullptr};
    if (parallel) {
      vocab_parallel::forward(logits, tc, pc, ce.collective, oc, *comm, exchange, s, kFn);
      return;
    }
    std::vector<RowStats> stats(logits.device == Device::CPU ? size_t(logits.rows) : 0);
    FL_DISPATCH(logits.device, kFn,
                cpu::ce_local_stats(logits, tc, pc, stats.data());
                cpu::ce_merge(stats.data(), 1, stats.data(), tc, pc, oc),
                cuda::ce_forward_tp1(logits, tc, pc, oc, s));
  };
  core::LceGrads grads;
  if (in_forward) {
    // The count (Mean's divisor) is known from the targets alone, before any gradient.
    core::CeParams count_only = p;
    count_only.reduction = Reduction::None;
    reduce(dev, kFn, nullptr, target, count_only, nullptr, count, stream);
    FL_DISPATCH(dev, kFn, *one = 1.0f, cuda::lce_fill(one, 1.0f, 1, stream));
    // None: each row's upstream gradient is its weight; Sum / Mean: the unit scalar
    float* dbias = out.bias.data ? out.dbias : nullptr;
    if (dbias) zero_floats(dev, dbias, weight.rows, stream);
    steps.gradient = with_column_sums(
        gradient_step(target, p, out.lse, reduced ? one : out.row_weight, count), dbias);
    grads = core::LceGrads{out.dhidden, out.dweight, false, false};
  }
  run_loop(dev, kFn, plan, hidden, weight, steps, grads, stream, mem + layout.loop_at);
  if (reduced)
    reduce(dev, kFn, row_loss, target, p, out.loss, out.valid_count, stream);
  else if (out.valid_count)  // None: the count alone
    reduce(dev, kFn, nullptr, target, p, nullptr, out.valid_count, stream);
}

void linear_cross_entropy_prepare(Device device, [[maybe_unused]] Stream stream) {
  FL_DISPATCH(device, "linear_cross_entropy_prepare", (void)0, cuda::lce_prepare(stream));
}

size_t linear_cross_entropy_local_stats_scratch_bytes(const MatrixView& hidden,
                                                      const MatrixView& weight,
                                                      const LinearCrossEntropyOptions& options) {
  resolve(CrossEntropyOptions{}, options, hidden.rows, weight.rows, hidden.cols);
  return core::lce_loop_bytes(make_plan(hidden, weight, options), hidden.device);
}

void linear_cross_entropy_local_stats(const MatrixView& hidden, const MatrixView& weight,
                                      const IndexView& target, const CrossEntropyOptions& ce,
                                      const LinearCrossEntropyOptions& options, RowStats* stats,
                                      Stream stream, void* scratch, size_t scratch_bytes,
                                      const VectorView& bias) {
  constexpr const char* kFn = "linear_cross_entropy_local_stats";
  const core::CeParams p = check_inputs(hidden, weight, target, ce, options);
  check_bias(bias, hidden, weight, "bias");
  require(stats != nullptr || hidden.rows == 0, "stats: got null, expected ", hidden.rows,
          " RowStats");
  detail::require_outputs_apart(
      {{stats, hidden.rows * int64_t(sizeof(RowStats)), "stats"},
       {scratch, int64_t(scratch_bytes), "scratch"}},
      {detail::span_of(hidden, "hidden"), detail::span_of(weight, "weight"),
       detail::span_of(target, "target"), detail::span_of(bias, "bias")});
  check_targets_on_host(target, p);
  const core::LcePlan plan = make_plan(hidden, weight, options);
  char* memory = scratch ? callers_scratch(scratch, scratch_bytes,
                                           core::lce_loop_bytes(plan, hidden.device),
                                           hidden.device, "scratch",
                                           "linear_cross_entropy_local_stats_scratch_bytes")
                         : nullptr;
  core::LceSteps steps;
  steps.bias = bias_of(bias, 0, weight.rows);
  steps.forward = [&](const MatrixView& logits, int64_t row0, [[maybe_unused]] Stream s) {
    const core::CeParams pc = chunk_params(p, logits.rows);
    const IndexView tc = target_rows(target, row0, logits.rows);
    FL_DISPATCH(logits.device, kFn, cpu::ce_local_stats(logits, tc, pc, stats + row0),
                cuda::ce_local_stats(logits, tc, pc, stats + row0, s));
  };
  run_loop(hidden.device, kFn, plan, hidden, weight, steps, {}, stream, memory);
}

void linear_cross_entropy_backward(const MatrixView& hidden, const MatrixView& weight,
                                   const IndexView& target, const float* lse,
                                   const float* grad_loss, const float* valid_count,
                                   const CrossEntropyOptions& ce,
                                   const LinearCrossEntropyOptions& options,
                                   const LinearCrossEntropyOutputs& saved,
                                   const LinearCrossEntropyGrads& grads, Stream stream) {
  constexpr const char* kFn = "linear_cross_entropy_backward";
  const core::CeParams p = check_inputs(hidden, weight, target, ce, options);
  require(saved.row_weight == nullptr || p.reduction == Reduction::None,
          "saved.row_weight: got a pointer with a Sum or Mean reduction, expected null (the "
          "forward's row weights, Reduction::None only)");
  const LinearCeBackward mode = resolve_linear_ce_backward(options.backward_mode, p.reduction,
                                                           hidden.dtype, saved.row_weight != nullptr);
  const Device dev = hidden.device;
  const int64_t N = hidden.rows;
  constexpr const char* written = "the backward writes the gradients there";
  check_grad_view(grads.dhidden, "grads.dhidden", N, hidden.cols, hidden, weight, written);
  check_grad_view(grads.dweight, "grads.dweight", weight.rows, hidden.cols, hidden, weight, written);
  check_bias(saved.bias, hidden, weight, "saved.bias");
  check_dbias(grads.dbias, grads.dbias_dtype, saved.bias, "grads.dbias", "saved.bias", true);
  const int64_t V = weight.rows;
  const detail::Span dbias_span{grads.dbias, V * detail::element_size(grads.dbias_dtype),
                                "grads.dbias"};
  detail::require_outputs_apart(
      {detail::span_of(grads.dhidden, "grads.dhidden"),
       detail::span_of(grads.dweight, "grads.dweight"), dbias_span},
      {detail::span_of(hidden, "hidden"), detail::span_of(weight, "weight"),
       detail::span_of(saved.bias, "saved.bias")});
  require(grad_loss != nullptr || (p.reduction == Reduction::None && N == 0),
          "grad_loss: got null, expected ", p.reduction == Reduction::None ? N : 1, " floats");
  // what the backward reads beside the inputs, never under the gradients it writes
  const int64_t ngrad = p.reduction == Reduction::None ? N : 1;
  for (const detail::Span& written : {detail::span_of(grads.dhidden, "grads.dhidden"),
                                      detail::span_of(grads.dweight, "grads.dweight"), dbias_span})
    detail::require_read_apart(written, {{grad_loss, ngrad * 4, "grad_loss"}, {lse, N * 4, "lse"},
                                         {valid_count, 4, "valid_count"},
                                         detail::span_of(target, "target"),
                                         {saved.row_weight, N * 4, "saved.row_weight"}});

  if (mode == LinearCeBackward::InForward) {
    constexpr const char* why = "the InForward backward scales the gradients its forward "
                                "wrote: pass that forward's outputs as `saved`";
    check_grad_view(saved.dhidden, "saved.dhidden", N, hidden.cols, hidden, weight, why);
    check_grad_view(saved.dweight, "saved.dweight", weight.rows, hidden.cols, hidden, weight, why);
    auto same_or_apart = [](const MatrixView& dst, const MatrixView& src, const char* name) {
      const bool same = dst.data == src.data && dst.row_stride == src.row_stride &&
                        dst.dtype == src.dtype;
      require(same || !detail::overlaps(dst, src), name,
              ": overlaps the saved gradient without being the same view; expected the saved "
              "buffer itself (scaled in place) or a separate one");
    };
    same_or_apart(grads.dhidden, saved.dhidden, "grads.dhidden");
    same_or_apart(grads.dweight, saved.dweight, "grads.dweight");
    // and never over the other saved gradient: dhidden is scaled first, dweight read after it
    detail::require_read_apart(detail::span_of(grads.dhidden, "grads.dhidden"),
                               {detail::span_of(saved.dweight, "saved.dweight")});
    detail::require_read_apart(detail::span_of(grads.dweight, "grads.dweight"),
                               {detail::span_of(saved.dhidden, "saved.dhidden")});
    if (grads.dbias) {
      require(saved.dbias != nullptr, "saved.dbias: got null with grads.dbias, expected the "
              "forward's out.dbias (the InForward backward scales it)");
      // the saved fp32 gradient itself (scaled in place), or apart from it and the others
      const bool same = grads.dbias == saved.dbias && grads.dbias_dtype == DType::F32;
      const detail::Span saved_dbias{saved.dbias, V * 4, "saved.dbias"};
      if (!same) detail::require_read_apart(dbias_span, {saved_dbias});
      for (const detail::Span& written : {detail::span_of(grads.dhidden, "grads.dhidden"),
                                          detail::span_of(grads.dweight, "grads.dweight")})
        detail::require_read_apart(written, {saved_dbias});
      detail::require_read_apart(dbias_span, {detail::span_of(saved.dhidden, "saved.dhidden"),
                                              detail::span_of(saved.dweight, "saved.dweight")});
    }
    // The scale: grad_loss[0], or (row weights) the c of grad_loss = c * row_weight, found
    // where grad_loss lives (a float of device memory on CUDA).
    const float* scale = grad_loss;
    float host_scale = 0.0f;
    std::optional<vocab_parallel::Scratch> device_scale;
    if (saved.row_weight) {
      FL_DISPATCH(dev, kFn,
                  host_scale = cpu::lce_row_weight_scale(grad_loss, saved.row_weight, N);
                  scale = &host_scale,
                  scale = device_scale.emplace(dev, sizeof(float), stream, kFn).as<float>();
                  cuda::lce_row_weight_scale(grad_loss, saved.row_weight, N,
                                             const_cast<float*>(scale), stream));
    }
    FL_DISPATCH(dev, kFn,
                cpu::lce_scale(saved.dhidden, grads.dhidden, scale, false);
                cpu::lce_scale(saved.dweight, grads.dweight, scale, grads.accumulate_dweight),
                cuda::lce_scale(saved.dhidden, grads.dhidden, scale, false, stream);
                cuda::lce_scale(saved.dweight, grads.dweight, scale,
                                grads.accumulate_dweight, stream));
    if (grads.dbias) scale_vector(dev, saved.dbias, grads.dbias, grads.dbias_dtype, V, scale, stream);
    return;
  }
  require(lse != nullptr || N == 0, "lse: got null, expected the forward's lse");
  require(valid_count != nullptr || p.reduction != Reduction::Mean || N == 0,
          "valid_count: got null, expected the forward's valid_count for Reduction::Mean");
  check_targets_on_host(target, p);
  // dbias sums in fp32: in grads.dbias itself when it is fp32, else in V floats of scratch
  // (and a 1 to scale by) rounded into it once after the loop.
  std::optional<vocab_parallel::Scratch> dbias_scratch;
  float* dbias32 = nullptr;
  if (grads.dbias) {
    if (grads.dbias_dtype == DType::F32) {
      dbias32 = static_cast<float*>(grads.dbias);
    } else {
      dbias32 = dbias_scratch.emplace(dev, sizeof(float) * size_t(V + 1), stream, kFn).as<float>();
      FL_DISPATCH(dev, kFn, dbias32[V] = 1.0f, cuda::lce_fill(dbias32 + V, 1.0f, 1, stream));
    }
    zero_floats(dev, dbias32, V, stream);
  }
  auto round_dbias = [&] {
    if (dbias_scratch)
      scale_vector(dev, dbias32, grads.dbias, grads.dbias_dtype, V, dbias32 + V, stream);
  };
  core::LceSteps steps;
  steps.bias = bias_of(saved.bias, 0, weight.rows);
  if (options.vocab_block == 0) {
    steps.gradient = with_column_sums(gradient_step(target, p, lse, grad_loss, valid_count),
                                      dbias32);
    run_loop(dev, kFn, make_plan(hidden, weight, options), hidden, weight, steps,
             core::LceGrads{grads.dhidden, grads.dweight, grads.accumulate_dweight, false},
             stream);
    round_dbias();
    return;
  }
  // Vocabulary blocks outside, token chunks inside: a block is a shard of this rank's shard
  // (its columns start at vocab_start + b0), so the cross-entropy's gradient pass runs on it
  // as is. fp32 accumulators: dhidden over the blocks, each block's dweight over all tokens.
  const core::LceTuning tuning = core::lce_tuning();
  const int64_t H = hidden.cols, block = vocab_block_for(options, N, V, hidden.dtype, tuning);
  auto block_of = [&](int64_t b0, int64_t nb) {
    MatrixView wb = weight;
    wb.data = static_cast<char*>(weight.data) +
              b0 * weight.row_stride * detail::element_size(weight.dtype);
    wb.rows = nb;
    return wb;
  };
  // One chunk of every token per block (see `direct` below) needs no fp32 block: then it is
  // not allocated (up to 128 MiB). A shorter last block has chunks at least as long.
  const bool all_direct = make_plan(hidden, block_of(0, block), options, tuning).chunk >= N;
  const int64_t block_floats = all_direct ? 0 : block * H;
  vocab_parallel::Scratch acc(dev, sizeof(float) * size_t(N * H + block_floats + 1), stream, kFn);
  const MatrixView dh32{acc.as<float>(), N, H, H, DType::F32, dev};
  float* one = acc.as<float>(size_t(N * H + block_floats));
  FL_DISPATCH(dev, kFn, *one = 1.0f, cuda::lce_fill(one, 1.0f, 1, stream));
  for (int64_t b0 = 0; b0 < V; b0 += block) {
    const int64_t nb = std::min(block, V - b0);
    const MatrixView wb = block_of(b0, nb);
    core::CeParams pb = p;
    pb.vocab_start = p.vocab_start + b0;
    pb.vocab_local = nb;
    const MatrixView dwb{acc.as<float>(size_t(N * H)), nb, H, H, DType::F32, dev};
    MatrixView dw_rows = grads.dweight;
    dw_rows.data = static_cast<char*>(grads.dweight.data) +
                   b0 * grads.dweight.row_stride * detail::element_size(grads.dweight.dtype);
    dw_rows.rows = nb;
    // One chunk of every token: the block's single dweight GEMM sums all tokens in its own fp32
    // accumulator and rounds once, so it writes (or adds into) the caller's rows directly,
    // without the fp32 block and its conversion pass (3 x 2 bytes per element of traffic).
    const core::LcePlan plan = make_plan(hidden, wb, options, tuning);
    const bool direct = all_direct || plan.chunk >= N;
    detail::require(direct || block_floats > 0, kFn, ": internal: a vocabulary block of ", nb,
                    " rows needs the fp32 block that was not allocated");
    steps.bias = bias_of(saved.bias, b0, nb);
    steps.gradient = with_column_sums(gradient_step(target, pb, lse, grad_loss, valid_count),
                                      dbias32 ? dbias32 + b0 : nullptr);
    run_loop(dev, kFn, plan, hidden, wb, steps,
             direct ? core::LceGrads{dh32, dw_rows, grads.accumulate_dweight, b0 > 0}
                    : core::LceGrads{dh32, dwb, false, b0 > 0},
             stream);
    if (!direct)
      FL_DISPATCH(dev, kFn, cpu::lce_scale(dwb, dw_rows, one, grads.accumulate_dweight),
                  cuda::lce_scale(dwb, dw_rows, one, grads.accumulate_dweight, stream));
  }
  FL_DISPATCH(dev, kFn, cpu::lce_scale(dh32, grads.dhidden, one, false),
              cuda::lce_scale(dh32, grads.dhidden, one, false, stream));
  round_dbias();
}

}  // namespace fusedloss

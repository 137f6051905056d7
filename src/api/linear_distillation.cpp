// Public linear distillation entry points: validate, plan the student's chunks (api/lce_loop.h),
// and hand the chunk loop steps that compute the same rows of the teacher's logits beside them
// (a GEMM of their own) and the row math (core/distill_math.h) on the inputs' backend.
#include "fusedloss/linear_distillation.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include "api/check.h"
#include "api/lce_loop.h"
#include "api/vocab_parallel.h"
#include "cpu/distill_cpu.h"
#include "cpu/gemm_cpu.h"
#include "cpu/matrix_cpu.h"
#ifdef FUSEDLOSS_WITH_CUDA
#include "cuda/distill_cuda.h"
#include "cuda/gemm_lt.h"
#endif

namespace fusedloss {

namespace {

using detail::require;

using lce::loop_options;

core::DistillParams params_of(const LinearDistillationOptions& o) {
  return {o.divergence, o.beta, 1.0f / o.temperature, o.hard_label_weight};
}

// The options with vocab_global resolved (0: V_local).
LinearDistillationOptions resolved(LinearDistillationOptions o, int64_t vocab_local) {
  if (o.vocab_global == 0) o.vocab_global = vocab_local;
  return o;
}

void check_targets(const IndexView& target, int64_t rows, const LinearDistillationOptions& o) {
  core::CeParams p;
  p.rows = rows;
  p.vocab_global = o.vocab_global;
  p.ignore_index = o.ignore_index;
  detail::check_targets_on_host(target, p, "target");
}

LinearDistillationOptions check_inputs(const MatrixView& sh, const MatrixView& sw,
                                       const MatrixView& th, const MatrixView& tw,
                                       const IndexView& target,
                                       const LinearDistillationOptions& options) {
  for (auto [m, name] : {std::pair{&sh, "student_hidden"}, {&sw, "student_weight"},
                         {&th, "teacher_hidden"}, {&tw, "teacher_weight"}}) {
    detail::check_matrix(*m, name);
    require(m->device == sh.device, name, ".device: got ", to_string(m->device), ", expected ",
            to_string(sh.device), " (student_hidden's device)");
  }
  require(sw.cols == sh.cols, "student_weight: got shape [", sw.rows, ", ", sw.cols,
          "], expected [V, ", sh.cols, "] (H_s = student_hidden.cols)");
  require(tw.cols == th.cols, "teacher_weight: got shape [", tw.rows, ", ", tw.cols,
          "], expected [V, ", th.cols, "] (H_t = teacher_hidden.cols)");
  require(tw.rows == sw.rows, "teacher_weight.rows: got ", tw.rows, ", expected ", sw.rows,
          " (V = student_weight.rows: one vocabulary)");
  require(th.rows == sh.rows, "teacher_hidden.rows: got ", th.rows, ", expected ", sh.rows,
          " (N = student_hidden.rows: the same tokens)");
  require(sw.dtype == sh.dtype, "student_weight.dtype: got ", to_string(sw.dtype), ", expected ",
          to_string(sh.dtype), " (student_hidden's dtype)");
  require(tw.dtype == th.dtype, "teacher_weight.dtype: got ", to_string(tw.dtype), ", expected ",
          to_string(th.dtype), " (teacher_hidden's dtype)");
  if (target.data) detail::check_index(target, "target", sh.rows, sh.device, "student_hidden");
  // (no rows: an empty target may have no address; nothing needs one)
  validate_linear_distillation_options(options, sh.rows, sw.rows,
                                       target.data != nullptr || sh.rows == 0);
  const LinearDistillationOptions o = resolved(options, sw.rows);
  if (target.data) check_targets(target, sh.rows, o);
  return o;
}

IndexView rows_of_target(const IndexView& t, int64_t row0, int64_t rows) {
  return t.data ? lce::target_rows(t, row0, rows) : t;
}

// The rows of the teacher's logits computed at a time for a student chunk.
int64_t teacher_slice(const core::LcePlan& student) {
  const int64_t r = student.tuning.teacher_rows;
  return r > 0 ? std::min(r, student.chunk) : student.chunk;
}

// The teacher's logits of the student's chunk of rows, in a buffer of their own (the teacher's
// dtype), with the GEMM's memory beside it: the CPU GEMMs' fp32 stage, or cuBLASLt's workspace
// (the teacher's GEMM runs on the steps' stream while the student's next one runs beside it).
// The last rows computed are kept: a loop with both a forward and a gradient step would ask
// for each chunk twice (every entry point runs one step now).
class TeacherChunks {
 public:
  // The teacher's plan and what it takes beside the student's chunk buffers: a row of the
  // chunk, and the GEMM's memory.
  static core::LcePlan plan_of(const MatrixView& hidden, const MatrixView& weight,
                               const LinearDistillationOptions& o) {
    return lce::make_plan(hidden, weight, loop_options(o));
  }
  static size_t gemm_bytes(const core::LcePlan& p, Device device) {
    return device == Device::CPU ? core::lce_cpu_stage_bytes(p) : p.gemm_workspace;
  }
  static lce::Beside beside(const core::LcePlan& p, Device device) {
    return {size_t(p.stride) * size_t(detail::element_size(p.dtype)),
            gemm_bytes(p, device) + core::kLceAlign};
  }

  TeacherChunks(const core::LcePlan& student, const MatrixView& hidden, const MatrixView& weight,
                const LinearDistillationOptions& o, Stream stream, const char* fn)
      : hidden_(hidden), weight_(weight), plan_(plan_of(hidden, weight, o)) {
    plan_.chunk = teacher_slice(student);
    const size_t at = core::round_up(size_t(plan_.chunk) * size_t(plan_.stride) *
                                         size_t(detail::element_size(plan_.dtype)),
                                     core::kLceAlign);
    extra_ = gemm_bytes(plan_, hidden.device);
    if (hidden.rows == 0) return;
    memory_.emplace(hidden.device, at + extra_, stream, fn);
    extra_at_ = memory_->as<char>(at);
  }
  // [rows, V_local] = teacher_hidden rows [row0, row0 + rows) @ teacher_weight^T, on `stream`.
  MatrixView logits(int64_t row0, int64_t rows, [[maybe_unused]] Stream stream) {
    const MatrixView out{memory_->as<char>(), rows, plan_.vocab_local, plan_.stride, plan_.dtype,
                         hidden_.device};
    if (row0 == row0_ && rows == rows_) return out;
    row0_ = row0, rows_ = rows;
    const MatrixView h = cpu::rows_of(hidden_, row0, rows);
    FL_DISPATCH(hidden_.device, "linear_distillation",
                cpu::gemm(h, false, weight_, true, out, false,
                          cpu::GemmStage{extra_ ? reinterpret_cast<float*>(extra_at_) : nullptr,
                                         int64_t(extra_ / sizeof(float))}),
                cuda::gemm(h, false, weight_, true, out, false, plan_.tf32, extra_at_, extra_,
                           stream, plan_.tuning.gemm_algos));
    return out;
  }

 private:
  MatrixView hidden_, weight_;
  core::LcePlan plan_;
  std::optional<vocab_parallel::Scratch> memory_;
  size_t extra_ = 0;
  char* extra_at_ = nullptr;
  int64_t row0_ = -1, rows_ = -1;
};

// The student's plan, its chunks sized so that its buffers and the teacher's share
// workspace_bytes: the teacher's buffer as long as a chunk, or tuning.teacher_rows long.
core::LcePlan student_plan(const MatrixView& sh, const MatrixView& sw, const MatrixView& th,
                           const MatrixView& tw, const LinearDistillationOptions& o) {
  core::LceTuning tuning = core::lce_tuning();
  const lce::Beside teacher = TeacherChunks::beside(TeacherChunks::plan_of(th, tw, o), sh.device);
  const LinearCrossEntropyOptions lo = loop_options(o);
  if (tuning.teacher_rows > 0) {
    const int64_t slice = std::min(tuning.teacher_rows, std::max<int64_t>(sh.rows, 1));
    const core::LcePlan sliced = lce::make_plan(
        sh, sw, lo, tuning, {0, teacher.bytes + size_t(slice) * teacher.row_bytes});
    // Slices pay off only under longer student chunks: where the slice's buffer leaves the
    // student fewer rows than itself, the teacher's buffer follows the chunk instead.
    if (sliced.chunk >= slice || o.chunk_rows > 0) return sliced;
    tuning.teacher_rows = 0;
  }
  return lce::make_plan(sh, sw, lo, tuning, teacher);
}

// f(xs, xt, the chunk's targets, row0, stream) on each token chunk: the student's logits xs and
// the teacher's xt of the same rows (null: no such step).
using ChunkStep = std::function<void(const MatrixView& xs, const MatrixView& xt,
                                     const IndexView& target, int64_t row0, Stream stream)>;

// One pass of the chunk loop over the student's tokens with the teacher's logits of each chunk
// beside them: `forward`, then `gradient` (which turns xs into its gradient for the student's
// GEMMs into `grads`) on each chunk.
void run_chunks(const char* fn, const MatrixView& sh, const MatrixView& sw, const MatrixView& th,
                const MatrixView& tw, const IndexView& target, const LinearDistillationOptions& o,
                Stream stream, const ChunkStep& forward, const ChunkStep& gradient = {},
                const LinearCrossEntropyGrads& grads = {}) {
  const core::LcePlan plan = student_plan(sh, sw, th, tw, o);
  TeacherChunks teacher(plan, th, tw, o, stream, fn);
  const int64_t slice = teacher_slice(plan);
  auto step = [&](const ChunkStep& f) -> core::LceStep {
    if (!f) return {};
    // f on the chunk's rows a teacher slice at a time (every step is row by row).
    return [&, f](const MatrixView& xs, int64_t row0, Stream s) {
      for (int64_t r = 0; r < xs.rows; r += slice) {
        const int64_t rows = std::min(slice, xs.rows - r);
        f(cpu::rows_of(xs, r, rows), teacher.logits(row0 + r, rows, s),
          rows_of_target(target, row0 + r, rows), row0 + r, s);
      }
    };
  };
  core::LceSteps steps;
  steps.forward = step(forward);
  steps.gradient = step(gradient);
  lce::run_loop(sh.device, fn, plan, sh, sw, steps,
                core::LceGrads{grads.dhidden, grads.dweight, grads.accumulate_dweight, false},
                stream);
}

// The options of the steps after the all-gather (no operands to check them against): the
// whole vocabulary, and the options' own rules for it.
void check_merge_options(const LinearDistillationOptions& o, int64_t rows, bool has_target) {
  require(o.vocab_global >= 1, "options.vocab_global: got ", o.vocab_global,
          ", expected the whole vocabulary (>= 1) to merge shards");
  LinearDistillationOptions whole = o;
  whole.vocab_start = 0;  // (this rank's shard is not read here)
  validate_linear_distillation_options(whole, rows, o.vocab_global, has_target || rows == 0);
}

void check_out(const void* p, int64_t n, const char* name, const char* what) {
  require(p != nullptr || n == 0, name, ": got null, expected ", n, " ", what);
}

}  // namespace

void validate_linear_distillation_options(const LinearDistillationOptions& o, int64_t rows,
                                          int64_t vocab_local, bool has_target) {
  require(rows >= 0, "student_hidden.rows: got ", rows, ", expected N >= 0");
  require(vocab_local >= 1, "student_weight.rows: got ", vocab_local, ", expected V_local >= 1");
  const int d = int(o.divergence);
  require(d >= 0 && d <= 2, "options.divergence: got ", d,
          ", expected ForwardKL (0), ReverseKL (1) or JSD (2)");
  require(std::isfinite(o.temperature) && o.temperature > 0.0f, "options.temperature: got ",
          o.temperature, ", expected a finite value > 0");
  require(o.divergence != Divergence::JSD || (o.beta > 0.0f && o.beta < 1.0f), "options.beta: got ",
          o.beta, ", expected a value in (0, 1) (jsd's mixture weight; 0 and 1 make it 0: take "
          "forward_kl or reverse_kl)");
  require(o.hard_label_weight >= 0.0f && o.hard_label_weight <= 1.0f,
          "options.hard_label_weight: got ", o.hard_label_weight, ", expected a value in [0, 1]");
  require(has_target || o.hard_label_weight == 0.0f, "options.hard_label_weight: got ",
          o.hard_label_weight, " without a target, expected 0 (the hard-label term needs targets)");
  const int64_t global = o.vocab_global == 0 ? vocab_local : o.vocab_global;
  require(o.vocab_start >= 0 && o.vocab_start + vocab_local <= global, "options.vocab_start: got ",
          o.vocab_start, " with V_local ", vocab_local, " and vocab_global ", global,
          ", expected a shard [vocab_start, vocab_start + V_local) within [0, vocab_global)");
  require(o.ignore_index < 0 || o.ignore_index >= global, "options.ignore_index: got ",
          o.ignore_index, ", expected a value outside [0, ", global, ")");
  require(o.chunk_rows >= 0, "options.chunk_rows: got ", o.chunk_rows,
          ", expected 0 (from workspace_bytes) or >= 1");
  require(o.chunk_rows > 0 || o.workspace_bytes > 0,
          "options.workspace_bytes: got 0 with chunk_rows 0, expected > 0");
}

void linear_distillation_forward(const MatrixView& sh, const MatrixView& sw, const MatrixView& th,
                                 const MatrixView& tw, const IndexView& target,
                                 const LinearDistillationOptions& options, float* loss,
                                 DistillRowStats* stats, Stream stream,
                                 const DistillInForward& in_forward) {
  constexpr const char* kFn = "linear_distillation_forward";
  const LinearDistillationOptions o = check_inputs(sh, sw, th, tw, target, options);
  require(o.vocab_global == sw.rows, "options.vocab_global: got ", o.vocab_global,
          " with V_local ", sw.rows, ", expected one shard (vocab-parallel: ",
          "linear_distillation_local_partials and distill_merge)");
  const int64_t n = sh.rows;
  check_out(loss, n, "loss", "floats");
  check_out(stats, n, "stats", "DistillRowStats");
  const detail::Span s_loss{loss, n * 4, "loss"},
      s_stats{stats, n * int64_t(sizeof(DistillRowStats)), "stats"},
      s_th = detail::span_of(th, "teacher_hidden"), s_tw = detail::span_of(tw, "teacher_weight"),
      s_target = detail::span_of(target, "target");
  detail::require_outputs_apart({s_loss, s_stats},
                                {detail::span_of(sh, "student_hidden"),
                                 detail::span_of(sw, "student_weight"), s_th, s_tw, s_target});
  const LinearCrossEntropyGrads& in_grads = in_forward.grads;
  const bool grads = in_grads.dhidden.data || in_grads.dweight.data;
  const float* gl = in_forward.grad_loss;
  require(grads || gl == nullptr, "in_forward.grad_loss: got a pointer without in_forward.grads, ",
          "expected null (the upstream gradients of the in-forward gradients only)");
  require(in_grads.dbias == nullptr, "in_forward.grads.dbias: got a pointer, expected null (the ",
          "distillation loss has no bias)");
  const detail::Span s_gl{gl, n * 4, "in_forward.grad_loss"};
  detail::require_outputs_apart({s_loss, s_stats}, {s_gl});
  if (grads) lce::check_grads(in_grads, sh, sw, {s_th, s_tw, s_target, s_loss, s_stats, s_gl});
  const core::DistillParams p = params_of(o);
  auto forward = [&](const MatrixView& xs, const MatrixView& xt, const IndexView& tc,
                     int64_t row0, [[maybe_unused]] Stream s) {
    FL_DISPATCH(xs.device, kFn,
                cpu::distill_rows(xs, xt, tc, o.ignore_index, p, loss + row0, stats + row0),
                cuda::distill_rows(xs, xt, tc, o.ignore_index, p, loss + row0, stats + row0, s));
  };
  // In-forward: the loss and the gradient of each chunk in one step (on sm_90 one kernel that
  // reads each row pair once).
  auto forward_and_gradient = [&](const MatrixView& xs, const MatrixView& xt, const IndexView& tc,
                                  int64_t row0, [[maybe_unused]] Stream s) {
    const float* g = gl ? gl + row0 : nullptr;
    FL_DISPATCH(xs.device, kFn,
                (cpu::distill_rows(xs, xt, tc, o.ignore_index, p, loss + row0, stats + row0),
                 cpu::distill_gradient(xs, xt, tc, 0, o.ignore_index, p, stats + row0, g)),
                cuda::distill_rows_and_gradient(xs, xt, tc, o.ignore_index, p, loss + row0,
                                                stats + row0, g, s));
  };
  if (grads)
    run_chunks(kFn, sh, sw, th, tw, target, o, stream, {}, forward_and_gradient, in_grads);
  else
    run_chunks(kFn, sh, sw, th, tw, target, o, stream, forward);
}

void linear_distillation_local_partials(const MatrixView& sh, const MatrixView& sw,
                                        const MatrixView& th, const MatrixView& tw,
                                        const IndexView& target,
                                        const LinearDistillationOptions& options,
                                        DistillPartial* partials, Stream stream) {
  constexpr const char* kFn = "linear_distillation_local_partials";
  const LinearDistillationOptions o = check_inputs(sh, sw, th, tw, target, options);
  const int64_t n = sh.rows;
  check_out(partials, n, "partials", "DistillPartial");
  detail::require_outputs_apart(
      {{partials, n * int64_t(sizeof(DistillPartial)), "partials"}},
      {detail::span_of(sh, "student_hidden"), detail::span_of(sw, "student_weight"),
       detail::span_of(th, "teacher_hidden"), detail::span_of(tw, "teacher_weight"),
       detail::span_of(target, "target")});
  const core::DistillParams p = params_of(o);
  run_chunks(kFn, sh, sw, th, tw, target, o, stream,
             [&](const MatrixView& xs, const MatrixView& xt, const IndexView& tc, int64_t row0,
                 [[maybe_unused]] Stream s) {
               FL_DISPATCH(xs.device, kFn,
                           cpu::distill_partials(xs, xt, tc, o.vocab_start, p, partials + row0),
                           cuda::distill_partials(xs, xt, tc, o.vocab_start, p, partials + row0,
                                                  s));
             });
}

void distill_merge(const DistillPartial* partials, int world, int64_t rows, const IndexView& target,
                   const LinearDistillationOptions& options, DistillRowStats* stats, float* loss,
                   Device device, [[maybe_unused]] Stream stream) {
  require(world >= 1, "world: got ", world, ", expected >= 1 shards");
  check_out(partials, rows, "partials", "DistillPartial a shard");
  check_out(stats, rows, "stats", "DistillRowStats");
  check_out(loss, rows, "loss", "floats");
  check_merge_options(options, rows, target.data != nullptr);
  if (target.data) {
    detail::check_index(target, "target", rows, device, "partials");
    check_targets(target, rows, options);
  }
  detail::require_outputs_apart(
      {{stats, rows * int64_t(sizeof(DistillRowStats)), "stats"}, {loss, rows * 4, "loss"}},
      {{partials, int64_t(world) * rows * int64_t(sizeof(DistillPartial)), "partials"},
       detail::span_of(target, "target")});
  const core::DistillParams p = params_of(options);
  FL_DISPATCH(device, "distill_merge",
              cpu::distill_merge(partials, world, rows, target, options.ignore_index, p, stats, loss),
              cuda::distill_merge(partials, world, rows, target, options.ignore_index,
                                  options.vocab_global, p, stats, loss, stream));
}

void linear_distillation_jsd_sums(const MatrixView& sh, const MatrixView& sw, const MatrixView& th,
                                  const MatrixView& tw, const LinearDistillationOptions& options,
                                  const DistillRowStats* stats, float* sums, Stream stream) {
  constexpr const char* kFn = "linear_distillation_jsd_sums";
  // (the soft term's sums: neither the targets nor the hard-label weight enter them)
  LinearDistillationOptions soft_only = options;
  soft_only.hard_label_weight = 0.0f;
  const LinearDistillationOptions o = check_inputs(sh, sw, th, tw, IndexView{}, soft_only);
  const int64_t n = sh.rows;
  require(o.divergence == Divergence::JSD, "options.divergence: got ", int(o.divergence),
          ", expected JSD (2) (the KL divergences are complete after distill_merge)");
  check_out(stats, n, "stats", "DistillRowStats");
  check_out(sums, 2 * n, "sums", "floats");
  detail::require_outputs_apart(
      {{sums, 2 * n * 4, "sums"}},
      {detail::span_of(sh, "student_hidden"), detail::span_of(sw, "student_weight"),
       detail::span_of(th, "teacher_hidden"), detail::span_of(tw, "teacher_weight"),
       {stats, n * int64_t(sizeof(DistillRowStats)), "stats"}});
  const core::DistillParams p = params_of(o);
  run_chunks(kFn, sh, sw, th, tw, IndexView{}, o, stream,
             [&](const MatrixView& xs, const MatrixView& xt, const IndexView&, int64_t row0,
                 [[maybe_unused]] Stream s) {
               FL_DISPATCH(xs.device, kFn,
                           cpu::distill_jsd_sums(xs, xt, p, stats + row0, sums + 2 * row0),
                           cuda::distill_jsd_sums(xs, xt, p, stats + row0, sums + 2 * row0, s));
             });
}

void distill_add_jsd(const float* sums, int64_t rows, const IndexView& target,
                     const LinearDistillationOptions& options, DistillRowStats* stats, float* loss,
                     Device device, [[maybe_unused]] Stream stream) {
  check_merge_options(options, rows, target.data != nullptr);
  require(options.divergence == Divergence::JSD, "options.divergence: got ",
          int(options.divergence), ", expected JSD (2) (the KL divergences have no second round)");
  check_out(sums, 2 * rows, "sums", "floats");
  check_out(stats, rows, "stats", "DistillRowStats");
  check_out(loss, rows, "loss", "floats");
  if (target.data) detail::check_index(target, "target", rows, device, "sums");
  detail::require_outputs_apart(
      {{stats, rows * int64_t(sizeof(DistillRowStats)), "stats"}, {loss, rows * 4, "loss"}},
      {{sums, 2 * rows * 4, "sums"}, detail::span_of(target, "target")});
  const core::DistillParams p = params_of(options);
  FL_DISPATCH(device, "distill_add_jsd",
              cpu::distill_add_jsd(sums, rows, target, options.ignore_index, p, stats, loss),
              cuda::distill_add_jsd(sums, rows, target, options.ignore_index, p, stats, loss,
                                    stream));
}

void linear_distillation_backward(const MatrixView& sh, const MatrixView& sw,
                                  const MatrixView& th, const MatrixView& tw,
                                  const IndexView& target, const DistillRowStats* stats,
                                  const float* grad_loss, const LinearDistillationOptions& options,
                                  const LinearCrossEntropyGrads& grads, Stream stream) {
  constexpr const char* kFn = "linear_distillation_backward";
  const LinearDistillationOptions o = check_inputs(sh, sw, th, tw, target, options);
  const int64_t n = sh.rows;
  check_out(stats, n, "stats", "DistillRowStats (the forward's)");
  check_out(grad_loss, n, "grad_loss", "floats");
  require(grads.dbias == nullptr, "grads.dbias: got a pointer, expected null (the distillation ",
          "loss has no bias)");
  lce::check_grads(grads, sh, sw,
                   {{stats, n * int64_t(sizeof(DistillRowStats)), "stats"},
                    {grad_loss, n * 4, "grad_loss"}, detail::span_of(target, "target"),
                    detail::span_of(th, "teacher_hidden"), detail::span_of(tw, "teacher_weight")});
  const core::DistillParams p = params_of(o);
  auto gradient = [&](const MatrixView& xs, const MatrixView& xt, const IndexView& tc,
                      int64_t row0, [[maybe_unused]] Stream s) {
    FL_DISPATCH(xs.device, kFn,
                cpu::distill_gradient(xs, xt, tc, o.vocab_start, o.ignore_index, p, stats + row0,
                                      grad_loss + row0),
                cuda::distill_gradient(xs, xt, tc, o.vocab_start, o.ignore_index, p, stats + row0,
                                       grad_loss + row0, s));
  };
  run_chunks(kFn, sh, sw, th, tw, target, o, stream, {}, gradient, grads);
}

}  // namespace fusedloss

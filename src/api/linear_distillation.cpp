// Public linear distillation entry points: validate, plan the student's chunks (api/lce_loop.h),
// and hand the chunk loop steps that compute the same rows of the teacher's logits beside them
// (a GEMM of their own) and the row math (core/distill_math.h).
#include "fusedloss/linear_distillation.h"

#include <cmath>
#include <optional>
#include "api/check.h"
#include "api/lce_loop.h"
#include "api/vocab_parallel.h"
#include "cpu/distill_cpu.h"
#include "cpu/gemm_cpu.h"
#include "cpu/matrix_cpu.h"

namespace fusedloss {

namespace {

using detail::require;

using lce::loop_options;

core::DistillParams params_of(const LinearDistillationOptions& o) {
  return {o.divergence, o.beta, 1.0f / o.temperature, o.hard_label_weight};
}

void check_inputs(const MatrixView& sh, const MatrixView& sw, const MatrixView& th,
                  const MatrixView& tw, const IndexView& target,
                  const LinearDistillationOptions& o) {
  for (auto [m, name] : {std::pair{&sh, "student_hidden"}, {&sw, "student_weight"},
                         {&th, "teacher_hidden"}, {&tw, "teacher_weight"}}) {
    detail::check_matrix(*m, name);
    require(m->device == sh.device, name, ".device: got ", to_string(m->device), ", expected ",
            to_string(sh.device), " (student_hidden's device)");
  }
  require(sh.device == Device::CPU, "student_hidden.device: got ", to_string(sh.device),
          ", expected cpu (the linear distillation loss has a CPU backend only in this version)");
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
  validate_linear_distillation_options(o, sh.rows, sw.rows, target.data != nullptr || sh.rows == 0);
  if (target.data) {
    core::CeParams p;
    p.rows = target.size;
    p.vocab_global = sw.rows;
    p.ignore_index = o.ignore_index;
    detail::check_targets_on_host(target, p, "target");
  }
}

IndexView rows_of_target(const IndexView& t, int64_t row0, int64_t rows) {
  return t.data ? lce::target_rows(t, row0, rows) : t;
}

// The teacher's logits of the student's chunk of rows, in a buffer of their own (the teacher's
// dtype) with the CPU GEMMs' fp32 stage beside it.
class TeacherChunks {
 public:
  TeacherChunks(const core::LcePlan& student, const MatrixView& hidden, const MatrixView& weight,
                const LinearDistillationOptions& o, Stream stream, const char* fn)
      : hidden_(hidden), weight_(weight), plan_(lce::make_plan(hidden, weight, loop_options(o))) {
    plan_.chunk = student.chunk;
    const size_t at = core::lce_cpu_stage_at(plan_), stage = core::lce_cpu_stage_bytes(plan_);
    memory_.emplace(hidden.device, at + stage, stream, fn);
    stage_ = cpu::GemmStage{stage ? memory_->as<float>(at / sizeof(float)) : nullptr,
                            int64_t(stage / sizeof(float))};
  }
  // The GEMM of rows [row0, row0 + rows): [rows, V] = teacher_hidden rows @ teacher_weight^T.
  MatrixView logits(int64_t row0, int64_t rows) const {
    const MatrixView out{memory_->as<char>(), rows, plan_.vocab_local, plan_.stride, plan_.dtype,
                         hidden_.device};
    cpu::gemm(cpu::rows_of(hidden_, row0, rows), false, weight_, true, out, false, stage_);
    return out;
  }

 private:
  MatrixView hidden_, weight_;
  core::LcePlan plan_;
  std::optional<vocab_parallel::Scratch> memory_;
  cpu::GemmStage stage_;
};

}  // namespace

void validate_linear_distillation_options(const LinearDistillationOptions& o, int64_t rows,
                                          int64_t vocab, bool has_target) {
  require(rows >= 0, "student_hidden.rows: got ", rows, ", expected N >= 0");
  require(vocab >= 1, "student_weight.rows: got ", vocab, ", expected V >= 1");
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
  require(o.ignore_index < 0 || o.ignore_index >= vocab, "options.ignore_index: got ",
          o.ignore_index, ", expected a value outside [0, ", vocab, ")");
  require(o.chunk_rows >= 0, "options.chunk_rows: got ", o.chunk_rows,
          ", expected 0 (from workspace_bytes) or >= 1");
  require(o.chunk_rows > 0 || o.workspace_bytes > 0,
          "options.workspace_bytes: got 0 with chunk_rows 0, expected > 0");
}

void linear_distillation_forward(const MatrixView& sh, const MatrixView& sw, const MatrixView& th,
                                 const MatrixView& tw, const IndexView& target,
                                 const LinearDistillationOptions& o, float* loss,
                                 DistillRowStats* stats, Stream stream) {
  constexpr const char* kFn = "linear_distillation_forward";
  check_inputs(sh, sw, th, tw, target, o);
  const int64_t n = sh.rows;
  require((loss != nullptr && stats != nullptr) || n == 0, "loss and stats: got null, expected ",
          n, " floats and ", n, " DistillRowStats");
  detail::require_outputs_apart(
      {{loss, n * 4, "loss"}, {stats, n * int64_t(sizeof(DistillRowStats)), "stats"}},
      {detail::span_of(sh, "student_hidden"), detail::span_of(sw, "student_weight"),
       detail::span_of(th, "teacher_hidden"), detail::span_of(tw, "teacher_weight"),
       detail::span_of(target, "target")});
  const core::LcePlan plan = lce::make_plan(sh, sw, loop_options(o));
  const TeacherChunks teacher(plan, th, tw, o, stream, kFn);
  const core::DistillParams p = params_of(o);
  core::LceSteps steps;
  steps.forward = [&](const MatrixView& logits, int64_t row0, Stream) {
    cpu::distill_forward(logits, teacher.logits(row0, logits.rows),
                         rows_of_target(target, row0, logits.rows), o.ignore_index, p,
                         loss + row0, stats + row0);
  };
  lce::run_loop(sh.device, kFn, plan, sh, sw, steps, {}, stream);
}

void linear_distillation_backward(const MatrixView& sh, const MatrixView& sw,
                                  const MatrixView& th, const MatrixView& tw,
                                  const IndexView& target, const DistillRowStats* stats,
                                  const float* grad_loss, const LinearDistillationOptions& o,
                                  const LinearCrossEntropyGrads& grads, Stream stream) {
  constexpr const char* kFn = "linear_distillation_backward";
  check_inputs(sh, sw, th, tw, target, o);
  const int64_t n = sh.rows;
  require((stats != nullptr && grad_loss != nullptr) || n == 0,
          "stats and grad_loss: got null, expected the forward's stats and ", n, " floats");
  lce::check_grads(grads, sh, sw,
                   {{stats, n * int64_t(sizeof(DistillRowStats)), "stats"},
                    {grad_loss, n * 4, "grad_loss"}, detail::span_of(target, "target"),
                    detail::span_of(th, "teacher_hidden"), detail::span_of(tw, "teacher_weight")});
  const core::LcePlan plan = lce::make_plan(sh, sw, loop_options(o));
  const TeacherChunks teacher(plan, th, tw, o, stream, kFn);
  const core::DistillParams p = params_of(o);
  core::LceSteps steps;
  steps.gradient = [&](const MatrixView& logits, int64_t row0, Stream) {
    cpu::distill_gradient(logits, teacher.logits(row0, logits.rows),
                          rows_of_target(target, row0, logits.rows), o.ignore_index, p,
                          stats + row0, grad_loss + row0);
  };
  lce::run_loop(sh.device, kFn, plan, sh, sw, steps,
                core::LceGrads{grads.dhidden, grads.dweight, grads.accumulate_dweight, false},
                stream);
}

}  // namespace fusedloss

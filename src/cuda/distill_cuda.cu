#include "cuda/distill_cuda.h"

#include "core/dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/device_error.cuh"
#include "cuda/reduce.cuh"
#include "cuda/vector_io.cuh"

namespace fusedloss::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnit = 8;  // elements of both rows per load: one 16-byte vector of a 16-bit row

// The rows' targets (data null: none, every row counts), int32 or int64 global class ids.
struct Targets {
  const void* data;
  bool wide;
  __device__ __forceinline__ int64_t at(int64_t r) const {
    return wide ? static_cast<const int64_t*>(data)[r] : int64_t(static_cast<const int32_t*>(data)[r]);
  }
  // Ignored rows count for nothing; a target outside [0, vocab) is reported (the host checks
  // host targets before the call; device targets only here) and its row's loss is NaN.
  __device__ __forceinline__ bool ignored(int64_t r, int64_t ignore_index, int64_t vocab,
                                          DeviceError* error) const {
    if (!data) return false;
    const int64_t t = at(r);
    if (t == ignore_index) return true;
    if ((t < 0 || t >= vocab) && error) report_device_error(error, kBadTarget, r, t);
    return false;
  }
};

Targets targets_of(const IndexView& t) { return {t.data, t.type == IndexType::I64}; }

// f(j, x, t) over one row pair's columns: each thread its 8-element units in increasing column
// order, then at most one element of the tail. x: the student's logit, t: the teacher's.
template <core::StorageKind KS, core::StorageKind KT, class F>
__device__ __forceinline__ void for_each_pair(const core::Elem<KS>* xs, const core::Elem<KT>* xt,
                                              int64_t cols, F&& f) {
  const int64_t units = cols / kUnit;
  for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
    float a[kUnit], b[kUnit];
    load_floats<KS, kUnit>(xs + u * kUnit, a);
    load_floats<KT, kUnit>(xt + u * kUnit, b);
#pragma unroll
    for (int e = 0; e < kUnit; ++e) f(u * kUnit + e, a[e], b[e]);
  }
  for (int64_t j = units * kUnit + threadIdx.x; j < cols; j += blockDim.x)
    f(j, core::Storage<KS>::load(xs[j]), core::Storage<KT>::load(xt[j]));
}

template <core::StorageKind K>
__device__ __forceinline__ const core::Elem<K>* row_of(const MatrixView& m, int64_t r) {
  return static_cast<const core::Elem<K>*>(m.data) + r * m.row_stride;
}

// Pass 1 of block row r over its columns, block-reduced: every thread gets the same partial.
template <core::StorageKind KS, core::StorageKind KT>
__device__ __forceinline__ core::DistillPartial row_partial(const MatrixView& xs,
                                                            const MatrixView& xt, int64_t r,
                                                            const core::DistillParams& p,
                                                            core::DistillPartial* scratch) {
  core::DistillPartial a = core::distill_empty();
  for_each_pair<KS, KT>(row_of<KS>(xs, r), row_of<KT>(xt, r), xs.cols,
                        [&](int64_t, float x, float t) {
                          core::distill_add(p, a, x, x * p.inv_t, t * p.inv_t);
                        });
  return block_reduce(
      a, [&](const core::DistillPartial& u, const core::DistillPartial& v) {
        return core::distill_combine(p, u, v);
      },
      scratch);
}

struct Sums {
  float soft, soft_student;
};

// jsd's pass 2 of block row r with the row's merged stats, block-reduced.
template <core::StorageKind KS, core::StorageKind KT>
__device__ __forceinline__ Sums row_jsd(const MatrixView& xs, const MatrixView& xt, int64_t r,
                                        const core::DistillParams& p, const DistillRowStats& st,
                                        Sums* scratch) {
  Sums s{0.0f, 0.0f};
  for_each_pair<KS, KT>(row_of<KS>(xs, r), row_of<KT>(xt, r), xs.cols,
                        [&](int64_t, float x, float t) {
                          core::distill_jsd_terms(p, x * p.inv_t - st.lse_student,
                                                   t * p.inv_t - st.lse_teacher, s.soft,
                                                   s.soft_student);
                        });
  return block_reduce(
      s, [](const Sums& u, const Sums& v) { return Sums{u.soft + v.soft, u.soft_student + v.soft_student}; },
      scratch);
}

// The raw student logit at the row's target if this shard holds it, else -inf.
template <core::StorageKind KS>
__device__ __forceinline__ float target_logit(const MatrixView& xs, int64_t r, Targets tg,
                                              int64_t vocab_start) {
  if (!tg.data) return -INFINITY;
  const int64_t local = tg.at(r) - vocab_start;
  return local >= 0 && local < xs.cols ? core::Storage<KS>::load(row_of<KS>(xs, r)[local]) : -INFINITY;
}

// One shard, the whole forward of a row: pass 1, the stats, jsd's pass 2, the loss.
template <core::StorageKind KS, core::StorageKind KT>
__global__ void __launch_bounds__(kThreads)
    rows_kernel(MatrixView xs, MatrixView xt, Targets tg, int64_t ignore_index,
                core::DistillParams p, float* loss, DistillRowStats* stats, DeviceError* error) {
  __shared__ core::DistillPartial scratch[kThreads / 32];
  __shared__ Sums sums_scratch[kThreads / 32];
  const int64_t r = blockIdx.x;
  if (tg.ignored(r, ignore_index, xs.cols, threadIdx.x == 0 ? error : nullptr)) {  // the block leaves
    if (threadIdx.x == 0) {
      loss[r] = 0.0f;
      stats[r] = DistillRowStats{0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    }
    return;
  }
  const core::DistillPartial a = row_partial<KS, KT>(xs, xt, r, p, scratch);
  DistillRowStats st = core::distill_row_stats(p, a);
  if (p.divergence == Divergence::JSD) {
    const Sums s = row_jsd<KS, KT>(xs, xt, r, p, st, sums_scratch);
    st.soft = s.soft;
    st.soft_student = s.soft_student;
  }
  if (threadIdx.x == 0) {
    stats[r] = st;
    loss[r] = core::distill_loss(p, st, target_logit<KS>(xs, r, tg, 0), tg.data != nullptr);
  }
}

template <core::StorageKind KS, core::StorageKind KT>
__global__ void __launch_bounds__(kThreads)
    partials_kernel(MatrixView xs, MatrixView xt, Targets tg, int64_t vocab_start,
                    core::DistillParams p, core::DistillPartial* partials) {
  __shared__ core::DistillPartial scratch[kThreads / 32];
  const int64_t r = blockIdx.x;
  core::DistillPartial a = row_partial<KS, KT>(xs, xt, r, p, scratch);
  if (threadIdx.x == 0) {
    a.target = target_logit<KS>(xs, r, tg, vocab_start);
    partials[r] = a;
  }
}

__global__ void merge_kernel(const core::DistillPartial* partials, int world, int64_t rows,
                             Targets tg, int64_t ignore_index, int64_t vocab_global,
                             core::DistillParams p, DistillRowStats* stats, float* loss,
                             DeviceError* error) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  if (tg.ignored(r, ignore_index, vocab_global, error)) {
    stats[r] = DistillRowStats{0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    loss[r] = 0.0f;
    return;
  }
  core::distill_merge_row(p, partials, world, rows, r, tg.data != nullptr, stats[r], loss[r]);
}

template <core::StorageKind KS, core::StorageKind KT>
__global__ void __launch_bounds__(kThreads)
    jsd_sums_kernel(MatrixView xs, MatrixView xt, core::DistillParams p,
                    const DistillRowStats* stats, float* sums) {
  __shared__ Sums scratch[kThreads / 32];
  const int64_t r = blockIdx.x;
  const Sums s = row_jsd<KS, KT>(xs, xt, r, p, stats[r], scratch);
  if (threadIdx.x == 0) sums[2 * r] = s.soft, sums[2 * r + 1] = s.soft_student;
}

__global__ void add_jsd_kernel(const float* sums, int64_t rows, Targets tg, int64_t ignore_index,
                               core::DistillParams p, DistillRowStats* stats, float* loss) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows || (tg.data && tg.at(r) == ignore_index)) return;
  stats[r].soft = sums[2 * r];
  stats[r].soft_student = sums[2 * r + 1];
  loss[r] += (1.0f - p.hard_weight) * sums[2 * r];
}

// In place over the student's row: its logits -> g dloss/dx (core::distill_grad).
template <core::StorageKind KS, core::StorageKind KT>
__global__ void __launch_bounds__(kThreads)
    gradient_kernel(MatrixView xs, MatrixView xt, Targets tg, int64_t vocab_start,
                    int64_t ignore_index, core::DistillParams p, const DistillRowStats* stats,
                    const float* grad_loss) {
  const int64_t r = blockIdx.x;
  auto* row = static_cast<core::Elem<KS>*>(xs.data) + r * xs.row_stride;
  const auto* trow = row_of<KT>(xt, r);
  const int64_t tgt = tg.data ? tg.at(r) : -1;
  const bool ignored = tg.data && tgt == ignore_index;
  const float g = ignored ? 0.0f : grad_loss ? grad_loss[r] : 1.0f;
  const DistillRowStats st = stats[r];
  auto grad = [&](int64_t j, float x, float t) {
    return ignored ? 0.0f : core::distill_grad(p, st, x, t * p.inv_t, vocab_start + j == tgt, g);
  };
  const int64_t units = xs.cols / kUnit;
  constexpr int W = vector_width<core::Elem<KS>>();
  for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
    float a[kUnit], b[kUnit];
    load_floats<KS, kUnit>(row + u * kUnit, a);
    load_floats<KT, kUnit>(trow + u * kUnit, b);
#pragma unroll
    for (int v = 0; v < kUnit / W; ++v) {
      Vec16 out;
#pragma unroll
      for (int e = 0; e < W; ++e) put<KS>(out, e, grad(u * kUnit + v * W + e, a[v * W + e], b[v * W + e]));
      store_vec(row + u * kUnit + v * W, out);
    }
  }
  for (int64_t j = units * kUnit + threadIdx.x; j < xs.cols; j += blockDim.x)
    row[j] = core::Storage<KS>::store(
        grad(j, core::Storage<KS>::load(row[j]), core::Storage<KT>::load(trow[j])));
}

void require_rows_aligned(const MatrixView& x, const char* fn) {
  const int64_t es = detail::element_size(x.dtype);
  detail::require(reinterpret_cast<uintptr_t>(x.data) % kVectorBytes == 0 &&
                      (x.row_stride * es) % kVectorBytes == 0,
                  fn, ": internal: a chunk buffer's rows are not on 16-byte boundaries");
}

// f(KS, KT) for the two buffers' storage kinds, after the alignment checks.
template <class F>
void with_kinds(const MatrixView& xs, const MatrixView& xt, const char* fn, F&& f) {
  require_rows_aligned(xs, fn);
  require_rows_aligned(xt, fn);
  core::dispatch_dtype(xs.dtype, [&](auto ks) {
    core::dispatch_dtype(xt.dtype, [&](auto kt) { f(ks, kt); });
  });
}

unsigned blocks_for(int64_t rows) { return unsigned((rows + 255) / 256); }

}  // namespace

void distill_rows(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                  int64_t ignore_index, const core::DistillParams& p, float* loss,
                  DistillRowStats* stats, Stream stream) {
  if (xs.rows == 0) return;
  with_kinds(xs, xt, "distill_rows", [&](auto ks, auto kt) {
    rows_kernel<decltype(ks)::value, decltype(kt)::value>
        <<<unsigned(xs.rows), kThreads, 0, as_cuda(stream)>>>(xs, xt, targets_of(target),
                                                              ignore_index, p, loss, stats,
                                                              device_error_word());
    FL_CUDA_CHECK_LAUNCH();
  });
}

void distill_partials(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                      int64_t vocab_start, const core::DistillParams& p,
                      core::DistillPartial* partials, Stream stream) {
  if (xs.rows == 0) return;
  with_kinds(xs, xt, "distill_partials", [&](auto ks, auto kt) {
    partials_kernel<decltype(ks)::value, decltype(kt)::value>
        <<<unsigned(xs.rows), kThreads, 0, as_cuda(stream)>>>(xs, xt, targets_of(target),
                                                              vocab_start, p, partials);
    FL_CUDA_CHECK_LAUNCH();
  });
}

void distill_merge(const core::DistillPartial* partials, int world, int64_t rows,
                   const IndexView& target, int64_t ignore_index, int64_t vocab_global,
                   const core::DistillParams& p, DistillRowStats* stats, float* loss,
                   Stream stream) {
  if (rows == 0) return;
  merge_kernel<<<blocks_for(rows), 256, 0, as_cuda(stream)>>>(
      partials, world, rows, targets_of(target), ignore_index, vocab_global, p, stats, loss,
      device_error_word());
  FL_CUDA_CHECK_LAUNCH();
}

void distill_jsd_sums(const MatrixView& xs, const MatrixView& xt, const core::DistillParams& p,
                      const DistillRowStats* stats, float* sums, Stream stream) {
  if (xs.rows == 0) return;
  with_kinds(xs, xt, "distill_jsd_sums", [&](auto ks, auto kt) {
    jsd_sums_kernel<decltype(ks)::value, decltype(kt)::value>
        <<<unsigned(xs.rows), kThreads, 0, as_cuda(stream)>>>(xs, xt, p, stats, sums);
    FL_CUDA_CHECK_LAUNCH();
  });
}

void distill_add_jsd(const float* sums, int64_t rows, const IndexView& target,
                     int64_t ignore_index, const core::DistillParams& p, DistillRowStats* stats,
                     float* loss, Stream stream) {
  if (rows == 0) return;
  add_jsd_kernel<<<blocks_for(rows), 256, 0, as_cuda(stream)>>>(
      sums, rows, targets_of(target), ignore_index, p, stats, loss);
  FL_CUDA_CHECK_LAUNCH();
}

void distill_gradient(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                      int64_t vocab_start, int64_t ignore_index, const core::DistillParams& p,
                      const DistillRowStats* stats, const float* grad_loss, Stream stream) {
  if (xs.rows == 0) return;
  with_kinds(xs, xt, "distill_gradient", [&](auto ks, auto kt) {
    gradient_kernel<decltype(ks)::value, decltype(kt)::value>
        <<<unsigned(xs.rows), kThreads, 0, as_cuda(stream)>>>(
            xs, xt, targets_of(target), vocab_start, ignore_index, p, stats, grad_loss);
    FL_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace fusedloss::cuda

// CUDA cross-entropy: the passes of src/core/cross_entropy_math.h. The row passes (stats,
// backward) run under the RowPerBlock launch policy, the O(rows) passes under RowPerThread.
//
// Bytes: the stats pass reads the logits once, the backward reads once and writes once:
// 3 passes over [rows, V_local], the floor. Everything else is O(rows).
#include "cuda/cross_entropy_cuda.h"

#include "core/dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/device_error.cuh"
#include "cuda/reduce.cuh"
#include "cuda/vector_io.cuh"

namespace fusedloss::cuda {
namespace {

using core::CeParams;
using core::StorageKind;
using core::TargetKind;

// The row passes' tuning knobs, at build time to compare variants (bench/ce_variants.sh); the
// defaults are the best measured on an H200 (bench/NOTES.md): the read-only stats pass likes
// more, smaller blocks; the read+write backward likes 8 loads in flight per thread.
#ifndef FUSEDLOSS_CE_FWD_THREADS
#define FUSEDLOSS_CE_FWD_THREADS 256
#endif
#ifndef FUSEDLOSS_CE_FWD_UNROLL
#define FUSEDLOSS_CE_FWD_UNROLL 8
#endif
#ifndef FUSEDLOSS_CE_BWD_THREADS
#define FUSEDLOSS_CE_BWD_THREADS 512
#endif
#ifndef FUSEDLOSS_CE_BWD_UNROLL
#define FUSEDLOSS_CE_BWD_UNROLL 8
#endif
// Two 512-thread backward blocks per SM (64 registers a thread): without the cap the row
// walk's last step (every load of it in flight) costs some variants an occupancy step.
#ifndef FUSEDLOSS_CE_BWD_MIN_BLOCKS
#define FUSEDLOSS_CE_BWD_MIN_BLOCKS 2
#endif

// Launch policy of the row passes: one block of kThreads threads per row (the grid is the
// rows), walking it with walk_row, kUnroll 16-byte loads in flight per thread. A row's
// statistics are then one block reduction, with no second pass over blocks.
template <int kThreads_, int kUnroll_, int kMinBlocks_ = 1>
struct RowPerBlock {
  static constexpr int kThreads = kThreads_;
  static constexpr int kUnroll = kUnroll_;
  static constexpr int kMinBlocks = kMinBlocks_;  // resident blocks per SM: a register cap
  static_assert(kThreads % 32 == 0, "whole warps");
  __device__ static int64_t row() { return blockIdx.x; }
  static dim3 grid(int64_t rows) {
    detail::require(rows <= int64_t(INT32_MAX), "logits.rows: got ", rows, ", expected <= ",
                    INT32_MAX, " (one CUDA block per row)");
    return dim3(unsigned(rows));
  }
};
using FwdRows = RowPerBlock<FUSEDLOSS_CE_FWD_THREADS, FUSEDLOSS_CE_FWD_UNROLL>;
using BwdRows = RowPerBlock<FUSEDLOSS_CE_BWD_THREADS, FUSEDLOSS_CE_BWD_UNROLL,
                            FUSEDLOSS_CE_BWD_MIN_BLOCKS>;

// Launch policy of the O(rows) passes (merge, all-reduce preparation): one thread per row.
struct RowPerThread {
  static constexpr int kThreads = 256;
  __device__ static int64_t row() { return blockIdx.x * int64_t(blockDim.x) + threadIdx.x; }
  static dim3 grid(int64_t rows) { return dim3(unsigned((rows + kThreads - 1) / kThreads)); }
};

template <class Index>
__device__ __forceinline__ TargetKind classify(const Index* target, int64_t r, const CeParams& p,
                                               int64_t* t) {
  *t = int64_t(target[r]);
  return core::classify_target(*t, p.ignore_index, p.vocab_start, p.vocab_local, p.vocab_global);
}

// A thread's share of a row: max, sum of exp(x - max), sum of x; merged in a block reduction.
struct RowPart {
  float m, s, sx;
};
struct MergeParts {
  __device__ __forceinline__ RowPart operator()(RowPart a, const RowPart& b) const {
    core::online_merge(a.m, a.s, b.m, b.s);
    a.sx += b.sx;
    return a;
  }
};

// Pass 1: per-row max, sum-exp, target logit and (with smoothing) sum of logits.
// kFinish (TP=1): the stats are already global, so the row's lse and loss are written here
// and no merge pass follows.
// The logit soft-cap (linear cross-entropy) as a compile-time choice: the plain cross-entropy's
// kernels keep their registers (a runtime branch cost ~10 per thread and an occupancy step).
template <bool kCap>
__device__ __forceinline__ float capped(float x, float cap) {
  if constexpr (kCap) {
    return core::cap_logit(x, cap);
  } else {
    return x;
  }
}

template <StorageKind K, class Index, bool kSumLogits, bool kFinish, bool kCap>
__global__ void __launch_bounds__(FwdRows::kThreads, FwdRows::kMinBlocks) stats_kernel(const typename core::Storage<K>::type* x,
                                                         int64_t row_stride, const Index* target,
                                                         CeParams p, RowStats* stats,
                                                         float* lse_out, float* row_loss_out) {
  using S = core::Storage<K>;
  using T = typename S::type;
  constexpr int VEC = vector_width<T>();
  __shared__ RowPart scratch[FwdRows::kThreads / 32];
  const int64_t r = FwdRows::row();
  const T* row = x + r * row_stride;
  float m = -INFINITY, s = 0.0f, sx = 0.0f;
  walk_row<T, FwdRows::kThreads, FwdRows::kUnroll>(
      row, p.vocab_local, true,
      [&](int64_t, T bits) {
        float v = capped<kCap>(S::load(bits), p.softcap);
        core::online_add(m, s, v);
        if (kSumLogits) sx += v;
      },
      [&](int64_t, const Vec16& raw) {
        float v[VEC];
        to_floats<K>(raw, v);
        if constexpr (kCap) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) v[k] = core::cap_logit(v[k], p.softcap);
        }
        core::online_add_chunk<VEC>(m, s, v);
        if (kSumLogits) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) sx += v[k];
        }
      });
  const RowPart row_part = block_reduce(RowPart{m, s, sx}, MergeParts{}, scratch);
  m = row_part.m, s = row_part.s, sx = row_part.sx;
  if (threadIdx.x == 0) {
    int64_t t;
    TargetKind kind = classify(target, r, p, &t);
    if (kind == TargetKind::OutOfRange) report_bad_target(r, t);
    float tl = kind == TargetKind::Local ? capped<kCap>(S::load(row[t - p.vocab_start]), p.softcap)
                                          : -INFINITY;
    if constexpr (kFinish) {
      core::finish_row(RowStats{m, s, tl, sx}, sx, kind, p, lse_out[r], row_loss_out[r]);
    } else {
      stats[r] = RowStats{m, s, tl, sx};
    }
  }
}

// All-reduce form: rescale to the global max so that a SUM over ranks merges.
template <class Index>
__global__ void prepare_sum_kernel(const RowStats* local, const float* global_max,
                                   const Index* target, CeParams p, int rank,
                                   RowStats* summable) {
  const int64_t r = RowPerThread::row();
  if (r >= p.rows) return;
  int64_t t;
  bool owner = classify(target, r, p, &t) == TargetKind::Local;
  summable[r] = core::summable_row(local[r], global_max[r], owner, rank);
}

__global__ void extract_max_kernel(const RowStats* stats, int64_t rows, float* maxima) {
  const int64_t r = RowPerThread::row();
  if (r < rows) maxima[r] = stats[r].max;
}

// Pass 2: merge the parts of each row; per-row loss and lse.
template <class Index>
__global__ void merge_kernel(const RowStats* combined, int parts, const RowStats* local,
                             const Index* target, CeParams p, float* lse_out,
                             float* row_loss_out) {
  const int64_t r = RowPerThread::row();
  if (r >= p.rows) return;
  int64_t t;
  core::finish_row(core::merge_row(combined, parts, p.rows, r),
                   core::own_sum_logits(local, r, p),
                   classify(target, r, p, &t), p, lse_out[r], row_loss_out[r]);
}

// Deterministic sum / mean over rows and the non-ignored count: one block, fixed order,
// double accumulation.
constexpr int kReduceThreads = 1024;
struct LossCount {
  double sum;
  long long count;
};
struct AddLossCount {
  __device__ __forceinline__ LossCount operator()(const LossCount& a, const LossCount& b) const {
    return {a.sum + b.sum, a.count + b.count};
  }
};
template <class Index>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_kernel(const float* row_loss, const Index* target, CeParams p, float* loss_out,
                  float* count_out) {
  __shared__ LossCount scratch[kReduceThreads / 32];
  LossCount mine{0.0, 0};
  for (int64_t r = threadIdx.x; r < p.rows; r += kReduceThreads) {
    if (int64_t(target[r]) == p.ignore_index) continue;
    mine.sum += row_loss ? row_loss[r] : 0.0f;
    ++mine.count;
  }
  const LossCount all = block_reduce(mine, AddLossCount{}, scratch);
  if (threadIdx.x == 0) {
    if (count_out) *count_out = float(all.count);
    if (p.reduction == Reduction::Sum) *loss_out = float(all.sum);
    if (p.reduction == Reduction::Mean)
      *loss_out = all.count ? float(all.sum / double(all.count)) : 0.0f;
  }
}

// Backward: g_j = dL (p_j (1 + 2 z lse) - (1 - a)[j == target] - a / K), one read, one write.
template <bool kCap>
__device__ __forceinline__ float grad_at(const core::GradRow& g, float x, bool is_target,
                                         float cap) {
  if constexpr (kCap) {
    return core::capped_grad_element(g, x, is_target, cap);
  } else {
    return core::grad_element(g, x, is_target);
  }
}

// fp32 logits with the soft-cap need more than 64 registers a thread without spills: one
// block per SM there.
template <StorageKind K, bool kCap>
constexpr int bwd_min_blocks() {
  return kCap && K == StorageKind::F32 ? 1 : BwdRows::kMinBlocks;
}

template <StorageKind K, class Index, bool kCap>
__global__ void __launch_bounds__(BwdRows::kThreads, bwd_min_blocks<K, kCap>())
    backward_kernel(const typename core::Storage<K>::type* x, int64_t x_stride,
                    typename core::Storage<K>::type* g, int64_t g_stride, const Index* target,
                    const float* lse, const float* grad_loss, const float* valid_count,
                    CeParams p) {
  using S = core::Storage<K>;
  using T = typename S::type;
  constexpr int VEC = vector_width<T>();
  const int64_t r = BwdRows::row();
  const T* xr = x + r * x_stride;
  T* gr = g + r * g_stride;
  int64_t t;
  TargetKind kind = classify(target, r, p, &t);
  float dl = p.reduction == Reduction::None ? grad_loss[r]
             : p.reduction == Reduction::Sum ? grad_loss[0]
                                             : grad_loss[0] / fmaxf(valid_count[0], 1.0f);
  // Ignored rows get 0 and out-of-range rows NaN, whatever the logits hold.
  const bool constant = kind == TargetKind::Ignored || kind == TargetKind::OutOfRange;
  const float fill = kind == TargetKind::Ignored ? 0.0f : NAN;
  core::GradRow gr_c = core::make_grad_row(lse[r], dl, p.smoothing, p.z_loss);
  const int64_t local_t = kind == TargetKind::Local ? t - p.vocab_start : -1;
  const bool same_alignment =
      reinterpret_cast<uintptr_t>(xr) % 16 == reinterpret_cast<uintptr_t>(gr) % 16;
  // In place (g == x) every column is read before it is written, by the same thread.
  walk_row<T, BwdRows::kThreads, BwdRows::kUnroll>(
      xr, p.vocab_local, same_alignment,
      [&](int64_t j, T bits) {
        gr[j] = S::store(constant ? fill : grad_at<kCap>(gr_c, S::load(bits), j == local_t, p.softcap));
      },
      [&](int64_t j, const Vec16& raw) {
        Vec16 out{};
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          put<K>(out, k,
                 constant ? fill : grad_at<kCap>(gr_c, get<K>(raw, k), j + k == local_t, p.softcap));
        store_vec(gr + j, out);
      });
}

template <class F>
void dispatch_all(DType dtype, IndexType itype, F&& f) {
  core::dispatch_dtype(dtype, [&](auto k) {
    core::dispatch_index(itype, [&](auto idx) { f(k, idx); });
  });
}

template <bool kFinish>
void launch_stats(const MatrixView& logits, const IndexView& target, const CeParams& p,
                  RowStats* stats, float* lse, float* row_loss, Stream stream) {
  const dim3 grid = FwdRows::grid(logits.rows);
  dispatch_all(logits.dtype, target.type, [&](auto k, auto idx) {
    constexpr StorageKind K = decltype(k)::value;
    using Index = decltype(idx);
    using T = typename core::Storage<K>::type;
    auto* x = static_cast<const T*>(logits.data);
    auto* t = static_cast<const Index*>(target.data);
    auto launch = [&](auto sum_logits, auto cap) {
      stats_kernel<K, Index, decltype(sum_logits)::value, kFinish, decltype(cap)::value>
          <<<grid, FwdRows::kThreads, 0, as_cuda(stream)>>>(x, logits.row_stride, t, p, stats, lse,
                                                      row_loss);
    };
    using Yes = std::true_type;
    using No = std::false_type;
    const bool cap = p.softcap > 0.0f;
    if (p.need_sum_logits)
      cap ? launch(Yes{}, Yes{}) : launch(Yes{}, No{});
    else
      cap ? launch(No{}, Yes{}) : launch(No{}, No{});
    FL_CUDA_CHECK_LAUNCH();
  });
}

template <class Index>
void launch_reduce(const float* row_losses, const Index* t, const CeParams& p,
                   const CrossEntropyOutputs& out, Stream stream) {
  reduce_kernel<<<1, kReduceThreads, 0, as_cuda(stream)>>>(row_losses, t, p, out.loss,
                                                           out.valid_count);
  FL_CUDA_CHECK_LAUNCH();
}

}  // namespace

void ce_local_stats(const MatrixView& logits, const IndexView& target, const CeParams& p,
                    RowStats* stats, Stream stream) {
  if (logits.rows == 0) return;
  launch_stats<false>(logits, target, p, stats, nullptr, nullptr, stream);
}

void ce_forward_tp1(const MatrixView& logits, const IndexView& target, const CeParams& p,
                    const CrossEntropyOutputs& out, Stream stream) {
  const bool reduce = p.reduction != Reduction::None;
  float* row_losses = reduce ? static_cast<float*>(alloc_async(sizeof(float) * p.rows, stream))
                             : out.loss;
  if (p.rows > 0) launch_stats<true>(logits, target, p, nullptr, out.lse, row_losses, stream);
  if (reduce || out.valid_count) {
    core::dispatch_index(target.type, [&](auto idx) {
      using Index = decltype(idx);
      launch_reduce(row_losses, static_cast<const Index*>(target.data), p, out, stream);
    });
  }
  if (reduce) free_async(row_losses, stream);
}

void ce_extract_max(const RowStats* stats, int64_t rows, float* maxima, Stream stream) {
  if (rows == 0) return;
  extract_max_kernel<<<RowPerThread::grid(rows), RowPerThread::kThreads, 0, as_cuda(stream)>>>(
      stats, rows, maxima);
  FL_CUDA_CHECK_LAUNCH();
}

void ce_prepare_sum(const RowStats* local, const float* global_max, const IndexView& target,
                    const CeParams& p, int rank, RowStats* summable, Stream stream) {
  if (p.rows == 0) return;
  core::dispatch_index(target.type, [&](auto idx) {
    using Index = decltype(idx);
    prepare_sum_kernel<<<RowPerThread::grid(p.rows), RowPerThread::kThreads, 0, as_cuda(stream)>>>(
        local, global_max, static_cast<const Index*>(target.data), p, rank, summable);
    FL_CUDA_CHECK_LAUNCH();
  });
}

void ce_merge(const RowStats* combined, int parts, const RowStats* local, const IndexView& target,
              const CeParams& p, const CrossEntropyOutputs& out, Stream stream) {
  const bool reduce = p.reduction != Reduction::None;
  // Per-row losses land in out.loss for None, else in scratch that the reduction reads.
  float* row_losses = reduce ? static_cast<float*>(alloc_async(sizeof(float) * p.rows, stream))
                             : out.loss;
  core::dispatch_index(target.type, [&](auto idx) {
    using Index = decltype(idx);
    auto* t = static_cast<const Index*>(target.data);
    if (p.rows > 0) {
      merge_kernel<<<RowPerThread::grid(p.rows), RowPerThread::kThreads, 0, as_cuda(stream)>>>(
          combined, parts, local, t, p, out.lse, row_losses);
      FL_CUDA_CHECK_LAUNCH();
    }
    if (reduce || out.valid_count) launch_reduce(row_losses, t, p, out, stream);
  });
  if (reduce) free_async(row_losses, stream);
}

void ce_reduce(const float* row_losses, const IndexView& target, const CeParams& p,
               const CrossEntropyOutputs& out, Stream stream) {
  core::dispatch_index(target.type, [&](auto idx) {
    using Index = decltype(idx);
    launch_reduce(row_losses, static_cast<const Index*>(target.data), p, out, stream);
  });
}

void ce_backward(const MatrixView& logits, const IndexView& target, const float* lse,
                 const float* grad_loss, const float* valid_count, const CeParams& p,
                 const MatrixView& grad, Stream stream) {
  if (logits.rows == 0) return;
  const dim3 grid = BwdRows::grid(logits.rows);
  dispatch_all(logits.dtype, target.type, [&](auto k, auto idx) {
    constexpr StorageKind K = decltype(k)::value;
    using Index = decltype(idx);
    using T = typename core::Storage<K>::type;
    auto launch = [&](auto cap) {
      backward_kernel<K, Index, decltype(cap)::value>
          <<<grid, BwdRows::kThreads, 0, as_cuda(stream)>>>(
              static_cast<const T*>(logits.data), logits.row_stride, static_cast<T*>(grad.data),
              grad.row_stride, static_cast<const Index*>(target.data), lse, grad_loss,
              valid_count, p);
    };
    if (p.softcap > 0.0f)
      launch(std::true_type{});
    else
      launch(std::false_type{});
    FL_CUDA_CHECK_LAUNCH();
  });
}

void check_device_errors(Stream stream) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    return;  // no GPU, so no kernel could have reported anything
  }
  DeviceError host{};
  FL_CUDA_CHECK(cudaMemcpyFromSymbolAsync(&host, g_device_error, sizeof(host), 0,
                                          cudaMemcpyDeviceToHost, as_cuda(stream)));
  FL_CUDA_CHECK(cudaStreamSynchronize(as_cuda(stream)));
  if (!host.flag) return;
  DeviceError clear{};
  FL_CUDA_CHECK(cudaMemcpyToSymbolAsync(g_device_error, &clear, sizeof(clear), 0,
                                        cudaMemcpyHostToDevice, as_cuda(stream)));
  FL_CUDA_CHECK(cudaStreamSynchronize(as_cuda(stream)));
  detail::fail("target[", host.row, "]: got ", host.value,
               ", expected in [0, vocab_global) or ignore_index (reported by the CUDA kernels; "
               "that row's loss is NaN)");
}

}  // namespace fusedloss::cuda

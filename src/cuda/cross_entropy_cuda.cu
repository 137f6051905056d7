// CUDA cross-entropy: the passes of src/core/cross_entropy_math.h. The row passes (stats,
// backward) run under the RowPerBlock launch policy, the O(rows) passes under RowPerThread.
//
// Bytes: the stats pass reads the logits once, the backward reads once and writes once:
// 3 passes over [rows, V_local], the floor. Everything else is O(rows).
#include "cuda/cross_entropy_cuda.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/dispatch.h"
#include "core/row_weight.h"
#include "cuda/bulk_copy.cuh"
#include "cuda/cuda_check.h"
#define FUSEDLOSS_DEFINE_DEVICE_ERROR
#include "cuda/device_error.cuh"
#include "cuda/reduce.cuh"
#include "cuda/runtime.h"
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
// Three stats blocks per SM (at most 85 registers a thread): left free, the compiler spends
// registers on more exponentials in flight and the stats pass loses an occupancy step.
#ifndef FUSEDLOSS_CE_FWD_MIN_BLOCKS
#define FUSEDLOSS_CE_FWD_MIN_BLOCKS 3
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

// The forward that writes the gradient (stats_grad_kernel): 256 threads with 4 loads in flight
// each, three blocks per SM (at most 85 registers a thread, no spills), each keeping up to a
// third of the SM's shared memory of its row between the passes: the best of the launch shapes
// measured on an H200 (bench/NOTES.md).
#ifndef FUSEDLOSS_CE_FUSED_THREADS
#define FUSEDLOSS_CE_FUSED_THREADS 256
#endif
#ifndef FUSEDLOSS_CE_FUSED_UNROLL
#define FUSEDLOSS_CE_FUSED_UNROLL 4
#endif
#ifndef FUSEDLOSS_CE_FUSED_BLOCKS_PER_SM
#define FUSEDLOSS_CE_FUSED_BLOCKS_PER_SM 3
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
using FwdRows = RowPerBlock<FUSEDLOSS_CE_FWD_THREADS, FUSEDLOSS_CE_FWD_UNROLL,
                            FUSEDLOSS_CE_FWD_MIN_BLOCKS>;
using BwdRows = RowPerBlock<FUSEDLOSS_CE_BWD_THREADS, FUSEDLOSS_CE_BWD_UNROLL,
                            FUSEDLOSS_CE_BWD_MIN_BLOCKS>;
using FusedRows = RowPerBlock<FUSEDLOSS_CE_FUSED_THREADS, FUSEDLOSS_CE_FUSED_UNROLL,
                              FUSEDLOSS_CE_FUSED_BLOCKS_PER_SM>;

// Launch policy of cluster_grad_kernel: kThreads threads a block, one block per slice of a row,
// a cluster of at most kMaxCluster blocks per row (the portable cluster size), each slice at
// most kSliceBytes where the row allows (small slices: more resident blocks per SM, so one
// block's copies overlap another's arithmetic).
#ifndef FUSEDLOSS_CE_CLUSTER_SLICE_BYTES
#define FUSEDLOSS_CE_CLUSTER_SLICE_BYTES (48 * 1024)
#endif
struct ClusterRows {
  static constexpr int kThreads = 256;
  static constexpr int kMaxCluster = 8;
  static constexpr int64_t kSliceBytes = FUSEDLOSS_CE_CLUSTER_SLICE_BYTES;
};

// Launch policy of the kernels whose blocks outlive a row (a row cache in shared memory set up
// once, an early exit for the whole launch): a bounded grid, each block striding over rows.
struct StridedRows {
  __device__ static int64_t first() { return blockIdx.x; }
  __device__ static int64_t stride() { return gridDim.x; }
  static unsigned grid(int64_t rows, int64_t most) {
    return unsigned(std::max<int64_t>(std::min(rows, most), 1));
  }
};

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

// The agreement's checksum of the targets (and row weights) added into *out (a wrapping
// uint64 sum: the same bits in any order, so the blocks' atomic adds are deterministic).
template <class Index>
struct TargetTerm {
  const Index* target;
  __device__ uint64_t operator()(int64_t r) const {
    return core::target_checksum_term(int64_t(target[r]), r);
  }
};

struct RowWeightTerm {
  const float* weight;
  int64_t rows;
  __device__ uint64_t operator()(int64_t r) const {
    return core::row_weight_checksum_term(weight[r], r, rows);
  }
};

// *out += the sum over rows of term(r) (wrapping; the order does not matter).
template <class Term>
__global__ void __launch_bounds__(256) checksum_kernel(Term term, int64_t rows,
                                                       unsigned long long* out) {
  __shared__ unsigned long long part[8];
  unsigned long long s = 0;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows;
       r += int64_t(gridDim.x) * blockDim.x)
    s += term(r);
  for (int o = 16; o > 0; o /= 2) s += __shfl_down_sync(0xffffffffu, s, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long total = 0;
    for (int w = 0; w < int(blockDim.x / 32); ++w) total += part[w];
    atomicAdd(out, total);
  }
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

// The target's place in the vector at column j: 0..VEC-1, or -1 when it is elsewhere; one
// 64-bit comparison per vector instead of one per element.
template <int VEC>
__device__ __forceinline__ int target_in_vector(int64_t local_t, int64_t j) {
  const int64_t d = local_t - j;
  return d >= 0 && d < VEC ? int(d) : -1;
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

// The gradient of one 16-byte vector of a row, tk the target's place in it (-1: elsewhere).
// Where `fma` (the caller's per-row core::fma_exponent, false for soft-capped logits) and the
// target is elsewhere, fast(x) gives every element (the one-fma exponent: nothing compared per
// element); otherwise exact(x, is_target) does.
template <StorageKind K, class Fast, class Exact>
__device__ __forceinline__ Vec16 grad_vector(const Vec16& raw, int tk, bool fma, Fast fast,
                                             Exact exact) {
  constexpr int VEC = vector_width<typename core::Storage<K>::type>();
  Vec16 out{};
  if (fma && tk < 0) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) put<K>(out, k, fast(get<K>(raw, k)));
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) put<K>(out, k, exact(get<K>(raw, k), k == tk));
  }
  return out;
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
  const float dl = core::row_grad_scale(p, grad_loss, valid_count, r);
  // Ignored rows get 0 and out-of-range rows NaN, whatever the logits hold.
  const bool constant = kind == TargetKind::Ignored || kind == TargetKind::OutOfRange;
  const float fill = kind == TargetKind::Ignored ? 0.0f : NAN;
  core::GradRow gr_c = core::make_grad_row(lse[r], dl, p.smoothing, p.z_loss);
  // The one-fma exponent (core::softmax_p) for plain logits; the soft-capped ones keep theirs.
  const bool fma = !kCap && core::fma_exponent(gr_c);
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
        store_vec(gr + j, grad_vector<K>(
                              raw, target_in_vector<VEC>(local_t, j), fma,
                              [&](float x) { return constant ? fill : core::grad_element<true>(gr_c, x, false); },
                              [&](float x, bool is_target) {
                                return constant ? fill : grad_at<kCap>(gr_c, x, is_target, p.softcap);
                              }));
      });
}

// A thread's share of a row in the fused kernel: RowPart plus the target logit, which the
// thread whose columns hold the target picks up in pass 1 (-inf elsewhere; the max merges it).
struct RowPartT {
  RowPart part;
  float target_logit;
};
struct MergePartsT {
  __device__ __forceinline__ RowPartT operator()(RowPartT a, const RowPartT& b) const {
    a.part = MergeParts{}(a.part, b.part);
    a.target_logit = fmaxf(a.target_logit, b.target_logit);
    return a;
  }
};

// The forward that writes the gradient (TP=1, Sum/Mean). A resident grid of blocks strides
// over the rows; per row, pass 1 is the stats pass of stats_kernel<kFinish>, which also keeps
// the first `cache_vecs` 16-byte vectors of the row's body in shared memory, and pass 2 is
// backward_kernel's for a unit upstream gradient (over the valid count for Mean), reading
// those vectors from shared memory and the rest of a longer row from global memory again (L2
// hits). A row that fits the cache is read from memory once and written once.
// Few blocks fit an SM beside their caches, so nothing may wait on memory in series: the
// target logit comes with pass 1 (not a load after the target's), and the next row's target
// is read during pass 2. (A bulk L2 prefetch of each block's next row, measured, did not pay.)
// g is x (in place) or a buffer whose rows start at the same 16-byte alignment as x's.
template <StorageKind K, class Index, bool kSumLogits>
__global__ void __launch_bounds__(FusedRows::kThreads, FusedRows::kMinBlocks)
    stats_grad_kernel(const typename core::Storage<K>::type* x, int64_t x_stride,
                      typename core::Storage<K>::type* g, int64_t g_stride, const Index* target,
                      CeParams p, int64_t cache_vecs, const float* valid_count, float* lse_out,
                      float* row_loss_out) {
  using S = core::Storage<K>;
  using T = typename S::type;
  constexpr int VEC = vector_width<T>();
  extern __shared__ Vec16 cache[];
  __shared__ RowPartT scratch[FusedRows::kThreads / 32];
  const int64_t n = p.vocab_local;
  const float unit = core::row_grad_scale(p, nullptr, valid_count, 0);  // the same for every row
  int64_t r = StridedRows::first();
  if (r >= p.rows) return;
  int64_t t = int64_t(target[r]);
  for (; r < p.rows; r += StridedRows::stride()) {
    const T* xr = x + r * x_stride;
    T* gr = g + r * g_stride;
    const TargetKind kind =
        core::classify_target(t, p.ignore_index, p.vocab_start, p.vocab_local, p.vocab_global);
    const int64_t local_t = kind == TargetKind::Local ? t - p.vocab_start : -1;
    const int64_t head = head_to_alignment(xr, n);

    float m = -INFINITY, s = 0.0f, sx = 0.0f, tl = -INFINITY;
    walk_row<T, FusedRows::kThreads, FusedRows::kUnroll>(
        xr, n, true,
        [&](int64_t j, T bits) {
          const float v = S::load(bits);
          core::online_add(m, s, v);
          if (kSumLogits) sx += v;
          if (j == local_t) tl = v;
        },
        [&](int64_t j, const Vec16& raw) {
          const int64_t i = (j - head) / VEC;
          if (i < cache_vecs) cache[i] = raw;
          float v[VEC];
          to_floats<K>(raw, v);
          core::online_add_chunk<VEC>(m, s, v);
          if (kSumLogits) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) sx += v[k];
          }
          const int tk = target_in_vector<VEC>(local_t, j);
          if (tk >= 0) {
#pragma unroll
            for (int k = 0; k < VEC; ++k)
              if (k == tk) tl = v[k];
          }
        });
    // A barrier: the cached vectors are all in before pass 2 reads them.
    const RowPartT row = block_reduce(RowPartT{RowPart{m, s, sx}, tl}, MergePartsT{}, scratch);
    const float lse = row.part.m + logf(row.part.s);  // finish_row's lse, bit for bit
    const int64_t next = r + StridedRows::stride();
    const int64_t t_next = next < p.rows ? int64_t(target[next]) : 0;  // in flight over pass 2
    if (threadIdx.x == 0) {
      if (kind == TargetKind::OutOfRange) report_bad_target(r, t);
      core::finish_row(RowStats{row.part.m, row.part.s, row.target_logit, row.part.sx},
                       row.part.sx, kind, p, lse_out[r], row_loss_out[r]);
    }

    auto cached = [&](const T* body, int64_t i) {
      return i < cache_vecs ? cache[i] : load_vec(body + i * VEC);
    };
    if (kind == TargetKind::Ignored || kind == TargetKind::OutOfRange) {  // the whole block
      const float fill = kind == TargetKind::Ignored ? 0.0f : NAN;
      Vec16 filled{};
#pragma unroll
      for (int k = 0; k < VEC; ++k) put<K>(filled, k, fill);
      walk_row_from<T, FusedRows::kThreads, FusedRows::kUnroll>(
          xr, n, true, cached, [&](int64_t j, T) { gr[j] = S::store(fill); },
          [&](int64_t j, const Vec16&) { store_vec(gr + j, filled); });
    } else {
      const core::GradRow gc = core::make_grad_row(lse, unit, p.smoothing, p.z_loss);
      const bool fma = core::fma_exponent(gc);
      auto fast = [&](float x) { return core::grad_element<true>(gc, x, false); };
      auto exact = [&](float x, bool is_target) { return core::grad_element(gc, x, is_target); };
      walk_row_from<T, FusedRows::kThreads, FusedRows::kUnroll>(
          xr, n, true, cached, [&](int64_t j, T bits) { gr[j] = S::store(exact(S::load(bits), j == local_t)); },
          [&](int64_t j, const Vec16& raw) {
            store_vec(gr + j, grad_vector<K>(raw, target_in_vector<VEC>(local_t, j), fma, fast, exact));
          });
    }
    t = t_next;
    __syncthreads();  // the cache is the next row's
  }
}

// The forward that writes the gradient on sm_90, rows split over a thread-block cluster
// (cluster_grad_kernel): the 2-pass floor's traffic, each logit read once and each gradient
// written once, for rows of any length up to 8 slices.
// One cluster per row, one slice of the row per block (slice_vecs 16-byte vectors; the last
// may be shorter). A block's thread 0 brings its slice into shared memory with one bulk copy
// (the copy unit keeps the whole slice in flight, so a few resident blocks saturate HBM without
// registers holding loads); the block reduces it to (max, sum-exp, sum, target logit); the
// blocks exchange these four floats through distributed shared memory and merge them in rank
// order, so every block derives the same lse; each block then turns its slice into the gradient
// in place and thread 0 writes it back with one bulk store. Requires rows of whole 16-byte
// vectors starting on 16 bytes in x and g (rows_vectorisable), and code built for sm_90.
template <StorageKind K, class Index, bool kSumLogits>
__global__ void __launch_bounds__(ClusterRows::kThreads)
    cluster_grad_kernel(const typename core::Storage<K>::type* x, int64_t x_stride,
                        typename core::Storage<K>::type* g, int64_t g_stride, const Index* target,
                        CeParams p, int cluster_blocks, int64_t slice_vecs,
                        const float* valid_count, float* lse_out, float* row_loss_out) {
  using S = core::Storage<K>;
  using T = typename S::type;
  constexpr int VEC = vector_width<T>();
  extern __shared__ Vec16 slice[];
  __shared__ RowPartT scratch[ClusterRows::kThreads / 32];
  __shared__ uint64_t loaded;
  __shared__ float part[4];  // this block's (max, sum-exp, sum, target logit), read cluster-wide
  __shared__ float merged[4];
  const int64_t r = blockIdx.x / cluster_blocks;
  const uint32_t rank = cluster_rank();
  const int64_t first = int64_t(rank) * slice_vecs * VEC;  // the slice's first column
  // 32-bit counts in the loops (a slice is at most a block's shared memory).
  const int n = int(std::max<int64_t>(0, std::min(slice_vecs, (p.vocab_local - first) / VEC)));
  if (threadIdx.x == 0) {
    mbarrier_init(&loaded);
    if (n) bulk_load(slice, x + r * x_stride + first, uint32_t(n) * kVectorBytes, &loaded);
  }
  const int64_t t = int64_t(target[r]);  // in flight with the copy
  const TargetKind kind =
      core::classify_target(t, p.ignore_index, p.vocab_start, p.vocab_local, p.vocab_global);
  // The target's place in this slice (-1 if elsewhere): its logit is read once from shared
  // memory and its vector takes a separate branch in pass 2, so that the loops compare
  // nothing per element.
  const int64_t col = kind == TargetKind::Local ? t - p.vocab_start - first : -1;
  const int tpos = col >= 0 && col < int64_t(n) * VEC ? int(col) : -1;
  __syncthreads();  // the barrier is initialised before anyone waits on it
  if (n) mbarrier_wait(&loaded, 0);

  // Pass 1 over two vectors a step: one max and one rescale per 2 x VEC elements.
  float m = -INFINITY, s = 0.0f, sx = 0.0f;
  const float tl = threadIdx.x == 0 && tpos >= 0
                       ? S::load(reinterpret_cast<const T*>(slice)[tpos]) : -INFINITY;
  int i = threadIdx.x;
  for (; i + ClusterRows::kThreads < n; i += 2 * ClusterRows::kThreads) {
    float v[2 * VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v[k] = get<K>(slice[i], k);
      v[VEC + k] = get<K>(slice[i + ClusterRows::kThreads], k);
    }
    core::online_add_chunk<2 * VEC>(m, s, v);
    if (kSumLogits) {
#pragma unroll
      for (int k = 0; k < 2 * VEC; ++k) sx += v[k];
    }
  }
  if (i < n) {
    float v[VEC];
    to_floats<K>(slice[i], v);
    core::online_add_chunk<VEC>(m, s, v);
    if (kSumLogits) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) sx += v[k];
    }
  }
  const RowPartT own = block_reduce(RowPartT{RowPart{m, s, sx}, tl}, MergePartsT{}, scratch);
  if (threadIdx.x == 0) {
    part[0] = own.part.m, part[1] = own.part.s, part[2] = own.part.sx, part[3] = own.target_logit;
  }
  cluster_arrive();
  cluster_wait();  // every block's part is in
  if (threadIdx.x == 0) {  // the same merge, in rank order, in every block of the cluster
    RowPartT row{RowPart{-INFINITY, 0.0f, 0.0f}, -INFINITY};
    for (int b = 0; b < cluster_blocks; ++b) {
      const RowPartT other{RowPart{load_from_cluster_block(&part[0], b), load_from_cluster_block(&part[1], b),
                                   load_from_cluster_block(&part[2], b)},
                           load_from_cluster_block(&part[3], b)};
      row = MergePartsT{}(row, other);
    }
    merged[0] = row.part.m, merged[1] = row.part.s, merged[2] = row.part.sx, merged[3] = row.target_logit;
    if (rank == 0) {
      if (kind == TargetKind::OutOfRange) report_bad_target(r, t);
      core::finish_row(RowStats{row.part.m, row.part.s, row.target_logit, row.part.sx},
                       row.part.sx, kind, p, lse_out[r], row_loss_out[r]);
    }
  }
  cluster_arrive();  // this block is done reading the others' parts (waited for at the end)
  __syncthreads();
  const float lse = merged[0] + logf(merged[1]);  // finish_row's lse, bit for bit

  if (kind == TargetKind::Ignored || kind == TargetKind::OutOfRange) {
    const float fill = kind == TargetKind::Ignored ? 0.0f : NAN;
    Vec16 filled{};
#pragma unroll
    for (int k = 0; k < VEC; ++k) put<K>(filled, k, fill);
    for (int i = threadIdx.x; i < n; i += ClusterRows::kThreads) slice[i] = filled;
  } else {
    const float unit = core::row_grad_scale(p, nullptr, valid_count, 0);
    const core::GradRow gc = core::make_grad_row(lse, unit, p.smoothing, p.z_loss);
    const int tvec = tpos >= 0 ? tpos / VEC : -1;
    const bool fma = core::fma_exponent(gc);
    auto fast = [&](float x) { return core::grad_element<true>(gc, x, false); };
    auto exact = [&](float x, bool is_target) { return core::grad_element(gc, x, is_target); };
    for (int i = threadIdx.x; i < n; i += ClusterRows::kThreads) {
      const Vec16 raw = slice[i];  // one 16-byte load
      slice[i] = grad_vector<K>(raw, i == tvec ? tpos % VEC : -1, fma, fast, exact);
    }
  }
  fence_shared_for_bulk_copy();
  __syncthreads();
  if (threadIdx.x == 0 && n) bulk_store(g + r * g_stride + first, slice, uint32_t(n) * kVectorBytes);
  cluster_wait();  // no block leaves while another may still read its part
}

// The backward of the gradient written in the forward: g *= grad_loss[0]. Every block reads
// the scale first and leaves when it is exactly 1 (the usual loss.backward()): no host sync
// and no pass over g. Rows are strided over a bounded grid.
template <StorageKind K>
__global__ void __launch_bounds__(BwdRows::kThreads)
    scale_kernel(typename core::Storage<K>::type* g, int64_t stride, int64_t rows, int64_t cols,
                 const float* grad_loss) {
  using S = core::Storage<K>;
  using T = typename S::type;
  constexpr int VEC = vector_width<T>();
  const float scale = grad_loss[0];
  if (scale == 1.0f) return;
  for (int64_t r = StridedRows::first(); r < rows; r += StridedRows::stride()) {
    T* gr = g + r * stride;
    walk_row<T, BwdRows::kThreads, BwdRows::kUnroll>(
        gr, cols, true, [&](int64_t j, T bits) { gr[j] = S::store(S::load(bits) * scale); },
        [&](int64_t j, const Vec16& raw) {
          Vec16 out{};
#pragma unroll
          for (int k = 0; k < VEC; ++k) put<K>(out, k, get<K>(raw, k) * scale);
          store_vec(gr + j, out);
        });
  }
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
  const ScratchBuffer scratch(reduce ? sizeof(float) * p.rows : 0, stream);
  float* row_losses = reduce ? scratch.as<float>() : out.loss;
  if (p.rows > 0) launch_stats<true>(logits, target, p, nullptr, out.lse, row_losses, stream);
  if (reduce || out.valid_count) {
    core::dispatch_index(target.type, [&](auto idx) {
      using Index = decltype(idx);
      launch_reduce(row_losses, static_cast<const Index*>(target.data), p, out, stream);
    });
  }
}

namespace {

// The device's numbers for the fused kernel (runtime.h's facts, kept per device there): its SM
// count and the cache a block gets (the block's share of an SM's shared memory, 2 KiB left for
// its static shared memory and the driver's reserve, within the per-block maximum).
struct FusedLaunch {
  int sms = 0;
  int64_t cache_bytes = 0;
};

FusedLaunch fused_launch() {
  const int64_t cache = std::min<int64_t>(int64_t(shared_per_block_optin()) - 2048,
                                          int64_t(shared_per_sm()) / FUSEDLOSS_CE_FUSED_BLOCKS_PER_SM - 2048);
  return FusedLaunch{sm_count(), std::max<int64_t>(cache, 0) / kVectorBytes * kVectorBytes};
}

// The cluster kernel's split of a row of `vecs` 16-byte vectors: blocks per row and vectors a
// block, or {0, 0} when the row does not fit kMaxCluster slices of the most shared memory a
// block may have.
std::pair<int, int64_t> cluster_split(int64_t vecs) {
  const int64_t target = ClusterRows::kSliceBytes / kVectorBytes;
  int64_t blocks = std::min<int64_t>((vecs + target - 1) / target, ClusterRows::kMaxCluster);
  blocks = std::max<int64_t>(blocks, 1);
  const int64_t slice = (vecs + blocks - 1) / blocks;
  // at least two blocks an SM, so that one block's copies overlap another's arithmetic: rows
  // that need more (fp32 beyond about 230k columns) take the 3 passes, which are measured;
  // this split is not
  if (slice * kVectorBytes > shared_for_two_blocks_per_sm()) return {0, 0};
  return {int((vecs + slice - 1) / slice), slice};
}

// The cluster kernel's split of `logits` rows for `kernel` on this device: {0, 0} where it
// cannot run (a device or a build before sm_90: max_active_clusters says 0; rows too long, too
// many of them for the grid).
std::pair<int, int64_t> cluster_plan(const void* kernel, const MatrixView& logits) {
  const auto split = cluster_split(logits.cols * detail::element_size(logits.dtype) / kVectorBytes);
  if (split.first == 0 || logits.rows > int64_t(INT32_MAX) / split.first) return {0, 0};
  allow_most_shared(kernel);
  const bool fits = max_active_clusters(kernel, ClusterRows::kThreads, split.first,
                                        size_t(split.second) * kVectorBytes) > 0;
  return fits ? split : std::pair<int, int64_t>{0, 0};
}

}  // namespace

void ce_forward_with_grad_tp1(const MatrixView& logits, const IndexView& target, const CeParams& p,
                              const CrossEntropyOutputs& out, const MatrixView& grad,
                              Stream stream) {
  const int64_t esize = detail::element_size(logits.dtype);
  const bool same_alignment =
      (logits.data == grad.data && logits.row_stride == grad.row_stride) ||
      (row_starts_aligned(logits.data, logits.row_stride, esize) &&
       row_starts_aligned(grad.data, grad.row_stride, esize));
  const FusedLaunch launch_shape = fused_launch();
  // The whole row body when it fits the block's share of the SM's shared memory.
  const int64_t cache_vecs = std::min<int64_t>(logits.cols * esize / kVectorBytes,
                                               launch_shape.cache_bytes / kVectorBytes);
  const size_t shared = size_t(cache_vecs) * kVectorBytes;
  // The fused kernel pays while most of a row stays in its cache: measured on an H200 (bf16,
  // 8192 rows, bench/NOTES.md), rows of 64 and 100 KB ran 13% and 8% faster than the stats and
  // backward kernels in sequence, rows of 256 and 297 KB 7% and 9% slower (pass 2's rest
  // no longer fits L2). Longer rows take the cluster kernel below where it can run; they, and
  // vectors of one row that would not land on the other's boundary, else take the two kernels:
  // the same results, 3 passes.
  // A soft cap takes the two kernels (each has it): the 2-pass kernels keep no cap variant,
  // which would double their instantiations for an option few calls use.
  const bool uncapped = p.softcap == 0.0f;
  const bool fused = uncapped && same_alignment && logits.cols * esize <= 2 * int64_t(shared);
  // Rows the fused kernel cannot hold, on sm_90: the cluster kernel, for rows of whole vectors
  // on the 16-byte boundary in both (H200, 8192 rows bf16, against the 3 passes in the same
  // run: 1.51 against 1.56 ms at V = 131072, 1.69 against 1.80 at 151936). Where the fused
  // kernel applies it stays (V = 32768: 0.350 ms, the cluster kernel 0.352-0.355 in other runs).
  const bool whole_vectors =
      uncapped && !fused && rows_vectorisable(logits) && rows_vectorisable(grad);
  bool done = false;
  if (p.rows > 0) dispatch_all(logits.dtype, target.type, [&](auto k, auto idx) {
    constexpr StorageKind K = decltype(k)::value;
    using Index = decltype(idx);
    using T = typename core::Storage<K>::type;
    auto* t = static_cast<const Index*>(target.data);
    auto run = [&](auto sum_logits) {
      constexpr bool kSum = decltype(sum_logits)::value;
      auto cluster = cluster_grad_kernel<K, Index, kSum>;
      const auto split = whole_vectors
                             ? cluster_plan(reinterpret_cast<const void*>(cluster), logits)
                             : std::pair<int, int64_t>{0, 0};
      if (split.first == 0 && !fused) return;
      const ScratchBuffer scratch(sizeof(float) * p.rows, stream);
      float* row_losses = scratch.as<float>();
      // Mean: the gradient divides by the valid count, so it is counted first (one small block).
      if (p.reduction == Reduction::Mean) launch_reduce<Index>(nullptr, t, p, out, stream);
      const auto* x = static_cast<const T*>(logits.data);
      auto* g = static_cast<T*>(grad.data);
      if (split.first) {
        launch_in_clusters(cluster, unsigned(p.rows * split.first), ClusterRows::kThreads,
                           split.first, size_t(split.second) * kVectorBytes, stream, x,
                           logits.row_stride, g, grad.row_stride, t, p, split.first,
                           split.second, static_cast<const float*>(out.valid_count), out.lse,
                           row_losses);
      } else {
        auto kernel = stats_grad_kernel<K, Index, kSum>;
        allow_most_shared(reinterpret_cast<const void*>(kernel));
        // The resident grid: every block strides over rows.
        int per_sm = 0;
        FL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                                    FusedRows::kThreads, shared));
        const unsigned blocks =
            StridedRows::grid(p.rows, int64_t(std::max(per_sm, 1)) * launch_shape.sms);
        kernel<<<blocks, FusedRows::kThreads, shared, as_cuda(stream)>>>(
            x, logits.row_stride, g, grad.row_stride, t, p, cache_vecs, out.valid_count, out.lse,
            row_losses);
        FL_CUDA_CHECK_LAUNCH();
      }
      launch_reduce(row_losses, t, p, out, stream);
      done = true;
    };
    if (p.need_sum_logits)
      run(std::true_type{});
    else
      run(std::false_type{});
  });
  if (!done) {
    ce_forward_tp1(logits, target, p, out, stream);
    ce_backward(logits, target, out.lse, nullptr, out.valid_count, p, grad, stream);
  }
}

void ce_scale_grad(const MatrixView& grad, const float* grad_loss, Stream stream) {
  core::dispatch_dtype(grad.dtype, [&](auto k) {
    constexpr StorageKind K = decltype(k)::value;
    using T = typename core::Storage<K>::type;
    const unsigned blocks = StridedRows::grid(grad.rows, 1024);
    scale_kernel<K><<<blocks, BwdRows::kThreads, 0, as_cuda(stream)>>>(
        static_cast<T*>(grad.data), grad.row_stride, grad.rows, grad.cols, grad_loss);
    FL_CUDA_CHECK_LAUNCH();
  });
}

void ce_extract_max(const RowStats* stats, int64_t rows, float* maxima, Stream stream) {
  if (rows == 0) return;
  extract_max_kernel<<<RowPerThread::grid(rows), RowPerThread::kThreads, 0, as_cuda(stream)>>>(
      stats, rows, maxima);
  FL_CUDA_CHECK_LAUNCH();
}

void ce_target_checksum(const IndexView& target, uint64_t* out, Stream stream) {
  if (target.size == 0) return;
  core::dispatch_index(target.type, [&](auto idx) {
    using Index = decltype(idx);
    const auto blocks = unsigned(std::min<int64_t>((target.size + 255) / 256, 264));
    checksum_kernel<<<blocks, 256, 0, as_cuda(stream)>>>(
        TargetTerm<Index>{static_cast<const Index*>(target.data)}, target.size,
        reinterpret_cast<unsigned long long*>(out));
    FL_CUDA_CHECK_LAUNCH();
  });
}

void ce_row_weight_checksum(const float* weight, int64_t rows, uint64_t* out, Stream stream) {
  if (rows == 0) return;
  const auto blocks = unsigned(std::min<int64_t>((rows + 255) / 256, 264));
  checksum_kernel<<<blocks, 256, 0, as_cuda(stream)>>>(
      RowWeightTerm{weight, rows}, rows, reinterpret_cast<unsigned long long*>(out));
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
              const CeParams& p, const CrossEntropyOutputs& out, Stream stream,
              float* row_scratch) {
  const bool reduce = p.reduction != Reduction::None;
  // Per-row losses land in out.loss for None, else in scratch that the reduction reads.
  const ScratchBuffer scratch(reduce && !row_scratch ? sizeof(float) * p.rows : 0, stream);
  float* row_losses = !reduce ? out.loss : row_scratch ? row_scratch : scratch.as<float>();
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

namespace {

constexpr int kRowWeightThreads = 1024;

struct MinRow {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};

__global__ void __launch_bounds__(kRowWeightThreads)
row_weight_scale_kernel(const float* grad_loss, const float* row_weight, int64_t n, float* scale) {
  __shared__ int64_t scratch[kRowWeightThreads / 32];
  int64_t first = n;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    if (row_weight[i] != 0.0f) {
      first = i;
      break;
    }
  first = block_reduce(first, MinRow{}, scratch);
  const float c =
      first < n ? core::row_weight_scale(grad_loss[first], row_weight[first]) : 0.0f;
  int64_t non_finite = n, bad = n;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float g = grad_loss[i];
    if (!isfinite(g))
      non_finite = min(non_finite, i);
    else if (!core::fits_row_weight(g, row_weight[i], c))
      bad = min(bad, i);
  }
  non_finite = block_reduce(non_finite, MinRow{}, scratch);
  bad = block_reduce(bad, MinRow{}, scratch);
  if (threadIdx.x != 0) return;
  if (non_finite < n) {
    *scale = __int_as_float(0x7fc00000);  // NaN, as a recomputed backward's gradients would be
  } else if (bad < n) {
    *scale = __int_as_float(0x7fc00000);
    const int64_t bits = int64_t(uint32_t(__float_as_uint(grad_loss[bad]))) |
                         (int64_t(__float_as_uint(row_weight[bad])) << 32);
    report_device_error(kNotRowWeighted, bad, bits);
  } else {
    *scale = c;
  }
}

}  // namespace

void lce_row_weight_scale(const float* grad_loss, const float* row_weight, int64_t n,
                          float* scale, Stream stream) {
  row_weight_scale_kernel<<<1, kRowWeightThreads, 0, as_cuda(stream)>>>(grad_loss, row_weight, n,
                                                                         scale);
  FL_CUDA_CHECK_LAUNCH();
}

DeviceError* device_error_word() {
  void* word = nullptr;
  FL_CUDA_CHECK(cudaGetSymbolAddress(&word, g_device_error));
  return static_cast<DeviceError*>(word);
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
  if (host.flag == kNotRowWeighted) {
    const uint32_t g_bits = uint32_t(uint64_t(host.value)), w_bits = uint32_t(uint64_t(host.value) >> 32);
    float g = 0.0f, w = 0.0f;
    memcpy(&g, &g_bits, 4);
    memcpy(&w, &w_bits, 4);
    detail::fail("linear_cross_entropy_backward: grad_loss[", host.row, "]: got ", g,
                 " where row_weight[", host.row, "] (Python: loss_mask) is ", w,
                 " (reported by the CUDA kernels; that backward's gradients are NaN), expected "
                 "c * row_weight", core::kNotRowWeightedWhy);
  }
  if (host.flag == kBadToken)
    detail::fail("tokens[", host.row, "]: got ", host.value,
                 ", expected in [0, vocab_global) or ignore_index (reported by the CUDA kernels of "
                 "the log-prob head; that row's log-prob and entropy are NaN)");
  detail::fail("target[", host.row, "]: got ", host.value,
               ", expected in [0, vocab_global) or ignore_index (reported by the CUDA kernels; "
               "that row's loss is NaN)");
}

}  // namespace fusedloss::cuda

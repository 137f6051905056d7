#include "cuda/distill_cuda.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include "core/dispatch.h"
#include "core/linear_ce_plan.h"  // round_up
#include "cuda/bulk_copy.cuh"
#include "cuda/cuda_check.h"
#include "cuda/device_error.cuh"
#include "cuda/reduce.cuh"
#include "cuda/runtime.h"
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
                          core::distill_add(p, a, x, t);
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
                          core::distill_jsd_terms(p, st, x, t, s.soft, s.soft_student);
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
      stats[r] = DistillRowStats{};
    }
    return;
  }
  const core::DistillPartial a = row_partial<KS, KT>(xs, xt, r, p, scratch);
  const DistillRowStats st = core::distill_row_stats(p, a);
  // The stats and the loss leave before jsd's pass 2, which adds its soft term to both: less
  // is live across it (the 8 stats kept through it spilled in the mixed-dtype kernels).
  float row_loss = 0.0f;
  if (threadIdx.x == 0) {
    stats[r] = st;
    row_loss = core::distill_loss(p, st, target_logit<KS>(xs, r, tg, 0), tg.data != nullptr);
  }
  if (p.divergence == Divergence::JSD) {
    const Sums s = row_jsd<KS, KT>(xs, xt, r, p, st, sums_scratch);
    if (threadIdx.x == 0) {
      stats[r].soft = s.soft;
      stats[r].soft_student = s.soft_student;
      row_loss += (1.0f - p.hard_weight) * s.soft;
    }
  }
  if (threadIdx.x == 0) loss[r] = row_loss;
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
    stats[r] = DistillRowStats{};
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

// The gradient of one unit of kUnit columns (a, b: the student's and the teacher's logits,
// j0: the first column's index) into `out`, in the student's kind.
template <core::StorageKind KS, class Grad>
__device__ __forceinline__ void grad_unit(core::Elem<KS>* out, const float (&a)[kUnit],
                                          const float (&b)[kUnit], int64_t j0, Grad&& grad) {
  constexpr int W = vector_width<core::Elem<KS>>();
#pragma unroll
  for (int v = 0; v < kUnit / W; ++v) {
    Vec16 o;
#pragma unroll
    for (int e = 0; e < W; ++e) put<KS>(o, e, grad(j0 + v * W + e, a[v * W + e], b[v * W + e]));
    store_vec(out + v * W, o);
  }
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
    return ignored ? 0.0f : core::distill_grad(p, st, x, t, vocab_start + j == tgt, g);
  };
  const int64_t units = xs.cols / kUnit;
  for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
    float a[kUnit], b[kUnit];
    load_floats<KS, kUnit>(row + u * kUnit, a);
    load_floats<KT, kUnit>(trow + u * kUnit, b);
    grad_unit<KS>(row + u * kUnit, a, b, u * kUnit, grad);
  }
  for (int64_t j = units * kUnit + threadIdx.x; j < xs.cols; j += blockDim.x)
    row[j] = core::Storage<KS>::store(
        grad(j, core::Storage<KS>::load(row[j]), core::Storage<KT>::load(trow[j])));
}

// ---- a row pair in a thread-block cluster's shared memory (sm_90) ----
//
// The forward of a row pair that also writes the student's gradient, at the traffic floor: each
// logit of both models read once and each gradient written once (the kernels above read both
// rows two or three times: pass 1, jsd's pass 2, the gradient). One cluster per row, one column
// slice per block: the student's slice and the teacher's same columns side by side in the
// block's shared memory, each brought in by one bulk copy. Pass 1 reduces the block's slice to a
// DistillPartial; the blocks exchange them through distributed shared memory and every block
// merges them in rank order, so all derive the same stats; jsd's pass 2 exchanges its two sums
// the same way; then each block turns its student slice into the gradient in place and writes
// it back with one bulk store. The row math is core/distill_math.h's, as in the kernels above.
constexpr int kMaxCluster = 8;  // the portable cluster size

// Block `rank`'s float f of a struct of floats in every block's shared memory.
template <class T>
__device__ __forceinline__ T load_struct_from_cluster_block(const T* p, uint32_t rank) {
  static_assert(sizeof(T) % sizeof(float) == 0, "a struct of floats");
  T v;
  for (int f = 0; f < int(sizeof(T) / sizeof(float)); ++f)
    reinterpret_cast<float*>(&v)[f] = load_from_cluster_block(reinterpret_cast<const float*>(p) + f, rank);
  return v;
}

template <core::StorageKind KS, core::StorageKind KT>
__global__ void __launch_bounds__(kThreads)
    cluster_rows_kernel(MatrixView xs, MatrixView xt, Targets tg, int64_t ignore_index,
                        core::DistillParams p, int cluster_blocks, int slice_cols,
                        uint32_t teacher_at, float* loss, DistillRowStats* stats, bool write_grad,
                        const float* grad_loss, DeviceError* error) {
  extern __shared__ Vec16 slice[];
  __shared__ core::DistillPartial scratch[kThreads / 32];
  __shared__ Sums sums_scratch[kThreads / 32];
  __shared__ uint64_t loaded[2];
  __shared__ core::DistillPartial part;  // this block's, read cluster-wide
  __shared__ Sums part_sums;             // jsd: this block's pass-2 sums, read cluster-wide
  __shared__ DistillRowStats merged;
  __shared__ float merged_target;
  const int64_t r = blockIdx.x / cluster_blocks;
  const uint32_t rank = cluster_rank();
  const int64_t first = int64_t(rank) * slice_cols;
  const int n = int(std::max<int64_t>(0, std::min<int64_t>(slice_cols, xs.cols - first)));
  auto* sx = reinterpret_cast<core::Elem<KS>*>(slice);
  const auto* st_ = reinterpret_cast<const core::Elem<KT>*>(reinterpret_cast<const char*>(slice) + teacher_at);
  // whole 16-byte vectors (the last slice's tail reaches into the rows' padding)
  const uint32_t bytes_s = core::round_up(uint32_t(n * sizeof(core::Elem<KS>)), uint32_t(kVectorBytes));
  const uint32_t bytes_t = core::round_up(uint32_t(n * sizeof(core::Elem<KT>)), uint32_t(kVectorBytes));
  auto* xs_row = static_cast<core::Elem<KS>*>(xs.data) + r * xs.row_stride + first;
  const bool is_ignored =
      tg.ignored(r, ignore_index, xs.cols, rank == 0 && threadIdx.x == 0 ? error : nullptr);
  if (is_ignored) {  // the whole cluster leaves here: no block reads another's memory
    if (rank == 0 && threadIdx.x == 0) {
      loss[r] = 0.0f;
      stats[r] = DistillRowStats{};
    }
    if (write_grad) {  // (zeros over the last slice's tail too: the chunk buffers' padding)
      for (int i = threadIdx.x; i < int(bytes_s / kVectorBytes); i += kThreads) slice[i] = Vec16{};
      fence_shared_for_bulk_copy();
      __syncthreads();
      if (threadIdx.x == 0 && n) bulk_store(xs_row, sx, bytes_s);
    }
    return;
  }
  if (threadIdx.x == 0) {
    mbarrier_init(&loaded[0]);
    mbarrier_init(&loaded[1]);
    if (n) {
      bulk_load(sx, xs_row, bytes_s, &loaded[0]);
      bulk_load(const_cast<core::Elem<KT>*>(st_), row_of<KT>(xt, r) + first, bytes_t, &loaded[1]);
    }
  }
  // The target's column in this slice, if it is here (its logit enters the partial once).
  const int64_t tcol = tg.data ? tg.at(r) - first : -1;
  __syncthreads();  // the barriers are initialised before anyone waits on them
  if (n) {
    mbarrier_wait(&loaded[0], 0);
    mbarrier_wait(&loaded[1], 0);
  }

  // Pass 1 over the slice, then the cluster's merge.
  core::DistillPartial a = core::distill_empty();
  for_each_pair<KS, KT>(sx, st_, n, [&](int64_t, float x, float t) {
    core::distill_add(p, a, x, t);
  });
  a = block_reduce(
      a, [&](const core::DistillPartial& u, const core::DistillPartial& v) {
        return core::distill_combine(p, u, v);
      },
      scratch);
  if (threadIdx.x == 0) {
    if (tcol >= 0 && tcol < n) a.target = core::Storage<KS>::load(sx[tcol]);
    part = a;
  }
  cluster_arrive();
  cluster_wait();  // every block's part is in
  if (threadIdx.x == 0) {  // the same merge, in rank order, in every block
    core::DistillPartial m = load_struct_from_cluster_block(&part, 0);
    for (int b = 1; b < cluster_blocks; ++b)
      m = core::distill_combine(p, m, load_struct_from_cluster_block(&part, uint32_t(b)));
    merged = core::distill_row_stats(p, m);
    merged_target = m.target;
  }
  __syncthreads();
  DistillRowStats row = merged;
  if (p.divergence == Divergence::JSD) {  // pass 2 with the row's lse, then its merge
    Sums s{0.0f, 0.0f};
    for_each_pair<KS, KT>(sx, st_, n, [&](int64_t, float x, float t) {
      core::distill_jsd_terms(p, row, x, t, s.soft, s.soft_student);
    });
    s = block_reduce(
        s, [](const Sums& u, const Sums& v) { return Sums{u.soft + v.soft, u.soft_student + v.soft_student}; },
        sums_scratch);
    if (threadIdx.x == 0) part_sums = s;
    cluster_arrive();
    cluster_wait();
    if (threadIdx.x == 0) {
      Sums m{0.0f, 0.0f};
      for (int b = 0; b < cluster_blocks; ++b) {
        const Sums o = load_struct_from_cluster_block(&part_sums, uint32_t(b));
        m.soft += o.soft;
        m.soft_student += o.soft_student;
      }
      merged.soft = m.soft;
      merged.soft_student = m.soft_student;
    }
    __syncthreads();
    row = merged;
  }
  cluster_arrive();  // this block is done reading the others' parts (waited for at the end)
  if (rank == 0 && threadIdx.x == 0) {
    stats[r] = row;
    loss[r] = core::distill_loss(p, row, merged_target, tg.data != nullptr);
  }
  if (write_grad) {  // the student's slice -> its gradient, in place, then one bulk store
    const float g = grad_loss ? grad_loss[r] : 1.0f;
    const int64_t tgt = tg.data ? tg.at(r) : -1;
    auto grad = [&](int64_t j, float x, float t) {
      return core::distill_grad(p, row, x, t, first + j == tgt, g);
    };
    const int units = n / kUnit;
    for (int u = threadIdx.x; u < units; u += kThreads) {
      float xa[kUnit], ta[kUnit];
      load_floats<KS, kUnit>(sx + u * kUnit, xa);
      load_floats<KT, kUnit>(st_ + u * kUnit, ta);
      grad_unit<KS>(sx + u * kUnit, xa, ta, int64_t(u) * kUnit, grad);
    }
    for (int j = units * kUnit + threadIdx.x; j < n; j += kThreads)
      sx[j] = core::Storage<KS>::store(grad(j, core::Storage<KS>::load(sx[j]), core::Storage<KT>::load(st_[j])));
    fence_shared_for_bulk_copy();
    __syncthreads();
    if (threadIdx.x == 0 && n) bulk_store(xs_row, sx, bytes_s);
  }
  cluster_wait();  // no block leaves while another may still read its part
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

// The cluster kernel's split of a row pair: blocks a row (0: it cannot run), columns a block,
// where the teacher's columns start in a block's shared memory and its bytes. Slices of about
// kSliceBytes where the row allows (more resident blocks an SM, so that one block's copies
// overlap another's arithmetic), at most kMaxCluster of them, each within
// shared_for_two_blocks_per_sm(); buffers whose rows' padding
// holds each slice's 16-byte tail (the chunk buffers' pitch: a multiple of 16 bytes); a device
// and build of sm_90 or later (max_active_clusters says 0 otherwise).
struct ClusterSplit {
  int blocks = 0;
  int cols = 0;
  uint32_t teacher_at = 0;
  size_t bytes = 0;
};
constexpr int64_t kSliceBytes = 48 * 1024;

ClusterSplit cluster_split(const void* kernel, const MatrixView& xs, const MatrixView& xt) {
  const int64_t es = detail::element_size(xs.dtype), et = detail::element_size(xt.dtype);
  const int64_t cols = xs.cols;
  auto padded = [](int64_t bytes) { return core::round_up(bytes, int64_t(kVectorBytes)); };
  if (xs.row_stride * es < padded(cols * es) || xt.row_stride * et < padded(cols * et)) return {};
  int64_t blocks = std::clamp<int64_t>((cols * (es + et) + kSliceBytes - 1) / kSliceBytes, 1,
                                       kMaxCluster);
  const int64_t per_block = core::round_up((cols + blocks - 1) / blocks, int64_t(kUnit));
  blocks = (cols + per_block - 1) / per_block;
  const int64_t teacher_at = padded(per_block * es), bytes = teacher_at + padded(per_block * et);
  if (bytes > shared_for_two_blocks_per_sm() || xs.rows > int64_t(INT32_MAX) / blocks) return {};
  allow_most_shared(kernel);
  if (max_active_clusters(kernel, kThreads, int(blocks), size_t(bytes)) == 0) return {};
  return {int(blocks), int(per_block), uint32_t(teacher_at), size_t(bytes)};
}

// FUSEDLOSS_DISTILL_CLUSTERS = 0 | 1: the one-block-a-row kernels always (0, the default), or
// the cluster kernel where it can run (1; read at every call). Opt-in until a GPU run has held
// it to the tests and measured it against the one-block kernels (bench/distill_bench.py's
// fusedloss-clusters).
bool clusters_allowed() {
  const char* v = std::getenv("FUSEDLOSS_DISTILL_CLUSTERS");
  return v && std::string(v) == "1";
}

// The forward of xs's rows in clusters, and with write_grad their gradients in place (as
// distill_gradient with vocab_start 0); false where the cluster kernel cannot run (nothing
// enqueued then).
bool rows_in_clusters(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                      int64_t ignore_index, const core::DistillParams& p, float* loss,
                      DistillRowStats* stats, bool write_grad, const float* grad_loss,
                      Stream stream) {
  if (!clusters_allowed()) return false;
  bool done = false;
  with_kinds(xs, xt, "distill_rows", [&](auto ks, auto kt) {
    auto kernel = cluster_rows_kernel<decltype(ks)::value, decltype(kt)::value>;
    const ClusterSplit c = cluster_split(reinterpret_cast<const void*>(kernel), xs, xt);
    if (c.blocks == 0) return;
    launch_in_clusters(kernel, unsigned(xs.rows * c.blocks), kThreads, c.blocks, c.bytes, stream,
                       xs, xt, targets_of(target), ignore_index, p, c.blocks, c.cols,
                       c.teacher_at, loss, stats, write_grad, grad_loss, device_error_word());
    done = true;
  });
  return done;
}

}  // namespace

void distill_rows(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                  int64_t ignore_index, const core::DistillParams& p, float* loss,
                  DistillRowStats* stats, Stream stream) {
  if (xs.rows == 0) return;
  if (rows_in_clusters(xs, xt, target, ignore_index, p, loss, stats, false, nullptr, stream)) return;
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

void distill_rows_and_gradient(const MatrixView& xs, const MatrixView& xt, const IndexView& target,
                               int64_t ignore_index, const core::DistillParams& p, float* loss,
                               DistillRowStats* stats, const float* grad_loss, Stream stream) {
  if (xs.rows == 0) return;
  if (rows_in_clusters(xs, xt, target, ignore_index, p, loss, stats, true, grad_loss, stream)) return;
  distill_rows(xs, xt, target, ignore_index, p, loss, stats, stream);
  distill_gradient(xs, xt, target, 0, ignore_index, p, stats, grad_loss, stream);
}

}  // namespace fusedloss::cuda

// CUDA RMSNorm.
//
// Forward ("rows" kernels): a group of tpr threads (a multiple of 32) owns one row at a time;
// each thread holds NP 16-byte vectors of the row in registers (vector p = t + k * tpr, so a
// warp's loads are contiguous), sums their squares, the group sums in a fixed order
// (reduce.cuh), and the thread scales its own vectors and stores them: x is read once, y
// written once, rstd 4 bytes per row. A block holds several groups when rows are short (small
// H: one warp per row).
//
// Backward ("rows" kernels): the same row-in-registers walk over x (or s) and dy, on a fixed
// grid of about 2 blocks per SM (occupancy permitting), each block walking a strided set of
// rows. A thread owns the same columns in every row, so it accumulates dy * xhat for them in
// registers across its rows; at the end the block's groups add their accumulators in group
// order (shared memory) and the block writes one fp32 row of partials [grid, H]. A second small
// kernel adds the partial rows of each column in a fixed order. No float atomics anywhere: the
// weight gradient has the same bits on every call on a given device (the grid depends on the
// device's SM count and on H, never on timing).
//
// Views that cannot be walked in 16-byte vectors (odd H, offset pointers, strides that are not
// a multiple of 16 bytes) and rows too long for registers go through the "any" kernels: one
// block per row, single elements, the row read twice (the second read mostly hits L1/L2), and
// in the backward the partial row of the block accumulated in global memory by the thread that
// owns each column.
//
// Aliasing (validated in src/api/rms_norm.cpp): in the forward no output overlaps an input or
// another output. In the backward grad_x may be exactly grad_y, x_or_s or grad_residual_out
// (the same view): every element is read by the thread that writes it, before it writes it, so
// those pointers are not __restrict__. The weight never overlaps an output and is read through
// the read-only path.
#include "cuda/rms_norm_cuda.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include "core/dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/reduce.cuh"
#include "cuda/vector_io.cuh"

namespace fusedloss::cuda {
namespace {

using core::StorageKind;
using core::Elem;
using core::St;

// Build-time knobs (defaults are the shipped kernels). A row gets tpr = ceil(vectors / NP)
// threads, NP the smallest power of two up to the maximum with tpr <= the target; blocks
// gather rows up to the block target.
#ifndef FUSEDLOSS_RMS_FWD_TPR
#define FUSEDLOSS_RMS_FWD_TPR 128
#endif
#ifndef FUSEDLOSS_RMS_FWD_BLOCK
#define FUSEDLOSS_RMS_FWD_BLOCK 256
#endif
#ifndef FUSEDLOSS_RMS_BWD_TPR
#define FUSEDLOSS_RMS_BWD_TPR 128
#endif
#ifndef FUSEDLOSS_RMS_BWD_BLOCK
#define FUSEDLOSS_RMS_BWD_BLOCK 512
#endif
// Backward blocks per SM at most (the grid, and the partial rows: the workspace size).
#ifndef FUSEDLOSS_RMS_BWD_BLOCKS_PER_SM
#define FUSEDLOSS_RMS_BWD_BLOCKS_PER_SM 2
#endif
constexpr int kFwdMaxThreads = 1024;  // launch bound: <= 64 registers a thread
constexpr int kBwdMaxThreads = 512;   // launch bound: <= 128 (the accumulators live in registers)
// Vectors per thread in the forward: 4 (16 registers of row data), within the 64 registers of
// the launch bound without spills (8 spilled with the residual add).
template <class T>
constexpr int fwd_max_np() {
  return 4;
}
// The backward holds x, dy and an fp32 accumulator per column: at most 32 columns a thread
// for 16-bit rows (4 vectors: 16 + 16 + 32 registers), 16 for fp32 (4 vectors: 16 + 16 + 16),
// within the launch bound without spills.
template <class T>
constexpr int bwd_max_np() {
  return 4;
}
constexpr int kAnyThreads = 256;
constexpr int kBwdBlocksPerSm = FUSEDLOSS_RMS_BWD_BLOCKS_PER_SM;
static_assert(FUSEDLOSS_RMS_BWD_BLOCK <= kBwdMaxThreads, "backward block within its launch bound");

template <StorageKind X, StorageKind W>
struct FwdArgs {
  const Elem<X>* x;
  int64_t xs;
  const Elem<X>* res;  // null: no residual
  int64_t rs;
  Elem<X>* y;
  int64_t ys;
  Elem<X>* s_out;  // residual_out, iff res
  int64_t ss;
  const Elem<W>* w;
  float* rstd;
  int64_t rows, hidden;
  float eps;
  bool zc;
  int tpr;  // threads per row: a multiple of 32 dividing blockDim.x
};

template <StorageKind X, StorageKind W>
struct BwdArgs {
  const Elem<X>* dy;
  int64_t dys;
  const Elem<X>* x;
  int64_t xs;
  const Elem<X>* gres;  // null when absent
  int64_t gs;
  Elem<X>* dx;
  int64_t dxs;
  const Elem<W>* w;
  const float* rstd;
  float* partial;  // [gridDim.x, hidden]
  int64_t rows, hidden;
  bool zc;
  int tpr;
};

// ---- forward ----

template <StorageKind X, StorageKind W, int NP>
__global__ void __launch_bounds__(kFwdMaxThreads) forward_rows_kernel(FwdArgs<X, W> a) {
  constexpr int VEC = vector_width<Elem<X>>();
  __shared__ float scratch[kFwdMaxThreads / 32];
  const int groups = blockDim.x / a.tpr, g = threadIdx.x / a.tpr, t = threadIdx.x % a.tpr;
  const int64_t nvec = a.hidden / VEC;
  // The loop bounds are the block's, not the group's: every thread reaches every group_sum.
  for (int64_t base = int64_t(blockIdx.x) * groups; base < a.rows;
       base += int64_t(gridDim.x) * groups) {
    const int64_t r = base + g;
    const bool live = r < a.rows;
    Vec16 v[NP] = {};  // zero bits are 0.0 in every storage kind: absent vectors add nothing
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const int64_t p = t + int64_t(k) * a.tpr;
      if (live && p < nvec) v[k] = load_vec(a.x + r * a.xs + p * VEC);
    }
    if (a.res) {
#pragma unroll
      for (int k = 0; k < NP; ++k) {
        const int64_t p = t + int64_t(k) * a.tpr;
        if (live && p < nvec) {
          float xf[VEC], rf[VEC];
          to_floats<X>(v[k], xf);
          to_floats<X>(load_vec(a.res + r * a.rs + p * VEC), rf);
#pragma unroll
          for (int e = 0; e < VEC; ++e) xf[e] += rf[e];
          v[k] = from_floats<X>(xf);  // s as stored: the backward reads it back
          store_vec(a.s_out + r * a.ss + p * VEC, v[k]);
        }
      }
    }
    float sq = 0.0f;
#pragma unroll
    for (int k = 0; k < NP; ++k)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float f = get<X>(v[k], e);
        sq += f * f;
      }
    sq = group_sum(sq, a.tpr, scratch);
    const float rstd = core::rms_rstd(sq, a.hidden, a.eps);
    if (live && t == 0) a.rstd[r] = rstd;
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const int64_t p = t + int64_t(k) * a.tpr;
      if (live && p < nvec) {
        float w[VEC], o[VEC];
        load_floats_ro<W, VEC>(a.w + p * VEC, w);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          o[e] = core::rms_y(get<X>(v[k], e), rstd, core::rms_gamma(w[e], a.zc));
        store_vec(a.y + r * a.ys + p * VEC, from_floats<X>(o));
      }
    }
  }
}

template <StorageKind X, StorageKind W>
__global__ void __launch_bounds__(kAnyThreads) forward_any_kernel(FwdArgs<X, W> a) {
  __shared__ float scratch[kAnyThreads / 32];
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const Elem<X>* xr = a.x + r * a.xs;
    float sq = 0.0f;
    for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x) {
      float s = St<X>::load(xr[c]);
      if (a.res) {
        const Elem<X> stored = St<X>::store(s + St<X>::load(a.res[r * a.rs + c]));
        a.s_out[r * a.ss + c] = stored;
        s = St<X>::load(stored);
      }
      sq += s * s;
    }
    sq = block_sum(sq, scratch);
    const float rstd = core::rms_rstd(sq, a.hidden, a.eps);
    if (threadIdx.x == 0) a.rstd[r] = rstd;
    // s is read back by the thread that stored it
    const Elem<X>* sr = a.res ? a.s_out + r * a.ss : xr;
    for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x)
      a.y[r * a.ys + c] = St<X>::store(
          core::rms_y(St<X>::load(sr[c]), rstd, core::rms_gamma(St<W>::load(a.w[c]), a.zc)));
  }
}

// ---- backward ----

template <StorageKind X, StorageKind W, int NP>
__global__ void __launch_bounds__(kBwdMaxThreads) backward_rows_kernel(BwdArgs<X, W> a) {
  constexpr int VEC = vector_width<Elem<X>>();
  __shared__ float scratch[kBwdMaxThreads / 32];
  __shared__ float exchange[kBwdMaxThreads * VEC];
  const int groups = blockDim.x / a.tpr, g = threadIdx.x / a.tpr, t = threadIdx.x % a.tpr;
  const int64_t nvec = a.hidden / VEC;
  float dg[NP][VEC] = {};
  for (int64_t base = int64_t(blockIdx.x) * groups; base < a.rows;
       base += int64_t(gridDim.x) * groups) {
    const int64_t r = base + g;
    const bool live = r < a.rows;
    Vec16 xv[NP] = {}, gv[NP] = {};
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const int64_t p = t + int64_t(k) * a.tpr;
      if (live && p < nvec) {
        xv[k] = load_vec(a.x + r * a.xs + p * VEC);
        gv[k] = load_vec(a.dy + r * a.dys + p * VEC);
      }
    }
    const float rstd = live ? a.rstd[r] : 0.0f;
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const int64_t p = t + int64_t(k) * a.tpr;
      if (p < nvec) {  // a dead row's vectors are zeros: they add nothing
        float w[VEC];
        load_floats_ro<W, VEC>(a.w + p * VEC, w);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float xhat = get<X>(xv[k], e) * rstd, dy = get<X>(gv[k], e);
          dot += dy * core::rms_gamma(w[e], a.zc) * xhat;
          dg[k][e] += dy * xhat;
        }
      }
    }
    const float c = core::rms_dot_mean(group_sum(dot, a.tpr, scratch), a.hidden);
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const int64_t p = t + int64_t(k) * a.tpr;
      if (live && p < nvec) {
        float w[VEC], o[VEC], gr[VEC] = {};
        load_floats_ro<W, VEC>(a.w + p * VEC, w);
        if (a.gres) to_floats<X>(load_vec(a.gres + r * a.gs + p * VEC), gr);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          o[e] = core::rms_grad_s(get<X>(xv[k], e) * rstd, get<X>(gv[k], e),
                                  core::rms_gamma(w[e], a.zc), rstd, c) + gr[e];
        store_vec(a.dx + r * a.dxs + p * VEC, from_floats<X>(o));  // in place: read above
      }
    }
  }
  // The groups' accumulators, added in group order into group 0's, one vector slot at a time.
#pragma unroll
  for (int k = 0; k < NP; ++k) {
    if (groups > 1) {  // uniform over the block
      __syncthreads();
      if (g > 0)
#pragma unroll
        for (int e = 0; e < VEC; ++e) exchange[((g - 1) * VEC + e) * a.tpr + t] = dg[k][e];
      __syncthreads();
      if (g == 0)
        for (int h = 1; h < groups; ++h)
#pragma unroll
          for (int e = 0; e < VEC; ++e) dg[k][e] += exchange[((h - 1) * VEC + e) * a.tpr + t];
    }
    const int64_t p = t + int64_t(k) * a.tpr;
    if (g == 0 && p < nvec) {
      float* out = a.partial + int64_t(blockIdx.x) * a.hidden + p * VEC;
#pragma unroll
      for (int q = 0; q < VEC; q += 4) {
        const float part[4] = {dg[k][q], dg[k][q + 1], dg[k][q + 2], dg[k][q + 3]};
        store_vec(out + q, from_floats<StorageKind::F32>(part));
      }
    }
  }
}

template <StorageKind X, StorageKind W>
__global__ void __launch_bounds__(kAnyThreads) backward_any_kernel(BwdArgs<X, W> a) {
  __shared__ float scratch[kAnyThreads / 32];
  // This block's partial row; column c is only ever touched by the thread that owns it.
  float* part = a.partial + int64_t(blockIdx.x) * a.hidden;
  for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x) part[c] = 0.0f;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const float rstd = a.rstd[r];
    const Elem<X>* xr = a.x + r * a.xs;
    const Elem<X>* gr = a.dy + r * a.dys;
    float dot = 0.0f;
    for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x) {
      const float xhat = St<X>::load(xr[c]) * rstd, dy = St<X>::load(gr[c]);
      dot += dy * core::rms_gamma(St<W>::load(a.w[c]), a.zc) * xhat;
      part[c] += dy * xhat;
    }
    const float m = core::rms_dot_mean(block_sum(dot, scratch), a.hidden);
    for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x) {
      float v = core::rms_grad_s(St<X>::load(xr[c]) * rstd, St<X>::load(gr[c]),
                                 core::rms_gamma(St<W>::load(a.w[c]), a.zc), rstd, m);
      if (a.gres) v += St<X>::load(a.gres[r * a.gs + c]);
      a.dx[r * a.dxs + c] = St<X>::store(v);  // in place: this thread read xr[c], gr[c] above
    }
  }
}

// grad_weight[c] = sum over the partial rows, in row order per slice and slice order after:
// 32 columns x 32 row slices per block.
__global__ void __launch_bounds__(1024) column_sum_kernel(const float* partial, int parts,
                                                          int64_t hidden, float* out) {
  __shared__ float sums[32][33];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int64_t c = int64_t(blockIdx.x) * 32 + tx;
  float s = 0.0f;
  if (c < hidden)
    for (int k = ty; k < parts; k += 32) s += partial[int64_t(k) * hidden + c];
  sums[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < hidden) {
    float total = 0.0f;
    for (int k = 0; k < 32; ++k) total += sums[k][tx];
    out[c] = total;
  }
}

// ---- host side ----

// Per-device facts, queried once: the SM count, and blocks per SM of a kernel at a block size.
std::mutex g_cache_mutex;
std::map<std::tuple<int, const void*, int>, int> g_cache;

int cached(const void* key, int threads, int (*query)(int device, const void* key, int threads)) {
  int device = 0;
  FL_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  auto [it, fresh] = g_cache.try_emplace({device, key, threads}, 0);
  if (fresh) {
    try {
      it->second = query(device, key, threads);
    } catch (...) {
      g_cache.erase(it);
      throw;
    }
  }
  return it->second;
}

int sm_count() {
  return cached(nullptr, 0, [](int device, const void*, int) {
    int n = 0;
    FL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return std::max(n, 1);
  });
}

int blocks_per_sm(const void* kernel, int threads) {
  return cached(kernel, threads, [](int, const void* k, int n) {
    int blocks = 0;
    FL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, n, 0));
    return std::max(blocks, 1);
  });
}

// The backward's partial rows at most: the grid never exceeds this.
int64_t max_partial_rows(int64_t rows) {
  return std::min<int64_t>(int64_t(kBwdBlocksPerSm) * sm_count(), std::max<int64_t>(rows, 1));
}

struct RowLayout {
  int np = 0;      // vectors per thread; 0: the rows do not fit, use the "any" kernels
  int tpr = 0;     // threads per row
  int groups = 0;  // rows per block at a time
};

RowLayout row_layout(int64_t nvec, int max_np, int target_tpr, int block_target, int max_block) {
  int np = 1;
  while (np < max_np && (nvec + np - 1) / np > target_tpr) np *= 2;
  const int64_t tpr = ((nvec + np - 1) / np + 31) / 32 * 32;
  if (tpr > max_block) return {};
  const int t = int(tpr);
  return {np, t, std::max(1, block_target / t)};
}

template <class F>
void dispatch_types(DType x, DType w, F&& f) {
  using K = StorageKind;
  auto x_is = [&](auto xk) {
    constexpr K X = decltype(xk)::value;
    if (w == DType::F32) return f(xk, std::integral_constant<K, K::F32>{});
    if constexpr (X == K::F32) {
      if (w == DType::BF16) return f(xk, std::integral_constant<K, K::BF16>{});
      if (w == DType::F16) return f(xk, std::integral_constant<K, K::F16>{});
    } else {
      if (w == x) return f(xk, xk);
    }
    detail::fail("weight.dtype: got ", to_string(w), ", unsupported with x.dtype ", to_string(x));
  };
  core::dispatch_dtype(x, x_is);
}

// Calls f(NP) as a compile-time constant, NP in {1, 2, 4, ..., kMax}: only those are compiled.
template <int kMax, class F>
void dispatch_np(int np, F&& f) {
  if constexpr (kMax > 1) {
    if (np < kMax) return dispatch_np<kMax / 2>(np, f);
  }
  f(std::integral_constant<int, kMax>{});
}

bool vectorisable(const MatrixView& m) {
  return m.rows == 0 || rows_vectorisable(m.data, m.cols, m.rows > 1 ? m.row_stride : m.cols,
                                          detail::element_size(m.dtype));
}

unsigned grid_of(int64_t blocks) { return unsigned(std::clamp<int64_t>(blocks, 1, int64_t(1) << 30)); }

}  // namespace

size_t rms_norm_workspace_bytes(int64_t rows, int64_t hidden) {
  return size_t(max_partial_rows(rows)) * size_t(hidden) * sizeof(float);
}

void rms_norm_forward(const MatrixView& x, const core::RmsNormParams& p, const MatrixView& y,
                      float* rstd, const MatrixView& residual, const MatrixView& residual_out,
                      Stream stream) {
  if (p.rows == 0) return;
  dispatch_types(x.dtype, p.weight_dtype, [&](auto xk, auto wk) {
    constexpr StorageKind X = decltype(xk)::value, W = decltype(wk)::value;
    constexpr int VEC = vector_width<Elem<X>>();
    FwdArgs<X, W> a{static_cast<const Elem<X>*>(x.data), x.row_stride,
                    static_cast<const Elem<X>*>(residual.data), residual.row_stride,
                    static_cast<Elem<X>*>(y.data), y.row_stride,
                    static_cast<Elem<X>*>(residual_out.data), residual_out.row_stride,
                    static_cast<const Elem<W>*>(p.weight), rstd, p.rows, p.hidden, p.eps,
                    p.zero_centered_gamma, 0};
    const bool vec = vectorisable(x) && vectorisable(y) && vectorisable(residual) &&
                     vectorisable(residual_out) && aligned_to(p.weight, kVectorBytes) &&
                     p.hidden % VEC == 0;
    const RowLayout l = vec ? row_layout(p.hidden / VEC, fwd_max_np<Elem<X>>(), FUSEDLOSS_RMS_FWD_TPR,
                                         FUSEDLOSS_RMS_FWD_BLOCK, kFwdMaxThreads)
                            : RowLayout{};
    if (l.np) {
      a.tpr = l.tpr;
      dispatch_np<fwd_max_np<Elem<X>>()>(l.np, [&](auto np) {
        forward_rows_kernel<X, W, decltype(np)::value>
            <<<grid_of((p.rows + l.groups - 1) / l.groups), l.tpr * l.groups, 0,
               as_cuda(stream)>>>(a);
      });
    } else {
      a.tpr = kAnyThreads;
      forward_any_kernel<X, W><<<grid_of(p.rows), kAnyThreads, 0, as_cuda(stream)>>>(a);
    }
    FL_CUDA_CHECK_LAUNCH();
  });
}

void rms_norm_backward(const MatrixView& grad_y, const MatrixView& x_or_s,
                       const core::RmsNormParams& p, const float* rstd, const MatrixView& grad_x,
                       float* grad_weight, void* workspace, const MatrixView& grad_residual_out,
                       Stream stream) {
  if (p.rows == 0) {
    FL_CUDA_CHECK(cudaMemsetAsync(grad_weight, 0, sizeof(float) * p.hidden, as_cuda(stream)));
    return;
  }
  const int64_t max_parts = max_partial_rows(p.rows);
  struct Owned {  // the partials allocated here, freed stream-ordered on every exit
    void* ptr;
    Stream stream;
    ~Owned() { free_async(ptr, stream); }
  } owned{workspace ? nullptr : alloc_async(sizeof(float) * max_parts * p.hidden, stream), stream};
  float* partial = static_cast<float*>(workspace ? workspace : owned.ptr);
  int parts = 0;
  dispatch_types(x_or_s.dtype, p.weight_dtype, [&](auto xk, auto wk) {
    constexpr StorageKind X = decltype(xk)::value, W = decltype(wk)::value;
    constexpr int VEC = vector_width<Elem<X>>();
    BwdArgs<X, W> a{static_cast<const Elem<X>*>(grad_y.data), grad_y.row_stride,
                    static_cast<const Elem<X>*>(x_or_s.data), x_or_s.row_stride,
                    static_cast<const Elem<X>*>(grad_residual_out.data),
                    grad_residual_out.row_stride, static_cast<Elem<X>*>(grad_x.data),
                    grad_x.row_stride, static_cast<const Elem<W>*>(p.weight), rstd, partial,
                    p.rows, p.hidden, p.zero_centered_gamma, 0};
    const bool vec = vectorisable(grad_y) && vectorisable(x_or_s) && vectorisable(grad_x) &&
                     vectorisable(grad_residual_out) && aligned_to(p.weight, kVectorBytes) &&
                     p.hidden % VEC == 0;
    const RowLayout l = vec ? row_layout(p.hidden / VEC, bwd_max_np<Elem<X>>(), FUSEDLOSS_RMS_BWD_TPR,
                                         FUSEDLOSS_RMS_BWD_BLOCK, kBwdMaxThreads)
                            : RowLayout{};
    if (l.np) {
      a.tpr = l.tpr;
      dispatch_np<bwd_max_np<Elem<X>>()>(l.np, [&](auto np) {
        auto* kernel = backward_rows_kernel<X, W, decltype(np)::value>;
        const int threads = l.tpr * l.groups;
        const int per_sm = std::min(kBwdBlocksPerSm, blocks_per_sm((const void*)kernel, threads));
        parts = int(std::min<int64_t>({int64_t(per_sm) * sm_count(), max_parts,
                                       (p.rows + l.groups - 1) / l.groups}));
        kernel<<<unsigned(parts), threads, 0, as_cuda(stream)>>>(a);
      });
    } else {
      a.tpr = kAnyThreads;
      parts = int(max_parts);
      backward_any_kernel<X, W><<<unsigned(parts), kAnyThreads, 0, as_cuda(stream)>>>(a);
    }
    FL_CUDA_CHECK_LAUNCH();
  });
  column_sum_kernel<<<grid_of((p.hidden + 31) / 32), 1024, 0, as_cuda(stream)>>>(
      partial, parts, p.hidden, grad_weight);
  FL_CUDA_CHECK_LAUNCH();
}

}  // namespace fusedloss::cuda

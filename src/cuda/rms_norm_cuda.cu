// CUDA RMSNorm.
//
// Forward ("rows" kernels): a group of tpr threads (a multiple of 32) owns one row at a time;
// each thread holds NP 16-byte vectors of the row in registers (vector p = t + k * tpr, so a
// warp's loads are contiguous), sums their squares, the group sums in a fixed order
// (reduce.cuh), and the thread scales its own vectors and stores them: x is read once, y
// written once, rstd 4 bytes per row. A block holds several groups when rows are short (small
// H: one warp per row). Rows of 512 threads and more (H >= 8192 in fp32, 16384 in 16-bit) are
// read twice instead ("reread" kernel): the first pass sums the squares, the second reads the
// row again from L1/L2 and stores y, so that a thread needs a few registers rather than the 64
// that cap an SM at one or two held rows (8192 x 16384 on the H200: fp32 1.31 -> 1.21x the
// floor, bf16 1.15 -> 1.11x; bench/NOTES.md).
//
// Backward ("rows" kernels): the same row-in-registers walk over x (or s) and dy, on a fixed
// grid of up to 4 blocks per SM (occupancy permitting), each block walking a strided set of
// rows. A row of more than 512 threads (fp32 H > 8192, 16-bit H > 16384) is split over a
// thread-block cluster (sm_90) of up to 8 equal blocks of whole warps, at most 512 threads
// each, each block holding its share of the row, the row's sum exchanged through distributed
// shared memory (cluster_sum_alternating), rather than held at 8 vectors a thread with half
// re-read (fp32 8192 x 16384: 1.74 -> 1.08x the floor). Rows whose warps admit no such split
// (17, 19, 23, ... or 34 warps: fp32 H 8196..8704, 9220..9728, ...) keep the 8-vector path, or
// in 16-bit the element-wise kernel. A thread owns the same columns in every row, so it
// accumulates dy * xhat for them in registers across its rows, and holds the weights of those columns, loaded once before its
// first row; at the end the block's groups add their accumulators in group
// order (shared memory) and the block writes one fp32 row of partials [grid, H]. A second small
// kernel adds the partial rows of each column in a fixed order (launched as a programmatic
// dependent of the row kernel: its launch overlaps the row kernel's tail, its reads wait for
// the row kernel's end). No float atomics anywhere: the weight gradient has the same bits on
// every call on a given device (the grid depends on the device's SM count, H and the tuning,
// never on timing).
//
// Synchronisation: only __syncthreads, reached by every thread of the block (the row loops'
// bounds are the block's, not the group's), and for split rows the cluster barrier, reached by
// every thread of the cluster (the blocks of a cluster walk the same rows), so the proof is
// short and compute-sanitizer racecheck checks all of it. Per row one barrier
// (group_sum_alternating: two scratch halves; none when a row is one warp: shuffles only); the accumulator exchange at the end has its own
// array and two barriers per slot. While a block waits at its barrier, HBM is kept busy by the
// other blocks of the SM (the default backward block is 128 threads, one or two rows, up to
// four blocks per SM that drift apart) and by an L2 prefetch of the group's next row (a hint, no
// shared state) issued as it starts a row. Groups with their own named barriers (bar.sync
// 1 + g, a thread count) were tried: racecheck reported hazards on the exchange that the code's
// ordering does not allow by reading, i.e. most likely its model of counted named barriers,
// but a design the tool cannot confirm is not shipped.
//
// Views that cannot be walked in 16-byte vectors (odd H, offset pointers, strides that are not
// a multiple of 16 bytes), and backward rows that neither one block nor a cluster holds (or on
// a device without clusters), go through the "any" kernels: one block per row, single
// elements, the row read twice (the second read mostly hits L1/L2), and in the backward the
// partial row of the block accumulated in global memory by the thread that owns each column.
//
// Aliasing (validated in src/api/rms_norm.cpp): in the forward no output overlaps an input or
// another output. In the backward grad_x may be exactly grad_y, x_or_s or grad_residual_out
// (the same view): every element is read by the thread that writes it, before it writes it, so
// those pointers are not __restrict__. The weight never overlaps an output and is read through
// the read-only path.
#include "cuda/rms_norm_cuda.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include "core/dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/dependent_launch.cuh"
#include "cuda/reduce.cuh"
#include "cuda/runtime.h"
#include "cuda/vector_io.cuh"

namespace fusedloss::cuda {
namespace {

using core::StorageKind;
using core::Elem;
using core::St;

constexpr int kFwdMaxThreads = 1024;  // launch bound: <= 64 registers a thread
constexpr int kBwdMaxThreads = 512;   // launch bound: <= 128 (the accumulators live in registers)
// Vectors per thread in the forward: 4 (16 registers of row data), within the 64 registers of
// the launch bound without spills (8 spilled with the residual add).
constexpr int kFwdMaxNp = 4;
// The backward holds x, dy, an fp32 accumulator per column and the weights (as stored): 4
// vectors a thread (16-bit rows: 16 + 16 + 32 registers, + 16 for 16-bit weights or 32 for
// fp32; fp32 rows: 16 + 16 + 16, + 8 to 16). fp32 rows that do not fit 512 threads that way
// (H 8196..16384) take 8: 8 accumulator vectors (32 registers), x, dy and the weights of 4 held
// (48; 2 on sm_80), the others read again in the second pass; no spills. 16-bit rows would need
// 64 accumulator registers: those rows (H > 16384) take the "any" kernels.
template <class T>
constexpr int bwd_long_np() {
  return sizeof(T) == 4 ? 8 : 4;
}
constexpr int kBwdPreferredNp = 4;
constexpr int kAnyThreads = 256;
// A backward row split over a thread-block cluster (sm_90): at most kMaxClusterBlocks blocks
// (the portable cluster size) and kMaxRowThreads threads in all, whose row sum needs
// 2 * kMaxRowThreads / 32 floats of scratch in each block.
constexpr int kMaxClusterBlocks = 8;
constexpr int kMaxRowThreads = 2048;

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
  bool prefetch;  // the group's next row into L2
  int tpr;        // threads per row: a multiple of 32 dividing blockDim.x
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
  bool prefetch;
  int tpr;    // threads per row in a block: a multiple of 32 dividing blockDim.x
  int split;  // blocks per row: 1, or a cluster of this many blocks of tpr threads each
};

// Where a thread sits: its group (a row at a time) in the block, its place in the row, and the
// rows its block (or cluster) walks. A row split over a cluster of `split` blocks is one group
// a block; block b of the cluster (rank b % split: a 1-D cluster's blocks are consecutive)
// holds the row's threads b * tpr ... (b + 1) * tpr - 1, so that a vector's place in the row,
// t + k * row, and the row sum's order are those of one block of split * tpr threads.
// kSplit: compiled for rows split over clusters (only the backward's 4-vector kernels are; the
// others keep split at 1 at compile time, and with it their registers).
template <bool kSplit>
struct RowThreads {
  int split, rank, groups, g, t, row;
  __device__ RowThreads(int tpr, int split_)
      : split(kSplit ? split_ : 1),
        rank(kSplit ? int(blockIdx.x) % split_ : 0),
        groups(int(blockDim.x) / tpr),
        g(int(threadIdx.x) / tpr),
        t(rank * tpr + int(threadIdx.x) % tpr),
        row(tpr * split) {}
  // This block's walk over the rows: the unit is the cluster (one block when split is 1).
  __device__ int64_t unit() const { return int64_t(blockIdx.x) / split; }
  __device__ int64_t first() const { return unit() * groups; }
  __device__ int64_t step() const { return int64_t(gridDim.x / split) * groups; }
  // Before the first row: every block of the cluster has started (its shared memory exists)
  // before any block writes into it. No block leaves early: each one's last row sum waits for
  // every other block's writes of that row.
  __device__ void enter() const {
    if constexpr (kSplit) {
      cluster_arrive();
      cluster_wait();
    }
  }
  // The row's sum, every thread of the block (cluster) calling it once per row.
  __device__ float sum(float v, float* scratch, int parity) const {
    if constexpr (kSplit) return cluster_sum_alternating(v, split, rank, scratch, parity);
    return group_sum_alternating(v, int(blockDim.x) / groups, scratch, parity);
  }
};

// ---- forward ----

template <StorageKind X, StorageKind W, int NP>
__global__ void __launch_bounds__(kFwdMaxThreads) forward_rows_kernel(FwdArgs<X, W> a) {
  constexpr int VEC = vector_width<Elem<X>>();
  __shared__ float scratch[2 * kFwdMaxThreads / 32];
  const RowThreads<false> rt(a.tpr, 1);
  const int t = rt.t, g = rt.g;
  const int nvec = int(a.hidden / VEC);  // rows this short fit the registers
  const int64_t step = rt.step();
  const int64_t row_bytes = a.hidden * int64_t(sizeof(Elem<X>));
  int parity = 0;
  // The loop bounds are the block's, not the group's: every thread reaches every row sum.
  for (int64_t base = rt.first(); base < a.rows; base += step, parity ^= 1) {
    const int64_t r = base + g;
    const bool live = r < a.rows;
    if (a.prefetch && t == 0 && r + step < a.rows) {
      prefetch_l2(a.x + (r + step) * a.xs, row_bytes);
      if (a.res) prefetch_l2(a.res + (r + step) * a.rs, row_bytes);
    }
    Vec16 v[NP] = {};  // zero bits are 0.0 in every storage kind: absent vectors add nothing
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const int p = t + k * rt.row;
      if (live && p < nvec) v[k] = load_vec(a.x + r * a.xs + p * VEC);
    }
    if (a.res) {
#pragma unroll
      for (int k = 0; k < NP; ++k) {
        const int p = t + k * rt.row;
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
    sq = rt.sum(sq, scratch, parity);
    const float rstd = core::rms_rstd(sq, a.hidden, a.eps);
    if (live && t == 0) a.rstd[r] = rstd;
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const int p = t + k * rt.row;
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

// Long rows: one block a row, the row read twice in 16-byte vectors instead of held in
// registers. The first pass sums the squares (kRereadUnroll vectors in flight a thread, with
// the residual: s stored as it goes), the second reads x (or s) again, from L1/L2 where the
// first pass just brought it, and stores y. HBM sees x once, as with the held rows, but a
// thread needs only a few registers, so an SM keeps many rows in flight (the held 4-vector
// rows of 16384 fp32 columns take a 1024-thread block at 64 registers: one row an SM).
constexpr int kRereadUnroll = 4;

template <StorageKind X, StorageKind W>
__global__ void __launch_bounds__(kFwdMaxThreads) forward_reread_kernel(FwdArgs<X, W> a) {
  constexpr int VEC = vector_width<Elem<X>>();
  __shared__ float scratch[2 * kFwdMaxThreads / 32];
  // int64 positions: the only vector kernel a row of 2^31 elements or more can reach
  const int64_t nvec = a.hidden / VEC, t = threadIdx.x, step = blockDim.x;
  int parity = 0;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x, parity ^= 1) {
    const Elem<X>* xr = a.x + r * a.xs;
    float sq = 0.0f;
    for (int64_t p0 = t; p0 < nvec; p0 += step * kRereadUnroll) {
      Vec16 v[kRereadUnroll];
#pragma unroll
      for (int u = 0; u < kRereadUnroll; ++u) {
        const int64_t p = p0 + u * step;
        v[u] = p < nvec ? load_vec(xr + p * VEC) : Vec16{};
      }
#pragma unroll
      for (int u = 0; u < kRereadUnroll; ++u) {
        const int64_t p = p0 + u * step;
        if (a.res && p < nvec) {
          float xf[VEC], rf[VEC];
          to_floats<X>(v[u], xf);
          to_floats<X>(load_vec(a.res + r * a.rs + p * VEC), rf);
#pragma unroll
          for (int e = 0; e < VEC; ++e) xf[e] += rf[e];
          v[u] = from_floats<X>(xf);  // s as stored: the second pass and the backward read it
          store_vec(a.s_out + r * a.ss + p * VEC, v[u]);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float f = get<X>(v[u], e);
          sq += f * f;
        }
      }
    }
    sq = group_sum_alternating(sq, blockDim.x, scratch, parity);
    const float rstd = core::rms_rstd(sq, a.hidden, a.eps);
    if (t == 0) a.rstd[r] = rstd;
    // this thread's own vectors again (s: its own stores)
    const Elem<X>* sr = a.res ? a.s_out + r * a.ss : xr;
    for (int64_t p = t; p < nvec; p += step) {
      const Vec16 v = load_vec(sr + p * VEC);
      float w[VEC], o[VEC];
      load_floats_ro<W, VEC>(a.w + p * VEC, w);
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        o[e] = core::rms_y(get<X>(v, e), rstd, core::rms_gamma(w[e], a.zc));
      store_vec(a.y + r * a.ys + p * VEC, from_floats<X>(o));
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

template <StorageKind X, StorageKind W, int NP, bool kSplit>
__global__ void __launch_bounds__(kBwdMaxThreads) backward_rows_kernel(BwdArgs<X, W> a) {
  allow_dependent_launch();  // the column sum's launch may start (it waits for this grid's end)
  constexpr int VEC = vector_width<Elem<X>>();
  __shared__ float scratch[2 * kMaxRowThreads / 32];
  const RowThreads<kSplit> rt(a.tpr, a.split);
  rt.enter();
  const int t = rt.t, g = rt.g, groups = rt.groups;
  const int nvec = int(a.hidden / VEC);  // rows this short fit the registers
  const int64_t step = rt.step();
  const int64_t row_bytes = a.hidden * int64_t(sizeof(Elem<X>));
  // x and dy of the first kHeld vectors stay in registers between the passes; the rest (fp32
  // rows of 8 vectors a thread: H 8196..16384, one group a block) are read again in the second
  // pass, from L1/L2 where the first pass just brought them: what keeps 8 accumulator vectors
  // within the registers without spills.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  constexpr int kLongHeld = 2;  // sm_80's register allocation spills at 3 and 4
#else
  constexpr int kLongHeld = 4;
#endif
  constexpr int kHeld = NP <= kBwdPreferredNp ? NP : kLongHeld;
  __shared__ float exchange[kBwdMaxThreads * VEC];
  float dg[NP][VEC] = {};
  // A thread's columns are the same in every row, so the weights of its held vectors are loaded
  // once, as stored, and held across rows: read per row they cost a load in each pass, the
  // second one after the row's reduction, where its latency (L2, once the streaming rows have
  // evicted them from L1) is on the row's critical path (3-8% of the backward on the H200,
  // bench/NOTES.md). fp16 rows of 4 vectors hold 2: with all 4, ptxas spills (112 bytes with
  // fp16 weights on sm_90; fp32 weights fit, but were not timed apart, so they hold 2 as well).
  constexpr int kHeldW = X == StorageKind::F16 && kHeld == 4 ? 2 : kHeld;
  Packed<W, VEC> wv[kHeldW] = {};
#pragma unroll
  for (int k = 0; k < kHeldW; ++k)
    if (t + k * rt.row < nvec) wv[k] = load_packed<W, VEC, true>(a.w + (t + k * rt.row) * VEC);
  // Vector k's weights as floats: held, or read now.
  auto weights = [&](int k, int p, float (&w)[VEC]) {
    if (k < kHeldW) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) w[e] = wv[k < kHeldW ? k : 0][e];
    } else {
      load_floats_ro<W, VEC>(a.w + p * VEC, w);
    }
  };
  int parity = 0;
  for (int64_t base = rt.first(); base < a.rows; base += step, parity ^= 1) {
    const int64_t r = base + g;
    const bool live = r < a.rows;
    if (a.prefetch && t == 0 && r + step < a.rows) {
      prefetch_l2(a.x + (r + step) * a.xs, row_bytes);
      prefetch_l2(a.dy + (r + step) * a.dys, row_bytes);
      if (a.gres) prefetch_l2(a.gres + (r + step) * a.gs, row_bytes);
    }
    // Vector k of x and dy (zeros past the row or on a dead row: they add nothing).
    auto load_xdy = [&](int k, Vec16& xk, Vec16& gk) {
      const int p = t + k * rt.row;
      if (live && p < nvec) {
        xk = load_vec(a.x + r * a.xs + p * VEC);
        gk = load_vec(a.dy + r * a.dys + p * VEC);
      }
    };
    Vec16 xv[kHeld] = {}, gv[kHeld] = {};
#pragma unroll
    for (int k = 0; k < kHeld; ++k) load_xdy(k, xv[k], gv[k]);
    const float rstd = live ? a.rstd[r] : 0.0f;
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const int p = t + k * rt.row;
      Vec16 xk = {}, gk = {};
      if (k < kHeld) xk = xv[k < kHeld ? k : 0], gk = gv[k < kHeld ? k : 0];
      else load_xdy(k, xk, gk);
      if (p < nvec) {
        float w[VEC];
        weights(k, p, w);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float xhat = get<X>(xk, e) * rstd, dy = get<X>(gk, e);
          dot += dy * core::rms_gamma(w[e], a.zc) * xhat;
          dg[k][e] += dy * xhat;
        }
      }
    }
    const float c =
        core::rms_dot_mean(rt.sum(dot, scratch, parity), a.hidden);
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const int p = t + k * rt.row;
      Vec16 xk = {}, gk = {};
      if (k < kHeld) xk = xv[k < kHeld ? k : 0], gk = gv[k < kHeld ? k : 0];
      else load_xdy(k, xk, gk);  // before this thread stores over them (in place)
      if (live && p < nvec) {
        float w[VEC], o[VEC], gr[VEC] = {};
        weights(k, p, w);
        if (a.gres) to_floats<X>(load_vec(a.gres + r * a.gs + p * VEC), gr);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          o[e] = core::rms_grad_s(get<X>(xk, e) * rstd, get<X>(gk, e),
                                  core::rms_gamma(w[e], a.zc), rstd, c) + gr[e];
        store_vec(a.dx + r * a.dxs + p * VEC, from_floats<X>(o));  // in place: read above
      }
    }
  }
  // The groups' accumulators, added in group order into group 0's, one vector slot at a time
  // (exchange is not the scratch: the row loop's last reads of it need no barrier here). A row
  // split over a cluster is one group a block, each block holding its own columns.
  const int tg = threadIdx.x % a.tpr;  // the thread's place in its group
#pragma unroll
  for (int k = 0; k < NP; ++k) {
    if (groups > 1) {  // uniform over the block
      __syncthreads();
      if (g > 0)
#pragma unroll
        for (int e = 0; e < VEC; ++e) exchange[((g - 1) * VEC + e) * a.tpr + tg] = dg[k][e];
      __syncthreads();
      if (g == 0)
        for (int h = 1; h < groups; ++h)
#pragma unroll
          for (int e = 0; e < VEC; ++e) dg[k][e] += exchange[((h - 1) * VEC + e) * a.tpr + tg];
    }
    const int p = t + k * rt.row;
    if (g == 0 && p < nvec) {
      float* out = a.partial + rt.unit() * a.hidden + p * VEC;
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
// 32 columns x 32 row slices per block; the fp32 sum rounded once into the weight gradient's
// dtype (a 16-bit weight's gradient needs no conversion pass after this one).
template <StorageKind G>
__global__ void __launch_bounds__(1024) column_sum_kernel(const float* partial, int parts,
                                                          int64_t hidden, Elem<G>* out) {
  wait_for_preceding_grid();  // the partial rows are complete and visible past this
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
    out[c] = St<G>::store(total);
  }
}

// ---- host side ----

// Overlapped only where the column sum's wait is compiled in: without it, its reads would not
// be ordered after the row kernel's writes. (Every instantiation of it is built for the same
// architectures, so the fp32 one answers for all.)
bool column_sum_overlapped(const RmsNormTuning& tune) {
  return tune.bwd_overlap_sum &&
         built_for_sm90(reinterpret_cast<const void*>(column_sum_kernel<StorageKind::F32>));
}

// The tuning in force (set_rms_norm_tuning); read once per call.
std::mutex g_tuning_mutex;
RmsNormTuning g_tuning;

RmsNormTuning current_tuning() {
  std::lock_guard<std::mutex> lock(g_tuning_mutex);
  return g_tuning;
}

// The backward's partial rows at most: the grid never exceeds this.
int64_t max_partial_rows(int64_t rows, const RmsNormTuning& t) {
  return std::min<int64_t>(int64_t(t.bwd_blocks_per_sm) * sm_count(), std::max<int64_t>(rows, 1));
}

struct RowLayout {
  int np = 0;        // vectors per thread; 0: the rows do not fit, use the "any" kernels
  int tpr = 0;       // threads per row in a block
  int groups = 0;    // rows per block at a time
  int split = 1;     // blocks per row (a cluster when > 1)
  int clusters = 0;  // split > 1: the clusters the device keeps resident
};

// Threads for a row of `nvec` vectors at `np` a thread, in whole warps.
int64_t row_threads(int64_t nvec, int np) { return ((nvec + np - 1) / np + 31) / 32 * 32; }

// NP: the smallest power of two up to `preferred_np` giving a row <= target_tpr threads; beyond
// it (up to max_np) only while the row does not fit: max_block threads, or with clusters
// (cluster_threads > 0) kMaxRowThreads. A row of preferred_np vectors a thread and more than
// cluster_threads (or max_block) threads is split over the fewest blocks (at most
// kMaxClusterBlocks) of equal whole warps that bring each to at most that many (or failing
// that, to max_block); a row whose warps no such count divides is not split (17 warps: fp32
// H 8196..8704 stay at 8 vectors a thread). Only those kernels are compiled for clusters.
// Blocks gather rows up to block_target threads.
RowLayout row_layout(int64_t nvec, int preferred_np, int max_np, int target_tpr, int block_target,
                     int max_block, int cluster_threads) {
  const int max_row = cluster_threads > 0 ? kMaxRowThreads : max_block;
  int np = 1;
  while (np < preferred_np && row_threads(nvec, np) > target_tpr) np *= 2;
  while (np < max_np && row_threads(nvec, np) > max_row) np *= 2;
  if (row_threads(nvec, np) > max_row) return {};
  const int t = int(row_threads(nvec, np));
  int split = 0, block = 0;
  const bool may_split = cluster_threads > 0 && np == preferred_np;
  for (int pass = 0; pass < 2 && split == 0; ++pass) {
    const int most = pass == 0 && may_split ? std::min(cluster_threads, max_block) : max_block;
    for (int s = 1; s <= (may_split ? kMaxClusterBlocks : 1) && split == 0; ++s)
      if (t % (32 * s) == 0 && t / s <= most) split = s, block = t / s;
  }
  if (split == 0) return {};
  return {np, block, split > 1 || np > preferred_np ? 1 : std::max(1, block_target / t), split};
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

// The backward's row layout for rows of `hidden` columns (`vec`: the views can be walked in
// vectors) on the current device: split over clusters where the tuning asks for it and the
// device (and the build) runs the split kernel; {} for the element-wise kernel.
template <StorageKind X, StorageKind W>
RowLayout backward_layout(int64_t hidden, bool vec, const RmsNormTuning& tune) {
  if (!vec) return {};
  auto layout = [&](int cluster_threads) {
    return row_layout(hidden / vector_width<Elem<X>>(), kBwdPreferredNp, bwd_long_np<Elem<X>>(),
                      tune.bwd_tpr, tune.bwd_block, kBwdMaxThreads, cluster_threads);
  };
  RowLayout clustered = layout(tune.bwd_cluster_threads);
  if (clustered.np && clustered.split == 1) return clustered;  // as without clusters
  if (clustered.np) {
    clustered.clusters = max_active_clusters(
        (const void*)backward_rows_kernel<X, W, kBwdPreferredNp, true>, clustered.tpr,
        clustered.split, 0);
    if (clustered.clusters > 0) return clustered;
  }
  // no cluster layout (a row of 17 warps), or none this device runs: a row a block, 8 vectors
  // a thread for fp32 rows that need them, else the element-wise kernel
  return layout(0);
}

unsigned grid_of(int64_t blocks) { return unsigned(std::clamp<int64_t>(blocks, 1, int64_t(1) << 30)); }

}  // namespace

RmsNormTuning rms_norm_tuning() { return current_tuning(); }

void set_rms_norm_tuning(const RmsNormTuning& t) {
  auto in = [](const char* field, int v, int lo, int hi, int multiple) {
    detail::require(v >= lo && v <= hi && v % multiple == 0, "RmsNormTuning.", field, ": got ", v,
                    ", expected ", lo, "..", hi, multiple > 1 ? " in multiples of 32" : "");
  };
  in("fwd_tpr", t.fwd_tpr, 32, kFwdMaxThreads, 32);
  in("fwd_block", t.fwd_block, 32, kFwdMaxThreads, 32);
  in("fwd_blocks_per_sm", t.fwd_blocks_per_sm, 0, 64, 1);
  in("bwd_tpr", t.bwd_tpr, 32, kBwdMaxThreads, 32);
  in("bwd_block", t.bwd_block, 32, kBwdMaxThreads, 32);
  in("bwd_blocks_per_sm", t.bwd_blocks_per_sm, 1, 16, 1);
  in("fwd_reread_from", t.fwd_reread_from, 0, kMaxRowThreads, 32);
  in("fwd_reread_block", t.fwd_reread_block, 0, kFwdMaxThreads, 32);
  in("bwd_cluster_threads", t.bwd_cluster_threads, 0, kBwdMaxThreads, 32);
  std::lock_guard<std::mutex> lock(g_tuning_mutex);
  g_tuning = t;
}

RmsNormTuning parse_rms_norm_tuning(const std::string& spec) {
  RmsNormTuning t;
  const std::pair<const char*, int*> ints[] = {
      {"fwd_tpr", &t.fwd_tpr}, {"fwd_block", &t.fwd_block},
      {"fwd_blocks_per_sm", &t.fwd_blocks_per_sm}, {"bwd_tpr", &t.bwd_tpr},
      {"bwd_block", &t.bwd_block}, {"bwd_blocks_per_sm", &t.bwd_blocks_per_sm},
      {"fwd_reread_from", &t.fwd_reread_from}, {"fwd_reread_block", &t.fwd_reread_block},
      {"bwd_cluster_threads", &t.bwd_cluster_threads}};
  const std::pair<const char*, bool*> flags[] = {{"fwd_prefetch", &t.fwd_prefetch},
                                                 {"bwd_prefetch", &t.bwd_prefetch},
                                                 {"bwd_overlap_sum", &t.bwd_overlap_sum}};
  size_t at = 0;
  while (at < spec.size()) {
    const size_t end = std::min(spec.find(',', at), spec.size());
    const std::string item = spec.substr(at, end - at);
    at = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    const std::string val = eq == std::string::npos ? "" : item.substr(eq + 1);
    char* stop = nullptr;
    const long v = std::strtol(val.c_str(), &stop, 10);
    detail::require(!val.empty() && *stop == '\0', "RmsNormTuning: '", item,
                    "': expected field=integer");
    bool known = false;
    for (auto& [name, field] : ints)
      if (key == name)  // out-of-range values stay out of range for the check
        *field = int(std::clamp<long>(v, -1, 1L << 20)), known = true;
    for (auto& [name, field] : flags)
      if (key == name) {
        detail::require(v == 0 || v == 1, "RmsNormTuning.", key, ": got ", v, ", expected 0 or 1");
        *field = v == 1, known = true;
      }
    detail::require(known, "RmsNormTuning: unknown field '", key, "'");
  }
  return t;
}

// A caller's workspace is sized by the shipped tuning, whatever set_rms_norm_tuning says now
// or at the call: a tuning changed between the size query and the backward must not make the
// backward write past it. The backward caps its partial rows at this bound with or without a
// caller's workspace, so that both add the weight gradient in the same order (the same bits).
int64_t workspace_partial_rows(int64_t rows) { return max_partial_rows(rows, RmsNormTuning{}); }

size_t rms_norm_workspace_bytes(int64_t rows, int64_t hidden) {
  return size_t(workspace_partial_rows(rows)) * size_t(hidden) * sizeof(float);
}

void rms_norm_forward(const MatrixView& x, const core::RmsNormParams& p, const MatrixView& y,
                      float* rstd, const MatrixView& residual, const MatrixView& residual_out,
                      Stream stream) {
  if (p.rows == 0) return;
  const RmsNormTuning tune = current_tuning();
  dispatch_types(x.dtype, p.weight_dtype, [&](auto xk, auto wk) {
    constexpr StorageKind X = decltype(xk)::value, W = decltype(wk)::value;
    constexpr int VEC = vector_width<Elem<X>>();
    FwdArgs<X, W> a{static_cast<const Elem<X>*>(x.data), x.row_stride,
                    static_cast<const Elem<X>*>(residual.data), residual.row_stride,
                    static_cast<Elem<X>*>(y.data), y.row_stride,
                    static_cast<Elem<X>*>(residual_out.data), residual_out.row_stride,
                    static_cast<const Elem<W>*>(p.weight), rstd, p.rows, p.hidden, p.eps,
                    p.zero_centered_gamma, tune.fwd_prefetch, 0};
    const bool vec = rows_vectorisable(x) && rows_vectorisable(y) && rows_vectorisable(residual) &&
                     rows_vectorisable(residual_out) && aligned_to(p.weight, kVectorBytes) &&
                     p.hidden % VEC == 0;
    // Rows whose held layout takes fwd_reread_from threads or more, and rows no held layout
    // fits, are read twice, by blocks of as many threads as the held layout would have (each
    // thread 4 vectors a pass) up to a block's limit, or fwd_reread_block.
    const int64_t held_threads = row_threads(p.hidden / VEC, kFwdMaxNp);
    const RowLayout l = vec && (tune.fwd_reread_from == 0 || held_threads < tune.fwd_reread_from)
                            ? row_layout(p.hidden / VEC, kFwdMaxNp, kFwdMaxNp, tune.fwd_tpr,
                                         tune.fwd_block, kFwdMaxThreads, 0)
                            : RowLayout{};
    if (l.np) {
      a.tpr = l.tpr;
      dispatch_np<kFwdMaxNp>(l.np, [&](auto np) {
        auto* kernel = forward_rows_kernel<X, W, decltype(np)::value>;
        const int threads = l.tpr * l.groups;
        int64_t blocks = (p.rows + l.groups - 1) / l.groups;
        if (tune.fwd_blocks_per_sm > 0) {  // persistent: the blocks resident at once
          const int per_sm =
              std::min(tune.fwd_blocks_per_sm, blocks_per_sm((const void*)kernel, threads));
          blocks = std::min<int64_t>(blocks, int64_t(per_sm) * sm_count());
        }
        kernel<<<grid_of(blocks), threads, 0, as_cuda(stream)>>>(a);
      });
    } else if (vec) {
      const int threads = tune.fwd_reread_block > 0
                              ? tune.fwd_reread_block
                              : int(std::min<int64_t>(held_threads, kFwdMaxThreads));
      forward_reread_kernel<X, W><<<grid_of(p.rows), threads, 0, as_cuda(stream)>>>(a);
    } else {
      a.tpr = kAnyThreads;
      forward_any_kernel<X, W><<<grid_of(p.rows), kAnyThreads, 0, as_cuda(stream)>>>(a);
    }
    FL_CUDA_CHECK_LAUNCH();
  });
}

void rms_norm_backward(const MatrixView& grad_y, const MatrixView& x_or_s,
                       const core::RmsNormParams& p, const float* rstd, const MatrixView& grad_x,
                       void* grad_weight, DType grad_weight_dtype, void* workspace,
                       const MatrixView& grad_residual_out, Stream stream) {
  if (p.rows == 0) {  // zeros: all-zero bits in every float dtype
    FL_CUDA_CHECK(cudaMemsetAsync(grad_weight, 0, detail::element_size(grad_weight_dtype) * p.hidden,
                                  as_cuda(stream)));
    return;
  }
  const RmsNormTuning tune = current_tuning();
  const int64_t max_parts =
      std::min(max_partial_rows(p.rows, tune), workspace_partial_rows(p.rows));
  // the partials: the caller's workspace, or scratch given back on every exit
  const ScratchBuffer owned(workspace ? 0 : sizeof(float) * max_parts * p.hidden, stream);
  float* partial = static_cast<float*>(workspace ? workspace : owned.get());
  int parts = 0;
  dispatch_types(x_or_s.dtype, p.weight_dtype, [&](auto xk, auto wk) {
    constexpr StorageKind X = decltype(xk)::value, W = decltype(wk)::value;
    constexpr int VEC = vector_width<Elem<X>>();
    BwdArgs<X, W> a{static_cast<const Elem<X>*>(grad_y.data), grad_y.row_stride,
                    static_cast<const Elem<X>*>(x_or_s.data), x_or_s.row_stride,
                    static_cast<const Elem<X>*>(grad_residual_out.data),
                    grad_residual_out.row_stride, static_cast<Elem<X>*>(grad_x.data),
                    grad_x.row_stride, static_cast<const Elem<W>*>(p.weight), rstd, partial,
                    p.rows, p.hidden, p.zero_centered_gamma, tune.bwd_prefetch, 0, 1};
    const bool vec = rows_vectorisable(grad_y) && rows_vectorisable(x_or_s) && rows_vectorisable(grad_x) &&
                     rows_vectorisable(grad_residual_out) && aligned_to(p.weight, kVectorBytes) &&
                     p.hidden % VEC == 0;
    const RowLayout l = backward_layout<X, W>(p.hidden, vec, tune);
    if (l.np) {
      dispatch_np<bwd_long_np<Elem<X>>()>(l.np, [&](auto np) {
        constexpr int NP = decltype(np)::value;
        auto* kernel = backward_rows_kernel<X, W, NP, false>;
        if constexpr (NP == kBwdPreferredNp)
          if (l.split > 1) kernel = backward_rows_kernel<X, W, NP, true>;
        // only the kSplit kernels index partial rows by cluster
        detail::require(l.split == 1 || NP == kBwdPreferredNp, "RMSNorm internal: a ", NP,
                        "-vector row layout split over ", l.split, " blocks");
        const int threads = l.tpr * l.groups;
        // the grid's units (blocks, or clusters) resident at once: one partial row each
        const int64_t resident =
            l.split > 1
                ? std::min<int64_t>(l.clusters, int64_t(tune.bwd_blocks_per_sm) * sm_count() / l.split)
                : int64_t(std::min(tune.bwd_blocks_per_sm, blocks_per_sm((const void*)kernel, threads))) *
                      sm_count();
        parts = int(std::min<int64_t>({std::max<int64_t>(resident, 1), max_parts,
                                       (p.rows + l.groups - 1) / l.groups}));
        a.tpr = l.tpr;
        a.split = l.split;
        if (l.split > 1)
          launch_in_clusters(kernel, unsigned(parts * l.split), threads, l.split, 0, stream, a);
        else
          kernel<<<unsigned(parts), threads, 0, as_cuda(stream)>>>(a);
      });
    } else {
      a.tpr = kAnyThreads;
      parts = int(max_parts);
      backward_any_kernel<X, W><<<unsigned(parts), kAnyThreads, 0, as_cuda(stream)>>>(a);
    }
    FL_CUDA_CHECK_LAUNCH();
  });
  core::dispatch_dtype(grad_weight_dtype, [&](auto gk) {
    constexpr StorageKind G = decltype(gk)::value;
    launch_dependent(column_sum_kernel<G>, dim3(grid_of((p.hidden + 31) / 32)), dim3(1024),
                     as_cuda(stream), column_sum_overlapped(tune),
                     static_cast<const float*>(partial), parts, p.hidden,
                     static_cast<Elem<G>*>(grad_weight));
  });
}

bool rms_norm_column_sum_overlapped() { return column_sum_overlapped(rms_norm_tuning()); }

int rms_norm_backward_row_split(int64_t hidden, DType dtype, DType weight_dtype) {
  int split = 1;
  dispatch_types(dtype, weight_dtype, [&](auto xk, auto wk) {
    constexpr StorageKind X = decltype(xk)::value, W = decltype(wk)::value;
    const bool vec = hidden % vector_width<Elem<X>>() == 0;  // a contiguous, aligned view
    split = std::max(backward_layout<X, W>(hidden, vec, current_tuning()).split, 1);
  });
  return split;
}

}  // namespace fusedloss::cuda

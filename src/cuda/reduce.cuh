// The one block reduction of the CUDA kernels: fixed-order combines across threads, so the same
// inputs give the same bits on every run (no atomics, no order that depends on scheduling).
// Any value made of 32-bit words combines: a float sum, the cross-entropy's (max, sum-exp,
// sum) triple, a (double, count) pair.
#pragma once
#include <cstdint>
#include <cstring>
#include "cuda/bulk_copy.cuh"

namespace fusedloss::cuda {

// v from the lane `off` away (xor), word by word.
template <class T>
__device__ __forceinline__ T shfl_xor(const T& v, int off) {
  static_assert(sizeof(T) % 4 == 0, "whole 32-bit words");
  constexpr int kWords = int(sizeof(T)) / 4;
  uint32_t w[kWords];
  memcpy(w, &v, sizeof(T));
#pragma unroll
  for (int i = 0; i < kWords; ++i) w[i] = __shfl_xor_sync(0xffffffffu, w[i], off);
  T out;
  memcpy(&out, w, sizeof(T));
  return out;
}

// op over the 32 lanes of a warp by an xor butterfly. With a commutative op (float addition)
// every lane ends with the same bits: at each step the two partners combine the same two
// values; otherwise each lane's result is still the same on every run.
template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = op(v, shfl_xor(v, off));
  return v;
}

// op over each group of `group_threads` consecutive threads of the block (a multiple of 32
// dividing blockDim.x; blockDim.x itself for one group per block). Every thread of the block
// must call it (it synchronises the block twice); every thread of a group gets the group's
// result, the same bits: warp results, then the group's warps combined in warp order
// (((w0 op w1) op w2) ...). `scratch` holds blockDim.x / 32 values of shared memory.
template <class T, class Op>
__device__ __forceinline__ T group_reduce(T v, Op op, int group_threads, T* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = warp_reduce(v, op);
  if (group_threads == 32) return v;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = group_threads / 32, first = (threadIdx.x / group_threads) * warps;
  T r = scratch[first];
  for (int w = 1; w < warps; ++w) r = op(r, scratch[first + w]);
  __syncthreads();  // the scratch may be reused right after
  return r;
}

// op over the whole block; `scratch` holds blockDim.x / 32 values.
template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T* scratch) {
  return group_reduce(v, op, blockDim.x, scratch);
}

struct Plus {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, Plus{}); }
__device__ __forceinline__ float group_sum(float v, int group_threads, float* scratch) {
  return group_reduce(v, Plus{}, group_threads, scratch);
}

// group_sum with one block barrier instead of two, for a loop that sums once per iteration:
// `scratch` holds 2 * blockDim.x / 32 floats and `parity` alternates between iterations (0, 1,
// 0, ...), every thread of the block calling it with the same value. Why one barrier is enough:
// iteration i writes half i % 2, meets the barrier, then reads it; the next write to that half
// (iteration i + 2) comes after iteration i + 1's barrier, which no thread passes before it has
// finished its reads of iteration i. Only __syncthreads orders the slots (no named barriers,
// no thread-count arguments), so compute-sanitizer racecheck models all of it. Same order and
// bits as group_sum.
__device__ __forceinline__ float group_sum_alternating(float v, int group_threads, float* scratch,
                                                       int parity) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = warp_sum(v);
  if (group_threads == 32) return v;
  float* half = scratch + parity * (blockDim.x / 32);
  if (lane == 0) half[warp] = v;
  __syncthreads();
  const int warps = group_threads / 32, first = (threadIdx.x / group_threads) * warps;
  float s = 0.0f;
  for (int w = 0; w < warps; ++w) s += half[first + w];
  return s;
}

// group_sum_alternating for a row split over the `split` blocks of a thread-block cluster
// (sm_90; `rank`: this block's place in it; one group a block, and every thread of every block
// of the cluster calls it, as often as the others). Each warp's sum goes into slot
// rank * warps + warp of every block's `scratch` (distributed shared memory), one cluster
// barrier, then each thread adds all split * warps slots in order: the order and bits of
// group_sum_alternating over one group of split * blockDim.x threads, the thread of the
// row at rank * blockDim.x + threadIdx.x. `scratch` holds 2 * split * blockDim.x / 32 floats.
// Why `parity` makes one barrier enough, as above: a block writes a half again only two calls
// later, after the next call's cluster barrier, which no block passes before every block of
// the cluster has arrived at it, i.e. finished its reads of this one. Only the writes cross
// blocks, and they precede the barrier: a block may exit after its last call.
__device__ __forceinline__ float cluster_sum_alternating(float v, int split, int rank,
                                                         float* scratch, int parity) {
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  float* half = scratch + parity * split * warps;
  if (threadIdx.x % 32 == 0)
    for (int b = 0; b < split; ++b) store_to_cluster_block(&half[rank * warps + warp], b, v);
  cluster_arrive();
  cluster_wait();
  float s = 0.0f;
  for (int w = 0; w < split * warps; ++w) s += half[w];
  return s;
}

// Sum over the whole block; `scratch` holds blockDim.x / 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  return block_reduce(v, Plus{}, scratch);
}

}  // namespace fusedloss::cuda

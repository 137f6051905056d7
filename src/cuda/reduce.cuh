// Fixed-order sums across threads: the same inputs give the same bits on every run (no
// atomics, no order that depends on scheduling).
#pragma once

namespace fusedloss::cuda {

// Sum over the 32 lanes of a warp by an xor butterfly. Every lane ends with the same bits: at
// each step the two partners add the same two values (float addition is commutative).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over each group of `group_threads` consecutive threads of the block (a multiple of 32
// dividing blockDim.x; blockDim.x itself for one group per block). Every thread of the block
// must call it (it synchronises the block twice); every thread of a group gets the group's sum,
// the same bits: warp sums, then the group's warps added in warp order. `scratch` holds
// blockDim.x / 32 floats of shared memory.
__device__ __forceinline__ float group_sum(float v, int group_threads, float* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = warp_sum(v);
  if (group_threads == 32) return v;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = group_threads / 32, first = (threadIdx.x / group_threads) * warps;
  float s = 0.0f;
  for (int w = 0; w < warps; ++w) s += scratch[first + w];
  __syncthreads();  // the scratch may be reused right after
  return s;
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

// Sum over the whole block; `scratch` holds blockDim.x / 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  return group_sum(v, blockDim.x, scratch);
}

}  // namespace fusedloss::cuda

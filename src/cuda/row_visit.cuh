// One block walks one row: scalar head up to the first 16-byte boundary, 16-byte vectors
// (UNROLL loads in flight per thread before any is used), scalar tail. Handles odd widths,
// unaligned bases and any row stride with the same code.
#pragma once
#include <cstdint>

namespace fusedloss::cuda {

template <class T>
__device__ __forceinline__ int64_t head_to_alignment(const T* row, int64_t n) {
  auto addr = reinterpret_cast<uintptr_t>(row);
  if (addr % sizeof(T) != 0) return n;  // not even element-aligned: all scalar
  int64_t head = int64_t((16 - addr % 16) % 16) / int64_t(sizeof(T));
  return head < n ? head : n;
}

// Plain loads (not __ldg): the backward may write the same row in place.
// on_scalar(j) for single elements, on_vector(j, uint4 raw) for 16-byte vectors at column j.
// vectorise = false forces the scalar path (e.g. when an output has another alignment).
template <class T, int THREADS, int UNROLL, class OnScalar, class OnVector>
__device__ __forceinline__ void visit_row(const T* row, int64_t n, bool vectorise,
                                          OnScalar&& on_scalar, OnVector&& on_vector) {
  constexpr int VEC = 16 / sizeof(T);
  const int tid = threadIdx.x;
  const int64_t head = vectorise ? head_to_alignment(row, n) : n;
  for (int64_t j = tid; j < head; j += THREADS) on_scalar(j);
  const int64_t nvec = (n - head) / VEC;
  const uint4* vec = reinterpret_cast<const uint4*>(row + head);
  int64_t i = tid;
  for (; i + (UNROLL - 1) * THREADS < nvec; i += UNROLL * THREADS) {
    uint4 raw[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) raw[u] = vec[i + u * THREADS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) on_vector(head + (i + u * THREADS) * VEC, raw[u]);
  }
  for (; i < nvec; i += THREADS) on_vector(head + i * VEC, vec[i]);
  for (int64_t j = head + nvec * VEC + tid; j < n; j += THREADS) on_scalar(j);
}

// Unpack a 16-byte vector of storage elements to floats.
template <class S, int VEC>
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[VEC]) {
  const auto* e = reinterpret_cast<const typename S::type*>(&raw);
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = S::load(e[k]);
}

template <class S, int VEC>
__device__ __forceinline__ uint4 pack(const float (&in)[VEC]) {
  uint4 raw;
  auto* e = reinterpret_cast<typename S::type*>(&raw);
#pragma unroll
  for (int k = 0; k < VEC; ++k) e[k] = S::store(in[k]);
  return raw;
}

}  // namespace fusedloss::cuda

// 16-byte vector access for the CUDA kernels: one vector type (four 32-bit words, so that a
// vector of 16-bit or 8-bit elements occupies four registers, not one register per element),
// loads and stores, element access by storage kind (core::Storage: fp32, fp16, bf16, e4m3),
// and the host-side test of whether a view can be walked in vectors at all (base, row stride
// and width on the 16-byte boundary).
//
// A kernel that walks rows in vectors also needs a path for views that fail the test (odd
// widths, offset pointers, strides that are not a multiple of 16 bytes): the test is per call.
#pragma once
#include <cstdint>
#include "core/numeric.h"

namespace fusedloss::cuda {

constexpr int kVectorBytes = 16;

struct alignas(16) Vec16 {
  uint32_t w[4];
};

// Elements of T in one vector: 4 fp32, 8 fp16/bf16, 16 e4m3.
template <class T>
constexpr int vector_width() {
  return kVectorBytes / int(sizeof(T));
}

// Plain loads and stores: right for memory that a thread of the same kernel may also write
// (in-place gradients). load_vec_ro reads through the read-only path: only for inputs that no
// output of the launch overlaps (weights, biases).
template <class T>
__device__ __forceinline__ Vec16 load_vec(const T* p) {
  return *reinterpret_cast<const Vec16*>(p);
}
template <class T>
__device__ __forceinline__ Vec16 load_vec_ro(const T* p) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  return Vec16{{u.x, u.y, u.z, u.w}};
}
template <class T>
__device__ __forceinline__ void store_vec(T* p, const Vec16& v) {
  *reinterpret_cast<Vec16*>(p) = v;
}

// A hint: start bringing `bytes` bytes at p into L2 (sm_90's bulk prefetch: one instruction for
// a whole row; nothing on older chips), so that HBM keeps streaming a row a thread will load
// later while it reduces or stores the current one. p 16-byte aligned, bytes a multiple of 16
// (spans over 2^30 bytes are cut there). No effect on results, and no shared memory: L2 is
// coherent, so prefetching memory that the launch writes later (in-place gradients) is harmless.
__device__ __forceinline__ void prefetch_l2(const void* p, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int64_t kMax = int64_t(1) << 30;
  const uint32_t n = uint32_t(bytes < kMax ? bytes : kMax);
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(n) : "memory");
#else
  (void)p, (void)bytes;
#endif
}

// Element e (a compile-time index in unrolled loops) of storage kind K, as a float; and the
// vector of N = vector_width floats stored back in K, rounded once.
template <core::StorageKind K>
__device__ __forceinline__ float get(const Vec16& v, int e) {
  using T = typename core::Storage<K>::type;
  constexpr int per_word = 4 / int(sizeof(T));
  const uint32_t word = v.w[e / per_word];
  if constexpr (per_word == 1) {
    return core::Storage<K>::load(__uint_as_float(word));
  } else {
    constexpr int bits = 8 * int(sizeof(T));
    return core::Storage<K>::load(T(word >> (bits * (e % per_word))));
  }
}

template <core::StorageKind K, int N>
__device__ __forceinline__ void to_floats(const Vec16& v, float (&out)[N]) {
  static_assert(N == vector_width<typename core::Storage<K>::type>(), "one vector");
#pragma unroll
  for (int e = 0; e < N; ++e) out[e] = get<K>(v, e);
}

template <core::StorageKind K, int N>
__device__ __forceinline__ Vec16 from_floats(const float (&in)[N]) {
  using T = typename core::Storage<K>::type;
  static_assert(N == vector_width<T>(), "one vector");
  constexpr int per_word = 4 / int(sizeof(T));
  Vec16 v;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if constexpr (per_word == 1) {
      v.w[q] = __float_as_uint(core::Storage<K>::store(in[q]));
    } else {
      uint32_t word = 0;
#pragma unroll
      for (int k = 0; k < per_word; ++k)
        word |= uint32_t(core::Storage<K>::store(in[q * per_word + k])) << (8 * sizeof(T) * k);
      v.w[q] = word;
    }
  }
  return v;
}

// N consecutive read-only values of kind K at p, as floats: whole 16-byte vectors, or one 8-
// or 4-byte access when N elements are fewer bytes (a bf16 weight next to an fp32 row: 4
// values, 8 bytes). p must be aligned to min(16, N * sizeof(element)) bytes.
template <core::StorageKind K, int N>
__device__ __forceinline__ void load_floats_ro(const typename core::Storage<K>::type* p,
                                               float (&out)[N]) {
  using T = typename core::Storage<K>::type;
  constexpr int W = vector_width<T>();
  if constexpr (N >= W) {
    static_assert(N % W == 0, "whole vectors");
#pragma unroll
    for (int q = 0; q < N; q += W) {
      const Vec16 v = load_vec_ro(p + q);
#pragma unroll
      for (int e = 0; e < W; ++e) out[q + e] = get<K>(v, e);
    }
  } else {
    static_assert(N * sizeof(T) == 8 || N * sizeof(T) == 4, "8 or 4 bytes");
    Vec16 v{};
    if constexpr (N * sizeof(T) == 8) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
      v.w[0] = u.x, v.w[1] = u.y;
    } else {
      v.w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    }
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = get<K>(v, e);
  }
}

// ---- host side ----

inline bool aligned_to(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % uint64_t(bytes) == 0;
}

// Whether rows of `cols` elements of `elem_bytes` each, `row_stride` elements apart from
// `data`, can be walked in 16-byte vectors: the base, every row start and the width on a
// 16-byte boundary. Absent views (data == nullptr) pass.
inline bool rows_vectorisable(const void* data, int64_t cols, int64_t row_stride,
                              int64_t elem_bytes) {
  if (!data) return true;
  const int64_t width = kVectorBytes / elem_bytes;
  return aligned_to(data, kVectorBytes) && cols % width == 0 &&
         (row_stride * elem_bytes) % kVectorBytes == 0;
}

}  // namespace fusedloss::cuda

// 16-byte vector access for the CUDA kernels, the one home for it: one vector type (four
// 32-bit words, so that a vector of 16-bit or 8-bit elements occupies four registers, not one
// register per element), loads and stores (whole vectors, or one narrower access for fewer
// elements), element access by storage kind (core::Storage: fp32, fp16, bf16, e4m3), the row
// walk of the one-block-per-row kernels, and the host-side tests of whether a view can be
// walked in vectors at all (base, row stride and width on the boundary).
//
// A kernel that walks rows in whole vectors also needs a path for views that fail the test
// (odd widths, offset pointers, strides that are not a multiple of 16 bytes): the test is per
// call. walk_row needs none: it walks any row start.
#pragma once
#include <cstdint>
#include "common/error.h"
#include "core/numeric.h"
#include "fusedloss/types.h"

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

// The stored bits of element e of a vector (the rest of its word kept): how from_floats
// builds a vector, and how a kernel stores values it rounded itself (the e4m3 copy).
template <class T>
__device__ __forceinline__ void set_bits(Vec16& v, int e, T bits) {
  constexpr int per_word = 4 / int(sizeof(T));
  if constexpr (per_word == 1) {
    uint32_t word;
    memcpy(&word, &bits, 4);
    v.w[e] = word;
  } else {
    constexpr int bits_per = 8 * int(sizeof(T));
    const int shift = bits_per * (e % per_word);
    const uint32_t mask = ((1u << bits_per) - 1u) << shift;
    v.w[e / per_word] = (v.w[e / per_word] & ~mask) | (uint32_t(bits) << shift);
  }
}

// x stored in K (rounded once) as element e of a vector: a kernel packs each result as it
// computes it, so no array of N floats stays live before the store.
template <core::StorageKind K>
__device__ __forceinline__ void put(Vec16& v, int e, float x) {
  set_bits(v, e, core::Storage<K>::store(x));
}

// N <= vector_width floats stored in K, rounded once, as the first N elements of a vector
// (the rest zero).
template <core::StorageKind K, int N>
__device__ __forceinline__ Vec16 from_floats(const float (&in)[N]) {
  static_assert(N <= vector_width<typename core::Storage<K>::type>(), "one vector");
  Vec16 v{};
#pragma unroll
  for (int e = 0; e < N; ++e) put<K>(v, e, in[e]);
  return v;
}

// B bytes (1, 2, 4, 8 or 16) at p, aligned to B, as the low bytes of a vector (the rest zero),
// and back. kReadOnly reads through the read-only path (see load_vec_ro).
template <int B, bool kReadOnly = false>
__device__ __forceinline__ Vec16 load_bytes(const void* p) {
  static_assert(B == 1 || B == 2 || B == 4 || B == 8 || B == 16, "one access");
  Vec16 v{};
  if constexpr (B == 16) {
    v = kReadOnly ? load_vec_ro(static_cast<const uint8_t*>(p)) : load_vec(static_cast<const uint8_t*>(p));
  } else if constexpr (B == 8) {
    const uint2 u = kReadOnly ? __ldg(static_cast<const uint2*>(p)) : *static_cast<const uint2*>(p);
    v.w[0] = u.x, v.w[1] = u.y;
  } else if constexpr (B == 4) {
    v.w[0] = kReadOnly ? __ldg(static_cast<const unsigned int*>(p)) : *static_cast<const unsigned int*>(p);
  } else if constexpr (B == 2) {
    v.w[0] = kReadOnly ? __ldg(static_cast<const unsigned short*>(p)) : *static_cast<const unsigned short*>(p);
  } else {
    v.w[0] = kReadOnly ? __ldg(static_cast<const unsigned char*>(p)) : *static_cast<const unsigned char*>(p);
  }
  return v;
}
template <int B>
__device__ __forceinline__ void store_bytes(void* p, const Vec16& v) {
  static_assert(B == 1 || B == 2 || B == 4 || B == 8 || B == 16, "one access");
  if constexpr (B == 16) {
    *static_cast<Vec16*>(p) = v;
  } else if constexpr (B == 8) {
    *static_cast<uint2*>(p) = make_uint2(v.w[0], v.w[1]);
  } else if constexpr (B == 4) {
    *static_cast<uint32_t*>(p) = v.w[0];
  } else if constexpr (B == 2) {
    *static_cast<uint16_t*>(p) = uint16_t(v.w[0]);
  } else {
    *static_cast<uint8_t*>(p) = uint8_t(v.w[0]);
  }
}

// N consecutive values of kind K at p, kept as stored (16-bit kinds: two a register) and read
// as floats by index: what a kernel loads once and holds across rows (a weight), converting an
// element where it uses it. p must be aligned to min(16, N * sizeof(element)) bytes.
// kReadOnly: read-only inputs only (see load_vec_ro).
template <core::StorageKind K, int N>
struct Packed {
  using T = typename core::Storage<K>::type;
  static constexpr int kPerVec = vector_width<T>();
  Vec16 v[(N + kPerVec - 1) / kPerVec];
  __device__ __forceinline__ float operator[](int e) const { return get<K>(v[e / kPerVec], e % kPerVec); }
};
template <core::StorageKind K, int N, bool kReadOnly = false>
__device__ __forceinline__ Packed<K, N> load_packed(const typename core::Storage<K>::type* p) {
  using T = typename core::Storage<K>::type;
  constexpr int W = vector_width<T>();
  Packed<K, N> out;
  if constexpr (N >= W) {
    static_assert(N % W == 0, "whole vectors");
#pragma unroll
    for (int q = 0; q < N; q += W) out.v[q / W] = load_bytes<kVectorBytes, kReadOnly>(p + q);
  } else {
    out.v[0] = load_bytes<N * int(sizeof(T)), kReadOnly>(p);
  }
  return out;
}

// N consecutive values of kind K at p, as floats: whole 16-byte vectors, or one access of N
// elements when they are fewer bytes (a bf16 weight next to an fp32 row: 4 values, 8 bytes; a
// single element). Alignment and kReadOnly as load_packed.
template <core::StorageKind K, int N, bool kReadOnly = false>
__device__ __forceinline__ void load_floats(const typename core::Storage<K>::type* p,
                                            float (&out)[N]) {
  const Packed<K, N> v = load_packed<K, N, kReadOnly>(p);
#pragma unroll
  for (int e = 0; e < N; ++e) out[e] = v[e];
}
template <core::StorageKind K, int N>
__device__ __forceinline__ void load_floats_ro(const typename core::Storage<K>::type* p,
                                               float (&out)[N]) {
  load_floats<K, N, true>(p, out);
}
// ---- the row walk ----

// Where a row's vector body starts: the first 256-byte boundary in the row (two L2 lines), so
// that a warp's 32 vectors cover whole lines. Measured on an H200 (bf16, 8192 rows,
// bench/NOTES.md): the cross-entropy in place at V = 50257 ran at 1.17x its floor with the body
// on the first 16-byte boundary, 1.07x on 128 bytes, 1.06x on 256 and 512; at V = 131073,
// 1.19x, 1.05x, 1.02x and 1.02x. Rows that start on the boundary walk as before.
#ifndef FUSEDLOSS_ROW_ALIGN_BYTES
#define FUSEDLOSS_ROW_ALIGN_BYTES 256
#endif
constexpr int kRowAlignBytes = FUSEDLOSS_ROW_ALIGN_BYTES;
static_assert(kRowAlignBytes % kVectorBytes == 0, "the body starts on a vector boundary");

// Elements of T before the body's boundary in a row of n (all n when the row is not even
// element-aligned).
template <class T>
__device__ __forceinline__ int64_t head_to_alignment(const T* row, int64_t n) {
  const auto addr = reinterpret_cast<uintptr_t>(row);
  if (addr % sizeof(T) != 0) return n;
  const int64_t head = int64_t((kRowAlignBytes - addr % kRowAlignBytes) % kRowAlignBytes) / int64_t(sizeof(T));
  return head < n ? head : n;
}

// One block of THREADS threads walks one row of n elements, whatever its start address: a
// scalar head up to the body's boundary, 16-byte vectors for the body, a scalar tail.
// on_scalar(j, bits) gets the stored element at column j, on_vector(j, v) the vector at
// columns [j, j + vector_width), j on a vector boundary.
//
// Loads in flight: every thread issues its UNROLL vector loads of a step before the step's
// first callback, the last step of a row too (predicated), and loads its head and tail
// elements (at most kHeadSlots and one) with that last step. A row whose length is not a
// multiple of the step, or that starts off the boundary, keeps the aligned rows' loads in
// flight: no serial latency for the remainder, head or tail.
//
// In place: a callback may write the row it was given (the same columns), since each column is
// loaded before its callback runs and no two callbacks share a column. Plain loads, not the
// read-only path, for that reason.
//
// vectorise = false walks single elements (UNROLL in flight per thread): for a caller whose
// output row sits at another 16-byte alignment than the input row, so that writes in vectors
// would not land on the boundary.
//
// walk_row_from takes the body's loads from load_body(body, i), the i-th vector after the head
// (a kernel that kept part of the row in shared memory reads it from there); walk_row loads
// them from the row.
template <class T, int THREADS, int UNROLL, class LoadBody, class OnScalar, class OnVector>
__device__ __forceinline__ void walk_row_from(const T* row, int64_t n, bool vectorise,
                                              LoadBody&& load_body, OnScalar&& on_scalar,
                                              OnVector&& on_vector) {
  constexpr int W = vector_width<T>();
  constexpr int64_t kStep = int64_t(THREADS) * UNROLL;
  static_assert(THREADS >= W, "a thread owns at most one tail element");
  constexpr int kHeadSlots = (kRowAlignBytes / int(sizeof(T)) - 1 + THREADS - 1) / THREADS;
  const int tid = threadIdx.x;
  const int64_t head = vectorise ? head_to_alignment(row, n) : n;
  if (head == n) {
    for (int64_t j0 = 0; j0 < n; j0 += kStep) {
      T raw[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t j = j0 + tid + int64_t(u) * THREADS;
        if (j < n) raw[u] = row[j];
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t j = j0 + tid + int64_t(u) * THREADS;
        if (j < n) on_scalar(j, raw[u]);
      }
    }
    return;
  }
  const int64_t nvec = (n - head) / W;
  const T* body = row + head;
  // Whole steps, then the last one (1 to kStep vectors) with the head and the tail.
  int64_t i0 = 0;
  for (; i0 + kStep < nvec; i0 += kStep) {
    Vec16 raw[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) raw[u] = load_body(body, i0 + tid + int64_t(u) * THREADS);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) on_vector(head + (i0 + tid + int64_t(u) * THREADS) * W, raw[u]);
  }
  const int64_t rest = nvec - i0 - tid;  // this thread's last-step vectors: ceil(rest / THREADS)
  const int mine = rest > 0 ? int((rest + THREADS - 1) / THREADS) : 0;
  const int64_t tail = head + nvec * W;
  const bool has_tail = tid < int(n - tail);  // the tail is shorter than a vector
  Vec16 raw[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u)
    if (u < mine) raw[u] = load_body(body, i0 + tid + int64_t(u) * THREADS);
  T head_bits[kHeadSlots];
#pragma unroll
  for (int h = 0; h < kHeadSlots; ++h)
    if (tid + h * THREADS < head) head_bits[h] = row[tid + h * THREADS];
  const T tail_bits = has_tail ? row[tail + tid] : T{};
#pragma unroll
  for (int u = 0; u < UNROLL; ++u)
    if (u < mine) on_vector(head + (i0 + tid + int64_t(u) * THREADS) * W, raw[u]);
#pragma unroll
  for (int h = 0; h < kHeadSlots; ++h)
    if (tid + h * THREADS < head) on_scalar(int64_t(tid + h * THREADS), head_bits[h]);
  if (has_tail) on_scalar(tail + tid, tail_bits);
}

template <class T, int THREADS, int UNROLL, class OnScalar, class OnVector>
__device__ __forceinline__ void walk_row(const T* row, int64_t n, bool vectorise,
                                         OnScalar&& on_scalar, OnVector&& on_vector) {
  walk_row_from<T, THREADS, UNROLL>(
      row, n, vectorise,
      [](const T* body, int64_t i) { return load_vec(body + i * vector_width<T>()); }, on_scalar,
      on_vector);
}

// ---- host side ----

inline bool aligned_to(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % uint64_t(bytes) == 0;
}

// Whether rows of `cols` elements of `elem_bytes` each, `row_stride` elements apart from
// `data`, can be walked in accesses of `access` elements: the base, every row start and the
// width on that boundary. Absent views (data == nullptr) pass.
inline bool rows_aligned(const void* data, int64_t cols, int64_t row_stride, int64_t elem_bytes,
                         int64_t access) {
  if (!data) return true;
  return aligned_to(data, access * elem_bytes) && cols % access == 0 && row_stride % access == 0;
}

// Whether every row of a view starts on the 16-byte boundary (whatever its width).
inline bool row_starts_aligned(const void* data, int64_t row_stride, int64_t elem_bytes) {
  return aligned_to(data, kVectorBytes) && (row_stride * elem_bytes) % kVectorBytes == 0;
}

// rows_aligned for a view: absent or empty views pass, a single row's stride is never used.
inline bool rows_aligned(const MatrixView& m, int64_t access) {
  if (!m.data || m.rows == 0) return true;
  return rows_aligned(m.data, m.cols, m.rows > 1 ? m.row_stride : m.cols,
                      detail::element_size(m.dtype), access);
}

// The same for whole 16-byte vectors.
inline bool rows_vectorisable(const MatrixView& m) {
  return rows_aligned(m, kVectorBytes / detail::element_size(m.dtype));
}

}  // namespace fusedloss::cuda

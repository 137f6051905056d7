// CUDA SwiGLU over the fused gate-up layout, one block per row, VEC elements per access
// (16-byte vectors from vector_io.cuh when every row and half is aligned, single elements
// otherwise).
//
// Bytes per row: forward reads 2n and writes n (+2n bytes of e4m3 with the fp8 store);
// backward reads n + 2n and writes 2n. The bias gradient reads the written gradient once more.
#include "cuda/swiglu_cuda.h"

#include "core/dispatch.h"
#include "core/swiglu_math.h"
#include "cuda/cuda_check.h"
#include "cuda/reduce.cuh"
#include "cuda/vector_io.cuh"

namespace fusedloss::cuda {
namespace {

using core::StorageKind;
using core::Elem;
using core::St;

// Build-time knobs for bench/swiglu_variants.sh; the defaults are the shipped kernels.
#ifndef FUSEDLOSS_SWIGLU_THREADS
#define FUSEDLOSS_SWIGLU_THREADS 256
#endif
// Column groups per thread in flight: a thread loads the packs of kGroups column groups before
// computing any of them, so kGroups 16-byte loads per input are outstanding at once.
#ifndef FUSEDLOSS_SWIGLU_GROUPS
#define FUSEDLOSS_SWIGLU_GROUPS 1
#endif
constexpr int kThreads = FUSEDLOSS_SWIGLU_THREADS;
constexpr int kGroups = FUSEDLOSS_SWIGLU_GROUPS;
// An optional register cap: at least this many resident blocks per SM.
#ifdef FUSEDLOSS_SWIGLU_MIN_BLOCKS
#define FL_SWIGLU_BOUNDS __launch_bounds__(kThreads, FUSEDLOSS_SWIGLU_MIN_BLOCKS)
#else
#define FL_SWIGLU_BOUNDS __launch_bounds__(kThreads)
#endif

// VEC consecutive elements of T as stored, in one access (vector_io.cuh): a whole 16-byte
// vector, or a single element on the unvectorised path (VEC = 1).
template <class T, int VEC>
constexpr int kAccessBytes = VEC * int(sizeof(T));

// The stored gate and up values of columns [j, j + VEC) of one row.
struct RawGateUp {
  Vec16 g, u;
};

template <class T, int VEC>
__device__ __forceinline__ RawGateUp load_raw(const T* yr, int64_t j, int64_t n) {
  return {load_bytes<kAccessBytes<T, VEC>>(yr + j), load_bytes<kAccessBytes<T, VEC>>(yr + n + j)};
}

// VEC bias values at columns [j, j + VEC), in V's storage type or fp32 (a uniform branch; the
// fp32 y case has one kind only). can_vectorise checked the bias base for 16-byte alignment.
template <StorageKind V, int VEC>
__device__ __forceinline__ void load_bias(const core::SwigluParams& p, int64_t j,
                                          float (&out)[VEC]) {
  if constexpr (V != StorageKind::F32) {
    if (p.bias_f32) {
      load_floats<StorageKind::F32, VEC>(static_cast<const float*>(p.bias) + j, out);
      return;
    }
  }
  load_floats<V, VEC>(static_cast<const Elem<V>*>(p.bias) + j, out);
}

// VEC gate/up values at columns [j, j + VEC) from their stored values, bias added, clamped.
template <StorageKind Y, StorageKind V, int VEC>
__device__ __forceinline__ void gate_up_values(const RawGateUp& raw, int64_t j,
                                               const core::SwigluParams& p, core::GateUp (&v)[VEC]) {
  float bg[VEC] = {}, bu[VEC] = {};
  if (p.bias) {
    load_bias<V, VEC>(p, j, bg);
    load_bias<V, VEC>(p, p.n + j, bu);
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k)
    v[k] = core::gate_up(get<Y>(raw.g, k) + bg[k], get<Y>(raw.u, k) + bu[k], p.clamp);
}

// Calls f(k, j) for this thread's column groups k = 0 .. kGroups-1, at columns
// j = j0 + k * stride, while j < n. The kernels run it twice per step: all loads, then all math.
template <class F>
__device__ __forceinline__ void for_each_group(int64_t j0, int64_t stride, int64_t n, F&& f) {
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int64_t j = j0 + k * stride;
    if (j >= n) break;
    f(k, j);
  }
}

template <StorageKind V, int VEC, bool kFp8Store>
__global__ void FL_SWIGLU_BOUNDS
    forward_kernel(const Elem<V>* y, int64_t ys, core::SwigluParams p, Elem<V>* out, int64_t os,
                   uint8_t* y8, int64_t y8s) {
  constexpr int64_t kStride = int64_t(kThreads) * VEC;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const Elem<V>* yr = y + r * ys;
    const float w = p.weights ? p.weights[r] : 1.0f;
    for (int64_t j0 = int64_t(threadIdx.x) * VEC; j0 < p.n; j0 += kGroups * kStride) {
      RawGateUp raw[kGroups];
      for_each_group(j0, kStride, p.n,
                     [&](int k, int64_t j) { raw[k] = load_raw<Elem<V>, VEC>(yr, j, p.n); });
      for_each_group(j0, kStride, p.n, [&](int k, int64_t j) {
        core::GateUp v[VEC];
        gate_up_values<V, V, VEC>(raw[k], j, p, v);
        Vec16 o{};
#pragma unroll
        for (int e = 0; e < VEC; ++e) put<V>(o, e, core::swiglu_value(v[e]) * w);
        store_bytes<kAccessBytes<Elem<V>, VEC>>(out + r * os + j, o);
        if constexpr (kFp8Store) {
          // the raw input (before bias), as Megatron saves it, with the caller's overflow rule
          Vec16 fg{}, fu{};
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            set_bits(fg, e, core::float_to_e4m3(get<V>(raw[k].g, e), p.fp8_saturate));
            set_bits(fu, e, core::float_to_e4m3(get<V>(raw[k].u, e), p.fp8_saturate));
          }
          store_bytes<kAccessBytes<uint8_t, VEC>>(y8 + r * y8s + j, fg);
          store_bytes<kAccessBytes<uint8_t, VEC>>(y8 + r * y8s + p.n + j, fu);
        }
      });
    }
  }
}

template <StorageKind Y, StorageKind V, int VEC, bool kWeights>
__global__ void FL_SWIGLU_BOUNDS
    backward_kernel(const Elem<V>* go, int64_t gos, const Elem<Y>* y, int64_t ys,
                    core::SwigluParams p, Elem<V>* gy, int64_t gys, float* grad_weights) {
  constexpr int64_t kStride = int64_t(kThreads) * VEC;
  __shared__ float scratch[kThreads / 32];
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const Elem<Y>* yr = y + r * ys;
    const Elem<V>* gor = go + r * gos;
    Elem<V>* gr = gy + r * gys;
    const float w = kWeights ? p.weights[r] : 1.0f;
    float dw = 0.0f;
    for (int64_t j0 = int64_t(threadIdx.x) * VEC; j0 < p.n; j0 += kGroups * kStride) {
      RawGateUp raw[kGroups];
      Vec16 g[kGroups];
      for_each_group(j0, kStride, p.n, [&](int k, int64_t j) {
        raw[k] = load_raw<Elem<Y>, VEC>(yr, j, p.n);
        g[k] = load_bytes<kAccessBytes<Elem<V>, VEC>>(gor + j);
      });
      for_each_group(j0, kStride, p.n, [&](int k, int64_t j) {
        core::GateUp v[VEC];
        gate_up_values<Y, V, VEC>(raw[k], j, p, v);
        Vec16 da{}, db{};
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float ge = get<V>(g[k], e);
          float dae, dbe;
          const float value = core::swiglu_grad(v[e], ge * w, dae, dbe);
          if (kWeights) dw += value * ge;
          put<V>(da, e, dae);
          put<V>(db, e, dbe);
        }
        // in place: this thread read these columns above
        store_bytes<kAccessBytes<Elem<V>, VEC>>(gr + j, da);
        store_bytes<kAccessBytes<Elem<V>, VEC>>(gr + p.n + j, db);
      });
    }
    if constexpr (kWeights) {
      const float sum = block_sum(dw, scratch);  // fixed order: deterministic
      if (threadIdx.x == 0) grad_weights[r] = sum;
    }
  }
}

// Bias gradient: column sums of the stored gradient in two fixed-order stages.
constexpr int64_t kRowsPerChunk = 256;
template <StorageKind V>
__global__ void column_partial_kernel(const Elem<V>* g, int64_t gs, int64_t rows, int64_t cols,
                                      float* partial) {
  int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  int64_t r0 = blockIdx.y * kRowsPerChunk, r1 = min(rows, r0 + kRowsPerChunk);
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) s += St<V>::load(g[r * gs + c]);
  partial[blockIdx.y * cols + c] = s;
}

__global__ void column_final_kernel(const float* partial, int64_t chunks, int64_t cols, float* out) {
  int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) s += partial[k * cols + c];
  out[c] = s;
}

// VEC-element accesses need every row start and both halves on a VEC boundary (16 bytes for
// y's dtype, fewer for the e4m3 copy), and the bias on 16 bytes.
bool can_vectorise(const core::SwigluParams& p, int vec, std::initializer_list<const MatrixView*> views) {
  if (p.n % vec) return false;
  for (const MatrixView* m : views)
    if (!rows_aligned(*m, vec)) return false;
  return !p.bias || aligned_to(p.bias, kVectorBytes);
}

unsigned row_grid(int64_t rows) { return unsigned(std::min<int64_t>(rows, 1 << 30)); }

// Calls launch(width, flag) with both as compile-time constants: VEC-wide packs when `wide`
// (single elements otherwise), and the kernel's one optional feature on or off.
template <int VEC, class Launch>
void dispatch_layout(bool wide, bool flag, Launch&& launch) {
  auto with_flag = [&](auto width) {
    if (flag) launch(width, std::true_type{});
    else launch(width, std::false_type{});
  };
  if (wide) with_flag(std::integral_constant<int, VEC>{});
  else with_flag(std::integral_constant<int, 1>{});
}

}  // namespace

void swiglu_forward(const MatrixView& y, const core::SwigluParams& p, const MatrixView& out,
                    const MatrixView& y_fp8, Stream stream) {
  if (p.rows == 0) return;
  core::dispatch_dtype(y.dtype, [&](auto k) {
    constexpr StorageKind V = decltype(k)::value;
    constexpr int VEC = vector_width<Elem<V>>();
    auto launch = [&](auto vec_c, auto fp8_c) {
      forward_kernel<V, decltype(vec_c)::value, decltype(fp8_c)::value>
          <<<row_grid(p.rows), kThreads, 0, as_cuda(stream)>>>(
              static_cast<const Elem<V>*>(y.data), y.row_stride, p,
              static_cast<Elem<V>*>(out.data), out.row_stride, static_cast<uint8_t*>(y_fp8.data),
              y_fp8.row_stride);
    };
    dispatch_layout<VEC>(can_vectorise(p, VEC, {&y, &out, &y_fp8}), y_fp8.data != nullptr, launch);
    FL_CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward(const MatrixView& grad_out, const MatrixView& y, const core::SwigluParams& p,
                     const MatrixView& grad_y, float* grad_weights, float* grad_bias,
                     Stream stream) {
  if (p.rows == 0) {
    if (grad_bias) FL_CUDA_CHECK(cudaMemsetAsync(grad_bias, 0, sizeof(float) * 2 * p.n, as_cuda(stream)));
    return;
  }
  core::dispatch_dtype(grad_y.dtype, [&](auto k) {
    constexpr StorageKind V = decltype(k)::value;
    constexpr int VEC = vector_width<Elem<V>>();
    auto run = [&](auto y_kind) {
      constexpr StorageKind Y = decltype(y_kind)::value;
      auto launch = [&](auto vec_c, auto w_c) {
        backward_kernel<Y, V, decltype(vec_c)::value, decltype(w_c)::value>
            <<<row_grid(p.rows), kThreads, 0, as_cuda(stream)>>>(
                static_cast<const Elem<V>*>(grad_out.data), grad_out.row_stride,
                static_cast<const Elem<Y>*>(y.data), y.row_stride, p,
                static_cast<Elem<V>*>(grad_y.data), grad_y.row_stride, grad_weights);
      };
      dispatch_layout<VEC>(can_vectorise(p, VEC, {&grad_out, &y, &grad_y}), grad_weights != nullptr,
                           launch);
      FL_CUDA_CHECK_LAUNCH();
    };
    if (y.dtype == DType::FP8_E4M3) run(std::integral_constant<StorageKind, StorageKind::E4M3>{});
    else run(std::integral_constant<StorageKind, V>{});
    if (grad_bias) {
      const int64_t cols = 2 * p.n, chunks = (p.rows + kRowsPerChunk - 1) / kRowsPerChunk;
      const ScratchBuffer partials(sizeof(float) * cols * chunks, stream);
      float* partial = partials.as<float>();
      dim3 grid(unsigned((cols + 255) / 256), unsigned(chunks));
      column_partial_kernel<V><<<grid, 256, 0, as_cuda(stream)>>>(
          static_cast<const Elem<V>*>(grad_y.data), grad_y.row_stride, p.rows, cols, partial);
      FL_CUDA_CHECK_LAUNCH();
      column_final_kernel<<<unsigned((cols + 255) / 256), 256, 0, as_cuda(stream)>>>(partial, chunks,
                                                                                cols, grad_bias);
      FL_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace fusedloss::cuda

// CUDA SwiGLU over the fused gate-up layout, one block per row, VEC elements per access
// (16-byte accesses when every row and half is aligned, single elements otherwise).
//
// Bytes per row: forward reads 2n and writes n (+2n bytes of e4m3 with the fp8 store);
// backward reads n + 2n and writes 2n. The bias gradient reads the written gradient once more.
#include "cuda/swiglu_cuda.h"

#include <algorithm>

#include "core/dispatch.h"
#include "core/swiglu_math.h"
#include "cuda/cuda_check.h"

namespace fusedloss::cuda {
namespace {

using core::StorageKind;
template <StorageKind K>
using Elem = typename core::Storage<K>::type;
template <StorageKind K>
using St = core::Storage<K>;

constexpr int kMaxThreads = 256;
constexpr int kUnroll = 4;  // column groups per thread whose loads are all issued before any use

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}
template <class T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// Gate/up values of VEC columns from their raw packs, bias added.
template <StorageKind Y, StorageKind V, int VEC>
__device__ __forceinline__ core::GateUp gate_up_at(const Pack<Elem<Y>, VEC>& g,
                                                   const Pack<Elem<Y>, VEC>& u, int k, int64_t j,
                                                   const core::SwigluArgs& a) {
  float gk = St<Y>::load(g.v[k]), uk = St<Y>::load(u.v[k]);
  if (a.bias) {
    auto* b = static_cast<const Elem<V>*>(a.bias);
    gk += St<V>::load(b[j + k]);
    uk += St<V>::load(b[a.n + j + k]);
  }
  return core::gate_up(gk, uk, a.params);
}

// Each thread owns column groups base + u * stride, u < kUnroll (stride = blockDim * VEC).
#define FL_FOR_GROUPS(u, j, base, stride, n) \
  _Pragma("unroll") for (int u = 0; u < kUnroll; ++u) \
    if (const int64_t j = (base) + u * (stride); j < (n))

template <StorageKind V, int VEC, bool kFp8Store>
__global__ void __launch_bounds__(kMaxThreads)
    forward_kernel(const Elem<V>* y, int64_t ys, core::SwigluArgs a, Elem<V>* out, int64_t os,
                   uint8_t* y8, int64_t y8s) {
  const int64_t stride = int64_t(blockDim.x) * VEC;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const Elem<V>* yr = y + r * ys;
    const float w = a.weights ? a.weights[r] : 1.0f;
    for (int64_t base = int64_t(threadIdx.x) * VEC; base < a.n; base += stride * kUnroll) {
      Pack<Elem<V>, VEC> g[kUnroll], u[kUnroll];
      FL_FOR_GROUPS(k, j, base, stride, a.n) {
        g[k] = load_pack<Elem<V>, VEC>(yr + j);
        u[k] = load_pack<Elem<V>, VEC>(yr + a.n + j);
      }
      FL_FOR_GROUPS(k, j, base, stride, a.n) {
        Pack<Elem<V>, VEC> o;
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          o.v[e] = St<V>::store(core::swiglu_value(gate_up_at<V, V, VEC>(g[k], u[k], e, j, a)) * w);
        store_pack(out + r * os + j, o);
        if constexpr (kFp8Store) {  // the raw input (before bias), as Megatron saves it
          Pack<uint8_t, VEC> fg, fu;
#pragma unroll
          for (int e = 0; e < VEC; ++e)
            fg.v[e] = core::float_to_e4m3(St<V>::load(g[k].v[e])),
            fu.v[e] = core::float_to_e4m3(St<V>::load(u[k].v[e]));
          store_pack(y8 + r * y8s + j, fg);
          store_pack(y8 + r * y8s + a.n + j, fu);
        }
      }
    }
  }
}

template <StorageKind Y, StorageKind V, int VEC, bool kWeights>
__global__ void __launch_bounds__(kMaxThreads)
    backward_kernel(const Elem<V>* go, int64_t gos, const Elem<Y>* y, int64_t ys,
                    core::SwigluArgs a, Elem<V>* gy, int64_t gys, float* grad_weights) {
  __shared__ float warp_sums[kMaxThreads / 32];
  const int64_t stride = int64_t(blockDim.x) * VEC;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const Elem<Y>* yr = y + r * ys;
    Elem<V>* gr = gy + r * gys;
    const float w = kWeights ? a.weights[r] : 1.0f;
    float dw = 0.0f;
    for (int64_t base = int64_t(threadIdx.x) * VEC; base < a.n; base += stride * kUnroll) {
      Pack<Elem<Y>, VEC> g[kUnroll], u[kUnroll];
      Pack<Elem<V>, VEC> d[kUnroll];
      FL_FOR_GROUPS(k, j, base, stride, a.n) {
        g[k] = load_pack<Elem<Y>, VEC>(yr + j);
        u[k] = load_pack<Elem<Y>, VEC>(yr + a.n + j);
        d[k] = load_pack<Elem<V>, VEC>(go + r * gos + j);
      }
      // in place: every column this thread overwrites was loaded above
      FL_FOR_GROUPS(k, j, base, stride, a.n) {
        Pack<Elem<V>, VEC> da, db;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          core::GateUp v = gate_up_at<Y, V, VEC>(g[k], u[k], e, j, a);
          float ge = St<V>::load(d[k].v[e]), dae, dbe;
          core::swiglu_grad(v, ge * w, dae, dbe);
          if (kWeights) dw += core::swiglu_value(v) * ge;
          da.v[e] = St<V>::store(dae);
          db.v[e] = St<V>::store(dbe);
        }
        store_pack(gr + j, da);
        store_pack(gr + a.n + j, db);
      }
    }
    if constexpr (kWeights) {
      // fixed-order block sum: deterministic
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) dw += __shfl_xor_sync(0xffffffffu, dw, off);
      if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = dw;
      __syncthreads();
      if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int k = 0; k < int(blockDim.x / 32); ++k) s += warp_sums[k];
        grad_weights[r] = s;
      }
      __syncthreads();
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

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// 16-byte accesses need every row start, both halves and the bias on a VEC boundary.
bool can_vectorise(const core::SwigluArgs& a, int vec, std::initializer_list<const MatrixView*> views) {
  if (a.n % vec) return false;
  for (const MatrixView* m : views) {
    if (!m->data) continue;
    int64_t es = detail::element_size(m->dtype);
    if (!aligned(m->data, vec * es) || (m->row_stride * es) % (vec * es)) return false;
  }
  if (a.bias && !aligned(a.bias, 16)) return false;
  return true;
}

unsigned row_grid(int64_t rows) { return unsigned(std::min<int64_t>(rows, 1 << 30)); }

// Just enough threads (a multiple of 32) for one pass of kUnroll groups over the row.
unsigned row_threads(int64_t n, int vec) {
  int64_t groups = (n + vec - 1) / vec, want = (groups + kUnroll - 1) / kUnroll;
  return unsigned(std::clamp<int64_t>((want + 31) / 32 * 32, 32, kMaxThreads));
}

}  // namespace

void swiglu_forward(const MatrixView& y, const core::SwigluArgs& a, const MatrixView& out,
                    const MatrixView& y_fp8, Stream stream) {
  if (a.rows == 0) return;
  core::dispatch_dtype(y.dtype, [&](auto k) {
    constexpr StorageKind V = decltype(k)::value;
    constexpr int VEC = 16 / sizeof(Elem<V>);
    auto launch = [&](auto vec_c, auto fp8_c) {
      forward_kernel<V, decltype(vec_c)::value, decltype(fp8_c)::value>
          <<<row_grid(a.rows), row_threads(a.n, decltype(vec_c)::value), 0, as_cuda(stream)>>>(
              static_cast<const Elem<V>*>(y.data), y.row_stride, a,
              static_cast<Elem<V>*>(out.data), out.row_stride, static_cast<uint8_t*>(y_fp8.data),
              y_fp8.row_stride);
    };
    const bool vec = can_vectorise(a, VEC, {&y, &out, &y_fp8});
    const bool f8 = y_fp8.data != nullptr;
    using One = std::integral_constant<int, 1>;
    using Wide = std::integral_constant<int, VEC>;
    if (vec && f8) launch(Wide{}, std::true_type{});
    else if (vec) launch(Wide{}, std::false_type{});
    else if (f8) launch(One{}, std::true_type{});
    else launch(One{}, std::false_type{});
    FL_CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward(const MatrixView& grad_out, const MatrixView& y, const core::SwigluArgs& a,
                     const MatrixView& grad_y, float* grad_weights, float* grad_bias,
                     Stream stream) {
  if (a.rows == 0) {
    if (grad_bias) FL_CUDA_CHECK(cudaMemsetAsync(grad_bias, 0, sizeof(float) * 2 * a.n, as_cuda(stream)));
    return;
  }
  core::dispatch_dtype(grad_y.dtype, [&](auto k) {
    constexpr StorageKind V = decltype(k)::value;
    constexpr int VEC = 16 / sizeof(Elem<V>);
    auto run = [&](auto y_kind) {
      constexpr StorageKind Y = decltype(y_kind)::value;
      auto launch = [&](auto vec_c, auto w_c) {
        backward_kernel<Y, V, decltype(vec_c)::value, decltype(w_c)::value>
            <<<row_grid(a.rows), row_threads(a.n, decltype(vec_c)::value), 0, as_cuda(stream)>>>(
                static_cast<const Elem<V>*>(grad_out.data), grad_out.row_stride,
                static_cast<const Elem<Y>*>(y.data), y.row_stride, a,
                static_cast<Elem<V>*>(grad_y.data), grad_y.row_stride, grad_weights);
      };
      const bool vec = can_vectorise(a, VEC, {&grad_out, &y, &grad_y});
      using One = std::integral_constant<int, 1>;
      using Wide = std::integral_constant<int, VEC>;
      if (vec && grad_weights) launch(Wide{}, std::true_type{});
      else if (vec) launch(Wide{}, std::false_type{});
      else if (grad_weights) launch(One{}, std::true_type{});
      else launch(One{}, std::false_type{});
      FL_CUDA_CHECK_LAUNCH();
    };
    if (y.dtype == DType::FP8_E4M3) run(std::integral_constant<StorageKind, StorageKind::E4M3>{});
    else run(std::integral_constant<StorageKind, V>{});
    if (grad_bias) {
      const int64_t cols = 2 * a.n, chunks = (a.rows + kRowsPerChunk - 1) / kRowsPerChunk;
      float* partial = static_cast<float*>(alloc_async(sizeof(float) * cols * chunks, stream));
      dim3 grid(unsigned((cols + 255) / 256), unsigned(chunks));
      column_partial_kernel<V><<<grid, 256, 0, as_cuda(stream)>>>(
          static_cast<const Elem<V>*>(grad_y.data), grad_y.row_stride, a.rows, cols, partial);
      FL_CUDA_CHECK_LAUNCH();
      column_final_kernel<<<unsigned((cols + 255) / 256), 256, 0, as_cuda(stream)>>>(partial, chunks,
                                                                                cols, grad_bias);
      FL_CUDA_CHECK_LAUNCH();
      free_async(partial, stream);
    }
  });
}

}  // namespace fusedloss::cuda

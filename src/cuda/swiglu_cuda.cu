// CUDA SwiGLU, one block per row, VEC elements per access (16-byte vectors from vector_io.cuh
// when every row and operand is aligned, single elements otherwise). The kernels read gate and
// up through a pointer and a row stride each: the fused [T, 2n] layout is the pair of its
// halves, the two-tensor form any two views.
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
__device__ __forceinline__ RawGateUp load_raw(const T* gr, const T* ur, int64_t j) {
  return {load_bytes<kAccessBytes<T, VEC>>(gr + j), load_bytes<kAccessBytes<T, VEC>>(ur + j)};
}

// A row-strided operand as the kernels take it.
template <class T>
struct Rows {
  T* data;
  int64_t stride;
  __device__ __forceinline__ T* row(int64_t r) const { return data + r * stride; }
};

template <class T>
Rows<T> rows_of(const MatrixView& m) {
  return {static_cast<T*>(m.data), m.row_stride};
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

// VEC gate/up values at columns [j, j + VEC) from their stored values, bias added, the gate
// multiplied, clamped.
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
    v[k] = core::gate_up(get<Y>(raw.g, k) + bg[k], get<Y>(raw.u, k) + bu[k], p.clamp,
                         p.gate_multiplier);
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

// p is __grid_constant__: read in place from the parameter space where the device functions take
// it by reference (otherwise ptxas copied part of it to the stack in the fp32 16-byte kernel).
template <StorageKind V, int VEC, bool kFp8Store>
__global__ void FL_SWIGLU_BOUNDS
    forward_kernel(Rows<const Elem<V>> gate, Rows<const Elem<V>> up,
                   const __grid_constant__ core::SwigluParams p, Rows<Elem<V>> out,
                   Rows<uint8_t> gate8, Rows<uint8_t> up8) {
  constexpr int64_t kStride = int64_t(kThreads) * VEC;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const Elem<V>* gr = gate.row(r);
    const Elem<V>* ur = up.row(r);
    const float w = (p.weights ? p.weights[r] : 1.0f) * p.down_multiplier;
    for (int64_t j0 = int64_t(threadIdx.x) * VEC; j0 < p.n; j0 += kGroups * kStride) {
      RawGateUp raw[kGroups];
      for_each_group(j0, kStride, p.n,
                     [&](int k, int64_t j) { raw[k] = load_raw<Elem<V>, VEC>(gr, ur, j); });
      for_each_group(j0, kStride, p.n, [&](int k, int64_t j) {
        core::GateUp v[VEC];
        gate_up_values<V, V, VEC>(raw[k], j, p, v);
        Vec16 o{};
#pragma unroll
        for (int e = 0; e < VEC; ++e) put<V>(o, e, core::swiglu_value(v[e]) * w);
        store_bytes<kAccessBytes<Elem<V>, VEC>>(out.row(r) + j, o);
        if constexpr (kFp8Store) {
          // the raw input (before bias), as Megatron saves it, with the caller's overflow rule
          Vec16 fg{}, fu{};
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            set_bits(fg, e, core::float_to_e4m3(get<V>(raw[k].g, e), p.fp8_saturate));
            set_bits(fu, e, core::float_to_e4m3(get<V>(raw[k].u, e), p.fp8_saturate));
          }
          store_bytes<kAccessBytes<uint8_t, VEC>>(gate8.row(r) + j, fg);
          store_bytes<kAccessBytes<uint8_t, VEC>>(up8.row(r) + j, fu);
        }
      });
    }
  }
}

template <StorageKind Y, StorageKind V, int VEC, bool kWeights>
__global__ void FL_SWIGLU_BOUNDS
    backward_kernel(Rows<const Elem<V>> go, Rows<const Elem<Y>> gate, Rows<const Elem<Y>> up,
                    core::SwigluParams p, Rows<Elem<V>> dgate, Rows<Elem<V>> dup,
                    float* grad_weights) {
  constexpr int64_t kStride = int64_t(kThreads) * VEC;
  __shared__ float scratch[kThreads / 32];
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const Elem<Y>* gr = gate.row(r);
    const Elem<Y>* ur = up.row(r);
    const Elem<V>* gor = go.row(r);
    Elem<V>* dgr = dgate.row(r);
    Elem<V>* dur = dup.row(r);
    const float w = (kWeights ? p.weights[r] : 1.0f) * p.down_multiplier;
    float dw = 0.0f;
    for (int64_t j0 = int64_t(threadIdx.x) * VEC; j0 < p.n; j0 += kGroups * kStride) {
      RawGateUp raw[kGroups];
      Vec16 g[kGroups];
      for_each_group(j0, kStride, p.n, [&](int k, int64_t j) {
        raw[k] = load_raw<Elem<Y>, VEC>(gr, ur, j);
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
          const float value = core::swiglu_grad(v[e], ge * w, dae, dbe, p.gate_multiplier);
          if (kWeights) dw += value * ge;
          put<V>(da, e, dae);
          put<V>(db, e, dbe);
        }
        // in place: this thread read these columns above
        store_bytes<kAccessBytes<Elem<V>, VEC>>(dgr + j, da);
        store_bytes<kAccessBytes<Elem<V>, VEC>>(dur + j, db);
      });
    }
    if constexpr (kWeights) {
      const float sum = block_sum(dw, scratch);  // fixed order: deterministic
      if (threadIdx.x == 0) grad_weights[r] = sum * p.down_multiplier;
    }
  }
}

// Bias gradient: column sums of the stored gradient (the gate's n columns, then the up's) in
// two fixed-order stages.
constexpr int64_t kRowsPerChunk = 256;
template <StorageKind V>
__global__ void column_partial_kernel(Rows<const Elem<V>> dgate, Rows<const Elem<V>> dup,
                                      int64_t n, int64_t rows, float* partial) {
  const int64_t cols = 2 * n;
  int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  const Rows<const Elem<V>> g = c < n ? dgate : dup;
  const int64_t col = c < n ? c : c - n;
  int64_t r0 = blockIdx.y * kRowsPerChunk, r1 = min(rows, r0 + kRowsPerChunk);
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) s += St<V>::load(g.row(r)[col]);
  partial[blockIdx.y * cols + c] = s;
}

__global__ void column_final_kernel(const float* partial, int64_t chunks, int64_t cols, float* out) {
  int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) s += partial[k * cols + c];
  out[c] = s;
}

// VEC-element accesses need every row start of every operand on a VEC boundary (16 bytes for
// the values' dtype, fewer for the e4m3 copy), and the bias on 16 bytes.
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

void swiglu_forward(const core::GateUpViews& in, const core::SwigluParams& p, const MatrixView& out,
                    const core::GateUpViews& in_fp8, Stream stream) {
  if (p.rows == 0) return;
  core::dispatch_dtype(in.gate.dtype, [&](auto k) {
    constexpr StorageKind V = decltype(k)::value;
    constexpr int VEC = vector_width<Elem<V>>();
    auto launch = [&](auto vec_c, auto fp8_c) {
      forward_kernel<V, decltype(vec_c)::value, decltype(fp8_c)::value>
          <<<row_grid(p.rows), kThreads, 0, as_cuda(stream)>>>(
              rows_of<const Elem<V>>(in.gate), rows_of<const Elem<V>>(in.up), p,
              rows_of<Elem<V>>(out), rows_of<uint8_t>(in_fp8.gate), rows_of<uint8_t>(in_fp8.up));
    };
    dispatch_layout<VEC>(
        can_vectorise(p, VEC, {&in.gate, &in.up, &out, &in_fp8.gate, &in_fp8.up}),
        in_fp8.gate.data != nullptr, launch);
    FL_CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward(const MatrixView& grad_out, const core::GateUpViews& in,
                     const core::SwigluParams& p, const core::GateUpViews& grad, float* grad_weights,
                     float* grad_bias, Stream stream) {
  if (p.rows == 0) {
    if (grad_bias) FL_CUDA_CHECK(cudaMemsetAsync(grad_bias, 0, sizeof(float) * 2 * p.n, as_cuda(stream)));
    return;
  }
  core::dispatch_dtype(grad.gate.dtype, [&](auto k) {
    constexpr StorageKind V = decltype(k)::value;
    constexpr int VEC = vector_width<Elem<V>>();
    auto run = [&](auto y_kind) {
      constexpr StorageKind Y = decltype(y_kind)::value;
      auto launch = [&](auto vec_c, auto w_c) {
        backward_kernel<Y, V, decltype(vec_c)::value, decltype(w_c)::value>
            <<<row_grid(p.rows), kThreads, 0, as_cuda(stream)>>>(
                rows_of<const Elem<V>>(grad_out), rows_of<const Elem<Y>>(in.gate),
                rows_of<const Elem<Y>>(in.up), p, rows_of<Elem<V>>(grad.gate),
                rows_of<Elem<V>>(grad.up), grad_weights);
      };
      dispatch_layout<VEC>(
          can_vectorise(p, VEC, {&grad_out, &in.gate, &in.up, &grad.gate, &grad.up}),
          grad_weights != nullptr, launch);
      FL_CUDA_CHECK_LAUNCH();
    };
    if (in.gate.dtype == DType::FP8_E4M3) run(std::integral_constant<StorageKind, StorageKind::E4M3>{});
    else run(std::integral_constant<StorageKind, V>{});
    if (grad_bias) {
      const int64_t cols = 2 * p.n, chunks = (p.rows + kRowsPerChunk - 1) / kRowsPerChunk;
      const ScratchBuffer partials(sizeof(float) * cols * chunks, stream);
      float* partial = partials.as<float>();
      dim3 grid(unsigned((cols + 255) / 256), unsigned(chunks));
      column_partial_kernel<V><<<grid, 256, 0, as_cuda(stream)>>>(
          rows_of<const Elem<V>>(grad.gate), rows_of<const Elem<V>>(grad.up), p.n, p.rows, partial);
      FL_CUDA_CHECK_LAUNCH();
      column_final_kernel<<<unsigned((cols + 255) / 256), 256, 0, as_cuda(stream)>>>(partial, chunks,
                                                                                cols, grad_bias);
      FL_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace fusedloss::cuda

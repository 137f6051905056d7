// CUDA linear cross-entropy: the chunk loop.
//
// Two streams: the caller's stream S runs every GEMM, a side stream X (cached per device and
// caller stream) runs the cross-entropy steps. Two chunk buffers, adjacent in memory, take the
// chunks in pairs (2j in the first, 2j + 1 in the second). With L = logits GEMM, CE = the
// steps, dh = dhidden GEMM, dW = dweight GEMM:
//
//   S:  L0  L1  [wait CE0] dh0  [wait CE1] dh1  dW(0,1)  L2  L3  [wait CE2] dh2 ...
//   X:     [wait L0] CE0   [wait L1] CE1             [wait L2] CE2  [wait L3] CE3 ...
//
// CE0 runs under L1, CE1 under dh0, and so on. dW takes both chunks of a pair at once (the
// buffers are one [2 chunk, V_local] matrix, the hidden rows are contiguous too): its K is two
// chunks, which halves the read-modify-write of the [V_local, H] accumulator (fp32: 8 bytes per
// element per dW GEMM, which at one chunk of K would rival the GEMM's own time). A buffer is
// refilled only after its pair's dW (stream order on S) and, without gradients, after the
// steps that read it (the event CE[b]). dweight accumulates in pair order on S (beta = 1 after
// the first pair). Memory: one stream-ordered allocation of the two buffers plus the cuBLASLt
// workspace, released on S after X has joined it.
#include "cuda/linear_ce_cuda.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include "core/dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/gemm_lt.h"

namespace fusedloss::cuda {
namespace {

// The side stream and events of one (device, caller stream), created on first use (outside a
// graph capture: warm up before capturing) and kept for the process.
struct Pipeline {
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr, logits_ready = nullptr, steps_done[2] = {};
};

Pipeline& pipeline_for(Stream stream) {
  static std::mutex mu;
  static std::map<std::pair<int, Stream>, Pipeline> pipelines;
  int device = 0;
  FL_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto it = pipelines.find({device, stream});
  if (it != pipelines.end()) return it->second;
  Pipeline p;
  FL_CUDA_CHECK(cudaStreamCreateWithFlags(&p.side, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&p.fork, &p.join, &p.logits_ready, &p.steps_done[0], &p.steps_done[1]})
    FL_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  return pipelines.emplace(std::make_pair(device, stream), p).first->second;
}

MatrixView rows_of(const MatrixView& m, int64_t row0, int64_t rows) {
  MatrixView v = m;
  v.data = static_cast<char*>(m.data) + row0 * m.row_stride * detail::element_size(m.dtype);
  v.rows = rows;
  return v;
}

// Stream-ordered scratch released on the stream it was allocated on.
struct AsyncBuffer {
  void* ptr;
  Stream stream;
  AsyncBuffer(size_t bytes, Stream s) : ptr(alloc_async(bytes, s)), stream(s) {}
  ~AsyncBuffer() { free_async(ptr, stream); }
  AsyncBuffer(const AsyncBuffer&) = delete;
  AsyncBuffer& operator=(const AsyncBuffer&) = delete;
};

template <core::StorageKind KS, core::StorageKind KD>
__global__ void scale_kernel(const typename core::Storage<KS>::type* src, int64_t src_stride,
                             typename core::Storage<KD>::type* dst, int64_t dst_stride,
                             int64_t rows, int64_t cols, const float* scale, bool accumulate) {
  using SS = core::Storage<KS>;
  using SD = core::Storage<KD>;
  const float s = *scale;
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    float v = s * SS::load(src[r * src_stride + c]);
    if (accumulate) v += SD::load(dst[r * dst_stride + c]);
    dst[r * dst_stride + c] = SD::store(v);
  }
}

__global__ void fill_kernel(float* p, float v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

unsigned grid_for(int64_t n, int threads) {
  return unsigned(std::min<int64_t>((n + threads - 1) / threads, 132 * 16));
}

}  // namespace

void lce_fill(float* ptr, float value, int64_t n, Stream stream) {
  if (n <= 0) return;
  fill_kernel<<<grid_for(n, 256), 256, 0, as_cuda(stream)>>>(ptr, value, n);
  FL_CUDA_CHECK_LAUNCH();
}

void lce_scale(const MatrixView& src, const MatrixView& dst, const float* scale, bool accumulate,
               Stream stream) {
  if (src.rows == 0 || src.cols == 0) return;
  core::dispatch_dtype(src.dtype, [&](auto ks) {
    core::dispatch_dtype(dst.dtype, [&](auto kd) {
      constexpr core::StorageKind KS = decltype(ks)::value, KD = decltype(kd)::value;
      using TS = typename core::Storage<KS>::type;
      using TD = typename core::Storage<KD>::type;
      scale_kernel<KS, KD><<<grid_for(src.rows * src.cols, 256), 256, 0, as_cuda(stream)>>>(
          static_cast<const TS*>(src.data), src.row_stride, static_cast<TD*>(dst.data),
          dst.row_stride, src.rows, src.cols, scale, accumulate);
      FL_CUDA_CHECK_LAUNCH();
    });
  });
}

void lce_run(const core::LcePlan& plan, const MatrixView& hidden, const MatrixView& weight,
             const core::LceSteps& steps, const core::LceGrads& grads, Stream stream) {
  const bool with_grads = bool(steps.gradient);
  const cudaStream_t S = as_cuda(stream);
  if (plan.rows == 0) {
    if (with_grads && !grads.accumulate_dweight) {  // no tokens: a zero weight gradient
      const MatrixView& w = grads.dweight;
      const int64_t es = detail::element_size(w.dtype);
      FL_CUDA_CHECK(cudaMemset2DAsync(w.data, size_t(std::max(w.row_stride, w.cols) * es), 0,
                                      size_t(w.cols * es), size_t(w.rows), S));
    }
    return;
  }
  Pipeline& pl = pipeline_for(stream);
  const cudaStream_t X = pl.side;
  const int64_t es = detail::element_size(plan.dtype);
  const size_t buffer_bytes = size_t(plan.chunk * plan.stride * es);
  // Adjacent buffers (the row pitch is a multiple of 16 bytes, so the second starts aligned).
  const size_t workspace_at = (2 * buffer_bytes + 255) / 256 * 256;
  AsyncBuffer mem(workspace_at + kGemmWorkspaceBytes, stream);
  char* base = static_cast<char*>(mem.ptr);
  void* workspace = base + workspace_at;
  const int64_t chunks = (plan.rows + plan.chunk - 1) / plan.chunk;
  auto rows_in = [&](int64_t i) { return std::min(plan.chunk, plan.rows - i * plan.chunk); };
  auto buffer = [&](int64_t i) {
    return MatrixView{base + (i % 2) * buffer_bytes, rows_in(i), plan.vocab_local, plan.stride,
                      plan.dtype, Device::CUDA};
  };
  // L(i) on S, then CE(i) on X.
  auto logits_and_steps = [&](int64_t i) {
    const MatrixView buf = buffer(i);
    if (i >= 2) FL_CUDA_CHECK(cudaStreamWaitEvent(S, pl.steps_done[i % 2], 0));
    gemm(rows_of(hidden, i * plan.chunk, buf.rows), false, weight, true, buf, false, plan.tf32,
         workspace, stream);
    FL_CUDA_CHECK(cudaEventRecord(pl.logits_ready, S));
    FL_CUDA_CHECK(cudaStreamWaitEvent(X, pl.logits_ready, 0));
    if (steps.forward) steps.forward(buf, i * plan.chunk, X);
    if (with_grads) steps.gradient(buf, i * plan.chunk, X);
    FL_CUDA_CHECK(cudaEventRecord(pl.steps_done[i % 2], X));
  };

  FL_CUDA_CHECK(cudaEventRecord(pl.fork, S));
  FL_CUDA_CHECK(cudaStreamWaitEvent(X, pl.fork, 0));
  // X joins S again on every exit, so the buffers are never freed under a running step.
  struct Join {
    Pipeline& pl;
    cudaStream_t S;
    ~Join() {
      if (cudaEventRecord(pl.join, pl.side) == cudaSuccess) (void)cudaStreamWaitEvent(S, pl.join, 0);
    }
  } join{pl, S};
  for (int64_t j = 0; j < chunks; j += 2) {
    const bool pair = j + 1 < chunks;
    logits_and_steps(j);
    if (pair) logits_and_steps(j + 1);
    if (!with_grads) continue;
    for (int64_t i = j; i < j + (pair ? 2 : 1); ++i) {
      const MatrixView g = buffer(i);
      FL_CUDA_CHECK(cudaStreamWaitEvent(S, pl.steps_done[i % 2], 0));
      gemm(g, false, weight, false, rows_of(grads.dhidden, i * plan.chunk, g.rows),
           grads.accumulate_dhidden, plan.tf32, workspace, stream);  // dhidden_c (+)= G @ W
    }
    MatrixView both = buffer(j);  // G of the pair: [rows(j) + rows(j + 1), V_local]
    if (pair) both.rows += rows_in(j + 1);
    gemm(both, true, rows_of(hidden, j * plan.chunk, both.rows), false, grads.dweight,
         grads.accumulate_dweight || j > 0, plan.tf32, workspace, stream);  // dW (+)= G^T @ h
  }
}

}  // namespace fusedloss::cuda

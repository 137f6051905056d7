// CUDA linear cross-entropy: the chunk loop.
//
// Two streams: the caller's stream S runs every GEMM, a side stream X (cached per device and
// caller stream) runs the cross-entropy steps. B chunk buffers (B = 2 by default, adjacent in
// memory) take the chunks in groups of B (chunk i in buffer i % B). With L = logits GEMM,
// CE = the steps, dh = dhidden GEMM, dW = dweight GEMM, at B = 2:
//
//   S:  L0  L1  [wait CE0] dh0  [wait CE1] dh1  dW(0,1)  L2  L3  [wait CE2] dh2 ...
//   X:     [wait L0] CE0   [wait L1] CE1             [wait L2] CE2  [wait L3] CE3 ...
//
// CE0 runs under L1, CE1 under dh0, and so on. dW takes the group's chunks at once (the
// buffers are one [B chunk, V_local] matrix, the hidden rows are contiguous too): its K is B
// chunks, which divides the read-modify-write of the [V_local, H] accumulator by B (fp32: 8
// bytes per element per dW GEMM, which at one chunk of K would rival the GEMM's own time). A
// buffer is refilled only after its group's dW (stream order on S) and, without gradients,
// after the steps that read it (the event CE[b]). dweight accumulates in group order on S
// (beta = 1 after the first group). Memory: one block of the caller's holds the buffers and the
// cuBLASLt workspace (workspace_bytes in all, core::lce_loop_bytes); X joins S before the loop
// returns, so the caller may release it on S.
//
// The variants (one buffer, dhidden per group, the steps on S, timed algorithm choice, the
// steps in L2-sized row slices) and the per-phase timing are chosen in src/core/lce_tuning.h.
#include "cuda/linear_ce_cuda.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>
#include "core/dispatch.h"
#include "core/lce_bias.h"
#include "core/lce_tuning.h"
#include "cuda/cuda_check.h"
#include "cuda/gemm_lt.h"
#include "cuda/runtime.h"
#include "fusedloss/linear_cross_entropy.h"  // LinearCePhaseTimes

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

// Rows over blockIdx.y, columns over x (no per-element division). In place with a scale of
// exactly 1 there is nothing to do: every block returns at once (decided on the device, so the
// common unit upstream gradient of the in-forward mode costs no pass over the gradients).
template <core::StorageKind KS, core::StorageKind KD>
__global__ void scale_kernel(const typename core::Storage<KS>::type* src, int64_t src_stride,
                             typename core::Storage<KD>::type* dst, int64_t dst_stride,
                             int64_t rows, int64_t cols, const float* scale, bool accumulate,
                             bool in_place) {
  using SS = core::Storage<KS>;
  using SD = core::Storage<KD>;
  const float s = *scale;
  if (in_place && s == 1.0f) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const auto* in = src + r * src_stride;
    auto* out = dst + r * dst_stride;
    for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < cols;
         c += int64_t(gridDim.x) * blockDim.x) {
      float v = s * SS::load(in[c]);
      if (accumulate) v += SD::load(out[c]);
      out[c] = SD::store(v);
    }
  }
}

template <core::StorageKind KL, core::StorageKind KB>
__global__ void copy_bias_kernel(core::Elem<KL>* out, const core::Elem<KB>* bias, int64_t n) {
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < n;
       c += int64_t(gridDim.x) * blockDim.x)
    out[c] = core::lce_bias_start<KL, KB>(bias[c]);
}

// One thread per column, down the rows: a warp reads consecutive columns of a row (coalesced),
// and each column's sum has one order (deterministic, no atomics).
template <core::StorageKind KG>
__global__ void column_sums_kernel(const core::Elem<KG>* g, int64_t stride, int64_t rows,
                                   int64_t cols, float* acc) {
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < cols;
       c += int64_t(gridDim.x) * blockDim.x)
    acc[c] = core::lce_column_sum<KG>(g, stride, rows, c, acc[c]);
}

__global__ void fill_kernel(float* p, float v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

unsigned grid_for(int64_t n, int threads) {
  return unsigned(std::min<int64_t>((n + threads - 1) / threads, 132 * 16));
}

// A grid over a matrix: up to 8 blocks of 256 columns a row (x), the rows over the rest (y).
dim3 rows_grid(int64_t rows, int64_t cols) {
  const unsigned gx = unsigned(std::min<int64_t>((cols + 255) / 256, 8));
  return dim3(gx, unsigned(std::min<int64_t>(rows, std::max<int64_t>(1, 132 * 16 / gx))));
}

}  // namespace

void lce_fill(float* ptr, float value, int64_t n, Stream stream) {
  if (n <= 0) return;
  fill_kernel<<<grid_for(n, 256), 256, 0, as_cuda(stream)>>>(ptr, value, n);
  FL_CUDA_CHECK_LAUNCH();
}

void lce_copy_bias(void* out, DType dtype, const VectorView& bias, Stream stream) {
  if (bias.size == 0) return;
  core::dispatch_dtype(dtype, [&](auto kl) {
    core::dispatch_dtype(bias.dtype, [&](auto kb) {
      constexpr core::StorageKind KL = decltype(kl)::value, KB = decltype(kb)::value;
      copy_bias_kernel<KL, KB><<<grid_for(bias.size, 256), 256, 0, as_cuda(stream)>>>(
          static_cast<core::Elem<KL>*>(out), static_cast<const core::Elem<KB>*>(bias.data),
          bias.size);
      FL_CUDA_CHECK_LAUNCH();
    });
  });
}

void lce_add_column_sums(const MatrixView& g, float* acc, Stream stream) {
  if (g.rows == 0 || g.cols == 0) return;
  core::dispatch_dtype(g.dtype, [&](auto kg) {
    constexpr core::StorageKind KG = decltype(kg)::value;
    column_sums_kernel<KG><<<grid_for(g.cols, 256), 256, 0, as_cuda(stream)>>>(
        static_cast<const core::Elem<KG>*>(g.data), g.row_stride, g.rows, g.cols, acc);
    FL_CUDA_CHECK_LAUNCH();
  });
}

void lce_scale(const MatrixView& src, const MatrixView& dst, const float* scale, bool accumulate,
               Stream stream) {
  if (src.rows == 0 || src.cols == 0) return;
  core::dispatch_dtype(src.dtype, [&](auto ks) {
    core::dispatch_dtype(dst.dtype, [&](auto kd) {
      constexpr core::StorageKind KS = decltype(ks)::value, KD = decltype(kd)::value;
      using TS = typename core::Storage<KS>::type;
      using TD = typename core::Storage<KD>::type;
      const bool in_place = !accumulate && KS == KD && src.data == dst.data &&
                            src.row_stride == dst.row_stride;
      scale_kernel<KS, KD><<<rows_grid(src.rows, src.cols), 256, 0, as_cuda(stream)>>>(
          static_cast<const TS*>(src.data), src.row_stride, static_cast<TD*>(dst.data),
          dst.row_stride, src.rows, src.cols, scale, accumulate, in_place);
      FL_CUDA_CHECK_LAUNCH();
    });
  });
}

namespace {

// CUDA events around each phase of each chunk (FUSEDLOSS_LCE_TIMING=1), read once the loop
// has finished: the sums go to linear_cross_entropy_phase_times.
class PhaseClock {
 public:
  enum Phase { kLogits, kSteps, kDhidden, kDweight, kLoop, kPhases };
  explicit PhaseClock(bool on) : on_(on) {}
  PhaseClock(const PhaseClock&) = delete;
  PhaseClock& operator=(const PhaseClock&) = delete;
  ~PhaseClock() {
    for (auto& p : marks_)
      for (cudaEvent_t e : {p.first, p.second}) (void)cudaEventDestroy(e);
  }
  // Returns the index of the pair begun on `s`; end(index, s) closes it.
  size_t begin(Phase ph, cudaStream_t s) {
    if (!on_) return 0;
    std::pair<cudaEvent_t, cudaEvent_t> p{};
    FL_CUDA_CHECK(cudaEventCreate(&p.first));
    marks_.push_back(p);
    phases_.push_back(ph);
    FL_CUDA_CHECK(cudaEventCreate(&marks_.back().second));
    FL_CUDA_CHECK(cudaEventRecord(marks_.back().first, s));
    return marks_.size() - 1;
  }
  void end(size_t i, cudaStream_t s) {
    if (on_) FL_CUDA_CHECK(cudaEventRecord(marks_[i].second, s));
  }
  // After the loop's last event on S (X joined): wait for it and add the sums.
  void report() {
    if (!on_) return;
    double ms[kPhases] = {};
    for (size_t i = 0; i < marks_.size(); ++i) {
      FL_CUDA_CHECK(cudaEventSynchronize(marks_[i].second));
      float t = 0.0f;
      FL_CUDA_CHECK(cudaEventElapsedTime(&t, marks_[i].first, marks_[i].second));
      ms[phases_[i]] += t;
    }
    core::lce_add_phase_times(
        LinearCePhaseTimes{ms[kLogits], ms[kSteps], ms[kDhidden], ms[kDweight], ms[kLoop], 1});
  }

 private:
  bool on_;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> marks_;
  std::vector<Phase> phases_;
};

}  // namespace

void lce_prepare(Stream stream) {
  (void)pipeline_for(stream);
  gemm_prepare();
}

void lce_run(const core::LcePlan& plan, const MatrixView& hidden, const MatrixView& weight,
             const core::LceSteps& steps, const core::LceGrads& grads, void* memory,
             Stream stream) {
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
  const core::LceTuning& tune = plan.tuning;
  const int64_t B = tune.buffers;  // buffers = chunks per dW GEMM
  Pipeline& pl = pipeline_for(stream);
  // One buffer leaves nothing to overlap: a chunk's GEMMs wait on its own cross-entropy, so a
  // side stream would only add the fork, the join and two event waits per chunk.
  const cudaStream_t X = B > 1 && tune.side_stream ? pl.side : S;
  // Adjacent buffers (the row pitch is a multiple of 16 bytes, so the second starts aligned).
  const size_t buffer_bytes = core::lce_buffer_bytes(plan);
  char* base = static_cast<char*>(memory);
  void* workspace = plan.gemm_workspace ? base + core::lce_gemm_workspace_at(plan) : nullptr;
  const int64_t chunks = (plan.rows + plan.chunk - 1) / plan.chunk;
  auto rows_in = [&](int64_t i) { return std::min(plan.chunk, plan.rows - i * plan.chunk); };
  auto buffer = [&](int64_t i) {
    return MatrixView{base + (i % B) * buffer_bytes, rows_in(i), plan.vocab_local, plan.stride,
                      plan.dtype, Device::CUDA};
  };
  auto gemm_ = [&](const MatrixView& a, bool ta, const MatrixView& b, bool tb,
                   const MatrixView& c, bool accumulate, const void* bias = nullptr) {
    gemm(a, ta, b, tb, c, accumulate, plan.tf32, workspace, plan.gemm_workspace, stream,
         tune.gemm_algos, bias);
  };
  // The bias, once per call, in the logits' dtype at a 256-byte boundary: what the logits
  // GEMM's bias epilogue reads (core/lce_bias.h).
  void* bias = nullptr;
  if (steps.bias.data) {
    bias = base + core::lce_bias_at(plan);
    lce_copy_bias(bias, plan.dtype, steps.bias, S);
  }
  PhaseClock clock(tune.timing && !capturing(S));
  // L(i) on S, then CE(i) on X.
  auto logits_and_steps = [&](int64_t i) {
    const MatrixView buf = buffer(i);
    if (i >= B) FL_CUDA_CHECK(cudaStreamWaitEvent(S, pl.steps_done[i % B], 0));
    const size_t tl = clock.begin(PhaseClock::kLogits, S);
    gemm_(rows_of(hidden, i * plan.chunk, buf.rows), false, weight, true, buf, false, bias);
    clock.end(tl, S);
    FL_CUDA_CHECK(cudaEventRecord(pl.logits_ready, S));
    FL_CUDA_CHECK(cudaStreamWaitEvent(X, pl.logits_ready, 0));
    const size_t tc = clock.begin(PhaseClock::kSteps, X);
    core::lce_run_steps(plan, steps, buf, i * plan.chunk, X);
    clock.end(tc, X);
    FL_CUDA_CHECK(cudaEventRecord(pl.steps_done[i % B], X));
  };

  const size_t loop = clock.begin(PhaseClock::kLoop, S);
  FL_CUDA_CHECK(cudaEventRecord(pl.fork, S));
  FL_CUDA_CHECK(cudaStreamWaitEvent(X, pl.fork, 0));
  {
    // X joins S again on every exit, so the buffers are never freed under a running step.
    struct Join {
      Pipeline& pl;
      cudaStream_t X, S;
      ~Join() {
        if (cudaEventRecord(pl.join, X) == cudaSuccess) (void)cudaStreamWaitEvent(S, pl.join, 0);
      }
    } join{pl, X, S};
    for (int64_t j = 0; j < chunks; j += B) {
      const int64_t end = std::min(j + B, chunks);
      for (int64_t i = j; i < end; ++i) logits_and_steps(i);
      if (!with_grads) continue;
      MatrixView group = buffer(j);  // G of the group: [rows(j) + ... , V_local]
      for (int64_t i = j + 1; i < end; ++i) group.rows += rows_in(i);
      if (tune.dhidden_group) {  // dhidden (+)= G @ W over the group
        for (int64_t i = j; i < end; ++i)
          FL_CUDA_CHECK(cudaStreamWaitEvent(S, pl.steps_done[i % B], 0));
        const size_t t = clock.begin(PhaseClock::kDhidden, S);
        gemm_(group, false, weight, false, rows_of(grads.dhidden, j * plan.chunk, group.rows),
              grads.accumulate_dhidden);
        clock.end(t, S);
      } else {  // per chunk, each as soon as its steps are done, in row pieces
        for (int64_t i = j; i < end; ++i) {
          const MatrixView g = buffer(i);
          FL_CUDA_CHECK(cudaStreamWaitEvent(S, pl.steps_done[i % B], 0));
          const size_t t = clock.begin(PhaseClock::kDhidden, S);
          const int64_t piece = (g.rows + tune.dhidden_pieces - 1) / tune.dhidden_pieces;
          const int64_t step = piece >= 64 ? (piece + 63) / 64 * 64 : std::max<int64_t>(piece, 1);
          for (int64_t r = 0; r < g.rows; r += step) {
            const int64_t n = std::min(step, g.rows - r);
            gemm_(rows_of(g, r, n), false, weight, false,
                  rows_of(grads.dhidden, i * plan.chunk + r, n), grads.accumulate_dhidden);
          }
          clock.end(t, S);
        }
      }
      const size_t t = clock.begin(PhaseClock::kDweight, S);
      gemm_(group, true, rows_of(hidden, j * plan.chunk, group.rows), false, grads.dweight,
            grads.accumulate_dweight || j > 0);  // dW (+)= G^T @ h
      clock.end(t, S);
    }
  }
  clock.end(loop, S);
  clock.report();
}

}  // namespace fusedloss::cuda

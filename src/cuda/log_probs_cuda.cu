#include "cuda/log_probs_cuda.h"

#include "core/dispatch.h"
#include "core/log_probs_math.h"
#include "cuda/cuda_check.h"
#include "cuda/device_error.cuh"
#include "cuda/reduce.cuh"
#include "cuda/vector_io.cuh"

namespace fusedloss::cuda {
namespace {

constexpr int kThreads = 256;

template <class Index>
__device__ __forceinline__ int64_t token_at(const void* tokens, int64_t r) {
  return int64_t(static_cast<const Index*>(tokens)[r]);
}

// Row r of a chunk, `cols` elements from a 16-byte boundary: each thread visits its vectors in
// increasing column order, then at most one element of the tail, calling f(j, value).
template <core::StorageKind K, class F>
__device__ __forceinline__ void for_each_in_row(const core::Elem<K>* row, int64_t cols, F&& f) {
  constexpr int W = vector_width<core::Elem<K>>();
  const int64_t nvec = cols / W;
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    const Vec16 x = load_vec(row + v * W);
#pragma unroll
    for (int e = 0; e < W; ++e) f(v * W + e, get<K>(x, e));
  }
  for (int64_t j = nvec * W + threadIdx.x; j < cols; j += blockDim.x)
    f(j, core::Storage<K>::load(row[j]));
}

template <core::StorageKind K, class Index>
__global__ void __launch_bounds__(kThreads) local_stats_kernel(MatrixView x, const void* tokens,
                                                               float inv_t, int64_t vocab_start,
                                                               LogProbStats* stats) {
  __shared__ LogProbStats scratch[kThreads / 32];
  const int64_t r = blockIdx.x;
  const auto* row = static_cast<const core::Elem<K>*>(x.data) + r * x.row_stride;
  LogProbStats s = core::lp_empty();
  for_each_in_row<K>(row, x.cols, [&](int64_t j, float z) { core::lp_add(s, z * inv_t, vocab_start + j); });
  s = block_reduce(s, [](const LogProbStats& a, const LogProbStats& b) { return core::lp_combine(a, b); },
                   scratch);
  if (threadIdx.x == 0) {
    const int64_t local = token_at<Index>(tokens, r) - vocab_start;
    s.target = local >= 0 && local < x.cols ? core::Storage<K>::load(row[local]) * inv_t : -INFINITY;
    stats[r] = s;
  }
}

template <class Index>
__global__ void merge_kernel(const LogProbStats* stats, int world, int64_t rows, const void* tokens,
                             int64_t ignore_index, int64_t vocab_global, LinearLogProbsOutputs out,
                             DeviceError* error) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  LogProbStats s = stats[r];
  for (int k = 1; k < world; ++k) s = core::lp_combine(s, stats[int64_t(k) * rows + r]);
  const int64_t t = token_at<Index>(tokens, r);
  const bool ignored = t == ignore_index, valid = t >= 0 && t < vocab_global;
  if (!ignored && !valid) report_device_error(error, kBadToken, r, t);
  const float lse = core::lp_lse(s);
  if (out.lse) out.lse[r] = lse;
  if (out.log_probs) out.log_probs[r] = ignored ? 0.0f : valid ? s.target - lse : NAN;
  if (out.entropy) out.entropy[r] = ignored ? 0.0f : valid ? core::lp_entropy(s) : NAN;
  if (out.argmax) out.argmax[r] = s.argmax;
}

template <core::StorageKind K, class Index>
__global__ void __launch_bounds__(kThreads) gradient_kernel(MatrixView x, const void* tokens,
                                                            const float* lse, const float* entropy,
                                                            const float* g, const float* e,
                                                            float inv_t, int64_t vocab_start,
                                                            int64_t ignore_index) {
  constexpr int W = vector_width<core::Elem<K>>();
  const int64_t r = blockIdx.x;
  auto* row = static_cast<core::Elem<K>*>(x.data) + r * x.row_stride;
  const int64_t t = token_at<Index>(tokens, r);
  const float gr = g && t != ignore_index ? g[r] : 0.0f;
  const float er = e && t != ignore_index ? e[r] : 0.0f;
  const float h = entropy ? entropy[r] : 0.0f, l = lse[r];
  const int64_t nvec = x.cols / W;
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    Vec16 z = load_vec(row + v * W);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const int64_t j = vocab_start + v * W + k;
      put<K>(z, k, core::lp_grad(get<K>(z, k) * inv_t, l, h, j == t, gr, er, inv_t));
    }
    store_vec(row + v * W, z);
  }
  for (int64_t j = nvec * W + threadIdx.x; j < x.cols; j += blockDim.x) {
    const float y = core::Storage<K>::load(row[j]) * inv_t;
    row[j] = core::Storage<K>::store(core::lp_grad(y, l, h, vocab_start + j == t, gr, er, inv_t));
  }
}

void require_row_alignment(const MatrixView& x, const char* fn) {
  const int64_t es = detail::element_size(x.dtype);
  detail::require(reinterpret_cast<uintptr_t>(x.data) % kVectorBytes == 0 &&
                      (x.row_stride * es) % kVectorBytes == 0,
                  fn, ": internal: the chunk buffer's rows are not on 16-byte boundaries");
}

}  // namespace

void lp_local_stats(const MatrixView& x, const IndexView& tokens, float inv_t, int64_t vocab_start,
                    LogProbStats* stats, Stream stream) {
  if (x.rows == 0) return;
  require_row_alignment(x, "lp_local_stats");
  core::dispatch_dtype(x.dtype, [&](auto kind) {
    core::dispatch_index(tokens.type, [&](auto index) {
      local_stats_kernel<decltype(kind)::value, decltype(index)>
          <<<unsigned(x.rows), kThreads, 0, as_cuda(stream)>>>(x, tokens.data, inv_t, vocab_start,
                                                               stats);
      FL_CUDA_CHECK_LAUNCH();
    });
  });
}

void lp_merge(const LogProbStats* stats, int world, int64_t rows, const IndexView& tokens,
              const LinearLogProbsOptions& o, const LinearLogProbsOutputs& out, Stream stream) {
  if (rows == 0) return;
  core::dispatch_index(tokens.type, [&](auto index) {
    merge_kernel<decltype(index)><<<unsigned((rows + 255) / 256), 256, 0, as_cuda(stream)>>>(
        stats, world, rows, tokens.data, o.ignore_index, o.vocab_global, out, device_error_word());
    FL_CUDA_CHECK_LAUNCH();
  });
}

void lp_gradient(const MatrixView& x, const IndexView& tokens, const float* lse,
                 const float* entropy, const float* g, const float* e, float inv_t,
                 int64_t vocab_start, int64_t ignore_index, Stream stream) {
  if (x.rows == 0) return;
  require_row_alignment(x, "lp_gradient");
  core::dispatch_dtype(x.dtype, [&](auto kind) {
    core::dispatch_index(tokens.type, [&](auto index) {
      gradient_kernel<decltype(kind)::value, decltype(index)>
          <<<unsigned(x.rows), kThreads, 0, as_cuda(stream)>>>(x, tokens.data, lse, entropy, g, e,
                                                               inv_t, vocab_start, ignore_index);
      FL_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace fusedloss::cuda

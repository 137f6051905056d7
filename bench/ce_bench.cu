// Cross-entropy benchmark of the C++ API: forward, backward (in place) and forward+backward
// for bf16 logits [rows, V], reduction none; the device copy bandwidth measured in the same
// run and the 3-pass floor. Median of many runs with CUDA events; the logits are restored from
// a pristine copy outside the timed region (the in-place backward overwrites them).
// Output: CSV on stdout (provider,op,V,ms,...), one line per measurement.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "fusedloss/fusedloss.h"

namespace fl = fusedloss;

#define CHECK(call)                                                                       \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_),      \
                   __FILE__, __LINE__);                                                   \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

template <class Setup, class Body>
double median_ms(int iters, Setup&& setup, Body&& body) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < iters + 3; ++i) {
    setup();
    CHECK(cudaEventRecord(a));
    body();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (i >= 3) ms.push_back(t);  // warm-up excluded
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Bytes read + written per second by a large device-to-device copy.
double copy_bandwidth_gbs() {
  const size_t bytes = size_t(2) << 30;
  void *src, *dst;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&dst, bytes));
  CHECK(cudaMemset(src, 1, bytes));
  double ms = median_ms(20, [] {}, [&] { CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

__global__ void fill_bf16(uint16_t* x, size_t n, uint64_t seed) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i < n; i += size_t(gridDim.x) * blockDim.x) {
    // hash -> roughly uniform in [-8, 8)
    uint64_t h = (i + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    float v = (float(h & 0xffffff) / 16777216.0f - 0.5f) * 16.0f;
    uint32_t u = __float_as_uint(v);
    x[i] = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 8192;
  std::vector<int64_t> vocab = {32768, 131072, 151936, 262144};
  const int iters = 30;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const double bw = copy_bandwidth_gbs();
  std::printf("provider,op,V,rows,ms,floor_ms,copy_gbs,peak_extra_mib,gpu\n");
  cudaMemPool_t pool;
  CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
  for (int64_t V : vocab) {
    const size_t n = size_t(rows) * V, bytes = n * 2;
    uint16_t *x, *pristine;
    int64_t* target;
    float *loss, *lse, *grad_loss;
    CHECK(cudaMalloc(&x, bytes));
    CHECK(cudaMalloc(&pristine, bytes));
    CHECK(cudaMalloc(&target, rows * 8));
    CHECK(cudaMalloc(&loss, rows * 4));
    CHECK(cudaMalloc(&lse, rows * 4));
    CHECK(cudaMalloc(&grad_loss, rows * 4));
    fill_bf16<<<1024, 256>>>(pristine, n, uint64_t(V));
    CHECK(cudaGetLastError());
    std::vector<int64_t> t(rows);
    std::mt19937_64 gen(V);
    for (auto& v : t) v = int64_t(gen() % uint64_t(V));
    std::vector<float> ones(rows, 1.0f);
    CHECK(cudaMemcpy(target, t.data(), rows * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(grad_loss, ones.data(), rows * 4, cudaMemcpyHostToDevice));
    fl::CrossEntropyOptions opt;
    opt.reduction = fl::Reduction::None;
    fl::MatrixView xv{x, rows, V, V, fl::DType::BF16, fl::Device::CUDA};
    fl::IndexView tv{target, rows, fl::IndexType::I64, fl::Device::CUDA};
    fl::CrossEntropyOutputs out{loss, lse, nullptr};
    auto restore = [&] { CHECK(cudaMemcpyAsync(x, pristine, bytes, cudaMemcpyDeviceToDevice)); };
    auto fwd = [&] { fl::cross_entropy_forward(xv, tv, opt, out); };
    auto bwd = [&] { fl::cross_entropy_backward(xv, tv, lse, grad_loss, nullptr, opt, xv); };
    restore();
    fwd();
    CHECK(cudaDeviceSynchronize());
    uint64_t zero = 0;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    double t_fwd = median_ms(iters, restore, fwd);
    double t_bwd = median_ms(iters, restore, bwd);
    double t_both = median_ms(iters, restore, [&] { fwd(); bwd(); });
    fl::check_device_errors();
    uint64_t high = 0;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
    // Everything the library allocated beyond the caller's buffers comes from the stream-ordered
    // pool (the scratch RowStats); lse (4 B/row) is the caller's saved state, added here.
    double extra_mib = (double(high) + rows * 4.0) / (1 << 20);
    const double pass_ms = double(bytes) / (bw * 1e9) * 1e3;
    struct { const char* op; double ms, floor; } rowsout[] = {
        {"forward", t_fwd, 1 * pass_ms}, {"backward", t_bwd, 2 * pass_ms}, {"fwd+bwd", t_both, 3 * pass_ms}};
    for (auto& r : rowsout)
      std::printf("fusedloss-cpp,%s,%lld,%lld,%.4f,%.4f,%.1f,%.2f,%s\n", r.op, (long long)V,
                  (long long)rows, r.ms, r.floor, bw, extra_mib, prop.name);
    std::fflush(stdout);
    for (void* p : {(void*)x, (void*)pristine, (void*)target, (void*)loss, (void*)lse, (void*)grad_loss})
      CHECK(cudaFree(p));
  }
  return 0;
}

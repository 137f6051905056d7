// Shared pieces of the C++ benchmark binaries: checked CUDA calls, median event timing,
// the device-copy bandwidth, random bf16 fill.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                       \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_),      \
                   __FILE__, __LINE__);                                                   \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

// A GPU-side wait of about 2 ms (4M cycles, as the Python harness's torch.cuda._sleep) queued
// ahead of each timed region: the host enqueues the timed work while the GPU is busy, so the
// events time device work alone, and the clocks are up as in a training step rather than
// dropping in the host's gaps between short runs.
constexpr long long kBusyCycles = 4000000;
__global__ void busy_wait_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Median milliseconds of `body` over `iters` runs (3 warm-ups), `setup` outside the timing.
template <class Setup, class Body>
double median_ms(int iters, Setup&& setup, Body&& body) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < iters + 3; ++i) {
    setup();
    busy_wait_kernel<<<1, 1>>>(kBusyCycles);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(a));
    body();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (i >= 3) ms.push_back(t);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Median forward, backward and forward+backward times of one provider, each run from a
// restored input (restore() runs outside the timed region), printed as the CSV rows the
// benchmark drivers read: provider,op,<size>,rows,ms,floor_ms,copy_gbs,peak_extra_mib,gpu.
template <class Restore, class Forward, class Backward>
void time_and_print(int iters, Restore&& restore, Forward&& fwd, Backward&& bwd, long long size,
                    long long rows, const double (&floor_ms)[3], double copy_gbs,
                    double extra_mib, const char* gpu, const char* provider = "fusedloss-cpp") {
  const double ms[3] = {median_ms(iters, restore, fwd), median_ms(iters, restore, bwd),
                        median_ms(iters, restore, [&] { fwd(); bwd(); })};
  const char* ops[3] = {"forward", "backward", "fwd+bwd"};
  for (int i = 0; i < 3; ++i)
    std::printf("%s,%s,%lld,%lld,%.4f,%.4f,%.1f,%.2f,%s\n", provider, ops[i], size, rows, ms[i],
                floor_ms[i], copy_gbs, extra_mib, gpu);
  std::fflush(stdout);
}

// Bytes read + written per second by a large device-to-device copy, in GB/s.
inline double copy_bandwidth_gbs() {
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

// Roughly uniform bf16 values in [lo, hi), from a hash of the index (never zeros).
__global__ void fill_bf16_kernel(uint16_t* x, size_t n, uint64_t seed, float lo, float hi) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t h = (i + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    float v = lo + (hi - lo) * (float(h & 0xffffff) / 16777216.0f);
    uint32_t u = __float_as_uint(v);
    x[i] = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

inline void fill_bf16(uint16_t* x, size_t n, uint64_t seed, float lo, float hi) {
  fill_bf16_kernel<<<1024, 256>>>(x, n, seed, lo, hi);
  CHECK(cudaGetLastError());
}

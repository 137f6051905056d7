// What the C++ examples share: a buffer on the GPU when there is one (else host memory, for the
// CPU backend), and the CUDA return-code check. Kept in the examples so each stays a complete
// program a reader can follow without the test harness.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fusedloss/fusedloss.h"
#if FUSEDLOSS_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace example {

#if FUSEDLOSS_HAS_CUDA
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
#endif

// Raw bytes on the device when `on_gpu` (copied back by fetch), else host memory.
template <class T>
struct Buffer {
  std::vector<T> host;
  void* data = nullptr;
  bool on_gpu = false;
  Buffer(std::vector<T> v, bool gpu) : host(std::move(v)), on_gpu(gpu) {
    data = host.data();
#if FUSEDLOSS_HAS_CUDA
    if (on_gpu) {
      check(cudaMalloc(&data, host.size() * sizeof(T)), "cudaMalloc");
      check(cudaMemcpy(data, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            "cudaMemcpy");
    }
#endif
  }
  const std::vector<T>& fetch() {
#if FUSEDLOSS_HAS_CUDA
    if (on_gpu)
      check(cudaMemcpy(host.data(), data, host.size() * sizeof(T), cudaMemcpyDeviceToHost),
            "cudaMemcpy");
#endif
    return host;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
#if FUSEDLOSS_HAS_CUDA
    if (on_gpu) check(cudaFree(data), "cudaFree");
#endif
  }
};

inline bool have_gpu() {
#if FUSEDLOSS_HAS_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

}  // namespace example

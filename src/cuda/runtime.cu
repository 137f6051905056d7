// Stream-ordered memory and copies, per-device facts.
#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include "cuda/runtime.h"
#include "cuda/cuda_check.h"

namespace fusedloss::cuda {

void throw_error(cudaError_t err, const char* call, const char* file, int line) {
  switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorStubLibrary:
    case cudaErrorInitializationError:
    case cudaErrorNoKernelImageForDevice:
      (void)cudaGetLastError();  // the error is reported here; later calls must not see it again
      throw detail::NoUsableCudaDevice(std::string("no usable CUDA device (") +
                                       cudaGetErrorString(err) + ")");
    default:
      detail::fail(call, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err), " (",
                   file, ":", line, ")");
  }
}

void* alloc_async(size_t bytes, Stream stream) {
  void* p = nullptr;
  if (bytes) FL_CUDA_CHECK(cudaMallocAsync(&p, bytes, as_cuda(stream)));
  return p;
}

void free_async(void* ptr, Stream stream) {
  // A destructor path (~Scratch): a failed free must not throw, so its error is dropped here.
  // It stays sticky only if the context itself failed, and then the next checked call reports it.
  if (ptr) (void)cudaFreeAsync(ptr, as_cuda(stream));
}

void copy_async(void* dst, const void* src, size_t bytes, bool to_device, Stream stream) {
  FL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes,
                                to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                                as_cuda(stream)));
}

void synchronize(Stream stream) { FL_CUDA_CHECK(cudaStreamSynchronize(as_cuda(stream))); }

bool capturing(Stream stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FL_CUDA_CHECK(cudaStreamIsCapturing(as_cuda(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

namespace {

std::mutex g_facts_mutex;
std::map<std::tuple<int, const void*, int>, int> g_facts;

// query(device, key, threads) once per (current device, key, threads); a query that throws
// leaves nothing behind, so the next call asks again.
int device_fact(const void* key, int threads, int (*query)(int device, const void* key, int threads)) {
  int device = 0;
  FL_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(g_facts_mutex);
  auto [it, fresh] = g_facts.try_emplace({device, key, threads}, 0);
  if (fresh) {
    try {
      it->second = query(device, key, threads);
    } catch (...) {
      g_facts.erase(it);
      throw;
    }
  }
  return it->second;
}

}  // namespace

int sm_count() {
  return device_fact(nullptr, 0, [](int device, const void*, int) {
    int n = 0;
    FL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return std::max(n, 1);
  });
}

int blocks_per_sm(const void* kernel, int threads) {
  return device_fact(kernel, threads, [](int, const void* k, int n) {
    int blocks = 0;
    FL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, n, 0));
    return std::max(blocks, 1);
  });
}

bool built_for_sm90(const void* kernel) {
  return device_fact(kernel, -1, [](int, const void* k, int) {  // -1: not a block size
    cudaFuncAttributes attributes{};
    FL_CUDA_CHECK(cudaFuncGetAttributes(&attributes, k));
    return int(attributes.ptxVersion >= 90);
  }) != 0;
}

}  // namespace fusedloss::cuda

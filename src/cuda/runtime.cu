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

int max_active_clusters(const void* kernel, int threads, int cluster, size_t shared) {
  int device = 0;
  FL_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, int, size_t>, int> known;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = known.find({device, kernel, threads, cluster, shared});
    if (it != known.end()) return it->second;
  }
  int major = 0, clusters = 0;
  FL_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major >= 9 && built_for_sm90(kernel)) {
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attribute = {};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = unsigned(cluster);
    attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
    config.gridDim = dim3(unsigned(cluster));
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = shared;
    config.attrs = &attribute;
    config.numAttrs = 1;
    // A refusal here is an answer (the cluster does not fit this device), not a failed call,
    // and it is kept like any other: the layout, the grid and with them the weight gradient's
    // bits must not change between calls.
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
      (void)cudaGetLastError();
      clusters = 0;
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  return known[{device, kernel, threads, cluster, shared}] = std::max(clusters, 0);
}

void launch_in_clusters(const void* kernel, unsigned blocks, int threads, int cluster,
                        size_t shared, Stream stream, void** args) {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = unsigned(cluster);
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = shared;
  config.stream = as_cuda(stream);
  config.attrs = &attribute;
  config.numAttrs = 1;
  FL_CUDA_CHECK(cudaLaunchKernelExC(&config, kernel, args));
}

}  // namespace fusedloss::cuda

// Stream-ordered memory and copies, per-device facts.
#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include "cuda/runtime.h"
#include "common/scratch.h"
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
    case cudaErrorMemoryAllocation: {  // not sticky: the next call may succeed
      (void)cudaGetLastError();
      int device = -1;
      (void)cudaGetDevice(&device);
      throw OutOfMemory(std::string("CUDA out of memory on device ") + std::to_string(device) +
                        ": " + call + " (" + file + ":" + std::to_string(line) + ")");
    }
    default:
      detail::fail(call, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err), " (",
                   file, ":", line, ")");
  }
}

void* alloc_async(size_t bytes, Stream stream) {
  if (!bytes) return nullptr;
  // An installed allocator serves outside stream capture only: a captured graph keeps using its
  // scratch at every replay, long after the call gave it back (cudaMallocAsync's memory nodes
  // belong to the graph).
  if (detail::scratch_allocator_installed() && !capturing(stream))
    if (void* p = detail::scratch_from_installed(bytes, stream)) return p;
  void* p = nullptr;
  try {
    FL_CUDA_CHECK(cudaMallocAsync(&p, bytes, as_cuda(stream)));
  } catch (const OutOfMemory& e) {  // the size is what a reader of the error needs
    throw OutOfMemory("fusedloss scratch of " + std::to_string(bytes) + " bytes: " + e.what());
  }
  return p;
}

void free_async(void* ptr, Stream stream) {
  if (!ptr || detail::release_to_installed(ptr, stream)) return;
  // A destructor path (~Scratch): a failed free must not throw, so its error is dropped here.
  // It stays sticky only if the context itself failed, and then the next checked call reports it.
  (void)cudaFreeAsync(ptr, as_cuda(stream));
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

// What a fact is about: a kernel (or none), a block size, and for cluster occupancy the
// cluster size and dynamic shared memory (0 otherwise).
struct FactKey {
  const void* kernel = nullptr;
  int threads = 0;
  int cluster = 0;
  size_t shared = 0;
};

std::mutex g_facts_mutex;
std::map<std::tuple<int, const void*, int, int, size_t>, int> g_facts;

// query(device, key) once per current device and key; a query that throws leaves nothing
// behind, so the next call asks again. (The query runs under the lock: it must not ask for
// another fact.)
int device_fact(const FactKey& key, int (*query)(int device, const FactKey& key)) {
  int device = 0;
  FL_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(g_facts_mutex);
  auto [it, fresh] =
      g_facts.try_emplace({device, key.kernel, key.threads, key.cluster, key.shared}, 0);
  if (fresh) {
    try {
      it->second = query(device, key);
    } catch (...) {
      g_facts.erase(it);
      throw;
    }
  }
  return it->second;
}

// A launch of `blocks` blocks in 1-D clusters of `cluster`; `attribute` must outlive it.
cudaLaunchConfig_t cluster_config(unsigned blocks, int threads, int cluster, size_t shared,
                                  cudaLaunchAttribute& attribute) {
  attribute = {};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = unsigned(cluster);
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = shared;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return config;
}

}  // namespace

int sm_count() {
  return device_fact({}, [](int device, const FactKey&) {
    int n = 0;
    FL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return std::max(n, 1);
  });
}

int blocks_per_sm(const void* kernel, int threads) {
  return device_fact({kernel, threads}, [](int, const FactKey& k) {
    int blocks = 0;
    FL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k.kernel, k.threads, 0));
    return std::max(blocks, 1);
  });
}

int shared_per_block_optin() {
  return device_fact({nullptr, -2}, [](int device, const FactKey&) {  // -2: not a block size
    int n = 0;
    FL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return n;
  });
}

int shared_per_sm() {
  return device_fact({nullptr, -3}, [](int device, const FactKey&) {
    int n = 0;
    FL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    return n;
  });
}

int64_t shared_for_two_blocks_per_sm() {
  return std::min<int64_t>(int64_t(shared_per_block_optin()) - 1024,
                           int64_t(shared_per_sm()) / 2 - 2048);
}

void allow_most_shared(const void* kernel) {
  const int most = shared_per_block_optin();  // (asked before the lock device_fact takes)
  device_fact({kernel, -4, 0, size_t(most)}, [](int, const FactKey& k) {
    // the dynamic part may take what the kernel's static shared memory leaves of the opt-in
    cudaFuncAttributes attributes{};
    FL_CUDA_CHECK(cudaFuncGetAttributes(&attributes, k.kernel));
    const int dynamic = int(k.shared) - int(attributes.sharedSizeBytes);
    FL_CUDA_CHECK(cudaFuncSetAttribute(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       dynamic > 0 ? dynamic : 0));
    return 1;
  });
}

bool built_for_sm90(const void* kernel) {
  return device_fact({kernel, -1}, [](int, const FactKey& k) {  // -1: not a block size
    cudaFuncAttributes attributes{};
    FL_CUDA_CHECK(cudaFuncGetAttributes(&attributes, k.kernel));
    return int(attributes.ptxVersion >= 90);
  }) != 0;
}

int max_active_clusters(const void* kernel, int threads, int cluster, size_t shared) {
  if (!built_for_sm90(kernel)) return 0;  // its cluster instructions would be missing
  return device_fact({kernel, threads, cluster, shared}, [](int device, const FactKey& k) {
    int major = 0, clusters = 0;
    FL_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    if (major < 9) return 0;
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config =
        cluster_config(unsigned(k.cluster), k.threads, k.cluster, k.shared, attribute);
    // A refusal here is an answer (the cluster does not fit this device), not a failed call,
    // and it is kept like any other: the layout, the grid and with them the weight gradient's
    // bits must not change between calls.
    if (cudaOccupancyMaxActiveClusters(&clusters, k.kernel, &config) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return std::max(clusters, 0);
  });
}

void launch_in_clusters(const void* kernel, unsigned blocks, int threads, int cluster,
                        size_t shared, Stream stream, void** args) {
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t config = cluster_config(blocks, threads, cluster, shared, attribute);
  config.stream = as_cuda(stream);
  FL_CUDA_CHECK(cudaLaunchKernelExC(&config, kernel, args));
}

}  // namespace fusedloss::cuda

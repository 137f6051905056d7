// Stream-ordered memory and copies.
#include <cstdint>
#include "cuda/runtime.h"
#include "cuda/cuda_check.h"

namespace fusedloss::cuda {

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

}  // namespace fusedloss::cuda

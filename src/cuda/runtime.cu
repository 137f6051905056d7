// Stream-ordered memory and copies.
#include <cstdint>
#include <string>
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

}  // namespace fusedloss::cuda

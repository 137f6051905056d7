// Stream-ordered memory and copies shared by the CUDA backends (src/cuda/runtime.cu).
#pragma once
#include <cstddef>
#include "fusedloss/types.h"

namespace fusedloss::cuda {

// Stream-ordered scratch memory (cudaMallocAsync), safe inside CUDA graph capture.
void* alloc_async(size_t bytes, Stream stream);
void free_async(void* ptr, Stream stream);
void copy_async(void* dst, const void* src, size_t bytes, bool to_device, Stream stream);
void synchronize(Stream stream);
// Whether `stream` is being captured into a CUDA graph (what must not time or synchronise then).
bool capturing(Stream stream);

}  // namespace fusedloss::cuda

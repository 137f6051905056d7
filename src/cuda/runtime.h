// Stream-ordered memory and copies, and per-device facts, shared by the CUDA backends
// (src/cuda/runtime.cu).
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

// Facts of the current device, each queried once per device (and kernel, block size) and kept:
// the SM count; how many blocks of `threads` threads of `kernel` an SM holds; and whether
// `kernel`, as this device runs it, was compiled for sm_90 or later (the virtual architecture
// of its code: an sm_80-only build JIT-compiled for an H100 reports 80), i.e. whether its
// Hopper instructions (dependent launch, bulk copies, clusters) are in it.
int sm_count();
int blocks_per_sm(const void* kernel, int threads);
bool built_for_sm90(const void* kernel);

}  // namespace fusedloss::cuda

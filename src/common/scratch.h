// The installed scratch allocator (fusedloss/scratch.h), as the backends consult it: below the
// API and the CUDA runtime alike (src/common), so that src/cuda needs nothing from src/api.
#pragma once
#include <cstddef>
#include "fusedloss/types.h"

namespace fusedloss::detail {

// Whether an allocator may be installed (one atomic load: the default path's whole cost).
bool scratch_allocator_installed();
// Scratch for work on `stream` from the installed allocator, recorded with it; nullptr when
// none is installed or it declines the stream (the caller takes cudaMallocAsync). Throws
// OutOfMemory when it has no memory for the request, Error for a block not 256-byte aligned.
void* scratch_from_installed(size_t bytes, Stream stream);
// Gives `ptr` back to the allocator it came from; false when it came from none (cudaMallocAsync).
bool release_to_installed(void* ptr, Stream stream);

}  // namespace fusedloss::detail

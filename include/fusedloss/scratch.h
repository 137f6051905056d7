// fusedloss: where the CUDA backends take their scratch memory.
//
// Scratch is what a call needs only while it runs: the linear cross-entropy's logits chunk
// buffer and cuBLASLt workspace (workspace_bytes together), the cross-entropy's per-row
// losses, RMSNorm's and SwiGLU's per-block partial sums when no workspace is passed, the
// vocab-parallel exchange buffers. By default it comes from cudaMallocAsync on the device's
// default pool and goes back with cudaFreeAsync on the same stream. A trainer with its own
// caching allocator installs it here, so that the scratch is cached and counted with the rest
// of its memory (the PyTorch package can hand over torch's caching allocator).
#pragma once
#include <cstddef>
#include "fusedloss/types.h"

namespace fusedloss {

struct ScratchAllocator {
  // `bytes` (> 0) for work queued on `stream` from now on, on the stream's device (the current
  // device when the core calls it from a call whose buffers are on it), 256-byte aligned.
  // nullptr: out of memory; the call throws OutOfMemory (it does not fall back to
  // cudaMallocAsync: the allocator's limits, e.g. a memory fraction, are the trainer's). A less
  // aligned block is given back at once and the call throws Error. Must not throw. Not called
  // for a stream `serves` declines, nor while `stream` is being captured into a CUDA graph: the
  // graph would use the block at every replay, after the call gave it back; cudaMallocAsync's
  // memory nodes serve captures.
  void* (*allocate)(size_t bytes, Stream stream, void* context) = nullptr;
  // Takes back what `allocate` returned, with the stream it was allocated for. Work already
  // queued on that stream may still use the memory: it may go only to work queued on that
  // stream after this call (cudaFreeAsync's rule). Must not throw.
  void (*release)(void* ptr, Stream stream, void* context) = nullptr;
  void* context = nullptr;  // passed to every function
  // Optional: whether `allocate` serves scratch for `stream` (e.g. only a framework's current
  // stream); scratch for a stream it declines comes from cudaMallocAsync. nullptr: every stream.
  // Must not throw.
  bool (*serves)(Stream stream, void* context) = nullptr;
};

// Installs a copy of `allocator` for the process (nullptr: back to cudaMallocAsync); allocate
// and release must be set. Scratch taken before goes back to the allocator it came from. Throws
// Error for an allocator with one function missing.
void set_scratch_allocator(const ScratchAllocator* allocator);

}  // namespace fusedloss

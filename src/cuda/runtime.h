// Stream-ordered memory and copies, and per-device facts, shared by the CUDA backends
// (src/cuda/runtime.cu).
#pragma once
#include <cstddef>
#include <tuple>
#include <utility>
#include "fusedloss/types.h"

namespace fusedloss::cuda {

// Stream-ordered scratch memory: from the installed allocator (fusedloss/scratch.h), else
// cudaMallocAsync; safe inside CUDA graph capture. free_async gives it back where it came from.
void* alloc_async(size_t bytes, Stream stream);
void free_async(void* ptr, Stream stream);
// alloc_async's scratch, given back on scope exit (also when a launch in between throws).
class ScratchBuffer {
 public:
  ScratchBuffer(size_t bytes, Stream stream) : ptr_(alloc_async(bytes, stream)), stream_(stream) {}
  ~ScratchBuffer() { free_async(ptr_, stream_); }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  void* get() const { return ptr_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }

 private:
  void* ptr_;
  Stream stream_;
};
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
// Shared memory: the most dynamic shared memory one block may opt into, and an SM's; and the
// most a block of a row-slicing cluster kernel takes, so that two stay resident on an SM (one
// block's copies overlapping another's arithmetic): 1 KiB under the opt-in, and half the SM's
// less 2 KiB for each block's static part and the driver's reserve.
int shared_per_block_optin();
int shared_per_sm();
int64_t shared_for_two_blocks_per_sm();
// Lets `kernel` take as much dynamic shared memory as shared_per_block_optin() leaves beside
// its static shared memory on the current device, once per device: the largest any call needs,
// so that concurrent callers never lower it under each other's launches.
void allow_most_shared(const void* kernel);
bool built_for_sm90(const void* kernel);

// Thread-block clusters (sm_90 and later). How many clusters of `cluster` blocks of `kernel`
// (`threads` threads and `shared` bytes of dynamic shared memory a block) the current device
// keeps resident at once; 0 where it cannot run one: a device before sm_90, a kernel whose code
// was not built for it (its cluster instructions would be missing), no GPC with that many SMs
// free. Asked once per device and configuration; an opt-in to more than 48 KiB of dynamic
// shared memory (cudaFuncSetAttribute) must come first.
int max_active_clusters(const void* kernel, int threads, int cluster, size_t shared);
// kernel(*args[0], ...) on `blocks` blocks (a multiple of `cluster`), in clusters of `cluster`.
void launch_in_clusters(const void* kernel, unsigned blocks, int threads, int cluster,
                        size_t shared, Stream stream, void** args);
// The same with the kernel's arguments, converted to its parameter types as <<<>>> does.
template <class... Params, class... Args>
void launch_in_clusters(void (*kernel)(Params...), unsigned blocks, int threads, int cluster,
                        size_t shared, Stream stream, Args&&... args) {
  std::tuple<Params...> values(std::forward<Args>(args)...);
  std::apply(
      [&](auto&... v) {
        void* pointers[] = {static_cast<void*>(&v)...};
        launch_in_clusters(reinterpret_cast<const void*>(kernel), blocks, threads, cluster, shared,
                           stream, pointers);
      },
      values);
}

}  // namespace fusedloss::cuda

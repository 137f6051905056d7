// A ring of row stages in shared memory, filled by the copy engine (sm_90's bulk copies, TMA):
// the one home for the staged row kernels' data movement.
//
// Why: a row kernel that loads its row into registers or shared memory with its own threads
// has nothing in flight while it reduces the row and stores its outputs. Here one thread asks
// for the block's next rows (one bulk copy per tensor and row) up to `stages` rows ahead; the
// copies land in shared memory whatever the threads are doing, and an mbarrier per stage says
// when a row is complete. A stage of 0 bytes completes at once (a block with no share of a row). The threads read their vectors from shared
// memory (16-byte loads, consecutive per warp: no bank conflicts).
//
// Protocol, for a block that walks rows i = 0, 1, ... (its own rows, in order):
//   - init() by every thread once, before anything else (thread 0 initialises, the block syncs);
//   - fill(i % stages, sources) for rows 0 .. stages-1 by every thread (thread 0 issues);
//   - before reading row i: wait(i % stages, (i / stages) & 1);
//   - a stage is refilled (fill) only after a block barrier that every thread passed after its
//     last read of the row in it: the caller's row loop has one per row.
// No copy is left in flight at the kernel's end if every filled row is waited for.
//
// Requirements (checked by the host before choosing a staged kernel): a 16-byte aligned source
// row, bytes a multiple of 16 and at most 2^20 - 1 per stage (an mbarrier's transaction count),
// and an sm_90 binary.
#pragma once
#include <cstdint>
#include <cuda/ptx>

namespace fusedloss::cuda {

// The largest number of tensors a stage holds (x and dy in the backward; x and the residual in
// the forward).
constexpr int kRingMaxTensors = 2;

class RowRing {
 public:
  // smem: dynamic shared memory of bytes() bytes, 128-byte aligned.
  __device__ RowRing(unsigned char* smem, int stages, int tensors, uint32_t row_bytes)
      : full_(reinterpret_cast<uint64_t*>(smem)),
        data_(smem + 128),
        stages_(stages),
        tensors_(tensors),
        row_bytes_(row_bytes) {}

  __host__ __device__ static size_t bytes(int stages, int tensors, int64_t row_bytes) {
    return 128 + size_t(stages) * size_t(tensors) * size_t(row_bytes);  // barriers, then rows
  }

  __device__ void init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) {
      for (int s = 0; s < stages_; ++s) ::cuda::ptx::mbarrier_init(full_ + s, 1);
      // the barriers' initialisation, visible to the copy engine before any copy uses them
      ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
    }
    __syncthreads();
#else
    __trap();  // the host launches staged kernels only from sm_90 binaries
#endif
  }

  // Thread 0 asks for row `src[0..tensors)` into stage s; the other threads do nothing.
  __device__ void fill(int s, const void* const (&src)[kRingMaxTensors]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x != 0) return;
    ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                           ::cuda::ptx::space_shared, full_ + s,
                                           uint32_t(tensors_) * row_bytes_);
    for (int k = 0; k < tensors_ && row_bytes_ > 0; ++k)
      ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global,
                                 row(s, k), src[k], row_bytes_, full_ + s);
#else
    (void)s, (void)src;
#endif
  }

  // Every thread: until stage s holds its row (the fill's phase of that parity).
  __device__ void wait(int s, uint32_t parity) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    while (!::cuda::ptx::mbarrier_try_wait_parity(::cuda::ptx::sem_acquire,
                                                  ::cuda::ptx::scope_cta, full_ + s, parity)) {
    }
#else
    (void)s, (void)parity;
#endif
  }

  __device__ unsigned char* row(int s, int tensor) const {
    return data_ + (size_t(s) * size_t(tensors_) + size_t(tensor)) * row_bytes_;
  }

 private:
  uint64_t* full_;
  unsigned char* data_;
  int stages_, tensors_;
  uint32_t row_bytes_;
};

}  // namespace fusedloss::cuda

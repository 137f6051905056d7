// sm_90's bulk copies between global and shared memory (the TMA unit's 1-D form) and the
// thread-block-cluster barrier, for kernels that keep a whole row in shared memory: one
// instruction moves a row's slice, and the load is tracked by an mbarrier's transaction count
// instead of by registers, so an SM keeps every resident block's slice in flight at once.
// Compiled for sm_90 and later only; callers launch such kernels only on those devices (on
// older targets the bodies are empty and must not run).
#pragma once
#include <cstdint>

namespace fusedloss::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FUSEDLOSS_BULK_COPY 1
#endif

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// One thread: an mbarrier expecting one arrival, visible to the bulk-copy unit before use.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
#ifdef FUSEDLOSS_BULK_COPY
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One thread: arrive on `bar` announcing `bytes` of copies, then start the copy of `bytes`
// (a multiple of 16, both addresses 16-byte aligned) from src into this block's shared dst.
// The barrier's phase completes when they have all landed.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#ifdef FUSEDLOSS_BULK_COPY
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar)) : "memory");
#endif
}

// Every thread: wait until phase `parity` of `bar` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#ifdef FUSEDLOSS_BULK_COPY
  uint32_t done = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done) : "r"(shared_address(bar)), "r"(parity) : "memory");
  } while (!done);
#endif
}

// Every thread that wrote shared memory the bulk store will read, before the block barrier
// that precedes the store: orders the writes before the copy unit's reads.
__device__ __forceinline__ void fence_shared_for_bulk_copy() {
#ifdef FUSEDLOSS_BULK_COPY
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// One thread: copy `bytes` (a multiple of 16, 16-byte aligned) from this block's shared src to
// global dst, and wait until the copy has read its source (the shared memory may then be
// reused or the block exit; the global writes complete on their own, before the kernel ends).
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
#ifdef FUSEDLOSS_BULK_COPY
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(shared_address(src)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}

// The cluster barrier in two halves (every thread of every block of the cluster): arrive
// releases this thread's earlier writes (shared memory included) to the cluster, wait acquires
// everyone's.
__device__ __forceinline__ void cluster_arrive() {
#ifdef FUSEDLOSS_BULK_COPY
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#ifdef FUSEDLOSS_BULK_COPY
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
#ifdef FUSEDLOSS_BULK_COPY
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}

// Reads a float at `p` (this block's shared memory address) in block `rank` of the cluster.
__device__ __forceinline__ float load_from_cluster_block(const float* p, uint32_t rank) {
  float v = 0.0f;
#ifdef FUSEDLOSS_BULK_COPY
  uint32_t remote = 0;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(p)), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
}

// Writes v at `p` (this block's shared memory address) in block `rank` of the cluster; visible
// there after a cluster barrier (cluster_arrive's release, the reader's cluster_wait).
__device__ __forceinline__ void store_to_cluster_block(float* p, uint32_t rank, float v) {
#ifdef FUSEDLOSS_BULK_COPY
  uint32_t remote = 0;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(p)), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
#endif
}

}  // namespace fusedloss::cuda

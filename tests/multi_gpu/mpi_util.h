// mpirun test helpers: this rank and the world, and an error every rank must raise.
#pragma once
#include <malloc.h>
#include <mpi.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include "common/test_util.h"

namespace fusedloss::test {

inline int world_rank() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
inline int world_size() { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }

// Every rank throws an error of type E (an Error, e.g. OutOfMemory) holding `fragment`; none
// hangs.
template <class E = Error, class F>
void expect_error_everywhere(F&& f, const char* fragment) {
  int ok = 0;
  try {
    f();
  } catch (const Error& e) {
    const bool found = std::string(e.what()).find(fragment) != std::string::npos;
    const bool typed = dynamic_cast<const E*>(&e) != nullptr;
    ok = found && typed;
    if (!found) ADD_FAILURE() << "message '" << e.what() << "' lacks '" << fragment << "'";
    if (!typed) ADD_FAILURE() << "'" << e.what() << "' is not the error type expected";
  }
  EXPECT_EQ(ok, 1) << "rank " << world_rank() << " did not raise";
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(all, world_size()) << "not every rank raised";
}

// f() returns without an error on every rank.
template <class F>
void expect_runs_everywhere(F&& f) {
  int ran = 0;
  try {
    f();
    ran = 1;
  } catch (const Error& e) {
    ADD_FAILURE() << "rank " << world_rank() << ": " << e.what();
  }
  int all = 0;
  MPI_Allreduce(&ran, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(all, world_size()) << "the call failed on some rank";
}

// While alive, this rank has about `headroom` bytes of memory left on `device` (0: no cap): on
// the host an address-space limit just above what the process maps, on a GPU a block holding
// the rest of the device's free memory.
class MemoryCap {
 public:
  MemoryCap(Device device, size_t headroom) {
    if (!headroom) return;
    if (device == Device::CPU) {
      malloc_trim(0);  // free heap given back: an allocation under the cap needs new space
      getrlimit(RLIMIT_AS, &saved_);
      std::ifstream statm("/proc/self/statm");
      size_t pages = 0;
      statm >> pages;
      const rlimit cap{pages * size_t(sysconf(_SC_PAGESIZE)) + headroom, saved_.rlim_max};
      capped_ = setrlimit(RLIMIT_AS, &cap) == 0;
      if (!capped_) ADD_FAILURE() << "setrlimit(RLIMIT_AS) failed";
      return;
    }
#if FUSEDLOSS_HAS_CUDA
    int dev = 0;
    cudaMemPool_t pool;
    cuda_check(cudaDeviceSynchronize());
    cuda_check(cudaGetDevice(&dev));
    cuda_check(cudaDeviceGetDefaultMemPool(&pool, dev));
    cuda_check(cudaMemPoolTrimTo(pool, 0));  // what the pool keeps would serve the call
    size_t free = 0, total = 0;
    cuda_check(cudaMemGetInfo(&free, &total));
    if (free > headroom) cuda_check(cudaMalloc(&hog_, free - headroom));
#endif
  }
  ~MemoryCap() {
    if (capped_) setrlimit(RLIMIT_AS, &saved_);
#if FUSEDLOSS_HAS_CUDA
    if (hog_) cudaFree(hog_);
#endif
  }
  MemoryCap(const MemoryCap&) = delete;
  MemoryCap& operator=(const MemoryCap&) = delete;

 private:
  rlimit saved_{};
  bool capped_ = false;
  void* hog_ = nullptr;
};

}  // namespace fusedloss::test

// The process's scratch allocator (fusedloss/scratch.h). Each allocation remembers the allocator
// it came from, so replacing it while scratch is live is safe. Until one is installed the CUDA
// runtime's path pays one atomic load.
#include "fusedloss/scratch.h"

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>
#include "common/scratch.h"
#include "common/error.h"

namespace fusedloss {
namespace {

struct Installed {
  std::mutex mu;
  const ScratchAllocator* current = nullptr;  // one of `copies`
  // Every allocator ever installed, one copy each, never freed (live scratch may point at one);
  // installing an equal one again reuses its copy, so switching back and forth does not grow it.
  std::vector<const ScratchAllocator*> copies;
  std::unordered_map<void*, const ScratchAllocator*> taken;
};

Installed& installed() {
  static auto* state = new Installed;  // never destroyed: scratch may come back during exit
  return *state;
}

std::atomic<bool> g_ever_installed{false};

constexpr uintptr_t kScratchAlignment = 256;  // cudaMalloc's and cudaMallocAsync's

}  // namespace

void set_scratch_allocator(const ScratchAllocator* allocator) {
  if (allocator) {
    detail::require(allocator->allocate && allocator->release, "allocator: got allocate = ",
                    allocator->allocate ? "a function" : "nullptr", " and release = ",
                    allocator->release ? "a function" : "nullptr",
                    ", expected both (or no allocator: nullptr, for cudaMallocAsync)");
  }
  Installed& s = installed();
  std::lock_guard<std::mutex> lock(s.mu);
  s.current = nullptr;
  if (!allocator) return;
  for (const ScratchAllocator* c : s.copies)
    if (c->allocate == allocator->allocate && c->release == allocator->release &&
        c->serves == allocator->serves && c->context == allocator->context)
      s.current = c;
  if (!s.current) s.copies.push_back(s.current = new ScratchAllocator(*allocator));
  g_ever_installed.store(true, std::memory_order_release);
}

namespace detail {

bool scratch_allocator_installed() { return g_ever_installed.load(std::memory_order_acquire); }

void* scratch_from_installed(size_t bytes, Stream stream) {
  if (!g_ever_installed.load(std::memory_order_acquire)) return nullptr;
  Installed& s = installed();
  const ScratchAllocator* allocator = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    allocator = s.current;
  }
  if (!allocator) return nullptr;
  if (allocator->serves && !allocator->serves(stream, allocator->context)) return nullptr;
  void* ptr = allocator->allocate(bytes, stream, allocator->context);
  if (!ptr)
    throw OutOfMemory("fusedloss scratch of " + std::to_string(bytes) +
                      " bytes: the installed scratch allocator has no memory for it");
  if (reinterpret_cast<uintptr_t>(ptr) % kScratchAlignment != 0) {
    allocator->release(ptr, stream, allocator->context);  // the kernels' vector loads and
    fail("fusedloss scratch of ", bytes, " bytes: the installed scratch allocator returned ",
         ptr, ", expected a ", kScratchAlignment, "-byte aligned block");  // cuBLASLt assume it
  }
  std::lock_guard<std::mutex> lock(s.mu);
  s.taken[ptr] = allocator;
  return ptr;
}

bool release_to_installed(void* ptr, Stream stream) {
  if (!g_ever_installed.load(std::memory_order_acquire)) return false;
  Installed& s = installed();
  const ScratchAllocator* allocator = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.taken.find(ptr);
    if (it == s.taken.end()) return false;
    allocator = it->second;
    s.taken.erase(it);
  }
  allocator->release(ptr, stream, allocator->context);
  return true;
}

}  // namespace detail
}  // namespace fusedloss

// Test helpers: seeded random inputs, dtype rounding, buffers that live on either backend,
// poisoning, and comparison against the float64 reference.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <vector>

#include "core/numeric.h"  // fusedloss_testing adds src/ to the include path
#include "fusedloss/config.h"
#include "fusedloss/types.h"
#if FUSEDLOSS_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace fusedloss::test {

// One seed per process, fresh each run unless FUSEDLOSS_SEED is set; printed for replay.
inline uint64_t test_seed() {
  static uint64_t seed = [] {
    const char* env = std::getenv("FUSEDLOSS_SEED");
    uint64_t s = env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    std::cout << "[fusedloss] random seed " << s << " (set FUSEDLOSS_SEED=" << s
              << " to replay)\n";
    return s;
  }();
  return seed;
}

inline std::mt19937_64& rng() {
  static std::mt19937_64 gen(test_seed());
  return gen;
}

inline int64_t dtype_size(DType d) { return d == DType::F32 ? 4 : 2; }

// Store a float as dtype into raw bytes, and read it back.
inline void store_as(DType d, void* base, int64_t i, float v) {
  if (d == DType::F32) static_cast<float*>(base)[i] = v;
  if (d == DType::F16) static_cast<uint16_t*>(base)[i] = core::float_to_half(v);
  if (d == DType::BF16) static_cast<uint16_t*>(base)[i] = core::float_to_bf16(v);
}
inline float load_as(DType d, const void* base, int64_t i) {
  if (d == DType::F32) return static_cast<const float*>(base)[i];
  if (d == DType::F16) return core::half_to_float(static_cast<const uint16_t*>(base)[i]);
  return core::bf16_to_float(static_cast<const uint16_t*>(base)[i]);
}

inline bool cuda_available(std::string* why) {
#if FUSEDLOSS_HAS_CUDA
  int n = 0, driver = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && n > 0) return true;
  cudaDriverGetVersion(&driver);  // 0: no CUDA driver is loaded (no GPU on this machine)
  if (driver == 0)
    *why = "no usable GPU (no CUDA driver found)";
  else if (e == cudaSuccess || e == cudaErrorNoDevice)
    *why = "no usable GPU (the CUDA driver sees no device)";
  else
    *why = std::string("no usable GPU (") + cudaGetErrorString(e) + ")";
  return false;
#else
  *why = "this build has no CUDA backend";
  return false;
#endif
}

#define FL_SKIP_UNLESS_BACKEND(device)                                              \
  do {                                                                              \
    std::string why_;                                                               \
    if ((device) == ::fusedloss::Device::CUDA && !::fusedloss::test::cuda_available(&why_)) { \
      std::cout << "[  SKIPPED ] CUDA backend: " << why_ << "\n";                   \
      GTEST_SKIP() << "CUDA backend: " << why_;                                     \
    }                                                                               \
  } while (0)

#if FUSEDLOSS_HAS_CUDA
// A test's own CUDA call: its failure throws, naming the error.
inline void cuda_check(cudaError_t e) {
  if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
}
#endif

// Raw bytes mirrored on the host; on the CUDA backend the device copy is what the library sees.
class Buffer {
 public:
  Buffer(Device device, size_t bytes) : device_(device), host_(bytes) {
#if FUSEDLOSS_HAS_CUDA
    if (device_ == Device::CUDA && bytes) {
      if (cudaMalloc(&dev_, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    }
#endif
  }
  ~Buffer() {
#if FUSEDLOSS_HAS_CUDA
    if (dev_) cudaFree(dev_);
#endif
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* host() { return host_.data(); }
  template <class T> T* host_as() { return reinterpret_cast<T*>(host_.data()); }
  size_t bytes() const { return host_.size(); }
  Device device() const { return device_; }
  // The pointer handed to the library.
  void* data() { return device_ == Device::CUDA ? dev_ : static_cast<void*>(host_.data()); }
  template <class T> T* data_as() { return static_cast<T*>(data()); }
  void upload() {
#if FUSEDLOSS_HAS_CUDA
    if (device_ == Device::CUDA && bytes())
      check(cudaMemcpy(dev_, host_.data(), bytes(), cudaMemcpyHostToDevice));
#endif
  }
  void download() {
#if FUSEDLOSS_HAS_CUDA
    if (device_ == Device::CUDA && bytes()) {
      check(cudaDeviceSynchronize());
      check(cudaMemcpy(host_.data(), dev_, bytes(), cudaMemcpyDeviceToHost));
    }
#endif
  }
  // Fill with a byte pattern (0xff: NaN for every float dtype) and upload.
  void poison(unsigned char byte = 0xff) {
    std::memset(host_.data(), byte, bytes());
    upload();
  }

 private:
#if FUSEDLOSS_HAS_CUDA
  static void check(cudaError_t e) { cuda_check(e); }
#endif
  Device device_;
  std::vector<unsigned char> host_;
  void* dev_ = nullptr;
};

// Sets one environment variable for a scope (the kernels' FUSEDLOSS_* knobs,
// read at every call).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_)
      ::setenv(name_, old_.c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

// ||a - b|| / ||b|| over finite references; NaN in `a` where b is finite fails.
inline double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Tolerances for results stored in a dtype (fp32 math inside).
inline double grad_tolerance(DType d) { return d == DType::F32 ? 2e-5 : d == DType::F16 ? 2e-3 : 1e-2; }
constexpr double kLossTolerance = 2e-5;  // losses are fp32 whatever the logits' dtype


// Expects fusedloss::Error whose message contains every fragment.
template <class F>
void expect_error(F&& f, std::initializer_list<const char*> fragments) {
  try {
    f();
    ADD_FAILURE() << "expected fusedloss::Error";
  } catch (const Error& e) {
    for (const char* frag : fragments)
      EXPECT_NE(std::string(e.what()).find(frag), std::string::npos)
          << "message '" << e.what() << "' lacks '" << frag << "'";
  }
}
template <class F>
void expect_error(F&& f, const char* a, const char* b) {
  expect_error(std::forward<F>(f), {a, b});
}

}  // namespace fusedloss::test

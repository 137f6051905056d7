// A downstream program: one cross-entropy through the installed library, checked by hand.
#include <fusedloss/fusedloss.h>

#include <cmath>
#include <cstdio>
#include <cstring>

int main() {
  float x[2][3] = {{1.0f, 2.0f, 3.0f}, {0.5f, -1.0f, 0.0f}};
  int32_t target[2] = {2, 0};
  float loss = NAN, lse[2];
  fusedloss::CrossEntropyOptions opt;  // mean over rows
  fusedloss::cross_entropy_forward({x, 2, 3, 3, fusedloss::DType::F32, fusedloss::Device::CPU},
                                   {target, 2, fusedloss::IndexType::I32, fusedloss::Device::CPU},
                                   opt, {&loss, lse, nullptr});
  double expect = 0;
  for (int r = 0; r < 2; ++r) {
    double s = 0;
    for (float v : x[r]) s += std::exp(double(v));
    expect += (std::log(s) - x[r][target[r]]) / 2;
  }
  std::printf("fusedloss %s (CUDA %d): loss %.7f, expected %.7f\n", FUSEDLOSS_VERSION,
              FUSEDLOSS_HAS_CUDA, loss, expect);
  if (std::strcmp(FUSEDLOSS_VERSION, EXPECT_VERSION) != 0) {
    std::printf("FUSEDLOSS_VERSION %s differs from the CMake package's version %s\n",
                FUSEDLOSS_VERSION, EXPECT_VERSION);
    return 1;
  }
  if (FUSEDLOSS_HAS_CUDA != EXPECT_HAS_CUDA) {
    std::printf("FUSEDLOSS_HAS_CUDA %d differs from the CMake package's fusedloss_CUDA_FOUND (%d)\n",
                FUSEDLOSS_HAS_CUDA, EXPECT_HAS_CUDA);
    return 1;
  }
  return std::fabs(loss - expect) < 1e-5 ? 0 : 1;
}

// SwiGLU without PyTorch: forward and backward over Megatron's fused gate-up buffer y [T, 2n]
// (gate in columns [0, n), up in [n, 2n)), the gradient written back into y (in place). On the
// GPU when there is one, else the CPU backend. Checks both against a float64 reference computed
// here and exits non-zero when they disagree.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "example_buffer.h"
#include "fusedloss/fusedloss.h"

namespace fl = fusedloss;
using example::have_gpu;
using Buffer = example::Buffer<float>;

int main() {
  const int64_t T = 256, n = 1000;
  const bool gpu = have_gpu();
  const fl::Device dev = gpu ? fl::Device::CUDA : fl::Device::CPU;
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> y0(T * 2 * n), g0(T * n);
  for (auto& v : y0) v = normal(gen);
  for (auto& v : g0) v = normal(gen);

  Buffer y(y0, gpu), out(std::vector<float>(T * n, NAN), gpu), g(g0, gpu);
  const fl::MatrixView yv{y.data, T, 2 * n, 2 * n, fl::DType::F32, dev};
  const fl::MatrixView ov{out.data, T, n, n, fl::DType::F32, dev};
  const fl::MatrixView gv{g.data, T, n, n, fl::DType::F32, dev};
  try {
    fl::swiglu_forward(yv, {}, {}, {}, ov);
    fl::swiglu_backward(gv, yv, {}, {}, {}, /*grad_y=*/yv);  // in place: y now holds dy
  } catch (const fl::Error& e) {
    std::fprintf(stderr, "fusedloss: %s\n", e.what());
    return 1;
  }

  // float64 reference: out = silu(a) b; da = g sigmoid(a)(1 + a(1 - sigmoid(a))) b; db = g silu(a)
  double out_err = 0, grad_err = 0;
  const auto& o = out.fetch();
  const auto& dy = y.fetch();
  for (int64_t r = 0; r < T; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      const double a = y0[r * 2 * n + j], b = y0[r * 2 * n + n + j], gr = g0[r * n + j];
      const double s = 1.0 / (1.0 + std::exp(-a));
      out_err = std::fmax(out_err, std::fabs(o[r * n + j] - a * s * b) / (1.0 + std::fabs(a * s * b)));
      const double da = gr * s * (1.0 + a * (1.0 - s)) * b, db = gr * a * s;
      grad_err = std::fmax(grad_err, std::fabs(dy[r * 2 * n + j] - da) / (1.0 + std::fabs(da)));
      grad_err = std::fmax(grad_err, std::fabs(dy[r * 2 * n + n + j] - db) / (1.0 + std::fabs(db)));
    }
  }
  std::printf("[%s] swiglu T=%lld n=%lld: max rel. error out %.2e, grad (in place) %.2e\n",
              gpu ? "cuda" : "cpu", static_cast<long long>(T), static_cast<long long>(n), out_err,
              grad_err);
  const bool ok = out_err < 1e-5 && grad_err < 1e-5;
  std::printf("%s\n", ok ? "OK: matches the float64 reference" : "FAILED");
  return ok ? 0 : 1;
}

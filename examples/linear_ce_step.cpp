// The LM head and its loss without PyTorch and without a [tokens, V] logits buffer:
// linear_cross_entropy_forward (in-forward mode: the gradients of the mean loss are computed in
// the forward, one token chunk of logits at a time) and linear_cross_entropy_backward, which
// scales them by the upstream gradient and accumulates the weight's into an fp32 "main_grad"
// (as Megatron does under gradient-accumulation fusion). On the GPU when there is one, else the
// CPU backend. Checks the loss and main_grad against a float64 reference computed here and
// exits non-zero when they disagree.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "example_buffer.h"
#include "fusedloss/fusedloss.h"

namespace fl = fusedloss;
using example::Buffer;
using example::have_gpu;

int main() {
  const int64_t N = 100, H = 64, V = 5000;
  const bool gpu = have_gpu();
  const fl::Device dev = gpu ? fl::Device::CUDA : fl::Device::CPU;
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int64_t> cls(0, V - 1);
  std::vector<float> h0(N * H), w0(V * H), main_grad0(V * H);
  std::vector<int64_t> t0(N);
  for (auto& v : h0) v = normal(gen);
  for (auto& v : w0) v = normal(gen) * 0.25f;
  for (auto& v : main_grad0) v = normal(gen) * 1e-3f;  // an earlier micro-batch's gradient
  for (auto& t : t0) t = cls(gen);
  t0[3] = -100;  // ignored

  Buffer<float> hidden(h0, gpu), weight(w0, gpu), loss({NAN}, gpu), lse(std::vector<float>(N), gpu),
      count({0.0f}, gpu), dh(std::vector<float>(N * H), gpu), dw(std::vector<float>(V * H), gpu),
      grad_hidden(std::vector<float>(N * H), gpu), main_grad(main_grad0, gpu), upstream({1.0f}, gpu);
  Buffer<int64_t> target(t0, gpu);
  const fl::MatrixView hv{hidden.data, N, H, H, fl::DType::F32, dev};
  const fl::MatrixView wv{weight.data, V, H, H, fl::DType::F32, dev};
  const fl::IndexView tv{target.data, N, fl::IndexType::I64, dev};
  fl::CrossEntropyOptions ce;  // mean over non-ignored rows
  fl::LinearCrossEntropyOptions lo;
  lo.chunk_rows = 32;  // 4 chunks here; by default the chunk fills a 256 MiB workspace
  fl::LinearCrossEntropyOutputs out;
  out.loss = static_cast<float*>(loss.data);
  out.lse = static_cast<float*>(lse.data);
  out.valid_count = static_cast<float*>(count.data);
  out.dhidden = {dh.data, N, H, H, fl::DType::F32, dev};
  out.dweight = {dw.data, V, H, H, fl::DType::F32, dev};
  fl::LinearCrossEntropyGrads grads;
  grads.dhidden = {grad_hidden.data, N, H, H, fl::DType::F32, dev};
  grads.dweight = {main_grad.data, V, H, H, fl::DType::F32, dev};
  grads.accumulate_dweight = true;
  try {
    fl::linear_cross_entropy_forward(hv, wv, tv, ce, lo, out);
    fl::linear_cross_entropy_backward(hv, wv, tv, out.lse, static_cast<float*>(upstream.data),
                                      out.valid_count, ce, lo, out, grads);
    fl::check_device_errors();
  } catch (const fl::Error& e) {
    std::fprintf(stderr, "fusedloss: %s\n", e.what());
    return 1;
  }

  // float64 reference: logits, softmax, mean loss, dW = G^T h accumulated onto main_grad0.
  double total = 0;
  int64_t valid = 0;
  std::vector<double> ref_mg(main_grad0.begin(), main_grad0.end()), x(V);
  for (int64_t r = 0; r < N; ++r) {
    if (t0[r] < 0) continue;
    ++valid;
  }
  for (int64_t r = 0; r < N; ++r) {
    if (t0[r] < 0) continue;
    double mx = -INFINITY, s = 0;
    for (int64_t v = 0; v < V; ++v) {
      double acc = 0;
      for (int64_t k = 0; k < H; ++k) acc += double(h0[r * H + k]) * w0[v * H + k];
      x[v] = acc;
      mx = std::fmax(mx, acc);
    }
    for (int64_t v = 0; v < V; ++v) s += std::exp(x[v] - mx);
    const double lse_r = mx + std::log(s);
    total += lse_r - x[t0[r]];
    for (int64_t v = 0; v < V; ++v) {
      const double g = (std::exp(x[v] - lse_r) - (v == t0[r] ? 1.0 : 0.0)) / double(valid);
      for (int64_t k = 0; k < H; ++k) ref_mg[v * H + k] += g * h0[r * H + k];
    }
  }
  const double ref_loss = total / double(valid);
  const double loss_err = std::fabs(loss.fetch()[0] - ref_loss) / ref_loss;
  double num = 0, den = 0;
  const auto& mg = main_grad.fetch();
  for (int64_t i = 0; i < V * H; ++i) {
    num += (mg[i] - ref_mg[i]) * (mg[i] - ref_mg[i]);
    den += ref_mg[i] * ref_mg[i];
  }
  const double grad_err = std::sqrt(num / den);
  std::printf("[%s] linear cross-entropy N=%lld H=%lld V=%lld: loss %.6f (rel. error %.2e), "
              "main_grad rel. L2 error %.2e\n",
              gpu ? "cuda" : "cpu", static_cast<long long>(N), static_cast<long long>(H),
              static_cast<long long>(V), loss.host[0], loss_err, grad_err);
  const bool ok = loss_err < 1e-5 && grad_err < 1e-5;
  std::printf("%s\n", ok ? "OK: matches the float64 reference" : "FAILED");
  return ok ? 0 : 1;
}

// Cross-entropy benchmark of the C++ API: forward, backward and forward+backward for bf16
// logits [rows, V]; the device copy bandwidth measured in the same run and the floors.
// Providers: fusedloss-cpp (reduction none: 3 passes, floor 3), fusedloss-cpp-mean (mean, the
// same 3 passes), fusedloss-cpp-in-forward (mean, the gradient written in the forward and the
// backward's scale skipped for a unit upstream gradient: floor 2 passes) and
// fusedloss-cpp-in-forward-scaled (the same with an upstream gradient of 0.5: the backward
// scales, 2 more passes). Median of many runs with CUDA events; the logits are restored from a pristine
// copy outside the timed region (the in-place backward overwrites them).
// Output: CSV on stdout (provider,op,V,ms,...), one line per measurement.
//
// usage: ce_bench [rows] [V,V,...] [inplace|separate]
//   rows 8192, V 32768,131072,151936,262144 by default; the backward writes the gradient into
//   the logits (inplace, the default) or into a buffer of its own (separate). V = 50257 (rows
//   that start off the 16-byte boundary) against 50304 measures the unaligned row walk.
#include <cstring>
#include <random>
#include <sstream>
#include <string>

#include "bench_util.cuh"

#include "fusedloss/fusedloss.h"

namespace fl = fusedloss;

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 8192;
  std::vector<int64_t> vocab = {32768, 131072, 151936, 262144};
  if (argc > 2) {
    vocab.clear();
    std::stringstream list(argv[2]);
    for (std::string v; std::getline(list, v, ',');) vocab.push_back(std::atoll(v.c_str()));
  }
  const bool separate = argc > 3 && std::strcmp(argv[3], "separate") == 0;
  if (argc > 3 && !separate && std::strcmp(argv[3], "inplace") != 0) {
    std::fprintf(stderr, "ce_bench: third argument: got %s, expected inplace or separate\n", argv[3]);
    return 2;
  }
  const int iters = 30;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const double bw = copy_bandwidth_gbs();
  std::printf("provider,op,V,rows,ms,floor_ms,copy_gbs,peak_extra_mib,gpu\n");
  cudaMemPool_t pool;
  CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
  for (int64_t V : vocab) {
    const size_t n = size_t(rows) * V, bytes = n * 2;
    uint16_t *x, *pristine, *grad = nullptr;
    int64_t* target;
    float *loss, *lse, *grad_loss;
    CHECK(cudaMalloc(&x, bytes));
    CHECK(cudaMalloc(&pristine, bytes));
    if (separate) CHECK(cudaMalloc(&grad, bytes));
    CHECK(cudaMalloc(&target, rows * 8));
    CHECK(cudaMalloc(&loss, rows * 4));
    CHECK(cudaMalloc(&lse, rows * 4));
    CHECK(cudaMalloc(&grad_loss, rows * 4));
    fill_bf16(pristine, n, uint64_t(V), -8.0f, 8.0f);
    std::vector<int64_t> t(rows);
    std::mt19937_64 gen(V);
    for (auto& v : t) v = int64_t(gen() % uint64_t(V));
    std::vector<float> ones(rows, 1.0f);
    CHECK(cudaMemcpy(target, t.data(), rows * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(grad_loss, ones.data(), rows * 4, cudaMemcpyHostToDevice));
    fl::CrossEntropyOptions opt;
    opt.reduction = fl::Reduction::None;
    fl::MatrixView xv{x, rows, V, V, fl::DType::BF16, fl::Device::CUDA};
    fl::IndexView tv{target, rows, fl::IndexType::I64, fl::Device::CUDA};
    fl::CrossEntropyOutputs out{loss, lse, nullptr};
    auto restore = [&] { CHECK(cudaMemcpyAsync(x, pristine, bytes, cudaMemcpyDeviceToDevice)); };
    auto fwd = [&] { fl::cross_entropy_forward(xv, tv, opt, out); };
    fl::MatrixView gv = xv;
    if (separate) gv.data = grad;
    auto bwd = [&] { fl::cross_entropy_backward(xv, tv, lse, grad_loss, nullptr, opt, gv); };
    // The library allocates only from the stream-ordered pool (the scratch RowStats); lse
    // (4 B/row) is the caller's saved state, added here.
    const double pass_ms = double(bytes) / (bw * 1e9) * 1e3;
    uint64_t zero = 0;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    restore();
    fwd();
    bwd();
    CHECK(cudaDeviceSynchronize());
    uint64_t high = 0;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
    fl::check_device_errors();
    time_and_print(iters, restore, fwd, bwd, V, rows, {pass_ms, 2 * pass_ms, 3 * pass_ms}, bw,
                   (double(high) + rows * 4.0) / (1 << 20), prop.name);

    // Mean: the 3-pass path, then the gradient in the forward (grad_loss[0] = 1: the backward
    // skips; 0.5: it scales).
    fl::CrossEntropyOptions mean = opt;
    mean.reduction = fl::Reduction::Mean;
    float* count = loss + 1;  // loss[0] is the mean
    fl::CrossEntropyOutputs mean_out{loss, lse, count};
    auto fwd_mean = [&] { fl::cross_entropy_forward(xv, tv, mean, mean_out); };
    auto bwd_mean = [&] { fl::cross_entropy_backward(xv, tv, lse, grad_loss, count, mean, gv); };
    time_and_print(iters, restore, fwd_mean, bwd_mean, V, rows, {pass_ms, 2 * pass_ms, 3 * pass_ms},
                   bw, (double(high) + rows * 4.0) / (1 << 20), prop.name, "fusedloss-cpp-mean");
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    auto fwd_grad = [&] { fl::cross_entropy_forward_with_grad(xv, tv, mean, mean_out, gv); };
    restore();
    fwd_grad();
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
    fl::check_device_errors();
    float* half = grad_loss + 1;
    const float half_value = 0.5f;
    CHECK(cudaMemcpy(half, &half_value, 4, cudaMemcpyHostToDevice));
    for (const float* scale : {static_cast<const float*>(grad_loss), static_cast<const float*>(half)}) {
      auto bwd_scale = [&] { fl::cross_entropy_scale_grad(gv, scale); };
      const bool skips = scale == grad_loss;
      time_and_print(iters, restore, fwd_grad, bwd_scale, V, rows,
                     {2 * pass_ms, skips ? 0.0 : 2 * pass_ms, (skips ? 2 : 4) * pass_ms}, bw,
                     (double(high) + rows * 4.0) / (1 << 20), prop.name,
                     skips ? "fusedloss-cpp-in-forward" : "fusedloss-cpp-in-forward-scaled");
    }
    for (void* p : {(void*)x, (void*)pristine, (void*)target, (void*)loss, (void*)lse, (void*)grad_loss})
      CHECK(cudaFree(p));
    if (grad) CHECK(cudaFree(grad));
  }
  return 0;
}

// SwiGLU benchmark of the C++ API: T tokens of a bf16 fused gate-up buffer [T, 2n]; forward,
// backward (in place) and forward+backward; the floor from the copy bandwidth measured in the
// same run (forward moves 3n elements per token, backward 5n). Output: CSV on stdout.
#include "bench_util.cuh"
#include "fusedloss/fusedloss.h"

namespace fl = fusedloss;

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 8192;
  const int iters = 50;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const double bw = copy_bandwidth_gbs();
  std::printf("provider,op,n,rows,ms,floor_ms,copy_gbs,peak_extra_mib,gpu\n");
  for (int64_t n : {4096, 14336, 32768}) {
    const size_t ny = size_t(T) * 2 * n, nout = size_t(T) * n;
    uint16_t *y, *pristine, *out, *g;
    CHECK(cudaMalloc(&y, ny * 2));
    CHECK(cudaMalloc(&pristine, ny * 2));
    CHECK(cudaMalloc(&out, nout * 2));
    CHECK(cudaMalloc(&g, nout * 2));
    fill_bf16(pristine, ny, uint64_t(n), -4.0f, 4.0f);
    fill_bf16(g, nout, uint64_t(n) + 7, -1.0f, 1.0f);
    fl::MatrixView yv{y, T, 2 * n, 2 * n, fl::DType::BF16, fl::Device::CUDA};
    fl::MatrixView ov{out, T, n, n, fl::DType::BF16, fl::Device::CUDA};
    fl::MatrixView gv{g, T, n, n, fl::DType::BF16, fl::Device::CUDA};
    auto restore = [&] { CHECK(cudaMemcpyAsync(y, pristine, ny * 2, cudaMemcpyDeviceToDevice)); };
    auto fwd = [&] { fl::swiglu_forward(yv, {}, {}, {}, ov); };
    auto bwd = [&] { fl::swiglu_backward(gv, yv, {}, {}, {}, yv); };  // in place
    double t_fwd = median_ms(iters, restore, fwd);
    double t_bwd = median_ms(iters, restore, bwd);
    double t_both = median_ms(iters, restore, [&] { fwd(); bwd(); });
    const double elem_ms = 2.0 / (bw * 1e9) * 1e3 * double(T) * double(n);  // ms per n bf16 per token
    // Extra memory beyond the input: the output [T, n]; in place, no gradient buffer.
    const double extra_mib = double(nout) * 2 / (1 << 20);
    struct { const char* op; double ms, floor; } rows[] = {
        {"forward", t_fwd, 3 * elem_ms}, {"backward", t_bwd, 5 * elem_ms}, {"fwd+bwd", t_both, 8 * elem_ms}};
    for (auto& r : rows)
      std::printf("fusedloss-cpp,%s,%lld,%lld,%.4f,%.4f,%.1f,%.2f,%s\n", r.op, (long long)n,
                  (long long)T, r.ms, r.floor, bw, extra_mib, prop.name);
    std::fflush(stdout);
    for (void* p : {(void*)y, (void*)pristine, (void*)out, (void*)g}) CHECK(cudaFree(p));
  }
  return 0;
}

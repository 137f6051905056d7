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
    const double elem_ms = 2.0 / (bw * 1e9) * 1e3 * double(T) * double(n);  // n bf16 per token
    // Extra memory beyond the input: the output [T, n]; in place, no gradient buffer.
    time_and_print(iters, restore, fwd, bwd, n, T, {3 * elem_ms, 5 * elem_ms, 8 * elem_ms}, bw,
                   double(nout) * 2 / (1 << 20), prop.name);
    for (void* p : {(void*)y, (void*)pristine, (void*)out, (void*)g}) CHECK(cudaFree(p));
  }
  return 0;
}

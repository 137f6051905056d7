// RMSNorm benchmark of the C++ API: [T, H] rows, bf16 and fp32, weight in the input's dtype;
// forward, backward (with the weight gradient's finish) and forward+backward; the floor from
// the copy bandwidth measured in the same run: forward moves 2 elements per element of x (read
// x, write y), backward 3 (read x and dy, write dx): 4 and 10 B/element in bf16 for forward and
// forward+backward. copy_ms: device-to-device copies moving the same bytes, timed the same way
// (forward: one copy of x's size; backward: one of 1.5 times it; forward+backward: both): what
// the copy engine reaches at this size, launch and tail included. stream_ms: a plain SM kernel
// moving the same traffic (forward: y = x; backward: dx = x + dy; forward+backward: both), 16-byte
// vectors, 4 in flight a thread, as many blocks as fill the SMs: what a kernel with no row
// reduction reaches here, its launch, ramp and tail included. Output: CSV on stdout.
//
// Kernel variants, in one run: each argument is a launch shape of the CUDA kernels,
// "field=value,..." over the shipped defaults (src/cuda/rms_norm_cuda.h, RmsNormTuning;
// "default" for the defaults themselves); the CSV then starts with a variant column and has
// the ratio over the floor:
//   rms_norm_bench default bwd_block=512 "bwd_block=128,bwd_blocks_per_sm=4" bwd_prefetch=0
// RMS_SHAPES="16384x2048,16384x8192" (environment) runs only those T x H (both dtypes), e.g.
// under a profiler.
#include <cstdlib>
#include <string>
#include <vector>
#include "bench_util.cuh"
#include "cuda/rms_norm_cuda.h"
#include "fusedloss/fusedloss.h"

namespace fl = fusedloss;

// out = a (+ b): the streaming floor of the row kernels, no reduction, no row dependence.
constexpr int kStreamUnroll = 4;
__global__ void __launch_bounds__(256) stream_kernel(const uint4* a, const uint4* b, uint4* out,
                                                     size_t nvec) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i0 = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i0 < nvec; i0 += stride * kStreamUnroll) {
    uint4 v[kStreamUnroll], w[kStreamUnroll];
#pragma unroll
    for (int u = 0; u < kStreamUnroll; ++u) {
      const size_t i = i0 + u * stride;
      if (i < nvec) {
        v[u] = a[i];
        if (b) w[u] = b[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kStreamUnroll; ++u) {
      const size_t i = i0 + u * stride;
      if (i < nvec) {
        if (b) v[u] = {v[u].x ^ w[u].x, v[u].y ^ w[u].y, v[u].z ^ w[u].z, v[u].w ^ w[u].w};
        out[i] = v[u];
      }
    }
  }
}

int main(int argc, char** argv) {
  const int iters = 30;
  std::vector<std::string> variants(argv + 1, argv + argc);
  const bool labelled = !variants.empty();
  if (!labelled) variants.push_back("default");
  auto tune = [](const std::string& v) {
    fl::cuda::set_rms_norm_tuning(fl::cuda::parse_rms_norm_tuning(v == "default" ? "" : v));
  };
  try {
    for (const std::string& v : variants) tune(v);  // every spec checked before any timing
  } catch (const fl::Error& e) {
    std::fprintf(stderr, "rms_norm_bench: %s\n", e.what());
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const double bw = copy_bandwidth_gbs();
  int stream_blocks = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&stream_blocks, stream_kernel, 256, 0));
  stream_blocks *= prop.multiProcessorCount;
  std::printf(labelled ? "variant,provider,op,T,H,dtype,ms,floor_ms,ratio,copy_ms,ratio_copy,stream_ms,ratio_stream,copy_gbs,gpu\n"
                       : "provider,op,T,H,dtype,ms,floor_ms,copy_ms,stream_ms,copy_gbs,gpu\n");
  struct Shape { int64_t T, H; };
  const Shape shapes[] = {{16384, 2048}, {16384, 4096}, {16384, 5120}, {16384, 6144},
                          {16384, 8192}, {8192, 16384}};
  const char* only = std::getenv("RMS_SHAPES");
  auto wanted = [&](Shape s) {
    if (!only) return true;
    const std::string list = std::string(",") + only + ",";
    return list.find("," + std::to_string(s.T) + "x" + std::to_string(s.H) + ",") != std::string::npos;
  };
  for (const std::string& v : variants)
    for (fl::DType dt : {fl::DType::BF16, fl::DType::F32})
      for (Shape s : shapes) {
        if (!wanted(s)) continue;
        tune(v);
        const int64_t es = dt == fl::DType::F32 ? 4 : 2, n = s.T * s.H;
        void *x, *y, *dy, *dx, *w, *ws;
        float *rstd, *dw;
        const size_t ws_bytes = fl::rms_norm_backward_workspace_bytes(s.T, s.H, fl::Device::CUDA);
        for (void** p : {&x, &y, &dy, &dx}) CHECK(cudaMalloc(p, n * es));
        CHECK(cudaMalloc(&w, s.H * es));
        CHECK(cudaMalloc(&ws, ws_bytes));
        CHECK(cudaMalloc(&rstd, s.T * 4));
        CHECK(cudaMalloc(&dw, s.H * 4));
        // bf16 fill; the fp32 buffers get bf16 bit patterns as pairs: finite values either way
        fill_bf16(static_cast<uint16_t*>(x), n * es / 2, 1, -2.0f, 2.0f);
        fill_bf16(static_cast<uint16_t*>(dy), n * es / 2, 2, -1.0f, 1.0f);
        fill_bf16(static_cast<uint16_t*>(w), s.H * es / 2, 3, 0.5f, 1.5f);
        fl::MatrixView xv{x, s.T, s.H, s.H, dt, fl::Device::CUDA}, yv{y, s.T, s.H, s.H, dt, fl::Device::CUDA},
            gv{dy, s.T, s.H, s.H, dt, fl::Device::CUDA}, dxv{dx, s.T, s.H, s.H, dt, fl::Device::CUDA};
        fl::VectorView wv{w, s.H, dt, fl::Device::CUDA};
        auto fwd = [&] { fl::rms_norm_forward(xv, wv, {}, yv, rstd); };
        auto bwd = [&] { fl::rms_norm_backward(gv, xv, wv, rstd, {}, dxv, dw, ws); };
        const double elem_ms = double(es) / (bw * 1e9) * 1e3 * double(n);
        const double floor_ms[3] = {2 * elem_ms, 3 * elem_ms, 5 * elem_ms};
        const double ms[3] = {median_ms(iters, [] {}, fwd), median_ms(iters, [] {}, bwd),
                              median_ms(iters, [] {}, [&] { fwd(); bwd(); })};
        // The same bytes by copies: dx (n * es) and y, dy (n * es each) hold 3 * n * es.
        const size_t fwd_bytes = size_t(n * es), bwd_bytes = fwd_bytes * 3 / 2;
        void *from, *to;
        CHECK(cudaMalloc(&from, bwd_bytes));
        CHECK(cudaMalloc(&to, bwd_bytes));
        CHECK(cudaMemset(from, 0, bwd_bytes));
        auto copy = [&](size_t bytes) {
          CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice));
        };
        const double copy_ms[3] = {
            median_ms(iters, [] {}, [&] { copy(fwd_bytes); }),
            median_ms(iters, [] {}, [&] { copy(bwd_bytes); }),
            median_ms(iters, [] {}, [&] { copy(fwd_bytes); copy(bwd_bytes); })};
        // The same traffic through stream_kernel: x -> y; x, dy -> dx (x's size each).
        auto stream = [&](const void* a, const void* b, void* out) {
          stream_kernel<<<stream_blocks, 256>>>(static_cast<const uint4*>(a), static_cast<const uint4*>(b),
                                                static_cast<uint4*>(out), size_t(n * es) / 16);
          CHECK(cudaGetLastError());
        };
        const double stream_ms[3] = {
            median_ms(iters, [] {}, [&] { stream(x, nullptr, y); }),
            median_ms(iters, [] {}, [&] { stream(x, dy, dx); }),
            median_ms(iters, [] {}, [&] { stream(x, nullptr, y); stream(x, dy, dx); })};
        CHECK(cudaFree(from));
        CHECK(cudaFree(to));
        const char* ops[3] = {"forward", "backward", "fwd+bwd"};
        for (int i = 0; i < 3; ++i) {
          if (labelled) std::printf("\"%s\",", v.c_str());
          std::printf("fusedloss,%s,%lld,%lld,%s,%.4f,%.4f,", ops[i], (long long)s.T,
                      (long long)s.H, es == 4 ? "fp32" : "bf16", ms[i], floor_ms[i]);
          if (labelled) std::printf("%.3f,", ms[i] / floor_ms[i]);
          std::printf("%.4f,", copy_ms[i]);
          if (labelled) std::printf("%.3f,", ms[i] / copy_ms[i]);
          std::printf("%.4f,", stream_ms[i]);
          if (labelled) std::printf("%.3f,", ms[i] / stream_ms[i]);
          std::printf("%.1f,%s\n", bw, prop.name);
        }
        std::fflush(stdout);
        for (void* p : {x, y, dy, dx, w, ws, (void*)rstd, (void*)dw}) CHECK(cudaFree(p));
      }
  return 0;
}

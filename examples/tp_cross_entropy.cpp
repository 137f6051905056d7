// A trainer step without PyTorch: cross-entropy forward + backward over logits whose
// vocabulary is split across the MPI ranks (run with `mpirun -np N`, or alone for TP=1).
// On GPUs (one per rank) the hook is NCCL; otherwise the CPU backend with MPI.
// Prints the loss and a few gradient entries next to a float64 reference computed here.
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "fusedloss/comm_mpi.h"
#include "fusedloss/fusedloss.h"
#if FUSEDLOSS_HAS_NCCL
#include <cuda_runtime.h>
#include "fusedloss/comm_nccl.h"
#include "fusedloss/nccl_bootstrap.h"
#endif

namespace fl = fusedloss;

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int64_t rows = 64, V = 32000 * 4 / world * world;  // divisible by the rank count
  const int64_t Vl = V / world, start = rank * Vl;

  // The same logits and targets on every rank (a trainer would have only its shard).
  std::mt19937 gen(1234);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int64_t> cls(0, V - 1);
  std::vector<float> full(rows * V);
  for (auto& v : full) v = normal(gen);
  std::vector<int64_t> target(rows);
  for (auto& t : target) t = cls(gen);
  target[0] = -100;  // an ignored (padding) token
  std::vector<float> shard(rows * Vl);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(&shard[r * Vl], &full[r * V + start], Vl * 4);

  fl::CrossEntropyOptions opt;  // mean over non-ignored rows, PyTorch semantics
  opt.vocab_start = start;
  opt.vocab_global = V;
  float loss = NAN, count = 0;
  std::vector<float> lse(rows), grad(rows * Vl);
  const float one = 1.0f;
  const char* backend = "cpu+mpi";

  try {
#if FUSEDLOSS_HAS_NCCL
    int devices = 0;
    if (cudaGetDeviceCount(&devices) == cudaSuccess && devices >= world) {
      backend = "cuda+nccl";
      cudaSetDevice(rank);
      ncclComm_t nccl = fl::make_nccl_comm_from_mpi(MPI_COMM_WORLD);
      auto comm = fl::make_nccl_communicator(nccl);
      float *d_x, *d_loss, *d_lse, *d_count, *d_one;
      int64_t* d_t;
      cudaMalloc(&d_x, shard.size() * 4);
      cudaMalloc(&d_t, rows * 8);
      cudaMalloc(&d_loss, 4);
      cudaMalloc(&d_lse, rows * 4);
      cudaMalloc(&d_count, 4);
      cudaMalloc(&d_one, 4);
      cudaMemcpy(d_x, shard.data(), shard.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_t, target.data(), rows * 8, cudaMemcpyHostToDevice);
      cudaMemcpy(d_one, &one, 4, cudaMemcpyHostToDevice);
      fl::MatrixView x{d_x, rows, Vl, Vl, fl::DType::F32, fl::Device::CUDA};
      fl::IndexView t{d_t, rows, fl::IndexType::I64, fl::Device::CUDA};
      fl::cross_entropy_forward(x, t, opt, {d_loss, d_lse, d_count}, comm.get());
      fl::cross_entropy_backward(x, t, d_lse, d_one, d_count, opt, x);  // in place
      fl::check_device_errors();
      cudaMemcpy(&loss, d_loss, 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(grad.data(), d_x, grad.size() * 4, cudaMemcpyDeviceToHost);
      for (void* p : {(void*)d_x, (void*)d_t, (void*)d_loss, (void*)d_lse, (void*)d_count, (void*)d_one})
        cudaFree(p);
      ncclCommDestroy(nccl);
    } else
#endif
    {
      auto comm = fl::make_mpi_communicator(MPI_COMM_WORLD);
      fl::MatrixView x{shard.data(), rows, Vl, Vl, fl::DType::F32, fl::Device::CPU};
      fl::IndexView t{target.data(), rows, fl::IndexType::I64, fl::Device::CPU};
      fl::cross_entropy_forward(x, t, opt, {&loss, lse.data(), &count}, comm.get());
      fl::cross_entropy_backward(x, t, lse.data(), &one, &count, opt,
                                 {grad.data(), rows, Vl, Vl, fl::DType::F32, fl::Device::CPU});
    }
  } catch (const fl::Error& e) {
    std::fprintf(stderr, "rank %d: fusedloss error: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

  // float64 reference: mean over valid rows of lse - x[target]; its gradient.
  double ref_loss = 0;
  int64_t valid = 0;
  std::vector<double> ref_lse(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < V; ++j) m = std::fmax(m, full[r * V + j]);
    for (int64_t j = 0; j < V; ++j) s += std::exp(full[r * V + j] - m);
    ref_lse[r] = m + std::log(s);
    if (target[r] < 0) continue;
    ++valid;
    ref_loss += ref_lse[r] - full[r * V + target[r]];
  }
  ref_loss /= valid;
  double worst = 0;
  for (int64_t r = 1; r < rows; ++r)
    for (int64_t j = 0; j < Vl; ++j) {
      double g = std::exp(full[r * V + start + j] - ref_lse[r]) - (start + j == target[r]);
      worst = std::fmax(worst, std::fabs(grad[r * Vl + j] - g / valid));
    }
  for (int q = 0; q < world; ++q) {
    if (q == rank)
      std::printf("rank %d/%d [%s] vocab [%lld, %lld): loss %.7f  reference %.7f  "
                  "max |grad - reference| %.2e\n",
                  rank, world, backend, (long long)start, (long long)(start + Vl), loss, ref_loss,
                  worst);
    std::fflush(stdout);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  bool ok = std::fabs(loss - ref_loss) < 1e-5 * ref_loss && worst < 1e-6;
  int all_ok = ok, agree = 0;
  MPI_Allreduce(&ok, &agree, 1, MPI_C_BOOL, MPI_LAND, MPI_COMM_WORLD);
  (void)all_ok;
  if (rank == 0) std::printf("%s\n", agree ? "OK: matches the float64 reference" : "MISMATCH");
  MPI_Finalize();
  return agree ? 0 : 1;
}

// Host time of a vocab-parallel cross_entropy_forward with and without the shard agreement
// (CrossEntropyOptions::check_shard_agreement), under mpirun:
//   mpi       the MPI communicator on CPU buffers, every world size
//   cuda-loop CUDA buffers on this rank's GPU with a loopback communicator that claims two
//             ranks (device-to-device copies instead of NCCL): the agreement's own cost on a
//             device (H2D copy, all-gather, D2H copy, host sync), measurable on one GPU
//   nccl      NCCL, when every rank has a GPU of its own (world >= 2)
// Each timed block is `calls` back-to-back forwards and one stream sync; the blocks with and
// without the check alternate, and the medians over rounds are reported. The difference is
// the check's cost per call. CSV on stdout (rank 0). Arguments: [calls per block] [rounds].
// On a shared CPU, OMP_NUM_THREADS=1 keeps the ranks' threads from fighting over the cores.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fusedloss/comm_mpi.h"
#include "fusedloss/fusedloss.h"
#if FUSEDLOSS_HAS_CUDA
#include <cuda_runtime.h>
#endif
#if FUSEDLOSS_HAS_NCCL
#include "fusedloss/comm_nccl.h"
#include "fusedloss/nccl_bootstrap.h"
#endif

namespace fl = fusedloss;

namespace {

int g_rank = 0, g_world = 1;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "rank %d: %s\n", g_rank, what.c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

#if FUSEDLOSS_HAS_CUDA
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}
#endif

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Microseconds per call of `call` (calls times, then `sync`), median over rounds, the two
// settings alternating so that drift hits both alike. Returns {checked, unchecked}.
std::pair<double, double> time_both(const std::function<void(bool)>& call,
                                    const std::function<void()>& sync, int calls, int rounds) {
  std::vector<double> on, off;
  for (int r = 0; r < rounds + 1; ++r)  // round 0 warms up
    for (bool checked : {true, false}) {
      MPI_Barrier(MPI_COMM_WORLD);
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < calls; ++i) call(checked);
      sync();
      double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls;
      // every rank reports the slowest rank's time: a collective is as slow as its last rank
      double worst = 0;
      MPI_Allreduce(&us, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (r > 0) (checked ? on : off).push_back(worst);
    }
  return {median(on), median(off)};
}

void report(const char* backend, int world, int64_t rows, int64_t vl, std::pair<double, double> t) {
  if (g_rank == 0)
    std::printf("%s,%d,%lld,%lld,%.2f,%.2f,%.2f\n", backend, world, (long long)rows,
                (long long)vl, t.first, t.second, t.first - t.second);
}

// One problem [rows, vl] per rank on `dev`, forward through `comm`.
void run(const char* backend, fl::Communicator& comm, fl::Device dev, int64_t rows, int64_t vl,
         int calls, int rounds, const std::function<void()>& sync) {
  const size_t xb = size_t(rows) * vl * 4, tb = size_t(rows) * 8, fb = size_t(rows) * 4;
  std::vector<float> hx(size_t(rows) * vl);
  for (size_t i = 0; i < hx.size(); ++i) hx[i] = float((i * 2654435761u) % 1000) / 100.0f;
  std::vector<int64_t> ht(rows);
  for (int64_t r = 0; r < rows; ++r) ht[r] = (r * 7919) % (vl * comm.size());
  void *x = nullptr, *t = nullptr, *loss = nullptr, *lse = nullptr;
  std::vector<char> host;
  if (dev == fl::Device::CPU) {
    host.resize(xb + tb + 2 * fb);
    x = host.data(), t = host.data() + xb, loss = host.data() + xb + tb, lse = host.data() + xb + tb + fb;
    std::memcpy(x, hx.data(), xb);
    std::memcpy(t, ht.data(), tb);
  } else {
#if FUSEDLOSS_HAS_CUDA
    check(cudaMalloc(&x, xb), "cudaMalloc");
    check(cudaMalloc(&t, tb), "cudaMalloc");
    check(cudaMalloc(&loss, fb), "cudaMalloc");
    check(cudaMalloc(&lse, fb), "cudaMalloc");
    check(cudaMemcpy(x, hx.data(), xb, cudaMemcpyHostToDevice), "cudaMemcpy");
    check(cudaMemcpy(t, ht.data(), tb, cudaMemcpyHostToDevice), "cudaMemcpy");
#endif
  }
  fl::CrossEntropyOptions o;
  o.vocab_start = comm.rank() * vl;
  o.vocab_global = vl * comm.size();
  fl::MatrixView xv{x, rows, vl, vl, fl::DType::F32, dev};
  fl::IndexView tv{t, rows, fl::IndexType::I64, dev};
  // Fewer calls per block for the larger shape: the CPU backend computes it on the host.
  calls = int(std::max<int64_t>(10, std::min<int64_t>(calls, 4000000 / (rows * vl))));
  auto call = [&](bool checked) {
    o.check_shard_agreement = checked;
    fl::cross_entropy_forward(xv, tv, o, {static_cast<float*>(loss), static_cast<float*>(lse), nullptr},
                              &comm);
  };
  try {
    report(backend, comm.size(), rows, vl, time_both(call, sync, calls, rounds));
  } catch (const fl::Error& e) {
    die(e.what());
  }
#if FUSEDLOSS_HAS_CUDA
  if (dev == fl::Device::CUDA)
    for (void* p : {x, t, loss, lse}) check(cudaFree(p), "cudaFree");
#endif
}

#if FUSEDLOSS_HAS_CUDA
// Two "ranks" in one process on one GPU: rank 0 of 2 whose peer sends the same bytes. Enough
// for the forward to take the vocab-parallel path and for timing the agreement on a device.
class LoopbackCommunicator final : public fl::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  fl::Device device() const override { return fl::Device::CUDA; }
  void all_gather(const void* send, void* recv, size_t bytes, fl::Stream stream) override {
    for (int r = 0; r < 2; ++r)
      check(cudaMemcpyAsync(static_cast<char*>(recv) + r * bytes, send, bytes,
                            cudaMemcpyDeviceToDevice, cudaStream_t(stream)),
            "cudaMemcpyAsync");
  }
  void all_reduce(float*, size_t, fl::ReduceOp, fl::Stream) override {}  // two equal ranks
};
#endif

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world);
  const int calls = argc > 1 ? std::atoi(argv[1]) : 200, rounds = argc > 2 ? std::atoi(argv[2]) : 15;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{8, 128}, {64, 1024}};
  if (g_rank == 0)
    std::printf("backend,world,rows,vocab_local,us_per_call_checked,us_per_call_unchecked,"
                "check_us_per_call\n");
  {
    auto comm = fl::make_mpi_communicator(MPI_COMM_WORLD);
    if (g_world >= 2)
      for (auto [rows, vl] : shapes) run("mpi", *comm, fl::Device::CPU, rows, vl, calls, rounds, [] {});
    else if (g_rank == 0)
      std::fprintf(stderr, "mpi: skipped (one rank has no agreement; run under mpirun -np 2)\n");
  }
#if FUSEDLOSS_HAS_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  int have = devices > 0, all = 0;
  MPI_Allreduce(&have, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (all) {
    check(cudaSetDevice(g_rank % devices), "cudaSetDevice");
    auto sync = [] { check(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize"); };
    if (g_rank == 0) {  // one process is enough: no peer takes part
      LoopbackCommunicator loop;
      for (auto [rows, vl] : shapes)
        run("cuda-loopback", loop, fl::Device::CUDA, rows, vl, calls, rounds, sync);
    }
#if FUSEDLOSS_HAS_NCCL
    int own = devices >= g_world && g_world >= 2, every = 0;
    MPI_Allreduce(&own, &every, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (every) {
      ncclComm_t nccl = fl::make_nccl_comm_from_mpi(MPI_COMM_WORLD);
      {
        auto comm = fl::make_nccl_communicator(nccl);
        for (auto [rows, vl] : shapes) run("nccl", *comm, fl::Device::CUDA, rows, vl, calls, rounds, sync);
      }
      if (ncclCommDestroy(nccl) != ncclSuccess) die("ncclCommDestroy failed");
    } else if (g_rank == 0) {
      std::fprintf(stderr, "nccl: skipped (needs >= 2 ranks with a GPU each)\n");
    }
#endif
  } else if (g_rank == 0) {
    std::fprintf(stderr, "cuda: skipped (no usable GPU on some rank)\n");
  }
#endif
  MPI_Finalize();
  return 0;
}

// Vocab-parallel cross-entropy under mpirun: each rank holds V/world columns. The sharded loss
// equals the TP=1 loss, bit for bit on every rank; the gradient shards equal the TP=1
// gradient; mismatched shards give the same clear error on every rank, never a hang.
// MPI + CPU always; NCCL + CUDA when every rank has a GPU of its own.
#include <mpi.h>

#include "common/ce_harness.h"
#include "fusedloss/comm_mpi.h"
#if FUSEDLOSS_HAS_NCCL
#include "fusedloss/comm_nccl.h"
#include "fusedloss/nccl_bootstrap.h"
#endif

namespace fusedloss::test {
namespace {

int world_rank() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int world_size() { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }

// Every rank draws the same global problem from rank 0's seed.
using Problem = DenseProblem;
Problem make_problem(int64_t rows, int64_t V) {
  uint64_t seed = rng()();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  std::mt19937_64 gen(seed);
  Problem p = random_problem(rows, V, 3.0f, gen);
  for (int64_t r = 1; r < rows; r += 5) p.target[r] = -100;
  return p;
}

struct Result {
  std::vector<float> loss, grad;  // grad: this rank's [rows, V_local]
};

// Forward + backward through the public API on `dev`, with `comm` (null: TP=1 on all of x).
Result run(Device dev, const Problem& p, Communicator* comm, CrossEntropyOptions opt) {
  const int world = comm ? comm->size() : 1, rank = comm ? comm->rank() : 0;
  const int64_t Vl = p.V / world, rows = p.rows;
  opt.vocab_start = rank * Vl;
  opt.vocab_global = p.V;
  Buffer x(dev, rows * Vl * 4), t(dev, rows * 8), loss(dev, rows * 4), lse(dev, rows * 4),
      count(dev, 4), gl(dev, rows * 4);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(x.host_as<float>() + r * Vl, &p.x[r * p.V + rank * Vl], Vl * 4);
  std::memcpy(t.host(), p.target.data(), rows * 8);
  for (int64_t r = 0; r < rows; ++r) gl.host_as<float>()[r] = 1.0f;
  x.upload(); t.upload(); gl.upload(); loss.poison(); lse.poison();
  MatrixView xv{x.data(), rows, Vl, Vl, DType::F32, dev};
  IndexView tv{t.data(), rows, IndexType::I64, dev};
  cross_entropy_forward(xv, tv, opt, {loss.data_as<float>(), lse.data_as<float>(), count.data_as<float>()},
                        comm);
  cross_entropy_backward(xv, tv, lse.data_as<float>(), gl.data_as<float>(), count.data_as<float>(), opt, xv);
  check_device_errors();
  loss.download(); x.download();
  Result res;
  int64_t nloss = opt.reduction == Reduction::None ? rows : 1;
  res.loss.assign(loss.host_as<float>(), loss.host_as<float>() + nloss);
  res.grad.assign(x.host_as<float>(), x.host_as<float>() + rows * Vl);
  return res;
}

void expect_matches_tp1(Device dev, Communicator& comm) {
  const int world = comm.size(), rank = comm.rank();
  Problem p = make_problem(37, 2400);
  const int64_t Vl = p.V / world;
  for (auto form : {CollectiveForm::AllGather, CollectiveForm::AllReduce})
    for (auto red : {Reduction::None, Reduction::Mean})
      for (float ls : {0.0f, 0.1f}) {
        CrossEntropyOptions o;
        o.collective = form;
        o.reduction = red;
        o.label_smoothing = ls;
        o.z_loss = ls > 0 ? 1e-3f : 0.0f;
        SCOPED_TRACE("world " + std::to_string(world) + " form " + std::to_string(int(form)) +
                     " reduction " + std::to_string(int(red)) + " ls " + std::to_string(ls));
        Result tp1 = run(dev, p, nullptr, o);
        Result tpn = run(dev, p, &comm, o);
        for (size_t i = 0; i < tp1.loss.size(); ++i)
          EXPECT_NEAR(tpn.loss[i], tp1.loss[i], 1e-6 * std::fabs(tp1.loss[i]) + 1e-7) << "loss " << i;
        // The same loss bits on every rank.
        std::vector<float> all(tpn.loss.size() * world);
        MPI_Allgather(tpn.loss.data(), int(tpn.loss.size()), MPI_FLOAT, all.data(),
                      int(tpn.loss.size()), MPI_FLOAT, MPI_COMM_WORLD);
        for (int q = 0; q < world; ++q)
          EXPECT_EQ(0, std::memcmp(&all[q * tpn.loss.size()], tpn.loss.data(), tpn.loss.size() * 4))
              << "rank " << q << " loss bits differ from rank " << rank;
        // This rank's gradient shard is its slice of the TP=1 gradient.
        double worst = 0, gmax = 0;
        for (int64_t r = 0; r < p.rows; ++r)
          for (int64_t j = 0; j < Vl; ++j) {
            double ref = tp1.grad[r * p.V + rank * Vl + j];
            worst = std::max(worst, std::fabs(tpn.grad[r * Vl + j] - ref));
            gmax = std::max(gmax, std::fabs(ref));
          }
        EXPECT_LE(worst, 1e-6 * gmax + 1e-9) << "gradient shard of rank " << rank;
      }
}

// Each rank must throw, none may hang.
template <class F>
void expect_error_everywhere(F&& f, const char* fragment) {
  int threw = 0;
  try {
    f();
  } catch (const Error& e) {
    threw = std::string(e.what()).find(fragment) != std::string::npos;
    if (!threw) ADD_FAILURE() << "message '" << e.what() << "' lacks '" << fragment << "'";
  }
  EXPECT_EQ(threw, 1) << "rank " << world_rank() << " did not raise";
  int all = 0;
  MPI_Allreduce(&threw, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(all, world_size()) << "not every rank raised";
}

void expect_mismatch_errors(Device dev, Communicator& comm) {
  if (comm.size() < 2) GTEST_SKIP() << "needs >= 2 ranks";
  const int rank = comm.rank();
  const int64_t rows = 8, Vl = 64;
  // Rank 1 holds one column more than the others.
  const int64_t my_V = Vl + (rank == 1 ? 1 : 0);
  Buffer x(dev, rows * my_V * 4), t(dev, rows * 8), loss(dev, rows * 4), lse(dev, rows * 4);
  for (int64_t r = 0; r < rows; ++r) t.host_as<int64_t>()[r] = r;
  std::memset(x.host(), 0, x.bytes());
  x.upload(); t.upload();
  CrossEntropyOptions o;
  o.vocab_start = rank * Vl;
  o.vocab_global = Vl * comm.size();
  IndexView tv{t.data(), rows, IndexType::I64, dev};
  CrossEntropyOutputs out{loss.data_as<float>(), lse.data_as<float>(), nullptr};
  expect_error_everywhere([&] {
    cross_entropy_forward({x.data(), rows, my_V, my_V, DType::F32, dev}, tv, o, out, &comm);
  }, "V_local");
  // Rank 0 has fewer rows: caught by the fixed-size header, not a mismatched all-gather.
  const int64_t my_rows = rows - (rank == 0 ? 1 : 0);
  expect_error_everywhere([&] {
    cross_entropy_forward({x.data(), my_rows, Vl, Vl, DType::F32, dev},
                          {t.data(), my_rows, IndexType::I64, dev}, o, out, &comm);
  }, "rows");
  // Wrong shard start on the last rank.
  CrossEntropyOptions shifted = o;
  if (rank == comm.size() - 1) shifted.vocab_start = 0;
  expect_error_everywhere([&] {
    cross_entropy_forward({x.data(), rows, Vl, Vl, DType::F32, dev}, tv, shifted, out, &comm);
  }, "vocab_start");
  // A bad target on rank 0 only (CPU: found before the collective, reported everywhere).
  if (dev == Device::CPU) {
    if (rank == 0) t.host_as<int64_t>()[3] = o.vocab_global;
    t.upload();
    expect_error_everywhere([&] {
      cross_entropy_forward({x.data(), rows, Vl, Vl, DType::F32, dev}, tv, o, out, &comm);
    }, "target[3]");
  }
}

TEST(VocabParallelMpi, MatchesTp1) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_matches_tp1(Device::CPU, *comm);
}

TEST(VocabParallelMpi, MismatchedShardsFailOnEveryRank) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_mismatch_errors(Device::CPU, *comm);
}

// The communicator works on its own duplicate: the caller's error handler stays as it was.
TEST(VocabParallelMpi, LeavesTheCallersCommunicatorAlone) {
  MPI_Errhandler before, during;
  ASSERT_EQ(MPI_Comm_get_errhandler(MPI_COMM_WORLD, &before), MPI_SUCCESS);
  {
    auto comm = make_mpi_communicator(MPI_COMM_WORLD);
    EXPECT_EQ(comm->size(), world_size());
    EXPECT_EQ(comm->rank(), world_rank());
    ASSERT_EQ(MPI_Comm_get_errhandler(MPI_COMM_WORLD, &during), MPI_SUCCESS);
    EXPECT_EQ(during, before);
    EXPECT_EQ(during, MPI_ERRORS_ARE_FATAL);  // MPI's default, untouched
  }
  EXPECT_EQ(MPI_Errhandler_free(&during), MPI_SUCCESS);
  EXPECT_EQ(MPI_Errhandler_free(&before), MPI_SUCCESS);
}

#if FUSEDLOSS_HAS_NCCL
// Skips (collectively) unless every rank can have a GPU of its own.
bool nccl_ready(std::string* why) {
  std::string reason;
  int ok = cuda_available(&reason) ? 1 : 0, devices = 0;
  if (ok) cudaGetDeviceCount(&devices);
  if (ok && devices < world_size()) {
    ok = 0;
    reason = std::to_string(devices) + " GPU(s) for " + std::to_string(world_size()) + " ranks";
  }
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  *why = all ? "" : (reason.empty() ? "another rank has no GPU" : reason);
  return all;
}

class NcclComm {
 public:
  NcclComm() {
    cudaSetDevice(world_rank());
    nccl_ = make_nccl_comm_from_mpi(MPI_COMM_WORLD);
    comm_ = make_nccl_communicator(nccl_);
  }
  ~NcclComm() {
    ncclResult_t r = ncclCommDestroy(nccl_);
    if (r != ncclSuccess) ADD_FAILURE() << "ncclCommDestroy: " << ncclGetErrorString(r);
  }
  Communicator& get() { return *comm_; }

 private:
  ncclComm_t nccl_;
  std::unique_ptr<Communicator> comm_;
};

TEST(VocabParallelNccl, MatchesTp1) {
  std::string why;
  if (!nccl_ready(&why)) GTEST_SKIP() << "NCCL test needs a GPU per rank: " << why;
  NcclComm comm;
  expect_matches_tp1(Device::CUDA, comm.get());
}

TEST(VocabParallelNccl, MismatchedShardsFailOnEveryRank) {
  std::string why;
  if (!nccl_ready(&why)) GTEST_SKIP() << "NCCL test needs a GPU per rank: " << why;
  NcclComm comm;
  expect_mismatch_errors(Device::CUDA, comm.get());
}
#endif

}  // namespace
}  // namespace fusedloss::test

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int failed = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}

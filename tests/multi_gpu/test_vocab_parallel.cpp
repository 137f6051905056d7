// Vocab-parallel cross-entropy under mpirun: each rank holds V/world columns. The sharded loss
// equals the TP=1 loss, bit for bit on every rank; the gradient shards equal the TP=1
// gradient; mismatched shards give the same clear error on every rank, never a hang.
// MPI + CPU always; NCCL + CUDA when every rank has a GPU of its own.
#include <algorithm>
#include <cmath>
#include <mpi.h>

#include "multi_gpu/mpi_util.h"

#include "common/ce_harness.h"
#include "fusedloss/comm_mpi.h"
#if FUSEDLOSS_HAS_NCCL
#include "fusedloss/comm_nccl.h"
#include "fusedloss/nccl_bootstrap.h"
#endif

namespace fusedloss::test {
namespace {


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

// Forward + backward through the public API on `dev`, with `comm` (null: TP=1 on all of x);
// grad_in_forward: cross_entropy_forward_with_grad and the scale (a sum/mean loss).
Result run(Device dev, const Problem& p, Communicator* comm, CrossEntropyOptions opt,
           bool grad_in_forward = false) {
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
  const CrossEntropyOutputs outs{loss.data_as<float>(), lse.data_as<float>(), count.data_as<float>()};
  if (grad_in_forward) {
    cross_entropy_forward_with_grad(xv, tv, opt, outs, xv, comm);
    cross_entropy_scale_grad(xv, gl.data_as<float>());
  } else {
    cross_entropy_forward(xv, tv, opt, outs, comm);
    cross_entropy_backward(xv, tv, lse.data_as<float>(), gl.data_as<float>(), count.data_as<float>(),
                           opt, xv);
  }
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
  // TP=1 and TP=N add the sum-exp in different orders, so their fp32 lse may differ by a few
  // ulps of lse, and every softmax value p by p times that: the tolerance is 4 ulps of the
  // largest possible |lse| (max |x| + log V), relative to the largest gradient (loss: absolute).
  double xmax = 0;
  for (float v : p.x) xmax = std::max(xmax, double(std::fabs(v)));
  const double lse_ulp = std::ldexp(1.0, std::ilogb(std::max(1.0, xmax + std::log(double(p.V)))) - 23);
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
        for (bool in_forward : {false, true}) {
          if (in_forward && red == Reduction::None) continue;  // sum/mean only
          SCOPED_TRACE(in_forward ? "gradient in the forward" : "forward + backward");
          Result tp1 = run(dev, p, nullptr, o);
          Result tpn = run(dev, p, &comm, o, in_forward);
          for (size_t i = 0; i < tp1.loss.size(); ++i)
            EXPECT_NEAR(tpn.loss[i], tp1.loss[i], 1e-6 * std::fabs(tp1.loss[i]) + 4 * lse_ulp) << "loss " << i;
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
          EXPECT_LE(worst, 4 * lse_ulp * gmax + 1e-9) << "gradient shard of rank " << rank;
        }
      }
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
  // The gradient in the forward: rank 1's gradient buffer has the wrong shape.
  Buffer g(dev, rows * Vl * 4), count(dev, 4);
  const int64_t g_rows = rows - (rank == 1 ? 1 : 0);
  expect_error_everywhere([&] {
    cross_entropy_forward_with_grad({x.data(), rows, Vl, Vl, DType::F32, dev}, tv, o,
                                    {loss.data_as<float>(), lse.data_as<float>(), count.data_as<float>()},
                                    {g.data(), g_rows, Vl, Vl, DType::F32, dev}, &comm);
  }, "grad_logits");
  // A bad target on rank 0 only (CPU: found before the collective, reported everywhere).
  if (dev == Device::CPU) {
    if (rank == 0) t.host_as<int64_t>()[3] = o.vocab_global;
    t.upload();
    expect_error_everywhere([&] {
      cross_entropy_forward({x.data(), rows, Vl, Vl, DType::F32, dev}, tv, o, out, &comm);
    }, "target[3]");
  }
}

// Every rank throws, and the message is the same text on every rank (compared through
// MPI_COMM_WORLD, outside the communicator under test).
template <class F>
std::string expect_same_error_everywhere(F&& f, const std::string& fragment) {
  std::string msg;
  try {
    f();
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_FALSE(msg.empty()) << "rank " << world_rank() << " did not raise";
  EXPECT_NE(msg.find(fragment), std::string::npos) << "message '" << msg << "' lacks '" << fragment << "'";
  constexpr int kBytes = 512;
  std::vector<char> mine(kBytes, 0), all(size_t(kBytes) * world_size());
  std::memcpy(mine.data(), msg.data(), std::min<size_t>(msg.size(), kBytes - 1));
  MPI_Allgather(mine.data(), kBytes, MPI_CHAR, all.data(), kBytes, MPI_CHAR, MPI_COMM_WORLD);
  for (int r = 0; r < world_size(); ++r)
    EXPECT_STREQ(&all[size_t(r) * kBytes], mine.data()) << "rank " << r << " threw another message";
  return msg;
}

// A fixed shard problem of `rows` x `vl` columns per rank, for the agreement tests.
struct Shard {
  Device dev;
  int64_t rows, vl;
  Buffer x, t, loss, lse;
  CrossEntropyOptions o;
  Shard(Device d, const Communicator& comm, int64_t rows_, int64_t vl_)
      : dev(d), rows(rows_), vl(vl_), x(d, rows_ * (vl_ + 1) * 4), t(d, rows_ * 8),
        loss(d, rows_ * 4), lse(d, rows_ * 4) {
    std::memset(x.host(), 0, x.bytes());
    for (int64_t r = 0; r < rows; ++r) t.host_as<int64_t>()[r] = r;
    x.upload(); t.upload();
    o.vocab_start = comm.rank() * vl;
    o.vocab_global = vl * comm.size();
  }
  // A forward over this rank's first `r` rows and `v` columns (the buffers hold vl + 1).
  void forward(Communicator& comm, int64_t r, int64_t v) {
    cross_entropy_forward({x.data(), r, v, v, DType::F32, dev}, {t.data(), r, IndexType::I64, dev}, o,
                          {loss.data_as<float>(), lse.data_as<float>(), nullptr}, &comm);
  }
  void forward(Communicator& comm) { forward(comm, rows, vl); }
};

// After calls that agreed, one rank alone changes its rows, then its V_local: every rank
// throws the same error at that call (the agreement runs on every call, not once per shape),
// and the calls after it, agreed again, work.
void expect_later_disagreement_fails_everywhere(Device dev, Communicator& comm) {
  if (comm.size() < 2) GTEST_SKIP() << "needs >= 2 ranks";
  Shard s(dev, comm, 8, 64);
  for (int i = 0; i < 3; ++i) s.forward(comm);
  const bool odd = comm.rank() == 1;
  std::string m = expect_same_error_everywhere(
      [&] { s.forward(comm, odd ? s.rows - 1 : s.rows, s.vl); }, "rows");
  EXPECT_NE(m.find("rank 1 has 7 rows, rank 0 has 8"), std::string::npos) << m;
  s.forward(comm);
  m = expect_same_error_everywhere([&] { s.forward(comm, s.rows, odd ? s.vl + 1 : s.vl); }, "V_local");
  EXPECT_NE(m.find("rank 1 has V_local 65, rank 0 has 64"), std::string::npos) << m;
  s.forward(comm);
}

// One rank alone takes the other collective form (its collectives would not pair with the
// others'), then another label smoothing (no hang, but another loss): every rank throws at that
// call, and the agreed calls after it work.
void expect_option_disagreement_fails_everywhere(Device dev, Communicator& comm) {
  if (comm.size() < 2) GTEST_SKIP() << "needs >= 2 ranks";
  Shard s(dev, comm, 8, 64);
  const bool odd = comm.rank() == 1;
  for (auto form : {CollectiveForm::AllGather, CollectiveForm::AllReduce}) {
    s.o.collective = odd ? form : (form == CollectiveForm::AllGather ? CollectiveForm::AllReduce
                                                                       : CollectiveForm::AllGather);
    std::string m = expect_same_error_everywhere([&] { s.forward(comm); }, "options.collective");
    EXPECT_NE(m.find("rank 1 uses"), std::string::npos) << m;
  }
  s.o.collective = CollectiveForm::AllGather;
  s.o.label_smoothing = odd ? 0.1f : 0.0f;
  expect_same_error_everywhere([&] { s.forward(comm); },
                               "options: rank 1's label_smoothing=0.100000001 differs from rank "
                               "0's label_smoothing=0");
  s.o.label_smoothing = 0.0f;
  // Rank 1 alone changes one target (in range: its own checks pass): every rank would return
  // a loss of other tokens than its gradient's.
  s.t.download();
  if (odd) s.t.host_as<int64_t>()[3] = 0;
  s.t.upload();
  expect_same_error_everywhere([&] { s.forward(comm); }, "targets: rank 1's differ from rank 0's");
  s.t.host_as<int64_t>()[3] = 3;
  s.t.upload();
  s.forward(comm);
}

// A rank whose own arguments are rejected (a bad target, a missing output): every rank throws
// that rank's message, prefixed with its rank, at the same call.
void expect_local_error_everywhere(Device dev, Communicator& comm) {
  if (comm.size() < 2) GTEST_SKIP() << "needs >= 2 ranks";
  Shard s(dev, comm, 8, 64);
  s.forward(comm);
  const int64_t vg = s.o.vocab_global;
  if (dev == Device::CPU) {  // CUDA targets are checked by the kernels, in flight
    if (comm.rank() == 1) s.t.host_as<int64_t>()[5] = 99 + vg;
    s.t.upload();
    expect_same_error_everywhere([&] { s.forward(comm); },
                                 "vocab-parallel: rank 1: target[5]: got " + std::to_string(99 + vg) +
                                     ", expected in [0, " + std::to_string(vg) +
                                     ") or ignore_index (-100)");
    s.t.host_as<int64_t>()[5] = 5;
    s.t.upload();
  }
  const int last = comm.size() - 1;
  expect_same_error_everywhere([&] {
    CrossEntropyOutputs out{s.loss.data_as<float>(), comm.rank() == last ? nullptr : s.lse.data_as<float>(),
                            nullptr};
    cross_entropy_forward({s.x.data(), s.rows, s.vl, s.vl, DType::F32, dev},
                          {s.t.data(), s.rows, IndexType::I64, dev}, s.o, out, &comm);
  }, "vocab-parallel: rank " + std::to_string(last) + ": out.lse: got null");
  // The last rank alone passes logits that start mid-element (refused before any read).
  expect_same_error_everywhere([&] {
    char* x = static_cast<char*>(s.x.data()) + (comm.rank() == last ? 2 : 0);
    cross_entropy_forward({x, s.rows, s.vl, s.vl, DType::F32, dev},
                          {s.t.data(), s.rows, IndexType::I64, dev}, s.o,
                          {s.loss.data_as<float>(), s.lse.data_as<float>(), nullptr}, &comm);
  }, "vocab-parallel: rank " + std::to_string(last) +
         ": logits.data: got an address that is not 4-byte aligned");
  s.forward(comm);
}

// Counts the all-gathers that reach the wrapped communicator.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Device device() const override { return inner_.device(); }
  void all_gather(const void* send, void* recv, size_t bytes, Stream stream) override {
    ++all_gathers;
    inner_.all_gather(send, recv, bytes, stream);
  }
  void all_reduce(float* data, size_t count, ReduceOp op, Stream stream) override {
    inner_.all_reduce(data, count, op, stream);
  }
  int all_gathers = 0;

 private:
  Communicator& inner_;
};

// The header exchange is one all-gather on every call; check_shard_agreement = false skips it
// (and gives the same loss).
void expect_opt_out_skips_the_exchange(Device dev, Communicator& comm) {
  if (comm.size() < 2) GTEST_SKIP() << "needs >= 2 ranks";
  CountingCommunicator counting(comm);
  Shard s(dev, comm, 8, 64);
  for (auto form : {CollectiveForm::AllGather, CollectiveForm::AllReduce}) {
    const int stats_gathers = form == CollectiveForm::AllGather ? 1 : 0;
    s.o.collective = form;
    for (bool check : {true, false, true}) {
      s.o.check_shard_agreement = check;
      for (int call = 0; call < 3; ++call) {
        counting.all_gathers = 0;
        s.forward(counting);
        EXPECT_EQ(counting.all_gathers, stats_gathers + (check ? 1 : 0))
            << "check " << check << " call " << call << " form " << int(form);
      }
      s.loss.download();
      EXPECT_TRUE(std::isfinite(s.loss.host_as<float>()[0]));
    }
  }
}

// Rank 1 has too little memory for the exchange's scratch (2^20 rows of stats): every rank
// throws OutOfMemory with rank 1's message, none waits in the all-gather; with the memory
// back, the same call runs on every rank.
void expect_out_of_memory_everywhere(Device dev, Communicator& comm) {
  if (comm.size() < 2) GTEST_SKIP() << "needs >= 2 ranks";
  Shard s(dev, comm, int64_t(1) << 20, 1);
  for (int64_t r = 0; r < s.rows; ++r) s.t.host_as<int64_t>()[r] = r % comm.size();
  s.t.upload();
  {
    MemoryCap cap(dev, comm.rank() == 1 ? size_t(16) << 20 : 0);
    expect_error_everywhere<OutOfMemory>([&] { s.forward(comm); }, "vocab-parallel: rank 1: ");
  }
  expect_runs_everywhere([&] { s.forward(comm); });
}

TEST(VocabParallelMpi, OneRanksOutOfMemoryIsEveryRanks) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_out_of_memory_everywhere(Device::CPU, *comm);
}

TEST(VocabParallelMpi, MatchesTp1) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_matches_tp1(Device::CPU, *comm);
}

TEST(VocabParallelMpi, MismatchedShardsFailOnEveryRank) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_mismatch_errors(Device::CPU, *comm);
}

TEST(VocabParallelMpi, LaterDisagreementFailsOnEveryRank) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_later_disagreement_fails_everywhere(Device::CPU, *comm);
}

TEST(VocabParallelMpi, OptionDisagreementFailsOnEveryRank) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_option_disagreement_fails_everywhere(Device::CPU, *comm);
}

TEST(VocabParallelMpi, OneRanksErrorIsEveryRanksError) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_local_error_everywhere(Device::CPU, *comm);
}

TEST(VocabParallelMpi, OptOutSkipsTheExchange) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_opt_out_skips_the_exchange(Device::CPU, *comm);
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

TEST(VocabParallelNccl, LaterDisagreementFailsOnEveryRank) {
  std::string why;
  if (!nccl_ready(&why)) GTEST_SKIP() << "NCCL test needs a GPU per rank: " << why;
  NcclComm comm;
  expect_later_disagreement_fails_everywhere(Device::CUDA, comm.get());
}

TEST(VocabParallelNccl, OptionDisagreementFailsOnEveryRank) {
  std::string why;
  if (!nccl_ready(&why)) GTEST_SKIP() << "NCCL test needs a GPU per rank: " << why;
  NcclComm comm;
  expect_option_disagreement_fails_everywhere(Device::CUDA, comm.get());
}

TEST(VocabParallelNccl, OneRanksErrorIsEveryRanksError) {
  std::string why;
  if (!nccl_ready(&why)) GTEST_SKIP() << "NCCL test needs a GPU per rank: " << why;
  NcclComm comm;
  expect_local_error_everywhere(Device::CUDA, comm.get());
}

TEST(VocabParallelNccl, OneRanksOutOfMemoryIsEveryRanks) {
  std::string why;
  if (!nccl_ready(&why)) GTEST_SKIP() << "NCCL test needs a GPU per rank: " << why;
  NcclComm comm;
  expect_out_of_memory_everywhere(Device::CUDA, comm.get());
}

TEST(VocabParallelNccl, OptOutSkipsTheExchange) {
  std::string why;
  if (!nccl_ready(&why)) GTEST_SKIP() << "NCCL test needs a GPU per rank: " << why;
  NcclComm comm;
  expect_opt_out_skips_the_exchange(Device::CUDA, comm.get());
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

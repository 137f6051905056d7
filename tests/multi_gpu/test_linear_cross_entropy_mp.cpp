// Vocab-parallel linear cross-entropy under mpirun: each rank holds V/world rows of the weight.
// The sharded loss equals the TP=1 loss on every rank (the same bits on every rank), each
// rank's dweight is its rows of the TP=1 dweight, and the partial dhidden summed over the
// ranks is the TP=1 dhidden. Mismatched shards or one rank's bad argument: the same error on
// every rank, no hang. MPI + CPU always; NCCL + CUDA when every rank has a GPU of its own.
#include <mpi.h>

#include "multi_gpu/mpi_util.h"

#include "common/lce_harness.h"
#include "fusedloss/comm_mpi.h"
#if FUSEDLOSS_HAS_NCCL
#include "fusedloss/comm_nccl.h"
#include "fusedloss/nccl_bootstrap.h"
#endif

namespace fusedloss::test {
namespace {


// The same global problem on every rank, from rank 0's seed.
LceProblem shared_problem(const LceCase& global) {
  uint64_t seed = rng()();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  std::mt19937_64 gen(seed);
  return make_lce_problem(global, gen);
}

void expect_matches_tp1(Device dev, Communicator& comm) {
  const int world = comm.size(), rank = comm.rank();
  const std::pair<LinearCeBackward, Reduction> modes[] = {
      {LinearCeBackward::InForward, Reduction::Mean},
      {LinearCeBackward::Recompute, Reduction::Sum},
      {LinearCeBackward::Recompute, Reduction::None},
      {LinearCeBackward::InForward, Reduction::None}};  // with row weights (a 0/1 mask)
  for (auto [mode, red] : modes)
    for (float ls : {0.0f, 0.1f})
      for (int64_t chunk : {1, 5, 64}) {
        LceCase global;
        global.N = 23;
        global.H = 16;
        global.V = 6 * 37;  // V_local 111 (odd) at np 2, 74 at np 3
        global.lo.chunk_rows = chunk;
        global.lo.backward_mode = mode;
        global.lo.logit_softcap = ls > 0 ? 4.0f : 0.0f;
        global.ce.reduction = red;
        global.row_weights = mode == LinearCeBackward::InForward && red == Reduction::None;
        global.ce.label_smoothing = ls;
        global.ce.z_loss = ls > 0 ? 1e-3f : 0.0f;
        global.ce.collective = chunk == 5 ? CollectiveForm::AllReduce : CollectiveForm::AllGather;
        SCOPED_TRACE("world " + std::to_string(world) + " " + global.describe());
        const LceProblem p = shared_problem(global);
        const LceResult tp1 = run_lce(dev, global, p);
        LceCase local = global;
        local.V = global.V / world;
        local.ce.vocab_start = rank * local.V;
        local.ce.vocab_global = global.V;
        const LceResult tpn = run_lce(dev, local, p, &comm, rank * local.V);

        EXPECT_LE(rel_l2(tpn.loss, tp1.loss), 1e-6) << "loss";
        EXPECT_LE(rel_l2(tpn.lse, tp1.lse), 1e-6) << "lse";
        EXPECT_EQ(tpn.valid_count, tp1.valid_count);
        // The same loss bits on every rank.
        std::vector<float> mine(tpn.loss.begin(), tpn.loss.end());
        std::vector<float> all(mine.size() * world);
        MPI_Allgather(mine.data(), int(mine.size()), MPI_FLOAT, all.data(), int(mine.size()),
                      MPI_FLOAT, MPI_COMM_WORLD);
        for (int q = 0; q < world; ++q)
          EXPECT_EQ(0, std::memcmp(&all[q * mine.size()], mine.data(), mine.size() * 4))
              << "rank " << q << " loss bits differ";
        // dweight: this rank's rows of the TP=1 gradient.
        std::vector<double> ref_rows(tp1.dweight.begin() + rank * local.V * global.H,
                                     tp1.dweight.begin() + (rank + 1) * local.V * global.H);
        EXPECT_LE(rel_l2(tpn.dweight, ref_rows), 1e-5) << "dweight shard of rank " << rank;
        // dhidden: the partials sum to the TP=1 gradient.
        std::vector<double> sum(tpn.dhidden.size());
        MPI_Allreduce(tpn.dhidden.data(), sum.data(), int(sum.size()), MPI_DOUBLE, MPI_SUM,
                      MPI_COMM_WORLD);
        EXPECT_LE(rel_l2(sum, tp1.dhidden), 1e-5) << "sum of partial dhidden";
        // And the whole thing against float64.
        expect_lce_close(global, tp1, reference_lce(global, p));
      }
}


// A forward's fp32 outputs in these buffers: dhidden [N, H], dweight [vl, H] (the in-forward
// mode's gradients).
LinearCrossEntropyOutputs fp32_outputs(Buffer& loss, Buffer& lse, Buffer& count, Buffer& dh,
                                       Buffer& dw, int64_t N, int64_t H, int64_t vl) {
  LinearCrossEntropyOutputs out;
  out.loss = loss.data_as<float>();
  out.lse = lse.data_as<float>();
  out.valid_count = count.data_as<float>();
  const Device dev = lse.device();
  out.dhidden = {dh.data(), N, H, H, DType::F32, dev};
  out.dweight = {dw.data(), vl, H, H, DType::F32, dev};
  return out;
}

void expect_mismatch_errors(Device dev, Communicator& comm) {
  if (comm.size() < 2) GTEST_SKIP() << "needs >= 2 ranks";
  const int rank = comm.rank(), world = comm.size();
  const int64_t N = 8, H = 4, Vl = 16;
  Buffer hidden(dev, N * (H + 1) * 4), weight(dev, (Vl + 1) * (H + 1) * 4), target(dev, N * 8),
      loss(dev, N * 4), lse(dev, N * 4), count(dev, 4), dh(dev, N * H * 4),
      dw(dev, (Vl + 1) * (H + 1) * 4);
  std::memset(hidden.host(), 0, hidden.bytes());
  std::memset(weight.host(), 0, weight.bytes());
  for (int64_t r = 0; r < N; ++r) target.host_as<int64_t>()[r] = r;
  hidden.upload(); weight.upload(); target.upload();
  CrossEntropyOptions ce;
  ce.vocab_start = rank * Vl;
  ce.vocab_global = Vl * world;
  IndexView tv{target.data(), N, IndexType::I64, dev};
  auto call = [&](int64_t vl, int64_t wcols, LinearCrossEntropyOptions lo = {},
                  size_t hidden_byte_offset = 0) {
    const LinearCrossEntropyOutputs out = fp32_outputs(loss, lse, count, dh, dw, N, H, vl);
    linear_cross_entropy_forward({hidden.data_as<char>() + hidden_byte_offset, N, H, H, DType::F32, dev},
                                 {weight.data(), vl, wcols, wcols, DType::F32, dev}, tv, ce, lo,
                                 out, &comm);
  };
  // Rank 1 holds one vocabulary row more.
  expect_error_everywhere([&] { call(Vl + (rank == 1), H); }, "V_local");
  // The last rank's weight has another H: its own error, raised on every rank.
  expect_error_everywhere([&] { call(Vl, H + (rank == world - 1)); }, "weight");
  // The last rank's hidden starts mid-element: its own error, raised on every rank.
  expect_error_everywhere([&] { call(Vl, H, {}, rank == world - 1 ? 2 : 0); },
                          "hidden.data: got an address that is not 4-byte aligned");
  // Rank 1 chunks differently: its collectives would not pair with the others'.
  LinearCrossEntropyOptions lo;
  lo.chunk_rows = rank == 1 ? 3 : 4;
  expect_error_everywhere([&] { call(Vl, H, lo); }, "chunking");
  // Rank 1 takes the other collective form: its collectives would not pair either.
  ce.collective = rank == 1 ? CollectiveForm::AllReduce : CollectiveForm::AllGather;
  expect_error_everywhere([&] { call(Vl, H); }, "options.collective: rank 1 uses AllReduce");
  ce.collective = CollectiveForm::AllGather;
  // Rank 1 soft-caps its logits: no hang, but every rank would compute another loss.
  lo = {};
  lo.logit_softcap = rank == 1 ? 30.0f : 0.0f;
  expect_error_everywhere([&] { call(Vl, H, lo); },
                          "options: rank 1's logit_softcap=30 differs from rank 0's logit_softcap=0");
  call(Vl, H);  // agreed again: fine
  // Rank 1's hidden states and weight are wider: valid on each rank, but a caller's dhidden
  // all-reduce would not pair. Named, with both values.
  {
    LinearCrossEntropyOptions recompute;  // (no dhidden output of the forward to size)
    recompute.backward_mode = LinearCeBackward::Recompute;
    const int64_t h = H + (rank == 1);
    const LinearCrossEntropyOutputs out = fp32_outputs(loss, lse, count, dh, dw, N, H, Vl);
    expect_error_everywhere(
        [&] {
          linear_cross_entropy_forward({hidden.data(), N, h, h, DType::F32, dev},
                                       {weight.data(), Vl, h, h, DType::F32, dev}, tv, ce,
                                       recompute, out, &comm);
        },
        "options: rank 1's H=5 differs from rank 0's H=4");
  }
  // Rank 1 alone changes a target (in range): refused everywhere.
  target.download();
  if (rank == 1) target.host_as<int64_t>()[2] = 0;
  target.upload();
  expect_error_everywhere([&] { call(Vl, H); }, "targets: rank 1's differ from rank 0's");
  target.host_as<int64_t>()[2] = 2;
  target.upload();
  // Rank 1 weights one row otherwise (row weights, InForward): its gradients would weight the
  // rows differently from the others', silently. Refused everywhere, with the targets; equal
  // weights agree (-0 and 0 are one weight).
  {
    CrossEntropyOptions none = ce;
    none.reduction = Reduction::None;
    Buffer rw(dev, N * 4);
    LinearCrossEntropyOutputs out = fp32_outputs(loss, lse, count, dh, dw, N, H, Vl);
    out.row_weight = rw.data_as<float>();
    auto weighted = [&](float rank1_row2) {  // row 2 weighs 0 on the other ranks
      for (int64_t r = 0; r < N; ++r)
        rw.host_as<float>()[r] = r != 2 ? 1.0f : rank == 1 ? rank1_row2 : 0.0f;
      rw.upload();
      linear_cross_entropy_forward({hidden.data(), N, H, H, DType::F32, dev},
                                   {weight.data(), Vl, H, H, DType::F32, dev}, tv, none, {}, out,
                                   &comm);
    };
    expect_error_everywhere([&] { weighted(1.0f); },
                            "targets: rank 1's differ from rank 0's (a checksum of their values, "
                            "and of the row weights')");
    weighted(0.0f);
    weighted(-0.0f);  // one weight: -0 and 0 agree
    // Rank 1 alone passes no row weights (Auto: Recompute there): named as such, not as the
    // backward mode it sets
    if (rank == 1) out.row_weight = nullptr;
    expect_error_everywhere([&] { weighted(0.0f); },
                            "options: rank 1's row_weight=null differs from rank 0's row_weight=given");
  }
  // A bad target on rank 0 only (CPU: found before the collective).
  if (dev == Device::CPU) {
    if (rank == 0) target.host_as<int64_t>()[3] = Vl * world;
    target.upload();
    expect_error_everywhere([&] { call(Vl, H); }, "target[3]");
  }
}

// Rank 1 has too little memory for the call's scratch (chunk buffers of 2048 x 8192 fp32
// logits): every rank throws OutOfMemory with rank 1's message, none waits in a collective;
// with the memory back, the same call runs on every rank.
void expect_out_of_memory_everywhere(Device dev, Communicator& comm) {
  if (comm.size() < 2) GTEST_SKIP() << "needs >= 2 ranks";
  const int rank = comm.rank(), world = comm.size();
  const int64_t N = 2048, H = 1, Vl = 8192;
  Buffer hidden(dev, N * H * 4), weight(dev, Vl * H * 4), target(dev, N * 8), loss(dev, 4),
      lse(dev, N * 4), count(dev, 4), dh(dev, N * H * 4), dw(dev, Vl * H * 4);
  for (int64_t r = 0; r < N; ++r) hidden.host_as<float>()[r] = 0.01f * float(r % 7);
  for (int64_t v = 0; v < Vl; ++v) weight.host_as<float>()[v] = 0.01f * float(v % 5);
  for (int64_t r = 0; r < N; ++r) target.host_as<int64_t>()[r] = (r * 37) % (Vl * world);
  hidden.upload(); weight.upload(); target.upload();
  CrossEntropyOptions ce;
  ce.vocab_start = rank * Vl;
  ce.vocab_global = Vl * world;
  auto call = [&] {
    const LinearCrossEntropyOutputs out = fp32_outputs(loss, lse, count, dh, dw, N, H, Vl);
    linear_cross_entropy_forward({hidden.data(), N, H, H, DType::F32, dev},
                                 {weight.data(), Vl, H, H, DType::F32, dev},
                                 {target.data(), N, IndexType::I64, dev}, ce, {}, out, &comm);
  };
  {
    MemoryCap cap(dev, rank == 1 ? size_t(16) << 20 : 0);
    expect_error_everywhere<OutOfMemory>(call, "vocab-parallel: rank 1: ");
  }
  expect_runs_everywhere(call);
}

// The host chunk loop allocates nothing beyond the call's scratch (a GEMM that copied its
// operands would take 4 MiB for the weight between the per-chunk collectives): with rank 1
// left room for about the scratch alone, the call runs on every rank.
void expect_the_loop_to_run_within_its_scratch(Communicator& comm) {
  const Device dev = Device::CPU;
  const int rank = comm.rank(), world = comm.size();
  const int64_t N = 128, H = 256, Vl = 4096;
  Buffer hidden(dev, N * H * 4), weight(dev, Vl * H * 4), target(dev, N * 8), loss(dev, 4),
      lse(dev, N * 4), count(dev, 4), dh(dev, N * H * 4), dw(dev, Vl * H * 4);
  for (int64_t i = 0; i < N * H; ++i) hidden.host_as<float>()[i] = 0.01f * float(i % 7);
  for (int64_t i = 0; i < Vl * H; ++i) weight.host_as<float>()[i] = 0.01f * float(i % 5);
  for (int64_t r = 0; r < N; ++r) target.host_as<int64_t>()[r] = (r * 37) % (Vl * world);
  CrossEntropyOptions ce;
  ce.vocab_start = rank * Vl;
  ce.vocab_global = Vl * world;
  LinearCrossEntropyOptions lo;
  lo.chunk_rows = 16;  // 256 KiB of logits a chunk
  auto call = [&] {
    linear_cross_entropy_forward({hidden.data(), N, H, H, DType::F32, dev},
                                 {weight.data(), Vl, H, H, DType::F32, dev},
                                 {target.data(), N, IndexType::I64, dev}, ce, lo,
                                 fp32_outputs(loss, lse, count, dh, dw, N, H, Vl), &comm);
  };
  ASSERT_LE(linear_cross_entropy_forward_scratch_bytes({hidden.data(), N, H, H, DType::F32, dev},
                                                       {weight.data(), Vl, H, H, DType::F32, dev},
                                                       ce, lo, world),
            size_t(512) << 10);
  expect_runs_everywhere(call);  // first outside the cap: the threads and the heap exist
  MemoryCap cap(dev, rank == 1 ? size_t(2) << 20 : 0);
  expect_runs_everywhere(call);
}

TEST(LinearCrossEntropyMpi, MatchesTp1) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_matches_tp1(Device::CPU, *comm);
}

TEST(LinearCrossEntropyMpi, MismatchedShardsFailOnEveryRank) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_mismatch_errors(Device::CPU, *comm);
}

TEST(LinearCrossEntropyMpi, OneRanksOutOfMemoryIsEveryRanks) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_out_of_memory_everywhere(Device::CPU, *comm);
}

TEST(LinearCrossEntropyMpi, TheLoopRunsWithinItsScratch) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  expect_the_loop_to_run_within_its_scratch(*comm);
}

#if FUSEDLOSS_HAS_NCCL
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

TEST(LinearCrossEntropyNccl, MatchesTp1AndFailsTogether) {
  std::string why;
  if (!nccl_ready(&why)) GTEST_SKIP() << "NCCL test needs a GPU per rank: " << why;
  cudaSetDevice(world_rank());
  ncclComm_t nccl = make_nccl_comm_from_mpi(MPI_COMM_WORLD);
  {
    auto comm = make_nccl_communicator(nccl);
    expect_matches_tp1(Device::CUDA, *comm);
    expect_mismatch_errors(Device::CUDA, *comm);
    expect_out_of_memory_everywhere(Device::CUDA, *comm);
  }
  ncclCommDestroy(nccl);
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

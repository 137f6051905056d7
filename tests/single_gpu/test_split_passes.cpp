// The public split passes, with the "collective" done by hand in one process: the vocab split
// in k shards must reproduce the unsharded loss (all-gather and all-reduce forms), and the
// per-shard backward must produce the matching slice of the unsharded gradient.
#include "common/ce_harness.h"

namespace fusedloss::test {
namespace {

class SplitPasses : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { FL_SKIP_UNLESS_BACKEND(GetParam()); }
};

struct Sharded {
  std::vector<float> loss;  // [rows] per-rank result of rank `observe`
  std::vector<float> lse;
  std::vector<double> grad;  // [rows, V] concatenated over shards
};

// Runs the passes for `world` equal shards of x [rows, V] (fp32), merging on every rank.
Sharded run_sharded(Device dev, const std::vector<float>& x, const std::vector<int64_t>& target,
                    int64_t rows, int64_t V, int world, CrossEntropyOptions opt,
                    CollectiveForm form, int observe) {
  const int64_t Vl = V / world;
  opt.reduction = Reduction::None;
  opt.vocab_global = V;
  Buffer tgt(dev, rows * 8);
  std::memcpy(tgt.host(), target.data(), rows * 8);
  tgt.upload();
  IndexView tv{tgt.data(), rows, IndexType::I64, dev};
  std::vector<RowStats> all(size_t(world) * rows);
  std::vector<std::unique_ptr<Buffer>> shards;
  for (int k = 0; k < world; ++k) {
    shards.push_back(std::make_unique<Buffer>(dev, rows * Vl * 4));
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(shards[k]->host_as<float>() + r * Vl, &x[r * V + k * Vl], Vl * 4);
    shards[k]->upload();
    Buffer st(dev, rows * sizeof(RowStats));
    opt.vocab_start = k * Vl;
    cross_entropy_local_stats({shards[k]->data(), rows, Vl, Vl, DType::F32, dev}, tv, opt,
                              st.data_as<RowStats>());
    st.download();
    std::memcpy(&all[size_t(k) * rows], st.host(), rows * sizeof(RowStats));
  }
  Sharded out;
  out.grad.assign(rows * V, 0.0);
  for (int k = 0; k < world; ++k) {
    opt.vocab_start = k * Vl;
    Buffer combined(dev, all.size() * sizeof(RowStats)), local(dev, rows * sizeof(RowStats));
    std::memcpy(local.host(), &all[size_t(k) * rows], rows * sizeof(RowStats));
    local.upload();
    int parts = world;
    if (form == CollectiveForm::AllGather) {
      std::memcpy(combined.host(), all.data(), all.size() * sizeof(RowStats));
      combined.upload();
    } else {
      // all-reduce MAX by hand, then each rank prepares, then SUM by hand
      std::vector<float> gmax(rows, -INFINITY);
      for (int q = 0; q < world; ++q)
        for (int64_t r = 0; r < rows; ++r) gmax[r] = std::fmax(gmax[r], all[q * rows + r].max);
      Buffer gm(dev, rows * 4);
      std::memcpy(gm.host(), gmax.data(), rows * 4);
      gm.upload();
      std::vector<float> sum(rows * 4, 0.0f);
      for (int q = 0; q < world; ++q) {
        Buffer lq(dev, rows * sizeof(RowStats)), sq(dev, rows * sizeof(RowStats));
        std::memcpy(lq.host(), &all[size_t(q) * rows], rows * sizeof(RowStats));
        lq.upload();
        CrossEntropyOptions oq = opt;
        oq.vocab_start = q * Vl;
        cross_entropy_prepare_sum(lq.data_as<RowStats>(), gm.data_as<float>(), tv, oq, Vl, q,
                                  sq.data_as<RowStats>(), dev);
        sq.download();
        for (int64_t i = 0; i < rows * 4; ++i) sum[i] += sq.host_as<float>()[i];
      }
      std::memcpy(combined.host(), sum.data(), rows * sizeof(RowStats));
      combined.upload();
      parts = 1;
    }
    Buffer loss(dev, rows * 4), lse(dev, rows * 4);
    loss.poison(); lse.poison();
    // `local` is read only under the partition scope: pass null otherwise, as the API allows
    const bool partition = opt.smoothing_scope == SmoothingScope::Partition;
    cross_entropy_merge(combined.data_as<RowStats>(), parts,
                        partition ? local.data_as<RowStats>() : nullptr, tv, opt, Vl,
                        {loss.data_as<float>(), lse.data_as<float>(), nullptr});
    loss.download(); lse.download();
    if (k == observe) {
      out.loss.assign(loss.host_as<float>(), loss.host_as<float>() + rows);
      out.lse.assign(lse.host_as<float>(), lse.host_as<float>() + rows);
    }
    Buffer ones(dev, rows * 4), g(dev, rows * Vl * 4);
    for (int64_t r = 0; r < rows; ++r) ones.host_as<float>()[r] = 1.0f;
    ones.upload(); g.poison();
    MatrixView sv{shards[k]->data(), rows, Vl, Vl, DType::F32, dev};
    cross_entropy_backward(sv, tv, lse.data_as<float>(), ones.data_as<float>(), nullptr, opt,
                           {g.data(), rows, Vl, Vl, DType::F32, dev});
    g.download();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < Vl; ++j) out.grad[r * V + k * Vl + j] = g.host_as<float>()[r * Vl + j];
  }
  return out;
}

TEST_P(SplitPasses, ShardedEqualsUnsharded) {
  const int64_t rows = 24, V = 1200;
  DenseProblem p = random_problem(rows, V, 2.0f, rng());
  const std::vector<float>& x = p.x;
  std::vector<int64_t>& target = p.target;
  target[3] = -100;
  std::vector<double> xd(x.begin(), x.end());
  for (float ls : {0.0f, 0.1f})
    for (float z : {0.0f, 1e-3f}) {
      RefOptions ro;
      ro.label_smoothing = ls;
      ro.z_loss = z;
      RefResult ref = reference_cross_entropy(xd, rows, V, target, ro, std::vector<double>(rows, 1));
      for (int world : {1, 2, 3, 4})
        for (auto form : {CollectiveForm::AllGather, CollectiveForm::AllReduce}) {
          SCOPED_TRACE("world=" + std::to_string(world) + " form=" + std::to_string(int(form)) +
                       " ls=" + std::to_string(ls) + " z=" + std::to_string(z));
          CrossEntropyOptions o;
          o.label_smoothing = ls;
          o.z_loss = z;
          Sharded s = run_sharded(GetParam(), x, target, rows, V, world, o, form, world - 1);
          EXPECT_LE(rel_l2(to_double(s.loss), ref.loss), kLossTolerance);
          EXPECT_LE(rel_l2(to_double(s.lse), ref.lse), kLossTolerance);
          EXPECT_LE(rel_l2(s.grad, ref.grad), 2e-5);
        }
    }
}

TEST_P(SplitPasses, PartitionScopeIsMegatronsPerShardAverage) {
  // Megatron's vocab_parallel_cross_entropy: smoothing = ls*Vl/(Vl-1), averaged over the shard.
  const int64_t rows = 10, V = 600;
  const int world = 3, Vl = V / world;
  const double ls = 0.1;
  DenseProblem p = random_problem(rows, V, 2.0f, rng());
  const std::vector<float>& x = p.x;
  std::vector<int64_t>& target = p.target;
  std::vector<double> xd(x.begin(), x.end());
  RefResult base = reference_cross_entropy(xd, rows, V, target, {}, std::vector<double>(rows, 1));
  CrossEntropyOptions o;
  o.label_smoothing = float(ls);
  o.smoothing_formula = SmoothingFormula::Megatron;
  o.smoothing_scope = SmoothingScope::Partition;
  for (int k = 0; k < world; ++k) {
    Sharded s = run_sharded(GetParam(), x, target, rows, V, world, o, CollectiveForm::AllGather, k);
    double alpha = ls * Vl / (Vl - 1.0);
    std::vector<double> expect(rows);
    for (int64_t r = 0; r < rows; ++r) {
      double mean_logp = 0;
      for (int64_t j = 0; j < Vl; ++j) mean_logp += (xd[r * V + k * Vl + j] - base.lse[r]) / Vl;
      double nll = base.lse[r] - xd[r * V + target[r]];
      expect[r] = (1 - alpha) * nll - alpha * mean_logp;
    }
    EXPECT_LE(rel_l2(to_double(s.loss), expect), kLossTolerance) << "rank " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, SplitPasses, ::testing::Values(Device::CPU, Device::CUDA),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace fusedloss::test

// The log-prob head on one process, every backend (CPU always; CUDA when a GPU is present),
// against a float64 reference: values at a temperature, both gradients together, chunk
// boundaries, ignored rows, the shard split (local stats of each vocabulary shard, then the
// merge), and bad inputs.
#include <cmath>
#include <vector>
#include "common/test_util.h"
#include "fusedloss/linear_log_probs.h"

namespace fusedloss::test {
namespace {

struct Problem {
  int64_t N = 29, H = 16, V = 37;
  DType dtype = DType::F32;
  float temperature = 0.8f;
  std::vector<float> hidden, weight, g, e;  // rounded to dtype
  std::vector<int64_t> tokens;
};

Problem make_problem(DType dtype, int64_t N = 29) {
  Problem p;
  p.N = N;
  p.dtype = dtype;
  std::normal_distribution<float> normal;
  auto rounded = [&](float v) {
    float out;
    store_as(dtype, &out, 0, v);
    return load_as(dtype, &out, 0);
  };
  for (int64_t i = 0; i < p.N * p.H; ++i) p.hidden.push_back(rounded(normal(rng())));
  for (int64_t i = 0; i < p.V * p.H; ++i) p.weight.push_back(rounded(normal(rng()) * 0.5f));
  std::uniform_int_distribution<int64_t> token(0, p.V - 1);
  for (int64_t r = 0; r < p.N; ++r) {
    p.tokens.push_back(r % 5 == 3 ? -100 : token(rng()));
    p.g.push_back(normal(rng()));
    p.e.push_back(normal(rng()));
  }
  return p;
}

struct Reference {
  std::vector<double> log_probs, entropy, dhidden, dweight;
  std::vector<int64_t> argmax;
};

// Float64 results and the gradients of sum g log_prob + e entropy (logits rounded to the
// inputs' dtype, as the chunk buffers store them).
Reference reference(const Problem& p) {
  Reference ref;
  ref.dhidden.assign(p.N * p.H, 0.0);
  ref.dweight.assign(p.V * p.H, 0.0);
  for (int64_t r = 0; r < p.N; ++r) {
    std::vector<double> y(p.V);
    for (int64_t j = 0; j < p.V; ++j) {
      double z = 0;
      for (int64_t k = 0; k < p.H; ++k) z += double(p.hidden[r * p.H + k]) * p.weight[j * p.H + k];
      float zr;
      store_as(p.dtype, &zr, 0, float(z));
      y[j] = double(load_as(p.dtype, &zr, 0)) / p.temperature;
    }
    const double m = *std::max_element(y.begin(), y.end());
    double s = 0;
    for (double v : y) s += std::exp(v - m);
    const double lse = m + std::log(s);
    double h = 0;
    for (double v : y) h -= std::exp(v - lse) * (v - lse);
    const int64_t t = p.tokens[r];
    const bool ignored = t == -100;
    ref.log_probs.push_back(ignored ? 0.0 : y[t] - lse);
    ref.entropy.push_back(ignored ? 0.0 : h);
    ref.argmax.push_back(std::max_element(y.begin(), y.end()) - y.begin());
    if (ignored) continue;
    for (int64_t j = 0; j < p.V; ++j) {
      const double logp = y[j] - lse, pj = std::exp(logp);
      const double dz = (p.g[r] * ((j == t) - pj) - p.e[r] * pj * (logp + h)) / p.temperature;
      for (int64_t k = 0; k < p.H; ++k) {
        ref.dhidden[r * p.H + k] += dz * p.weight[j * p.H + k];
        ref.dweight[j * p.H + k] += dz * p.hidden[r * p.H + k];
      }
    }
  }
  return ref;
}

// A device copy of floats stored as dtype.
struct Tensor {
  Buffer buf;
  Tensor(Device d, DType dtype, const std::vector<float>& v)
      : buf(d, v.size() * size_t(dtype_size(dtype))) {
    for (size_t i = 0; i < v.size(); ++i) store_as(dtype, buf.host(), int64_t(i), v[i]);
    buf.upload();
  }
  MatrixView view(int64_t rows, int64_t cols, DType dtype) {
    return MatrixView{buf.data(), rows, cols, cols, dtype, buf.device()};
  }
  std::vector<double> values(DType dtype) {
    buf.download();
    std::vector<double> out(buf.bytes() / size_t(dtype_size(dtype)));
    for (size_t i = 0; i < out.size(); ++i) out[i] = load_as(dtype, buf.host(), int64_t(i));
    return out;
  }
};

class LinearLogProbs : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { FL_SKIP_UNLESS_BACKEND(GetParam()); }

  void check(DType dtype, int64_t chunk_rows) {
    const Device dev = GetParam();
    const Problem p = make_problem(dtype);
    const Reference ref = reference(p);
    Tensor hidden(dev, dtype, p.hidden), weight(dev, dtype, p.weight);
    Tensor g(dev, DType::F32, p.g), e(dev, DType::F32, p.e);
    Buffer tokens(dev, sizeof(int64_t) * p.N);
    std::copy(p.tokens.begin(), p.tokens.end(), tokens.host_as<int64_t>());
    tokens.upload();
    Buffer lp(dev, 4 * p.N), ent(dev, 4 * p.N), lse(dev, 4 * p.N), am(dev, 8 * p.N);
    for (Buffer* b : {&lp, &ent, &lse, &am}) b->poison();
    LinearLogProbsOptions o;
    o.temperature = p.temperature;
    o.chunk_rows = chunk_rows;
    const MatrixView h = hidden.view(p.N, p.H, dtype), w = weight.view(p.V, p.H, dtype);
    const IndexView t{tokens.data(), p.N, IndexType::I64, dev};
    linear_log_probs_forward(h, w, t, o,
                             {lp.data_as<float>(), ent.data_as<float>(), am.data_as<int64_t>(),
                              lse.data_as<float>()});
    for (Buffer* b : {&lp, &ent, &am}) b->download();
    const double tol = dtype == DType::F32 ? 2e-5 : 2e-2;
    for (int64_t r = 0; r < p.N; ++r) {
      EXPECT_NEAR(lp.host_as<float>()[r], ref.log_probs[r], tol * (1 + std::abs(ref.log_probs[r])))
          << "row " << r;
      EXPECT_NEAR(ent.host_as<float>()[r], ref.entropy[r], tol * (1 + ref.entropy[r])) << "row " << r;
      if (dtype == DType::F32) EXPECT_EQ(am.host_as<int64_t>()[r], ref.argmax[r]) << "row " << r;
    }
    Tensor dh(dev, dtype, std::vector<float>(p.N * p.H, NAN));
    Tensor dw(dev, DType::F32, std::vector<float>(p.V * p.H, NAN));
    linear_log_probs_backward(h, w, t, lse.data_as<float>(), ent.data_as<float>(),
                              g.buf.data_as<float>(), e.buf.data_as<float>(), o,
                              {dh.view(p.N, p.H, dtype), dw.view(p.V, p.H, DType::F32), false});
    EXPECT_LE(rel_l2(dh.values(dtype), ref.dhidden), grad_tolerance(dtype) * 2);
    EXPECT_LE(rel_l2(dw.values(DType::F32), ref.dweight), grad_tolerance(dtype) * 2);
  }
};

TEST_P(LinearLogProbs, AgainstFloat64) {
  for (DType d : {DType::F32, DType::BF16})
    for (int64_t chunk : {int64_t(0), int64_t(1), int64_t(7)}) check(d, chunk);
}

TEST_P(LinearLogProbs, ShardsMergeToTheWholeVocabulary) {
  const Device dev = GetParam();
  const Problem p = make_problem(DType::F32);
  const Reference ref = reference(p);
  Tensor hidden(dev, DType::F32, p.hidden), weight(dev, DType::F32, p.weight);
  Buffer tokens(dev, sizeof(int64_t) * p.N);
  std::copy(p.tokens.begin(), p.tokens.end(), tokens.host_as<int64_t>());
  tokens.upload();
  const IndexView t{tokens.data(), p.N, IndexType::I64, dev};
  const int world = 3;
  const int64_t shard = (p.V + world - 1) / world;  // the last shard is shorter
  Buffer stats(dev, sizeof(LogProbStats) * p.N * world);
  stats.poison();
  for (int r = 0; r < world; ++r) {
    LinearLogProbsOptions o;
    o.temperature = p.temperature;
    o.vocab_start = r * shard;
    o.vocab_global = p.V;
    MatrixView w = weight.view(std::min(shard, p.V - r * shard), p.H, DType::F32);
    w.data = static_cast<float*>(w.data) + r * shard * p.H;
    linear_log_probs_local_stats(hidden.view(p.N, p.H, DType::F32), w, t, o,
                                 stats.data_as<LogProbStats>() + r * p.N);
  }
  Buffer lp(dev, 4 * p.N), lse(dev, 4 * p.N), am(dev, 8 * p.N);
  LinearLogProbsOptions o;
  o.temperature = p.temperature;
  o.vocab_global = p.V;
  log_probs_merge(stats.data_as<LogProbStats>(), world, p.N, t, o,
                  {lp.data_as<float>(), nullptr, am.data_as<int64_t>(), lse.data_as<float>()}, dev);
  lp.download();
  am.download();
  for (int64_t r = 0; r < p.N; ++r) {
    EXPECT_NEAR(lp.host_as<float>()[r], ref.log_probs[r], 2e-5 * (1 + std::abs(ref.log_probs[r])));
    EXPECT_EQ(am.host_as<int64_t>()[r], ref.argmax[r]);
  }
}

TEST_P(LinearLogProbs, BadInputs) {
  const Device dev = GetParam();
  const Problem p = make_problem(DType::F32, 4);
  Tensor hidden(dev, DType::F32, p.hidden), weight(dev, DType::F32, p.weight);
  Buffer tokens(dev, sizeof(int64_t) * p.N), lse(dev, 4 * p.N);
  std::copy(p.tokens.begin(), p.tokens.end(), tokens.host_as<int64_t>());
  tokens.upload();
  const MatrixView h = hidden.view(p.N, p.H, DType::F32), w = weight.view(p.V, p.H, DType::F32);
  const IndexView t{tokens.data(), p.N, IndexType::I64, dev};
  LinearLogProbsOptions o;
  o.temperature = 0.0f;
  expect_error([&] { linear_log_probs_forward(h, w, t, o, {nullptr, nullptr, nullptr, lse.data_as<float>()}); },
               "options.temperature: got 0", "expected a finite value > 0");
  o = LinearLogProbsOptions{};
  o.vocab_start = 5;
  expect_error([&] { linear_log_probs_forward(h, w, t, o, {nullptr, nullptr, nullptr, lse.data_as<float>()}); },
               "options.vocab_start: got 5", "within [0, vocab_global)");
  o = LinearLogProbsOptions{};
  expect_error([&] { linear_log_probs_forward(h, w, t, o, {}); }, "out.lse: got null",
               "expected 4 floats");
  expect_error([&] { log_probs_merge(nullptr, 0, 0, t, o, {}, dev); }, "world: got 0",
               "expected >= 1");
}

INSTANTIATE_TEST_SUITE_P(Backends, LinearLogProbs, ::testing::Values(Device::CPU, Device::CUDA),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace fusedloss::test

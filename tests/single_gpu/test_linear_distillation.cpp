// The linear distillation loss against float64: every divergence at two
// temperatures, the hard-label term, ignored rows, no target, chunk boundaries, a teacher of
// another hidden size and dtype, both student dtypes, the in-forward gradients, three vocabulary
// shards merged; on every backend (CUDA when a GPU is present); bad options. The
// reference's gradient is the central difference of its own loss (float64), not the formula the
// library uses.
#include <cmath>
#include <functional>
#include <memory>
#include <vector>
#include "common/test_util.h"
#include "core/distill_math.h"
#include "fusedloss/linear_distillation.h"

namespace fusedloss::test {
namespace {

struct Case {
  Divergence divergence = Divergence::ForwardKL;
  float beta = 0.5f, temperature = 1.0f, hard = 0.0f;
  bool with_target = true;
  DType student = DType::F32, teacher = DType::F32;
  int64_t chunk_rows = 0;
  bool shards = false;  // vocab-parallel: three shards' partials merged
  bool in_forward_g = false;  // the in-forward gradients for g (else for 1 a row)
};

constexpr int64_t N = 23, Hs = 12, Ht = 17, V = 31;

int64_t element_bytes(DType d) { return d == DType::F32 ? 4 : 2; }

float rounded(DType d, float v) {
  float out;
  store_as(d, &out, 0, v);
  return load_as(d, &out, 0);
}

std::vector<float> random(DType d, int64_t n, float scale) {
  std::normal_distribution<float> normal;
  std::vector<float> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(rounded(d, normal(rng()) * scale));
  return v;
}

// [rows, V] = h @ w^T in float64, each logit rounded to dtype (as the chunk buffers hold it).
std::vector<double> logits(const std::vector<float>& h, const std::vector<float>& w, int64_t H,
                           DType d) {
  std::vector<double> z(N * V);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < V; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < H; ++k) acc += double(h[r * H + k]) * w[j * H + k];
      z[r * V + j] = rounded(d, float(acc));
    }
  return z;
}

// One row's loss from the definitions, in float64.
double row_loss(const Case& c, const double* x, const double* t, int64_t target) {
  std::vector<double> lq(V), lp(V);
  auto log_softmax = [](const double* v, double scale, std::vector<double>& out) {
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, v[j] * scale);
    for (int64_t j = 0; j < V; ++j) s += std::exp(v[j] * scale - m);
    for (int64_t j = 0; j < V; ++j) out[j] = v[j] * scale - m - std::log(s);
  };
  log_softmax(x, 1.0 / c.temperature, lq);
  log_softmax(t, 1.0 / c.temperature, lp);
  double soft = 0;
  for (int64_t j = 0; j < V; ++j) {
    const double q = std::exp(lq[j]), p = std::exp(lp[j]);
    if (c.divergence == Divergence::ForwardKL) soft += p * (lp[j] - lq[j]);
    if (c.divergence == Divergence::ReverseKL) soft += q * (lq[j] - lp[j]);
    if (c.divergence == Divergence::JSD) {
      const double m = c.beta * p + (1 - c.beta) * q;
      soft += c.beta * p * std::log(p / m) + (1 - c.beta) * q * std::log(q / m);
    }
  }
  double loss = (1 - c.hard) * soft;
  if (c.hard > 0) {
    std::vector<double> lz(V);
    log_softmax(x, 1.0, lz);
    loss -= c.hard * lz[target];
  }
  return loss;
}

// The four operands in their dtypes and the targets, on the backend's device.
struct Inputs {
  Buffer bsh, bsw, bth, btw, btarget;
  MatrixView sh, sw, th, tw;
  bool with_target;
  static size_t bytes(DType d, size_t n) { return n * size_t(element_bytes(d)); }
  static void fill(Buffer& b, const std::vector<float>& v, DType d) {
    for (size_t i = 0; i < v.size(); ++i) store_as(d, b.host(), int64_t(i), v[i]);
    b.upload();
  }
  Inputs(Device dev, const Case& c, const std::vector<float>& h_s, const std::vector<float>& w_s,
         const std::vector<float>& h_t, const std::vector<float>& w_t,
         const std::vector<int64_t>& target)
      : bsh(dev, bytes(c.student, h_s.size())), bsw(dev, bytes(c.student, w_s.size())),
        bth(dev, bytes(c.teacher, h_t.size())), btw(dev, bytes(c.teacher, w_t.size())),
        btarget(dev, 8 * target.size()), with_target(c.with_target) {
    fill(bsh, h_s, c.student), fill(bsw, w_s, c.student);
    fill(bth, h_t, c.teacher), fill(btw, w_t, c.teacher);
    std::memcpy(btarget.host(), target.data(), 8 * target.size());
    btarget.upload();
    sh = {bsh.data(), N, Hs, Hs, c.student, dev}, sw = {bsw.data(), V, Hs, Hs, c.student, dev};
    th = {bth.data(), N, Ht, Ht, c.teacher, dev}, tw = {btw.data(), V, Ht, Ht, c.teacher, dev};
  }
  IndexView target() {
    return IndexView{with_target ? btarget.data() : nullptr, N, IndexType::I64, btarget.device()};
  }
};

void check(Device dev, const Case& c) {
  SCOPED_TRACE(::testing::Message() << "divergence " << int(c.divergence) << " T " << c.temperature
                                    << " hard " << c.hard << " target " << c.with_target
                                    << " dtypes " << to_string(c.student) << "/"
                                    << to_string(c.teacher) << " chunk " << c.chunk_rows
                                    << " shards " << c.shards);
  auto sh = random(c.student, N * Hs, 1.0f), sw = random(c.student, V * Hs, 0.6f);
  auto th = random(c.teacher, N * Ht, 1.0f), tw = random(c.teacher, V * Ht, 0.6f);
  std::vector<int64_t> target(N);
  std::uniform_int_distribution<int64_t> cls(0, V - 1);
  for (int64_t r = 0; r < N; ++r) target[r] = r % 6 == 4 && c.with_target ? -100 : cls(rng());
  std::vector<float> g = random(DType::F32, N, 1.0f);
  const auto xs = logits(sh, sw, Hs, c.student), xt = logits(th, tw, Ht, c.teacher);

  // float64: losses, and dloss/dx by central differences of each row's loss
  std::vector<double> want_loss(N, 0.0), dx(N * V, 0.0), dx1(N * V, 0.0);
  for (int64_t r = 0; r < N; ++r) {
    if (target[r] == -100 && c.with_target) continue;
    std::vector<double> x(xs.begin() + r * V, xs.begin() + (r + 1) * V);
    want_loss[r] = row_loss(c, x.data(), &xt[r * V], target[r]);
    for (int64_t j = 0; j < V; ++j) {
      const double e = 1e-6 * std::max(1.0, std::abs(x[j])), keep = x[j];
      x[j] = keep + e;
      const double up = row_loss(c, x.data(), &xt[r * V], target[r]);
      x[j] = keep - e;
      const double down = row_loss(c, x.data(), &xt[r * V], target[r]);
      x[j] = keep;
      dx1[r * V + j] = (up - down) / (2 * e);
      dx[r * V + j] = g[r] * dx1[r * V + j];
    }
  }
  std::vector<double> want_dh(N * Hs, 0.0), want_dw(V * Hs, 0.0), unit_dh(N * Hs, 0.0),
      unit_dw(V * Hs, 0.0);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < V; ++j)
      for (int64_t k = 0; k < Hs; ++k) {
        want_dh[r * Hs + k] += dx[r * V + j] * sw[j * Hs + k];
        want_dw[j * Hs + k] += dx[r * V + j] * sh[r * Hs + k];
        unit_dh[r * Hs + k] += dx1[r * V + j] * sw[j * Hs + k];
        unit_dw[j * Hs + k] += dx1[r * V + j] * sh[r * Hs + k];
      }

  Inputs in(dev, c, sh, sw, th, tw, target);
  LinearDistillationOptions o;
  o.divergence = c.divergence;
  o.beta = c.beta;
  o.temperature = c.temperature;
  o.hard_label_weight = c.hard;
  o.chunk_rows = c.chunk_rows;
  const IndexView t = in.target();
  Buffer loss(dev, 4 * N), stats(dev, sizeof(DistillRowStats) * N), gb(dev, 4 * N);
  loss.poison();
  stats.poison();
  std::memcpy(gb.host(), g.data(), 4 * N);
  gb.upload();
  Buffer dh(dev, 4 * N * Hs), dw(dev, 4 * V * Hs);
  const MatrixView vdh{dh.data(), N, Hs, Hs, DType::F32, dev}, vdw{dw.data(), V, Hs, Hs, DType::F32, dev};
  // the logits' gradient is stored in the student's dtype before the GEMMs read it
  const double tol = c.student == DType::F32 ? 1e-4 : 2e-2;
  auto expect_grads = [&](const std::vector<double>& want_h, const std::vector<double>& want_w) {
    dh.download();
    dw.download();
    const float* h = dh.host_as<float>();
    const float* w = dw.host_as<float>();
    EXPECT_LE(rel_l2(std::vector<double>(h, h + N * Hs), want_h), tol);
    EXPECT_LE(rel_l2(std::vector<double>(w, w + V * Hs), want_w), tol);
  };
  auto expect_losses = [&] {
    loss.download();
    for (int64_t r = 0; r < N; ++r)
      EXPECT_NEAR(loss.host_as<float>()[r], want_loss[r], 3e-5 * (1 + std::abs(want_loss[r])))
          << "row " << r;
  };

  if (!c.shards) {
    linear_distillation_forward(in.sh, in.sw, in.th, in.tw, t, o, loss.data_as<float>(),
                                stats.data_as<DistillRowStats>());
    expect_losses();
    dh.poison();
    dw.poison();
    linear_distillation_backward(in.sh, in.sw, in.th, in.tw, t, stats.data_as<DistillRowStats>(),
                                 gb.data_as<float>(), o, {vdh, vdw, false});
    expect_grads(want_dh, want_dw);
    // the in-forward gradients: those of sum(loss), in the forward's one pass
    dh.poison();
    dw.poison();
    loss.poison();
    linear_distillation_forward(in.sh, in.sw, in.th, in.tw, t, o, loss.data_as<float>(),
                                stats.data_as<DistillRowStats>(), nullptr,
                                {{vdh, vdw, false}, c.in_forward_g ? gb.data_as<float>() : nullptr});
    expect_losses();
    if (c.in_forward_g)
      expect_grads(want_dh, want_dw);
    else
      expect_grads(unit_dh, unit_dw);
    return;
  }
  // Vocab-parallel in one process: three shards of the vocabulary, each's partials, the merge
  // (the all-gather's layout: shard-major), jsd's sums added over the shards; then each shard's
  // backward writes its rows of dweight and a partial dhidden, which add up.
  const int64_t starts[] = {0, 11, 20, V};
  constexpr int kWorld = 3;
  Buffer partials(dev, sizeof(DistillPartial) * N * kWorld), sums(dev, 8 * N);
  partials.poison();
  o.vocab_global = V;
  auto shard = [&](const MatrixView& m, int k) {
    MatrixView v = m;
    v.data = static_cast<char*>(m.data) + starts[k] * m.row_stride * element_bytes(m.dtype);
    v.rows = starts[k + 1] - starts[k];
    return v;
  };
  for (int k = 0; k < kWorld; ++k) {
    o.vocab_start = starts[k];
    linear_distillation_local_partials(in.sh, shard(in.sw, k), in.th, shard(in.tw, k), t, o,
                                       partials.data_as<DistillPartial>() + k * N);
  }
  distill_merge(partials.data_as<DistillPartial>(), kWorld, N, t, o,
                stats.data_as<DistillRowStats>(), loss.data_as<float>(), dev);
  if (c.divergence == Divergence::JSD) {
    std::vector<float> total(2 * N, 0.0f);
    for (int k = 0; k < kWorld; ++k) {
      o.vocab_start = starts[k];
      sums.poison();
      linear_distillation_jsd_sums(in.sh, shard(in.sw, k), in.th, shard(in.tw, k), o,
                                   stats.data_as<DistillRowStats>(), sums.data_as<float>());
      sums.download();
      for (int64_t i = 0; i < 2 * N; ++i) total[i] += sums.host_as<float>()[i];
    }
    std::memcpy(sums.host(), total.data(), 8 * N);
    sums.upload();
    distill_add_jsd(sums.data_as<float>(), N, t, o, stats.data_as<DistillRowStats>(),
                    loss.data_as<float>(), dev);
  }
  expect_losses();
  std::vector<double> got_dh(N * Hs, 0.0), got_dw(V * Hs, 0.0);
  Buffer part_dh(dev, 4 * N * Hs);
  for (int k = 0; k < kWorld; ++k) {
    o.vocab_start = starts[k];
    part_dh.poison();
    const int64_t rows = starts[k + 1] - starts[k];
    linear_distillation_backward(
        in.sh, shard(in.sw, k), in.th, shard(in.tw, k), t, stats.data_as<DistillRowStats>(),
        gb.data_as<float>(), o,
        {{part_dh.data(), N, Hs, Hs, DType::F32, dev}, shard(vdw, k), false});
    part_dh.download();
    dw.download();
    for (int64_t i = 0; i < N * Hs; ++i) got_dh[i] += part_dh.host_as<float>()[i];
    for (int64_t i = starts[k] * Hs; i < starts[k] * Hs + rows * Hs; ++i)
      got_dw[i] = dw.host_as<float>()[i];
  }
  EXPECT_LE(rel_l2(got_dh, want_dh), tol);
  EXPECT_LE(rel_l2(got_dw, want_dw), tol);
}

class LinearDistillation : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { FL_SKIP_UNLESS_BACKEND(GetParam()); }
};

TEST_P(LinearDistillation, EveryDivergenceAgainstFloat64) {
  for (Divergence d : {Divergence::ForwardKL, Divergence::ReverseKL, Divergence::JSD})
    for (float temperature : {1.0f, 2.5f}) {
      Case c;
      c.divergence = d;
      c.temperature = temperature;
      c.beta = 0.3f;
      check(GetParam(), c);
    }
}

TEST_P(LinearDistillation, HardLabelsIgnoredRowsAndNoTarget) {
  for (Divergence d : {Divergence::ForwardKL, Divergence::JSD}) {
    Case c;
    c.divergence = d;
    c.hard = 0.4f;
    c.temperature = 2.0f;
    check(GetParam(), c);
    c.hard = 0.0f;
    c.with_target = false;
    check(GetParam(), c);
  }
}

TEST_P(LinearDistillation, ChunksDtypesAndAnotherTeacher) {
  for (int64_t chunk : {int64_t(1), int64_t(5)}) {
    Case c;
    c.divergence = Divergence::ReverseKL;
    c.chunk_rows = chunk;
    check(GetParam(), c);
  }
  // The teacher's logits in slices of 2 rows under chunks of 5 (a short last slice), and in
  // slices of 3 under the default workspace's one chunk of every row (in-forward).
  for (const char* rows : {"2", "3"}) {
    const ScopedEnv env("FUSEDLOSS_DISTILL_TEACHER_ROWS", rows);
    for (Divergence d : {Divergence::ForwardKL, Divergence::JSD}) {
      Case c;
      c.divergence = d;
      c.hard = 0.25f;
      c.chunk_rows = rows[0] == '2' ? 5 : 0;
      c.in_forward_g = rows[0] == '3';
      check(GetParam(), c);
    }
  }
  Case c;
  c.student = DType::BF16;
  c.teacher = DType::F32;
  c.hard = 0.25f;
  check(GetParam(), c);
  c.student = DType::F32;
  c.teacher = DType::BF16;
  c.divergence = Divergence::JSD;
  c.in_forward_g = true;
  check(GetParam(), c);
}

TEST(LinearDistillationArguments, BadInputs) {
  std::vector<float> h(4 * 3, 0.5f), w(5 * 3, 0.25f), loss(4);
  std::vector<DistillRowStats> stats(4);
  std::vector<int64_t> target{0, 1, 7, 2};
  const MatrixView vh{h.data(), 4, 3, 3, DType::F32, Device::CPU};
  const MatrixView vw{w.data(), 5, 3, 3, DType::F32, Device::CPU};
  const IndexView t{target.data(), 4, IndexType::I64, Device::CPU};
  auto forward = [&](const LinearDistillationOptions& o, const IndexView& tt) {
    linear_distillation_forward(vh, vw, vh, vw, tt, o, loss.data(), stats.data());
  };
  LinearDistillationOptions o;
  expect_error([&] { forward(o, t); }, "target[2]: got 7", "");
  target[2] = 3;
  o.temperature = -1.0f;
  expect_error([&] { forward(o, t); }, "options.temperature: got -1", "expected a finite value > 0");
  o = {};
  o.divergence = Divergence::JSD;
  o.beta = 1.0f;
  expect_error([&] { forward(o, t); }, "options.beta: got 1", "expected a value in (0, 1)");
  o = {};
  o.hard_label_weight = 0.5f;
  expect_error([&] { forward(o, IndexView{nullptr, 4, IndexType::I64, Device::CPU}); },
               "options.hard_label_weight: got 0.5 without a target", "expected 0");
  o = {};
  const MatrixView other{w.data(), 4, 3, 3, DType::F32, Device::CPU};
  expect_error([&] { linear_distillation_forward(vh, vw, vh, other, t, o, loss.data(), stats.data()); },
               "teacher_weight.rows: got 4", "expected 5");
  o.vocab_global = 12;
  o.vocab_start = 8;
  expect_error([&] { forward(o, t); }, "options.vocab_start: got 8 with V_local 5",
               "within [0, vocab_global)");
  o.vocab_start = 5;
  expect_error([&] { forward(o, t); }, "options.vocab_global: got 12 with V_local 5",
               "expected one shard");
  o = {};
  std::vector<float> sums(8);
  expect_error([&] {
    linear_distillation_jsd_sums(vh, vw, vh, vw, o, stats.data(), sums.data());
  }, "options.divergence: got 0", "expected JSD (2)");
  // the steps after the all-gather check the options they read, and the in-forward arguments
  std::vector<DistillPartial> partials(4);
  o.vocab_global = 5;
  o.divergence = Divergence(7);
  expect_error([&] { distill_merge(partials.data(), 1, 4, t, o, stats.data(), loss.data(), Device::CPU); },
               "options.divergence: got 7", "expected ForwardKL (0)");
  o.divergence = Divergence::ForwardKL;
  expect_error([&] { distill_add_jsd(sums.data(), 4, t, o, stats.data(), loss.data(), Device::CPU); },
               "options.divergence: got 0", "expected JSD (2)");
  o = {};
  DistillInForward in;
  in.grad_loss = sums.data();
  expect_error([&] {
    linear_distillation_forward(vh, vw, vh, vw, t, o, loss.data(), stats.data(), nullptr, in);
  }, "in_forward.grad_loss: got a pointer without in_forward.grads", "expected null");
}

TEST_P(LinearDistillation, VocabShardsMergeToTheWholeVocabulary) {
  for (Divergence d : {Divergence::ForwardKL, Divergence::ReverseKL, Divergence::JSD}) {
    Case c;
    c.divergence = d;
    c.shards = true;
    c.temperature = 1.7f;
    c.hard = d == Divergence::ReverseKL ? 0.0f : 0.3f;
    c.chunk_rows = 7;
    check(GetParam(), c);
  }
  Case c;
  c.shards = true;
  c.with_target = false;
  c.student = DType::BF16;
  check(GetParam(), c);
}

// The one-pass KL of a 128256-class row whose teacher's logits are the student's plus an offset
// (the softmax ignores it) and small noise, summed as the CUDA kernel sums it (256 threads'
// strided parts, combined in a tree) and as two vocabulary shards: against float64, to a few
// 1e-7 whatever the offset. A cross term relative to one max alone lost 1e-5 at offset 20.
TEST(LinearDistillationMath, OneRowKlIsExactUnderAnOffsetBetweenTheModels) {
  constexpr int64_t kV = 128256, kThreads = 256;
  std::normal_distribution<float> normal;
  std::vector<float> s(kV), t(kV);
  for (float offset : {0.0f, 20.0f, 50.0f}) {
    for (int64_t j = 0; j < kV; ++j) {
      s[j] = 2.0f * normal(rng());
      t[j] = s[j] + offset + 0.01f * normal(rng());
    }
    for (Divergence d : {Divergence::ForwardKL, Divergence::ReverseKL}) {
      const core::DistillParams p{d, 0.5f, 1.0f, 0.0f};
      std::vector<core::DistillPartial> parts(kThreads, core::distill_empty());
      for (int64_t j = 0; j < kV; ++j) core::distill_add(p, parts[j % kThreads], s[j], t[j]);
      for (int64_t w = kThreads / 2; w >= 1; w /= 2)  // a tree, as the block reduction
        for (int64_t i = 0; i < w; ++i) parts[i] = core::distill_combine(p, parts[i], parts[i + w]);
      // float64: KL from the log-softmaxes
      auto lsm = [](const std::vector<float>& x) {
        double m = -INFINITY, z = 0;
        for (float v : x) m = std::max(m, double(v));
        for (float v : x) z += std::exp(double(v) - m);
        std::vector<double> out(x.size());
        for (size_t j = 0; j < x.size(); ++j) out[j] = double(x[j]) - m - std::log(z);
        return out;
      };
      const auto lq = lsm(s), lp = lsm(t);
      double want = 0;
      for (int64_t j = 0; j < kV; ++j)
        want += d == Divergence::ForwardKL ? std::exp(lp[j]) * (lp[j] - lq[j])
                                           : std::exp(lq[j]) * (lq[j] - lp[j]);
      const DistillRowStats got = core::distill_row_stats(p, parts[0]);
      EXPECT_NEAR(got.soft, want, 1e-6) << "offset " << offset << " divergence " << int(d);
      EXPECT_GT(want, 1e-5);  // the divergence itself, not 0: the check is relative to it
    }
  }
}

// Rows that span several blocks (a thread-block cluster's slices on sm_90) with a tail of less
// than one 8-element unit: the CUDA backend against the CPU backend, which the tests above hold
// to float64, for every divergence, with and without the hard-label term, an ignored row and
// three dtype pairs; the in-forward gradients and the forward + backward; the one-block-a-row
// kernels and (FUSEDLOSS_DISTILL_CLUSTERS=1) the cluster kernel. Needs a GPU: the CPU
// backend's own long-row math is in the tests above and the property tests.
TEST(LinearDistillationLongRows, CudaMatchesTheCpuBackend) {
  FL_SKIP_UNLESS_BACKEND(Device::CUDA);
  constexpr int64_t n = 5, h = 8, v = 40003;
  for (auto [ds, dt] : {std::pair{DType::BF16, DType::BF16}, {DType::BF16, DType::F32},
                        {DType::F32, DType::F32}})
    for (Divergence d : {Divergence::ForwardKL, Divergence::ReverseKL, Divergence::JSD})
      for (float hard : {0.0f, 0.3f}) {
        SCOPED_TRACE(::testing::Message() << to_string(ds) << "/" << to_string(dt) << " divergence "
                                          << int(d) << " hard " << hard);
        const auto sh = random(ds, n * h, 1.0f), sw = random(ds, v * h, 0.6f);
        const auto th = random(dt, n * h, 1.0f), tw = random(dt, v * h, 0.6f);
        std::vector<int64_t> target(n);
        std::uniform_int_distribution<int64_t> cls(0, v - 1);
        for (int64_t r = 0; r < n; ++r) target[r] = r == 2 ? -100 : cls(rng());
        target[3] = v - 1;  // the tail's last column
        LinearDistillationOptions o;
        o.divergence = d;
        o.beta = 0.4f;
        o.temperature = 1.5f;
        o.hard_label_weight = hard;
        struct Out {
          std::vector<float> loss;
          std::vector<double> dh, dw;
        };
        auto run = [&](Device dev, bool in_forward) {
          auto upload = [&](const std::vector<float>& x, DType dt_) {
            auto b = std::make_unique<Buffer>(dev, x.size() * size_t(element_bytes(dt_)));
            for (size_t i = 0; i < x.size(); ++i) store_as(dt_, b->host(), int64_t(i), x[i]);
            b->upload();
            return b;
          };
          auto bsh = upload(sh, ds), bsw = upload(sw, ds), bth = upload(th, dt), btw = upload(tw, dt);
          Buffer bt(dev, 8 * n), loss(dev, 4 * n), stats(dev, sizeof(DistillRowStats) * n),
              ones(dev, 4 * n), dh(dev, 4 * n * h), dw(dev, 4 * v * h);
          std::memcpy(bt.host(), target.data(), 8 * n);
          bt.upload();
          for (int64_t r = 0; r < n; ++r) ones.host_as<float>()[r] = 1.0f;
          ones.upload();
          loss.poison(), stats.poison(), dh.poison(), dw.poison();
          const MatrixView msh{bsh->data(), n, h, h, ds, dev}, msw{bsw->data(), v, h, h, ds, dev},
              mth{bth->data(), n, h, h, dt, dev}, mtw{btw->data(), v, h, h, dt, dev};
          const IndexView t{bt.data(), n, IndexType::I64, dev};
          const LinearCrossEntropyGrads grads{{dh.data(), n, h, h, DType::F32, dev},
                                              {dw.data(), v, h, h, DType::F32, dev}, false};
          if (in_forward) {
            linear_distillation_forward(msh, msw, mth, mtw, t, o, loss.data_as<float>(),
                                        stats.data_as<DistillRowStats>(), nullptr, {grads, nullptr});
          } else {
            linear_distillation_forward(msh, msw, mth, mtw, t, o, loss.data_as<float>(),
                                        stats.data_as<DistillRowStats>());
            linear_distillation_backward(msh, msw, mth, mtw, t, stats.data_as<DistillRowStats>(),
                                         ones.data_as<float>(), o, grads);
          }
          loss.download(), dh.download(), dw.download();
          Out out;
          out.loss.assign(loss.host_as<float>(), loss.host_as<float>() + n);
          out.dh.assign(dh.host_as<float>(), dh.host_as<float>() + n * h);
          out.dw.assign(dw.host_as<float>(), dw.host_as<float>() + v * h);
          return out;
        };
        // bf16 logits: one GEMM's rounding against another's (a unit in the last place of some
        // logits), and the gradient stored in bf16 before the GEMMs read it
        const bool bf16 = ds == DType::BF16 || dt == DType::BF16;
        const double loss_tol = bf16 ? 3e-3 : 2e-5, grad_tol = bf16 ? 2e-2 : 1e-4;
        const Out want = run(Device::CPU, false);
        for (const char* clusters : {"0", "1"})
        for (bool in_forward : {false, true}) {
          SCOPED_TRACE(::testing::Message() << (in_forward ? "in-forward gradients" : "forward + backward")
                                            << ", FUSEDLOSS_DISTILL_CLUSTERS=" << clusters);
          const ScopedEnv env("FUSEDLOSS_DISTILL_CLUSTERS", clusters);
          const Out got = run(Device::CUDA, in_forward);
          for (int64_t r = 0; r < n; ++r)
            EXPECT_NEAR(got.loss[r], want.loss[r], loss_tol * (1 + std::abs(want.loss[r])))
                << "row " << r;
          EXPECT_EQ(got.loss[2], 0.0f) << "the ignored row";
          EXPECT_LE(rel_l2(got.dh, want.dh), grad_tol);
          EXPECT_LE(rel_l2(got.dw, want.dw), grad_tol);
        }
      }
}

INSTANTIATE_TEST_SUITE_P(Backends, LinearDistillation, ::testing::Values(Device::CPU, Device::CUDA),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace fusedloss::test

// The linear distillation loss on the CPU backend against float64: every divergence at two
// temperatures, the hard-label term, ignored rows, no target, chunk boundaries, a teacher of
// another hidden size and dtype, both student dtypes; bad options; CUDA refused by name. The
// reference's gradient is the central difference of its own loss (float64), not the formula the
// library uses.
#include <cmath>
#include <functional>
#include <vector>
#include "common/test_util.h"
#include "fusedloss/linear_distillation.h"

namespace fusedloss::test {
namespace {

struct Case {
  Divergence divergence = Divergence::ForwardKL;
  float beta = 0.5f, temperature = 1.0f, hard = 0.0f;
  bool with_target = true;
  DType student = DType::F32, teacher = DType::F32;
  int64_t chunk_rows = 0;
};

constexpr int64_t N = 23, Hs = 12, Ht = 17, V = 31;

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

void check(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "divergence " << int(c.divergence) << " T " << c.temperature
                                    << " hard " << c.hard << " target " << c.with_target
                                    << " dtypes " << to_string(c.student) << "/"
                                    << to_string(c.teacher) << " chunk " << c.chunk_rows);
  const Device dev = Device::CPU;
  auto sh = random(c.student, N * Hs, 1.0f), sw = random(c.student, V * Hs, 0.6f);
  auto th = random(c.teacher, N * Ht, 1.0f), tw = random(c.teacher, V * Ht, 0.6f);
  std::vector<int64_t> target(N);
  std::uniform_int_distribution<int64_t> cls(0, V - 1);
  for (int64_t r = 0; r < N; ++r) target[r] = r % 6 == 4 && c.with_target ? -100 : cls(rng());
  std::vector<float> g = random(DType::F32, N, 1.0f);
  const auto xs = logits(sh, sw, Hs, c.student), xt = logits(th, tw, Ht, c.teacher);

  // float64: losses, and dloss/dx by central differences of each row's loss
  std::vector<double> want_loss(N, 0.0), dx(N * V, 0.0);
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
      dx[r * V + j] = g[r] * (up - down) / (2 * e);
    }
  }
  std::vector<double> want_dh(N * Hs, 0.0), want_dw(V * Hs, 0.0);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < V; ++j)
      for (int64_t k = 0; k < Hs; ++k) {
        want_dh[r * Hs + k] += dx[r * V + j] * sw[j * Hs + k];
        want_dw[j * Hs + k] += dx[r * V + j] * sh[r * Hs + k];
      }

  auto buffer_of = [&](const std::vector<float>& v, DType d) {
    std::vector<uint16_t> raw(v.size() * (d == DType::F32 ? 2 : 1));
    for (size_t i = 0; i < v.size(); ++i) store_as(d, raw.data(), int64_t(i), v[i]);
    return raw;
  };
  auto bsh = buffer_of(sh, c.student), bsw = buffer_of(sw, c.student);
  auto bth = buffer_of(th, c.teacher), btw = buffer_of(tw, c.teacher);
  const MatrixView vsh{bsh.data(), N, Hs, Hs, c.student, dev}, vsw{bsw.data(), V, Hs, Hs, c.student, dev};
  const MatrixView vth{bth.data(), N, Ht, Ht, c.teacher, dev}, vtw{btw.data(), V, Ht, Ht, c.teacher, dev};
  const IndexView t = c.with_target ? IndexView{target.data(), N, IndexType::I64, dev}
                                    : IndexView{nullptr, N, IndexType::I64, dev};
  LinearDistillationOptions o;
  o.divergence = c.divergence;
  o.beta = c.beta;
  o.temperature = c.temperature;
  o.hard_label_weight = c.hard;
  o.chunk_rows = c.chunk_rows;
  std::vector<float> loss(N, NAN);
  std::vector<DistillRowStats> stats(N);
  linear_distillation_forward(vsh, vsw, vth, vtw, t, o, loss.data(), stats.data());
  for (int64_t r = 0; r < N; ++r)
    EXPECT_NEAR(loss[r], want_loss[r], 3e-5 * (1 + std::abs(want_loss[r]))) << "row " << r;

  std::vector<float> dh(N * Hs, NAN), dw(V * Hs, NAN);
  linear_distillation_backward(vsh, vsw, vth, vtw, t, stats.data(), g.data(), o,
                               {{dh.data(), N, Hs, Hs, DType::F32, dev},
                                {dw.data(), V, Hs, Hs, DType::F32, dev}, false});
  // the logits' gradient is stored in the student's dtype before the GEMMs read it
  const double tol = c.student == DType::F32 ? 1e-4 : 2e-2;
  EXPECT_LE(rel_l2(std::vector<double>(dh.begin(), dh.end()), want_dh), tol);
  EXPECT_LE(rel_l2(std::vector<double>(dw.begin(), dw.end()), want_dw), tol);
}

TEST(LinearDistillation, EveryDivergenceAgainstFloat64) {
  for (Divergence d : {Divergence::ForwardKL, Divergence::ReverseKL, Divergence::JSD})
    for (float temperature : {1.0f, 2.5f}) {
      Case c;
      c.divergence = d;
      c.temperature = temperature;
      c.beta = 0.3f;
      check(c);
    }
}

TEST(LinearDistillation, HardLabelsIgnoredRowsAndNoTarget) {
  for (Divergence d : {Divergence::ForwardKL, Divergence::JSD}) {
    Case c;
    c.divergence = d;
    c.hard = 0.4f;
    c.temperature = 2.0f;
    check(c);
    c.hard = 0.0f;
    c.with_target = false;
    check(c);
  }
}

TEST(LinearDistillation, ChunksDtypesAndAnotherTeacher) {
  for (int64_t chunk : {int64_t(1), int64_t(5)}) {
    Case c;
    c.divergence = Divergence::ReverseKL;
    c.chunk_rows = chunk;
    check(c);
  }
  Case c;
  c.student = DType::BF16;
  c.teacher = DType::F32;
  c.hard = 0.25f;
  check(c);
  c.student = DType::F32;
  c.teacher = DType::BF16;
  c.divergence = Divergence::JSD;
  check(c);
}

TEST(LinearDistillation, BadInputs) {
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
  const MatrixView cuda_h{h.data(), 4, 3, 3, DType::F32, Device::CUDA};
  const MatrixView cuda_w{w.data(), 5, 3, 3, DType::F32, Device::CUDA};
  expect_error([&] {
    linear_distillation_forward(cuda_h, cuda_w, cuda_h, cuda_w,
                                IndexView{nullptr, 4, IndexType::I64, Device::CUDA}, o, loss.data(),
                                stats.data());
  }, "student_hidden.device: got cuda", "expected cpu");
}

}  // namespace
}  // namespace fusedloss::test

// Runs one cross-entropy configuration (forward + backward) on a backend and checks it
// against the float64 reference: losses, lse, gradients, untouched padding.
#pragma once
#include <algorithm>
#include <sstream>
#include <string>

#include "common/reference.h"
#include "common/test_util.h"
#include "fusedloss/cross_entropy.h"

namespace fusedloss::test {

struct CeCase {
  int64_t rows = 16;
  int64_t V = 1000;
  int64_t pad = 0;  // row_stride = V + pad
  int64_t base_offset = 0;  // elements between the allocation and the first logit (alignment)
  int64_t grad_offset = -1;  // a separate gradient's offset in its own allocation (-1: base_offset)
  DType dtype = DType::F32;
  IndexType itype = IndexType::I64;
  CrossEntropyOptions opt{};
  bool in_place = false;
  double ignore_fraction = 0.0;
  float scale = 3.0f;  // logits ~ N(shift, scale)
  float shift = 0.0f;
  // Sum/Mean: cross_entropy_forward_with_grad, then cross_entropy_scale_grad by the upstream
  // gradient, in place of forward + backward.
  bool grad_in_forward = false;
  float upstream = 0.0f;  // the upstream gradient; 0: random (per row for None)

  std::string describe() const {
    std::ostringstream os;
    os << "rows=" << rows << " V=" << V << " pad=" << pad << " offset=" << base_offset
       << " dtype=" << to_string(dtype) << " target=" << to_string(itype)
       << " ls=" << opt.label_smoothing
       << (opt.smoothing_formula == SmoothingFormula::Megatron ? "(megatron)" : "(pytorch)")
       << " z=" << opt.z_loss << " softcap=" << opt.logit_softcap << " reduction=" << int(opt.reduction)
       << " ignore=" << ignore_fraction << (in_place ? " in-place" : " out-of-place")
       << (grad_in_forward ? " grad-in-forward" : "") << " upstream=" << upstream;
    return os.str();
  }
};

struct CeRun {
  std::vector<double> x;       // logits as stored, [rows, V] dense
  std::vector<int64_t> target;
  std::vector<float> loss, lse, grad;  // library outputs (grad dense [rows, V])
  float valid_count = 0;
  std::vector<double> grad_weight;
  bool padding_intact = true;
  bool scale_kept_bits = true;  // grad_in_forward with a unit upstream gradient
};

// A dense fp32 problem: logits [rows, V] ~ N(0, sigma), targets uniform in [0, V) (callers
// mark ignored rows themselves).
struct DenseProblem {
  int64_t rows, V;
  std::vector<float> x;
  std::vector<int64_t> target;
};

template <class Gen>
DenseProblem random_problem(int64_t rows, int64_t V, float sigma, Gen& gen) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::uniform_int_distribution<int64_t> cls(0, V - 1);
  DenseProblem p{rows, V, std::vector<float>(rows * V), std::vector<int64_t>(rows)};
  for (auto& v : p.x) v = normal(gen);
  for (auto& t : p.target) t = cls(gen);
  return p;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

inline CeRun run_case(Device device, const CeCase& c) {
  CeRun out;
  const int64_t stride = c.V + c.pad, es = dtype_size(c.dtype);
  const int64_t elems = c.base_offset + (c.rows > 0 ? (c.rows - 1) * stride + c.V + c.pad : 0);
  Buffer logits(device, size_t(std::max<int64_t>(elems, 1) * es));
  std::normal_distribution<float> normal(c.shift, c.scale);
  // stay inside the dtype's finite range (bf16's top is 3.39e38)
  const float limit = c.dtype == DType::F16 ? 6e4f : c.dtype == DType::BF16 ? 3.38e38f : 3.4e38f;
  for (int64_t i = 0; i < elems; ++i)
    store_as(c.dtype, logits.host(), i, std::clamp(normal(rng()), -limit, limit));
  out.x.resize(c.rows * c.V);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t j = 0; j < c.V; ++j)
      out.x[r * c.V + j] = load_as(c.dtype, logits.host(), c.base_offset + r * stride + j);
  std::vector<unsigned char> original(static_cast<unsigned char*>(logits.host()),
                                      static_cast<unsigned char*>(logits.host()) + logits.bytes());
  logits.upload();

  const int64_t isz = c.itype == IndexType::I32 ? 4 : 8;
  Buffer target(device, size_t(std::max<int64_t>(c.rows, 1) * isz));
  std::uniform_int_distribution<int64_t> cls(0, c.V - 1);
  std::uniform_real_distribution<double> u01(0, 1);
  out.target.resize(c.rows);
  for (int64_t r = 0; r < c.rows; ++r) {
    int64_t t = u01(rng()) < c.ignore_fraction ? c.opt.ignore_index : cls(rng());
    out.target[r] = t;
    if (isz == 4) target.host_as<int32_t>()[r] = int32_t(t);
    else target.host_as<int64_t>()[r] = t;
  }
  target.upload();

  const bool none = c.opt.reduction == Reduction::None;
  const int64_t nloss = none ? c.rows : 1;
  Buffer loss(device, sizeof(float) * std::max<int64_t>(nloss, 1)), lse(device, sizeof(float) * std::max<int64_t>(c.rows, 1)),
      count(device, sizeof(float));
  loss.poison(); lse.poison(); count.poison();

  char* base = static_cast<char*>(logits.data()) + c.base_offset * es;
  MatrixView xv{base, c.rows, c.V, stride, c.dtype, device};
  IndexView tv{target.data(), c.rows, c.itype, device};
  CrossEntropyOutputs outs{loss.data_as<float>(), lse.data_as<float>(), count.data_as<float>()};
  const int64_t goff = c.grad_offset >= 0 ? c.grad_offset : c.base_offset;
  Buffer separate(device, c.in_place ? 1 : logits.bytes() + size_t(goff * es));
  if (!c.in_place) separate.poison();
  char* gbase = c.in_place ? base : static_cast<char*>(separate.data()) + goff * es;
  MatrixView gv{gbase, c.rows, c.V, stride, c.dtype, device};
  if (c.grad_in_forward)
    cross_entropy_forward_with_grad(xv, tv, c.opt, outs, gv);
  else
    cross_entropy_forward(xv, tv, c.opt, outs);
  check_device_errors();
  loss.download(); lse.download(); count.download();
  out.loss.assign(loss.host_as<float>(), loss.host_as<float>() + nloss);
  out.lse.assign(lse.host_as<float>(), lse.host_as<float>() + c.rows);
  out.valid_count = count.host_as<float>()[0];

  // Upstream gradient: a random vector for None, a random scalar otherwise.
  Buffer gl(device, sizeof(float) * std::max<int64_t>(nloss, 1));
  std::uniform_real_distribution<float> gdist(0.5f, 2.0f);
  for (int64_t i = 0; i < nloss; ++i) gl.host_as<float>()[i] = c.upstream ? c.upstream : gdist(rng());
  gl.upload();
  int64_t valid = 0;
  for (auto t : out.target) valid += t != c.opt.ignore_index;
  out.grad_weight.resize(c.rows);
  for (int64_t r = 0; r < c.rows; ++r) {
    double g = none ? gl.host_as<float>()[r] : gl.host_as<float>()[0];
    if (c.opt.reduction == Reduction::Mean) g /= std::max<int64_t>(valid, 1);
    out.grad_weight[r] = g;
  }

  Buffer& gbuf = c.in_place ? logits : separate;
  std::vector<unsigned char> unscaled;
  if (c.grad_in_forward) {
    gbuf.download();
    unscaled.assign(static_cast<unsigned char*>(gbuf.host()),
                    static_cast<unsigned char*>(gbuf.host()) + gbuf.bytes());
    cross_entropy_scale_grad(gv, gl.data_as<float>());
  } else {
    cross_entropy_backward(xv, tv, lse.data_as<float>(), gl.data_as<float>(),
                           count.data_as<float>(), c.opt, gv);
  }
  check_device_errors();
  gbuf.download();
  // A unit upstream gradient leaves the forward's gradient as it was, bit for bit.
  if (c.grad_in_forward && c.upstream == 1.0f)
    out.scale_kept_bits = std::equal(unscaled.begin(), unscaled.end(),
                                     static_cast<unsigned char*>(gbuf.host()));
  out.grad.resize(c.rows * c.V);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t j = 0; j < c.V; ++j)
      out.grad[r * c.V + j] =
          load_as(c.dtype, gbuf.host(), (c.in_place ? c.base_offset : goff) + r * stride + j);
  // In place, the padding columns and the bytes before the first row must be untouched.
  if (c.in_place) {
    const auto* now = static_cast<const unsigned char*>(logits.host());
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t j = c.V; j < stride; ++j)
        for (int64_t b = 0; b < es; ++b) {
          int64_t at = (c.base_offset + r * stride + j) * es + b;
          out.padding_intact &= now[at] == original[at];
        }
    for (int64_t b = 0; b < c.base_offset * es; ++b) out.padding_intact &= now[b] == original[b];
  }
  return out;
}

inline RefResult reference_for(const CeCase& c, const CeRun& run) {
  RefOptions o;
  o.ignore_index = c.opt.ignore_index;
  o.label_smoothing = c.opt.label_smoothing;
  o.megatron_formula = c.opt.smoothing_formula == SmoothingFormula::Megatron;
  o.z_loss = c.opt.z_loss;
  const double cap = c.opt.logit_softcap;
  if (cap <= 0) return reference_cross_entropy(run.x, c.rows, c.V, run.target, o, run.grad_weight);
  // the loss of the capped logits z = c tanh(x / c); dz/dx = 1 - (z / c)^2
  std::vector<double> z(run.x.size());
  for (size_t i = 0; i < z.size(); ++i) z[i] = cap * std::tanh(run.x[i] / cap);
  RefResult ref = reference_cross_entropy(z, c.rows, c.V, run.target, o, run.grad_weight);
  for (size_t i = 0; i < z.size(); ++i) ref.grad[i] *= 1.0 - (z[i] / cap) * (z[i] / cap);
  return ref;
}

// The whole check of one case.
inline void expect_matches_reference(Device device, const CeCase& c) {
  SCOPED_TRACE(c.describe());
  CeRun run = run_case(device, c);
  RefResult ref = reference_for(c, run);
  // Losses
  double total = 0;
  for (int64_t r = 0; r < c.rows; ++r)
    if (run.target[r] != c.opt.ignore_index) total += ref.loss[r];
  if (c.opt.reduction == Reduction::None) {
    EXPECT_LE(rel_l2(to_double(run.loss), ref.loss), kLossTolerance);
  } else {
    double expect = c.opt.reduction == Reduction::Sum ? total : (ref.valid ? total / ref.valid : 0.0);
    ASSERT_TRUE(std::isfinite(run.loss[0])) << "reduced loss " << run.loss[0];
    EXPECT_NEAR(run.loss[0], expect, kLossTolerance * (std::fabs(expect) + 1e-3));
  }
  EXPECT_EQ(run.valid_count, float(ref.valid));
  EXPECT_LE(rel_l2(to_double(run.lse), ref.lse), kLossTolerance);
  // Gradients
  double tol = grad_tolerance(c.dtype);
  EXPECT_LE(rel_l2(to_double(run.grad), ref.grad), tol);
  double gmax = 0;
  for (double g : ref.grad) gmax = std::max(gmax, std::fabs(g));
  double worst = 0;
  for (size_t i = 0; i < ref.grad.size(); ++i) worst = std::max(worst, std::fabs(run.grad[i] - ref.grad[i]));
  EXPECT_LE(worst, tol * gmax + 1e-7) << "max |grad - ref|";
  // Ignored rows: exactly zero gradient and loss.
  for (int64_t r = 0; r < c.rows; ++r) {
    if (run.target[r] != c.opt.ignore_index) continue;
    for (int64_t j = 0; j < c.V; ++j) ASSERT_EQ(run.grad[r * c.V + j], 0.0f) << "ignored row " << r;
    if (c.opt.reduction == Reduction::None) ASSERT_EQ(run.loss[r], 0.0f);
  }
  EXPECT_TRUE(run.padding_intact) << "in-place backward wrote outside the [rows, V] view";
  EXPECT_TRUE(run.scale_kept_bits) << "a unit upstream gradient changed the forward's gradient";
}

}  // namespace fusedloss::test

// SwiGLU on every backend against a float64 reference written from the definitions, with
// fresh random inputs and poisoned outputs; every Megatron variant, layouts and bad inputs.
#include <optional>

#include "common/test_util.h"
#include "core/swiglu_math.h"
#include "fusedloss/swiglu.h"

namespace fusedloss::test {
namespace {

struct SwCase {
  int64_t rows = 33, n = 96, pad = 0, offset = 0;
  DType dtype = DType::F32;
  bool bias = false, weights = false, fp8 = false, in_place = false;
  bool bias_f32 = false;  // an fp32 bias with a 16-bit y
  std::optional<float> clamp;
  // Clamp settings, and whether a third of the gate and up values sit exactly on +-clamp.
  bool gate_grad_at_bound = false, up_grad_at_bound = false, on_bound = false;
  float gate_multiplier = 1.0f, down_multiplier = 1.0f;  // Falcon-H1's
  std::string describe() const {
    std::ostringstream os;
    os << "rows=" << rows << " n=" << n << " pad=" << pad << " offset=" << offset << " dtype="
       << to_string(dtype) << (bias ? " bias" : "") << (weights ? " weights" : "")
       << (fp8 ? " fp8-store" : "") << (in_place ? " in-place" : "")
       << (bias_f32 ? " bias-fp32" : "") << (clamp ? " clamp=" + std::to_string(*clamp) : "")
       << (gate_grad_at_bound ? " gate-grad-at-bound" : "")
       << (up_grad_at_bound ? " up-grad-at-bound" : "") << (on_bound ? " on-bound" : "")
       << " gate_multiplier=" << gate_multiplier << " down_multiplier=" << down_multiplier;
    return os.str();
  }
};

double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Megatron's math in float64, with Falcon-H1's multipliers (the gate times m after the bias,
// before the clamp; the output times d): returns out [T, n], dy [T, 2n], dw [T], dbias [2n].
struct SwRef { std::vector<double> out, dy, dw, dbias; };
SwRef reference(const std::vector<double>& y, const std::vector<double>& y_bwd,
                const std::vector<double>& bias, const std::vector<double>& w,
                const std::vector<double>& g, int64_t T, int64_t n, const SwCase& c) {
  const std::optional<float> clamp = c.clamp;
  SwRef r{std::vector<double>(T * n), std::vector<double>(T * 2 * n), std::vector<double>(T),
          std::vector<double>(2 * n, 0.0)};
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < n; ++j) {
      auto value = [&](const std::vector<double>& src, double& a, double& b, bool& la, bool& lb) {
        a = (src[t * 2 * n + j] + (bias.empty() ? 0 : bias[j])) * double(c.gate_multiplier);
        b = src[t * 2 * n + n + j] + (bias.empty() ? 0 : bias[n + j]);
        la = lb = true;
        if (clamp) {
          // on a bound, as the options say; strictly inside, always; beyond, never
          la = a < *clamp || (c.gate_grad_at_bound && a == *clamp);
          lb = (b > -*clamp && b < *clamp) || (c.up_grad_at_bound && std::fabs(b) == *clamp);
          a = std::min<double>(a, *clamp);
          b = std::clamp<double>(b, -*clamp, *clamp);
        }
      };
      double a, b;
      bool la, lb;
      const double d = c.down_multiplier, m = c.gate_multiplier;
      double wt = w.empty() ? 1.0 : w[t];
      value(y, a, b, la, lb);
      r.out[t * n + j] = a * sig(a) * b * wt * d;
      value(y_bwd, a, b, la, lb);  // backward sees the saved (maybe e4m3) input
      double gg = g[t * n + j];
      r.dy[t * 2 * n + j] = la ? gg * wt * d * sig(a) * (1 + a * (1 - sig(a))) * b * m : 0.0;
      r.dy[t * 2 * n + n + j] = lb ? gg * wt * d * a * sig(a) : 0.0;
      r.dw[t] += a * sig(a) * b * gg * d;
    }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < 2 * n; ++c) r.dbias[c] += r.dy[t * 2 * n + c];
  return r;
}

class Swiglu : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { FL_SKIP_UNLESS_BACKEND(GetParam()); }
  void check(const SwCase& c);
  // The two-tensor form: gate and up in separate buffers (their own strides and offsets), or
  // the halves of one [T, 2n] buffer; the same reference.
  void check_two(const SwCase& c, bool halves);
};

SwigluOptions options_of(const SwCase& c) {
  SwigluOptions opt;
  if (c.clamp) opt.clamp = true, opt.clamp_value = *c.clamp;
  opt.clamp_gate_grad_at_bound = c.gate_grad_at_bound;
  opt.clamp_up_grad_at_bound = c.up_grad_at_bound;
  opt.gate_multiplier = c.gate_multiplier;
  opt.down_multiplier = c.down_multiplier;
  return opt;
}

void Swiglu::check(const SwCase& c) {
  SCOPED_TRACE(c.describe());
  const Device dev = GetParam();
  const int64_t T = c.rows, n = c.n, cols = 2 * n, stride = cols + c.pad, es = dtype_size(c.dtype);
  const int64_t elems = c.offset + std::max<int64_t>(T * stride, 1);
  auto nz = [](int64_t v) { return std::max<int64_t>(v, 1); };
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const DType bias_dtype = c.bias_f32 ? DType::F32 : c.dtype;
  Buffer y(dev, elems * es), out(dev, nz(T * n) * es), y8(dev, nz(T * cols)),
      bias(dev, cols * dtype_size(bias_dtype)),
      w(dev, nz(T) * 4), g(dev, nz(T * n) * es), gy(dev, elems * es), gw(dev, nz(T) * 4),
      gb(dev, cols * 4);
  for (int64_t i = 0; i < elems; ++i) store_as(c.dtype, y.host(), i, normal(rng()));
  if (c.on_bound)  // every third gate on +c, every third up on +-c (exact in every dtype)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = t % 3; j < n; j += 3) {
        store_as(c.dtype, y.host(), c.offset + t * stride + j, *c.clamp);
        store_as(c.dtype, y.host(), c.offset + t * stride + n + j, j % 2 ? *c.clamp : -*c.clamp);
      }
  for (int64_t i = 0; i < cols; ++i) store_as(bias_dtype, bias.host(), i, normal(rng()) * 0.3f);
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  for (int64_t t = 0; t < T; ++t) w.host_as<float>()[t] = u(rng());
  for (int64_t i = 0; i < T * n; ++i) store_as(c.dtype, g.host(), i, normal(rng()));
  // The reference sees the inputs exactly as stored.
  std::vector<double> yd(T * cols), bd, wd, gd(T * n);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < cols; ++j) yd[t * cols + j] = load_as(c.dtype, y.host(), c.offset + t * stride + j);
  if (c.bias) for (int64_t i = 0; i < cols; ++i) bd.push_back(load_as(bias_dtype, bias.host(), i));
  if (c.weights) for (int64_t t = 0; t < T; ++t) wd.push_back(w.host_as<float>()[t]);
  for (int64_t i = 0; i < T * n; ++i) gd[i] = load_as(c.dtype, g.host(), i);
  std::vector<unsigned char> y_before(static_cast<unsigned char*>(y.host()),
                                      static_cast<unsigned char*>(y.host()) + y.bytes());
  y.upload(); bias.upload(); w.upload(); g.upload();
  out.poison(); y8.poison(); gy.poison(); gw.poison(); gb.poison();

  auto at = [&](Buffer& b) { return static_cast<char*>(b.data()) + c.offset * es; };
  MatrixView yv{at(y), T, cols, stride, c.dtype, dev};
  MatrixView y8v{c.fp8 ? y8.data() : nullptr, T, cols, cols, DType::FP8_E4M3, dev};
  VectorView bv{c.bias ? bias.data() : nullptr, cols, bias_dtype, dev};
  VectorView wv{c.weights ? w.data() : nullptr, T, DType::F32, dev};
  const SwigluOptions opt = options_of(c);
  swiglu_forward(yv, bv, wv, opt, {out.data(), T, n, n, c.dtype, dev}, y8v);
  out.download(); y8.download();
  std::vector<double> ybwd = yd;
  if (c.fp8)
    for (int64_t i = 0; i < T * cols; ++i) {
      // the saved copy is the input rounded to e4m3 (checked against known encodings below)
      ybwd[i] = core::e4m3_to_float(y8.host_as<uint8_t>()[i]);
      ASSERT_EQ(y8.host_as<uint8_t>()[i], core::float_to_e4m3(float(yd[i]), opt.fp8_saturate))
          << "y_fp8[" << i << "]";
    }

  MatrixView gyv = c.in_place ? yv : MatrixView{at(gy), T, cols, stride, c.dtype, dev};
  swiglu_backward({g.data(), T, n, n, c.dtype, dev}, c.fp8 ? y8v : yv, bv, wv, opt, gyv,
                  c.weights ? gw.data_as<float>() : nullptr, c.bias ? gb.data_as<float>() : nullptr);
  Buffer& gbuf = c.in_place ? y : gy;
  gbuf.download(); gw.download(); gb.download();

  SwRef ref = reference(yd, ybwd, bd, wd, gd, T, n, c);
  const double tol = grad_tolerance(c.dtype);
  std::vector<double> o(T * n), dy(T * cols);
  for (int64_t i = 0; i < T * n; ++i) o[i] = load_as(c.dtype, out.host(), i);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < cols; ++j) dy[t * cols + j] = load_as(c.dtype, gbuf.host(), c.offset + t * stride + j);
  EXPECT_LE(rel_l2(o, ref.out), tol) << "forward";
  EXPECT_LE(rel_l2(dy, ref.dy), tol) << "grad_y";
  if (c.weights) {
    std::vector<double> dw(gw.host_as<float>(), gw.host_as<float>() + T);
    EXPECT_LE(rel_l2(dw, ref.dw), tol) << "grad_weights";
  }
  if (c.bias) {
    std::vector<double> db(gb.host_as<float>(), gb.host_as<float>() + cols);
    EXPECT_LE(rel_l2(db, ref.dbias), tol) << "grad_bias";
  }
  // Padding columns of a strided y keep their bytes (in place writes only [T, 2n]).
  if (c.in_place && c.pad) {
    const auto* now = static_cast<const unsigned char*>(y.host());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = cols; j < stride; ++j)
        for (int64_t b = 0; b < es; ++b) {
          int64_t idx = (c.offset + t * stride + j) * es + b;
          ASSERT_EQ(now[idx], y_before[idx]) << "padding of row " << t;
        }
  }
}

void Swiglu::check_two(const SwCase& c, bool halves) {
  SCOPED_TRACE(c.describe() + (halves ? " two-tensor halves" : " two-tensor separate"));
  const Device dev = GetParam();
  const int64_t T = c.rows, n = c.n, es = dtype_size(c.dtype);
  // gate and up: the halves of one [T, 2n + pad] buffer, or two buffers of different strides
  // and offsets (up's rows further apart than gate's)
  const int64_t gs = halves ? 2 * n + c.pad : n + c.pad, us = halves ? gs : n + c.pad + 3;
  const int64_t g_off = c.offset, u_off = halves ? c.offset + n : c.offset + 1;
  const int64_t g_elems = g_off + std::max<int64_t>(T * gs, 1) + (halves ? n : 0);
  const int64_t u_elems = halves ? 1 : u_off + std::max<int64_t>(T * us, 1);
  auto nz = [](int64_t v) { return std::max<int64_t>(v, 1); };
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const DType bias_dtype = c.bias_f32 ? DType::F32 : c.dtype;
  Buffer gbuf(dev, g_elems * es), ubuf(dev, u_elems * es), out(dev, nz(T * n) * es),
      y8(dev, nz(T * 2 * n)), bias(dev, 2 * n * dtype_size(bias_dtype)), w(dev, nz(T) * 4),
      g(dev, nz(T * n) * es), dg(dev, g_elems * es), du(dev, u_elems * es), gw(dev, nz(T) * 4),
      gb(dev, 2 * n * 4);
  for (int64_t i = 0; i < g_elems; ++i) store_as(c.dtype, gbuf.host(), i, normal(rng()));
  for (int64_t i = 0; i < u_elems; ++i) store_as(c.dtype, ubuf.host(), i, normal(rng()));
  Buffer& up_home = halves ? gbuf : ubuf;
  for (int64_t i = 0; i < 2 * n; ++i) store_as(bias_dtype, bias.host(), i, normal(rng()) * 0.3f);
  std::uniform_real_distribution<float> uni(0.1f, 1.0f);
  for (int64_t t = 0; t < T; ++t) w.host_as<float>()[t] = uni(rng());
  for (int64_t i = 0; i < T * n; ++i) store_as(c.dtype, g.host(), i, normal(rng()));
  std::vector<double> yd(T * 2 * n), bd, wd, gd(T * n);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < n; ++j) {
      yd[t * 2 * n + j] = load_as(c.dtype, gbuf.host(), g_off + t * gs + j);
      yd[t * 2 * n + n + j] = load_as(c.dtype, up_home.host(), u_off + t * us + j);
    }
  if (c.bias) for (int64_t i = 0; i < 2 * n; ++i) bd.push_back(load_as(bias_dtype, bias.host(), i));
  if (c.weights) for (int64_t t = 0; t < T; ++t) wd.push_back(w.host_as<float>()[t]);
  for (int64_t i = 0; i < T * n; ++i) gd[i] = load_as(c.dtype, g.host(), i);
  gbuf.upload(); ubuf.upload(); bias.upload(); w.upload(); g.upload();
  out.poison(); y8.poison(); dg.poison(); du.poison(); gw.poison(); gb.poison();

  auto at = [&](Buffer& b, int64_t off) { return static_cast<char*>(b.data()) + off * es; };
  MatrixView gate{at(gbuf, g_off), T, n, gs, c.dtype, dev}, up{at(up_home, u_off), T, n, us, c.dtype, dev};
  MatrixView y8v{c.fp8 ? y8.data() : nullptr, T, 2 * n, 2 * n, DType::FP8_E4M3, dev};
  VectorView bv{c.bias ? bias.data() : nullptr, 2 * n, bias_dtype, dev};
  VectorView wv{c.weights ? w.data() : nullptr, T, DType::F32, dev};
  const SwigluOptions opt = options_of(c);
  swiglu_gate_up_forward(gate, up, bv, wv, opt, {out.data(), T, n, n, c.dtype, dev}, y8v);
  out.download(); y8.download();
  std::vector<double> ybwd = yd;
  if (c.fp8)
    for (int64_t i = 0; i < T * 2 * n; ++i) {
      ybwd[i] = core::e4m3_to_float(y8.host_as<uint8_t>()[i]);
      ASSERT_EQ(y8.host_as<uint8_t>()[i], core::float_to_e4m3(float(yd[i]), opt.fp8_saturate))
          << "input_fp8[" << i << "]";
    }
  MatrixView f8g{y8.data(), T, n, 2 * n, DType::FP8_E4M3, dev},
      f8u{static_cast<uint8_t*>(y8.data()) + n, T, n, 2 * n, DType::FP8_E4M3, dev};
  MatrixView dgv = c.in_place ? gate : MatrixView{at(dg, g_off), T, n, gs, c.dtype, dev};
  MatrixView duv = c.in_place ? up
                              : MatrixView{at(halves ? dg : du, u_off), T, n, us, c.dtype, dev};
  swiglu_gate_up_backward({g.data(), T, n, n, c.dtype, dev}, c.fp8 ? f8g : gate, c.fp8 ? f8u : up,
                          bv, wv, opt, dgv, duv, c.weights ? gw.data_as<float>() : nullptr,
                          c.bias ? gb.data_as<float>() : nullptr);
  Buffer& dg_home = c.in_place ? gbuf : dg;
  Buffer& du_home = c.in_place ? up_home : (halves ? dg : du);
  dg_home.download(); du_home.download(); gw.download(); gb.download();

  SwRef ref = reference(yd, ybwd, bd, wd, gd, T, n, c);
  const double tol = grad_tolerance(c.dtype);
  std::vector<double> o(T * n), dy(T * 2 * n);
  for (int64_t i = 0; i < T * n; ++i) o[i] = load_as(c.dtype, out.host(), i);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < n; ++j) {
      dy[t * 2 * n + j] = load_as(c.dtype, dg_home.host(), g_off + t * gs + j);
      dy[t * 2 * n + n + j] = load_as(c.dtype, du_home.host(), u_off + t * us + j);
    }
  EXPECT_LE(rel_l2(o, ref.out), tol) << "forward";
  EXPECT_LE(rel_l2(dy, ref.dy), tol) << "grad_gate, grad_up";
  if (c.weights) {
    std::vector<double> dw(gw.host_as<float>(), gw.host_as<float>() + T);
    EXPECT_LE(rel_l2(dw, ref.dw), tol) << "grad_weights";
  }
  if (c.bias) {
    std::vector<double> db(gb.host_as<float>(), gb.host_as<float>() + 2 * n);
    EXPECT_LE(rel_l2(db, ref.dbias), tol) << "grad_bias";
  }
}

TEST_P(Swiglu, PlainEveryDtype) {
  for (DType d : {DType::F32, DType::F16, DType::BF16}) {
    SwCase c;
    c.dtype = d;
    check(c);
  }
}

TEST_P(Swiglu, Bias) {
  for (DType d : {DType::F32, DType::BF16}) {
    SwCase c;
    c.dtype = d;
    c.bias = true;
    c.rows = 300;  // more than one row chunk of the bias reduction
    check(c);
  }
}

TEST_P(Swiglu, WeightedPerTokenScale) {
  for (DType d : {DType::F32, DType::BF16}) {
    SwCase c;
    c.dtype = d;
    c.weights = true;
    check(c);
  }
}

TEST_P(Swiglu, Clamp) {
  for (float cv : {0.5f, 2.0f}) {
    SwCase c;
    c.clamp = cv;
    c.weights = cv > 1;
    check(c);
  }
}

// Elements exactly on +-clamp_value: the gradient passes there or not as each option says
// (torch's clamp rule differs between versions, and bf16 values land on the bound often).
TEST_P(Swiglu, ClampGradientAtTheBound) {
  for (DType d : {DType::F32, DType::BF16})
    for (bool gate : {false, true})
      for (bool up : {false, true}) {
        SwCase c;
        c.dtype = d;
        c.clamp = 2.0f;
        c.on_bound = true;
        c.gate_grad_at_bound = gate;
        c.up_grad_at_bound = up;
        check(c);
      }
}

// The gate's gradient on the bound changes the result by far more than the tolerance, so the
// test above would see a setting that is ignored.
TEST(SwigluClamp, SettingsDecideTheGradientOnTheBound) {
  core::SwigluClamp k{true, 2.0f, false, false};
  core::GateUp v = core::gate_up(2.0f, -2.0f, k);
  EXPECT_FALSE(v.a_live);
  EXPECT_FALSE(v.b_live);
  k.gate_grad_at_bound = k.up_grad_at_bound = true;
  v = core::gate_up(2.0f, -2.0f, k);
  EXPECT_TRUE(v.a_live);
  EXPECT_TRUE(v.b_live);
  v = core::gate_up(2.5f, 2.5f, k);  // beyond: never
  EXPECT_FALSE(v.a_live);
  EXPECT_FALSE(v.b_live);
  EXPECT_EQ(v.a, 2.0f);
  EXPECT_EQ(v.b, 2.0f);
}

// An fp32 bias with a 16-bit y (the math is fp32 anyway), on the 16-byte path and off it.
TEST_P(Swiglu, Fp32BiasWith16BitValues) {
  for (DType d : {DType::BF16, DType::F16})
    for (int64_t n : {96, 7}) {
      SwCase c;
      c.dtype = d;
      c.n = n;
      c.bias = true;
      c.bias_f32 = true;
      c.weights = n == 7;
      check(c);
    }
  SwCase in_place;
  in_place.dtype = DType::BF16;
  in_place.bias = in_place.bias_f32 = in_place.in_place = true;
  check(in_place);
}

TEST_P(Swiglu, Fp8InputStore) {
  for (DType d : {DType::F32, DType::F16, DType::BF16}) {
    SwCase c;
    c.dtype = d;
    c.fp8 = true;
    c.weights = d == DType::BF16;
    check(c);
  }
}

TEST_P(Swiglu, InPlace) {
  for (DType d : {DType::F32, DType::BF16}) {
    SwCase c;
    c.dtype = d;
    c.in_place = true;
    c.pad = 8;
    c.bias = d == DType::F32;
    check(c);
  }
}

TEST_P(Swiglu, LayoutsAndEdgeShapes) {
  for (int64_t n : {1, 3, 7, 8, 9, 64})
    for (int64_t pad : {0, 1, 8})
      for (int64_t offset : {0, 1}) {
        SwCase c;
        c.n = n;
        c.pad = pad;
        c.offset = offset;
        c.rows = 5;
        c.dtype = (n + pad) % 2 ? DType::F16 : DType::F32;
        c.in_place = offset == 1;
        check(c);
      }
  SwCase empty;
  empty.rows = 0;
  empty.bias = true;
  empty.weights = true;
  check(empty);
}

// Falcon-H1's multipliers against the float64 reference, with every option they meet.
TEST_P(Swiglu, GateAndDownMultipliers) {
  for (DType d : {DType::F32, DType::BF16})
    for (float m : {0.5f, 3.0f})
      for (float dm : {0.25f, -2.0f}) {
        SwCase c;
        c.dtype = d;
        c.gate_multiplier = m;
        c.down_multiplier = dm;
        c.weights = m > 1;
        c.bias = dm > 0;
        check(c);
      }
  SwCase clamp;  // the clamp bounds the multiplied gate
  clamp.clamp = 1.5f;
  clamp.gate_multiplier = 2.0f;
  clamp.down_multiplier = 0.5f;
  check(clamp);
  SwCase fp8;
  fp8.fp8 = true;
  fp8.gate_multiplier = 0.75f;
  fp8.down_multiplier = 1.5f;
  check(fp8);
}

// A multiplier of 1 is the plain op, bit for bit (x * 1 == x).
TEST(SwigluMultipliers, OneIsExact) {
  core::SwigluClamp k{false, 0.0f, false, false};
  for (float x : {0.3f, -7.25f, 1e-30f, 3e38f}) {
    EXPECT_EQ(core::gate_up(x, 2.0f, k, 1.0f).a, x);
    float da1, db1, da2, db2;
    const core::GateUp v = core::gate_up(x, 2.0f, k);
    EXPECT_EQ(core::swiglu_grad(v, 0.7f, da1, db1), core::swiglu_grad(v, 0.7f, da2, db2, 1.0f));
    EXPECT_EQ(da1, da2);
    EXPECT_EQ(db1, db2);
  }
}

TEST_P(Swiglu, TwoTensorForm) {
  for (bool halves : {false, true})
    for (DType d : {DType::F32, DType::F16, DType::BF16}) {
      SwCase c;
      c.dtype = d;
      c.pad = d == DType::F32 ? 0 : 8;
      check_two(c, halves);
      c.bias = c.weights = true;
      c.bias_f32 = d != DType::F32;
      c.rows = 300;
      c.gate_multiplier = 1.5f;
      c.down_multiplier = 0.5f;
      check_two(c, halves);
    }
}

TEST_P(Swiglu, TwoTensorInPlaceClampFp8AndEdgeShapes) {
  for (bool halves : {false, true}) {
    SwCase in_place;
    in_place.in_place = true;
    in_place.bias = in_place.weights = true;
    in_place.pad = 8;
    check_two(in_place, halves);
    SwCase clamp;
    clamp.clamp = 1.0f;
    clamp.dtype = DType::BF16;
    check_two(clamp, halves);
    SwCase fp8;
    fp8.fp8 = true;
    fp8.dtype = DType::F16;
    fp8.weights = true;
    check_two(fp8, halves);
    for (int64_t n : {1, 3, 7, 8, 9})
      for (int64_t offset : {0, 1}) {
        SwCase c;
        c.n = n;
        c.rows = 5;
        c.offset = offset;
        c.pad = n % 2;
        c.dtype = n % 2 ? DType::F16 : DType::F32;
        c.in_place = offset == 1;
        check_two(c, halves);
      }
    SwCase empty;
    empty.rows = 0;
    empty.bias = empty.weights = true;
    check_two(empty, halves);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Swiglu, ::testing::Values(Device::CPU, Device::CUDA),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(Fp8E4M3, KnownEncodings) {
  // bits: the code when saturating, and when overflow gives NaN (they differ past 448 only)
  struct { float v; uint8_t saturated, nan_mode; } known[] = {
      {0.0f, 0x00, 0x00}, {1.0f, 0x38, 0x38}, {-1.5f, 0xbc, 0xbc}, {448.0f, 0x7e, 0x7e},
      {-448.0f, 0xfe, 0xfe}, {0.001953125f, 0x01, 0x01} /* 2^-9, smallest subnormal */,
      {0.015625f, 0x08, 0x08} /* 2^-6 */, {1.0625f, 0x38, 0x38} /* tie: rounds to even */,
      {1.1875f, 0x3a, 0x3a} /* tie: up to even */, {464.0f, 0x7e, 0x7e} /* tie: down to 448 */,
      {470.0f, 0x7e, 0x7f} /* rounds past 448 */, {480.0f, 0x7e, 0x7f}, {-1e4f, 0xfe, 0xff},
      {INFINITY, 0x7e, 0x7f}, {-INFINITY, 0xfe, 0xff}, {NAN, 0x7f, 0x7f}};
  for (auto k : known) {
    EXPECT_EQ(int(core::float_to_e4m3(k.v, true)), int(k.saturated)) << k.v << " saturating";
    EXPECT_EQ(int(core::float_to_e4m3(k.v, false)), int(k.nan_mode)) << k.v << " NaN on overflow";
  }
  EXPECT_EQ(core::e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(core::e4m3_to_float(0x3a), 1.25f);
  EXPECT_EQ(core::e4m3_to_float(0xfe), -448.0f);
  EXPECT_EQ(core::e4m3_to_float(0x01), 0.001953125f);
  EXPECT_TRUE(std::isnan(core::e4m3_to_float(0x7f)));
  for (int b = 0; b < 256; ++b)  // every non-NaN code round-trips, in both modes
    if ((b & 0x7f) != 0x7f)
      for (bool saturate : {true, false})
        EXPECT_EQ(int(core::float_to_e4m3(core::e4m3_to_float(uint8_t(b)), saturate)), b);
}

// Bad inputs: odd last dim, bias / scale shapes, dtype and device mismatches, missing grads.
TEST(SwigluBadInputs, ClearErrors) {
  std::vector<float> y(4 * 8), out(4 * 4), bias(8), w(4), g(4 * 4), gy(4 * 8);
  MatrixView yv{y.data(), 4, 8, 8, DType::F32, Device::CPU}, ov{out.data(), 4, 4, 4, DType::F32, Device::CPU};
  VectorView none{};
  expect_error([&] { swiglu_forward({y.data(), 4, 7, 8, DType::F32, Device::CPU}, none, none, {}, ov); },
               "y.cols", "7");
  expect_error([&] { swiglu_forward(yv, {bias.data(), 6, DType::F32, Device::CPU}, none, {}, ov); },
               "bias.size", "6");
  expect_error([&] { swiglu_forward(yv, {bias.data(), 8, DType::BF16, Device::CPU}, none, {}, ov); },
               "bias.dtype", "bf16");
  // A 16-bit bias with fp32 values: the bias may be the values' dtype or fp32, nothing else.
  expect_error([&] { swiglu_forward(yv, {bias.data(), 8, DType::F16, Device::CPU}, none, {}, ov); },
               "bias.dtype", "got fp16, expected fp32");
  expect_error([&] { swiglu_forward(yv, none, {w.data(), 3, DType::F32, Device::CPU}, {}, ov); },
               "weights.size", "3");
  expect_error([&] { swiglu_forward(yv, none, {w.data(), 4, DType::F32, Device::CUDA}, {}, ov); },
               "weights.device", "cuda");
  expect_error([&] { swiglu_forward(yv, none, none, {}, {out.data(), 4, 4, 4, DType::F16, Device::CPU}); },
               "out.dtype", "fp16");
  expect_error([&] { swiglu_forward(yv, none, none, {}, {out.data(), 4, 3, 4, DType::F32, Device::CPU}); },
               "out", "[4, 3]");
  SwigluOptions bad;
  bad.clamp = true;
  bad.clamp_value = -1.0f;
  expect_error([&] { swiglu_forward(yv, none, none, bad, ov); }, "clamp_value", "-1");
  // The shape-free validator runs the same check, with the same message.
  expect_error([&] { validate_swiglu_options(bad); }, "options.clamp_value", "-1");
  bad.clamp_value = 1.0f;
  validate_swiglu_options(bad);
  MatrixView gv{g.data(), 4, 4, 4, DType::F32, Device::CPU}, gyv{gy.data(), 4, 8, 8, DType::F32, Device::CPU};
  expect_error([&] { swiglu_backward(gv, yv, none, {w.data(), 4, DType::F32, Device::CPU}, {}, gyv); },
               "grad_weights", "null");
  expect_error([&] { swiglu_backward(gv, yv, {bias.data(), 8, DType::F32, Device::CPU}, none, {}, gyv); },
               "grad_bias", "null");
  MatrixView shifted{y.data() + 1, 3, 8, 8, DType::F32, Device::CPU};
  expect_error([&] { swiglu_backward({g.data(), 3, 4, 4, DType::F32, Device::CPU}, {y.data(), 3, 8, 8, DType::F32, Device::CPU},
                                     none, none, {}, shifted); },
               "grad_y", "overlaps");
  // In place over y while the bias or the scale is y's own memory: the kernel would read
  // them after writing over them.
  std::vector<float> gb(8), gw(4);
  expect_error([&] { swiglu_backward(gv, yv, {y.data() + 8, 8, DType::F32, Device::CPU}, none, {}, yv,
                                     nullptr, gb.data()); },
               "grad_y: overlaps bias", "expected a separate buffer");
  expect_error([&] { swiglu_backward(gv, yv, none, {y.data() + 2, 4, DType::F32, Device::CPU}, {}, yv,
                                     gw.data(), nullptr); },
               "grad_y: overlaps weights", "expected a separate buffer");
  // the forward's output over the scale or the bias, the backward's small gradients over the
  // buffers the kernel reads or writes
  expect_error([&] { swiglu_forward(yv, none, {out.data(), 4, DType::F32, Device::CPU}, {}, ov); },
               "out: overlaps weights", "expected separate buffers");
  expect_error([&] { swiglu_forward(yv, {out.data() + 4, 8, DType::F32, Device::CPU}, none, {}, ov); },
               "out: overlaps bias", "expected separate buffers");
  expect_error([&] { swiglu_backward(gv, yv, none, {w.data(), 4, DType::F32, Device::CPU}, {}, gyv,
                                     gy.data() + 3, nullptr); },
               "grad_weights: overlaps grad_y", "expected separate buffers");
  expect_error([&] { swiglu_backward(gv, yv, {bias.data(), 8, DType::F32, Device::CPU}, none, {}, gyv,
                                     nullptr, g.data()); },
               "grad_bias: overlaps grad_out", "expected separate buffers");
  expect_error([&] { swiglu_backward(gv, yv, none, {w.data(), 4, DType::F32, Device::CPU}, {}, gyv,
                                     w.data(), nullptr); },
               "grad_weights: overlaps weights", "expected separate buffers");
}

// The two-tensor form: mismatched gate and up, and gradients that would clash.
TEST(SwigluBadInputs, TwoTensorForm) {
  std::vector<float> a(4 * 8), b(4 * 8), out(4 * 4), g(4 * 4), da(4 * 4), db(4 * 4), w(4);
  const Device cpu = Device::CPU;
  MatrixView gate{a.data(), 4, 4, 4, DType::F32, cpu}, up{b.data(), 4, 4, 4, DType::F32, cpu},
      ov{out.data(), 4, 4, 4, DType::F32, cpu}, gv{g.data(), 4, 4, 4, DType::F32, cpu},
      dgv{da.data(), 4, 4, 4, DType::F32, cpu}, duv{db.data(), 4, 4, 4, DType::F32, cpu};
  VectorView none{};
  expect_error([&] { swiglu_gate_up_forward(gate, {b.data(), 4, 3, 4, DType::F32, cpu}, none, none, {}, ov); },
               "up: got shape [4, 3], expected gate's [4, 4]", "one up value per gate value");
  expect_error([&] { swiglu_gate_up_forward(gate, {b.data(), 3, 4, 4, DType::F32, cpu}, none, none, {}, ov); },
               "up: got shape [3, 4]", "gate's [4, 4]");
  expect_error([&] { swiglu_gate_up_forward(gate, {b.data(), 4, 4, 4, DType::BF16, cpu}, none, none, {}, ov); },
               "up.dtype: got bf16", "expected gate's fp32");
  expect_error([&] { swiglu_gate_up_forward(gate, {b.data(), 4, 4, 4, DType::F32, Device::CUDA}, none, none, {}, ov); },
               "up.device: got cuda", "expected gate's cpu");
  expect_error([&] { swiglu_gate_up_forward(gate, up, {w.data(), 4, DType::F32, cpu}, none, {}, ov); },
               "bias.size: got 4, expected 2n = 8", "the gate's bias in [0, n)");
  expect_error([&] { swiglu_gate_up_forward(gate, up, none, none, {}, {out.data(), 4, 4, 4, DType::F16, cpu}); },
               "out.dtype", "fp16");
  expect_error([&] { swiglu_gate_up_forward(gate, up, none, none, {}, {a.data() + 8, 4, 4, 4, DType::F32, cpu}); },
               "out: overlaps gate", "separate buffers");
  SwigluOptions bad;
  bad.gate_multiplier = INFINITY;
  expect_error([&] { swiglu_gate_up_forward(gate, up, none, none, bad, ov); },
               "options.gate_multiplier: got inf", "expected a finite value");
  bad.gate_multiplier = 1.0f;
  bad.down_multiplier = NAN;
  expect_error([&] { validate_swiglu_options(bad); }, "options.down_multiplier: got nan",
               "expected a finite value");
  // one tensor as gate and up reads fine; its gradients cannot both go in place
  swiglu_gate_up_forward(gate, gate, none, none, {}, ov);
  expect_error([&] { swiglu_gate_up_backward(gv, gate, gate, none, none, {}, gate, gate); },
               "grad_gate: overlaps up", "cannot take their gradients in place");
  expect_error([&] { swiglu_gate_up_backward(gv, gate, up, none, none, {}, dgv, dgv); },
               "grad_gate: overlaps grad_up", "separate buffers");
  expect_error([&] { swiglu_gate_up_backward(gv, gate, up, none, none, {}, {a.data() + 1, 4, 4, 4, DType::F32, cpu}, duv); },
               "grad_gate: overlaps gate without being the same view", "gate itself (in place)");
  expect_error([&] { swiglu_gate_up_backward(gv, gate, up, none, none, {}, dgv, {a.data(), 4, 4, 4, DType::F32, cpu}); },
               "grad_up: overlaps gate", "expected a buffer apart from gate");
  expect_error([&] { swiglu_gate_up_backward(gv, gate, up, none, none, {}, gv, duv); },
               "grad_gate: overlaps grad_out", "separate buffer");
  expect_error([&] { swiglu_gate_up_backward(gv, gate, up, none, {w.data(), 4, DType::F32, cpu}, {}, dgv, duv); },
               "grad_weights: got null", "weights were given");
  // the halves of one [4, 8] buffer as gate and up, their gradients in place: accepted (the
  // halves share no element), and the same as the fused form's
  std::vector<float> y(4 * 8), y2(4 * 8), gy(4 * 8);
  for (size_t i = 0; i < y.size(); ++i) y[i] = y2[i] = std::sin(float(i));
  for (size_t i = 0; i < g.size(); ++i) g[i] = std::cos(float(i));
  MatrixView yg{y.data(), 4, 4, 8, DType::F32, cpu}, yu{y.data() + 4, 4, 4, 8, DType::F32, cpu};
  swiglu_gate_up_backward(gv, yg, yu, none, none, {}, yg, yu);
  swiglu_backward(gv, {y2.data(), 4, 8, 8, DType::F32, cpu}, none, none, {},
                  {gy.data(), 4, 8, 8, DType::F32, cpu});
  EXPECT_EQ(y, gy);
}

}  // namespace
}  // namespace fusedloss::test

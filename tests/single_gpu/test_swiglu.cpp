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
  std::string describe() const {
    std::ostringstream os;
    os << "rows=" << rows << " n=" << n << " pad=" << pad << " offset=" << offset << " dtype="
       << to_string(dtype) << (bias ? " bias" : "") << (weights ? " weights" : "")
       << (fp8 ? " fp8-store" : "") << (in_place ? " in-place" : "")
       << (bias_f32 ? " bias-fp32" : "") << (clamp ? " clamp=" + std::to_string(*clamp) : "")
       << (gate_grad_at_bound ? " gate-grad-at-bound" : "")
       << (up_grad_at_bound ? " up-grad-at-bound" : "") << (on_bound ? " on-bound" : "");
    return os.str();
  }
};

double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Megatron's math in float64: returns out [T, n], dy [T, 2n], dw [T], dbias [2n].
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
        a = src[t * 2 * n + j] + (bias.empty() ? 0 : bias[j]);
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
      double wt = w.empty() ? 1.0 : w[t];
      value(y, a, b, la, lb);
      r.out[t * n + j] = a * sig(a) * b * wt;
      value(y_bwd, a, b, la, lb);  // backward sees the saved (maybe e4m3) input
      double gg = g[t * n + j];
      r.dy[t * 2 * n + j] = la ? gg * wt * sig(a) * (1 + a * (1 - sig(a))) * b : 0.0;
      r.dy[t * 2 * n + n + j] = lb ? gg * wt * a * sig(a) : 0.0;
      r.dw[t] += a * sig(a) * b * gg;
    }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < 2 * n; ++c) r.dbias[c] += r.dy[t * 2 * n + c];
  return r;
}

class Swiglu : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { FL_SKIP_UNLESS_BACKEND(GetParam()); }
  void check(const SwCase& c);
};

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
  SwigluOptions opt;
  if (c.clamp) opt.clamp = true, opt.clamp_value = *c.clamp;
  opt.clamp_gate_grad_at_bound = c.gate_grad_at_bound;
  opt.clamp_up_grad_at_bound = c.up_grad_at_bound;
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

}  // namespace
}  // namespace fusedloss::test

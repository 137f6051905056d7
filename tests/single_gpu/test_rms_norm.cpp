// RMSNorm on every backend against a float64 reference written from the definitions, with
// fresh random inputs and poisoned outputs: every variant (eps, zero-centred gamma, weight
// dtypes, fused residual, the residual's gradient), layouts on and off the 16-byte path, rows
// too long for registers, edge shapes, determinism and bad inputs.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>

#include "common/test_util.h"
#include "fusedloss/rms_norm.h"
#if FUSEDLOSS_HAS_CUDA
#include "cuda/rms_norm_cuda.h"
#endif

namespace fusedloss::test {
namespace {

struct RmsCase {
  int64_t rows = 37, H = 256, pad = 0, offset = 0;
  DType dtype = DType::F32;
  std::optional<DType> weight_dtype;  // default: dtype
  float eps = 1e-5f;
  bool zero_centered = false, residual = false, grad_residual = false;
  bool in_place = false;         // grad_x is grad_y itself
  bool in_place_x = false;       // grad_x is x_or_s itself
  bool zero_rows = false;        // every third row all zeros
  bool caller_workspace = false;
  double scale = 2.0;            // the inputs' spread
  std::string describe() const {
    std::ostringstream os;
    os << "rows=" << rows << " H=" << H << " pad=" << pad << " offset=" << offset
       << " dtype=" << to_string(dtype) << " weight=" << to_string(weight_dtype.value_or(dtype))
       << " eps=" << eps << (zero_centered ? " zero-centred" : "") << (residual ? " residual" : "")
       << (grad_residual ? " grad-residual" : "") << (in_place ? " in-place(grad_y)" : "")
       << (in_place_x ? " in-place(x)" : "") << (zero_rows ? " zero-rows" : "")
       << (caller_workspace ? " workspace" : "");
    return os.str();
  }
};

// Round a double through a storage dtype, as a kernel storing it would (fp32 first).
double through(DType d, double v) {
  unsigned char b[4];
  store_as(d, b, 0, float(v));
  return load_as(d, b, 0);
}

struct RmsRef {
  std::vector<double> s, y, rstd, dx, dw;
  std::vector<double> dx_terms;  // rstd * dy * gamma: the size of what dx subtracts from
  std::vector<double> dw_terms;  // sum_rows |dy xhat|: the size of what dw's sum cancels
};

// s = x (+ r, rounded to the dtype as stored), y = s / sqrt(mean(s^2) + eps) * gamma;
// dx = rstd (dy gamma - xhat mean(dy gamma xhat)) (+ grad of s), dw = sum_rows dy xhat.
RmsRef reference(const std::vector<double>& x, const std::vector<double>& r,
                 const std::vector<double>& w, const std::vector<double>& dy,
                 const std::vector<double>& gres, int64_t T, int64_t H, const RmsCase& c) {
  RmsRef o{std::vector<double>(T * H), std::vector<double>(T * H), std::vector<double>(T),
           std::vector<double>(T * H), std::vector<double>(H, 0.0)};
  o.dw_terms.assign(H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t j = 0; j < H; ++j) {
      double s = x[t * H + j];
      if (!r.empty()) s = through(c.dtype, double(float(s) + float(r[t * H + j])));
      o.s[t * H + j] = s;
      ss += s * s;
    }
    const double rstd = 1.0 / std::sqrt(ss / double(H) + double(c.eps));
    o.rstd[t] = rstd;
    double dot = 0;
    for (int64_t j = 0; j < H; ++j) {
      const double gamma = c.zero_centered ? w[j] + 1.0 : w[j], xhat = o.s[t * H + j] * rstd;
      o.y[t * H + j] = xhat * gamma;
      dot += dy[t * H + j] * gamma * xhat;
      o.dw[j] += dy[t * H + j] * xhat;
      o.dw_terms[j] += std::abs(dy[t * H + j] * xhat);
    }
    const double m = dot / double(H);
    for (int64_t j = 0; j < H; ++j) {
      const double gamma = c.zero_centered ? w[j] + 1.0 : w[j], xhat = o.s[t * H + j] * rstd;
      o.dx[t * H + j] = rstd * (dy[t * H + j] * gamma - xhat * m) + (gres.empty() ? 0.0 : gres[t * H + j]);
      o.dx_terms.push_back(rstd * dy[t * H + j] * gamma);
    }
  }
  return o;
}

class RmsNorm : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { FL_SKIP_UNLESS_BACKEND(GetParam()); }
  void check(const RmsCase& c);
};

// A [T, H] matrix in a buffer of T rows `stride` apart, starting `offset` elements in.
struct Mat {
  Mat(Device dev, const RmsCase& c)
      : T(c.rows), H(c.H), stride(c.H + c.pad), offset(c.offset), dtype(c.dtype),
        buf(dev, (c.offset + std::max<int64_t>(c.rows * (c.H + c.pad), 1)) * dtype_size(c.dtype)),
        dev(dev) {}
  int64_t T, H, stride, offset;
  DType dtype;
  Buffer buf;
  Device dev;
  int64_t idx(int64_t t, int64_t j) const { return offset + t * stride + j; }
  MatrixView view() {
    return {static_cast<char*>(buf.data()) + offset * dtype_size(dtype), T, H, stride, dtype, dev};
  }
  void fill(std::normal_distribution<double>& dist, bool zero_rows) {
    for (int64_t i = 0; i < int64_t(buf.bytes()) / dtype_size(dtype); ++i)
      store_as(dtype, buf.host(), i, float(dist(rng())));
    if (zero_rows)
      for (int64_t t = 0; t < T; t += 3)
        for (int64_t j = 0; j < H; ++j) store_as(dtype, buf.host(), idx(t, j), 0.0f);
  }
  std::vector<double> values() {
    std::vector<double> v(T * H);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < H; ++j) v[t * H + j] = load_as(dtype, buf.host(), idx(t, j));
    return v;
  }
  // Padding (and the offset's head) still holds the poison: nothing was written outside [T, H].
  void expect_untouched_outside() {
    const auto* b = static_cast<const unsigned char*>(buf.host());
    const int64_t es = dtype_size(dtype);
    for (int64_t i = 0; i < int64_t(buf.bytes()) / es; ++i) {
      const int64_t rel = i - offset;
      const bool inside = rel >= 0 && rel / stride < T && rel % stride < H;
      if (inside) continue;
      for (int64_t k = 0; k < es; ++k)
        if (b[i * es + k] != 0xff) {
          ADD_FAILURE() << "element " << i << " outside [T, H] was written";
          return;
        }
    }
  }
};

void RmsNorm::check(const RmsCase& c) {
  SCOPED_TRACE(c.describe());
  const Device dev = GetParam();
  const int64_t T = c.rows, H = c.H;
  const DType wd = c.weight_dtype.value_or(c.dtype);
  std::normal_distribution<double> normal(0.0, c.scale), wnormal(c.zero_centered ? 0.0 : 1.0, 0.3);
  Mat x(dev, c), res(dev, c), y(dev, c), s(dev, c), dy(dev, c), gres(dev, c), dx(dev, c);
  Buffer w(dev, H * dtype_size(wd)), rstd(dev, std::max<int64_t>(T, 1) * 4), gw(dev, H * 4),
      gw2(dev, H * 4);
  x.fill(normal, c.zero_rows);
  res.fill(normal, c.zero_rows);
  if (c.zero_rows && c.residual)  // s = 0 + 0 on the zero rows
    for (int64_t t = 0; t < T; t += 3)
      for (int64_t j = 0; j < H; ++j) store_as(c.dtype, res.buf.host(), res.idx(t, j), 0.0f);
  std::normal_distribution<double> unit(0.0, 1.0);
  dy.fill(unit, false);
  gres.fill(unit, false);
  for (int64_t j = 0; j < H; ++j) store_as(wd, w.host(), j, float(wnormal(rng())));
  std::vector<double> xd = x.values(), rd = c.residual ? res.values() : std::vector<double>{},
                      dyd = dy.values(), gd = c.grad_residual ? gres.values() : std::vector<double>{},
                      wv(H);
  for (int64_t j = 0; j < H; ++j) wv[j] = load_as(wd, w.host(), j);
  x.buf.upload(); res.buf.upload(); dy.buf.upload(); gres.buf.upload(); w.upload();
  y.buf.poison(); s.buf.poison(); dx.buf.poison(); rstd.poison(); gw.poison(); gw2.poison();

  RmsNormOptions opt;
  opt.eps = c.eps;
  opt.zero_centered_gamma = c.zero_centered;
  const VectorView wview{w.data(), H, wd, dev};
  rms_norm_forward(x.view(), wview, opt, y.view(), rstd.data_as<float>(),
                   c.residual ? res.view() : MatrixView{}, c.residual ? s.view() : MatrixView{});
  y.buf.download(); s.buf.download(); rstd.download();
  const RmsRef ref = reference(xd, rd, wv, dyd, gd, T, H, c);

  const double tol = grad_tolerance(c.dtype);
  EXPECT_LE(rel_l2(y.values(), ref.y), tol) << "y";
  std::vector<double> rs(rstd.host_as<float>(), rstd.host_as<float>() + T);
  EXPECT_LE(rel_l2(rs, ref.rstd), 2e-6) << "rstd";
  y.expect_untouched_outside();
  if (c.residual) {
    std::vector<double> sv = s.values();
    for (int64_t i = 0; i < T * H; ++i) ASSERT_EQ(sv[i], ref.s[i]) << "residual_out[" << i << "]";
    s.expect_untouched_outside();
  }
  if (c.zero_rows)
    for (int64_t t = 0; t < T; t += 3)
      for (int64_t j = 0; j < H; ++j) ASSERT_EQ(load_as(c.dtype, y.buf.host(), y.idx(t, j)), 0.0f);

  // Backward, twice: the same bits (and with a caller's workspace, the same bits as without).
  Mat& src = c.residual ? s : x;
  Buffer ws(dev, std::max<size_t>(rms_norm_backward_workspace_bytes(T, H, dev), 16));
  if (dev == Device::CPU) EXPECT_EQ(rms_norm_backward_workspace_bytes(T, H, dev), 0u);
  ws.poison();
  std::vector<unsigned char> first_dx, first_gw;
  auto bytes_of = [](Buffer& b) {
    return std::vector<unsigned char>(static_cast<unsigned char*>(b.host()),
                                      static_cast<unsigned char*>(b.host()) + b.bytes());
  };
  auto restore = [](Buffer& b, const std::vector<unsigned char>& v) {
    std::memcpy(b.host(), v.data(), v.size());
    b.upload();
  };
  src.buf.download();
  const std::vector<unsigned char> dy_in = bytes_of(dy.buf), src_in = bytes_of(src.buf);
  for (int run = 0; run < 2; ++run) {
    // in place: grad_x is grad_y (or x_or_s); those get their inputs back for the second run
    if (c.in_place) restore(dy.buf, dy_in);
    if (c.in_place_x) restore(src.buf, src_in);
    if (!c.in_place && !c.in_place_x) dx.buf.poison();
    MatrixView gx = c.in_place ? dy.view() : c.in_place_x ? src.view() : dx.view();
    Buffer& gwb = run ? gw2 : gw;
    rms_norm_backward(dy.view(), src.view(), wview, rstd.data_as<float>(), opt, gx,
                      gwb.data_as<float>(), c.caller_workspace && run ? ws.data() : nullptr,
                      c.grad_residual ? gres.view() : MatrixView{});
    Mat& out = c.in_place ? dy : c.in_place_x ? src : dx;
    out.buf.download(); gwb.download();
    std::vector<unsigned char> dxb(static_cast<unsigned char*>(out.buf.host()),
                                   static_cast<unsigned char*>(out.buf.host()) + out.buf.bytes());
    std::vector<unsigned char> gwbytes(static_cast<unsigned char*>(gwb.host()),
                                       static_cast<unsigned char*>(gwb.host()) + gwb.bytes());
    if (run == 0) {
      if (H > 1) {
        EXPECT_LE(rel_l2(out.values(), ref.dx), tol) << "grad_x";
      } else {
        // dx = rstd dy gamma (1 - xhat^2) with xhat^2 = s^2 / (s^2 + eps): nearly all of it
        // cancels, so the error is measured against the terms, not the tiny difference
        std::vector<double> v = out.values();
        double num = 0, den = 0;
        for (int64_t i = 0; i < T; ++i) {
          num += (v[i] - ref.dx[i]) * (v[i] - ref.dx[i]);
          den += ref.dx_terms[i] * ref.dx_terms[i];
        }
        EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), tol) << "grad_x (H = 1)";
      }
      std::vector<double> g(gwb.host_as<float>(), gwb.host_as<float>() + H);
      // against the terms: a column whose few rows cancel (H = 1, 7 rows) has a tiny sum
      double num = 0, den = 0;
      for (int64_t j = 0; j < H; ++j) {
        num += (g[j] - ref.dw[j]) * (g[j] - ref.dw[j]);
        den += ref.dw_terms[j] * ref.dw_terms[j];
      }
      EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), 2e-5) << "grad_weight";
      if (!c.in_place && !c.in_place_x) out.expect_untouched_outside();
      if (c.zero_rows)  // finite: rstd = 1/sqrt(eps), xhat = 0
        for (int64_t t = 0; t < T; t += 3)
          for (int64_t j = 0; j < H; ++j)
            ASSERT_TRUE(std::isfinite(load_as(c.dtype, out.buf.host(), out.idx(t, j))));
      first_dx = dxb;
      first_gw = gwbytes;
    } else {
      EXPECT_TRUE(dxb == first_dx) << "grad_x differs between two identical calls";
      EXPECT_TRUE(gwbytes == first_gw) << "grad_weight differs between two identical calls";
    }
  }
  if (c.in_place || c.in_place_x) return;  // their inputs are gone
  // The weight gradient in a 16-bit dtype: the same fp32 sums rounded once, nothing written
  // past H.
  const float* gw32 = reinterpret_cast<const float*>(first_gw.data());
  for (DType gd : {DType::BF16, DType::F16}) {
    SCOPED_TRACE(std::string("grad_weight_dtype ") + to_string(gd));
    Buffer g16(dev, (H + 8) * 2);
    g16.poison();
    rms_norm_backward(dy.view(), src.view(), wview, rstd.data_as<float>(), opt, dx.view(),
                      g16.data(), gd, c.caller_workspace ? ws.data() : nullptr,
                      c.grad_residual ? gres.view() : MatrixView{});
    g16.download();
    for (int64_t j = 0; j < H; ++j)
      ASSERT_EQ(load_as(gd, g16.host(), j), through(gd, gw32[j])) << "grad_weight[" << j << "]";
    const auto* tail = static_cast<const unsigned char*>(g16.host()) + H * 2;
    for (int64_t k = 0; k < 16; ++k) ASSERT_EQ(tail[k], 0xff) << "byte " << k << " past H written";
  }
}

TEST_P(RmsNorm, EveryDtypeAndWeightDtype) {
  const std::pair<DType, DType> combos[] = {
      {DType::F32, DType::F32}, {DType::F32, DType::BF16}, {DType::F32, DType::F16},
      {DType::BF16, DType::BF16}, {DType::BF16, DType::F32}, {DType::F16, DType::F16},
      {DType::F16, DType::F32}};
  for (auto [x, w] : combos)
    for (int64_t H : {256, 250}) {  // on the 16-byte path and off it
      RmsCase c;
      c.dtype = x;
      c.weight_dtype = w;
      c.H = H;
      check(c);
    }
}

TEST_P(RmsNorm, EpsAndZeroCenteredGamma) {
  for (float eps : {1e-6f, 1e-5f, 0.5f})
    for (bool zc : {false, true})
      for (DType d : {DType::F32, DType::BF16}) {
        RmsCase c;
        c.eps = eps;
        c.zero_centered = zc;
        c.dtype = d;
        c.scale = eps > 0.1f ? 0.3 : 2.0;  // eps comparable to mean(x^2)
        check(c);
      }
}

TEST_P(RmsNorm, FusedResidual) {
  for (DType d : {DType::F32, DType::BF16, DType::F16})
    for (int64_t H : {512, 77})
      for (bool gres : {false, true}) {
        RmsCase c;
        c.dtype = d;
        c.H = H;
        c.residual = true;
        c.grad_residual = gres;
        c.weight_dtype = d == DType::BF16 ? DType::F32 : d;
        check(c);
      }
}

TEST_P(RmsNorm, InPlaceGradient) {
  for (DType d : {DType::F32, DType::BF16})
    for (int64_t H : {256, 13}) {
      RmsCase c;
      c.dtype = d;
      c.H = H;
      c.in_place = true;
      check(c);
      c.in_place = false;
      c.in_place_x = true;
      c.pad = 8;
      check(c);
    }
}

TEST_P(RmsNorm, LayoutsAndEdgeShapes) {
  for (int64_t H : {1, 3, 8, 9, 64, 129})
    for (int64_t pad : {0, 1, 8})
      for (int64_t offset : {0, 1, 8}) {
        RmsCase c;
        c.H = H;
        c.pad = pad;
        c.offset = offset;
        c.rows = 7;
        c.dtype = (H + pad + offset) % 2 ? DType::F16 : DType::BF16;
        c.residual = offset == 8;
        check(c);
      }
  for (DType d : {DType::F32, DType::BF16}) {
    RmsCase empty;
    empty.rows = 0;
    empty.dtype = d;
    check(empty);  // grad_weight becomes zeros
    RmsCase one;
    one.rows = 1;
    one.H = 1;
    one.dtype = d;
    check(one);
  }
}

TEST_P(RmsNorm, RowsOfZerosStayFinite) {
  for (DType d : {DType::F32, DType::BF16, DType::F16})
    for (int64_t H : {128, 33}) {
      RmsCase c;
      c.dtype = d;
      c.H = H;
      c.zero_rows = true;
      c.residual = d == DType::F16;
      check(c);
    }
}

// Hidden sizes of real models (the kernels' register layouts change with H), rows in the
// thousands (the backward's fixed grid walks many rows per block), and rows too long for
// registers (the single-element kernels).
TEST_P(RmsNorm, ModelShapesAndLongRows) {
  struct S { int64_t rows, H; DType d; };
  const S shapes[] = {{64, 2048, DType::BF16}, {48, 5120, DType::BF16}, {40, 6144, DType::BF16},
                      {24, 8192, DType::BF16}, {12, 16384, DType::BF16}, {12, 16384, DType::F32},
                      {20, 6144, DType::F32},  {3000, 64, DType::BF16},  {20000, 32, DType::F32},
                      {3, 16392, DType::BF16}, {3, 65544, DType::BF16},  {3, 32776, DType::F32}};
  for (const S& s : shapes) {
    RmsCase c;
    c.rows = s.rows;
    c.H = s.H;
    c.dtype = s.d;
    c.caller_workspace = true;
    c.zero_centered = s.H == 5120;
    check(c);
  }
}

TEST_P(RmsNorm, CallerWorkspace) {
  for (int64_t H : {256, 100}) {
    RmsCase c;
    c.H = H;
    c.rows = 500;
    c.dtype = DType::BF16;
    c.caller_workspace = true;
    check(c);
  }
}

// Every launch shape of the CUDA row kernels (cuda::RmsNormTuning), each around its path
// boundaries: one warp per row and many rows a block (shuffles only), a row per block, several
// multi-warp groups a block (the alternating scratch: more rows than one grid sweep, so both halves
// are reused), big groups, the persistent forward with its L2 prefetch, backward grids of 1 to 8
// blocks per SM, the column sum launched after the row kernel or overlapping it; a third of the
// backwards in place over grad_y, a third over x. Shapes: short rows in the thousands, model sizes
// with the residual, zero-centred gamma and a mixed weight dtype, and the register limits: rows
// held whole or split over clusters in the backward (fp32 H = 8196, 17 warps: the 8-vector
// path; bf16 H = 16392: the element-wise kernel), rows held or read twice in the forward, 16-bit
// rows up to H = 32776, fp16 rows of 4 vectors a thread (the backward holds 2
// of their weights and reads 2 a row).
// (The CPU backend has one path: it runs the shapes once.)
TEST_P(RmsNorm, KernelVariants) {
  const bool cuda = GetParam() == Device::CUDA;
  struct S { int64_t rows, H; DType d; bool residual; std::optional<DType> w; };
  const S shapes[] = {{5000, 64, DType::BF16, false, {}},    {2500, 2048, DType::BF16, true, {}},
                      {300, 5120, DType::BF16, false, DType::F32},
                      {200, 6144, DType::F32, true, DType::BF16},
                      {40, 8192, DType::F32, false, {}},      {40, 8196, DType::F32, true, {}},
                      {6, 16384, DType::F32, false, {}},      {3, 16388, DType::F32, false, {}},
                      {6, 16384, DType::BF16, true, {}},      {3, 16392, DType::BF16, false, {}},
                      {3, 32768, DType::F16, false, {}},      {3, 32776, DType::BF16, false, {}},
                      {300, 4096, DType::F16, false, {}},     {300, 4104, DType::F16, true, DType::F32}};
  const char* variants[] = {
      "",
      "fwd_tpr=32,fwd_block=1024,bwd_tpr=32,bwd_block=512,bwd_blocks_per_sm=1",
      "fwd_block=32,bwd_block=32,bwd_blocks_per_sm=8",
      "fwd_tpr=64,fwd_block=512,fwd_blocks_per_sm=1,fwd_prefetch=1,bwd_tpr=128,bwd_block=512,"
      "bwd_blocks_per_sm=1,bwd_prefetch=0",
      "fwd_tpr=256,fwd_block=1024,fwd_blocks_per_sm=2,bwd_tpr=512,bwd_block=512,"
      "bwd_blocks_per_sm=4",
      "fwd_tpr=32,fwd_block=64,fwd_blocks_per_sm=1,bwd_tpr=128,bwd_block=128,"
      "bwd_blocks_per_sm=1,bwd_prefetch=0,bwd_overlap_sum=0",
      // backward rows split over clusters: none (a row one block, fp32 rows of 8 vectors);
      // most rows, down to clusters of 5 and 8 blocks of one or two warps; clusters of 4 on a
      // grid of one block an SM. The forward: every row held (none read twice where a held
      // layout fits); every row read twice, in blocks of 96 threads, or as many as held;
      // rows from 256 threads read twice by 1024-thread blocks
      "bwd_cluster_threads=0,fwd_reread_from=0", "bwd_cluster_threads=64,fwd_reread_from=32",
      "bwd_cluster_threads=96,bwd_blocks_per_sm=1,fwd_reread_from=32,fwd_reread_block=96",
      "fwd_reread_from=256,fwd_reread_block=1024"};
#if FUSEDLOSS_HAS_CUDA
  const cuda::RmsNormTuning shipped = cuda::rms_norm_tuning();
  struct Restore {  // the shipped tuning again however the loop ends
    cuda::RmsNormTuning t;
    ~Restore() { cuda::set_rms_norm_tuning(t); }
  } restore{shipped};
  auto tune = [&](const char* v) {
    cuda::set_rms_norm_tuning(v ? cuda::parse_rms_norm_tuning(v) : shipped);
  };
#else
  auto tune = [](const char*) {};
#endif
  for (const char* v : variants) {
    if (!cuda && *v) continue;
    SCOPED_TRACE(std::string("tuning: ") + v);
    if (cuda) tune(v);
    for (const S& s : shapes) {
      RmsCase c;
      c.rows = s.rows;
      c.H = s.H;
      c.dtype = s.d;
      c.residual = c.grad_residual = s.residual;
      c.weight_dtype = s.w;
      c.zero_centered = s.H == 5120 || s.H == 8196;
      c.caller_workspace = true;
      const size_t i = size_t(&s - shapes);  // in place too: the pipelined rows read ahead
      c.in_place = i % 3 == 1;
      c.in_place_x = i % 3 == 2;
      check(c);
    }
  }
}

#if FUSEDLOSS_HAS_CUDA
// A caller sizes the workspace, then the tuning changes before the backward: the size does not
// follow the tuning (the backward caps its partial rows at it, with or without a caller's
// workspace; KernelVariants runs a tuning with more blocks per SM than the shipped one both
// ways and expects the same bits).
TEST(RmsNormTuning, WorkspaceSizeIgnoresTheTuning) {
  FL_SKIP_UNLESS_BACKEND(Device::CUDA);
  const size_t before = rms_norm_backward_workspace_bytes(100000, 4096, Device::CUDA);
  const cuda::RmsNormTuning shipped = cuda::rms_norm_tuning();
  struct Restore {
    cuda::RmsNormTuning t;
    ~Restore() { cuda::set_rms_norm_tuning(t); }
  } restore{shipped};
  cuda::set_rms_norm_tuning(cuda::parse_rms_norm_tuning("bwd_blocks_per_sm=16"));
  EXPECT_EQ(rms_norm_backward_workspace_bytes(100000, 4096, Device::CUDA), before);
}

// The device's compute capability major, and the highest architecture this build has code for
// at or below it (0 when FUSEDLOSS_TEST_CUDA_ARCHS is not numeric).
std::pair<int, int> device_major_and_built_arch() {
  int device = 0, major = 0;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  int best_arch = 0;
  std::stringstream archs(FUSEDLOSS_TEST_CUDA_ARCHS);
  for (std::string a; std::getline(archs, a, ',');) {
    const int arch = std::atoi(a.c_str());  // "90", "90a", "90-real": the leading number
    if (arch <= major * 10 + 9) best_arch = std::max(best_arch, arch);
  }
  return {major, best_arch};
}

// A backward row split over a cluster adds its sums in the order of one block of as many
// threads (for a row one block holds at 4 vectors a thread, the row kernel's layout is the same
// either way): grad_x has the same bits split or not; only the weight gradient's partial
// rows (one per block, or per cluster) may differ. Rows several times the resident clusters, so
// that each cluster reuses both halves of its exchange slots.
TEST(RmsNormTuning, RowsSplitOverClustersKeepTheirBits) {
  FL_SKIP_UNLESS_BACKEND(Device::CUDA);
  constexpr auto G = Device::CUDA;
  const cuda::RmsNormTuning shipped = cuda::rms_norm_tuning();
  struct Restore {
    cuda::RmsNormTuning t;
    ~Restore() { cuda::set_rms_norm_tuning(t); }
  } restore{shipped};
  const auto [major, arch] = device_major_and_built_arch();
  if (arch == 0) GTEST_SKIP() << "architectures not numeric: " << FUSEDLOSS_TEST_CUDA_ARCHS;
  if (!(arch >= 90 && major >= 9))
    GTEST_SKIP() << "thread-block clusters need sm_90 code on an sm_90 device (device sm_" << major
                 << "0, built for " << FUSEDLOSS_TEST_CUDA_ARCHS << ")";
  // rows of 256, 384 and 512 threads, split at 64 threads a block into 4, 6 and 8 blocks, at
  // 128 into 2, 3 and 4: the fewest blocks are whole ones, no warp idle
  struct S { int64_t rows, H; DType d; };
  for (const S sh : {S{1000, 8192, DType::BF16}, S{700, 6144, DType::F32}, S{500, 16384, DType::F16}}) {
    SCOPED_TRACE(std::to_string(sh.H) + " " + to_string(sh.d));
    const int64_t n = sh.rows * sh.H, es = dtype_size(sh.d);
    Buffer x(G, n * es), dy(G, n * es), w(G, sh.H * 4), rstd(G, sh.rows * 4);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (int64_t i = 0; i < n; ++i) {
      store_as(sh.d, x.host(), i, float(normal(rng())));
      store_as(sh.d, dy.host(), i, float(normal(rng())));
    }
    for (int64_t j = 0; j < sh.H; ++j) w.host_as<float>()[j] = float(1.0 + 0.3 * normal(rng()));
    x.upload(); dy.upload(); w.upload();
    const VectorView wv{w.data(), sh.H, DType::F32, G};
    const MatrixView xv{x.data(), sh.rows, sh.H, sh.H, sh.d, G};
    Buffer y(G, n * es);
    rms_norm_forward(xv, wv, RmsNormOptions{}, {y.data(), sh.rows, sh.H, sh.H, sh.d, G},
                     rstd.data_as<float>());
    auto grad_x = [&](const char* tuning, int expected_split) {
      cuda::set_rms_norm_tuning(cuda::parse_rms_norm_tuning(tuning));
      EXPECT_EQ(cuda::rms_norm_backward_row_split(sh.H, sh.d, DType::F32), expected_split);
      Buffer dx(G, n * es), gw(G, sh.H * 4);
      dx.poison();
      rms_norm_backward({dy.data(), sh.rows, sh.H, sh.H, sh.d, G}, xv, wv, rstd.data_as<float>(),
                        RmsNormOptions{}, {dx.data(), sh.rows, sh.H, sh.H, sh.d, G},
                        gw.data_as<float>());
      dx.download();
      const auto* p = static_cast<const unsigned char*>(dx.host());
      return std::vector<unsigned char>(p, p + dx.bytes());
    };
    const auto whole = grad_x("bwd_cluster_threads=0", 1);
    const int threads = int(sh.H * es / 16 / 4);  // 4 vectors a thread
    for (auto [split, blocks] : {std::pair{"bwd_cluster_threads=64", threads / 64},
                                 std::pair{"bwd_cluster_threads=128", threads / 128}}) {
      SCOPED_TRACE(split);
      EXPECT_TRUE(grad_x(split, blocks) == whole) << "grad_x";
    }
  }
}

// The column sum overlaps the row kernel (dependent_launch.cuh) on every device whose code
// was built for sm_90 or later; the guard that keeps it off elsewhere must not keep it off there.
TEST(RmsNormTuning, ColumnSumOverlappedOnHopper) {
  FL_SKIP_UNLESS_BACKEND(Device::CUDA);
  const auto [major, best_arch] = device_major_and_built_arch();
  std::printf("device sm_%d0, built for %s: column sum overlapped = %d\n", major,
              FUSEDLOSS_TEST_CUDA_ARCHS, int(cuda::rms_norm_column_sum_overlapped()));
  if (best_arch == 0) GTEST_SKIP() << "architectures not numeric: " << FUSEDLOSS_TEST_CUDA_ARCHS;
  EXPECT_EQ(cuda::rms_norm_column_sum_overlapped(), best_arch >= 90 && major >= 9);
}

// A caller's workspace receives the backward's partial rows while other blocks still read the
// inputs and write grad_x: one that shares memory with any of them is refused, naming both.
TEST(RmsNormBadInputs, WorkspaceApartFromEveryBuffer) {
  FL_SKIP_UNLESS_BACKEND(Device::CUDA);
  constexpr auto G = Device::CUDA;
  constexpr int64_t T = 64, H = 256;
  const size_t ws_bytes = rms_norm_backward_workspace_bytes(T, H, G);
  ASSERT_GT(ws_bytes, 0u);
  // one allocation, each buffer at the start of its own slot, a slot longer than the
  // workspace and a buffer together: a workspace placed at a buffer's start overlaps that
  // buffer and no other, one ending in a buffer's first bytes only that buffer
  const size_t slot = ws_bytes + size_t(T * H * 4) + 256;
  Buffer all(G, 8 * slot);
  auto at = [&](int i) { return all.data_as<char>() + i * slot; };
  auto m = [&](int i) { return MatrixView{at(i), T, H, H, DType::F32, G}; };
  const MatrixView dy = m(0), x = m(1), dx = m(2), gres = m(3);
  const auto w = reinterpret_cast<float*>(at(4)), rstd = reinterpret_cast<float*>(at(5)),
             gw = reinterpret_cast<float*>(at(6));
  const VectorView wv{w, H, DType::F32, G};
  const RmsNormOptions o;
  auto backward = [&](void* ws) { rms_norm_backward(dy, x, wv, rstd, o, dx, gw, ws, gres); };
  const std::pair<void*, const char*> over[] = {
      {dy.data, "grad_y"}, {x.data, "x_or_s"}, {dx.data, "grad_x"}, {gres.data, "grad_residual_out"},
      {w, "weight"}, {rstd, "rstd"}, {gw, "grad_weight"}};
  for (auto [buffer, name] : over) {
    SCOPED_TRACE(name);
    expect_error([&] { backward(buffer); }, "workspace: overlaps", name);
  }
  // a workspace ending in a buffer's first bytes
  expect_error([&] { backward(at(1) - ws_bytes + 16); }, "workspace: overlaps", "x_or_s");
  backward(at(7));  // its own bytes: accepted
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(RmsNormTuning, ClearErrors) {
  const cuda::RmsNormTuning shipped = cuda::rms_norm_tuning();
  expect_error([] { cuda::parse_rms_norm_tuning("bwd_blok=256"); }, {"unknown field 'bwd_blok'"});
  expect_error([] { cuda::parse_rms_norm_tuning("bwd_block=2x"); }, "bwd_block=2x", "field=integer");
  expect_error([] { cuda::parse_rms_norm_tuning("bwd_prefetch=2"); }, "bwd_prefetch", "0 or 1");
  expect_error([] { cuda::set_rms_norm_tuning(cuda::parse_rms_norm_tuning("bwd_block=1024")); },
               "bwd_block: got 1024", "32..512");
  expect_error([] { cuda::set_rms_norm_tuning(cuda::parse_rms_norm_tuning("fwd_tpr=48")); },
               "fwd_tpr: got 48", "multiples of 32");
  expect_error(
      [] { cuda::set_rms_norm_tuning(cuda::parse_rms_norm_tuning("bwd_cluster_threads=1024")); },
      "bwd_cluster_threads: got 1024", "0..512");
  const cuda::RmsNormTuning t = cuda::parse_rms_norm_tuning("fwd_blocks_per_sm=3,bwd_prefetch=0");
  EXPECT_EQ(t.fwd_blocks_per_sm, 3);
  EXPECT_FALSE(t.bwd_prefetch);
  EXPECT_EQ(t.bwd_block, cuda::RmsNormTuning{}.bwd_block);
  EXPECT_EQ(cuda::rms_norm_tuning().bwd_block, shipped.bwd_block);  // failed sets change nothing
}
#endif

INSTANTIATE_TEST_SUITE_P(Backends, RmsNorm, ::testing::Values(Device::CPU, Device::CUDA),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(RmsNormBadInputs, ClearErrors) {
  constexpr auto C = Device::CPU;
  std::vector<float> x(4 * 8), y(4 * 8), w(8), rstd(4), r(4 * 8), s(4 * 8), g(4 * 8), gx(4 * 8),
      gw(8);
  MatrixView xv{x.data(), 4, 8, 8, DType::F32, C}, yv{y.data(), 4, 8, 8, DType::F32, C};
  VectorView wv{w.data(), 8, DType::F32, C};
  RmsNormOptions o;
  expect_error([&] { rms_norm_forward(xv, {w.data(), 7, DType::F32, C}, o, yv, rstd.data()); },
               "weight.size", "got 7, expected H = 8");
  expect_error([&] { rms_norm_forward(xv, {}, o, yv, rstd.data()); }, "weight.data", "null");
  for (float eps : {0.0f, -1e-5f, NAN, INFINITY}) {
    RmsNormOptions bad;
    bad.eps = eps;
    expect_error([&] { rms_norm_forward(xv, wv, bad, yv, rstd.data()); }, "options.eps",
                 "expected a finite value > 0");
    expect_error([&] { validate_rms_norm_options(bad); }, "options.eps", "finite value > 0");
  }
  validate_rms_norm_options(o);
  // weight dtypes: x's or fp32; 16-bit weights with fp32 x; never fp16 with bf16
  std::vector<uint16_t> x16(4 * 8), y16(4 * 8), w16(8);
  MatrixView xb{x16.data(), 4, 8, 8, DType::BF16, C}, yb{y16.data(), 4, 8, 8, DType::BF16, C};
  expect_error([&] { rms_norm_forward(xb, {w16.data(), 8, DType::F16, C}, o, yb, rstd.data()); },
               "weight.dtype", "got fp16, expected bf16 (x's) or fp32");
  expect_error([&] { rms_norm_forward(xv, {w.data(), 8, DType::FP8_E4M3, C}, o, yv, rstd.data()); },
               "weight.dtype", "fp8_e4m3");
  expect_error([&] { rms_norm_forward(xv, {w.data(), 8, DType::F32, Device::CUDA}, o, yv, rstd.data()); },
               "weight.device", "cuda");
  expect_error([&] { rms_norm_forward(xv, wv, o, yb, rstd.data()); }, "y.dtype", "bf16");
  expect_error([&] { rms_norm_forward(xv, wv, o, {y.data(), 4, 7, 8, DType::F32, C}, rstd.data()); },
               "y: got shape [4, 7]", "expected [4, 8]");
  expect_error([&] { rms_norm_forward(xv, wv, o, {y.data(), 4, 8, 8, DType::F32, Device::CUDA}, rstd.data()); },
               "y.device", "cuda");
  expect_error([&] { rms_norm_forward(xv, wv, o, yv, nullptr); }, "rstd", "null");
  expect_error([&] { rms_norm_forward(xv, wv, o, {x.data() + 8, 3, 8, 8, DType::F32, C}, rstd.data()); },
               "y: got shape", "[4, 8]");
  expect_error([&] { rms_norm_forward(xv, wv, o, xv, rstd.data()); }, "y: overlaps x", "separate");
  expect_error([&] { rms_norm_forward(xv, wv, o, yv, y.data() + 3); }, "rstd: overlaps", "y");
  MatrixView rv{r.data(), 4, 8, 8, DType::F32, C}, sv{s.data(), 4, 8, 8, DType::F32, C};
  expect_error([&] { rms_norm_forward(xv, wv, o, yv, rstd.data(), rv); }, "residual_out", "null");
  expect_error([&] { rms_norm_forward(xv, wv, o, yv, rstd.data(), {}, sv); }, "residual_out",
               "no residual was given");
  expect_error([&] { rms_norm_forward(xv, wv, o, yv, rstd.data(), rv, yv); },
               "residual_out: overlaps y", "separate");
  expect_error([&] { rms_norm_forward(xv, wv, o, yv, rstd.data(), rv, rv); },
               "residual_out: overlaps residual", "separate");
  expect_error([&] { rms_norm_forward(xv, wv, o, yv, rstd.data(), {r.data(), 4, 8, 8, DType::F16, C}, sv); },
               "residual.dtype", "fp16");

  MatrixView gv{g.data(), 4, 8, 8, DType::F32, C}, gxv{gx.data(), 4, 8, 8, DType::F32, C};
  expect_error([&] { rms_norm_backward(gv, xv, wv, rstd.data(), o, gxv, nullptr); }, "grad_weight",
               "null");
  expect_error([&] { rms_norm_backward(gv, xv, wv, nullptr, o, gxv, gw.data()); }, "rstd", "null");
  expect_error([&] { rms_norm_backward(gv, xv, wv, rstd.data(), o, gxv, gw.data(), DType::FP8_E4M3); },
               "grad_weight_dtype: got fp8_e4m3", "fp32, bf16 or fp16");
  expect_error([&] { rms_norm_backward(gv, xv, wv, rstd.data(), o, gxv, gw.data(), DType(9)); },
               "grad_weight_dtype: got 9", "fp32, bf16 or fp16");
  expect_error([&] {
    rms_norm_backward(gv, xv, wv, rstd.data(), o, gxv,
                      reinterpret_cast<char*>(gw.data()) + 1, DType::BF16);
  }, "grad_weight", "2-byte aligned");
  expect_error([&] { rms_norm_backward(gv, xv, {w.data(), 9, DType::F32, C}, rstd.data(), o, gxv, gw.data()); },
               "weight.size", "9");
  expect_error([&] { rms_norm_backward({g.data(), 4, 8, 8, DType::BF16, C}, xv, wv, rstd.data(), o, gxv, gw.data()); },
               "grad_y.dtype", "bf16");
  expect_error([&] { rms_norm_backward({g.data(), 3, 8, 8, DType::F32, C}, xv, wv, rstd.data(), o, gxv, gw.data()); },
               "grad_y: got shape [3, 8]", "[4, 8]");
  // grad_x may be grad_y or x_or_s itself, never a shifted view of them
  expect_error([&] { rms_norm_backward({g.data(), 3, 8, 8, DType::F32, C}, {x.data(), 3, 8, 8, DType::F32, C}, wv,
                                       rstd.data(), o, {g.data() + 8, 3, 8, 8, DType::F32, C}, gw.data()); },
               "grad_x: overlaps grad_y", "same view");
  expect_error([&] { rms_norm_backward(gv, xv, wv, rstd.data(), o, gxv, gx.data() + 4); },
               "overlaps", "grad_weight");
  expect_error([&] { rms_norm_backward(gv, xv, wv, rstd.data(), o, gxv, gw.data(),
                                       reinterpret_cast<char*>(gw.data()) + 4); },
               "workspace", "16-byte aligned");
  expect_error([&] { rms_norm_backward(gv, xv, wv, rstd.data(), o, gxv, gw.data(), nullptr,
                                       {r.data(), 4, 9, 9, DType::F32, C}); },
               "grad_residual_out: got shape [4, 9]", "[4, 8]");
  // given with no rows for 4 rows of x: refused, not taken for absent (its gradient dropped)
  expect_error([&] { rms_norm_backward(gv, xv, wv, rstd.data(), o, gxv, gw.data(), nullptr,
                                       {r.data(), 0, 8, 8, DType::F32, C}); },
               "grad_residual_out: got shape [0, 8]", "[4, 8]");
  expect_error([&] { rms_norm_backward_workspace_bytes(-1, 8, C); }, "rows", "-1");
  expect_error([&] { rms_norm_backward_workspace_bytes(4, 0, C); }, "hidden", "0");
}

}  // namespace
}  // namespace fusedloss::test

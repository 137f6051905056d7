// Cross-entropy on one process, every backend (CPU always; CUDA when a GPU is present),
// against the float64 reference with fresh random inputs.
#include "common/ce_harness.h"
#include "core/cross_entropy_math.h"
#include "cpu/vector_rows.h"

namespace fusedloss::test {
namespace {

class CrossEntropy : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { FL_SKIP_UNLESS_BACKEND(GetParam()); }
  void check(const CeCase& c) { expect_matches_reference(GetParam(), c); }
};

TEST_P(CrossEntropy, EveryDtypeAndIndexType) {
  for (DType d : {DType::F32, DType::F16, DType::BF16})
    for (IndexType it : {IndexType::I32, IndexType::I64}) {
      CeCase c;
      c.dtype = d;
      c.itype = it;
      c.rows = 13;
      c.V = 2051;
      check(c);
    }
}

TEST_P(CrossEntropy, IgnoreIndexRows) {
  for (int64_t ignore : {int64_t(-100), int64_t(7), int64_t(-1)}) {
    CeCase c;
    c.opt.ignore_index = ignore;
    c.ignore_fraction = 0.4;
    c.rows = 40;
    check(c);
  }
}

TEST_P(CrossEntropy, LabelSmoothingBothFormulas) {
  for (auto formula : {SmoothingFormula::PyTorch, SmoothingFormula::Megatron})
    for (float ls : {0.1f, 0.5f})
      for (DType d : {DType::F32, DType::BF16}) {
        CeCase c;
        c.opt.label_smoothing = ls;
        c.opt.smoothing_formula = formula;
        c.dtype = d;
        c.ignore_fraction = 0.2;
        check(c);
      }
}

TEST_P(CrossEntropy, PartitionScopeAtTp1EqualsGlobal) {
  CeCase c;
  c.opt.label_smoothing = 0.2f;
  c.opt.smoothing_formula = SmoothingFormula::Megatron;
  c.opt.smoothing_scope = SmoothingScope::Partition;  // V_local == V_global at TP=1
  check(c);
}

TEST_P(CrossEntropy, ZLoss) {
  for (float z : {1e-4f, 0.1f}) {
    CeCase c;
    c.opt.z_loss = z;
    c.opt.label_smoothing = 0.1f;
    c.ignore_fraction = 0.25;
    check(c);
  }
}

// Gemma-2's soft cap: every reduction, the gradient in place and in the forward (which takes
// the stats and gradient kernels apart when capped), with smoothing and z-loss, rows long
// enough for the cluster kernel's length.
TEST_P(CrossEntropy, LogitSoftcap) {
  for (auto red : {Reduction::None, Reduction::Sum, Reduction::Mean})
    for (DType d : {DType::F32, DType::BF16})
      for (bool in_forward : {false, true}) {
        if (in_forward && red == Reduction::None) continue;
        CeCase c;
        c.opt.logit_softcap = 3.0f;
        c.opt.reduction = red;
        c.dtype = d;
        c.V = red == Reduction::Sum ? 131072 : 2051;
        c.rows = red == Reduction::Sum ? 5 : 23;
        c.grad_in_forward = in_forward;
        c.in_place = in_forward;
        c.ignore_fraction = 0.2;
        c.opt.label_smoothing = red == Reduction::Mean ? 0.1f : 0.0f;
        c.opt.z_loss = 1e-3f;
        check(c);
      }
}

TEST_P(CrossEntropy, EveryReduction) {
  for (auto red : {Reduction::None, Reduction::Sum, Reduction::Mean})
    for (bool in_place : {false, true}) {
      CeCase c;
      c.opt.reduction = red;
      c.in_place = in_place;
      c.ignore_fraction = 0.3;
      c.dtype = DType::BF16;
      check(c);
    }
}

TEST_P(CrossEntropy, StridedRowsAndUnalignedBases) {
  for (int64_t pad : {1, 3, 8, 13})
    for (int64_t offset : {0, 1, 5})
      for (DType d : {DType::F32, DType::BF16}) {
        CeCase c;
        c.pad = pad;
        c.base_offset = offset;
        c.dtype = d;
        c.V = 517;
        c.rows = 9;
        c.in_place = (pad + offset) % 2 == 0;
        check(c);
      }
}

TEST_P(CrossEntropy, EdgeShapes) {
  for (int64_t V : {1, 2, 3, 7, 8, 9, 15, 17, 4097}) {
    CeCase c;
    c.V = V;
    c.rows = 5;
    c.dtype = V % 2 ? DType::F16 : DType::F32;
    check(c);
  }
  for (auto red : {Reduction::None, Reduction::Sum, Reduction::Mean}) {
    CeCase zero_rows;
    zero_rows.rows = 0;
    zero_rows.opt.reduction = red;
    check(zero_rows);
  }
}

TEST_P(CrossEntropy, EveryAlignmentHeadAndTail) {
  // Row r of V = 50257 in bf16 starts 2r bytes past a 16-byte boundary, so 9 rows walk every
  // head length (50258, 50259, 50263: other steps through the heads; fp32: every 4-byte
  // head); the body ends in a partial step of the row walk and a tail of every length; V = 7
  // and 1 are shorter than a vector. An offset base shifts every row once more.
  for (int64_t V : {50257, 50258, 50259, 50263, 7, 1})
    for (DType d : {DType::F32, DType::F16, DType::BF16})
      for (bool in_place : {false, true})
        for (int64_t offset : {0, 3}) {
          CeCase c;
          c.V = V;
          c.rows = 9;
          c.dtype = d;
          c.in_place = in_place;
          c.base_offset = offset;
          c.opt.label_smoothing = offset ? 0.1f : 0.0f;  // the sum of logits walked too
          check(c);
        }
}

// The gradient written in the forward (Sum/Mean) and scaled in the backward: every dtype, the
// unaligned row walk (V = 50257, offset bases), rows shorter than a vector, in place and into
// a buffer of its own, smoothing and z-loss, ignored rows; a unit upstream gradient (nothing
// scaled) and others.
TEST_P(CrossEntropy, GradientInForward) {
  for (auto red : {Reduction::Sum, Reduction::Mean})
    for (DType d : {DType::F32, DType::F16, DType::BF16})
      for (int64_t V : {50257, 4096, 7, 1})
        for (bool in_place : {false, true}) {
          CeCase c;
          c.grad_in_forward = true;
          c.opt.reduction = red;
          c.dtype = d;
          c.V = V;
          c.rows = V > 4096 ? 9 : 21;
          c.in_place = in_place;
          c.base_offset = in_place ? 3 : 0;
          c.ignore_fraction = 0.3;
          c.upstream = V == 4096 ? 0.0f : 1.0f;
          c.opt.label_smoothing = V == 7 ? 0.1f : 0.0f;
          c.opt.smoothing_formula = SmoothingFormula::Megatron;
          c.opt.z_loss = V == 50257 ? 1e-3f : 0.0f;
          check(c);
        }
  CeCase strided;  // rows off the 16-byte boundary into an aligned buffer: the 3-pass path
  strided.grad_in_forward = true;
  strided.pad = 3;
  strided.dtype = DType::BF16;
  check(strided);
  // A gradient buffer of its own at another offset: 16 bytes on (rows of both on the boundary:
  // the fused kernel) and 6 bytes on (the two kernels).
  for (int64_t goff : {8, 3}) {
    CeCase moved;
    moved.grad_in_forward = true;
    moved.dtype = DType::BF16;
    moved.V = 1024;
    moved.grad_offset = goff;
    check(moved);
  }
  // Thousands of rows: the fused kernel's resident grid takes several rows a block (its row
  // loop, the next row's target, the cache reused).
  CeCase many;
  many.grad_in_forward = true;
  many.in_place = true;
  many.dtype = DType::BF16;
  many.rows = 2500;
  many.V = 1000;
  many.ignore_fraction = 0.1;
  many.opt.reduction = Reduction::Sum;
  check(many);
}

// Long rows: on sm_90 the cluster kernel splits 200 KB into 5 slices, 256 KB + 16 B into 6,
// fp32 800 KB into 8 of 100 KB, and fp32 1.9 MB does not fit 8 slices (the 3 passes); before
// sm_90 these rows are longer than twice the fused kernel's cache (the 3 passes). Rows on 16
// bytes whose body ends in a tail (a stride padded to 16 bytes: the fused kernel). For the
// cluster kernel also a stride padded by a whole vector, int32 targets, one row alone, clusters
// of 2 and 7 blocks, wide logit spreads, smoothing (the sum of logits over a cluster) with the
// Megatron formula, z-loss.
TEST_P(CrossEntropy, GradientInForwardLongRows) {
  struct Row {
    DType d;
    int64_t V, rows, pad;
    IndexType itype;
    float scale, smoothing, z_loss;
    Reduction reduction;
    bool in_place;
  };
  const auto I32 = IndexType::I32, I64 = IndexType::I64;
  const auto Sum = Reduction::Sum, Mean = Reduction::Mean;
  for (const Row& l : {Row{DType::BF16, 100000, 70, 0, I64, 3.0f, 0.0f, 0.0f, Mean, true},
                       Row{DType::BF16, 131080, 9, 0, I64, 3.0f, 0.0f, 0.0f, Mean, false},
                       Row{DType::F32, 200000, 5, 0, I64, 3.0f, 0.1f, 0.0f, Mean, true},
                       Row{DType::F32, 480000, 3, 0, I64, 3.0f, 0.1f, 0.0f, Mean, true},
                       Row{DType::BF16, 4093, 40, 3, I64, 3.0f, 0.0f, 1e-3f, Sum, true},
                       Row{DType::F32, 4094, 40, 2, I64, 3.0f, 0.1f, 1e-3f, Sum, true},
                       Row{DType::F16, 100003, 9, 5, I64, 3.0f, 0.0f, 1e-3f, Sum, false},
                       Row{DType::BF16, 80000, 7, 8, I32, 3.0f, 0.1f, 0.0f, Sum, false},
                       Row{DType::BF16, 151936, 1, 0, I64, 3.0f, 0.1f, 0.0f, Sum, true},
                       Row{DType::F16, 120000, 5, 0, I32, 30.0f, 0.0f, 0.0f, Sum, true},
                       Row{DType::F32, 90000, 4, 4, I64, 20.0f, 0.0f, 0.0f, Mean, false}}) {
    CeCase c;
    c.grad_in_forward = true;
    c.dtype = l.d;
    c.V = l.V;
    c.rows = l.rows;
    c.pad = l.pad;
    c.itype = l.itype;
    c.scale = l.scale;
    c.in_place = l.in_place;
    c.ignore_fraction = l.rows > 1 ? 0.2 : 0.0;
    c.opt.reduction = l.reduction;
    c.opt.label_smoothing = l.smoothing;
    c.opt.smoothing_formula = SmoothingFormula::Megatron;
    c.opt.z_loss = l.z_loss;
    c.upstream = l.rows == 9 || l.rows == 1 ? 0.0f : 1.0f;  // 0: random, the scale runs
    check(c);
  }
}

TEST_P(CrossEntropy, AllRowsIgnoredGivesZeroNotNaN) {
  for (auto red : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
    CeCase c;
    c.ignore_fraction = 1.0;
    c.opt.reduction = red;
    c.in_place = true;
    CeRun run = run_case(GetParam(), c);
    for (float l : run.loss) EXPECT_EQ(l, 0.0f);
    for (float g : run.grad) ASSERT_EQ(g, 0.0f);
    EXPECT_EQ(run.valid_count, 0.0f);
  }
}

TEST_P(CrossEntropy, LargeLogitsStayFinite) {
  // Logits of magnitude ~M: the loss and lse stay finite and exact to fp32 rounding. The
  // backward reads lse as one fp32 value, so p = exp(x - lse) carries ~M * 2^-24 absolute error
  // in its exponent: gradients are checked to that bound.
  for (auto [dtype, scale] : {std::pair{DType::F32, 1e4f}, std::pair{DType::F16, 2e4f}}) {
    CeCase c;
    c.scale = scale;  // fp16 values are clamped to +-6e4, the top of its range
    c.dtype = dtype;
    c.rows = 8;
    SCOPED_TRACE(c.describe());
    CeRun run = run_case(GetParam(), c);
    RefResult ref = reference_for(c, run);
    for (int64_t r = 0; r < c.rows; ++r) {
      ASSERT_TRUE(std::isfinite(run.lse[r]) && std::isfinite(run.loss[0]));
      EXPECT_NEAR(run.lse[r], ref.lse[r], 2e-6 * std::fabs(ref.lse[r]));
    }
    double total = 0;
    for (double l : ref.loss) total += l;
    EXPECT_NEAR(run.loss[0], total / c.rows, 1e-5 * total / c.rows + 1e-3);
    const double exponent_error = 4.0 * 6e4 * std::ldexp(1.0, -24);  // |x| up to 6e4
    EXPECT_LE(rel_l2(to_double(run.grad), ref.grad), std::max(exponent_error, grad_tolerance(dtype)));
  }
}

TEST_P(CrossEntropy, RowsAtTheBottomOfTheRangeKeepFiniteGradients) {
  // A vocabulary masked with finfo(dtype).min in every column but with a valid target: every
  // logit ~ -3e38 (N(0, 1) on top rounds away). |lse| log2(e) is beyond fp32's range there, so
  // the kernels' one-fma exponent must not be used (it would give inf). The loss is exact
  // (log V, from (max - T) + log s); the gradient is finite but not the uniform softmax: it
  // reads lse as one fp32 value, whose rounding at 3e38 (ulp 2e31) swallows log V, so every
  // p reads 1 (the limit LargeLogitsStayFinite states: an exponent error of |lse| 2^-24). Every
  // path: 3 passes, the gradient in the forward (fused kernel; the cluster kernel on sm_90).
  for (DType d : {DType::F32, DType::BF16})
    for (int64_t V : {3000, 131080})
      for (bool in_forward : {false, true}) {
        CeCase c;
        c.dtype = d;
        c.V = V;
        c.rows = V > 3000 ? 3 : 8;
        c.shift = -3.0e38f;
        c.scale = 1.0f;
        c.grad_in_forward = in_forward;
        c.in_place = in_forward;
        c.upstream = 1.0f;
        c.opt.reduction = in_forward ? Reduction::Sum : Reduction::None;
        SCOPED_TRACE(c.describe());
        CeRun run = run_case(GetParam(), c);
        RefResult ref = reference_for(c, run);
        double total = 0;
        for (double l : ref.loss) total += l;
        if (in_forward) {
          EXPECT_NEAR(run.loss[0], total, 1e-5 * total);
        } else {
          for (int64_t r = 0; r < c.rows; ++r) EXPECT_NEAR(run.loss[r], ref.loss[r], 1e-5 * ref.loss[r]);
        }
        for (size_t i = 0; i < run.grad.size(); ++i)
          ASSERT_TRUE(std::isfinite(run.grad[i]) && std::fabs(run.grad[i]) <= 1.0f) << "gradient " << i;
      }
}

TEST_P(CrossEntropy, LogitsNearALargeOffsetKeepTheLossExact) {
  // Logits C + N(0, 3) with C = 1e4: lse and the target logit are both ~C, so lse - T would
  // carry C * 2^-24 ~ 6e-4 of rounding; (max - T) + log s keeps the loss to fp32 precision of
  // its own size (the rows' losses here are ~5-10). Without label smoothing: its term averages
  // the row's logits, whose fp32 sum (~V * C) carries its own rounding at such offsets.
  for (float shift : {1e4f, -1e4f}) {
    CeCase c;
    c.shift = shift;
    c.rows = 64;
    c.opt.reduction = Reduction::None;
    SCOPED_TRACE(c.describe());
    CeRun run = run_case(GetParam(), c);
    RefResult ref = reference_for(c, run);
    for (int64_t r = 0; r < c.rows; ++r)
      EXPECT_NEAR(run.loss[r], ref.loss[r], 2e-5 * std::fabs(ref.loss[r])) << "row " << r;
  }
}

TEST_P(CrossEntropy, NonFiniteLogitsStayInTheirRow) {
  const Device dev = GetParam();
  const int64_t rows = 4, V = 300;
  Buffer x(dev, rows * V * 4), t(dev, rows * 8), loss(dev, rows * 4), lse(dev, rows * 4);
  std::normal_distribution<float> normal(0, 1);
  for (int64_t i = 0; i < rows * V; ++i) x.host_as<float>()[i] = normal(rng());
  x.host_as<float>()[0 * V + 10] = NAN;
  x.host_as<float>()[1 * V + 20] = INFINITY;
  x.host_as<float>()[2 * V + 30] = -INFINITY;  // a masked column: still a finite loss
  for (int64_t r = 0; r < rows; ++r) t.host_as<int64_t>()[r] = 5;
  x.upload(); t.upload(); loss.poison(); lse.poison();
  CrossEntropyOptions o;
  o.reduction = Reduction::None;
  cross_entropy_forward({x.data(), rows, V, V, DType::F32, dev}, {t.data(), rows, IndexType::I64, dev},
                        o, {loss.data_as<float>(), lse.data_as<float>(), nullptr});
  loss.download();
  EXPECT_FALSE(std::isfinite(loss.host_as<float>()[0]));
  EXPECT_FALSE(std::isfinite(loss.host_as<float>()[1]));
  EXPECT_TRUE(std::isfinite(loss.host_as<float>()[2]));
  EXPECT_TRUE(std::isfinite(loss.host_as<float>()[3]));
  // Rows 2 and 3 against the reference.
  std::vector<double> xd(x.host_as<float>(), x.host_as<float>() + rows * V);
  std::vector<int64_t> td(rows, 5);
  RefResult ref = reference_cross_entropy(xd, rows, V, td, {}, std::vector<double>(rows, 1.0));
  for (int r : {2, 3}) EXPECT_NEAR(loss.host_as<float>()[r], ref.loss[r], 1e-5 * ref.loss[r]);
}

TEST_P(CrossEntropy, Deterministic) {
  // Same inputs twice: bitwise the same loss and gradient.
  const Device dev = GetParam();
  CeCase c;
  c.rows = 64;
  c.V = 3001;
  c.dtype = DType::BF16;
  c.opt.label_smoothing = 0.1f;
  uint64_t state = rng()();
  rng().seed(state);
  CeRun a = run_case(dev, c);
  rng().seed(state);
  CeRun b = run_case(dev, c);
  ASSERT_EQ(a.loss.size(), b.loss.size());
  EXPECT_EQ(0, std::memcmp(a.loss.data(), b.loss.data(), a.loss.size() * 4));
  EXPECT_EQ(0, std::memcmp(a.grad.data(), b.grad.data(), a.grad.size() * 4));
}

// The CPU backend's vectorised row loops: core::host_exp against exp in float64 across fp32's
// range and at its special values; cpu/vector_rows.h's span loops (whichever clone this CPU
// runs) against float64 on rows whose lengths leave every vector tail, and on rows with -inf,
// +inf and NaN.
TEST(CpuRowLoops, HostExpAndSpansAgainstFloat64) {
  double worst = 0;
  for (float x = -87.3f; x < 88.0f; x += 0.00731f) {
    const double want = std::exp(double(x));
    worst = std::max(worst, std::abs(double(core::host_exp(x)) - want) / want);
  }
  EXPECT_LE(worst, 1.2e-7);  // one unit in the last place of fp32
  EXPECT_EQ(core::host_exp(-INFINITY), 0.0f);
  EXPECT_EQ(core::host_exp(-100.0f), 0.0f);  // below 2^-126: flushed, as on the GPU
  EXPECT_EQ(core::host_exp(0.0f), 1.0f);
  EXPECT_TRUE(std::isinf(core::host_exp(INFINITY)) && std::isinf(core::host_exp(89.0f)));
  EXPECT_TRUE(std::isnan(core::host_exp(NAN)));
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (int64_t n : {1, 3, 15, 16, 17, 63, 1000, 1024}) {
    SCOPED_TRACE(::testing::Message() << "n " << n);
    std::vector<float> v(n), out(n);
    for (float& e : v) e = normal(rng());
    double dm = -INFINITY, ds = 0, dsx = 0, mag = 0;
    for (float e : v) dm = std::max(dm, double(e));
    for (float e : v) ds += std::exp(double(e) - dm), dsx += e, mag += std::abs(e);
    float m, sum_exp, sum;
    cpu::span_stats(v.data(), n, &m, &sum_exp, &sum);
    EXPECT_EQ(m, float(dm));
    EXPECT_NEAR(sum_exp, ds, 1e-6 * ds);
    EXPECT_NEAR(sum, dsx, 1e-6 * mag);
    cpu::softmax_grad_span(v.data(), out.data(), n, 1.3f, 0.7f, 0.01f);
    for (int64_t i = 0; i < n; ++i) {  // (the difference rounded to fp32 as the loop takes it)
      const double p = 0.7 * std::exp(double(v[i] - 1.3f)), want = p - 0.01;
      EXPECT_NEAR(out[i], want, 3e-7 * p + 1e-9) << "column " << i;
    }
    cpu::softmax_grad_span(v.data(), v.data(), n, 1.3f, 0.7f, 0.01f);  // in place
    EXPECT_EQ(v, out);
    std::fill(v.begin(), v.end(), -INFINITY);  // a masked span: max -inf, nothing added
    cpu::span_stats(v.data(), n, &m, &sum_exp, &sum);
    EXPECT_EQ(m, -INFINITY);
    EXPECT_EQ(sum_exp, 0.0f);
    v[n / 2] = INFINITY;  // +inf: its term inf - inf is NaN, as the kernels' online sums
    cpu::span_stats(v.data(), n, &m, &sum_exp, &sum);
    EXPECT_EQ(m, INFINITY);
    EXPECT_TRUE(std::isnan(sum_exp));
    v.assign(n, 0.5f);
    v[n - 1] = NAN;  // a NaN reaches the sum
    cpu::span_stats(v.data(), n, &m, &sum_exp, &sum);
    EXPECT_TRUE(std::isnan(sum_exp));
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, CrossEntropy, ::testing::Values(Device::CPU, Device::CUDA),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace fusedloss::test

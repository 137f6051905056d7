// Linear cross-entropy on one process, every backend (CPU always; CUDA when a GPU is present),
// against the float64 reference: every option, both backward modes, chunk boundaries, gradient
// dtypes, accumulation, and the bad inputs of BAD_INPUTS.md.
#include <cstdlib>
#include <string>
#include "common/lce_harness.h"
#if FUSEDLOSS_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace fusedloss::test {
namespace {

class LinearCrossEntropy : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { FL_SKIP_UNLESS_BACKEND(GetParam()); }
  void check(const LceCase& c) { expect_lce_matches_reference(GetParam(), c); }
};

// The (mode, reduction) pairs a case can run in.
const std::pair<LinearCeBackward, Reduction> kModes[] = {
    {LinearCeBackward::Auto, Reduction::Mean},      {LinearCeBackward::InForward, Reduction::Sum},
    {LinearCeBackward::Recompute, Reduction::Mean}, {LinearCeBackward::Recompute, Reduction::Sum},
    {LinearCeBackward::Auto, Reduction::None},
};

TEST_P(LinearCrossEntropy, EveryDtypeModeAndReduction) {
  for (DType d : {DType::F32, DType::F16, DType::BF16})
    for (auto [mode, red] : kModes) {
      LceCase c;
      c.dtype = d;
      c.lo.backward_mode = mode;
      c.ce.reduction = red;
      if (d == DType::F16 && mode == LinearCeBackward::InForward) continue;  // refused: below
      check(c);
    }
}

// fp16: Auto takes Recompute (the loss scale reaches the gradient before fp16 stores it); an
// explicit InForward is refused, naming why.
TEST(LinearCrossEntropyModes, Fp16TakesRecompute) {
  EXPECT_EQ(resolve_linear_ce_backward(LinearCeBackward::Auto, Reduction::Mean, DType::F16),
            LinearCeBackward::Recompute);
  EXPECT_EQ(resolve_linear_ce_backward(LinearCeBackward::Auto, Reduction::Sum, DType::BF16),
            LinearCeBackward::InForward);
  EXPECT_EQ(resolve_linear_ce_backward(LinearCeBackward::Auto, Reduction::Mean, DType::F32),
            LinearCeBackward::InForward);
  expect_error([] { resolve_linear_ce_backward(LinearCeBackward::InForward, Reduction::Sum, DType::F16); },
               {"options.backward_mode: got InForward with fp16 inputs", "expected Recompute or Auto"});
  expect_error([] { resolve_linear_ce_backward(LinearCeBackward::Auto, Reduction::Sum, DType::FP8_E4M3); },
               {"dtype: got fp8_e4m3", "expected F32, BF16 or F16"});
  LceCase c;
  c.dtype = DType::F16;
  c.lo.backward_mode = LinearCeBackward::InForward;
  c.ce.reduction = Reduction::Sum;
  std::mt19937_64 gen(3);
  const LceProblem p = make_lce_problem(c, gen);
  expect_error([&] { run_lce(Device::CPU, c, p); }, {"backward_mode: got InForward with fp16 inputs"});
}

TEST_P(LinearCrossEntropy, IndexTypesAndIgnoreIndex) {
  for (IndexType it : {IndexType::I32, IndexType::I64})
    for (int64_t ignore : {int64_t(-100), int64_t(5)}) {
      LceCase c;
      c.itype = it;
      c.ce.ignore_index = ignore;
      c.ignore_fraction = 0.4;
      check(c);
    }
}

TEST_P(LinearCrossEntropy, ChunkBoundaries) {
  // N not a multiple of the chunk, a chunk of one token, one chunk, a chunk larger than N.
  for (int64_t chunk : {1, 3, 7, 49, 50, 64})
    for (auto [mode, red] : {kModes[0], kModes[2], kModes[4]}) {
      LceCase c;
      c.lo.chunk_rows = chunk;
      c.lo.backward_mode = mode;
      c.ce.reduction = red;
      c.dtype = chunk % 2 ? DType::BF16 : DType::F32;
      check(c);
    }
  // The chunk derived from the workspace bound: one buffer of 5 rows x V_local (rounded to 8)
  // beside the GEMM workspace's eighth (256 bytes here).
  LceCase c;
  c.lo.chunk_rows = 0;
  c.lo.workspace_bytes = 5 * 208 * 2 + 256;
  c.dtype = DType::BF16;
  ASSERT_EQ(linear_cross_entropy_chunk_rows(c.lo, c.N, c.V, c.dtype), 5);
  check(c);
}

TEST_P(LinearCrossEntropy, OddShapes) {
  for (int64_t V : {1, 2, 3, 17, 257})
    for (int64_t H : {1, 5, 64}) {
      LceCase c;
      c.V = V;
      c.H = H;
      c.N = 13;
      c.lo.chunk_rows = 4;
      c.dtype = V % 2 ? DType::F16 : DType::F32;
      check(c);
    }
}

TEST_P(LinearCrossEntropy, LabelSmoothingBothFormulasAndScopes) {
  for (auto formula : {SmoothingFormula::PyTorch, SmoothingFormula::Megatron})
    for (auto scope : {SmoothingScope::Global, SmoothingScope::Partition})
      for (auto [mode, red] : {kModes[0], kModes[4]}) {
        LceCase c;
        c.ce.label_smoothing = 0.1f;
        c.ce.smoothing_formula = formula;
        c.ce.smoothing_scope = scope;  // V_local == V_global at TP=1: the same
        c.lo.backward_mode = mode;
        c.ce.reduction = red;
        check(c);
      }
}

TEST_P(LinearCrossEntropy, ZLossAndSoftcap) {
  for (float z : {0.0f, 1e-3f})
    for (float cap : {0.0f, 1.5f, 30.0f})
      for (auto [mode, red] : {kModes[1], kModes[3], kModes[4]}) {
        LceCase c;
        c.ce.z_loss = z;
        c.ce.label_smoothing = z > 0 ? 0.05f : 0.0f;
        c.lo.logit_softcap = cap;
        c.lo.backward_mode = mode;
        c.ce.reduction = red;
        c.dtype = cap == 1.5f ? DType::BF16 : DType::F32;
        check(c);
      }
}

TEST_P(LinearCrossEntropy, GradientDtypesAccumulationInPlace) {
  for (DType d : {DType::BF16, DType::F16})
    for (DType gd : {DType::F32, d})
      for (auto [mode, red] : {kModes[0], kModes[2], kModes[4]})
        for (bool acc : {false, true}) {
          LceCase c;
          c.dtype = d;
          c.grad_dtype = gd;
          c.lo.backward_mode = mode;
          c.ce.reduction = red;
          c.accumulate_dweight = acc;
          check(c);
        }
  for (DType gd : {DType::F32, DType::BF16}) {
    LceCase c;
    c.dtype = gd;
    c.grad_dtype = gd;
    c.in_place_scale = true;
    check(c);
  }
}

// Reduction::None with row weights: the forward computes the gradients of sum(w * loss) (Auto
// takes InForward), the backward scales them by the c of an upstream gradient c * w; a 0/1 mask
// (Megatron's loss_mask) and arbitrary weights, across chunk boundaries, 16-bit gradients
// scaled in place, accumulation into dweight; fp16 takes Recompute (the weights unread).
TEST_P(LinearCrossEntropy, RowWeightedInForward) {
  for (DType d : {DType::F32, DType::BF16, DType::F16})
    for (int weights : {1, 2})
      for (int64_t chunk : {int64_t(1), int64_t(7), int64_t(64)}) {
        LceCase c;
        c.dtype = d;
        c.ce.reduction = Reduction::None;
        c.row_weights = weights;
        c.lo.chunk_rows = chunk;
        EXPECT_EQ(resolved_mode(c), d == DType::F16 ? LinearCeBackward::Recompute
                                                     : LinearCeBackward::InForward);
        check(c);
      }
  LceCase c;
  c.dtype = c.grad_dtype = DType::BF16;
  c.ce.reduction = Reduction::None;
  c.row_weights = 1;
  c.in_place_scale = true;
  check(c);
  c.in_place_scale = false;
  c.grad_dtype = DType::F32;
  c.accumulate_dweight = true;
  c.ce.label_smoothing = 0.1f;
  c.lo.logit_softcap = 5.0f;
  check(c);
}

TEST_P(LinearCrossEntropy, VocabBlockedRecompute) {
  // Vocabulary blocks outside, token chunks inside: blocks of 1 column, odd blocks, one block,
  // a block wider than V_local; every option that reads the column index.
  for (int64_t block : {1, 7, 64, 203, 500})
    for (auto red : {Reduction::Mean, Reduction::None}) {
      LceCase c;
      c.lo.backward_mode = LinearCeBackward::Recompute;
      c.lo.vocab_block = block;
      c.ce.reduction = red;
      c.ce.label_smoothing = 0.1f;
      c.ce.z_loss = 1e-3f;
      c.lo.logit_softcap = block == 7 ? 2.0f : 0.0f;
      c.dtype = block % 2 ? DType::BF16 : DType::F32;
      c.grad_dtype = c.dtype;
      c.accumulate_dweight = block == 64;
      check(c);
    }
  // One chunk of every token (the block's dweight GEMM writes the caller's rows directly), in
  // the weight's dtype and fp32, written and accumulated; and two chunks (the fp32 block).
  for (int64_t chunk : {int64_t(0), int64_t(50), int64_t(49)})
    for (DType gd : {DType::BF16, DType::F32})
      for (bool acc : {false, true}) {
        LceCase c;
        c.lo.backward_mode = LinearCeBackward::Recompute;
        c.lo.vocab_block = 64;
        c.lo.chunk_rows = chunk;
        c.dtype = DType::BF16;
        c.grad_dtype = gd;
        c.accumulate_dweight = acc;
        check(c);
      }
  // A workspace whose one chunk holds every token of a 48-column block but not of a 64-column
  // one: the block shrinks to 48 (no fp32 block), the result stays exact.
  for (auto red : {Reduction::Mean, Reduction::None}) {
    LceCase c;
    c.lo.backward_mode = LinearCeBackward::Recompute;
    c.lo.vocab_block = 64;
    c.lo.chunk_rows = 0;
    c.lo.workspace_bytes = 6000;  // 5488 bytes beside the GEMM's 512: 42 rows of 64, 57 of 48
    c.ce.reduction = red;
    c.dtype = DType::BF16;
    c.grad_dtype = DType::BF16;
    ASSERT_EQ(linear_cross_entropy_chunk_rows(c.lo, c.N, 64, DType::BF16), 42);
    ASSERT_EQ(linear_cross_entropy_chunk_rows(c.lo, c.N, 48, DType::BF16), 50);
    check(c);
  }
  LceCase zero;
  zero.N = 0;
  zero.lo.backward_mode = LinearCeBackward::Recompute;
  zero.lo.vocab_block = 50;
  LceProblem p = make_lce_problem(zero, rng());
  for (double g : run_lce(GetParam(), zero, p).dweight) ASSERT_EQ(g, 0.0);
}

TEST_P(LinearCrossEntropy, StridedHiddenAndTf32) {
  for (int64_t pad : {1, 8}) {
    LceCase c;
    c.hidden_pad = pad;
    c.dtype = pad == 1 ? DType::F16 : DType::BF16;
    check(c);
  }
  for (auto [mode, red] : {kModes[0], kModes[4]}) {
    LceCase c;
    c.lo.allow_tf32 = true;
    c.lo.backward_mode = mode;
    c.ce.reduction = red;
    check(c);
  }
}

TEST_P(LinearCrossEntropy, ZeroRowsAndAllIgnored) {
  for (auto [mode, red] : kModes) {
    LceCase c;
    c.N = 0;
    c.lo.backward_mode = mode;
    c.ce.reduction = red;
    LceProblem p = make_lce_problem(c, rng());
    LceResult got = run_lce(GetParam(), c, p);
    if (red != Reduction::None) EXPECT_EQ(got.loss[0], 0.0f);
    EXPECT_EQ(got.valid_count, 0.0f);
    for (double g : got.dweight) ASSERT_EQ(g, 0.0);
  }
  for (auto [mode, red] : kModes) {
    LceCase c;
    c.ignore_fraction = 1.0;
    c.lo.backward_mode = mode;
    c.ce.reduction = red;
    LceProblem p = make_lce_problem(c, rng());
    LceResult got = run_lce(GetParam(), c, p);
    for (double l : got.loss) EXPECT_EQ(l, 0.0);  // Mean over no rows: 0, not NaN
    for (double g : got.dhidden) ASSERT_EQ(g, 0.0);
    for (double g : got.dweight) ASSERT_EQ(g, 0.0);
  }
}

TEST_P(LinearCrossEntropy, LargerProblemManyChunks) {
  // Many chunks through the two-buffer pipeline, with the default chunking on a small bound.
  LceCase c;
  c.N = 300;
  c.H = 96;
  c.V = 1001;
  c.dtype = DType::BF16;
  c.lo.chunk_rows = 0;
  c.lo.workspace_bytes = 2 * 16 * 1008 * 2;  // 28 tokens per chunk beside the GEMM's 7936 bytes
  for (auto [mode, red] : {kModes[0], kModes[4]}) {
    c.lo.backward_mode = mode;
    c.ce.reduction = red;
    check(c);
  }
}

TEST_P(LinearCrossEntropy, GemmTilesLargerThanTheStage) {
  // On the CPU with a BLAS, 16-bit operands are staged as fp32 tiles in at least 1 MiB: here
  // no GEMM fits it whole, so the logits, dhidden and dweight GEMMs run in m x n tiles and
  // k blocks (H > 256, V_local > 256, chunks > 256 tokens), 16-bit outputs among them.
  for (DType d : {DType::BF16, DType::F16})
    for (DType gd : {DType::F32, d}) {
      LceCase c;
      c.N = 300;
      c.H = 300;
      c.V = 1100;
      c.dtype = d;
      c.grad_dtype = gd;
      c.lo.chunk_rows = 0;
      c.lo.workspace_bytes = size_t(2) << 20;  // one chunk of 300 tokens; a stage of 1 MiB
      c.accumulate_dweight = gd == DType::F32;  // Auto: InForward in bf16, Recompute in fp16
      check(c);
    }
}

// linear_cross_entropy_local_stats (with c's bias, if any) + cross_entropy_merge (one part)
// == the forward, row by row.
void expect_split_form_matches_forward(Device dev, const LceCase& c, const LceProblem& p) {
  const LceResult whole = run_lce(dev, c, p);
  Buffer hidden(dev, c.N * c.H * 2), weight(dev, c.V * c.H * 2), bias(dev, c.V * 2),
      target(dev, c.N * 8), stats(dev, c.N * sizeof(RowStats)), loss(dev, c.N * 4),
      lse(dev, c.N * 4), count(dev, 4);
  for (int64_t i = 0; i < c.N * c.H; ++i) store_as(c.dtype, hidden.host(), i, p.hidden[i]);
  for (int64_t i = 0; i < c.V * c.H; ++i) store_as(c.dtype, weight.host(), i, p.weight[i]);
  if (c.bias)
    for (int64_t i = 0; i < c.V; ++i) store_as(c.dtype, bias.host(), i, p.bias[i]);
  std::memcpy(target.host(), p.target.data(), c.N * 8);
  hidden.upload(); weight.upload(); bias.upload(); target.upload();
  MatrixView hv{hidden.data(), c.N, c.H, c.H, c.dtype, dev};
  MatrixView wv{weight.data(), c.V, c.H, c.H, c.dtype, dev};
  IndexView tv{target.data(), c.N, IndexType::I64, dev};
  const VectorView bv = c.bias ? VectorView{bias.data(), c.V, c.dtype, dev} : VectorView{};
  linear_cross_entropy_local_stats(hv, wv, tv, c.ce, c.lo, stats.data_as<RowStats>(), nullptr,
                                   nullptr, 0, bv);
  cross_entropy_merge(stats.data_as<RowStats>(), 1, stats.data_as<RowStats>(), tv, c.ce, c.V,
                      {loss.data_as<float>(), lse.data_as<float>(), count.data_as<float>()});
  loss.download(); lse.download();
  for (int64_t r = 0; r < c.N; ++r) {
    EXPECT_NEAR(loss.host_as<float>()[r], whole.loss[r], 1e-5 * (1 + std::fabs(whole.loss[r])));
    EXPECT_NEAR(lse.host_as<float>()[r], whole.lse[r], 1e-5 * (1 + std::fabs(whole.lse[r])));
  }
}

TEST_P(LinearCrossEntropy, SplitFormMatchesTheForward) {
  for (float cap : {0.0f, 2.0f}) {
    LceCase c;
    c.dtype = DType::BF16;
    c.lo.logit_softcap = cap;
    c.ce.reduction = Reduction::None;
    c.ce.label_smoothing = 0.1f;
    expect_split_form_matches_forward(GetParam(), c, make_lce_problem(c, rng()));
  }
}

TEST_P(LinearCrossEntropy, BiasEveryModeDtypeAndOption) {
  // The bias in the inputs' dtype and in fp32, its gradient in fp32 and in the bias's dtype,
  // over 8 chunks of 7 tokens, every mode and reduction, with the options that read the
  // biased logit (soft-cap, smoothing, z-loss, ignored rows).
  for (DType d : {DType::F32, DType::BF16, DType::F16})
    for (auto [mode, red] : kModes)
      for (int bias : {1, 2}) {
        if (d == DType::F16 && mode == LinearCeBackward::InForward) continue;
        LceCase c;
        c.dtype = d;
        c.grad_dtype = bias == 1 ? d : DType::F32;
        c.lo.backward_mode = mode;
        c.ce.reduction = red;
        c.bias = bias;
        c.dbias_dtype = bias == 1 ? d : DType::F32;
        c.lo.logit_softcap = bias == 2 ? 3.0f : 0.0f;
        c.ce.label_smoothing = bias == 1 ? 0.1f : 0.0f;
        c.ce.z_loss = bias == 2 ? 1e-3f : 0.0f;
        check(c);
      }
}

TEST_P(LinearCrossEntropy, BiasRowWeightsVocabBlocksAndInPlace) {
  for (int rw : {1, 2}) {  // the row-weighted in-forward gradients, dbias among them
    LceCase c;
    c.ce.reduction = Reduction::None;
    c.row_weights = rw;
    c.bias = 1;
    c.dtype = rw == 1 ? DType::F32 : DType::BF16;
    check(c);
  }
  for (int64_t block : {1, 7, 64, 500})  // vocabulary blocks: each block's columns of dbias
    for (DType dbd : {DType::F32, DType::BF16}) {
      LceCase c;
      c.lo.backward_mode = LinearCeBackward::Recompute;
      c.lo.vocab_block = block;
      c.dtype = DType::BF16;
      c.grad_dtype = DType::BF16;
      c.bias = 1;
      c.dbias_dtype = dbd;
      c.lo.logit_softcap = block == 7 ? 2.0f : 0.0f;
      check(c);
    }
  for (DType dbd : {DType::F32, DType::BF16}) {  // scaled in place (fp32) or out of the saved
    LceCase c;
    c.dtype = DType::BF16;
    c.grad_dtype = DType::BF16;
    c.in_place_scale = true;
    c.bias = 1;
    c.dbias_dtype = dbd;
    check(c);
  }
  for (auto mode : {LinearCeBackward::InForward, LinearCeBackward::Recompute}) {
    LceCase c;  // a bias that needs no gradient: the loss and the others still see it
    c.lo.backward_mode = mode;
    c.bias = 1;
    c.dbias = false;
    check(c);
  }
  for (int64_t chunk : {int64_t(1), int64_t(0)}) {  // one token a chunk; one chunk of all
    LceCase c;
    c.lo.chunk_rows = chunk;
    c.bias = 2;
    check(c);
  }
}

TEST_P(LinearCrossEntropy, BiasZeroRows) {
  // No tokens: a zero bias gradient, both modes.
  for (auto mode : {LinearCeBackward::InForward, LinearCeBackward::Recompute}) {
    LceCase c;
    c.N = 0;
    c.lo.backward_mode = mode;
    c.ce.reduction = Reduction::Sum;
    c.bias = 1;
    LceProblem p = make_lce_problem(c, rng());
    const LceResult got = run_lce(GetParam(), c, p);
    ASSERT_EQ(got.dbias.size(), size_t(c.V));
    for (double g : got.dbias) ASSERT_EQ(g, 0.0);
  }
}

TEST_P(LinearCrossEntropy, BiasSplitFormMatchesTheForward) {
  LceCase c;
  c.dtype = DType::BF16;
  c.lo.logit_softcap = 2.0f;
  c.ce.reduction = Reduction::None;
  c.bias = 1;
  c.dbias = false;
  expect_split_form_matches_forward(GetParam(), c, make_lce_problem(c, rng()));
}

TEST_P(LinearCrossEntropy, PipelineVariantsMatchTheReference) {
  // Every variant of the chunk pipeline, over many chunks (the last one short) with the
  // chunking derived from the workspace, in both backward modes.
  const std::pair<const char*, const char*> variants[] = {
      {"FUSEDLOSS_LCE_BUFFERS", "1"},       {"FUSEDLOSS_LCE_DHIDDEN", "group"},
      {"FUSEDLOSS_LCE_SIDE_STREAM", "0"},   {"FUSEDLOSS_LCE_GEMM_ALGOS", "4"},
      {"FUSEDLOSS_LCE_TIMING", "1"},        {"FUSEDLOSS_LCE_CE_ROWS", "5"},
      {"FUSEDLOSS_LCE_CE_ROWS", "1"},       {"FUSEDLOSS_LCE_CE_ROWS", "16"},
      {"FUSEDLOSS_LCE_DH_PIECES", "3"},     {"FUSEDLOSS_LCE_DH_PIECES", "16"}};
  for (auto [name, value] : variants) {
    SCOPED_TRACE(std::string(name) + "=" + value);
    // over two buffers, so the overlap, the two-chunk dweight GEMM and DHIDDEN=group run
    ScopedEnv two("FUSEDLOSS_LCE_BUFFERS", "2");
    ScopedEnv env(name, value);
    LceCase c;
    c.N = 150;
    c.H = 48;
    c.V = 301;
    c.dtype = DType::BF16;
    c.lo.chunk_rows = 0;
    c.lo.workspace_bytes = 2 * 16 * 304 * 2;  // 14 tokens per chunk at 2 buffers, 28 at 1
    for (auto [mode, red] : {kModes[1], kModes[2], kModes[4]}) {
      c.lo.backward_mode = mode;
      c.ce.reduction = red;
      linear_cross_entropy_phase_times(true);
      check(c);
      const LinearCePhaseTimes t = linear_cross_entropy_phase_times(true);
      if (GetParam() == Device::CUDA && std::string(name) == "FUSEDLOSS_LCE_TIMING") {
        // in_forward runs one chunk loop (its backward only scales); recompute one each way
        EXPECT_GE(t.loops, mode == LinearCeBackward::InForward ? 1 : 2);
        EXPECT_GT(t.logits_ms, 0.0);
        EXPECT_GT(t.ce_ms, 0.0);
        EXPECT_GT(t.dhidden_ms, 0.0);
        EXPECT_GT(t.dweight_ms, 0.0);
        EXPECT_GE(t.loop_ms, t.logits_ms);
      } else {
        EXPECT_EQ(t.loops, 0);  // timed only when asked, and only on CUDA
      }
    }
  }
}

TEST(LinearCrossEntropyPlan, TuningFromTheEnvironment) {
  LinearCrossEntropyOptions o;
  o.workspace_bytes = 300000;  // 262624 bytes beside the GEMM workspace: 130 rows of 2016
  EXPECT_EQ(linear_cross_entropy_chunk_rows(o, 1000, 1001, DType::BF16), 128);  // one buffer
  {
    ScopedEnv two("FUSEDLOSS_LCE_BUFFERS", "2");  // two buffers share the workspace
    EXPECT_EQ(linear_cross_entropy_chunk_rows(o, 1000, 1001, DType::BF16), 64);
  }
  const std::pair<const char*, const char*> bad[] = {
      {"FUSEDLOSS_LCE_BUFFERS", "3"},      {"FUSEDLOSS_LCE_DHIDDEN", "pair"},
      {"FUSEDLOSS_LCE_SIDE_STREAM", "yes"}, {"FUSEDLOSS_LCE_GEMM_ALGOS", "0"},
      {"FUSEDLOSS_LCE_GEMM_ALGOS", "4x"},   {"FUSEDLOSS_LCE_TIMING", "2"},
      {"FUSEDLOSS_LCE_CE_ROWS", "-1"},     {"FUSEDLOSS_LCE_DH_PIECES", "0"},
      {"FUSEDLOSS_LCE_DH_PIECES", "17"},   {"FUSEDLOSS_LCE_GEMM_WORKSPACE_MIB", "257"}};
  for (auto [name, value] : bad) {
    ScopedEnv env(name, value);
    expect_error([&] { linear_cross_entropy_chunk_rows(o, 1000, 1001, DType::BF16); },
                 {name, value, "expected"});
  }
}

TEST(LinearCrossEntropyPlan, DefaultWorkspaceIsAtMost256MiB) {
  LinearCrossEntropyOptions o;
  // The buffer and cuBLASLt's 4 MiB together within the 256 MiB default.
  constexpr int64_t kGemmWorkspace = int64_t(4) << 20;
  for (int64_t V : {int64_t(32000), int64_t(128256), int64_t(151936), int64_t(262144)})
    for (DType d : {DType::BF16, DType::F32}) {
      const int64_t chunk = linear_cross_entropy_chunk_rows(o, 1 << 20, V, d);
      const int64_t es = d == DType::F32 ? 4 : 2, stride = (V + 16 / es - 1) / (16 / es) * (16 / es);
      EXPECT_LE(chunk * stride * es + kGemmWorkspace, int64_t(256) << 20) << "V " << V;
      EXPECT_GE(chunk, 64) << "V " << V;
      EXPECT_EQ(chunk % 64, 0) << "V " << V;
    }
  EXPECT_EQ(linear_cross_entropy_chunk_rows(o, 10, 128256, DType::BF16), 10);  // <= N
  // whole 256-row tiles where that costs at most a quarter: 869 rows fit, 768 taken; 1030, 1024
  EXPECT_EQ(linear_cross_entropy_chunk_rows(o, 1 << 20, 151936, DType::BF16), 768);
  EXPECT_EQ(linear_cross_entropy_chunk_rows(o, 1 << 20, 128256, DType::BF16), 1024);
  {
    ScopedEnv cap("FUSEDLOSS_LCE_GEMM_WORKSPACE_MIB", "32");  // 224 MiB left: 915 rows, 768 taken
    EXPECT_EQ(linear_cross_entropy_chunk_rows(o, 1 << 20, 128256, DType::BF16), 768);
  }
  for (auto [fits, taken] : {std::pair<int64_t, int64_t>{600, 512}, {700, 640}, {300, 256},
                            {127, 64}, {63, 63}}) {
    // `fits` rows of 2048 bytes beside the GEMM workspace (an eighth, in 256-byte blocks)
    o.workspace_bytes = size_t(fits) * 1024 * 2 * 8 / 7 + 256;
    EXPECT_EQ(linear_cross_entropy_chunk_rows(o, 1 << 20, 1024, DType::BF16), taken) << fits;
  }
  o.workspace_bytes = 1;
  EXPECT_EQ(linear_cross_entropy_chunk_rows(o, 10, 128256, DType::BF16), 1);  // at least 1
}

// ---- bad inputs ----

struct BadFixture {
  static constexpr int64_t N = 6, H = 8, V = 10;
  Device dev;
  Buffer hidden, weight, target, loss, lse, count, dh, dw, gl;
  explicit BadFixture(Device d)
      : dev(d), hidden(d, N * H * 4), weight(d, V * H * 4), target(d, N * 8), loss(d, N * 4),
        lse(d, N * 4), count(d, 4), dh(d, N * H * 4), dw(d, V * H * 4), gl(d, N * 4) {
    for (int64_t i = 0; i < N * H; ++i) hidden.host_as<float>()[i] = float(i % 5) * 0.1f;
    for (int64_t i = 0; i < V * H; ++i) weight.host_as<float>()[i] = float(i % 3) * 0.1f;
    for (int64_t r = 0; r < N; ++r) target.host_as<int64_t>()[r] = r;
    for (int64_t r = 0; r < N; ++r) gl.host_as<float>()[r] = 1.0f;
    hidden.upload(); weight.upload(); target.upload(); gl.upload();
    loss.poison(); lse.poison();
  }
  MatrixView hv(DType dt = DType::F32) { return {hidden.data(), N, H, H, dt, dev}; }
  MatrixView wv(int64_t cols = H, DType dt = DType::F32) {
    return {weight.data(), V, cols, cols, dt, dev};
  }
  IndexView tv() { return {target.data(), N, IndexType::I64, dev}; }
  LinearCrossEntropyOutputs out() {
    LinearCrossEntropyOutputs o;
    o.loss = loss.data_as<float>();
    o.lse = lse.data_as<float>();
    o.valid_count = count.data_as<float>();
    o.dhidden = {dh.data(), N, H, H, DType::F32, dev};
    o.dweight = {dw.data(), V, H, H, DType::F32, dev};
    return o;
  }
  void forward(const MatrixView& h, const MatrixView& w, const CrossEntropyOptions& ce = {},
               const LinearCrossEntropyOptions& lo = {}) {
    linear_cross_entropy_forward(h, w, tv(), ce, lo, out());
  }
};

class LinearCrossEntropyBadInputs : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { FL_SKIP_UNLESS_BACKEND(GetParam()); }
};

TEST_P(LinearCrossEntropyBadInputs, ShapesDtypesDevicesAndOptions) {
  BadFixture f(GetParam());
  const Device other = GetParam() == Device::CPU ? Device::CUDA : Device::CPU;
  // H mismatch: weight [V, H - 1]
  expect_error([&] { f.forward(f.hv(), f.wv(BadFixture::H - 1)); },
               {"weight", "expected [V_local, 8]", "7"});
  // dtype mismatch
  expect_error([&] { f.forward(f.hv(), f.wv(BadFixture::H, DType::BF16)); },
               {"weight.dtype", "bf16", "fp32"});
  expect_error([&] { f.forward(f.hv(DType::FP8_E4M3), f.wv()); }, {"hidden.dtype", "fp8"});
  // device mismatch
  MatrixView w_other = f.wv();
  w_other.device = other;
  expect_error([&] { f.forward(f.hv(), w_other); }, {"weight.device"});
  IndexView t_other = f.tv();
  t_other.device = other;
  expect_error([&] {
    linear_cross_entropy_forward(f.hv(), f.wv(), t_other, {}, {}, f.out());
  }, {"target.device"});
  // targets of another length
  IndexView t_short = f.tv();
  t_short.size = 5;
  expect_error([&] { linear_cross_entropy_forward(f.hv(), f.wv(), t_short, {}, {}, f.out()); },
               {"target.size", "5", "6"});
  // options
  LinearCrossEntropyOptions lo;
  lo.logit_softcap = -1.0f;
  expect_error([&] { f.forward(f.hv(), f.wv(), {}, lo); }, {"logit_softcap", "-1"});
  lo = {};
  lo.chunk_rows = -2;
  expect_error([&] { f.forward(f.hv(), f.wv(), {}, lo); }, {"chunk_rows", "-2"});
  lo = {};
  lo.vocab_block = -1;
  expect_error([&] { f.forward(f.hv(), f.wv(), {}, lo); }, {"vocab_block", "-1"});
  lo = {};
  lo.chunk_rows = 0;
  lo.workspace_bytes = 0;
  expect_error([&] { f.forward(f.hv(), f.wv(), {}, lo); }, {"workspace_bytes"});
  lo = {};
  lo.backward_mode = LinearCeBackward::InForward;
  CrossEntropyOptions none;
  none.reduction = Reduction::None;
  expect_error([&] { f.forward(f.hv(), f.wv(), none, lo); }, {"backward_mode", "InForward", "None"});
  CrossEntropyOptions ls;
  ls.label_smoothing = 1.5f;
  expect_error([&] { f.forward(f.hv(), f.wv(), ls); }, {"label_smoothing", "1.5"});
  // in-forward gradient buffers of the wrong shape / dtype
  LinearCrossEntropyOutputs o = f.out();
  o.dweight.rows = BadFixture::V - 1;
  expect_error([&] { linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), {}, {}, o); },
               {"out.dweight", "[9, 8]", "[10, 8]"});
  o = f.out();
  o.dhidden.dtype = DType::BF16;
  expect_error([&] { linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), {}, {}, o); },
               {"out.dhidden.dtype", "bf16", "fp32"});
  o = f.out();
  o.dhidden.data = f.hidden.data();
  expect_error([&] { linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), {}, {}, o); },
               {"out.dhidden: overlaps hidden"});
  o = f.out();
  o.dweight.data = f.weight.data();
  expect_error([&] { linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), {}, {}, o); },
               {"out.dweight: overlaps weight"});
  // outputs over each other or over the inputs
  o = f.out();
  o.loss = f.lse.data_as<float>();
  expect_error([&] { linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), {}, {}, o); },
               {"out.loss: overlaps out.lse"});
  o = f.out();
  o.lse = static_cast<float*>(f.dh.data());
  expect_error([&] { linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), {}, {}, o); },
               {"out.lse: overlaps out.dhidden"});
  o = f.out();
  o.valid_count = static_cast<float*>(f.hidden.data()) + 3;
  expect_error([&] { linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), {}, {}, o); },
               {"out.valid_count: overlaps hidden"});
  // a vocabulary whose chunk row would overflow: an Error, not a division by zero
  expect_error([&] { linear_cross_entropy_chunk_rows({}, 4, int64_t(1) << 62, DType::F32); },
               {"vocab_local", "2^40"});
  // InForward (Auto's mode for Mean) without its gradient buffers: named with why
  LinearCrossEntropyOutputs no_grads = f.out();
  no_grads.dweight = {};
  expect_error([&] { linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), {}, {}, no_grads); },
               {"out.dweight: got none, expected a [10, 8] buffer", "InForward", "Recompute needs none"});
  // Nothing was written by any rejected call.
  f.loss.download();
  EXPECT_TRUE(std::isnan(f.loss.host_as<float>()[0]));
  // backward: a null grad_loss, the wrong gradient shape
  LinearCrossEntropyGrads g;
  g.dhidden = {f.dh.data(), BadFixture::N, BadFixture::H, BadFixture::H, DType::F32, f.dev};
  g.dweight = {f.dw.data(), BadFixture::V, BadFixture::H, BadFixture::H, DType::F32, f.dev};
  expect_error([&] {
    linear_cross_entropy_backward(f.hv(), f.wv(), f.tv(), f.lse.data_as<float>(), nullptr,
                                  f.count.data_as<float>(), {}, {}, f.out(), g);
  }, {"grad_loss", "null"});
  expect_error([&] {  // InForward: the forward's gradients are what it scales
    linear_cross_entropy_backward(f.hv(), f.wv(), f.tv(), f.lse.data_as<float>(),
                                  f.gl.data_as<float>(), f.count.data_as<float>(), {}, {}, no_grads, g);
  }, {"saved.dweight: got none", "pass that forward's outputs as `saved`"});
  expect_error([&] {  // what the backward reads must not lie under what it writes
    linear_cross_entropy_backward(f.hv(), f.wv(), f.tv(), static_cast<float*>(f.dh.data()) + 2,
                                  f.gl.data_as<float>(), f.count.data_as<float>(), {}, {}, f.out(), g);
  }, {"grads.dhidden: overlaps lse"});
  LinearCrossEntropyGrads g2 = g;
  g2.dhidden.cols = BadFixture::H + 1;
  g2.dhidden.row_stride = BadFixture::H + 1;
  expect_error([&] {
    linear_cross_entropy_backward(f.hv(), f.wv(), f.tv(), f.lse.data_as<float>(),
                                  f.gl.data_as<float>(), f.count.data_as<float>(), {}, {}, f.out(),
                                  g2);
  }, {"grads.dhidden", "[6, 9]", "[6, 8]"});
  LinearCrossEntropyOptions rec;
  rec.backward_mode = LinearCeBackward::Recompute;
  expect_error([&] {
    linear_cross_entropy_backward(f.hv(), f.wv(), f.tv(), f.lse.data_as<float>(),
                                  f.gl.data_as<float>(), nullptr, {}, rec, f.out(), g);
  }, {"valid_count", "Mean"});
  // In-forward backward: a gradient over the *other* saved gradient (the first scaling would
  // overwrite what the second reads).
  constexpr int64_t N = BadFixture::N, H = BadFixture::H, V = BadFixture::V;
  Buffer big(f.dev, V * H * 4), apart(f.dev, V * H * 4);
  LinearCrossEntropyGrads cross = g;
  cross.dhidden = {f.dw.data(), N, H, H, DType::F32, f.dev};  // over saved.dweight
  cross.dweight = {apart.data(), V, H, H, DType::F32, f.dev};
  expect_error([&] {
    linear_cross_entropy_backward(f.hv(), f.wv(), f.tv(), f.lse.data_as<float>(),
                                  f.gl.data_as<float>(), f.count.data_as<float>(), {}, {}, f.out(),
                                  cross);
  }, {"grads.dhidden: overlaps saved.dweight"});
  LinearCrossEntropyOutputs saved = f.out();
  saved.dhidden = {big.data(), N, H, H, DType::F32, f.dev};
  cross = g;
  cross.dweight = {big.data(), V, H, H, DType::F32, f.dev};  // over saved.dhidden
  expect_error([&] {
    linear_cross_entropy_backward(f.hv(), f.wv(), f.tv(), f.lse.data_as<float>(),
                                  f.gl.data_as<float>(), f.count.data_as<float>(), {}, {}, saved,
                                  cross);
  }, {"grads.dweight: overlaps saved.dhidden"});
  // The split form's stats are refused over what it reads.
  expect_error([&] {
    linear_cross_entropy_local_stats(f.hv(), f.wv(), f.tv(), {}, {},
                                     static_cast<RowStats*>(f.hidden.data()));
  }, {"stats: overlaps hidden"});
  expect_error([&] {
    linear_cross_entropy_local_stats(f.hv(), f.wv(), f.tv(), {}, {},
                                     static_cast<RowStats*>(f.target.data()));
  }, {"stats: overlaps target"});
  // The chunking query checks what it is given.
  expect_error([&] { linear_cross_entropy_chunk_rows({}, -1, 10, DType::F32); }, {"rows: got -1"});
  LinearCrossEntropyOptions zero;
  zero.workspace_bytes = 0;
  expect_error([&] { linear_cross_entropy_chunk_rows(zero, 4, 10, DType::F32); },
               {"options.workspace_bytes: got 0"});
}

// A caller's scratch (forward and local_stats): enough of it gives the bits of the call's own;
// too little, a misaligned block or one over an input is refused before anything is written.
TEST_P(LinearCrossEntropyBadInputs, Bias) {
  BadFixture f(GetParam());
  const Device dev = GetParam(), other = dev == Device::CPU ? Device::CUDA : Device::CPU;
  constexpr int64_t V = BadFixture::V;
  Buffer bias(dev, V * 4), db(dev, V * 4), sdb(dev, V * 4);
  bias.poison(0);
  auto forward = [&](const VectorView& b, float* dbias = nullptr) {
    LinearCrossEntropyOutputs o = f.out();
    o.bias = b;
    o.dbias = dbias;
    linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), {}, {}, o);
  };
  const VectorView good{bias.data(), V, DType::F32, dev};
  VectorView b = good;
  b.size = V - 1;
  expect_error([&] { forward(b); }, {"out.bias.size", "got 9", "V_local = weight.rows = 10"});
  b = good;
  b.dtype = DType::BF16;  // fp32 inputs: an fp32 bias only
  expect_error([&] { forward(b); }, {"out.bias.dtype", "bf16", "fp32"});
  b = good;
  b.device = other;
  expect_error([&] { forward(b); }, {"out.bias.device"});
  b = good;
  b.data = static_cast<char*>(bias.data()) + 2;
  expect_error([&] { forward(b); }, {"out.bias"});
  expect_error([&] { forward({}, db.data_as<float>()); },
               {"out.dbias", "without out.bias", "expected null"});
  // an output over the bias it reads
  expect_error([&] { forward(good, static_cast<float*>(const_cast<void*>(good.data))); },
               {"out.dbias", "out.bias"});
  forward(good, sdb.data_as<float>());  // the forward the backward calls below scale
  auto backward = [&](const VectorView& b, void* dbias, DType dt, float* saved_dbias) {
    LinearCrossEntropyOutputs saved = f.out();
    saved.bias = b;
    saved.dbias = saved_dbias;
    LinearCrossEntropyGrads g{{f.dh.data(), BadFixture::N, BadFixture::H, BadFixture::H,
                               DType::F32, dev},
                              {f.dw.data(), V, BadFixture::H, BadFixture::H, DType::F32, dev}};
    g.dbias = dbias;
    g.dbias_dtype = dt;
    linear_cross_entropy_backward(f.hv(), f.wv(), f.tv(), f.lse.data_as<float>(),
                                  f.gl.data_as<float>(), f.count.data_as<float>(), {}, {}, saved,
                                  g);
  };
  expect_error([&] { backward({}, db.data(), DType::F32, sdb.data_as<float>()); },
               {"grads.dbias", "without saved.bias"});
  expect_error([&] { backward(good, db.data(), DType::BF16, sdb.data_as<float>()); },
               {"grads.dbias dtype", "bf16", "fp32"});
  expect_error([&] { backward(good, db.data(), DType::F32, nullptr); },
               {"saved.dbias", "got null"});
  b = good;
  b.size = V + 1;
  expect_error([&] { backward(b, db.data(), DType::F32, sdb.data_as<float>()); },
               {"saved.bias.size", "got 11"});
  expect_error([&] { backward(good, const_cast<void*>(good.data), DType::F32,
                              sdb.data_as<float>()); },
               {"grads.dbias", "saved.bias"});
  // the right call passes, and the bias was only read
  backward(good, db.data(), DType::F32, sdb.data_as<float>());
  bias.download();
  for (int64_t v = 0; v < V; ++v) ASSERT_EQ(bias.host_as<float>()[v], 0.0f);
  // the split form names its own argument
  b = good;
  b.size = 3;
  expect_error([&] {
    Buffer stats(dev, BadFixture::N * sizeof(RowStats));
    linear_cross_entropy_local_stats(f.hv(), f.wv(), f.tv(), {}, {}, stats.data_as<RowStats>(),
                                     nullptr, nullptr, 0, b);
  }, {"bias.size", "got 3"});
}

TEST_P(LinearCrossEntropyBadInputs, CallersScratch) {
  BadFixture f(GetParam());
  CrossEntropyOptions ce;
  ce.reduction = Reduction::None;
  LinearCrossEntropyOptions lo;
  lo.chunk_rows = 4;  // two chunks
  const size_t need = linear_cross_entropy_forward_scratch_bytes(f.hv(), f.wv(), ce, lo);
  ASSERT_GT(need, 0u);
  Buffer scratch(f.dev, need + 512);
  auto run = [&](void* at, size_t bytes) {
    f.loss.poison();
    LinearCrossEntropyOutputs o = f.out();
    o.scratch = at;
    o.scratch_bytes = bytes;
    linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), ce, lo, o);
    f.loss.download();
    return std::vector<float>(f.loss.host_as<float>(), f.loss.host_as<float>() + BadFixture::N);
  };
  const std::vector<float> own = run(nullptr, 0);
  EXPECT_EQ(run(scratch.data(), need), own);
  expect_error([&] { run(scratch.data(), need - 1); },
               {"out.scratch_bytes: got", "linear_cross_entropy_forward_scratch_bytes"});
  expect_error([&] { run(scratch.data_as<char>() + 4, need); },
               {"out.scratch: got an address that is not a multiple of"});
  // (a scratch at hidden's address: on CUDA `need` reaches past hidden into the buffers
  // allocated after it, and the first pair found may be one of them with the scratch)
  expect_error([&] { run(f.hidden.data(), need); }, {"overlaps", "out.scratch"});
  f.loss.download();
  EXPECT_TRUE(std::isnan(f.loss.host_as<float>()[0]));  // refused before any write

  const size_t stats_need = linear_cross_entropy_local_stats_scratch_bytes(f.hv(), f.wv(), lo);
  Buffer stats(f.dev, BadFixture::N * sizeof(RowStats)), with(f.dev, BadFixture::N * sizeof(RowStats));
  linear_cross_entropy_local_stats(f.hv(), f.wv(), f.tv(), ce, lo, stats.data_as<RowStats>());
  linear_cross_entropy_local_stats(f.hv(), f.wv(), f.tv(), ce, lo, with.data_as<RowStats>(),
                                   nullptr, scratch.data(), stats_need);
  stats.download(), with.download();
  EXPECT_EQ(0, std::memcmp(stats.host(), with.host(), stats.bytes()));
  expect_error([&] {
    linear_cross_entropy_local_stats(f.hv(), f.wv(), f.tv(), ce, lo, with.data_as<RowStats>(),
                                     nullptr, scratch.data(), stats_need - 1);
  }, {"scratch_bytes: got", "linear_cross_entropy_local_stats_scratch_bytes"});
}

// Row weights (Reduction::None, InForward): an upstream gradient that is not c x the weights
// has no scale that gives the true gradients. The host backward throws naming the row; CUDA
// gives NaN gradients and check_device_errors() throws. A non-finite upstream gradient gives
// NaN gradients without an error (as a recomputed backward's would be); all-zero weights with
// a zero upstream gradient give zeros. Row weights with a Sum / Mean, or under an output, are
// refused.
TEST_P(LinearCrossEntropyBadInputs, UpstreamGradientNotProportionalToRowWeights) {
  BadFixture f(GetParam());
  const Device dev = GetParam();
  Buffer rw(dev, BadFixture::N * 4);
  const float mask[BadFixture::N] = {1, 0, 1, 1, 0, 1};
  std::copy(mask, mask + BadFixture::N, rw.host_as<float>());
  rw.upload();
  CrossEntropyOptions none;
  none.reduction = Reduction::None;
  LinearCrossEntropyOutputs out = f.out();
  out.row_weight = rw.data_as<float>();
  Buffer gdh(dev, BadFixture::N * BadFixture::H * 4), gdw(dev, BadFixture::V * BadFixture::H * 4);
  LinearCrossEntropyGrads grads;
  grads.dhidden = {gdh.data(), BadFixture::N, BadFixture::H, BadFixture::H, DType::F32, dev};
  grads.dweight = {gdw.data(), BadFixture::V, BadFixture::H, BadFixture::H, DType::F32, dev};
  auto backward_with = [&](std::initializer_list<float> g) {
    std::copy(g.begin(), g.end(), f.gl.host_as<float>());
    f.gl.upload();
    gdh.poison();
    gdw.poison();
    linear_cross_entropy_backward(f.hv(), f.wv(), f.tv(), f.lse.data_as<float>(),
                                  f.gl.data_as<float>(), nullptr, none, {}, out, grads);
  };
  auto all_of_dhidden = [&](auto pred) {
    gdh.download();
    for (int64_t i = 0; i < BadFixture::N * BadFixture::H; ++i)
      if (!pred(gdh.host_as<float>()[i])) return false;
    return true;
  };
  linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), none, {}, out);
  // row 1 has weight 0 and a gradient; c = 0.5 from row 0
  const std::initializer_list<float> off = {0.5f, 0.25f, 0.5f, 0.5f, 0.0f, 0.5f};
  auto expect_why = [](auto call) {
    expect_error(call, {"grad_loss[1]", "row_weight[1] (Python: loss_mask) is 0", "expected c * row_weight",
                        "Recompute"});
  };
  if (dev == Device::CPU) {
    expect_why([&] { backward_with(off); });
  } else {
    backward_with(off);
    expect_why([&] { check_device_errors(); });
    EXPECT_TRUE(all_of_dhidden([](float v) { return std::isnan(v); }));
  }
  backward_with({0.5f, 0.0f, 0.5f, INFINITY, 0.0f, 0.5f});  // not an error: NaN gradients
  check_device_errors();
  EXPECT_TRUE(all_of_dhidden([](float v) { return std::isnan(v); }));
  backward_with({0.5f, 0.0f, 0.5f, 0.5f, 0.0f, 0.5f});  // fits
  check_device_errors();
  EXPECT_TRUE(all_of_dhidden([](float v) { return std::isfinite(v); }));
  // every weight 0: c = 0, and a zero upstream gradient fits
  for (int64_t r = 0; r < BadFixture::N; ++r) rw.host_as<float>()[r] = 0.0f;
  rw.upload();
  linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), none, {}, out);
  backward_with({0, 0, 0, 0, 0, 0});
  check_device_errors();
  EXPECT_TRUE(all_of_dhidden([](float v) { return v == 0.0f; }));
  // c = g_0 / w_0 overflows to inf: inf * w_i would fit every finite g_i, so it is refused
  const float no_zero[BadFixture::N] = {1e-30f, 1, 1, 1, 1, 1};
  std::copy(no_zero, no_zero + BadFixture::N, rw.host_as<float>());
  rw.upload();
  linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), none, {}, out);
  const std::initializer_list<float> overflowing = {1e10f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  auto expect_overflow = [](auto call) {
    expect_error(call, {"grad_loss[0]", "row_weight[0] (Python: loss_mask) is 1e-30", "expected c * row_weight"});
  };
  if (dev == Device::CPU) {
    expect_overflow([&] { backward_with(overflowing); });
  } else {
    backward_with(overflowing);
    expect_overflow([&] { check_device_errors(); });
    EXPECT_TRUE(all_of_dhidden([](float v) { return std::isnan(v); }));
  }

  CrossEntropyOptions sum;
  sum.reduction = Reduction::Sum;
  expect_error([&] { linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), sum, {}, out); },
               {"out.row_weight", "Sum or Mean", "expected null"});
  LinearCrossEntropyOutputs under = out;  // the weights under dhidden, which the forward writes
  under.row_weight = static_cast<const float*>(out.dhidden.data);
  expect_error([&] { linear_cross_entropy_forward(f.hv(), f.wv(), f.tv(), none, {}, under); },
               {"out.row_weight"});
}

TEST_P(LinearCrossEntropyBadInputs, OutOfRangeTarget) {
  BadFixture f(GetParam());
  f.target.host_as<int64_t>()[3] = BadFixture::V;
  f.target.upload();
  if (GetParam() == Device::CPU) {
    expect_error([&] { f.forward(f.hv(), f.wv()); }, {"target[3]", "10", "[0, 10)"});
    f.loss.download();
    EXPECT_TRUE(std::isnan(f.loss.host_as<float>()[0]));  // checked before any write
  } else {
    CrossEntropyOptions o;
    o.reduction = Reduction::None;
    f.forward(f.hv(), f.wv(), o);
    expect_error([&] { check_device_errors(); }, {"target[3]", "10"});
    f.loss.download();
    EXPECT_TRUE(std::isnan(f.loss.host_as<float>()[3]));
    EXPECT_TRUE(std::isfinite(f.loss.host_as<float>()[2]));
  }
}

#if FUSEDLOSS_HAS_CUDA
// The peak of stream-ordered allocations during a call: the chunk buffers with the cuBLASLt
// workspace (workspace_bytes together) and O(N) floats; never [N, V].
TEST(LinearCrossEntropyCuda, PeakExtraMemoryIsTheWorkspace) {
  std::string why;
  if (!cuda_available(&why)) GTEST_SKIP() << why;
  const int64_t N = 4096, H = 256, V = 32000;
  LceCase c;
  c.N = N;
  c.H = H;
  c.V = V;
  c.dtype = DType::BF16;
  c.grad_dtype = DType::BF16;
  c.lo.chunk_rows = 0;
  c.lo.workspace_bytes = size_t(8) << 20;
  Buffer hidden(Device::CUDA, N * H * 2), weight(Device::CUDA, V * H * 2), target(Device::CUDA, N * 8),
      loss(Device::CUDA, N * 4), lse(Device::CUDA, N * 4), count(Device::CUDA, 4),
      dh(Device::CUDA, N * H * 2), dw(Device::CUDA, V * H * 2), gl(Device::CUDA, N * 4);
  std::memset(hidden.host(), 0, hidden.bytes());
  std::memset(weight.host(), 0, weight.bytes());
  for (int64_t r = 0; r < N; ++r) target.host_as<int64_t>()[r] = r % V, gl.host_as<float>()[r] = 1;
  hidden.upload(); weight.upload(); target.upload(); gl.upload();
  MatrixView hv{hidden.data(), N, H, H, DType::BF16, Device::CUDA};
  MatrixView wv{weight.data(), V, H, H, DType::BF16, Device::CUDA};
  IndexView tv{target.data(), N, IndexType::I64, Device::CUDA};
  for (int variant = 0; variant < 3; ++variant) {
    const Reduction red = variant == 0 ? Reduction::Mean : Reduction::None;
    c.lo.vocab_block = variant == 2 ? 1024 : 0;  // + fp32 [N, H] and [1024, H] accumulators
    CrossEntropyOptions ce;
    ce.reduction = red;
    LinearCrossEntropyOutputs out;
    out.loss = loss.data_as<float>();
    out.lse = lse.data_as<float>();
    out.valid_count = count.data_as<float>();
    out.dhidden = {dh.data(), N, H, H, DType::BF16, Device::CUDA};
    out.dweight = {dw.data(), V, H, H, DType::BF16, Device::CUDA};
    cudaMemPool_t pool;
    ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
    linear_cross_entropy_forward(hv, wv, tv, ce, c.lo, out);  // warm-up
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    uint64_t zero = 0;
    ASSERT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero), cudaSuccess);
    linear_cross_entropy_forward(hv, wv, tv, ce, c.lo, out);
    LinearCrossEntropyGrads g{out.dhidden, out.dweight, false};
    linear_cross_entropy_backward(hv, wv, tv, lse.data_as<float>(), gl.data_as<float>(),
                                  count.data_as<float>(), ce, c.lo, out, g);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    uint64_t high = 0;
    ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high), cudaSuccess);
    const uint64_t blocked = c.lo.vocab_block ? 4 * uint64_t(N + c.lo.vocab_block) * H : 0;
    const uint64_t bound = c.lo.workspace_bytes + 64 * uint64_t(N) + (1 << 20) + blocked;
    EXPECT_LE(high, bound) << "variant " << variant << ": peak " << high
                           << " B, logits would be " << N * V * 2 << " B";
  }
}

// One forward + backward on a caller's stream, eagerly and replayed from a CUDA graph captured
// on that stream (after a warm-up call, which creates the cached side stream and events): the
// side stream joins the capture through the fork event and leaves it through the join.
TEST(LinearCrossEntropyCuda, CallersStreamAndGraphCaptureMatchTheDefaultStream) {
  std::string why;
  if (!cuda_available(&why)) GTEST_SKIP() << why;
  for (auto red : {Reduction::Mean, Reduction::None}) {
    LceCase c;
    c.N = 100;
    c.H = 64;
    c.V = 777;
    c.dtype = DType::BF16;
    c.lo.chunk_rows = 16;  // 7 chunks: three pairs and a single one
    c.ce.reduction = red;
    SCOPED_TRACE(c.describe());
    const LceProblem p = make_lce_problem(c, rng());
    const LceResult eager = run_lce(Device::CUDA, c, p);  // default stream
    const Device dev = Device::CUDA;
    Buffer hidden(dev, c.N * c.H * 2), weight(dev, c.V * c.H * 2), target(dev, c.N * 8),
        loss(dev, c.N * 4), lse(dev, c.N * 4), count(dev, 4), gl(dev, c.N * 4),
        sdh(dev, c.N * c.H * 4), sdw(dev, c.V * c.H * 4), dh(dev, c.N * c.H * 4),
        dw(dev, c.V * c.H * 4);
    for (int64_t i = 0; i < c.N * c.H; ++i) store_as(c.dtype, hidden.host(), i, p.hidden[i]);
    for (int64_t i = 0; i < c.V * c.H; ++i) store_as(c.dtype, weight.host(), i, p.weight[i]);
    std::memcpy(target.host(), p.target.data(), c.N * 8);
    for (int64_t r = 0; r < c.N; ++r)
      gl.host_as<float>()[r] = red == Reduction::None ? p.grad_rows[r] : p.grad_scale;
    hidden.upload(); weight.upload(); target.upload(); gl.upload();
    MatrixView hv{hidden.data(), c.N, c.H, c.H, c.dtype, dev};
    MatrixView wv{weight.data(), c.V, c.H, c.H, c.dtype, dev};
    IndexView tv{target.data(), c.N, IndexType::I64, dev};
    LinearCrossEntropyOutputs out;
    out.loss = loss.data_as<float>();
    out.lse = lse.data_as<float>();
    out.valid_count = count.data_as<float>();
    out.dhidden = {sdh.data(), c.N, c.H, c.H, DType::F32, dev};
    out.dweight = {sdw.data(), c.V, c.H, c.H, DType::F32, dev};
    LinearCrossEntropyGrads g{{dh.data(), c.N, c.H, c.H, DType::F32, dev},
                              {dw.data(), c.V, c.H, c.H, DType::F32, dev}, false};
    cudaStream_t s;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    auto step = [&] {
      linear_cross_entropy_forward(hv, wv, tv, c.ce, c.lo, out, nullptr, s);
      linear_cross_entropy_backward(hv, wv, tv, lse.data_as<float>(), gl.data_as<float>(),
                                    count.data_as<float>(), c.ce, c.lo, out, g, s);
    };
    auto compare = [&](const char* what) {
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess) << what;
      loss.download(); dh.download(); dw.download();
      const int64_t nloss = red == Reduction::None ? c.N : 1;
      for (int64_t i = 0; i < nloss; ++i)
        EXPECT_NEAR(loss.host_as<float>()[i], eager.loss[i], 1e-5 * (1 + std::fabs(eager.loss[i])))
            << what << " loss " << i;
      std::vector<double> h(dh.host_as<float>(), dh.host_as<float>() + c.N * c.H);
      std::vector<double> w(dw.host_as<float>(), dw.host_as<float>() + c.V * c.H);
      EXPECT_LE(rel_l2(h, eager.dhidden), 1e-5) << what << " dhidden";
      EXPECT_LE(rel_l2(w, eager.dweight), 1e-5) << what << " dweight";
    };
    step();  // eager on the caller's stream (and the warm-up of the capture)
    compare("caller's stream");
    loss.poison(); dh.poison(); dw.poison();
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    step();
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    compare("graph replay");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(Backends, LinearCrossEntropy,
                         ::testing::Values(Device::CPU, Device::CUDA),
                         [](const auto& info) { return std::string(to_string(info.param)); });
INSTANTIATE_TEST_SUITE_P(Backends, LinearCrossEntropyBadInputs,
                         ::testing::Values(Device::CPU, Device::CUDA),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace fusedloss::test

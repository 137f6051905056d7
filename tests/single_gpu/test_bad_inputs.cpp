// BAD_INPUTS.md rows that apply to the C++ API: every bad argument gets a fusedloss::Error that
// names the argument and the value, and nothing is written before the check.
#include <cstring>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "common/ce_harness.h"
#include "core/cross_entropy_math.h"
#if FUSEDLOSS_HAS_CUDA
#include <cuda_runtime.h>
#endif
#include "fusedloss/rms_norm.h"
#include "fusedloss/swiglu.h"

namespace fusedloss::test {
namespace {

struct Fixture {
  static constexpr int64_t rows = 4, V = 10;
  Device dev;
  Buffer x, t, loss, lse;
  explicit Fixture(Device d)
      : dev(d), x(d, rows * V * 4), t(d, rows * 8), loss(d, rows * 4), lse(d, rows * 4) {
    for (int64_t i = 0; i < rows * V; ++i) x.host_as<float>()[i] = float(i % 7);
    for (int64_t r = 0; r < rows; ++r) t.host_as<int64_t>()[r] = r;
    x.upload(); t.upload(); loss.poison(); lse.poison();
  }
  MatrixView xv() { return {x.data(), rows, V, V, DType::F32, dev}; }
  IndexView tv() { return {t.data(), rows, IndexType::I64, dev}; }
  CrossEntropyOutputs out() { return {loss.data_as<float>(), lse.data_as<float>(), nullptr}; }
  void forward(const CrossEntropyOptions& o = {}) { cross_entropy_forward(xv(), tv(), o, out()); }
};

class BadInputs : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { FL_SKIP_UNLESS_BACKEND(GetParam()); }
};

TEST_P(BadInputs, OutOfRangeTargetIsReportedAndNeverIndexed) {
  for (int64_t bad : {int64_t(10), int64_t(1) << 40, int64_t(-1), int64_t(-101)}) {
    Fixture f(GetParam());
    f.t.host_as<int64_t>()[2] = bad;
    f.t.upload();
    std::string v = std::to_string(bad);
    if (GetParam() == Device::CPU) {
      expect_error([&] { f.forward(); }, {"target[2]", v.c_str(), "[0, 10)"});
      // checked before any write: the poisoned outputs are untouched
      EXPECT_TRUE(std::isnan(f.loss.host_as<float>()[0]));
    } else {
      CrossEntropyOptions o;
      o.reduction = Reduction::None;
      f.forward(o);  // asynchronous: reported through the device error word
      expect_error([&] { check_device_errors(); }, {"target[2]", v.c_str()});
      f.loss.download();
      EXPECT_TRUE(std::isnan(f.loss.host_as<float>()[2]));
      EXPECT_TRUE(std::isfinite(f.loss.host_as<float>()[1]));
      EXPECT_NO_THROW(check_device_errors());  // the report was cleared
      // The gradient in the forward (in place: the fused kernel): the same report, a NaN loss,
      // that row's gradient NaN and every other row's finite.
      Buffer cnt(f.dev, 4);
      CrossEntropyOutputs out{f.loss.data_as<float>(), f.lse.data_as<float>(),
                              cnt.data_as<float>()};
      cross_entropy_forward_with_grad(f.xv(), f.tv(), CrossEntropyOptions{}, out, f.xv());
      expect_error([&] { check_device_errors(); }, {"target[2]", v.c_str()});
      f.loss.download();
      f.x.download();
      EXPECT_TRUE(std::isnan(f.loss.host_as<float>()[0]));  // the mean over a NaN row
      for (int64_t r = 0; r < f.rows; ++r)
        for (int64_t j = 0; j < f.V; ++j)
          EXPECT_EQ(std::isnan(f.x.host_as<float>()[r * f.V + j]), r == 2) << r << ", " << j;
    }
  }
}

TEST_P(BadInputs, ShapesAndSizes) {
  Fixture f(GetParam());
  MatrixView x = f.xv();
  IndexView t = f.tv();
  t.size = 3;
  expect_error([&] { cross_entropy_forward(x, t, {}, f.out()); }, {"target.size", "3", "4"});
  MatrixView neg = x;
  neg.rows = -1;
  expect_error([&] { cross_entropy_forward(neg, f.tv(), {}, f.out()); }, {"logits.rows", "-1"});
  MatrixView nocols = x;
  nocols.cols = 0;
  expect_error([&] { cross_entropy_forward(nocols, f.tv(), {}, f.out()); }, {"logits.cols", "0"});
  MatrixView stride = x;
  stride.row_stride = 5;
  expect_error([&] { cross_entropy_forward(stride, f.tv(), {}, f.out()); }, {"row_stride", "5"});
  MatrixView null = x;
  null.data = nullptr;
  expect_error([&] { cross_entropy_forward(null, f.tv(), {}, f.out()); }, {"logits.data", "null"});
  CrossEntropyOutputs no_loss = f.out();
  no_loss.loss = nullptr;
  expect_error([&] { cross_entropy_forward(x, f.tv(), {}, no_loss); }, {"out.loss", "null"});
}

TEST_P(BadInputs, DtypesAndDevices) {
  Fixture f(GetParam());
  MatrixView x = f.xv();
  x.dtype = static_cast<DType>(7);
  expect_error([&] { cross_entropy_forward(x, f.tv(), {}, f.out()); }, {"dtype", "7"});
  IndexView t = f.tv();
  t.type = static_cast<IndexType>(5);
  expect_error([&] { cross_entropy_forward(f.xv(), t, {}, f.out()); }, {"target.type", "5"});
  IndexView other = f.tv();
  other.device = GetParam() == Device::CPU ? Device::CUDA : Device::CPU;
  expect_error([&] { cross_entropy_forward(f.xv(), other, {}, f.out()); },
               {"target.device", to_string(other.device), to_string(GetParam())});
}

TEST_P(BadInputs, Options) {
  Fixture f(GetParam());
  auto with = [&](auto edit) {
    CrossEntropyOptions o;
    edit(o);
    return [&f, o] { f.forward(o); };
  };
  expect_error(with([](auto& o) { o.label_smoothing = 1.0f; }), {"label_smoothing", "1", "[0, 1)"});
  expect_error(with([](auto& o) { o.label_smoothing = -0.1f; }), {"label_smoothing", "-0.1"});
  expect_error(with([](auto& o) { o.label_smoothing = NAN; }), {"label_smoothing", "nan"});
  expect_error(with([](auto& o) { o.z_loss = -1.0f; }), {"z_loss", "-1"});
  expect_error(with([](auto& o) { o.reduction = static_cast<Reduction>(9); }), {"reduction", "9"});
  expect_error(with([](auto& o) { o.smoothing_formula = static_cast<SmoothingFormula>(4); }),
               {"smoothing_formula", "4"});
  expect_error(with([](auto& o) { o.vocab_global = 5; }), {"vocab_global", "5"});
  expect_error(with([](auto& o) { o.vocab_start = 3; }), {"vocab_start", "3"});
  // sharded options without a communicator
  expect_error(with([](auto& o) { o.vocab_global = 20; }), {"vocab_global", "20", "communicator"});
  EXPECT_TRUE(std::isnan(f.loss.host_as<float>()[0])) << "an output was written before the error";
}

TEST_P(BadInputs, MegatronSmoothingNeedsTwoColumns) {
  const Device dev = GetParam();
  Buffer x(dev, 8), t(dev, 16), loss(dev, 4), lse(dev, 8);
  CrossEntropyOptions o;
  o.label_smoothing = 0.1f;
  o.smoothing_formula = SmoothingFormula::Megatron;
  expect_error([&] {
    cross_entropy_forward({x.data(), 2, 1, 1, DType::F32, dev}, {t.data(), 2, IndexType::I64, dev}, o,
                          {loss.data_as<float>(), lse.data_as<float>(), nullptr});
  }, {"label_smoothing", "K = 1"});
}

TEST_P(BadInputs, BackwardBuffers) {
  Fixture f(GetParam());
  Buffer grad(f.dev, f.rows * f.V * 4), gl(f.dev, 4), cnt(f.dev, 4);
  f.forward();
  MatrixView g{grad.data(), f.rows, f.V, f.V, DType::F32, f.dev};
  auto backward = [&](MatrixView gv, const float* count) {
    cross_entropy_backward(f.xv(), f.tv(), f.lse.data_as<float>(), gl.data_as<float>(), count, {}, gv);
  };
  MatrixView wrong_shape = g;
  wrong_shape.cols = 9;
  expect_error([&] { backward(wrong_shape, cnt.data_as<float>()); }, {"grad_logits", "9"});
  MatrixView wrong_dtype = g;
  wrong_dtype.dtype = DType::BF16;
  expect_error([&] { backward(wrong_dtype, cnt.data_as<float>()); }, {"grad_logits.dtype", "bf16"});
  MatrixView shifted = f.xv();  // overlaps the logits one element off: never allowed
  shifted.data = static_cast<float*>(shifted.data) + 1;
  shifted.rows = f.rows - 1;
  MatrixView xs = f.xv();
  xs.rows = f.rows - 1;
  expect_error([&] {
    cross_entropy_backward(xs, {f.t.data(), f.rows - 1, IndexType::I64, f.dev}, f.lse.data_as<float>(),
                           gl.data_as<float>(), cnt.data_as<float>(), {}, shifted);
  }, {"grad_logits", "overlaps"});
  expect_error([&] { backward(g, nullptr); }, {"valid_count", "Mean"});
  // The buffers the kernel reads while it writes the gradient must not be the gradient's memory.
  MatrixView logits_in_place = f.xv();
  expect_error([&] {
    cross_entropy_backward(f.xv(), {f.x.data(), f.rows, IndexType::I64, f.dev}, f.lse.data_as<float>(),
                           gl.data_as<float>(), cnt.data_as<float>(), {}, logits_in_place);
  }, {"grad_logits: overlaps target", "expected a separate buffer"});
  expect_error([&] {
    cross_entropy_backward(f.xv(), f.tv(), f.lse.data_as<float>(),
                           static_cast<float*>(grad.data()) + 5, cnt.data_as<float>(), {}, g);
  }, {"grad_logits: overlaps grad_loss"});
  expect_error([&] {
    cross_entropy_backward(f.xv(), f.tv(), static_cast<float*>(grad.data()) + 30,
                           gl.data_as<float>(), cnt.data_as<float>(), {}, g);
  }, {"grad_logits: overlaps lse"});
  expect_error([&] {
    cross_entropy_backward(f.xv(), f.tv(), f.lse.data_as<float>(), gl.data_as<float>(),
                           static_cast<float*>(grad.data()) + 39, {}, g);
  }, {"grad_logits: overlaps valid_count"});
}

// A view whose address does not start an element of its dtype: the kernels load whole elements
// (a CUDA fault), so it is refused, naming the view. Checked before anything runs, on any backend.
TEST_P(BadInputs, ViewsStartOnAnElement) {
  Fixture f(GetParam());
  char* x = static_cast<char*>(f.x.data());
  expect_error([&] {
    cross_entropy_forward({x + 1, f.rows, 4, f.V, DType::F32, f.dev}, f.tv(), {}, f.out());
  }, {"logits.data", "not 4-byte aligned", "fp32 element"});
  expect_error([&] {
    cross_entropy_forward({x + 2, f.rows, 4, f.V, DType::F32, f.dev}, f.tv(), {}, f.out());
  }, {"logits.data", "not 4-byte aligned"});
  expect_error([&] {
    cross_entropy_forward({x + 1, f.rows, 4, f.V, DType::BF16, f.dev}, f.tv(), {}, f.out());
  }, {"logits.data", "not 2-byte aligned", "bf16 element"});
  char* t = static_cast<char*>(f.t.data());
  MatrixView three{f.x.data(), f.rows - 1, f.V, f.V, DType::F32, f.dev};
  expect_error([&] {
    cross_entropy_forward(three, {t + 4, f.rows - 1, IndexType::I64, f.dev}, {}, f.out());
  }, {"target.data", "not 8-byte aligned", "int64 element"});
  // RMSNorm's weight and SwiGLU's bias and weights are vectors: the same rule
  Buffer w(f.dev, 64), rs(f.dev, 16), y(f.dev, f.rows * 8 * 4);
  MatrixView x8{f.x.data(), f.rows, 8, f.V, DType::F32, f.dev}, y8{y.data(), f.rows, 8, 8, DType::F32, f.dev};
  expect_error([&] {
    rms_norm_forward(x8, {w.data_as<char>() + 2, 8, DType::F32, f.dev}, {}, y8, rs.data_as<float>());
  }, {"weight.data", "not 4-byte aligned"});
  MatrixView x16{f.x.data(), f.rows, 8, 8, DType::BF16, f.dev};
  expect_error([&] {
    swiglu_forward(x16, {w.data_as<char>() + 1, 8, DType::BF16, f.dev}, {}, {},
                   {y.data(), f.rows, 4, 4, DType::BF16, f.dev});
  }, {"bias.data", "not 2-byte aligned"});
  expect_error([&] {
    swiglu_forward(x8, {}, {w.data_as<char>() + 2, f.rows, DType::F32, f.dev}, {}, {y.data(), f.rows, 4, 4, DType::F32, f.dev});
  }, {"weights.data", "not 4-byte aligned"});
}

// Outputs that overlap each other or the inputs: refused, naming the pair, before any write.
TEST_P(BadInputs, ForwardOutputsApart) {
  Fixture f(GetParam());
  Buffer cnt(f.dev, 4);
  CrossEntropyOptions none;
  none.reduction = Reduction::None;
  float* lse = f.lse.data_as<float>();
  expect_error([&] { cross_entropy_forward(f.xv(), f.tv(), {}, {lse, lse, nullptr}); },
               {"out.loss: overlaps out.lse"});
  expect_error([&] { cross_entropy_forward(f.xv(), f.tv(), {}, {f.loss.data_as<float>(), lse, lse + 1}); },
               {"out.lse: overlaps out.valid_count"});
  expect_error([&] {
    cross_entropy_forward(f.xv(), f.tv(), none, {f.loss.data_as<float>(), f.x.data_as<float>() + 10, nullptr});
  }, {"out.lse: overlaps logits"});
  expect_error([&] {
    cross_entropy_forward(f.xv(), f.tv(), {}, {f.loss.data_as<float>(), lse, static_cast<float*>(f.t.data())});
  }, {"out.valid_count: overlaps target"});
  // a logits extent past 2^63 bytes is refused, not wrapped (the overlap checks add it)
  expect_error([&] {
    cross_entropy_forward({f.x.data(), int64_t(1) << 61, 2, 8, DType::F32, f.dev}, f.tv(), {}, f.out());
  }, {"logits: got [", "fits in 2^63 bytes"});
  expect_error([&] {
    cross_entropy_forward({f.x.data(), f.rows, f.V, f.V, DType(7), f.dev}, f.tv(), {}, f.out());
  }, {"logits.dtype: got 7", "expected fp32, fp16 or bf16"});
  CrossEntropyOptions far;
  far.vocab_start = INT64_MAX;
  far.vocab_global = 8;
  expect_error([&] { validate_cross_entropy_options(far, 4, 8); }, {"options.vocab_start", "expected in [0, 0]"});
}

// The split passes refuse outputs that share memory with what they read (or each other), as
// the whole forward does; a well-formed call with separate buffers runs.
TEST_P(BadInputs, SplitPassOutputsApart) {
  Fixture f(GetParam());
  constexpr int64_t R = Fixture::rows;
  Buffer stats(f.dev, R * sizeof(RowStats) * 3), gmax(f.dev, R * 4), cnt(f.dev, 4);
  stats.poison();
  RowStats* s = stats.data_as<RowStats>();
  expect_error([&] { cross_entropy_local_stats(f.xv(), f.tv(), {}, f.x.data_as<RowStats>()); },
               {"stats: overlaps logits"});
  expect_error([&] { cross_entropy_local_stats(f.xv(), f.tv(), {}, static_cast<RowStats*>(f.t.data())); },
               {"stats: overlaps target"});
  cross_entropy_local_stats(f.xv(), f.tv(), {}, s);
  expect_error([&] { cross_entropy_prepare_sum(s, gmax.data_as<float>(), f.tv(), {}, f.V, 0, s, f.dev); },
               {"summable: overlaps local"});
  expect_error([&] {
    cross_entropy_prepare_sum(s, reinterpret_cast<float*>(s + R) + 2, f.tv(), {}, f.V, 0, s + R, f.dev);
  }, {"summable: overlaps global_max"});
  float* inside = reinterpret_cast<float*>(s + 1);
  expect_error([&] { cross_entropy_merge(s, 1, s, f.tv(), {}, f.V, {f.loss.data_as<float>(), inside, nullptr}); },
               {"out.lse: overlaps combined"});
  expect_error([&] {
    cross_entropy_merge(s, 1, s, f.tv(), {}, f.V, {f.loss.data_as<float>(), f.lse.data_as<float>(),
                                                   f.lse.data_as<float>() + 2});
  }, {"out.lse: overlaps out.valid_count"});
  CrossEntropyOptions partition;
  partition.label_smoothing = 0.1f;
  partition.smoothing_scope = SmoothingScope::Partition;
  expect_error([&] {
    cross_entropy_merge(s, 1, s + R, f.tv(), partition, f.V,
                        {f.loss.data_as<float>(), reinterpret_cast<float*>(s + R), nullptr});
  }, {"out.lse: overlaps local"});
  // separate buffers: the merge writes the loss
  f.loss.poison();
  cross_entropy_merge(s, 1, s, f.tv(), {}, f.V, {f.loss.data_as<float>(), f.lse.data_as<float>(), nullptr});
  f.loss.download();
  EXPECT_TRUE(std::isfinite(f.loss.host_as<float>()[0]));
}

TEST_P(BadInputs, GradientInForward) {
  Fixture f(GetParam());
  Buffer grad(f.dev, f.rows * f.V * 4), cnt(f.dev, 4);
  MatrixView g{grad.data(), f.rows, f.V, f.V, DType::F32, f.dev};
  CrossEntropyOutputs out{f.loss.data_as<float>(), f.lse.data_as<float>(), cnt.data_as<float>()};
  auto with_grad = [&](const CrossEntropyOptions& o, MatrixView gv, CrossEntropyOutputs outs) {
    cross_entropy_forward_with_grad(f.xv(), f.tv(), o, outs, gv);
  };
  CrossEntropyOptions none;
  none.reduction = Reduction::None;
  expect_error([&] { with_grad(none, g, out); }, {"options.reduction", "None", "Sum or Mean"});
  MatrixView wrong_shape = g;
  wrong_shape.rows = 3;
  expect_error([&] { with_grad({}, wrong_shape, out); }, {"grad_logits", "[3, 10]", "[4, 10]"});
  MatrixView wrong_dtype = g;
  wrong_dtype.dtype = DType::BF16;
  expect_error([&] { with_grad({}, wrong_dtype, out); }, {"grad_logits.dtype", "bf16", "fp32"});
  MatrixView shifted = f.xv();  // overlaps the logits one element off: never allowed
  shifted.data = static_cast<float*>(shifted.data) + 1;
  expect_error([&] {
    cross_entropy_forward_with_grad(f.xv(), f.tv(), {}, out, shifted);
  }, {"grad_logits", "overlaps"});
  // the forward's own outputs inside the gradient: named as the caller passed them
  float* in_grad = static_cast<float*>(grad.data()) + 5;
  expect_error([&] { with_grad({}, g, {in_grad, out.lse, out.valid_count}); },
               {"grad_logits: overlaps out.loss"});
  expect_error([&] { with_grad({}, g, {out.loss, in_grad, out.valid_count}); },
               {"grad_logits: overlaps out.lse"});
  expect_error([&] { with_grad({}, g, {out.loss, out.lse, in_grad}); },
               {"grad_logits: overlaps out.valid_count"});
  CrossEntropyOutputs no_count = out;
  no_count.valid_count = nullptr;
  expect_error([&] { with_grad({}, g, no_count); }, {"out.valid_count", "Mean"});
  // refused before anything is written
  grad.poison();
  f.lse.poison();
  expect_error([&] { with_grad(none, f.xv(), out); }, {"options.reduction"});
  f.x.download(); f.lse.download();
  EXPECT_EQ(f.x.host_as<float>()[5], 5.0f);
  EXPECT_TRUE(std::isnan(f.lse.host_as<float>()[0]));
  expect_error([&] { cross_entropy_scale_grad(g, nullptr); }, {"grad_loss", "null"});
  expect_error([&] { cross_entropy_scale_grad(g, static_cast<const float*>(grad.data()) + 3); },
               {"grad_logits: overlaps grad_loss"});
}

// A communicator whose collectives fail, as a broken MPI/NCCL hook would.
class FailingCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  Device device() const override { return Device::CPU; }
  void all_gather(const void*, void*, size_t, Stream) override {
    throw Error("MPI_Allgather failed: simulated transport error");
  }
  void all_reduce(float*, size_t, ReduceOp, Stream) override {
    throw Error("MPI_Allreduce failed: simulated transport error");
  }
};

TEST(BadInputsHook, CollectiveFailurePropagatesWithItsMessage) {
  Fixture f(Device::CPU);
  FailingCommunicator comm;
  CrossEntropyOptions o;
  o.vocab_global = 2 * f.V;
  expect_error([&] { cross_entropy_forward(f.xv(), f.tv(), o, f.out(), &comm); },
               {"MPI_Allgather failed", "simulated"});
  EXPECT_TRUE(std::isnan(f.loss.host_as<float>()[0])) << "an output was written despite the failure";
}

// The targets' checksum of the agreement, pinned to one value that the Python agreement's test
// pins too (python/tests/test_vocab_parallel.py): the two implementations stay in step.
TEST(BadInputsHook, TargetChecksumTestVector) {
  const int64_t targets[] = {5, -100, 0, 151935, 7};
  uint64_t sum = 0;
  for (int64_t r = 0; r < 5; ++r) sum += core::target_checksum_term(targets[r], r);
  EXPECT_EQ(sum, 0x7f5c27945f2feaaaull);
  // with row weights (the loss_mask's), -0 read as 0
  const float weights[] = {1.0f, 0.0f, -0.0f, 0.5f, 2.0f};
  for (int64_t r = 0; r < 5; ++r) sum += core::row_weight_checksum_term(weights[r], r, 5);
  EXPECT_EQ(sum, 0x3317c8adca28a5c0ull);
  // every NaN (sign, payload, signalling) is the one quiet NaN
  const int64_t three[] = {5, -100, 0};
  const uint32_t weight_bits[] = {0xffc00001u, 0x3f800000u, 0x7f800001u};
  sum = 0;
  for (int64_t r = 0; r < 3; ++r) {
    float w;
    memcpy(&w, &weight_bits[r], 4);
    sum += core::target_checksum_term(three[r], r) + core::row_weight_checksum_term(w, r, 3);
  }
  EXPECT_EQ(sum, 0x90776f2527e8f90cull);
}

// A communicator whose own size, rank or gather is wrong; throws a foreign exception on demand.
class BrokenCommunicator final : public Communicator {
 public:
  BrokenCommunicator(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::CPU; }
  void all_gather(const void* send, void* recv, size_t bytes, Stream) override {
    if (foreign) throw std::runtime_error("transport closed");
    // every slot gets a zeroed header: this rank's own never comes back
    std::memset(recv, 0, bytes * size_t(size_));
    (void)send;
  }
  void all_reduce(float*, size_t, ReduceOp, Stream) override {}
  bool foreign = false;

 private:
  int rank_, size_;
};

// The communicator's size and rank are checked before anything relies on them (a size of 0
// used to leave this rank's checks unread and return -inf after reading past a buffer); its
// foreign exceptions arrive as Error; a gather that loses this rank's header is refused.
TEST(BadInputsHook, BrokenCommunicatorIsRefused) {
  Fixture f(Device::CPU);
  CrossEntropyOptions o;
  for (auto [rank, size, what] : {std::tuple{0, 0, "comm.size(): got 0, expected 1..65536"},
                                  std::tuple{0, -1, "comm.size(): got -1"},
                                  std::tuple{0, 1 << 30, "comm.size(): got 1073741824"},
                                  std::tuple{2, 2, "comm.rank(): got 2, expected 0..1"},
                                  std::tuple{-1, 1, "comm.rank(): got -1, expected 0..0"}}) {
    BrokenCommunicator comm(rank, size);
    expect_error([&] { cross_entropy_forward(f.xv(), f.tv(), o, f.out(), &comm); }, {what});
    expect_error([&] { cross_entropy_forward_with_grad(f.xv(), f.tv(), o, f.out(), f.xv(), &comm); },
                 {what});
    EXPECT_TRUE(std::isnan(f.loss.host_as<float>()[0])) << what;
  }
  BrokenCommunicator comm(0, 2);
  o.vocab_global = 2 * f.V;
  expect_error([&] { cross_entropy_forward(f.xv(), f.tv(), o, f.out(), &comm); },
               {"comm.all_gather: slot 1 holds the header of rank 0"});
  comm.foreign = true;
  expect_error([&] { cross_entropy_forward(f.xv(), f.tv(), o, f.out(), &comm); },
               {"comm.all_gather: transport closed"});
  try {  // the communicator's own exception travels nested in the Error
    cross_entropy_forward(f.xv(), f.tv(), o, f.out(), &comm);
  } catch (const Error& e) {
    EXPECT_THROW(std::rethrow_if_nested(e), std::runtime_error);
  }
  EXPECT_TRUE(std::isnan(f.loss.host_as<float>()[0]));
}

// The shape-only validator runs the entry points' own option checks, with their messages,
// without any data pointer (callers validate before allocating, e.g. on fake tensors).
TEST(BadInputsValidators, CrossEntropyOptionsWithoutData) {
  Fixture f(Device::CPU);
  CrossEntropyOptions o;
  EXPECT_NO_THROW(validate_cross_entropy_options(o, 4, 10));
  EXPECT_NO_THROW(validate_cross_entropy_options(o, 0, 1));
  o.label_smoothing = 1.0f;
  std::string from_forward;
  try {
    f.forward(o);
  } catch (const Error& e) {
    from_forward = e.what();
  }
  expect_error([&] { validate_cross_entropy_options(o, 4, 10); }, {from_forward.c_str()});
  EXPECT_NE(from_forward.find("options.label_smoothing"), std::string::npos) << from_forward;
  // a floating-point value keeps its decimal point: the user passed 1.0, not the integer 1
  EXPECT_NE(from_forward.find("got 1.0,"), std::string::npos) << from_forward;
  o = {};
  o.vocab_start = 8;
  o.vocab_global = 16;
  EXPECT_NO_THROW(validate_cross_entropy_options(o, 4, 8));
  expect_error([&] { validate_cross_entropy_options(o, 4, 10); }, {"vocab_start", "8", "[0, 6]"});
  expect_error([&] { validate_cross_entropy_options({}, -1, 10); }, {"rows", "-1"});
  expect_error([&] { validate_cross_entropy_options({}, 4, 0); }, {"vocab_local", "0"});
}

#if FUSEDLOSS_HAS_CUDA
// Two ranks on one GPU as a device communicator sees them: rank 0's buffers gathered into
// both slots (a peer with identical inputs; the agreement header's first field, the rank, set
// to 1 in the peer's slot); `tamper` alters the peer's copy of the header at `byte`.
class MirrorCudaCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  Device device() const override { return Device::CUDA; }
  void all_gather(const void* send, void* recv, size_t bytes, Stream stream) override {
    auto s = static_cast<cudaStream_t>(stream);
    char* out = static_cast<char*>(recv);
    for (int r = 0; r < 2; ++r)
      ASSERT_EQ(cudaMemcpyAsync(out + r * bytes, send, bytes, cudaMemcpyDeviceToDevice, s), cudaSuccess);
    if (++gathers == 1) {  // the agreement's header: kept for the test to read
      header.resize(bytes);
      ASSERT_EQ(cudaMemcpyAsync(header.data(), send, bytes, cudaMemcpyDeviceToHost, s), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
      static const int64_t peer = 1;
      ASSERT_EQ(cudaMemcpyAsync(out + bytes, &peer, 8, cudaMemcpyHostToDevice, s), cudaSuccess);
      if (tamper) ASSERT_EQ(cudaMemsetAsync(out + bytes + byte, 0x5a, 1, s), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    }
  }
  std::vector<unsigned char> header;
  void all_reduce(float*, size_t, ReduceOp, Stream) override {}
  bool tamper = false;
  size_t byte = 0;
  int gathers = 0;
};

// The agreement's checksum of CUDA targets is computed on the device into the staged header:
// identical peers pass, a peer whose checksum differs is refused.
TEST(BadInputsHook, DeviceAgreementComparesTheTargets) {
  FL_SKIP_UNLESS_BACKEND(Device::CUDA);
  Fixture f(Device::CUDA);
  CrossEntropyOptions o;
  o.vocab_global = 2 * f.V;
  MirrorCudaCommunicator comm;
  EXPECT_NO_THROW(cross_entropy_forward(f.xv(), f.tv(), o, f.out(), &comm));
  // The checksum the device wrote into the header (its last 8 bytes) is the host formula's, for
  // more rows than one block covers and for either index width.
  const int64_t rows = 3000, V = 4;
  Buffer x(Device::CUDA, rows * V * 4), t64(Device::CUDA, rows * 8), t32(Device::CUDA, rows * 4),
      loss(Device::CUDA, rows * 4), lse(Device::CUDA, rows * 4);
  uint64_t expected = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t v = (r * 7 + 3) % (2 * V);
    t64.host_as<int64_t>()[r] = v;
    t32.host_as<int32_t>()[r] = int32_t(v);
    expected += core::target_checksum_term(v, r);
  }
  std::memset(x.host(), 0, x.bytes());
  x.upload(); t64.upload(); t32.upload();
  CrossEntropyOptions big;
  big.vocab_global = 2 * V;
  for (auto [buf, type] : {std::pair{&t64, IndexType::I64}, std::pair{&t32, IndexType::I32}}) {
    comm.gathers = 0;
    cross_entropy_forward({x.data(), rows, V, V, DType::F32, Device::CUDA},
                          {buf->data(), rows, type, Device::CUDA}, big,
                          {loss.data_as<float>(), lse.data_as<float>(), nullptr}, &comm);
    ASSERT_GE(comm.header.size(), 8u);
    uint64_t got = 0;
    std::memcpy(&got, comm.header.data() + comm.header.size() - 8, 8);
    EXPECT_EQ(got, expected) << "index type " << int(type);
  }
  comm.gathers = 0;
  comm.tamper = true;
  comm.byte = 56;  // the header's last field: the targets' checksum
  expect_error([&] { cross_entropy_forward(f.xv(), f.tv(), o, f.out(), &comm); },
               {"vocab-parallel targets: rank 1's differ from rank 0's"});
  comm.gathers = 0;
  comm.byte = 48;  // the options' fingerprint
  expect_error([&] { cross_entropy_forward(f.xv(), f.tv(), o, f.out(), &comm); },
               {"vocab-parallel options: rank 1's differ from rank 0's"});
}

// A CUDA build on a machine with no GPU, or a driver too old for the build: the error names
// the public function and says so, never a CUDA runtime string with a source path.
TEST(BadInputsNoGpu, CudaCallSaysNoUsableDevice) {
  std::string why;
  if (cuda_available(&why)) GTEST_SKIP() << "a GPU is present";
  float x[4] = {0, 1, 2, 3}, loss[2], lse[2];
  int64_t t[2] = {0, 1};
  auto expect_clear = [](auto&& call, const char* fn) {
    try {
      call();
      ADD_FAILURE() << fn << ": expected fusedloss::Error";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind(std::string(fn) + ": no usable CUDA device", 0), 0u) << m;
      EXPECT_EQ(m.find(".cu:"), std::string::npos) << "a source path in: " << m;
    }
  };
  expect_clear([&] {
    cross_entropy_forward({x, 2, 2, 2, DType::F32, Device::CUDA}, {t, 2, IndexType::I64, Device::CUDA},
                          {}, {loss, lse, nullptr});
  }, "cross_entropy_forward");
  expect_clear([&] {
    swiglu_forward({x, 2, 2, 2, DType::F32, Device::CUDA}, {}, {}, {},
                   {loss, 2, 1, 1, DType::F32, Device::CUDA});
  }, "swiglu_forward");
}
#else
TEST(BadInputsCpuOnlyBuild, CudaViewIsRejected) {
  float x[4] = {0, 1, 2, 3}, loss[2], lse[2];
  int64_t t[2] = {0, 1};
  expect_error([&] {
    cross_entropy_forward({x, 2, 2, 2, DType::F32, Device::CUDA}, {t, 2, IndexType::I64, Device::CUDA},
                          {}, {loss, lse, nullptr});
  }, {"no CUDA backend"});
}
#endif

INSTANTIATE_TEST_SUITE_P(Backends, BadInputs, ::testing::Values(Device::CPU, Device::CUDA),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace fusedloss::test

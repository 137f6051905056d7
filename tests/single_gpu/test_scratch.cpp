// The scratch allocator hook (fusedloss/scratch.h): its own checks on every backend; on CUDA,
// that every op's scratch comes from the installed allocator, goes back to it on the stream it
// was taken for, and that the results keep their bits.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <utility>

#include "common/lce_harness.h"
#include "common/test_util.h"
#include "fusedloss/fusedloss.h"

#if FUSEDLOSS_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace fusedloss::test {
namespace {

TEST(ScratchAllocator, RefusesAnAllocatorWithOneFunctionMissing) {
  ScratchAllocator only_allocate;
  only_allocate.allocate = [](size_t, Stream, void*) -> void* { return nullptr; };
  expect_error([&] { set_scratch_allocator(&only_allocate); },
               {"allocator: got allocate = a function and release = nullptr", "expected both"});
  ScratchAllocator only_release;
  only_release.release = [](void*, Stream, void*) {};
  expect_error([&] { set_scratch_allocator(&only_release); },
               {"allocator: got allocate = nullptr and release = a function"});
  set_scratch_allocator(nullptr);  // back to cudaMallocAsync: always accepted
}

#if FUSEDLOSS_HAS_CUDA
// Serves every request with cudaMallocAsync on the stream asked for, and records what it gave.
struct Recorder {
  std::mutex mu;
  std::map<void*, std::pair<size_t, Stream>> live;
  int64_t allocations = 0, releases = 0, bad_releases = 0, declined = 0, refused = 0;
  bool decline = false;    // serves() says no: the core must take cudaMallocAsync itself
  bool exhausted = false;  // allocate() answers nullptr: out of memory, the call throws
  bool misalign = false;   // allocate() answers a block 16 bytes into one of its own

  static bool serves(Stream, void* self) {
    auto* r = static_cast<Recorder*>(self);
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->decline) ++r->declined;
    return !r->decline;
  }
  static void* allocate(size_t bytes, Stream stream, void* self) {
    auto* r = static_cast<Recorder*>(self);
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->exhausted) return ++r->refused, nullptr;
    void* p = nullptr;
    if (cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream)) != cudaSuccess) return nullptr;
    r->live[p] = {bytes, stream};
    ++r->allocations;
    return r->misalign ? static_cast<char*>(p) + 16 : p;
  }
  static void release(void* p, Stream stream, void* self) {
    auto* r = static_cast<Recorder*>(self);
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->misalign) p = static_cast<char*>(p) - 16;
    auto it = r->live.find(p);
    if (it == r->live.end() || it->second.second != stream) {
      ++r->bad_releases;
      return;
    }
    r->live.erase(it);
    ++r->releases;
    (void)cudaFreeAsync(p, static_cast<cudaStream_t>(stream));
  }
  ScratchAllocator hook() { return ScratchAllocator{&allocate, &release, this, &serves}; }
};

// Installs `recorder` for one scope; uninstalls on every exit.
struct Installed {
  explicit Installed(Recorder& recorder) {
    const ScratchAllocator a = recorder.hook();
    set_scratch_allocator(&a);
  }
  ~Installed() { set_scratch_allocator(nullptr); }
};

// Scratch of the linear cross-entropy (chunk buffer and cuBLASLt workspace, the recompute
// mode's fp32 accumulation, the cross-entropy's per-row losses) and RMSNorm's partials.
struct Outcome {
  LceResult lce_none, lce_mean;
  std::vector<float> rms_grad_x, rms_grad_w;
};

// `after(op)` runs once each op is done (to count what each took).
template <class After>
Outcome run_ops(After&& after) {
  Outcome o;
  LceCase c;
  c.N = 37, c.H = 24, c.V = 301;
  c.lo.chunk_rows = 16;
  c.lo.vocab_block = 128;            // recompute: chunk buffer + fp32 [N, H] and vocabulary block
  c.ce.reduction = Reduction::None;
  std::mt19937_64 gen(7);
  const LceProblem p = make_lce_problem(c, gen);
  o.lce_none = run_lce(Device::CUDA, c, p);
  after("linear cross-entropy, recompute");
  c.lo.vocab_block = 0;
  c.ce.reduction = Reduction::Mean;  // in_forward: chunk buffer + the per-row losses
  o.lce_mean = run_lce(Device::CUDA, c, p);
  after("linear cross-entropy, in_forward");

  const int64_t T = 40, H = 96;  // RMSNorm backward with no workspace: partials taken inside
  Buffer x(Device::CUDA, T * H * 4), gy(Device::CUDA, T * H * 4), w(Device::CUDA, H * 4),
      rstd(Device::CUDA, T * 4), y(Device::CUDA, T * H * 4), gx(Device::CUDA, T * H * 4),
      gw(Device::CUDA, H * 4);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < T * H; ++i) x.host_as<float>()[i] = normal(gen), gy.host_as<float>()[i] = normal(gen);
  for (int64_t i = 0; i < H; ++i) w.host_as<float>()[i] = 1.0f + 0.1f * normal(gen);
  x.upload(), gy.upload(), w.upload(), gx.poison(), gw.poison();
  const MatrixView xv{x.data(), T, H, H, DType::F32, Device::CUDA};
  const VectorView wv{w.data(), H, DType::F32, Device::CUDA};
  rms_norm_forward(xv, wv, RmsNormOptions{}, MatrixView{y.data(), T, H, H, DType::F32, Device::CUDA},
                   rstd.data_as<float>());
  rms_norm_backward(MatrixView{gy.data(), T, H, H, DType::F32, Device::CUDA}, xv, wv,
                    rstd.data_as<float>(), RmsNormOptions{},
                    MatrixView{gx.data(), T, H, H, DType::F32, Device::CUDA}, gw.data_as<float>());
  gx.download(), gw.download();
  after("RMSNorm backward");
  o.rms_grad_x.assign(gx.host_as<float>(), gx.host_as<float>() + T * H);
  o.rms_grad_w.assign(gw.host_as<float>(), gw.host_as<float>() + H);
  return o;
}

Outcome run_ops() {
  return run_ops([](const char*) {});
}

void expect_same_bits(const Outcome& a, const Outcome& b) {
  for (const auto* r : {&a.lce_none, &a.lce_mean}) {
    const auto* s = r == &a.lce_none ? &b.lce_none : &b.lce_mean;
    EXPECT_EQ(r->loss, s->loss);
    EXPECT_EQ(r->lse, s->lse);
    EXPECT_EQ(r->dhidden, s->dhidden);
    EXPECT_EQ(r->dweight, s->dweight);
  }
  EXPECT_EQ(a.rms_grad_x, b.rms_grad_x);
  EXPECT_EQ(a.rms_grad_w, b.rms_grad_w);
}

TEST(ScratchAllocator, EveryOpsScratchComesFromTheInstalledAllocatorAndGoesBack) {
  FL_SKIP_UNLESS_BACKEND(Device::CUDA);
  const Outcome by_default = run_ops();
  Recorder recorder;
  Outcome hooked;
  {
    Installed installed(recorder);
    int64_t seen = 0;
    hooked = run_ops([&](const char* op) {  // every op took its scratch from the recorder
      std::lock_guard<std::mutex> lock(recorder.mu);
      EXPECT_GT(recorder.allocations, seen) << op;
      seen = recorder.allocations;
    });
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_GE(recorder.allocations, 5);  // chunk buffers, fp32 blocks, per-row losses, partials
  EXPECT_EQ(recorder.releases, recorder.allocations);
  EXPECT_EQ(recorder.bad_releases, 0);  // each back with the stream it was taken for, once
  EXPECT_TRUE(recorder.live.empty());
  expect_same_bits(by_default, hooked);
  const int64_t before = recorder.allocations;  // uninstalled: cudaMallocAsync again
  run_ops();
  EXPECT_EQ(recorder.allocations, before);
}

// Under stream capture the installed allocator is not asked: the graph would use its block at
// every replay, after the call gave it back. cudaMallocAsync's memory nodes serve the capture.
TEST(ScratchAllocator, ACaptureTakesTheGraphsOwnMemory) {
  FL_SKIP_UNLESS_BACKEND(Device::CUDA);
  const int64_t rows = 64, V = 1000;
  Buffer logits(Device::CUDA, rows * V * 4), target(Device::CUDA, rows * 8), loss(Device::CUDA, 4),
      lse(Device::CUDA, rows * 4), count(Device::CUDA, 4);
  for (int64_t i = 0; i < rows * V; ++i) logits.host_as<float>()[i] = float(i % 17) * 0.1f;
  for (int64_t r = 0; r < rows; ++r) target.host_as<int64_t>()[r] = r % V;
  logits.upload(), target.upload();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const MatrixView lv{logits.data(), rows, V, V, DType::F32, Device::CUDA};
  const IndexView tv{target.data(), rows, IndexType::I64, Device::CUDA};
  CrossEntropyOptions o;  // Mean: per-row losses in scratch
  const CrossEntropyOutputs out{loss.data_as<float>(), lse.data_as<float>(), count.data_as<float>()};
  cross_entropy_forward(lv, tv, o, out, nullptr, stream);  // warm-up outside the capture
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  Recorder recorder;
  cudaGraph_t graph = nullptr;
  {
    Installed installed(recorder);
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    cross_entropy_forward(lv, tv, o, out, nullptr, stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  }
  EXPECT_EQ(recorder.allocations + recorder.declined, 0);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  loss.poison();
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  loss.download();
  EXPECT_TRUE(std::isfinite(loss.host_as<float>()[0]));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(ScratchAllocator, ADeclinedRequestTakesCudaMallocAsync) {
  FL_SKIP_UNLESS_BACKEND(Device::CUDA);
  const Outcome by_default = run_ops();
  Recorder recorder;
  recorder.decline = true;
  Outcome declined;
  {
    Installed installed(recorder);
    declined = run_ops();
  }
  EXPECT_GE(recorder.declined, 4);
  EXPECT_EQ(recorder.allocations, 0);  // never asked for a stream it declined
  EXPECT_EQ(recorder.releases + recorder.bad_releases, 0);  // nothing of its own came back to it
  expect_same_bits(by_default, declined);
}

// An allocator out of memory is the call's OutOfMemory: the core does not take cudaMallocAsync
// behind its back (the allocator's limits are the trainer's). A misaligned block goes back at
// once and the call throws. Either way the next call, served again, gives the same bits.
TEST(ScratchAllocator, AnAllocatorsOutOfMemoryIsTheCallsAndAMisalignedBlockIsRefused) {
  FL_SKIP_UNLESS_BACKEND(Device::CUDA);
  const Outcome by_default = run_ops();
  Recorder recorder;
  Installed installed(recorder);
  LceCase c;
  c.N = 37, c.H = 24, c.V = 301;
  std::mt19937_64 gen(7);
  const LceProblem p = make_lce_problem(c, gen);
  recorder.exhausted = true;
  try {
    run_lce(Device::CUDA, c, p);
    ADD_FAILURE() << "no OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("the installed scratch allocator has no memory"),
              std::string::npos) << e.what();
  }
  EXPECT_GE(recorder.refused, 1);
  recorder.exhausted = false;
  recorder.misalign = true;
  expect_error([&] { run_lce(Device::CUDA, c, p); },
               {"the installed scratch allocator returned", "expected a 256-byte aligned block"});
  recorder.misalign = false;
  EXPECT_EQ(recorder.bad_releases, 0);  // the misaligned block came back as it was given
  EXPECT_EQ(recorder.live.size(), 0u);
  expect_same_bits(by_default, run_ops());
}
#endif

}  // namespace
}  // namespace fusedloss::test

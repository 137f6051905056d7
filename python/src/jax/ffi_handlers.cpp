// libfusedloss_jax: fusedloss's ops as XLA FFI handlers for fusedloss.jax (python/fusedloss/jax),
// over the public C++ API alone.
//
// Every handler has one binding: its buffers in order (RemainingArgs / RemainingRets) and its
// options as named attributes, so a handler reads like the core call it makes. Each exists twice:
// fusedloss_<op>_cpu (XLA's host platform: CPU views) and, in a build with CUDA,
// fusedloss_<op>_cuda (CUDA views on the stream XLA hands the call; the core's scratch comes from
// XLA's allocator for the call, see BoundScratch). fusedloss/jax/_ffi.py registers them.
//
// jax.vmap: the Python side calls with vmap_method="expand_dims", so every buffer arrives with the
// batch dims in front, of size 1 where that argument is not batched. Rows are independent: a
// handler whose results are all per row runs one core call over every batch item's rows when
// the row arguments are all batched and the shared ones (a weight, a bias) are not; otherwise it
// runs one core call per batch item (a reduction, a weight gradient per item).
//
// Errors: a fusedloss::Error is INVALID_ARGUMENT with the core's message (the Python side checks
// shapes, dtypes and options at trace time with the same messages, so what reaches here is a
// target value), an OutOfMemory is RESOURCE_EXHAUSTED.
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fusedloss/config.h"
#include "fusedloss/fusedloss.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace fl = fusedloss;

namespace {

using Args = ffi::RemainingArgs;
using Rets = ffi::RemainingRets;
using Attrs = ffi::Dictionary;

// Where a handler's work runs: XLA's host platform (no stream), or CUDA on XLA's stream.
struct Place {
  fl::Device device;
  fl::Stream stream;
};

// ---- scratch from XLA's allocator ----
// The core takes the scratch of a CUDA call (the linear cross-entropy's chunk buffer, per-row and
// per-block partial sums) from an installed fusedloss::ScratchAllocator. This library's copy of
// the core has one that hands out the FFI ScratchAllocator of the handler running on this thread:
// XLA's own device allocator, counted in its memory statistics, freed when the handler returns
// (after the work it queued on XLA's stream, which is where the memory's next user runs).
//
// XLA's allocator takes alignments up to 16 bytes: XLA_FFI_DeviceMemory_Allocate refuses a
// larger one ("Unsupported alignment"), and the FFI's ScratchAllocator turns that refusal into
// an empty optional. The core's scratch must be 256-byte aligned (its vector loads, cuBLASLt), so
// the binding asks for 16 and 240 bytes more and hands out the first 256-byte boundary inside.
constexpr size_t kXlaMaxAlignment = 16;
constexpr size_t kCoreAlignment = 256;

// Where the scratch of the handler running on this thread comes from: the FFI's allocator (CUDA
// handlers), or the host stand-in of fusedloss_jax_check_scratch_binding (CPU tests), which
// applies XLA's rules, so that a CPU run exercises this same binding.
struct ScratchSource {
  void* self = nullptr;
  std::optional<void*> (*allocate)(void* self, size_t bytes, size_t alignment) = nullptr;
};
thread_local const ScratchSource* t_scratch_source = nullptr;

void* xla_allocate(size_t bytes, fl::Stream, void*) {
  if (t_scratch_source == nullptr) return nullptr;
  try {
    const size_t padded = bytes + (kCoreAlignment - kXlaMaxAlignment);
    std::optional<void*> block =
        t_scratch_source->allocate(t_scratch_source->self, padded, kXlaMaxAlignment);
    if (!block || *block == nullptr) return nullptr;
    const uintptr_t p = reinterpret_cast<uintptr_t>(*block);
    if (p % kXlaMaxAlignment != 0) return *block;  // the core refuses it, naming the address
    return reinterpret_cast<void*>((p + kCoreAlignment - 1) / kCoreAlignment * kCoreAlignment);
  } catch (...) {
    return nullptr;
  }
}
void xla_release(void*, fl::Stream, void*) {}  // XLA frees it when the handler returns
bool xla_serves(fl::Stream, void*) { return t_scratch_source != nullptr; }

const fl::ScratchAllocator& xla_scratch_allocator() {
  static const fl::ScratchAllocator a = [] {
    fl::ScratchAllocator s;
    s.allocate = xla_allocate;
    s.release = xla_release;
    s.serves = xla_serves;
    return s;
  }();
  return a;
}

// Binds a scratch source to this thread for one handler call (and installs the allocator once).
class BoundScratch {
 public:
  explicit BoundScratch(const ScratchSource* source) {
    static std::once_flag installed;
    std::call_once(installed, [] { fl::set_scratch_allocator(&xla_scratch_allocator()); });
    t_scratch_source = source;
  }
  ~BoundScratch() { t_scratch_source = nullptr; }
  BoundScratch(const BoundScratch&) = delete;
  BoundScratch& operator=(const BoundScratch&) = delete;
};

// ---- errors ----

[[noreturn]] void internal(const std::string& what) {
  throw std::logic_error("fusedloss.jax internal: " + what);
}

template <class Body>
ffi::Error guarded(Body&& body) noexcept {
  try {
    body();
    return ffi::Error::Success();
  } catch (const fl::OutOfMemory& e) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, e.what());
  } catch (const fl::Error& e) {
    return ffi::Error::InvalidArgument(e.what());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(e.what());
  } catch (...) {
    return ffi::Error::Internal("fusedloss.jax internal: an unknown exception");
  }
}

// ---- buffers ----

ffi::AnyBuffer arg(const Args& args, size_t i) {
  auto b = args.get<ffi::AnyBuffer>(i);
  if (!b.has_value()) internal("argument " + std::to_string(i) + ": " + b.error().message());
  return *b;
}

ffi::AnyBuffer ret(const Rets& rets, size_t i) {
  auto b = rets.get<ffi::AnyBuffer>(i);
  if (!b.has_value()) internal("result " + std::to_string(i) + ": " + b.error().message());
  return **b;
}

template <class T>
T attr(const Attrs& attrs, const char* name) {
  auto v = attrs.get<T>(name);
  if (!v.has_value()) internal(std::string("attribute ") + name + ": " + v.error().message());
  return *v;
}

fl::DType value_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return fl::DType::F32;
    case ffi::DataType::F16: return fl::DType::F16;
    case ffi::DataType::BF16: return fl::DType::BF16;
    case ffi::DataType::F8E4M3FN: return fl::DType::FP8_E4M3;  // SwiGLU's fp8 input store
    default: internal("a value buffer of XLA type " + std::to_string(int(t)));
  }
}

int64_t dim(const ffi::AnyBuffer& b, int from_end) {
  auto dims = b.dimensions();
  if (int64_t(dims.size()) < from_end) internal("a buffer of rank " + std::to_string(dims.size()));
  return dims[dims.size() - from_end];
}

// The batch items of a call under jax.vmap (see the top of the file).
class Batch {
 public:
  // `result`: a result with `core` trailing dims; results carry the whole batch shape.
  Batch(const ffi::AnyBuffer& result, int core) {
    auto dims = result.dimensions();
    if (int64_t(dims.size()) < core) internal("a result of rank " + std::to_string(dims.size()));
    shape_.assign(dims.begin(), dims.end() - core);
    for (int64_t d : shape_) size_ *= d;
  }
  int64_t size() const { return size_; }

  // Element offset of item i in `b` (`core` trailing dims), broadcast along its size-1 dims.
  int64_t offset(const ffi::AnyBuffer& b, int core, int64_t i) const {
    auto dims = b.dimensions();
    const size_t lead = dims.size() - core;
    if (int64_t(dims.size()) < core || lead != shape_.size()) internal("batch dims of a buffer");
    int64_t inner = 1;
    for (size_t d = lead; d < dims.size(); ++d) inner *= dims[d];
    int64_t off = 0, stride = inner;
    for (size_t d = lead; d-- > 0;) {
      const int64_t idx = i % shape_[d];
      i /= shape_[d];
      if (dims[d] != 1 && dims[d] != shape_[d]) internal("batch dims of a buffer");
      if (dims[d] != 1) off += idx * stride;
      stride *= dims[d];
    }
    return off;
  }
  // Whether `b` carries every batch dim (it is batched), or none (size 1 each: shared).
  bool batched(const ffi::AnyBuffer& b, int core) const { return batch_of(b, core) == size_; }
  bool shared(const ffi::AnyBuffer& b, int core) const { return batch_of(b, core) == 1; }

 private:
  int64_t batch_of(const ffi::AnyBuffer& b, int core) const {
    auto dims = b.dimensions();
    int64_t n = 1;
    for (size_t d = 0; d + core < dims.size(); ++d) n *= dims[d];
    return n;
  }
  std::vector<int64_t> shape_;
  int64_t size_ = 1;
};

void* at(const ffi::AnyBuffer& b, int64_t elements) {
  return static_cast<char*>(b.untyped_data()) + elements * int64_t(ffi::ByteWidth(b.element_type()));
}
float* f32_at(const ffi::AnyBuffer& b, int64_t elements) {
  if (b.element_type() != ffi::DataType::F32) internal("an fp32 buffer of another type");
  return static_cast<float*>(at(b, elements));
}

fl::MatrixView matrix(const ffi::AnyBuffer& b, int64_t offset, int64_t rows, int64_t cols,
                      const Place& place) {
  return fl::MatrixView{at(b, offset), rows, cols, cols, value_dtype(b.element_type()),
                        place.device};
}

fl::VectorView vector(const ffi::AnyBuffer& b, int64_t offset, int64_t size, const Place& place) {
  return fl::VectorView{at(b, offset), size, value_dtype(b.element_type()), place.device};
}

fl::IndexView index(const ffi::AnyBuffer& b, int64_t offset, int64_t size, const Place& place) {
  fl::IndexType t;
  switch (b.element_type()) {
    case ffi::DataType::S32: t = fl::IndexType::I32; break;
    case ffi::DataType::S64: t = fl::IndexType::I64; break;
    default: internal("targets of XLA type " + std::to_string(int(b.element_type())));
  }
  return fl::IndexView{at(b, offset), size, t, place.device};
}

fl::RowStats* stats_at(const ffi::AnyBuffer& b, int64_t offset) {
  return reinterpret_cast<fl::RowStats*>(f32_at(b, offset));
}

// ---- options (the attribute names are fusedloss/jax/_ffi.py's) ----

// Vocab-parallel (attribute vocab_global > 0): the Python side hands a shard's targets
// renumbered so that its columns start at 0 (fusedloss/jax/_vocab_parallel.py): the shard's
// place is a traced value there, and attributes are static. Any options with vocab_global.
template <class Options>
void read_vocab_global(const Attrs& a, Options& o) {
  const int64_t vocab_global = attr<int64_t>(a, "vocab_global");
  if (vocab_global > 0) o.vocab_global = vocab_global;
}

fl::CrossEntropyOptions ce_options(const Attrs& a) {
  fl::CrossEntropyOptions o;
  o.ignore_index = attr<int64_t>(a, "ignore_index");
  o.label_smoothing = attr<float>(a, "label_smoothing");
  o.smoothing_formula = fl::SmoothingFormula(attr<int64_t>(a, "smoothing_formula"));
  o.smoothing_scope = fl::SmoothingScope(attr<int64_t>(a, "smoothing_scope"));
  o.z_loss = attr<float>(a, "z_loss");
  o.reduction = fl::Reduction(attr<int64_t>(a, "reduction"));
  // the cross-entropy's soft cap (the linear cross-entropy's comes in lce_options, equal)
  if (auto softcap = a.get<float>("logit_softcap"); softcap.has_value()) o.logit_softcap = *softcap;
  read_vocab_global(a, o);
  // Shapes are static per trace: every device of a mesh axis runs the same program, so the run-
  // time agreement of the other adapters has nothing to find.
  o.check_shard_agreement = false;
  return o;
}

fl::LinearCrossEntropyOptions lce_options(const Attrs& a) {
  fl::LinearCrossEntropyOptions o;
  o.logit_softcap = attr<float>(a, "logit_softcap");
  const int64_t workspace = attr<int64_t>(a, "workspace_bytes");
  if (workspace > 0) o.workspace_bytes = size_t(workspace);
  o.allow_tf32 = attr<bool>(a, "allow_tf32");
  o.backward_mode = fl::LinearCeBackward(attr<int64_t>(a, "backward_mode"));
  // > 0: the recompute backward's exact fp32 sum of a 16-bit dweight (dweight_accumulation
  // "fp32"), the block fusedloss_jax_backward_vocab_block gives
  o.vocab_block = attr<int64_t>(a, "vocab_block");
  return o;
}

fl::RmsNormOptions rms_options(const Attrs& a) {
  fl::RmsNormOptions o;
  o.eps = attr<float>(a, "eps");
  o.zero_centered_gamma = attr<bool>(a, "zero_centered_gamma");
  return o;
}

fl::SwigluOptions swiglu_options(const Attrs& a) {
  fl::SwigluOptions o;
  const float clamp_value = attr<float>(a, "clamp_value");
  o.clamp = clamp_value > 0.0f;
  o.clamp_value = clamp_value;
  o.gate_multiplier = attr<float>(a, "gate_multiplier");
  o.down_multiplier = attr<float>(a, "down_multiplier");
  // the fp8 input store's values past e4m3's range: as the running JAX's cast gives them
  o.fp8_saturate = attr<bool>(a, "fp8_saturate");
  return o;
}

fl::CrossEntropyOutputs ce_outputs(const Rets& r, int64_t i, int64_t rows, bool none) {
  const ffi::AnyBuffer loss = ret(r, 0), lse = ret(r, 1), count = ret(r, 2);
  return {f32_at(loss, none ? i * rows : i), f32_at(lse, i * rows), f32_at(count, i)};
}

// ---- cross-entropy ----

// logits [.., N, V], target [.., N] -> loss [.., N] or [..], lse [.., N], count [..]
void ce_forward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::CrossEntropyOptions o = ce_options(attrs);
  const ffi::AnyBuffer x = arg(args, 0), t = arg(args, 1);
  const Batch b(ret(rets, 1), 1);
  const int64_t rows = dim(x, 2), cols = dim(x, 1);
  const bool none = o.reduction == fl::Reduction::None;
  if (none && b.batched(x, 2) && b.batched(t, 1)) {  // one call over every item's rows
    fl::cross_entropy_forward(matrix(x, 0, b.size() * rows, cols, p),
                              index(t, 0, b.size() * rows, p), o,
                              ce_outputs(rets, 0, rows, true), nullptr, p.stream);
    return;
  }
  for (int64_t i = 0; i < b.size(); ++i)
    fl::cross_entropy_forward(matrix(x, b.offset(x, 2, i), rows, cols, p),
                              index(t, b.offset(t, 1, i), rows, p), o,
                              ce_outputs(rets, i, rows, none), nullptr, p.stream);
}

// logits [.., N, V], target [.., N], lse [.., N], grad_loss [.., N] or [..], count [..]
// -> grad_logits [.., N, V] (may alias the logits: the core writes in place then)
void ce_backward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::CrossEntropyOptions o = ce_options(attrs);
  const ffi::AnyBuffer x = arg(args, 0), t = arg(args, 1), lse = arg(args, 2),
                       g = arg(args, 3), count = arg(args, 4), dx = ret(rets, 0);
  const Batch b(dx, 2);
  const int64_t rows = dim(x, 2), cols = dim(x, 1);
  const int g_core = o.reduction == fl::Reduction::None ? 1 : 0;
  for (int64_t i = 0; i < b.size(); ++i)
    fl::cross_entropy_backward(matrix(x, b.offset(x, 2, i), rows, cols, p),
                               index(t, b.offset(t, 1, i), rows, p),
                               f32_at(lse, b.offset(lse, 1, i)), f32_at(g, b.offset(g, g_core, i)),
                               f32_at(count, b.offset(count, 0, i)), o,
                               matrix(dx, b.offset(dx, 2, i), rows, cols, p), p.stream);
}

// Vocab-parallel pass 1: logits [.., N, V_local], target [.., N] (renumbered) -> stats [.., N, 4]
void ce_local_stats(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::CrossEntropyOptions o = ce_options(attrs);
  const ffi::AnyBuffer x = arg(args, 0), t = arg(args, 1), s = ret(rets, 0);
  const Batch b(s, 2);
  const int64_t rows = dim(x, 2), cols = dim(x, 1);
  for (int64_t i = 0; i < b.size(); ++i)
    fl::cross_entropy_local_stats(matrix(x, b.offset(x, 2, i), rows, cols, p),
                                  index(t, b.offset(t, 1, i), rows, p), o,
                                  stats_at(s, b.offset(s, 2, i)), p.stream);
}

// Vocab-parallel pass 2: combined [.., parts, N, 4] (all_gather'd), local [.., N, 4], target
// [.., N] (global ids) -> loss, lse, count as ce_forward's. Attribute vocab_local.
void ce_merge(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::CrossEntropyOptions o = ce_options(attrs);
  const int64_t vocab_local = attr<int64_t>(attrs, "vocab_local");
  const ffi::AnyBuffer all = arg(args, 0), local = arg(args, 1), t = arg(args, 2);
  const Batch b(ret(rets, 1), 1);
  const int64_t rows = dim(t, 1);
  const int parts = int(dim(all, 3));
  const bool none = o.reduction == fl::Reduction::None;
  for (int64_t i = 0; i < b.size(); ++i)
    fl::cross_entropy_merge(stats_at(all, b.offset(all, 3, i)), parts,
                            stats_at(local, b.offset(local, 2, i)),
                            index(t, b.offset(t, 1, i), rows, p), o, vocab_local,
                            ce_outputs(rets, i, rows, none), p.stream);
}

// ---- linear cross-entropy ----

// Batch item i's dhidden [.., N, H] and dweight [.., V, H], the linear heads' gradients.
fl::LinearCrossEntropyGrads head_grads(const Batch& b, const ffi::AnyBuffer& dh,
                                       const ffi::AnyBuffer& dw, int64_t i, int64_t rows,
                                       int64_t vocab, int64_t hidden, const Place& p) {
  fl::LinearCrossEntropyGrads grads;
  grads.dhidden = matrix(dh, b.offset(dh, 2, i), rows, hidden, p);
  grads.dweight = matrix(dw, b.offset(dw, 2, i), vocab, hidden, p);
  return grads;
}

// hidden [.., N, H], weight [.., V, H], target [.., N] (, row weights [.., N] fp32: in_forward
// of reduction 'none' with a loss_mask, attribute has_row_weight) -> loss, lse, count (as
// ce_forward's), dhidden [.., N, H] and dweight [.., V, H] (in_forward: the gradients for a
// unit upstream gradient, or of sum(row_weight * loss); recompute: [.., 0] placeholders)
void lce_forward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::CrossEntropyOptions ce = ce_options(attrs);
  const fl::LinearCrossEntropyOptions o = lce_options(attrs);
  const ffi::AnyBuffer h = arg(args, 0), w = arg(args, 1), t = arg(args, 2);
  std::optional<ffi::AnyBuffer> row_weight;
  if (auto has = attrs.get<bool>("has_row_weight"); has.has_value() && *has)
    row_weight = arg(args, 3);
  const ffi::AnyBuffer dh = ret(rets, 3), dw = ret(rets, 4);
  const Batch b(ret(rets, 1), 1);
  const int64_t rows = dim(h, 2), hidden = dim(h, 1), vocab = dim(w, 2);
  const bool none = ce.reduction == fl::Reduction::None;
  const bool in_forward = o.backward_mode == fl::LinearCeBackward::InForward;
  for (int64_t i = 0; i < b.size(); ++i) {
    fl::LinearCrossEntropyOutputs out;
    const fl::CrossEntropyOutputs loss = ce_outputs(rets, i, rows, none);
    out.loss = loss.loss;
    out.lse = loss.lse;
    out.valid_count = loss.valid_count;
    if (in_forward) {
      out.dhidden = matrix(dh, b.offset(dh, 2, i), rows, hidden, p);
      out.dweight = matrix(dw, b.offset(dw, 2, i), vocab, hidden, p);
      if (row_weight) out.row_weight = f32_at(*row_weight, b.offset(*row_weight, 1, i));
    }
    fl::linear_cross_entropy_forward(matrix(h, b.offset(h, 2, i), rows, hidden, p),
                                     matrix(w, b.offset(w, 2, i), vocab, hidden, p),
                                     index(t, b.offset(t, 1, i), rows, p), ce, o, out, nullptr,
                                     p.stream);
  }
}

// Vocab-parallel pass 1: hidden [.., N, H], weight [.., V_local, H], target [.., N] (renumbered)
// -> stats [.., N, 4]
void lce_local_stats(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::CrossEntropyOptions ce = ce_options(attrs);
  const fl::LinearCrossEntropyOptions o = lce_options(attrs);
  const ffi::AnyBuffer h = arg(args, 0), w = arg(args, 1), t = arg(args, 2), s = ret(rets, 0);
  const Batch b(s, 2);
  const int64_t rows = dim(h, 2), hidden = dim(h, 1), vocab = dim(w, 2);
  if (b.batched(h, 2) && b.batched(t, 1) && b.shared(w, 2)) {  // one call over every item's rows
    fl::linear_cross_entropy_local_stats(matrix(h, 0, b.size() * rows, hidden, p),
                                         matrix(w, 0, vocab, hidden, p),
                                         index(t, 0, b.size() * rows, p), ce, o, stats_at(s, 0),
                                         p.stream);
    return;
  }
  for (int64_t i = 0; i < b.size(); ++i)
    fl::linear_cross_entropy_local_stats(matrix(h, b.offset(h, 2, i), rows, hidden, p),
                                         matrix(w, b.offset(w, 2, i), vocab, hidden, p),
                                         index(t, b.offset(t, 1, i), rows, p), ce, o,
                                         stats_at(s, b.offset(s, 2, i)), p.stream);
}

// The recompute backward: hidden, weight, target (renumbered at TP > 1), lse [.., N], grad_loss
// [.., N] or [..], count [..] -> dhidden [.., N, H] (at TP > 1 this shard's partial sum),
// dweight [.., V, H]
void lce_backward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::CrossEntropyOptions ce = ce_options(attrs);
  const fl::LinearCrossEntropyOptions o = lce_options(attrs);
  const ffi::AnyBuffer h = arg(args, 0), w = arg(args, 1), t = arg(args, 2), lse = arg(args, 3),
                       g = arg(args, 4), count = arg(args, 5);
  const ffi::AnyBuffer dh = ret(rets, 0), dw = ret(rets, 1);
  const Batch b(dh, 2);
  const int64_t rows = dim(h, 2), hidden = dim(h, 1), vocab = dim(w, 2);
  const int g_core = ce.reduction == fl::Reduction::None ? 1 : 0;
  for (int64_t i = 0; i < b.size(); ++i) {
    const fl::LinearCrossEntropyGrads grads = head_grads(b, dh, dw, i, rows, vocab, hidden, p);
    fl::linear_cross_entropy_backward(
        matrix(h, b.offset(h, 2, i), rows, hidden, p),
        matrix(w, b.offset(w, 2, i), vocab, hidden, p), index(t, b.offset(t, 1, i), rows, p),
        f32_at(lse, b.offset(lse, 1, i)), f32_at(g, b.offset(g, g_core, i)),
        f32_at(count, b.offset(count, 0, i)), ce, o, {}, grads, p.stream);
  }
}

// The in-forward backward of reduction 'none' with row weights: hidden, weight, target, the
// forward's dhidden [.., N, H] and dweight [.., V, H] (for sum(row_weight * loss)), row weights
// [.., N] fp32, grad_loss [.., N] = c * row_weight -> dhidden, dweight (c times the saved ones;
// c found where grad_loss lives; another grad_loss has no c: an error on the CPU, NaN on CUDA)
void lce_scale_rows(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::CrossEntropyOptions ce = ce_options(attrs);
  const fl::LinearCrossEntropyOptions o = lce_options(attrs);
  const ffi::AnyBuffer h = arg(args, 0), w = arg(args, 1), t = arg(args, 2),
                       sdh = arg(args, 3), sdw = arg(args, 4), rw = arg(args, 5), g = arg(args, 6);
  const ffi::AnyBuffer dh = ret(rets, 0), dw = ret(rets, 1);
  const Batch b(dh, 2);
  const int64_t rows = dim(h, 2), hidden = dim(h, 1), vocab = dim(w, 2);
  for (int64_t i = 0; i < b.size(); ++i) {
    fl::LinearCrossEntropyOutputs saved;
    saved.dhidden = matrix(sdh, b.offset(sdh, 2, i), rows, hidden, p);
    saved.dweight = matrix(sdw, b.offset(sdw, 2, i), vocab, hidden, p);
    saved.row_weight = f32_at(rw, b.offset(rw, 1, i));
    fl::linear_cross_entropy_backward(
        matrix(h, b.offset(h, 2, i), rows, hidden, p),
        matrix(w, b.offset(w, 2, i), vocab, hidden, p), index(t, b.offset(t, 1, i), rows, p),
        nullptr, f32_at(g, b.offset(g, 1, i)), nullptr, ce, o, saved,
        head_grads(b, dh, dw, i, rows, vocab, hidden, p), p.stream);
  }
}

// ---- the log-prob head ----

fl::LinearLogProbsOptions lp_options(const Attrs& a) {
  fl::LinearLogProbsOptions o;
  o.temperature = attr<float>(a, "temperature");
  o.ignore_index = attr<int64_t>(a, "ignore_index");
  const int64_t workspace = attr<int64_t>(a, "workspace_bytes");
  if (workspace > 0) o.workspace_bytes = size_t(workspace);
  o.allow_tf32 = attr<bool>(a, "allow_tf32");
  read_vocab_global(a, o);
  return o;
}

// Batch item i's log_probs, entropy, lse [.., N] and argmax [.., N, 2] (int64 as two int32 words).
fl::LinearLogProbsOutputs lp_outputs(const Rets& rets, int64_t i, int64_t rows) {
  fl::LinearLogProbsOutputs out;
  out.log_probs = f32_at(ret(rets, 0), i * rows);
  out.entropy = f32_at(ret(rets, 1), i * rows);
  out.lse = f32_at(ret(rets, 2), i * rows);
  out.argmax = reinterpret_cast<int64_t*>(at(ret(rets, 3), i * rows * 2));
  return out;
}

// LogProbStats in an int32 buffer of [.., N, 6] (24 bytes a row), from element `offset`.
fl::LogProbStats* lp_stats_at(const ffi::AnyBuffer& b, int64_t offset) {
  static_assert(sizeof(fl::LogProbStats) == 24, "LogProbStats: 6 words a row");
  return reinterpret_cast<fl::LogProbStats*>(at(b, offset));
}

// Vocab-parallel pass 1: hidden, weight [.., V_local, H], tokens (renumbered) -> stats [.., N, 6]
void lp_local_stats(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::LinearLogProbsOptions o = lp_options(attrs);
  const ffi::AnyBuffer h = arg(args, 0), w = arg(args, 1), t = arg(args, 2), s = ret(rets, 0);
  const Batch b(s, 2);
  const int64_t rows = dim(h, 2), hidden = dim(h, 1), vocab = dim(w, 2);
  for (int64_t i = 0; i < b.size(); ++i)
    fl::linear_log_probs_local_stats(matrix(h, b.offset(h, 2, i), rows, hidden, p),
                                     matrix(w, b.offset(w, 2, i), vocab, hidden, p),
                                     index(t, b.offset(t, 1, i), rows, p), o,
                                     lp_stats_at(s, b.offset(s, 2, i)), p.stream);
}

// Vocab-parallel pass 2: stats [.., parts, N, 6] (all_gather'd; each shard's arg-max a global id),
// tokens [.., N] (global ids) -> log_probs, entropy, lse, argmax as lp_forward's
void lp_merge(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::LinearLogProbsOptions o = lp_options(attrs);
  const ffi::AnyBuffer all = arg(args, 0), t = arg(args, 1);
  const Batch b(ret(rets, 0), 1);
  const int64_t rows = dim(t, 1);
  const int parts = int(dim(all, 3));
  for (int64_t i = 0; i < b.size(); ++i) {
    const fl::LinearLogProbsOutputs out = lp_outputs(rets, i, rows);
    fl::log_probs_merge(lp_stats_at(all, b.offset(all, 3, i)), parts, rows,
                        index(t, b.offset(t, 1, i), rows, p), o, out, p.device, p.stream);
  }
}

// hidden [.., N, H], weight [.., V, H], tokens [.., N] -> log_probs, entropy, lse [.., N] fp32,
// argmax [.., N, 2] int32 (each an int64 id as two words: XLA without x64 has no int64 result)
void lp_forward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::LinearLogProbsOptions o = lp_options(attrs);
  const ffi::AnyBuffer h = arg(args, 0), w = arg(args, 1), t = arg(args, 2);
  const Batch b(ret(rets, 0), 1);
  const int64_t rows = dim(h, 2), hidden = dim(h, 1), vocab = dim(w, 2);
  for (int64_t i = 0; i < b.size(); ++i) {
    const fl::LinearLogProbsOutputs out = lp_outputs(rets, i, rows);
    fl::linear_log_probs_forward(matrix(h, b.offset(h, 2, i), rows, hidden, p),
                                 matrix(w, b.offset(w, 2, i), vocab, hidden, p),
                                 index(t, b.offset(t, 1, i), rows, p), o, out, nullptr, p.stream);
  }
}

// hidden, weight, tokens, lse, entropy, grad_log_probs, grad_entropy ([.., N] fp32 each) ->
// dhidden [.., N, H], dweight [.., V, H]
void lp_backward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::LinearLogProbsOptions o = lp_options(attrs);
  const ffi::AnyBuffer h = arg(args, 0), w = arg(args, 1), t = arg(args, 2), lse = arg(args, 3),
                       ent = arg(args, 4), g = arg(args, 5), e = arg(args, 6);
  const ffi::AnyBuffer dh = ret(rets, 0), dw = ret(rets, 1);
  const Batch b(dh, 2);
  const int64_t rows = dim(h, 2), hidden = dim(h, 1), vocab = dim(w, 2);
  for (int64_t i = 0; i < b.size(); ++i) {
    const fl::LinearCrossEntropyGrads grads = head_grads(b, dh, dw, i, rows, vocab, hidden, p);
    fl::linear_log_probs_backward(
        matrix(h, b.offset(h, 2, i), rows, hidden, p),
        matrix(w, b.offset(w, 2, i), vocab, hidden, p), index(t, b.offset(t, 1, i), rows, p),
        f32_at(lse, b.offset(lse, 1, i)), f32_at(ent, b.offset(ent, 1, i)),
        f32_at(g, b.offset(g, 1, i)), f32_at(e, b.offset(e, 1, i)), o, grads, p.stream);
  }
}

// ---- the distillation loss ----

fl::LinearDistillationOptions distill_options(const Attrs& a) {
  fl::LinearDistillationOptions o;
  o.divergence = fl::Divergence(attr<int64_t>(a, "divergence"));
  o.beta = attr<float>(a, "beta");
  o.temperature = attr<float>(a, "temperature");
  o.hard_label_weight = attr<float>(a, "hard_label_weight");
  o.ignore_index = attr<int64_t>(a, "ignore_index");
  const int64_t workspace = attr<int64_t>(a, "workspace_bytes");
  if (workspace > 0) o.workspace_bytes = size_t(workspace);
  o.allow_tf32 = attr<bool>(a, "allow_tf32");
  read_vocab_global(a, o);
  return o;
}

// DistillPartial in an int32 buffer of [.., N, 8] (32 bytes a row), from element `offset`.
fl::DistillPartial* distill_partials_at(const ffi::AnyBuffer& b, int64_t offset) {
  static_assert(sizeof(fl::DistillPartial) == 32, "DistillPartial: 8 words a row");
  return reinterpret_cast<fl::DistillPartial*>(at(b, offset));
}

// DistillRowStats in an int32 buffer of [.., N, 8] (32 bytes a row), from element `offset`.
fl::DistillRowStats* distill_stats_at(const ffi::AnyBuffer& b, int64_t offset) {
  static_assert(sizeof(fl::DistillRowStats) == 32, "DistillRowStats: 8 words a row");
  return reinterpret_cast<fl::DistillRowStats*>(at(b, offset));
}

// The four head operands of batch item i, and its targets (none without has_target).
struct DistillOperands {
  fl::MatrixView sh, sw, th, tw;
  fl::IndexView target;
};
DistillOperands distill_operands(const Args& args, const Batch& b, int64_t i, bool has_target,
                                 const Place& p) {
  const ffi::AnyBuffer sh = arg(args, 0), sw = arg(args, 1), th = arg(args, 2), tw = arg(args, 3),
                       t = arg(args, 4);
  const int64_t rows = dim(sh, 2), vocab = dim(sw, 2), hs = dim(sh, 1), ht = dim(th, 1);
  return {matrix(sh, b.offset(sh, 2, i), rows, hs, p), matrix(sw, b.offset(sw, 2, i), vocab, hs, p),
          matrix(th, b.offset(th, 2, i), rows, ht, p), matrix(tw, b.offset(tw, 2, i), vocab, ht, p),
          has_target ? index(t, b.offset(t, 1, i), rows, p)
                     : fl::IndexView{nullptr, rows, fl::IndexType::I32, p.device}};
}

// student_hidden [.., N, H_s], student_weight [.., V, H_s], teacher_hidden [.., N, H_t],
// teacher_weight [.., V, H_t], target [.., N] (read with has_target) (, grad_loss [.., N] fp32:
// in_forward) -> loss [.., N] fp32, stats [.., N, 8] int32 (, dhidden [.., N, H_s] and dweight
// [.., V, H_s]: in_forward, the gradients of sum(grad_loss * loss))
void distill_forward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::LinearDistillationOptions o = distill_options(attrs);
  const bool has_target = attr<bool>(attrs, "has_target");
  const bool in_forward = rets.size() == 4;
  const ffi::AnyBuffer loss = ret(rets, 0), stats = ret(rets, 1);
  const Batch b(loss, 1);
  for (int64_t i = 0; i < b.size(); ++i) {
    const DistillOperands x = distill_operands(args, b, i, has_target, p);
    fl::DistillInForward grads;
    if (in_forward) {
      const ffi::AnyBuffer g = arg(args, 5);
      grads.grads = head_grads(b, ret(rets, 2), ret(rets, 3), i, x.sh.rows, x.sw.rows, x.sh.cols, p);
      grads.grad_loss = f32_at(g, b.offset(g, 1, i));
    }
    fl::linear_distillation_forward(x.sh, x.sw, x.th, x.tw, x.target, o,
                                    f32_at(loss, b.offset(loss, 1, i)),
                                    distill_stats_at(stats, b.offset(stats, 2, i)), p.stream,
                                    grads);
  }
}

// the forward's operands, stats [.., N, 8] and grad_loss [.., N] fp32 -> dhidden [.., N, H_s],
// dweight [.., V, H_s]
void distill_backward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::LinearDistillationOptions o = distill_options(attrs);
  const bool has_target = attr<bool>(attrs, "has_target");
  const ffi::AnyBuffer stats = arg(args, 5), g = arg(args, 6), dh = ret(rets, 0), dw = ret(rets, 1);
  const Batch b(dh, 2);
  for (int64_t i = 0; i < b.size(); ++i) {
    const DistillOperands x = distill_operands(args, b, i, has_target, p);
    fl::linear_distillation_backward(
        x.sh, x.sw, x.th, x.tw, x.target, distill_stats_at(stats, b.offset(stats, 2, i)),
        f32_at(g, b.offset(g, 1, i)), o,
        head_grads(b, dh, dw, i, x.sh.rows, x.sw.rows, x.sh.cols, p), p.stream);
  }
}

// Vocab-parallel pass 1: the four operands (both weights [.., V_local, H]), targets
// (renumbered) -> partials [.., N, 8] int32
void distill_local_partials(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::LinearDistillationOptions o = distill_options(attrs);
  const bool has_target = attr<bool>(attrs, "has_target");
  const ffi::AnyBuffer out = ret(rets, 0);
  const Batch b(out, 2);
  for (int64_t i = 0; i < b.size(); ++i) {
    const DistillOperands x = distill_operands(args, b, i, has_target, p);
    fl::linear_distillation_local_partials(x.sh, x.sw, x.th, x.tw, x.target, o,
                                           distill_partials_at(out, b.offset(out, 2, i)), p.stream);
  }
}

// Vocab-parallel merge: partials [.., parts, N, 8] (all_gather'd), targets [.., N] (global ids)
// -> loss [.., N] fp32, stats [.., N, 8] int32 (jsd: without the soft term, which
// distill_jsd_sums' psum'd sums complete)
void distill_merge(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::LinearDistillationOptions o = distill_options(attrs);
  const bool has_target = attr<bool>(attrs, "has_target");
  const ffi::AnyBuffer all = arg(args, 0), t = arg(args, 1), loss = ret(rets, 0),
                       stats = ret(rets, 1);
  const Batch b(loss, 1);
  const int64_t rows = dim(t, 1);
  const int parts = int(dim(all, 3));
  for (int64_t i = 0; i < b.size(); ++i)
    fl::distill_merge(distill_partials_at(all, b.offset(all, 3, i)), parts, rows,
                      has_target ? index(t, b.offset(t, 1, i), rows, p)
                                 : fl::IndexView{nullptr, rows, fl::IndexType::I32, p.device},
                      o, distill_stats_at(stats, b.offset(stats, 2, i)),
                      f32_at(loss, b.offset(loss, 1, i)), p.device, p.stream);
}

// Vocab-parallel jsd pass 2: the four operands, targets (unread), the merged stats [.., N, 8]
// -> this shard's sums [.., N, 2] fp32
void distill_jsd_sums(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::LinearDistillationOptions o = distill_options(attrs);
  const ffi::AnyBuffer stats = arg(args, 5), sums = ret(rets, 0);
  const Batch b(sums, 2);
  for (int64_t i = 0; i < b.size(); ++i) {
    const DistillOperands x = distill_operands(args, b, i, false, p);
    fl::linear_distillation_jsd_sums(x.sh, x.sw, x.th, x.tw, o,
                                     distill_stats_at(stats, b.offset(stats, 2, i)),
                                     f32_at(sums, b.offset(sums, 2, i)), p.stream);
  }
}

// ---- RMSNorm ----

// x [.., T, H], weight [.., H] (, residual [.., T, H]) -> y [.., T, H], rstd [.., T]
// (, s = x + residual [.., T, H])
void rms_norm_forward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::RmsNormOptions o = rms_options(attrs);
  const bool fused = args.size() == 3;
  const ffi::AnyBuffer x = arg(args, 0), w = arg(args, 1), y = ret(rets, 0), rstd = ret(rets, 1);
  const Batch b(rstd, 1);
  int64_t rows = dim(x, 2), items = b.size();
  const int64_t hidden = dim(x, 1);
  const bool merged = b.batched(x, 2) && b.shared(w, 1) && (!fused || b.batched(arg(args, 2), 2));
  if (merged) rows *= items, items = 1;  // one call over every item's rows
  for (int64_t i = 0; i < items; ++i) {
    fl::MatrixView residual, s;
    if (fused) {
      const ffi::AnyBuffer r = arg(args, 2), sum = ret(rets, 2);
      residual = matrix(r, merged ? 0 : b.offset(r, 2, i), rows, hidden, p);
      s = matrix(sum, i * rows * hidden, rows, hidden, p);
    }
    fl::rms_norm_forward(matrix(x, merged ? 0 : b.offset(x, 2, i), rows, hidden, p),
                         vector(w, merged ? 0 : b.offset(w, 1, i), hidden, p), o,
                         matrix(y, i * rows * hidden, rows, hidden, p), f32_at(rstd, i * rows),
                         residual, s, p.stream);
  }
}

// grad_y [.., T, H], x_or_s [.., T, H], weight [.., H], rstd [.., T] (, grad_s [.., T, H])
// -> grad_x [.., T, H], grad_weight [.., H] (in the weight's dtype)
void rms_norm_backward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::RmsNormOptions o = rms_options(attrs);
  const bool fused = args.size() == 5;
  const ffi::AnyBuffer g = arg(args, 0), x = arg(args, 1), w = arg(args, 2), rstd = arg(args, 3);
  const ffi::AnyBuffer dx = ret(rets, 0), dw = ret(rets, 1);
  const Batch b(dx, 2);
  const int64_t rows = dim(x, 2), hidden = dim(x, 1);
  for (int64_t i = 0; i < b.size(); ++i) {
    fl::MatrixView grad_s;
    if (fused) {
      const ffi::AnyBuffer gs = arg(args, 4);
      grad_s = matrix(gs, b.offset(gs, 2, i), rows, hidden, p);
    }
    fl::rms_norm_backward(matrix(g, b.offset(g, 2, i), rows, hidden, p),
                          matrix(x, b.offset(x, 2, i), rows, hidden, p),
                          vector(w, b.offset(w, 1, i), hidden, p),
                          f32_at(rstd, b.offset(rstd, 1, i)), o,
                          matrix(dx, b.offset(dx, 2, i), rows, hidden, p),
                          at(dw, b.offset(dw, 1, i)), value_dtype(dw.element_type()), nullptr,
                          grad_s, p.stream);
  }
}

// ---- SwiGLU ----

// The optional arguments of a SwiGLU call, after its leading ones: bias [.., 2n] and per-token
// scale [.., T] (attributes has_bias / has_scale).
struct SwigluExtras {
  std::optional<ffi::AnyBuffer> bias, scale;
};
SwigluExtras swiglu_extras(const Args& args, size_t first, const Attrs& attrs) {
  SwigluExtras e;
  size_t next = first;
  if (attr<bool>(attrs, "has_bias")) e.bias = arg(args, next++);
  if (attr<bool>(attrs, "has_scale")) e.scale = arg(args, next++);
  return e;
}

// Batch item i's bias [2n] and scale [rows] views (empty where absent); `merged`: the one call
// over every item's rows, whose shared bias and batched scale start at 0.
struct SwigluAux {
  fl::VectorView bias, scale;
};
SwigluAux swiglu_aux(const SwigluExtras& e, const Batch& b, int64_t i, bool merged, int64_t rows,
                     int64_t two_n, const Place& p) {
  SwigluAux a;
  if (e.bias) a.bias = vector(*e.bias, merged ? 0 : b.offset(*e.bias, 1, i), two_n, p);
  if (e.scale) a.scale = vector(*e.scale, merged ? 0 : b.offset(*e.scale, 1, i), rows, p);
  return a;
}

// Whether one core call can take every batch item's rows: the row inputs all batched, the
// bias shared, the scale batched (see the top of the file).
bool swiglu_merged(const Batch& b, std::initializer_list<ffi::AnyBuffer> row_inputs,
                   const SwigluExtras& e) {
  for (const ffi::AnyBuffer& x : row_inputs)
    if (!b.batched(x, 2)) return false;
  return (!e.bias || b.shared(*e.bias, 1)) && (!e.scale || b.batched(*e.scale, 1));
}

// SwiGLU's gradients of the per-token scale and the bias (results after the input gradients).
struct SwigluAuxGrads {
  std::optional<ffi::AnyBuffer> scale, bias;
  float* scale_at(int64_t elements) const { return scale ? f32_at(*scale, elements) : nullptr; }
  float* bias_at(int64_t elements) const { return bias ? f32_at(*bias, elements) : nullptr; }
};
SwigluAuxGrads swiglu_aux_grads(const Rets& rets, size_t first, const SwigluExtras& e) {
  SwigluAuxGrads d;
  size_t next = first;
  if (e.scale) d.scale = ret(rets, next++);
  if (e.bias) d.bias = ret(rets, next++);
  return d;
}

// The fp8 input store's e4m3 copy [.., T, 2n] of a SwiGLU forward (its second result, attribute
// fp8_store), or none.
std::optional<ffi::AnyBuffer> fp8_store(const Rets& rets, const Attrs& attrs) {
  if (!attr<bool>(attrs, "fp8_store")) return std::nullopt;
  return ret(rets, 1);
}

// Row view of [T, 2n] `b`'s columns [first, first + n) (the gate's or the up's half).
fl::MatrixView half(const ffi::AnyBuffer& b, int64_t offset, int64_t rows, int64_t n,
                    int64_t first, const Place& place) {
  return fl::MatrixView{at(b, offset + first), rows, n, 2 * n, value_dtype(b.element_type()),
                        place.device};
}

// y [.., T, 2n] (, bias, scale) -> out [.., T, n] (, its e4m3 copy [.., T, 2n]: fp8_store)
void swiglu_forward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::SwigluOptions o = swiglu_options(attrs);
  const ffi::AnyBuffer y = arg(args, 0), out = ret(rets, 0);
  const SwigluExtras e = swiglu_extras(args, 1, attrs);
  const Batch b(out, 2);
  int64_t rows = dim(y, 2), items = b.size();
  const int64_t cols = dim(y, 1);
  const std::optional<ffi::AnyBuffer> y8 = fp8_store(rets, attrs);
  const bool merged = swiglu_merged(b, {y}, e);
  if (merged) rows *= items, items = 1;  // one call over every item's rows
  for (int64_t i = 0; i < items; ++i) {
    const SwigluAux a = swiglu_aux(e, b, i, merged, rows, cols, p);
    fl::swiglu_forward(matrix(y, merged ? 0 : b.offset(y, 2, i), rows, cols, p), a.bias, a.scale,
                       o, matrix(out, i * rows * cols / 2, rows, cols / 2, p),
                       y8 ? matrix(*y8, i * rows * cols, rows, cols, p) : fl::MatrixView{},
                       p.stream);
  }
}

// grad_out [.., T, n], y [.., T, 2n] (, bias, scale) -> grad_y [.., T, 2n] (, grad_scale [.., T]
// fp32 with a scale) (, grad_bias [.., 2n] fp32 with a bias)
void swiglu_backward(const Place& p, const Args& args, const Rets& rets, const Attrs& attrs) {
  const fl::SwigluOptions o = swiglu_options(attrs);
  const ffi::AnyBuffer g = arg(args, 0), y = arg(args, 1), dy = ret(rets, 0);
  const SwigluExtras e = swiglu_extras(args, 2, attrs);
  const SwigluAuxGrads d = swiglu_aux_grads(rets, 1, e);
  const Batch b(dy, 2);
  const int64_t rows = dim(y, 2), cols = dim(y, 1);
  for (int64_t i = 0; i < b.size(); ++i) {
    const SwigluAux a = swiglu_aux(e, b, i, false, rows, cols, p);
    fl::swiglu_backward(matrix(g, b.offset(g, 2, i), rows, cols / 2, p),
                        matrix(y, b.offset(y, 2, i), rows, cols, p), a.bias, a.scale, o,
                        matrix(dy, b.offset(dy, 2, i), rows, cols, p), d.scale_at(i * rows),
                        d.bias_at(i * cols), p.stream);
  }
}

// The two-tensor form: gate [.., T, n], up [.., T, n] (, bias [.., 2n], scale) -> out [.., T, n]
// (, the e4m3 copy [.., T, 2n] of [gate | up]: fp8_store)
void swiglu_gate_up_forward(const Place& p, const Args& args, const Rets& rets,
                            const Attrs& attrs) {
  const fl::SwigluOptions o = swiglu_options(attrs);
  const ffi::AnyBuffer gate = arg(args, 0), up = arg(args, 1), out = ret(rets, 0);
  const SwigluExtras e = swiglu_extras(args, 2, attrs);
  const Batch b(out, 2);
  int64_t rows = dim(gate, 2), items = b.size();
  const int64_t n = dim(gate, 1);
  const std::optional<ffi::AnyBuffer> in8 = fp8_store(rets, attrs);
  const bool merged = swiglu_merged(b, {gate, up}, e);
  if (merged) rows *= items, items = 1;  // one call over every item's rows
  for (int64_t i = 0; i < items; ++i) {
    const SwigluAux a = swiglu_aux(e, b, i, merged, rows, 2 * n, p);
    fl::swiglu_gate_up_forward(matrix(gate, merged ? 0 : b.offset(gate, 2, i), rows, n, p),
                               matrix(up, merged ? 0 : b.offset(up, 2, i), rows, n, p), a.bias,
                               a.scale, o, matrix(out, i * rows * n, rows, n, p),
                               in8 ? matrix(*in8, i * rows * 2 * n, rows, 2 * n, p)
                                   : fl::MatrixView{},
                               p.stream);
  }
}

// grad_out [.., T, n], gate, up [.., T, n] (fp8_store: the forward's e4m3 copy [.., T, 2n] in
// their place, one argument) (, bias, scale) -> grad_gate, grad_up [.., T, n] (, grad_scale
// [.., T] fp32 with a scale) (, grad_bias [.., 2n] fp32 with a bias)
void swiglu_gate_up_backward(const Place& p, const Args& args, const Rets& rets,
                             const Attrs& attrs) {
  const fl::SwigluOptions o = swiglu_options(attrs);
  const bool stored = attr<bool>(attrs, "fp8_store");
  const ffi::AnyBuffer g = arg(args, 0), gate = arg(args, 1), up = arg(args, stored ? 1 : 2);
  const ffi::AnyBuffer dgate = ret(rets, 0), dup = ret(rets, 1);
  const SwigluExtras e = swiglu_extras(args, stored ? 2 : 3, attrs);
  const SwigluAuxGrads d = swiglu_aux_grads(rets, 2, e);
  const Batch b(dgate, 2);
  const int64_t rows = dim(dgate, 2), n = dim(dgate, 1);
  for (int64_t i = 0; i < b.size(); ++i) {
    const SwigluAux a = swiglu_aux(e, b, i, false, rows, 2 * n, p);
    const int64_t at_gate = b.offset(gate, 2, i), at_up = b.offset(up, 2, i);
    fl::swiglu_gate_up_backward(matrix(g, b.offset(g, 2, i), rows, n, p),
                                stored ? half(gate, at_gate, rows, n, 0, p)
                                       : matrix(gate, at_gate, rows, n, p),
                                stored ? half(up, at_up, rows, n, n, p)
                                       : matrix(up, at_up, rows, n, p), a.bias, a.scale, o,
                                matrix(dgate, b.offset(dgate, 2, i), rows, n, p),
                                matrix(dup, b.offset(dup, 2, i), rows, n, p),
                                d.scale_at(i * rows), d.bias_at(i * 2 * n), p.stream);
  }
}

// ---- the handlers: one binding, two platforms ----

using Op = void (*)(const Place&, const Args&, const Rets&, const Attrs&);

template <Op op>
ffi::Error on_cpu(Args args, Rets rets, Attrs attrs) {
  return guarded([&] { op(Place{fl::Device::CPU, nullptr}, args, rets, attrs); });
}

#if FUSEDLOSS_HAS_CUDA
template <Op op>
ffi::Error on_cuda(void* stream, ffi::ScratchAllocator scratch, Args args, Rets rets,
                   Attrs attrs) {
  return guarded([&] {
    const ScratchSource source{&scratch, [](void* self, size_t bytes, size_t alignment) {
      return static_cast<ffi::ScratchAllocator*>(self)->Allocate(bytes, alignment);
    }};
    BoundScratch bound(&source);
    op(Place{fl::Device::CUDA, stream}, args, rets, attrs);
  });
}
#define FL_CUDA_HANDLER(name, op)                                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(fusedloss_##name##_cuda, on_cuda<op>,                          \
                                ffi::Ffi::Bind()                                               \
                                    .Ctx<ffi::PlatformStream<void*>>()                         \
                                    .Ctx<ffi::ScratchAllocator>()                              \
                                    .RemainingArgs()                                           \
                                    .RemainingRets()                                           \
                                    .Attrs());
#else
#define FL_CUDA_HANDLER(name, op)
#endif

#define FL_HANDLER(name, op)                                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(fusedloss_##name##_cpu, on_cpu<op>,                            \
                                ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());     \
  FL_CUDA_HANDLER(name, op)

}  // namespace

FL_HANDLER(ce_forward, ce_forward)
FL_HANDLER(ce_backward, ce_backward)
FL_HANDLER(ce_local_stats, ce_local_stats)
FL_HANDLER(ce_merge, ce_merge)
FL_HANDLER(lce_forward, lce_forward)
FL_HANDLER(lce_local_stats, lce_local_stats)
FL_HANDLER(lce_backward, lce_backward)
FL_HANDLER(lce_scale_rows, lce_scale_rows)
FL_HANDLER(lp_forward, lp_forward)
FL_HANDLER(lp_backward, lp_backward)
FL_HANDLER(lp_local_stats, lp_local_stats)
FL_HANDLER(lp_merge, lp_merge)
FL_HANDLER(distill_forward, distill_forward)
FL_HANDLER(distill_backward, distill_backward)
FL_HANDLER(distill_local_partials, distill_local_partials)
FL_HANDLER(distill_merge, distill_merge)
FL_HANDLER(distill_jsd_sums, distill_jsd_sums)
FL_HANDLER(rms_norm_forward, rms_norm_forward)
FL_HANDLER(rms_norm_backward, rms_norm_backward)
FL_HANDLER(swiglu_forward, swiglu_forward)
FL_HANDLER(swiglu_backward, swiglu_backward)
FL_HANDLER(swiglu_gate_up_forward, swiglu_gate_up_forward)
FL_HANDLER(swiglu_gate_up_backward, swiglu_gate_up_backward)

// ---- trace-time checks for fusedloss/jax (ctypes): the core's validators and rules ----
// Each returns 0, or 1 with the core's message in `message` (NUL-terminated, cut to `capacity`).

namespace {
template <class Body>
int checked(char* message, size_t capacity, Body&& body) noexcept {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    if (capacity) {
      std::strncpy(message, e.what(), capacity - 1);
      message[capacity - 1] = '\0';
    }
    return 1;
  }
}

fl::CrossEntropyOptions plain_ce(int64_t ignore_index, float label_smoothing, int32_t formula,
                                 int32_t scope, float z_loss, int32_t reduction) {
  fl::CrossEntropyOptions o;
  o.ignore_index = ignore_index;
  o.label_smoothing = label_smoothing;
  o.smoothing_formula = fl::SmoothingFormula(formula);
  o.smoothing_scope = fl::SmoothingScope(scope);
  o.z_loss = z_loss;
  o.reduction = fl::Reduction(reduction);
  return o;
}
}  // namespace

extern "C" {

int fusedloss_jax_has_cuda() { return FUSEDLOSS_HAS_CUDA ? 1 : 0; }

int fusedloss_jax_validate_cross_entropy(int64_t ignore_index, float label_smoothing,
                                         int32_t formula, int32_t scope, float z_loss,
                                         int32_t reduction, int64_t rows, int64_t vocab_local,
                                         char* message, size_t capacity) {
  return checked(message, capacity, [&] {
    fl::validate_cross_entropy_options(
        plain_ce(ignore_index, label_smoothing, formula, scope, z_loss, reduction), rows,
        vocab_local);
  });
}

int fusedloss_jax_validate_linear_cross_entropy(int64_t ignore_index, float label_smoothing,
                                                int32_t formula, int32_t scope, float z_loss,
                                                int32_t reduction, float logit_softcap,
                                                int64_t workspace_bytes, int32_t backward_mode,
                                                int64_t rows, int64_t vocab_local, int64_t hidden,
                                                char* message, size_t capacity) {
  return checked(message, capacity, [&] {
    fl::LinearCrossEntropyOptions o;
    o.logit_softcap = logit_softcap;
    if (workspace_bytes > 0) o.workspace_bytes = size_t(workspace_bytes);
    o.backward_mode = fl::LinearCeBackward(backward_mode);
    fl::validate_linear_cross_entropy_options(
        plain_ce(ignore_index, label_smoothing, formula, scope, z_loss, reduction), o, rows,
        vocab_local, hidden);
  });
}

// The backward mode `mode` (Auto, InForward, Recompute) resolves to for these inputs.
// row_weighted: a reduction 'none' with a loss_mask (the row weights of the in-forward backward).
int fusedloss_jax_resolve_linear_ce_backward(int32_t mode, int32_t reduction, int32_t dtype,
                                             int32_t row_weighted, int32_t* resolved,
                                             char* message, size_t capacity) {
  return checked(message, capacity, [&] {
    *resolved = int32_t(fl::resolve_linear_ce_backward(fl::LinearCeBackward(mode),
                                                       fl::Reduction(reduction), fl::DType(dtype),
                                                       row_weighted != 0));
  });
}

int fusedloss_jax_validate_linear_log_probs(float temperature, int64_t workspace_bytes,
                                           int64_t rows, int64_t vocab_local, int64_t hidden,
                                           char* message, size_t capacity) {
  return checked(message, capacity, [&] {
    fl::LinearLogProbsOptions o;
    o.temperature = temperature;
    if (workspace_bytes > 0) o.workspace_bytes = size_t(workspace_bytes);
    fl::validate_linear_log_probs_options(o, rows, vocab_local, hidden);
  });
}

int fusedloss_jax_validate_linear_distillation(int64_t divergence, float beta, float temperature,
                                              float hard_label_weight, int64_t ignore_index,
                                              int64_t workspace_bytes, int64_t rows, int64_t vocab,
                                              int32_t has_target, char* message, size_t capacity) {
  return checked(message, capacity, [&] {
    fl::LinearDistillationOptions o;
    o.divergence = fl::Divergence(divergence);
    o.beta = beta;
    o.temperature = temperature;
    o.hard_label_weight = hard_label_weight;
    o.ignore_index = ignore_index;
    if (workspace_bytes > 0) o.workspace_bytes = size_t(workspace_bytes);
    fl::validate_linear_distillation_options(o, rows, vocab, has_target != 0);
  });
}

int fusedloss_jax_validate_rms_norm(float eps, int32_t zero_centered_gamma, char* message,
                                    size_t capacity) {
  return checked(message, capacity, [&] {
    fl::RmsNormOptions o;
    o.eps = eps;
    o.zero_centered_gamma = zero_centered_gamma != 0;
    fl::validate_rms_norm_options(o);
  });
}

// The vocab_block of a linear cross-entropy backward of the resolved `mode` (LinearCeBackward)
// into a dweight of `dtype` (DType) with an fp32 (1) or weight-dtype (0) accumulation.
int64_t fusedloss_jax_backward_vocab_block(int32_t mode, int32_t fp32_accumulation, int32_t dtype,
                                           int64_t hidden) {
  return fl::linear_cross_entropy_backward_vocab_block(fl::LinearCeBackward(mode),
                                                       fp32_accumulation != 0, fl::DType(dtype),
                                                       hidden);
}

// Whether the RMSNorm kernels read a weight of dtype `weight` beside x of dtype `x` as it is.
int fusedloss_jax_rms_norm_reads_weight_as_is(int32_t x, int32_t weight) {
  return fl::rms_norm_reads_weight_as_is(fl::DType(x), fl::DType(weight)) ? 1 : 0;
}

// clamp: whether clamp_value applies (no clamp: clamp_value=None on the Python side).
int fusedloss_jax_validate_swiglu(int32_t clamp, float clamp_value, float gate_multiplier,
                                  float down_multiplier, char* message, size_t capacity) {
  return checked(message, capacity, [&] {
    fl::SwigluOptions o;
    o.clamp = clamp != 0;
    o.clamp_value = clamp_value;
    o.gate_multiplier = gate_multiplier;
    o.down_multiplier = down_multiplier;
    fl::validate_swiglu_options(o);
  });
}

// Drives the CUDA handlers' scratch binding on the host, as the core calls it (serves, then
// allocate), over a stand-in for XLA's FFI allocator with its rules: an alignment that is a power
// of two up to 16 bytes, or no memory; blocks 16 bytes past a 256-byte boundary (the worst case
// for the core's 256-byte rule). 0 when `bytes` came back 256-byte aligned inside the block.
int fusedloss_jax_check_scratch_binding(size_t bytes, char* message, size_t capacity) {
  return checked(message, capacity, [&] {
    struct HostXla {
      std::vector<unsigned char> arena;
      unsigned char* block = nullptr;
      size_t size = 0;
    } xla;
    const ScratchSource source{&xla, [](void* self, size_t size, size_t alignment) {
      auto& x = *static_cast<HostXla*>(self);
      if (alignment == 0 || (alignment & (alignment - 1)) || alignment > kXlaMaxAlignment)
        return std::optional<void*>();  // XLA: "Unsupported alignment"
      x.arena.assign(size + 2 * kCoreAlignment, 0);
      const uintptr_t base = reinterpret_cast<uintptr_t>(x.arena.data());
      const uintptr_t at = (base + kCoreAlignment - 1) / kCoreAlignment * kCoreAlignment + 16;
      x.block = reinterpret_cast<unsigned char*>(at);
      x.size = size;
      return std::optional<void*>(x.block);
    }};
    BoundScratch bound(&source);
    const fl::ScratchAllocator& a = xla_scratch_allocator();
    if (!a.serves(nullptr, a.context))
      throw std::runtime_error("the bound scratch allocator declines the handler's stream");
    auto* p = static_cast<unsigned char*>(a.allocate(bytes, nullptr, a.context));
    if (p == nullptr)
      throw std::runtime_error("fusedloss scratch of " + std::to_string(bytes) +
                               " bytes: the bound allocator has no memory for it");
    if (reinterpret_cast<uintptr_t>(p) % kCoreAlignment != 0)
      throw std::runtime_error("scratch at an address not 256-byte aligned");
    if (p < xla.block || p + bytes > xla.block + xla.size)
      throw std::runtime_error("scratch of " + std::to_string(bytes) +
                               " bytes reaches past the allocator's block");
    a.release(p, nullptr, a.context);
  });
}

// Synchronises `stream` (null: the legacy default stream) and reports the first bad target the
// CUDA kernels of this library flagged since the last call (fusedloss::check_device_errors).
int fusedloss_jax_check_device_errors(void* stream, char* message, size_t capacity) {
  return checked(message, capacity, [&] { fl::check_device_errors(stream); });
}

}  // extern "C"

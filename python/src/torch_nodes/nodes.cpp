// What every op's C++ autograd node shares (nodes.h), the core's table as fusedloss._C hands it
// over, and the core's CUDA scratch from torch's caching allocator.
#include "nodes.h"

#include <ATen/TensorUtils.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace fusedloss::torch_nodes {

namespace {

// set by fusedloss_torch_attach
std::atomic<const CoreTable*> g_core{nullptr};

}  // namespace

const CoreTable* attached_core() { return g_core.load(std::memory_order_acquire); }

// ---- tensors -> views ----

fusedloss::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return fusedloss::DType::F32;
    case at::kHalf: return fusedloss::DType::F16;
    case at::kBFloat16: return fusedloss::DType::BF16;
    default: TORCH_CHECK_VALUE(false, "fusedloss internal: dtype ", t.scalar_type(), " has no kernel");
  }
}

fusedloss::Device backend_of(const at::Tensor& t) {
  return t.is_cuda() ? fusedloss::Device::CUDA : fusedloss::Device::CPU;
}

fusedloss::Stream stream_of(const at::Tensor& t) {
  if (!t.is_cuda()) return nullptr;
  // through c10's device-generic interface: no link to libc10_cuda, the same current stream
  return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(t.device()).native_handle();
}

// t as [rows, cols] over its own memory when the kernels can read it as is, else undefined
// (expanded, transposed or overlapping rows): _views._rows_view.
at::Tensor rows_view(const at::Tensor& t) {
  const int64_t cols = t.size(-1);
  if (cols < 1 || (t.stride(-1) != 1 && cols > 1)) return {};
  const int64_t rows = t.numel() / cols;
  at::Tensor r;
  if (t.dim() == 2) {
    r = t;
  } else if (const int64_t shape[2] = {rows, cols};
             at::detail::computeStride(t.sizes(), t.strides(), at::IntArrayRef(shape, 2))) {
    r = t.view({rows, cols});  // (no copy: the leading dims flatten)
  } else {
    return {};
  }
  return rows > 1 && r.stride(0) < cols ? at::Tensor() : r;
}

// t as [rows, cols] rows the kernels read: a view where one exists, else a copy.
at::Tensor rows_of(const at::Tensor& t) {
  at::Tensor r = rows_view(t);
  return r.defined() ? r : t.contiguous().view({-1, t.size(-1)});
}

fusedloss::MatrixView matrix(const at::Tensor& rows) {
  const int64_t n = rows.size(0), cols = rows.size(1);
  return {rows.data_ptr(), n, cols, n > 1 ? rows.stride(0) : cols, dtype_of(rows), backend_of(rows)};
}

fusedloss::VectorView vector(const at::Tensor& t) {
  return {t.data_ptr(), t.numel(), dtype_of(t), backend_of(t)};
}

at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// Whether a gradient may overwrite t's memory: an autograd intermediate (not a leaf or a view
// of one) whose rows the kernels address as they are (_views.storage_is_ours).
bool storage_is_ours(const at::Tensor& t) {
  const bool base_is_leaf = t.is_view() ? t._base().is_leaf() : t.is_leaf();
  return !t.is_leaf() && !base_is_leaf && rows_view(t).defined();
}

// A node whose backward wrote the gradient into its input refuses a second backward
// (_op.py: FusedOp._backward).
void refuse_if_consumed(AutogradContext* ctx, const char* op, const char* flag,
                        const char* consumed) {
  TORCH_CHECK(!ctx->saved_data.count("consumed"), op, ": second backward through a result computed "
              "with ", flag, "=True; the first backward ", consumed, ", so it cannot be "
              "differentiated again. Use ", flag, "=False to backward twice (retain_graph=True).");
}

void mark_consumed(AutogradContext* ctx, const at::Tensor& input) {
  ctx->saved_data["consumed"] = true;
  input.unsafeGetTensorImpl()->bump_version();  // it holds its gradient: later readers trip
}

// Whether the byte ranges of a's and b's elements meet (_views.shares_memory).
bool shares_memory(const at::Tensor& a, const at::Tensor& b) {
  if (!a.numel() || !b.numel() || a.device() != b.device()) return false;
  auto range = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d)
      if (t.size(d) > 0) last += (t.size(d) - 1) * t.stride(d);
    const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
    return std::make_pair(first, first + uintptr_t((last + 1) * int64_t(t.element_size())) - 1);
  };
  const auto [a0, a1] = range(a);
  const auto [b0, b1] = range(b);
  return a0 <= b1 && b0 <= a1;
}

// t, or a copy when it shares memory with `written` (_views.apart_from).
at::Tensor apart_from(const at::Tensor& t, const at::Tensor& written) {
  return t.defined() && shares_memory(t, written) ? t.clone() : t;
}

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); }

// ---- class indices and the cross-entropy's options ----

// What a direct caller of a public op passes as class indices (_views.require_index_dtype):
// signed integers, or uint8/uint16/uint32 (uint64's may not fit int64).
void require_index_dtype(const at::Tensor& target) {
  const auto d = target.scalar_type();
  TORCH_CHECK_VALUE(d == at::kByte || d == at::kChar || d == at::kShort || d == at::kInt ||
                        d == at::kLong || d == at::kUInt16 || d == at::kUInt32,
                    "target.dtype: got ", d, ", expected an integer dtype (class indices; signed, "
                    "or uint8/uint16/uint32)");
}

// Class indices as the kernels read them (_views.index): int32/int64 as they are, any other
// integer dtype (checked by the caller) widened to int64; contiguous.
at::Tensor index_of(const at::Tensor& target) {
  at::Tensor t = target;
  if (t.scalar_type() != at::kInt && t.scalar_type() != at::kLong) t = t.to(at::kLong);
  return t.is_contiguous() ? t : t.reshape(-1).contiguous();
}

fusedloss::IndexView index_view(const at::Tensor& t) {
  return {t.data_ptr(), t.numel(),
          t.scalar_type() == at::kInt ? fusedloss::IndexType::I32 : fusedloss::IndexType::I64,
          backend_of(t)};
}

// The options as the Python schema carries them (enums as their integer values).
fusedloss::CrossEntropyOptions ce_options(int64_t ignore_index, double label_smoothing,
                                          int64_t formula, int64_t scope, double z_loss,
                                          int64_t reduction, double logit_softcap) {
  fusedloss::CrossEntropyOptions o;
  o.ignore_index = ignore_index;
  o.label_smoothing = float(label_smoothing);
  o.smoothing_formula = fusedloss::SmoothingFormula(formula);
  o.smoothing_scope = fusedloss::SmoothingScope(scope);
  o.z_loss = float(z_loss);
  o.reduction = fusedloss::Reduction(reduction);
  o.logit_softcap = float(logit_softcap);
  return o;
}

void keep(AutogradContext* ctx, std::initializer_list<std::pair<const char*, c10::IValue>> options) {
  for (const auto& [name, value] : options) ctx->saved_data[name] = value;
}

void keep_ce_options(AutogradContext* ctx, int64_t ignore_index, double label_smoothing,
                     int64_t formula, int64_t scope, double z_loss, int64_t reduction,
                     double logit_softcap) {
  keep(ctx, {{"ignore_index", ignore_index}, {"label_smoothing", label_smoothing},
             {"formula", formula}, {"scope", scope}, {"z_loss", z_loss},
             {"reduction", reduction}, {"softcap", logit_softcap}});
}

fusedloss::CrossEntropyOptions kept_ce_options(AutogradContext* ctx) {
  auto& d = ctx->saved_data;
  return ce_options(d["ignore_index"].toInt(), d["label_smoothing"].toDouble(),
                    d["formula"].toInt(), d["scope"].toInt(), d["z_loss"].toDouble(),
                    d["reduction"].toInt(), d["softcap"].toDouble());
}

// ---- the double-backward guard (python/fusedloss/_op.py: _NoSecondOrder) ----

namespace {

// Joins a gradient to the op's differentiable inputs ("anchors") and refuses to be
// differentiated: the backward kernels are not differentiable ops, so a second-order gradient
// through them would be silently wrong.
struct NoSecondOrder : torch::autograd::Function<NoSecondOrder> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, const std::string& op,
                            at::TensorList anchors) {
    (void)anchors;
    ctx->saved_data["op"] = op;
    return grad.view_as(grad);
  }
  static variable_list backward(AutogradContext* ctx, variable_list) {
    TORCH_CHECK(false, ctx->saved_data["op"].toStringRef(),
                ": differentiating its gradient (a double backward, e.g. through "
                "create_graph=True) is not supported; its backward is a fused kernel, not a "
                "differentiable op");
  }
};

}  // namespace

// Under create_graph=True (grad mode on when the backward began): every gradient guarded (the
// values stay usable).
void guard_second_order(bool create_graph, variable_list& grads, const variable_list& saved,
                        const char* op) {
  if (!create_graph) return;
  std::vector<at::Tensor> anchors;
  for (const auto& t : saved)
    if (t.defined() && t.requires_grad()) anchors.push_back(t);
  for (auto& g : grads) {
    if (!g.defined()) continue;
    if (anchors.empty() && !g.requires_grad()) g = g.detach().requires_grad_();
    g = NoSecondOrder::apply(g, std::string(op), at::TensorList(anchors));
  }
}


}  // namespace fusedloss::torch_nodes

using fusedloss::torch_nodes::CoreTable;
using fusedloss::torch_nodes::g_core;

// Called by fusedloss/_native.py right after loading this library, with fusedloss._C's table
// and its size: 0 when attached, 1 when the table's layout is not this library's (a _C from
// another build), which leaves the nodes unusable and the Python nodes serving.
extern "C" __attribute__((visibility("default"))) int fusedloss_torch_attach(const CoreTable* table,
                                                                            uint32_t size) {
  if (!table || size != sizeof(CoreTable) || table->size != sizeof(CoreTable) ||
      table->version != fusedloss::python::kCoreTableVersion)
    return 1;
  const CoreTable& t = *table;
  for (const void* entry : {(const void*)t.rms_norm_forward, (const void*)t.rms_norm_backward_workspace_bytes,
                            (const void*)t.rms_norm_backward, (const void*)t.swiglu_forward,
                            (const void*)t.swiglu_backward, (const void*)t.cross_entropy_forward,
                            (const void*)t.cross_entropy_forward_with_grad, (const void*)t.cross_entropy_backward,
                            (const void*)t.cross_entropy_scale_grad, (const void*)t.linear_cross_entropy_forward,
                            (const void*)t.linear_cross_entropy_backward, (const void*)t.set_scratch_allocator,
                            (const void*)t.resolve_linear_ce_backward, (const void*)t.swiglu_gate_up_forward,
                            (const void*)t.swiglu_gate_up_backward})
    if (!entry) return 1;
  g_core.store(table, std::memory_order_release);
  return 0;
}

namespace {

// ---- the core's CUDA scratch from torch's caching allocator (fusedloss.set_scratch_allocator) ----
//
// A block is a uint8 tensor on the current device, allocated on its current stream; releasing
// it drops the tensor, which returns the block to torch's cache for work queued on that stream
// from then on: the same stream-ordered rule as cudaFreeAsync. Scratch for any other stream
// (another device's, or a stream that is not the current one) is not served here: the core
// then takes cudaMallocAsync for it. Out of memory in torch's cache is the call's
// torch.OutOfMemoryError, as a torch allocation of the same size would be.

struct TorchScratch {
  std::mutex mu;
  std::unordered_map<void*, c10::DataPtr> held;
};

TorchScratch& torch_scratch() {
  static auto* scratch = new TorchScratch;  // never destroyed: blocks may come back during exit
  return *scratch;
}

// The block comes straight from the registered CUDA allocator (torch's caching allocator), not
// through at::empty: no dispatcher on the way (a dispatch mode would see an allocation in the
// middle of a core call; deterministic mode would fill every block).
bool torch_scratch_serves(fusedloss::Stream stream, void*) noexcept {
  try {
    const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
    return cuda.getStream(cuda.getDevice()).native_handle() == stream;
  } catch (...) {  // no CUDA: cudaMallocAsync reports it
    return false;
  }
}

void* torch_scratch_allocate(size_t bytes, fusedloss::Stream, void*) noexcept {
  try {
    c10::DataPtr block = c10::GetAllocator(c10::DeviceType::CUDA)->allocate(bytes);
    void* ptr = block.get();
    if (!ptr) return nullptr;
    TorchScratch& s = torch_scratch();
    std::lock_guard<std::mutex> lock(s.mu);
    s.held.emplace(ptr, std::move(block));
    return ptr;
  } catch (...) {  // out of memory in torch's cache: the core raises OutOfMemory
    return nullptr;
  }
}

void torch_scratch_release(void* ptr, fusedloss::Stream, void*) noexcept {
  c10::DataPtr block;  // freed after the lock, into torch's cache
  TorchScratch& s = torch_scratch();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.held.find(ptr);
    if (it == s.held.end()) return;
    block = std::move(it->second);
    s.held.erase(it);
  }
}

}  // namespace

// Called by fusedloss.set_scratch_allocator: 1 takes the core's CUDA scratch from torch's
// caching allocator, 0 gives it back to cudaMallocAsync. Returns 0, or 1 when the core is not
// attached or refused.
extern "C" __attribute__((visibility("default"))) int fusedloss_torch_scratch(int from_torch) {
  const CoreTable* core = g_core.load(std::memory_order_acquire);
  if (!core) return 1;
  static const fusedloss::ScratchAllocator allocator{&torch_scratch_allocate, &torch_scratch_release,
                                                      nullptr, &torch_scratch_serves};
  return core->set_scratch_allocator(from_torch ? &allocator : nullptr) ? 1 : 0;
}


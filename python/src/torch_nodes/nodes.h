// fusedloss's autograd nodes in C++ for eager PyTorch calls (libfusedloss_torch.so, loaded by
// fusedloss/_native.py with torch.ops.load_library): what every op's node shares. One file an
// op beside this one (rms_norm.cpp, swiglu.cpp, cross_entropy.cpp, linear_cross_entropy.cpp),
// each with its node, its eager entry point and their registration. Only the eager entry points
// ("<op>_eager") are registered here: the traced path uses the Python custom ops of the same
// names without the suffix.
//
// Why: every eager op pays the autograd engine's round trip, and a node written in Python adds
// to it (bench/autograd_node_probe.py on an H200 host: an empty node costs 94 us forward +
// backward in Python, 78 us in C++; F.rms_norm's whole op 103 us). These nodes run the same
// steps as the Python scaffold's eager path (python/fusedloss/_op.py and the op's module): the
// same views, copies, allocations, kernels and double-backward guard. The Python layer still
// checks the arguments first (its messages name them); torch.compile keeps the Python custom ops.
//
// Built only against the torch it was compiled with (the version is checked before loading).
// The core is not linked in: the nodes call fusedloss._C's through its table (core_table.h).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <initializer_list>
#include <optional>
#include <utility>
#include <string>

#include "../core_table.h"
#include "fusedloss/fusedloss.h"

namespace fusedloss::torch_nodes {

using fusedloss::python::CoreTable;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The core, as fusedloss._C exports it: null until fusedloss_torch_attach (nodes.cpp).
const CoreTable* attached_core();

// ---- tensors -> views (python/fusedloss/_views.py has the same rules) ----

fusedloss::DType dtype_of(const at::Tensor& t);
fusedloss::Device backend_of(const at::Tensor& t);
fusedloss::Stream stream_of(const at::Tensor& t);
// t as [rows, cols] over its own memory when the kernels can read it as is, else undefined
// (expanded, transposed or overlapping rows): _views._rows_view.
at::Tensor rows_view(const at::Tensor& t);
// t as [rows, cols] rows the kernels read: a view where one exists, else a copy.
at::Tensor rows_of(const at::Tensor& t);
fusedloss::MatrixView matrix(const at::Tensor& rows);
fusedloss::VectorView vector(const at::Tensor& t);
at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype);
at::Tensor or_undefined(const std::optional<at::Tensor>& t);
// Whether the byte ranges of a's and b's elements meet (_views.shares_memory).
bool shares_memory(const at::Tensor& a, const at::Tensor& b);
// t, or a copy when it shares memory with `written` (_views.apart_from).
at::Tensor apart_from(const at::Tensor& t, const at::Tensor& written);

// ---- class indices and the cross-entropy's options (cross_entropy.cpp, linear_cross_entropy.cpp) ----

// What a direct caller of a public op passes as class indices (_views.require_index_dtype):
// signed integers, or uint8/uint16/uint32 (uint64's may not fit int64).
void require_index_dtype(const at::Tensor& target);
// Class indices as the kernels read them (_views.index): int32/int64 as they are, any other
// integer dtype (checked by the caller) widened to int64; contiguous.
at::Tensor index_of(const at::Tensor& target);
fusedloss::IndexView index_view(const at::Tensor& t);
// The options as the Python schema carries them (enums as their integer values).
fusedloss::CrossEntropyOptions ce_options(int64_t ignore_index, double label_smoothing,
                                          int64_t formula, int64_t scope, double z_loss,
                                          int64_t reduction,
                                          double logit_softcap = 0.0);

// ---- options kept for the backward ----

// A node's options by name in ctx->saved_data.
void keep(AutogradContext* ctx, std::initializer_list<std::pair<const char*, c10::IValue>> options);
// ce_options' arguments, as both losses' nodes keep them, and the options they make.
void keep_ce_options(AutogradContext* ctx, int64_t ignore_index, double label_smoothing,
                     int64_t formula, int64_t scope, double z_loss, int64_t reduction,
                     double logit_softcap);
fusedloss::CrossEntropyOptions kept_ce_options(AutogradContext* ctx);

// ---- the core call ----

// One core call through the table's `entry`; a core Error becomes a ValueError with the core's
// message (the Python bindings raise fusedloss._C.Error, a ValueError subclass: catch
// ValueError to handle both), anything else a RuntimeError.
template <class Entry, class... Args>
void core_call(Entry CoreTable::*entry, Args&&... args) {
  const CoreTable* core = attached_core();
  TORCH_CHECK(core, "fusedloss: the C++ nodes were called without fusedloss._C's core attached "
              "(import fusedloss first; fusedloss._native.status says why they are not in use)");
  if (const auto* failure = (core->*entry)(std::forward<Args>(args)...)) {
    const std::string what = failure->message;
    TORCH_CHECK_WITH(OutOfMemoryError, !failure->out_of_memory, what);
    TORCH_CHECK(failure->argument_error, what);
    // the Python argument's name: "options.label_smoothing: ..." -> "label_smoothing: ..."
    const std::string prefix = "options.";
    TORCH_CHECK_VALUE(false, what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what);
  }
}

// ---- gradients written in place, and second-order gradients ----

// Whether a gradient may overwrite t's memory: an autograd intermediate (not a leaf or a view
// of one) whose rows the kernels address as they are (_views.storage_is_ours).
bool storage_is_ours(const at::Tensor& t);
// A node whose backward wrote the gradient into its input refuses a second backward
// (_op.py: FusedOp._backward).
void refuse_if_consumed(AutogradContext* ctx, const char* op, const char* flag,
                        const char* consumed = "overwrote the input with its gradient");
void mark_consumed(AutogradContext* ctx, const at::Tensor& input);
// Under create_graph=True (grad mode on when the backward began): every gradient guarded (the
// values stay usable), so that differentiating it raises (python/fusedloss/_op.py:
// _NoSecondOrder): the backward kernels are not differentiable ops.
void guard_second_order(bool create_graph, variable_list& grads, const variable_list& saved,
                        const char* op);

}  // namespace fusedloss::torch_nodes

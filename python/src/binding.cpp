// fusedloss._C: the C++ API for Python, over raw pointers. Plain C++ (no LibTorch): the Python
// layer passes tensor.data_ptr() and the current stream, so this module does not depend on
// which CUDA version torch was built with.
#include <exception>
#include <string>
#include <optional>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core_table.h"
#include "fusedloss/fusedloss.h"

namespace py = pybind11;
using namespace fusedloss;

namespace {

void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }
float* fptr(uintptr_t p) { return reinterpret_cast<float*>(p); }

PyObject* g_error_type = nullptr;  // fusedloss._C.Error (a ValueError), set at import

// Runs one C++ API call. A fusedloss::Error becomes fusedloss._C.Error (a ValueError) right
// here, with its message, without going through pybind11's exception translator registry;
// one that wraps a Python exception raised in a callback (the library nests a communicator's
// own exception in the Error it throws) re-raises that exception as it was, type and
// traceback (a torch.distributed timeout stays one).
template <class Body>
void guarded(Body&& body) {
  try {
    body();
  } catch (const OutOfMemory& e) {
    // torch.OutOfMemoryError, which batch-size finders and OOM handlers catch (MemoryError
    // without torch)
    py::object oom = py::reinterpret_borrow<py::object>(PyExc_MemoryError);
    try {
      oom = py::module_::import("torch").attr("OutOfMemoryError");
    } catch (py::error_already_set&) {
    }
    PyErr_SetString(oom.ptr(), e.what());
    throw py::error_already_set();
  } catch (const Error& e) {
    try {
      std::rethrow_if_nested(e);
    } catch (py::error_already_set&) {
      throw;
    } catch (...) {
    }
    PyErr_SetString(g_error_type, e.what());
    throw py::error_already_set();
  }
}

// A Communicator whose collectives are Python callables (a torch.distributed group, in
// fusedloss/_distributed.py): gather(send, recv, bytes_per_rank, stream) and
// reduce(data, count, "max" | "sum", stream) over raw addresses. The GIL is held throughout
// (see below); a Python exception unwinds through the C++ call nested in an Error, and
// guarded() raises the Python exception itself.
class CallbackCommunicator : public Communicator {
 public:
  CallbackCommunicator(int rank, int size, Device device, py::function gather,
                       py::function reduce)
      : rank_(rank), size_(size), device_(device), gather_(std::move(gather)),
        reduce_(std::move(reduce)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return device_; }
  void all_gather(const void* send, void* recv, size_t bytes_per_rank, Stream stream) override {
    gather_(reinterpret_cast<uintptr_t>(send), reinterpret_cast<uintptr_t>(recv), bytes_per_rank,
            reinterpret_cast<uintptr_t>(stream));
  }
  void all_reduce(float* data, size_t count, ReduceOp op, Stream stream) override {
    reduce_(reinterpret_cast<uintptr_t>(data), count, op == ReduceOp::Max ? "max" : "sum",
            reinterpret_cast<uintptr_t>(stream));
  }

 private:
  int rank_, size_;
  Device device_;
  py::function gather_, reduce_;
};

// ---- the core table for the C++ autograd nodes (core_table.h) ----

// Runs one core call for the table: nullptr, or what it threw (kept per thread until that
// thread's next failing call).
template <class Body>
python::CoreError caught(Body&& body) noexcept {
  thread_local std::string message;
  thread_local python::CoreFailure failure;
  failure.argument_error = false;
  failure.out_of_memory = false;
  try {
    body();
    return nullptr;
  } catch (const OutOfMemory& e) {
    failure.out_of_memory = true;
    message = e.what();
  } catch (const Error& e) {
    failure.argument_error = true;
    message = e.what();
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "fusedloss internal: an unknown exception in the core";
  }
  failure.message = message.c_str();
  return &failure;
}

// Fn as a table entry with Fn's parameters (the overload picked by the entry's type).
template <class Entry, Entry Fn>
struct Exported;
template <class... Args, void (*Fn)(Args...)>
struct Exported<void (*)(Args...), Fn> {
  static python::CoreError call(Args... args) noexcept {
    return caught([&] { Fn(args...); });
  }
};

const python::CoreTable& core_table() {
  static const python::CoreTable table = [] {
    python::CoreTable t;
    t.rms_norm_forward = Exported<void (*)(const MatrixView&, const VectorView&, const RmsNormOptions&,
                                           const MatrixView&, float*, const MatrixView&,
                                           const MatrixView&, Stream),
                                  &rms_norm_forward>::call;
    t.rms_norm_backward_workspace_bytes = [](int64_t rows, int64_t hidden, Device device,
                                             size_t* bytes) noexcept {
      return caught([&] { *bytes = rms_norm_backward_workspace_bytes(rows, hidden, device); });
    };
    t.rms_norm_backward =
        Exported<void (*)(const MatrixView&, const MatrixView&, const VectorView&, const float*,
                          const RmsNormOptions&, const MatrixView&, void*, DType, void*,
                          const MatrixView&, Stream),
                 &rms_norm_backward>::call;
    t.swiglu_forward = Exported<decltype(&swiglu_forward), &swiglu_forward>::call;
    t.swiglu_backward = Exported<decltype(&swiglu_backward), &swiglu_backward>::call;
    t.cross_entropy_forward = Exported<decltype(&cross_entropy_forward), &cross_entropy_forward>::call;
    t.cross_entropy_forward_with_grad =
        Exported<decltype(&cross_entropy_forward_with_grad), &cross_entropy_forward_with_grad>::call;
    t.cross_entropy_backward = Exported<decltype(&cross_entropy_backward), &cross_entropy_backward>::call;
    t.cross_entropy_scale_grad =
        Exported<decltype(&cross_entropy_scale_grad), &cross_entropy_scale_grad>::call;
    t.linear_cross_entropy_forward =
        Exported<decltype(&linear_cross_entropy_forward), &linear_cross_entropy_forward>::call;
    t.linear_cross_entropy_backward =
        Exported<decltype(&linear_cross_entropy_backward), &linear_cross_entropy_backward>::call;
    t.set_scratch_allocator = Exported<decltype(&set_scratch_allocator), &set_scratch_allocator>::call;
    t.swiglu_gate_up_forward =
        Exported<decltype(&swiglu_gate_up_forward), &swiglu_gate_up_forward>::call;
    t.swiglu_gate_up_backward =
        Exported<decltype(&swiglu_gate_up_backward), &swiglu_gate_up_backward>::call;
    t.resolve_linear_ce_backward = [](LinearCeBackward mode, Reduction reduction, DType dtype,
                                      bool row_weighted, LinearCeBackward* resolved) noexcept {
      return caught(
          [&] { *resolved = resolve_linear_ce_backward(mode, reduction, dtype, row_weighted); });
    };
    return t;
  }();
  return table;
}

// The enums, views and the cross-entropy options every op shares.
void bind_types(py::module_& m) {
  py::enum_<DType>(m, "DType")
      .value("F32", DType::F32).value("F16", DType::F16).value("BF16", DType::BF16)
      .value("FP8_E4M3", DType::FP8_E4M3);
  py::enum_<Device>(m, "Device").value("CPU", Device::CPU).value("CUDA", Device::CUDA);
  py::enum_<IndexType>(m, "IndexType").value("I32", IndexType::I32).value("I64", IndexType::I64);
  py::enum_<Reduction>(m, "Reduction")
      .value("NONE", Reduction::None).value("SUM", Reduction::Sum).value("MEAN", Reduction::Mean);
  py::enum_<SmoothingFormula>(m, "SmoothingFormula")
      .value("PYTORCH", SmoothingFormula::PyTorch).value("MEGATRON", SmoothingFormula::Megatron);
  py::enum_<SmoothingScope>(m, "SmoothingScope")
      .value("GLOBAL", SmoothingScope::Global).value("PARTITION", SmoothingScope::Partition);

  py::class_<MatrixView>(m, "MatrixView")
      .def(py::init([](uintptr_t data, int64_t rows, int64_t cols, int64_t stride, DType dt,
                       Device dev) { return MatrixView{ptr(data), rows, cols, stride, dt, dev}; }),
           py::arg("data"), py::arg("rows"), py::arg("cols"), py::arg("row_stride"),
           py::arg("dtype"), py::arg("device"));
  py::class_<IndexView>(m, "IndexView")
      .def(py::init([](uintptr_t data, int64_t size, IndexType t, Device dev) {
        return IndexView{ptr(data), size, t, dev};
      }));
  py::class_<VectorView>(m, "VectorView")
      .def(py::init([](uintptr_t data, int64_t size, DType dt, Device dev) {
        return VectorView{ptr(data), size, dt, dev};
      }))
      .def(py::init([]() { return VectorView{}; }));

  py::class_<CrossEntropyOptions>(m, "CrossEntropyOptions")
      .def(py::init<>())
      .def_readwrite("ignore_index", &CrossEntropyOptions::ignore_index)
      .def_readwrite("label_smoothing", &CrossEntropyOptions::label_smoothing)
      .def_readwrite("smoothing_formula", &CrossEntropyOptions::smoothing_formula)
      .def_readwrite("smoothing_scope", &CrossEntropyOptions::smoothing_scope)
      .def_readwrite("z_loss", &CrossEntropyOptions::z_loss)
      .def_readwrite("logit_softcap", &CrossEntropyOptions::logit_softcap)
      .def_readwrite("reduction", &CrossEntropyOptions::reduction)
      .def_readwrite("vocab_start", &CrossEntropyOptions::vocab_start)
      .def_readwrite("vocab_global", &CrossEntropyOptions::vocab_global)
      .def_readwrite("check_shard_agreement", &CrossEntropyOptions::check_shard_agreement);
}

// fusedloss/cross_entropy.h.
void bind_cross_entropy(py::module_& m) {
  // Shape-only validators: the entry points' own option checks, for fake tensors too.
  m.def("validate_cross_entropy_options",
        [](const CrossEntropyOptions& o, int64_t rows, int64_t vocab_local) {
          guarded([&] { validate_cross_entropy_options(o, rows, vocab_local); });
        },
        py::arg("options"), py::arg("rows"), py::arg("vocab_local"));
  m.def("cross_entropy_forward",
        [](const MatrixView& x, const IndexView& t, const CrossEntropyOptions& o, uintptr_t loss,
           uintptr_t lse, uintptr_t count, uintptr_t stream) {
          guarded([&] {
            cross_entropy_forward(x, t, o, {fptr(loss), fptr(lse), fptr(count)}, nullptr,
                                  ptr(stream));
          });
        });
  m.def("cross_entropy_local_stats",
        [](const MatrixView& x, const IndexView& t, const CrossEntropyOptions& o, uintptr_t stats,
           uintptr_t stream) {
          guarded([&] {
            cross_entropy_local_stats(x, t, o, static_cast<RowStats*>(ptr(stats)), ptr(stream));
          });
        });
  m.def("cross_entropy_merge",
        [](uintptr_t combined, int parts, uintptr_t local, const IndexView& t,
           const CrossEntropyOptions& o, int64_t vocab_local, uintptr_t loss, uintptr_t lse,
           uintptr_t count, uintptr_t stream, uintptr_t row_scratch) {
          guarded([&] {
            cross_entropy_merge(static_cast<const RowStats*>(ptr(combined)), parts,
                                static_cast<const RowStats*>(ptr(local)), t, o, vocab_local,
                                {fptr(loss), fptr(lse), fptr(count)}, ptr(stream),
                                fptr(row_scratch));
          });
        },
        py::arg("combined"), py::arg("parts"), py::arg("local"), py::arg("target"),
        py::arg("options"), py::arg("vocab_local"), py::arg("loss"), py::arg("lse"),
        py::arg("count"), py::arg("stream"), py::arg("row_scratch") = 0);
  m.def("cross_entropy_backward",
        [](const MatrixView& x, const IndexView& t, uintptr_t lse, uintptr_t grad_loss,
           uintptr_t count, const CrossEntropyOptions& o, const MatrixView& grad, uintptr_t stream) {
          guarded([&] {
            cross_entropy_backward(x, t, fptr(lse), fptr(grad_loss), fptr(count), o, grad,
                                   ptr(stream));
          });
        });
  m.def("cross_entropy_forward_with_grad",
        [](const MatrixView& x, const IndexView& t, const CrossEntropyOptions& o, uintptr_t loss,
           uintptr_t lse, uintptr_t count, const MatrixView& grad, uintptr_t stream) {
          guarded([&] {
            cross_entropy_forward_with_grad(x, t, o, {fptr(loss), fptr(lse), fptr(count)}, grad,
                                            nullptr, ptr(stream));
          });
        });
  m.def("cross_entropy_scale_grad", [](const MatrixView& grad, uintptr_t grad_loss, uintptr_t stream) {
    guarded([&] { cross_entropy_scale_grad(grad, fptr(grad_loss), ptr(stream)); });
  });
}

// fusedloss/swiglu.h.
void bind_swiglu(py::module_& m) {
  py::class_<SwigluOptions>(m, "SwigluOptions")
      .def(py::init<>())
      .def_readwrite("clamp", &SwigluOptions::clamp)
      .def_readwrite("clamp_value", &SwigluOptions::clamp_value)
      .def_readwrite("fp8_saturate", &SwigluOptions::fp8_saturate)
      .def_readwrite("clamp_gate_grad_at_bound", &SwigluOptions::clamp_gate_grad_at_bound)
      .def_readwrite("clamp_up_grad_at_bound", &SwigluOptions::clamp_up_grad_at_bound)
      .def_readwrite("gate_multiplier", &SwigluOptions::gate_multiplier)
      .def_readwrite("down_multiplier", &SwigluOptions::down_multiplier);
  m.def("validate_swiglu_options",
        [](const SwigluOptions& o) { guarded([&] { validate_swiglu_options(o); }); },
        py::arg("options"));
  m.def("swiglu_forward",
        [](const MatrixView& y, const VectorView& bias, const VectorView& w, const SwigluOptions& o,
           const MatrixView& out, const MatrixView& y8, uintptr_t stream) {
          guarded([&] { swiglu_forward(y, bias, w, o, out, y8, ptr(stream)); });
        });
  m.def("swiglu_backward",
        [](const MatrixView& g, const MatrixView& y, const VectorView& bias, const VectorView& w,
           const SwigluOptions& o, const MatrixView& gy, uintptr_t gw, uintptr_t gb,
           uintptr_t stream) {
          guarded([&] { swiglu_backward(g, y, bias, w, o, gy, fptr(gw), fptr(gb), ptr(stream)); });
        });
  m.def("swiglu_gate_up_forward",
        [](const MatrixView& gate, const MatrixView& up, const VectorView& bias, const VectorView& w,
           const SwigluOptions& o, const MatrixView& out, const MatrixView& in8, uintptr_t stream) {
          guarded([&] { swiglu_gate_up_forward(gate, up, bias, w, o, out, in8, ptr(stream)); });
        });
  m.def("swiglu_gate_up_backward",
        [](const MatrixView& g, const MatrixView& gate, const MatrixView& up, const VectorView& bias,
           const VectorView& w, const SwigluOptions& o, const MatrixView& dgate,
           const MatrixView& dup, uintptr_t gw, uintptr_t gb, uintptr_t stream) {
          guarded([&] {
            swiglu_gate_up_backward(g, gate, up, bias, w, o, dgate, dup, fptr(gw), fptr(gb),
                                    ptr(stream));
          });
        });
}

// fusedloss/rms_norm.h.
void bind_rms_norm(py::module_& m) {
  py::class_<RmsNormOptions>(m, "RmsNormOptions")
      .def(py::init<>())
      .def_readwrite("eps", &RmsNormOptions::eps)
      .def_readwrite("zero_centered_gamma", &RmsNormOptions::zero_centered_gamma);
  m.def("rms_norm_reads_weight_as_is", &rms_norm_reads_weight_as_is, py::arg("x"), py::arg("weight"));
  m.def("validate_rms_norm_options",
        [](const RmsNormOptions& o) { guarded([&] { validate_rms_norm_options(o); }); });
  m.def("rms_norm_forward",
        [](const MatrixView& x, const VectorView& w, const RmsNormOptions& o, const MatrixView& y,
           uintptr_t rstd, const MatrixView& residual, const MatrixView& residual_out,
           uintptr_t stream) {
          guarded([&] {
            rms_norm_forward(x, w, o, y, fptr(rstd), residual, residual_out, ptr(stream));
          });
        });
  m.def("rms_norm_backward_workspace_bytes", [](int64_t rows, int64_t hidden, Device device) {
    size_t bytes = 0;
    guarded([&] { bytes = rms_norm_backward_workspace_bytes(rows, hidden, device); });
    return bytes;
  });
  m.def("rms_norm_backward",
        [](const MatrixView& gy, const MatrixView& x, const VectorView& w, uintptr_t rstd,
           const RmsNormOptions& o, const MatrixView& gx, uintptr_t gw, DType gw_dtype,
           uintptr_t workspace, const MatrixView& gres, uintptr_t stream) {
          guarded([&] {
            rms_norm_backward(gy, x, w, fptr(rstd), o, gx, ptr(gw), gw_dtype, ptr(workspace), gres,
                              ptr(stream));
          });
        });
}

// fusedloss/linear_cross_entropy.h.
void bind_linear_cross_entropy(py::module_& m) {
  py::enum_<LinearCeBackward>(m, "LinearCeBackward")
      .value("AUTO", LinearCeBackward::Auto).value("IN_FORWARD", LinearCeBackward::InForward)
      .value("RECOMPUTE", LinearCeBackward::Recompute);
  py::class_<LinearCrossEntropyOptions>(m, "LinearCrossEntropyOptions")
      .def(py::init<>())
      .def_readwrite("workspace_bytes", &LinearCrossEntropyOptions::workspace_bytes)
      .def_readwrite("chunk_rows", &LinearCrossEntropyOptions::chunk_rows)
      .def_readwrite("allow_tf32", &LinearCrossEntropyOptions::allow_tf32)
      .def_readwrite("logit_softcap", &LinearCrossEntropyOptions::logit_softcap)
      .def_readwrite("backward_mode", &LinearCrossEntropyOptions::backward_mode)
      .def_readwrite("vocab_block", &LinearCrossEntropyOptions::vocab_block);
  m.def("validate_linear_cross_entropy_options",
        [](const CrossEntropyOptions& ce, const LinearCrossEntropyOptions& o, int64_t rows,
           int64_t vocab_local, int64_t hidden) {
          guarded([&] { validate_linear_cross_entropy_options(ce, o, rows, vocab_local, hidden); });
        });
  m.def("resolve_linear_ce_backward",
        [](LinearCeBackward mode, Reduction reduction, DType dtype, bool row_weighted) {
          LinearCeBackward resolved = mode;
          guarded([&] { resolved = resolve_linear_ce_backward(mode, reduction, dtype, row_weighted); });
          return resolved;
        },
        py::arg("mode"), py::arg("reduction"), py::arg("dtype"), py::arg("row_weighted") = false);
  py::class_<CallbackCommunicator>(m, "CallbackCommunicator")
      .def(py::init<int, int, Device, py::function, py::function>(), py::arg("rank"),
           py::arg("size"), py::arg("device"), py::arg("gather"), py::arg("reduce"));
  m.def("linear_cross_entropy_chunk_rows",
        [](const LinearCrossEntropyOptions& o, int64_t rows, int64_t vocab_local, DType dtype) {
          int64_t chunk = 0;
          guarded([&] { chunk = linear_cross_entropy_chunk_rows(o, rows, vocab_local, dtype); });
          return chunk;
        });
  m.def("linear_cross_entropy_phase_times",
        [](bool reset) {
          const LinearCePhaseTimes t = linear_cross_entropy_phase_times(reset);
          py::dict d;
          d["logits_ms"] = t.logits_ms;
          d["ce_ms"] = t.ce_ms;
          d["dhidden_ms"] = t.dhidden_ms;
          d["dweight_ms"] = t.dweight_ms;
          d["loop_ms"] = t.loop_ms;
          d["loops"] = t.loops;
          return d;
        },
        py::arg("reset") = false);
  m.def("linear_cross_entropy_forward",
        [](const MatrixView& h, const MatrixView& w, const IndexView& t,
           const CrossEntropyOptions& ce, const LinearCrossEntropyOptions& o, uintptr_t loss,
           uintptr_t lse, uintptr_t count, const MatrixView& dh, const MatrixView& dw,
           uintptr_t stream, CallbackCommunicator* comm, uintptr_t scratch, size_t scratch_bytes,
           uintptr_t row_weight, const VectorView& bias, uintptr_t dbias) {
          guarded([&] {
            LinearCrossEntropyOutputs out;
            out.row_weight = fptr(row_weight);
            out.bias = bias;
            out.dbias = fptr(dbias);
            out.loss = fptr(loss);
            out.lse = fptr(lse);
            out.valid_count = fptr(count);
            out.dhidden = dh;
            out.dweight = dw;
            out.scratch = ptr(scratch);
            out.scratch_bytes = scratch_bytes;
            linear_cross_entropy_forward(h, w, t, ce, o, out, comm, ptr(stream));
          });
        },
        py::arg("hidden"), py::arg("weight"), py::arg("target"), py::arg("ce"), py::arg("options"),
        py::arg("loss"), py::arg("lse"), py::arg("count"), py::arg("dhidden"),
        py::arg("dweight"), py::arg("stream"), py::arg("comm") = nullptr, py::arg("scratch") = 0,
        py::arg("scratch_bytes") = 0, py::arg("row_weight") = 0, py::arg("bias") = VectorView{},
        py::arg("dbias") = 0);
  m.def("linear_cross_entropy_backward_vocab_block", &linear_cross_entropy_backward_vocab_block,
        py::arg("mode"), py::arg("fp32_accumulation"), py::arg("dweight_dtype"), py::arg("hidden"));
  m.def("linear_cross_entropy_forward_scratch_bytes",
        [](const MatrixView& h, const MatrixView& w, const CrossEntropyOptions& ce,
           const LinearCrossEntropyOptions& o, int comm_size) {
          size_t bytes = 0;
          guarded([&] { bytes = linear_cross_entropy_forward_scratch_bytes(h, w, ce, o, comm_size); });
          return bytes;
        },
        py::arg("hidden"), py::arg("weight"), py::arg("ce"), py::arg("options"),
        py::arg("comm_size"));
  m.def("linear_cross_entropy_local_stats",
        [](const MatrixView& h, const MatrixView& w, const IndexView& t,
           const CrossEntropyOptions& ce, const LinearCrossEntropyOptions& o, uintptr_t stats,
           uintptr_t stream, uintptr_t scratch, size_t scratch_bytes, const VectorView& bias) {
          guarded([&] {
            linear_cross_entropy_local_stats(h, w, t, ce, o, static_cast<RowStats*>(ptr(stats)),
                                             ptr(stream), ptr(scratch), scratch_bytes, bias);
          });
        },
        py::arg("hidden"), py::arg("weight"), py::arg("target"), py::arg("ce"),
        py::arg("options"), py::arg("stats"), py::arg("stream"), py::arg("scratch") = 0,
        py::arg("scratch_bytes") = 0, py::arg("bias") = VectorView{});
  m.def("linear_cross_entropy_prepare",
        [](Device device, uintptr_t stream) {
          guarded([&] { linear_cross_entropy_prepare(device, ptr(stream)); });
        },
        py::arg("device"), py::arg("stream"));
  m.def("linear_cross_entropy_local_stats_scratch_bytes",
        [](const MatrixView& h, const MatrixView& w, const LinearCrossEntropyOptions& o) {
          size_t bytes = 0;
          guarded([&] { bytes = linear_cross_entropy_local_stats_scratch_bytes(h, w, o); });
          return bytes;
        },
        py::arg("hidden"), py::arg("weight"), py::arg("options"));
  m.def("linear_cross_entropy_backward",
        [](const MatrixView& h, const MatrixView& w, const IndexView& t, uintptr_t lse,
           uintptr_t grad_loss, uintptr_t count, const CrossEntropyOptions& ce,
           const LinearCrossEntropyOptions& o, const MatrixView& saved_dh,
           const MatrixView& saved_dw, const MatrixView& dh, const MatrixView& dw,
           bool accumulate_dweight, uintptr_t stream, uintptr_t row_weight,
           const VectorView& bias, uintptr_t saved_dbias, uintptr_t dbias, DType dbias_dtype) {
          guarded([&] {
            LinearCrossEntropyOutputs saved;
            saved.dhidden = saved_dh;
            saved.dweight = saved_dw;
            saved.row_weight = fptr(row_weight);
            saved.bias = bias;
            saved.dbias = fptr(saved_dbias);
            LinearCrossEntropyGrads grads{dh, dw, accumulate_dweight};
            grads.dbias = ptr(dbias);
            grads.dbias_dtype = dbias_dtype;
            linear_cross_entropy_backward(h, w, t, fptr(lse), fptr(grad_loss), fptr(count), ce, o,
                                          saved, grads, ptr(stream));
          });
        },
        py::arg("hidden"), py::arg("weight"), py::arg("target"), py::arg("lse"),
        py::arg("grad_loss"), py::arg("count"), py::arg("ce"), py::arg("options"),
        py::arg("saved_dhidden"), py::arg("saved_dweight"), py::arg("dhidden"), py::arg("dweight"),
        py::arg("accumulate_dweight"), py::arg("stream"), py::arg("row_weight") = 0,
        py::arg("bias") = VectorView{}, py::arg("saved_dbias") = 0, py::arg("dbias") = 0,
        py::arg("dbias_dtype") = DType::F32);
}

// The log-prob head (fusedloss/linear_log_probs.h): pointers as integers, as above.
void bind_linear_log_probs(py::module_& m) {
  py::class_<LinearLogProbsOptions>(m, "LinearLogProbsOptions")
      .def(py::init<>())
      .def_readwrite("temperature", &LinearLogProbsOptions::temperature)
      .def_readwrite("ignore_index", &LinearLogProbsOptions::ignore_index)
      .def_readwrite("vocab_start", &LinearLogProbsOptions::vocab_start)
      .def_readwrite("vocab_global", &LinearLogProbsOptions::vocab_global)
      .def_readwrite("workspace_bytes", &LinearLogProbsOptions::workspace_bytes)
      .def_readwrite("chunk_rows", &LinearLogProbsOptions::chunk_rows)
      .def_readwrite("allow_tf32", &LinearLogProbsOptions::allow_tf32);
  m.attr("LOG_PROB_STATS_BYTES") = int(sizeof(LogProbStats));
  m.def("validate_linear_log_probs_options",
        [](const LinearLogProbsOptions& o, int64_t rows, int64_t vocab_local, int64_t hidden) {
          guarded([&] { validate_linear_log_probs_options(o, rows, vocab_local, hidden); });
        },
        py::arg("options"), py::arg("rows"), py::arg("vocab_local"), py::arg("hidden"));
  m.def("linear_log_probs_local_stats_scratch_bytes",
        [](const MatrixView& h, const MatrixView& w, const LinearLogProbsOptions& o) {
          size_t bytes = 0;
          guarded([&] { bytes = linear_log_probs_local_stats_scratch_bytes(h, w, o); });
          return bytes;
        },
        py::arg("hidden"), py::arg("weight"), py::arg("options"));
  m.def("linear_log_probs_local_stats",
        [](const MatrixView& h, const MatrixView& w, const IndexView& t,
           const LinearLogProbsOptions& o, uintptr_t stats, uintptr_t stream, uintptr_t scratch,
           size_t scratch_bytes) {
          guarded([&] {
            linear_log_probs_local_stats(h, w, t, o, static_cast<LogProbStats*>(ptr(stats)),
                                         ptr(stream), ptr(scratch), scratch_bytes);
          });
        },
        py::arg("hidden"), py::arg("weight"), py::arg("tokens"), py::arg("options"),
        py::arg("stats"), py::arg("stream"), py::arg("scratch") = 0, py::arg("scratch_bytes") = 0);
  m.def("log_probs_merge",
        [](uintptr_t stats, int world, int64_t rows, const IndexView& t,
           const LinearLogProbsOptions& o, uintptr_t log_probs, uintptr_t entropy,
           uintptr_t argmax, uintptr_t lse, Device device, uintptr_t stream) {
          guarded([&] {
            LinearLogProbsOutputs out;
            out.log_probs = fptr(log_probs);
            out.entropy = fptr(entropy);
            out.argmax = static_cast<int64_t*>(ptr(argmax));
            out.lse = fptr(lse);
            log_probs_merge(static_cast<const LogProbStats*>(ptr(stats)), world, rows, t, o, out,
                            device, ptr(stream));
          });
        },
        py::arg("stats"), py::arg("world"), py::arg("rows"), py::arg("tokens"), py::arg("options"),
        py::arg("log_probs"), py::arg("entropy"), py::arg("argmax"), py::arg("lse"),
        py::arg("device"), py::arg("stream"));
  m.def("linear_log_probs_backward",
        [](const MatrixView& h, const MatrixView& w, const IndexView& t, uintptr_t lse,
           uintptr_t entropy, uintptr_t grad_log_probs, uintptr_t grad_entropy,
           const LinearLogProbsOptions& o, const MatrixView& dh, const MatrixView& dw,
           bool accumulate_dweight, uintptr_t stream) {
          guarded([&] {
            linear_log_probs_backward(h, w, t, fptr(lse), fptr(entropy), fptr(grad_log_probs),
                                      fptr(grad_entropy), o, {dh, dw, accumulate_dweight},
                                      ptr(stream));
          });
        },
        py::arg("hidden"), py::arg("weight"), py::arg("tokens"), py::arg("lse"),
        py::arg("entropy"), py::arg("grad_log_probs"), py::arg("grad_entropy"), py::arg("options"),
        py::arg("dhidden"), py::arg("dweight"), py::arg("accumulate_dweight"), py::arg("stream"));
}

// The linear distillation loss (fusedloss/linear_distillation.h): pointers as integers.
void bind_linear_distillation(py::module_& m) {
  py::enum_<Divergence>(m, "Divergence")
      .value("ForwardKL", Divergence::ForwardKL)
      .value("ReverseKL", Divergence::ReverseKL)
      .value("JSD", Divergence::JSD);
  py::class_<LinearDistillationOptions>(m, "LinearDistillationOptions")
      .def(py::init<>())
      .def_readwrite("divergence", &LinearDistillationOptions::divergence)
      .def_readwrite("beta", &LinearDistillationOptions::beta)
      .def_readwrite("temperature", &LinearDistillationOptions::temperature)
      .def_readwrite("hard_label_weight", &LinearDistillationOptions::hard_label_weight)
      .def_readwrite("ignore_index", &LinearDistillationOptions::ignore_index)
      .def_readwrite("workspace_bytes", &LinearDistillationOptions::workspace_bytes)
      .def_readwrite("chunk_rows", &LinearDistillationOptions::chunk_rows)
      .def_readwrite("allow_tf32", &LinearDistillationOptions::allow_tf32)
      .def_readwrite("vocab_start", &LinearDistillationOptions::vocab_start)
      .def_readwrite("vocab_global", &LinearDistillationOptions::vocab_global);
  m.attr("DISTILL_ROW_STATS_BYTES") = int(sizeof(DistillRowStats));
  m.attr("DISTILL_PARTIAL_BYTES") = int(sizeof(DistillPartial));
  m.def("validate_linear_distillation_options",
        [](const LinearDistillationOptions& o, int64_t rows, int64_t vocab, bool has_target) {
          guarded([&] { validate_linear_distillation_options(o, rows, vocab, has_target); });
        },
        py::arg("options"), py::arg("rows"), py::arg("vocab"), py::arg("has_target"));
  m.def("linear_distillation_forward",
        [](const MatrixView& sh, const MatrixView& sw, const MatrixView& th, const MatrixView& tw,
           const IndexView& t, const LinearDistillationOptions& o, uintptr_t loss, uintptr_t stats,
           uintptr_t stream, std::optional<MatrixView> dh, std::optional<MatrixView> dw,
           uintptr_t grad_loss) {
          guarded([&] {
            linear_distillation_forward(
                sh, sw, th, tw, t, o, fptr(loss), static_cast<DistillRowStats*>(ptr(stats)),
                ptr(stream),
                {{dh.value_or(MatrixView{}), dw.value_or(MatrixView{})}, fptr(grad_loss)});
          });
        },
        py::arg("student_hidden"), py::arg("student_weight"), py::arg("teacher_hidden"),
        py::arg("teacher_weight"), py::arg("target"), py::arg("options"), py::arg("loss"),
        py::arg("stats"), py::arg("stream"), py::arg("dhidden") = py::none(),
        py::arg("dweight") = py::none(), py::arg("grad_loss") = 0);
  m.def("linear_distillation_local_partials",
        [](const MatrixView& sh, const MatrixView& sw, const MatrixView& th, const MatrixView& tw,
           const IndexView& t, const LinearDistillationOptions& o, uintptr_t partials,
           uintptr_t stream) {
          guarded([&] {
            linear_distillation_local_partials(sh, sw, th, tw, t, o,
                                               static_cast<DistillPartial*>(ptr(partials)),
                                               ptr(stream));
          });
        },
        py::arg("student_hidden"), py::arg("student_weight"), py::arg("teacher_hidden"),
        py::arg("teacher_weight"), py::arg("target"), py::arg("options"), py::arg("partials"),
        py::arg("stream"));
  m.def("distill_merge",
        [](uintptr_t partials, int world, int64_t rows, const IndexView& t,
           const LinearDistillationOptions& o, uintptr_t stats, uintptr_t loss, Device device,
           uintptr_t stream) {
          guarded([&] {
            distill_merge(static_cast<const DistillPartial*>(ptr(partials)), world, rows, t, o,
                          static_cast<DistillRowStats*>(ptr(stats)), fptr(loss), device,
                          ptr(stream));
          });
        },
        py::arg("partials"), py::arg("world"), py::arg("rows"), py::arg("target"),
        py::arg("options"), py::arg("stats"), py::arg("loss"), py::arg("device"),
        py::arg("stream"));
  m.def("linear_distillation_jsd_sums",
        [](const MatrixView& sh, const MatrixView& sw, const MatrixView& th, const MatrixView& tw,
           const LinearDistillationOptions& o, uintptr_t stats, uintptr_t sums, uintptr_t stream) {
          guarded([&] {
            linear_distillation_jsd_sums(sh, sw, th, tw, o,
                                         static_cast<const DistillRowStats*>(ptr(stats)),
                                         fptr(sums), ptr(stream));
          });
        },
        py::arg("student_hidden"), py::arg("student_weight"), py::arg("teacher_hidden"),
        py::arg("teacher_weight"), py::arg("options"), py::arg("stats"), py::arg("sums"),
        py::arg("stream"));
  m.def("distill_add_jsd",
        [](uintptr_t sums, int64_t rows, const IndexView& t, const LinearDistillationOptions& o,
           uintptr_t stats, uintptr_t loss, Device device, uintptr_t stream) {
          guarded([&] {
            distill_add_jsd(reinterpret_cast<const float*>(sums), rows, t, o,
                            static_cast<DistillRowStats*>(ptr(stats)), fptr(loss), device,
                            ptr(stream));
          });
        },
        py::arg("sums"), py::arg("rows"), py::arg("target"), py::arg("options"),
        py::arg("stats"), py::arg("loss"), py::arg("device"), py::arg("stream"));
  m.def("linear_distillation_backward",
        [](const MatrixView& sh, const MatrixView& sw, const MatrixView& th, const MatrixView& tw,
           const IndexView& t, uintptr_t stats, uintptr_t grad_loss,
           const LinearDistillationOptions& o, const MatrixView& dh, const MatrixView& dw,
           bool accumulate_dweight, uintptr_t stream) {
          guarded([&] {
            linear_distillation_backward(sh, sw, th, tw, t,
                                         static_cast<const DistillRowStats*>(ptr(stats)),
                                         fptr(grad_loss), o, {dh, dw, accumulate_dweight},
                                         ptr(stream));
          });
        },
        py::arg("student_hidden"), py::arg("student_weight"), py::arg("teacher_hidden"),
        py::arg("teacher_weight"), py::arg("target"), py::arg("stats"), py::arg("grad_loss"),
        py::arg("options"), py::arg("dhidden"), py::arg("dweight"), py::arg("accumulate_dweight"),
        py::arg("stream"));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusedloss C++ core (raw-pointer binding; see fusedloss/ for the torch API)";
  g_error_type = py::register_local_exception<Error>(m, "Error", PyExc_ValueError).ptr();
  // The GIL stays held in every call: the calls are short (kernel launches), and errors become
  // Python exceptions without crossing a GIL-released frame.
  bind_types(m);
  bind_cross_entropy(m);
  bind_swiglu(m);
  bind_rms_norm(m);
  bind_linear_cross_entropy(m);
  bind_linear_log_probs(m);
  bind_linear_distillation(m);

  m.def("check_device_errors",
        [](uintptr_t stream) { guarded([&] { check_device_errors(ptr(stream)); }); });
  // The address and size of the core table, for fusedloss/_native.py to hand to the C++ nodes.
  m.def("_core_table", [] { return reinterpret_cast<uintptr_t>(&core_table()); });
  m.attr("_CORE_TABLE_SIZE") = int(sizeof(python::CoreTable));
  m.attr("_CORE_TABLE_VERSION") = int(python::kCoreTableVersion);
  m.attr("ROW_STATS_FLOATS") = int(sizeof(RowStats) / sizeof(float));
  m.attr("HAS_CUDA") = bool(FUSEDLOSS_HAS_CUDA);
#ifdef FUSEDLOSS_STATIC_CXX_RUNTIME
  m.attr("STATIC_CXX_RUNTIME") = true;
#else
  m.attr("STATIC_CXX_RUNTIME") = false;
#endif
  m.attr("__version__") = FUSEDLOSS_VERSION;
}

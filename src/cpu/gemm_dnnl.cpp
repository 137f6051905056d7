// cpu::gemm_bf16 through oneDNN's matmul primitive: bf16 operands read in place (any row
// stride, either transposed), fp32 accumulation in the bf16 dot-product instructions, C written
// in its dtype (each element rounded once; a sum post-op accumulates into it). The staged
// cblas_sgemm path computes the same products in fp32 at half their rate and converts every
// tile first.
#include "cpu/gemm_cpu.h"

#include <oneapi/dnnl/dnnl.h>
#include <algorithm>
#include <mutex>
#include "common/error.h"

namespace fusedloss::cpu {
namespace {

// Whether oneDNN runs bf16 dot products natively here (AVX512-BF16, AMX): elsewhere its bf16
// matmul converts, and the staged sgemm path is as fast.
bool native_bf16() {
  static const bool yes = [] {
    const unsigned isa = unsigned(dnnl_get_effective_cpu_isa());
    return (isa & unsigned(dnnl_cpu_isa_avx512_core_bf16)) == unsigned(dnnl_cpu_isa_avx512_core_bf16);
  }();
  return yes;
}

dnnl_engine_t cpu_engine() {
  static dnnl_engine_t engine = [] {
    dnnl_engine_t e = nullptr;
    return dnnl_engine_create(&e, dnnl_cpu, 0) == dnnl_success ? e : nullptr;
  }();
  return engine;
}

// A CPU stream per host thread (a stream runs its primitives in the caller's thread).
dnnl_stream_t thread_stream() {
  struct Own {
    dnnl_stream_t s = nullptr;
    ~Own() {
      if (s) dnnl_stream_destroy(s);
    }
  };
  thread_local Own own;
  if (!own.s && cpu_engine() &&
      dnnl_stream_create(&own.s, cpu_engine(), dnnl_stream_default_flags) != dnnl_success)
    own.s = nullptr;
  return own.s;
}

// op(X) of a row-major view as oneDNN's [rows, cols] descriptor: X^T when `t`, through strides.
bool describe(dnnl_memory_desc_t* md, const MatrixView& x, bool t, dnnl_data_type_t type) {
  const int64_t ld = std::max(x.row_stride, x.cols);  // a one-row view may carry any stride
  const dnnl_dims_t dims = {t ? x.cols : x.rows, t ? x.rows : x.cols};
  const dnnl_dims_t strides = {t ? 1 : ld, t ? ld : 1};
  return dnnl_memory_desc_init_by_strides(md, 2, dims, type, strides) == dnnl_success;
}

// The objects of one call, released on every exit.
struct Call {
  dnnl_post_ops_t ops = nullptr;
  dnnl_primitive_attr_t attr = nullptr;
  dnnl_primitive_desc_t pd = nullptr;
  dnnl_primitive_t prim = nullptr;
  dnnl_memory_t a = nullptr, b = nullptr, c = nullptr;
  ~Call() {
    for (dnnl_memory_t m : {a, b, c})
      if (m) dnnl_memory_destroy(m);
    if (prim) dnnl_primitive_destroy(prim);
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (attr) dnnl_primitive_attr_destroy(attr);
    if (ops) dnnl_post_ops_destroy(ops);
  }
};

}  // namespace

bool gemm_bf16(const MatrixView& A, bool ta, const MatrixView& B, bool tb, const MatrixView& C,
               bool accumulate) {
  const int64_t k = ta ? A.rows : A.cols;
  if (A.dtype != DType::BF16 || B.dtype != DType::BF16 || C.dtype == DType::F16 || k == 0 ||
      !native_bf16())
    return false;
  dnnl_engine_t engine = cpu_engine();
  dnnl_stream_t stream = thread_stream();
  if (!engine || !stream) return false;
  // Setting up (descriptors, the primitive: oneDNN's cache keeps it across calls) may fail
  // only for want of memory or support; the caller's BLAS path then runs instead.
  dnnl_memory_desc_t a_md, b_md, c_md;
  Call call;
  const bool ready =
      describe(&a_md, A, ta, dnnl_bf16) && describe(&b_md, B, tb, dnnl_bf16) &&
      describe(&c_md, C, false, C.dtype == DType::F32 ? dnnl_f32 : dnnl_bf16) &&
      dnnl_primitive_attr_create(&call.attr) == dnnl_success &&
      (!accumulate ||
       (dnnl_post_ops_create(&call.ops) == dnnl_success &&
        dnnl_post_ops_append_sum(call.ops, 1.0f) == dnnl_success &&
        dnnl_primitive_attr_set_post_ops(call.attr, call.ops) == dnnl_success));
  dnnl_matmul_desc_t op;
  if (!ready || dnnl_matmul_desc_init(&op, &a_md, &b_md, nullptr, &c_md) != dnnl_success ||
      dnnl_primitive_desc_create(&call.pd, &op, call.attr, engine, nullptr) != dnnl_success ||
      dnnl_primitive_create(&call.prim, call.pd) != dnnl_success ||
      dnnl_memory_create(&call.a, &a_md, engine, A.data) != dnnl_success ||
      dnnl_memory_create(&call.b, &b_md, engine, B.data) != dnnl_success ||
      dnnl_memory_create(&call.c, &c_md, engine, C.data) != dnnl_success)
    return false;
  const dnnl_exec_arg_t args[] = {
      {DNNL_ARG_SRC, call.a}, {DNNL_ARG_WEIGHTS, call.b}, {DNNL_ARG_DST, call.c}};
  // Once running, C may be partly written: a failure now is an error, not a fallback.
  const dnnl_status_t ran = dnnl_primitive_execute(call.prim, stream, 3, args);
  const dnnl_status_t done = ran == dnnl_success ? dnnl_stream_wait(stream) : ran;
  detail::require(done == dnnl_success, "cpu gemm: oneDNN's bf16 matmul failed with status ",
                  int(done), " for [", C.rows, ", ", k, "] x [", k, ", ", C.cols, "]");
  return true;
}

}  // namespace fusedloss::cpu

// Row-major GEMMs through cuBLASLt.
//
// cuBLASLt is column-major: the row-major C[m, n] = op(A) op(B) is the column-major
// C^T[n, m] = op(B)^T op(A)^T, and a row-major matrix's storage read column-major is its
// transpose. So the call passes B's storage first (transposed when tb), A's second
// (transposed when ta), with m and n swapped; no data moves.
#include "cuda/gemm_lt.h"

#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <vector>
#include "cuda/cuda_check.h"
#include "cuda/runtime.h"

#define FL_CUBLAS_CHECK(call)                                                              \
  do {                                                                                     \
    cublasStatus_t fl_st_ = (call);                                                        \
    if (fl_st_ != CUBLAS_STATUS_SUCCESS)                                                   \
      ::fusedloss::detail::fail(#call, " failed: ", cublasLtGetStatusName(fl_st_), ": ",   \
                                cublasLtGetStatusString(fl_st_), " (", __FILE__, ":", __LINE__, \
                                ")");                                                      \
  } while (0)

namespace fusedloss::cuda {
namespace {

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::F32: return CUDA_R_32F;
    case DType::F16: return CUDA_R_16F;
    case DType::BF16: return CUDA_R_16BF;
    default: break;
  }
  detail::fail("gemm: dtype ", to_string(d), ", expected fp32, fp16 or bf16");
}

// Largest power of two (<= 256) dividing both the address and the row pitch in bytes: the
// alignment every row of the operand has, which is what cuBLASLt may assume.
uint32_t alignment(const MatrixView& m, int64_t ld) {
  const auto a = reinterpret_cast<uintptr_t>(m.data);
  const auto pitch = uint64_t(ld) * uint64_t(detail::element_size(m.dtype));
  uint32_t al = 256;
  while (al > 1 && (a % al || pitch % al)) al >>= 1;
  return al;
}

int current_device() {
  int dev = 0;
  FL_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

cublasLtHandle_t handle_for(int device) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t> handles;  // one per device, for the process
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  FL_CUBLAS_CHECK(cublasLtCreate(&h));
  handles.emplace(device, h);
  return h;
}

// Everything the algorithm choice depends on, and how it was chosen.
using Key = std::array<int64_t, 19>;

// The descriptors and algorithm of one shape, built once and kept for the process (a per-call
// setup of five descriptors would cost host time on every chunk).
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  void destroy() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// An operation descriptor: fp32 accumulation and scale, the transposes, and with a bias the
// bias epilogue reading `bias` (in `bias_type`, one element per row of cuBLASLt's D: per
// column of the row-major C).
cublasLtMatmulDesc_t make_op(cublasComputeType_t compute, cublasOperation_t op1,
                             cublasOperation_t op2, const void* bias, cudaDataType_t bias_type) {
  cublasLtMatmulDesc_t d = nullptr;
  FL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, compute, CUDA_R_32F));
  struct Guard {  // destroys d if an attribute fails
    cublasLtMatmulDesc_t* d;
    ~Guard() {
      if (*d) cublasLtMatmulDescDestroy(*d);
    }
  } guard{&d};
  FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &op1, sizeof(op1)));
  FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &op2, sizeof(op2)));
  if (bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const int32_t type = bias_type;
    FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                   sizeof(epilogue)));
    FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                   sizeof(bias)));
    FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &type,
                                                   sizeof(type)));
  }
  cublasLtMatmulDesc_t out = d;
  d = nullptr;
  return out;
}

// Destroys a plan's descriptors on scope exit unless the cache took them (error paths too).
struct PlanOwner {
  Plan* plan = nullptr;
  ~PlanOwner() {
    if (plan) plan->destroy();
  }
};

// RAII for what only the choice needs.
struct Choice {
  cublasLtMatmulPreference_t pref = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  void* scratch = nullptr;
  cudaStream_t stream = nullptr;
  ~Choice() {
    free_async(scratch, stream);
    if (stop) cudaEventDestroy(stop);
    if (start) cudaEventDestroy(start);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
  }
};

}  // namespace

void gemm_prepare() {
  int device = 0;
  FL_CUDA_CHECK(cudaGetDevice(&device));
  (void)handle_for(device);
}

void gemm(const MatrixView& A, bool ta, const MatrixView& B, bool tb, const MatrixView& C,
          bool accumulate, bool tf32, void* workspace, size_t workspace_bytes, Stream stream,
          int candidates, const void* bias) {
  const int64_t m = C.rows, n = C.cols, k = ta ? A.rows : A.cols;
  detail::require((tb ? B.cols : B.rows) == k && (ta ? A.cols : A.rows) == m &&
                      (tb ? B.rows : B.cols) == n,
                  "gemm: inner shapes disagree (internal)");
  detail::require(!bias || (!accumulate && reinterpret_cast<uintptr_t>(bias) % 256 == 0),
                  "gemm: a bias needs an overwritten C and a 256-byte aligned address (internal)");
  if (m == 0 || n == 0) return;
  const bool fp32_in = A.dtype == DType::F32;
  const cublasComputeType_t compute =
      fp32_in && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  // Column-major operands: X1 = B's storage ([B.cols, B.rows]), X2 = A's storage.
  auto ld = [](const MatrixView& v) { return std::max<int64_t>(v.row_stride, v.cols); };
  const cublasOperation_t op1 = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op2 = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int device = current_device();
  cublasLtHandle_t h = handle_for(device);
  const cudaStream_t s = as_cuda(stream);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;

  const uint32_t al_a = alignment(B, ld(B)), al_b = alignment(A, ld(A)), al_c = alignment(C, ld(C));
  // Under graph capture the timed choice cannot run (it synchronises): the heuristic's answer
  // is used and not cached, so a later uncaptured call still times the candidates.
  const int asked = candidates > 1 && capturing(s) ? 1 : std::max(candidates, 1);
  // A short inner dimension under a large output (a chunk's dweight update: [V, H] over the
  // chunk's tokens): the heuristic's first answer is a large tile (256x128, 320x128) whose few
  // k-steps leave its epilogue (C read, D written) exposed. Among its first 8 answers the one with
  // the most waves (128x160 tiles, more of them in flight) was the fastest when timed on an H200
  // at k = 768 and 1024 (V 151936 and 128256, H 4096: 11-25% faster, beta 0 and 1; 2% slower at
  // k = 256). Chosen without timing: no host synchronisation, the same choice every process.
  const bool most_waves = asked == 1 && k <= 2048 && double(m) * double(n) >= double(1 << 26);
  const int heuristics = most_waves ? 8 : asked;
  const Key key{device, m, n, k, ld(A), ld(B), ld(C), int64_t(op1), int64_t(op2),
                int64_t(A.dtype), int64_t(C.dtype), int64_t(compute), al_a, al_b, al_c,
                accumulate, asked, int64_t(workspace_bytes), bias != nullptr};
  static std::mutex mu;
  static std::map<Key, Plan> plans;
  Plan plan;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = plans.find(key);
    if (it != plans.end()) plan = it->second, cached = true;
  }
  PlanOwner owner;  // holds this call's own descriptors until the cache takes them
  if (!cached) {
    owner.plan = &plan;
    // With a bias: this call's bias address, every later one 256-byte aligned as well (the
    // heuristic reads the address for its alignment); each call sets its own (below).
    plan.op = make_op(compute, op1, op2, bias, cuda_type(C.dtype));
    FL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, cuda_type(B.dtype), uint64_t(B.cols),
                                               uint64_t(B.rows), ld(B)));
    FL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, cuda_type(A.dtype), uint64_t(A.cols),
                                               uint64_t(A.rows), ld(A)));
    FL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.c, cuda_type(C.dtype), uint64_t(C.cols),
                                               uint64_t(C.rows), ld(C)));
    Choice ch;
    FL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&ch.pref));
    const uint64_t ws = workspace_bytes;
    FL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        ch.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    FL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        ch.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
    FL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        ch.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
    FL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        ch.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
    FL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        ch.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));
    // A 16-bit output is rounded once, from the fp32 sum: split-K partial sums reduced in the
    // output type (the OUTPUT_TYPE and INPLACE schemes) round once per split. The heuristic picks
    // such kernels for long inner dimensions under narrow or unaligned outputs (dhidden over a
    // whole vocabulary at an odd H), where they cost several times torch's error.
    if (C.dtype != DType::F32) {
      const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      FL_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          ch.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)));
    }
    std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(heuristics));
    int found = 0;
    FL_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(h, plan.op, plan.a, plan.b, plan.c, plan.c,
                                                   ch.pref, heuristics, results.data(), &found));
    detail::require(found > 0, "cublasLtMatmulAlgoGetHeuristic: no algorithm for the GEMM [", m,
                    ", ", k, "] x [", k, ", ", n, "] (", to_string(A.dtype), " -> ",
                    to_string(C.dtype), ")");
    plan.algo = results[0].algo;
    if (most_waves) {
      float waves = results[0].wavesCount;
      for (int i = 1; i < found; ++i)
        if (results[size_t(i)].wavesCount > waves)
          waves = results[size_t(i)].wavesCount, plan.algo = results[size_t(i)].algo;
    } else if (found > 1) {
      // Time each candidate (one warm-up, then kReps runs) on this stream, with the real
      // operands. The output: C itself when it is overwritten (the real call below rewrites
      // it), a zeroed scratch of C's size when the GEMM accumulates into C.
      constexpr int kReps = 3;
      void* out = C.data;
      if (accumulate) {
        const size_t bytes = size_t(C.rows) * size_t(ld(C)) * detail::element_size(C.dtype);
        ch.stream = s;
        ch.scratch = alloc_async(bytes, s);
        FL_CUDA_CHECK(cudaMemsetAsync(ch.scratch, 0, bytes, s));
        out = ch.scratch;
      }
      FL_CUDA_CHECK(cudaEventCreate(&ch.start));
      FL_CUDA_CHECK(cudaEventCreate(&ch.stop));
      float best = -1.0f;
      for (int i = 0; i < found; ++i) {
        auto launch = [&] {
          return cublasLtMatmul(h, plan.op, &alpha, B.data, plan.a, A.data, plan.b, &beta, out,
                                plan.c, out, plan.c, &results[size_t(i)].algo, workspace,
                                workspace_bytes, s);
        };
        if (launch() != CUBLAS_STATUS_SUCCESS) continue;  // a candidate that cannot run here
        FL_CUDA_CHECK(cudaEventRecord(ch.start, s));
        for (int r = 0; r < kReps; ++r) FL_CUBLAS_CHECK(launch());
        FL_CUDA_CHECK(cudaEventRecord(ch.stop, s));
        FL_CUDA_CHECK(cudaEventSynchronize(ch.stop));
        float ms = 0.0f;
        FL_CUDA_CHECK(cudaEventElapsedTime(&ms, ch.start, ch.stop));
        if (best < 0.0f || ms < best) best = ms, plan.algo = results[size_t(i)].algo;
      }
    }
    // Cached unless chosen under capture; another thread may have cached the shape first.
    std::lock_guard<std::mutex> lock(mu);
    if (asked == std::max(candidates, 1) && plans.emplace(key, plan).second) owner.plan = nullptr;
  }
  // A cached descriptor is shared by every thread: a bias address is set on a copy of its own.
  struct CallOp {
    cublasLtMatmulDesc_t d = nullptr;
    ~CallOp() {
      if (d) cublasLtMatmulDescDestroy(d);
    }
  } call;
  if (bias) call.d = make_op(compute, op1, op2, bias, cuda_type(C.dtype));
  FL_CUBLAS_CHECK(cublasLtMatmul(h, bias ? call.d : plan.op, &alpha, B.data, plan.a, A.data,
                                 plan.b, &beta, C.data, plan.c, C.data, plan.c, &plan.algo,
                                 workspace, workspace_bytes, s));
}

}  // namespace fusedloss::cuda

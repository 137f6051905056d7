// Runs one linear cross-entropy configuration (forward + backward) on a backend, and the
// float64 reference it is checked against: logits = hidden @ weight^T in double, rounded to
// the inputs' dtype as the chunk buffers store them, plus the bias (rounded again, as the
// chunk buffer stores the sum), soft-capped, then the reference cross-entropy
// (tests/common/reference.h) and the chain rule back to hidden, weight and bias.
#pragma once
#include <algorithm>
#include <sstream>
#include <string>

#include "common/reference.h"
#include "common/test_util.h"
#include "fusedloss/linear_cross_entropy.h"

namespace fusedloss::test {

struct LceCase {
  int64_t N = 50, H = 40, V = 203;
  int64_t hidden_pad = 0;  // hidden's row stride = H + hidden_pad
  DType dtype = DType::F32;
  DType grad_dtype = DType::F32;  // dhidden / dweight buffers (and the saved in-forward ones)
  IndexType itype = IndexType::I64;
  CrossEntropyOptions ce{};
  LinearCrossEntropyOptions lo{};
  double ignore_fraction = 0.1;
  bool accumulate_dweight = false;
  bool in_place_scale = false;  // InForward: scale the saved buffers in place
  float logit_sigma = 2.0f;
  // Reduction::None with row weights (LinearCrossEntropyOutputs::row_weight): 0 off, 1 a 0/1
  // mask, 2 arbitrary weights; the upstream gradient is then grad_scale x the weights.
  int row_weights = 0;
  // The LM head's bias: 0 none, 1 in the inputs' dtype, 2 in fp32; its gradient in dbias_dtype
  // (fp32 or the bias's dtype), or not asked for (dbias = false: a bias without a gradient).
  int bias = 0;
  bool dbias = true;
  DType dbias_dtype = DType::F32;

  LceCase() { lo.chunk_rows = 7; }
  DType bias_dtype() const { return bias == 2 ? DType::F32 : dtype; }
  std::string describe() const {
    std::ostringstream os;
    os << "N=" << N << " H=" << H << " V=" << V << " pad=" << hidden_pad
       << " dtype=" << to_string(dtype) << " grads=" << to_string(grad_dtype)
       << " chunk=" << lo.chunk_rows << " ws=" << lo.workspace_bytes
       << " mode=" << int(lo.backward_mode) << " reduction=" << int(ce.reduction)
       << " ls=" << ce.label_smoothing << " formula=" << int(ce.smoothing_formula)
       << " scope=" << int(ce.smoothing_scope) << " z=" << ce.z_loss
       << " softcap=" << lo.logit_softcap << " tf32=" << lo.allow_tf32
       << " ignore=" << ignore_fraction << " accumulate=" << accumulate_dweight
       << " in_place=" << in_place_scale << " row_weights=" << row_weights << " bias=" << bias
       << " dbias=" << dbias << " dbias_dtype=" << to_string(dbias_dtype);
    return os.str();
  }
};

// A dense problem in float (values already rounded to the case's dtype).
struct LceProblem {
  std::vector<float> hidden, weight;  // [N, H], [V, H]
  std::vector<int64_t> target;
  float grad_scale = 1.0f;            // upstream gradient of a Sum / Mean loss
  std::vector<float> grad_rows;       // upstream gradient per row (None)
  std::vector<float> row_weight;      // the row weights (LceCase::row_weights)
  std::vector<float> dweight_init;    // dweight before an accumulating backward
  std::vector<float> bias;            // [V_global] (LceCase::bias), rounded to its dtype
};

template <class Gen>
LceProblem make_lce_problem(const LceCase& c, Gen& gen) {
  LceProblem p;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float wsd = c.logit_sigma / std::sqrt(float(c.H));
  auto round = [&](float v) {
    float tmp;
    store_as(c.dtype, &tmp, 0, v);
    return load_as(c.dtype, &tmp, 0);
  };
  p.hidden.resize(c.N * c.H);
  p.weight.resize(c.V * c.H);
  for (auto& v : p.hidden) v = round(normal(gen));
  for (auto& v : p.weight) v = round(normal(gen) * wsd);
  const int64_t vglobal = c.ce.vocab_global > 0 ? c.ce.vocab_global : c.V;
  std::uniform_int_distribution<int64_t> cls(0, vglobal - 1);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  p.target.resize(c.N);
  for (auto& t : p.target) t = u(gen) < c.ignore_fraction ? c.ce.ignore_index : cls(gen);
  p.grad_scale = 0.5f + float(u(gen));
  p.grad_rows.resize(c.N);
  for (auto& g : p.grad_rows) g = float(u(gen)) * 2.0f - 0.5f;
  if (c.row_weights) {
    p.row_weight.resize(c.N);
    for (int64_t r = 0; r < c.N; ++r) {
      const double draw = u(gen);
      p.row_weight[r] = draw < 0.3 ? 0.0f : c.row_weights == 1 ? 1.0f : float(u(gen)) * 3.0f - 1.0f;
      p.grad_rows[r] = p.grad_scale * p.row_weight[r];  // c x w, as autograd forms it
    }
  }
  p.dweight_init.resize(c.V * c.H);
  for (auto& v : p.dweight_init) v = normal(gen) * 0.01f;
  if (c.bias) {
    p.bias.resize(vglobal);
    for (auto& v : p.bias) {
      float tmp;
      store_as(c.bias_dtype(), &tmp, 0, normal(gen));
      v = load_as(c.bias_dtype(), &tmp, 0);
    }
  }
  return p;
}

struct LceResult {
  std::vector<double> loss, lse, dhidden, dweight;  // dense
  std::vector<double> dbias;                        // [V] with a bias and its gradient
  float valid_count = -1;
};

inline LinearCeBackward resolved_mode(const LceCase& c) {
  return resolve_linear_ce_backward(c.lo.backward_mode, c.ce.reduction, c.dtype, c.row_weights != 0);
}

// The library on `device` (with `comm`: this rank's shard, rows [v0, v0 + V) of the weight in
// `p`, whose weight then holds V_global rows).
inline LceResult run_lce(Device device, const LceCase& c, const LceProblem& p,
                         Communicator* comm = nullptr, int64_t v0 = 0) {
  const int64_t N = c.N, H = c.H, V = c.V, hs = H + c.hidden_pad;
  const int64_t es = dtype_size(c.dtype), gs = dtype_size(c.grad_dtype);
  Buffer hidden(device, size_t(std::max<int64_t>(N * hs, 1) * es));
  Buffer weight(device, size_t(V * H * es));
  Buffer target(device, size_t(std::max<int64_t>(N, 1) * 8));
  hidden.poison(0x7b);  // padding: finite garbage the kernels must not read
  for (int64_t r = 0; r < N; ++r)
    for (int64_t h = 0; h < H; ++h) store_as(c.dtype, hidden.host(), r * hs + h, p.hidden[r * H + h]);
  for (int64_t v = 0; v < V; ++v)
    for (int64_t h = 0; h < H; ++h)
      store_as(c.dtype, weight.host(), v * H + h, p.weight[(v0 + v) * H + h]);
  for (int64_t r = 0; r < N; ++r) {
    if (c.itype == IndexType::I64) target.host_as<int64_t>()[r] = p.target[r];
    else target.host_as<int32_t>()[r] = int32_t(p.target[r]);
  }
  hidden.upload(); weight.upload(); target.upload();
  const bool none = c.ce.reduction == Reduction::None;
  const int64_t nloss = none ? N : 1;
  Buffer loss(device, size_t(std::max<int64_t>(nloss, 1) * 4)), lse(device, size_t(std::max<int64_t>(N, 1) * 4)),
      count(device, 4), gl(device, size_t(std::max<int64_t>(N, 1) * 4)),
      rw(device, size_t(std::max<int64_t>(N, 1) * 4));
  loss.poison(); lse.poison(); count.poison();
  Buffer sdh(device, size_t(std::max<int64_t>(N * H, 1) * gs)), sdw(device, size_t(V * H * gs));
  Buffer dh(device, size_t(std::max<int64_t>(N * H, 1) * gs)), dw(device, size_t(V * H * gs));
  sdh.poison(); sdw.poison(); dh.poison();
  for (int64_t i = 0; i < V * H; ++i)
    store_as(c.grad_dtype, dw.host(), i, c.accumulate_dweight ? p.dweight_init[(v0 * H) + i] : NAN);
  dw.upload();
  MatrixView hv{hidden.data(), N, H, hs, c.dtype, device};
  MatrixView wv{weight.data(), V, H, H, c.dtype, device};
  IndexView tv{target.data(), N, c.itype, device};
  LinearCrossEntropyOutputs out;
  out.loss = loss.data_as<float>();
  out.lse = lse.data_as<float>();
  out.valid_count = count.data_as<float>();
  out.dhidden = MatrixView{sdh.data(), N, H, H, c.grad_dtype, device};
  out.dweight = MatrixView{sdw.data(), V, H, H, c.grad_dtype, device};
  if (c.row_weights) {
    std::copy(p.row_weight.begin(), p.row_weight.end(), rw.host_as<float>());
    rw.upload();
    out.row_weight = rw.data_as<float>();
  }
  const int64_t bs = dtype_size(c.bias_dtype()), dbs = dtype_size(c.dbias_dtype);
  Buffer bias(device, size_t(V * bs)), sdb(device, size_t(V * 4)), db(device, size_t(V * dbs));
  sdb.poison(); db.poison();
  if (c.bias) {
    for (int64_t v = 0; v < V; ++v) store_as(c.bias_dtype(), bias.host(), v, p.bias[v0 + v]);
    bias.upload();
    out.bias = VectorView{bias.data(), V, c.bias_dtype(), device};
    if (c.dbias) out.dbias = sdb.data_as<float>();
  }
  linear_cross_entropy_forward(hv, wv, tv, c.ce, c.lo, out, comm);
  for (int64_t r = 0; r < N; ++r) gl.host_as<float>()[r] = none ? p.grad_rows[r] : p.grad_scale;
  gl.upload();
  LinearCrossEntropyGrads grads;
  const bool in_place = c.in_place_scale && resolved_mode(c) == LinearCeBackward::InForward;
  Buffer& dh_buf = in_place ? sdh : dh;
  Buffer& dw_buf = in_place ? sdw : dw;
  if (in_place && c.accumulate_dweight) throw std::logic_error("in-place scaling cannot accumulate");
  grads.dhidden = MatrixView{dh_buf.data(), N, H, H, c.grad_dtype, device};
  grads.dweight = MatrixView{dw_buf.data(), V, H, H, c.grad_dtype, device};
  grads.accumulate_dweight = c.accumulate_dweight;
  if (c.bias && c.dbias) {
    // in place over the saved fp32 gradient where the case scales in place and can
    const bool db_in_place = in_place && c.dbias_dtype == DType::F32;
    grads.dbias = db_in_place ? sdb.data() : db.data();
    grads.dbias_dtype = c.dbias_dtype;
  }
  linear_cross_entropy_backward(hv, wv, tv, lse.data_as<float>(), gl.data_as<float>(),
                                count.data_as<float>(), c.ce, c.lo, out, grads);
  check_device_errors();
  loss.download(); lse.download(); count.download(); dh_buf.download(); dw_buf.download();
  LceResult res;
  for (int64_t i = 0; i < nloss; ++i) res.loss.push_back(loss.host_as<float>()[i]);
  for (int64_t i = 0; i < N; ++i) res.lse.push_back(lse.host_as<float>()[i]);
  for (int64_t i = 0; i < N * H; ++i) res.dhidden.push_back(load_as(c.grad_dtype, dh_buf.host(), i));
  for (int64_t i = 0; i < V * H; ++i) res.dweight.push_back(load_as(c.grad_dtype, dw_buf.host(), i));
  res.valid_count = count.host_as<float>()[0];
  if (grads.dbias) {
    Buffer& db_buf = grads.dbias == sdb.data() ? sdb : db;
    db_buf.download();
    for (int64_t v = 0; v < V; ++v) res.dbias.push_back(load_as(c.dbias_dtype, db_buf.host(), v));
  }
  return res;
}

// The float64 reference over the whole vocabulary of `p` (V_global = p.weight rows).
inline LceResult reference_lce(const LceCase& c, const LceProblem& p) {
  const int64_t N = c.N, H = c.H, V = int64_t(p.weight.size()) / H;
  const double cap = c.lo.logit_softcap;
  std::vector<double> z(N * V);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t v = 0; v < V; ++v) {
      double acc = 0;
      for (int64_t h = 0; h < H; ++h) acc += double(p.hidden[r * H + h]) * p.weight[v * H + h];
      // the chunk buffer's one rounding, of the product plus the bias (in the logits' dtype,
      // as the buffer starts from it), as torch's addmm rounds
      float stored, start = 0.0f;
      if (c.bias) {
        store_as(c.dtype, &start, 0, float(p.bias[v]));
        acc += load_as(c.dtype, &start, 0);
      }
      store_as(c.dtype, &stored, 0, float(acc));
      double x = load_as(c.dtype, &stored, 0);
      z[r * V + v] = cap > 0 ? cap * std::tanh(x / cap) : x;
    }
  int64_t valid = 0;
  for (auto t : p.target) valid += t != c.ce.ignore_index;
  std::vector<double> w(N);
  for (int64_t r = 0; r < N; ++r)
    w[r] = c.ce.reduction == Reduction::None ? p.grad_rows[r]
           : c.ce.reduction == Reduction::Sum ? p.grad_scale
                                               : p.grad_scale / double(std::max<int64_t>(valid, 1));
  RefOptions o;
  o.ignore_index = c.ce.ignore_index;
  o.label_smoothing = c.ce.label_smoothing;
  o.megatron_formula = c.ce.smoothing_formula == SmoothingFormula::Megatron;
  o.z_loss = c.ce.z_loss;
  RefResult ref = reference_cross_entropy(z, N, V, p.target, o, w);
  LceResult res;
  res.valid_count = float(valid);
  if (c.ce.reduction == Reduction::None) {
    res.loss = ref.loss;
  } else {
    double total = 0;
    for (int64_t r = 0; r < N; ++r) total += ref.loss[r];
    res.loss = {c.ce.reduction == Reduction::Sum ? total : (valid ? total / valid : 0.0)};
  }
  res.lse = ref.lse;
  std::vector<double> gx = ref.grad;
  if (cap > 0)
    for (size_t i = 0; i < gx.size(); ++i) gx[i] *= 1.0 - (z[i] / cap) * (z[i] / cap);
  res.dhidden.assign(N * H, 0.0);
  res.dweight.assign(V * H, 0.0);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t v = 0; v < V; ++v) {
      const double g = gx[r * V + v];
      if (g == 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        res.dhidden[r * H + h] += g * p.weight[v * H + h];
        res.dweight[v * H + h] += g * p.hidden[r * H + h];
      }
    }
  if (c.accumulate_dweight)
    for (int64_t i = 0; i < V * H; ++i) res.dweight[i] += p.dweight_init[i];
  if (c.bias && c.dbias) {
    res.dbias.assign(V, 0.0);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t v = 0; v < V; ++v) res.dbias[v] += gx[r * V + v];
  }
  return res;
}

// Tolerances: fp32 math throughout, results rounded to their dtypes; bf16/fp16 logits (and
// their gradient) are rounded in the chunk buffer, which the reference repeats for the logits
// only. The GEMM sums in another order than the reference, so a logit near a rounding boundary
// can land one 16-bit ulp away (bf16 2^-8, fp16 2^-11 relative): the loss tolerance allows a
// few such flips. TF32 GEMMs carry ~1e-3 relative error.
inline double lce_loss_tolerance(const LceCase& c) {
  if (c.dtype == DType::F32) return c.lo.allow_tf32 ? 5e-3 : 2e-5;
  return c.dtype == DType::BF16 ? 4e-3 : 1e-3;
}
// fp32 gradients: a weight-gradient element sums N terms (p - onehot) h that can cancel to a
// fraction of their size, and a tiny shape leaves few elements to average that over (measured:
// 1.1e-5 at N = 13, H = 1, V = 2), hence 4e-5 rather than fp32's 1e-5 of well-conditioned sums.
inline double lce_grad_tolerance(const LceCase& c) {
  double t = c.dtype == DType::F32 ? (c.lo.allow_tf32 ? 5e-3 : 4e-5) : c.dtype == DType::F16 ? 5e-3 : 2e-2;
  if (c.grad_dtype != DType::F32) t = std::max(t, grad_tolerance(c.grad_dtype));
  return t;
}

inline void expect_lce_close(const LceCase& c, const LceResult& got, const LceResult& ref) {
  const double lt = lce_loss_tolerance(c), gt = lce_grad_tolerance(c);
  ASSERT_EQ(got.loss.size(), ref.loss.size());
  for (size_t i = 0; i < ref.loss.size(); ++i)
    ASSERT_TRUE(std::isfinite(got.loss[i])) << "loss[" << i << "] = " << got.loss[i];
  EXPECT_LE(rel_l2(got.loss, ref.loss), lt) << "loss";
  EXPECT_LE(rel_l2(got.lse, ref.lse), lt) << "lse";
  EXPECT_EQ(got.valid_count, ref.valid_count);
  EXPECT_LE(rel_l2(got.dhidden, ref.dhidden), gt) << "dhidden";
  EXPECT_LE(rel_l2(got.dweight, ref.dweight), gt) << "dweight";
  ASSERT_EQ(got.dbias.size(), ref.dbias.size());
  const double bt = c.dbias_dtype == DType::F32 ? gt : std::max(gt, grad_tolerance(c.dbias_dtype));
  if (!ref.dbias.empty()) EXPECT_LE(rel_l2(got.dbias, ref.dbias), bt) << "dbias";
}

inline void expect_lce_matches_reference(Device device, const LceCase& c) {
  SCOPED_TRACE(c.describe());
  LceProblem p = make_lce_problem(c, rng());
  LceResult got = run_lce(device, c, p);
  expect_lce_close(c, got, reference_lce(c, p));
}

}  // namespace fusedloss::test

// fusedloss: SwiGLU over Megatron's fused gate-up layout, or over separate gate and up.
//
//   y = [a | b] per row: gate a = y[:, 0:n), up b = y[:, n:2n)     (y: [T, 2n], any row stride)
//   or the two-tensor form: gate a [T, n] and up b [T, n], each with its own row stride (Hugging
//   Face's and Liger's gate_proj(x), up_proj(x); halves of one buffer are read as they are)
//   forward   out = silu(a') * b' * w * d          a' = m (a + bias_a), b' = b + bias_b;
//                                                  w optional; m, d the gate and down multipliers
//   backward  da = g w d m sigmoid(a')(1 + a'(1 - sigmoid(a'))) b',  db = g w d silu(a')
//             dw = d sum_j silu(a'_j) b'_j g_j,  dbias = column sums of [da | db]
// The multipliers are Falcon-H1's mlp_multipliers: up * silu(gate * gate_multiplier), and the
// down projection's output times down_multiplier, which (the projection being linear) is this
// op's output times down_multiplier. Both 1 by default (plain SwiGLU).
// Clamped variant (clamp_value c): a' = min(a, c), b' = clamp(b, -c, c), and the gradient is
// zero where a clamp was active (beyond a bound; exactly on one, see the options). All math in fp32; outputs rounded once.
#pragma once
#include "fusedloss/types.h"

namespace fusedloss {

struct SwigluOptions {
  bool clamp = false;
  float clamp_value = 0.0f;  // > 0 when clamp is set
  // Whether the gradient passes where the value equals the bound, as the framework's clamp
  // does: the gate's for gate == clamp_value (Megatron: a.clamp(max=c)), the up's for
  // up == +-clamp_value (b.clamp(min=-c, max=c)). Strictly inside the bounds it always passes.
  // bf16/fp16 values land on the bound often, so this decides real gradients. The defaults
  // are torch 2.15's rule (0 on the bound for both); the Python package sets them from the
  // torch it runs with.
  bool clamp_gate_grad_at_bound = false;
  bool clamp_up_grad_at_bound = false;
  // The fp8 input store's values beyond e4m3's largest finite value (448), and inf: +-448 when
  // true (the hardware's satfinite conversion; newer torch casts), NaN when false (older torch
  // casts). Megatron stores torch's cast; the Python package matches the torch it runs with.
  bool fp8_saturate = true;
  // Falcon-H1's multipliers (finite; 1 leaves the math as it is): the gate is multiplied by
  // gate_multiplier after the bias and before the clamp and the activation; the output (and so
  // every gradient) by down_multiplier.
  float gate_multiplier = 1.0f;
  float down_multiplier = 1.0f;
};

// Checks the options alone (no views, no data): the same checks and messages the entry
// points run first. Throws Error.
void validate_swiglu_options(const SwigluOptions& options);

// y: [T, 2n] fp32/fp16/bf16. bias: absent or [2n], y's dtype or fp32. weights: absent or [T] fp32.
// out: [T, n] of y's dtype. y_fp8: absent (data == nullptr) or [T, 2n] FP8_E4M3, receiving the
// input (before bias) rounded to e4m3 for the backward (Megatron's fp8 input store).
void swiglu_forward(const MatrixView& y, const VectorView& bias, const VectorView& weights,
                    const SwigluOptions& options, const MatrixView& out,
                    const MatrixView& y_fp8 = {}, Stream stream = nullptr);

// grad_out: [T, n]. y: the saved input, in its own dtype or FP8_E4M3. grad_y: [T, 2n] in
// grad_out's dtype; may be y itself (in place, when the dtypes match). grad_weights: [T] fp32,
// required iff weights are given. grad_bias: [2n] fp32, required iff bias is given (computed in
// a fixed order: deterministic).
void swiglu_backward(const MatrixView& grad_out, const MatrixView& y, const VectorView& bias,
                     const VectorView& weights, const SwigluOptions& options,
                     const MatrixView& grad_y, float* grad_weights = nullptr,
                     float* grad_bias = nullptr, Stream stream = nullptr);

// The two-tensor form, through the same kernels: gate [T, n] and up [T, n] of one dtype
// (fp32/fp16/bf16; FP8_E4M3 both in the backward, from the fp8 input store), each with its own
// row stride; they may share memory (e.g. the halves of one [T, 2n] buffer, or one tensor
// twice). bias: absent or [2n], the gate's bias in [0, n) and the up's in [n, 2n). input_fp8:
// absent or [T, 2n] FP8_E4M3 receiving gate (columns [0, n)) and up ([n, 2n)) rounded to e4m3;
// its halves are the backward's gate and up then.
void swiglu_gate_up_forward(const MatrixView& gate, const MatrixView& up, const VectorView& bias,
                            const VectorView& weights, const SwigluOptions& options,
                            const MatrixView& out, const MatrixView& input_fp8 = {},
                            Stream stream = nullptr);

// grad_gate, grad_up: [T, n] in grad_out's dtype. In place: grad_gate may be gate itself and
// grad_up up itself (the same views; the dtypes match); otherwise each is apart from gate, up
// and the other. grad_weights / grad_bias as in swiglu_backward ([2n]: the gate's, then the up's).
void swiglu_gate_up_backward(const MatrixView& grad_out, const MatrixView& gate,
                             const MatrixView& up, const VectorView& bias,
                             const VectorView& weights, const SwigluOptions& options,
                             const MatrixView& grad_gate, const MatrixView& grad_up,
                             float* grad_weights = nullptr, float* grad_bias = nullptr,
                             Stream stream = nullptr);

}  // namespace fusedloss

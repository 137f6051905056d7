"""Property-based: shapes, layouts (expanded, transposed, sliced, offset, overlapping rows),
dtypes, options and in-place flags for every op and every tensor argument, against a float64
torch reference; memory the caller owns (leaves, targets, scales, biases) is never written.

CI runs a fixed-seed batch and a few random examples; FUSEDLOSS_PROPERTY_EXAMPLES and
FUSEDLOSS_PROPERTY_DEVICE=cuda give the long run on a GPU."""
import contextlib
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import fusedloss
from fusedloss._views import storage_is_ours
from layouts import LAYOUTS, build, leaf

DEVICE = os.environ.get("FUSEDLOSS_PROPERTY_DEVICE", "cpu")
EXAMPLES = int(os.environ.get("FUSEDLOSS_PROPERTY_EXAMPLES", "60"))
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
RUNS = {  # a fixed batch (the same examples every run) and a few fresh random ones
    "fixed": settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck)),
    "random": settings(max_examples=max(EXAMPLES // 4, 5), deadline=None, database=None,
                       suppress_health_check=list(HealthCheck)),
}


def _shape(draw, cols):
    rows = draw(st.integers(0, 9))
    if draw(st.booleans()):
        return (rows, cols)
    return (draw(st.integers(1, 3)), rows, cols)  # Megatron's [s, b, ...]


def _layout(draw, shape):
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return draw(st.sampled_from(LAYOUTS)) if rows > 1 else "contiguous"


def _input(draw, shape, dtype, gen, scale, edit=None):
    """(leaf base, op input, reference input from a float64 copy of the base)."""
    layout = _layout(draw, shape)
    base, view = leaf(layout, shape, dtype, DEVICE, gen, scale, step=draw(st.integers(1, 8)))
    if edit is not None:
        with torch.no_grad():
            base.copy_(edit(base))
    through_intermediate = draw(st.booleans())  # else the op gets a view of the leaf itself
    inp = view(base * 1 if through_intermediate else base)
    base64 = base.detach().double().requires_grad_(True)
    return base, inp, base64, view(base64), layout


def _multiplicity(layout, shape):
    """How many op elements share one base element (the base's gradient sums them)."""
    return max(shape) if layout in ("expanded", "overlapping") else 1


def _upstream(draw, out, gen):
    """A scalar to backward from: out.sum() (an expanded gradient arrives) or a weighted sum."""
    if out.dim() == 0 or draw(st.booleans()):
        return lambda o: o.sum(), lambda o: o.sum()
    w = torch.rand(out.shape, generator=gen, dtype=torch.float64) + 0.5
    return (lambda o: (o * w.to(o.device, o.dtype)).sum()), (lambda o: (o * w.to(o.device)).sum())


def _close(actual, expected, tol, scale=1.0):
    torch.testing.assert_close(actual.double().cpu(), expected.detach().double().cpu(), rtol=tol,
                               atol=tol * scale, equal_nan=True)


def _ce_reference(x, t, ignore_index, ls, formula, reduction, z, softcap=None, parts=False):
    """float64 loss (with parts: (loss, z-loss part)) of logits x, soft-capped first."""
    x2 = x.reshape(-1, x.size(-1))
    if softcap:
        x2 = softcap * torch.tanh(x2 / softcap)
    t2 = t.reshape(-1).long()
    if formula == "megatron" and ls > 0:
        ls = ls * x2.size(1) / (x2.size(1) - 1)
    per_row = F.cross_entropy(x2, t2, ignore_index=ignore_index, label_smoothing=ls, reduction="none")
    valid = t2 != ignore_index
    z_rows = z * torch.where(valid, torch.logsumexp(x2, -1) ** 2, 0.0)

    def reduced(rows):
        if reduction == "none":
            return rows.view(t.shape)
        if reduction == "sum":
            return rows.sum()
        return rows.sum() / valid.sum().clamp(min=1)  # no valid row: 0, not NaN

    loss = reduced(per_row + z_rows)
    return (loss, reduced(z_rows)) if parts else loss


@st.composite
def _ce_case(draw):
    cols = draw(st.integers(1, 70))
    shape = _shape(draw, cols)
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ls = draw(st.sampled_from([0.0, 0.1])) if cols > 1 else 0.0
    reduction = draw(st.sampled_from(["none", "sum", "mean"]))
    tdtype = draw(st.sampled_from([torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]))
    ignore = 255 if tdtype == torch.uint8 else -100  # an unsigned index cannot hold -100
    opts = dict(ignore_index=ignore, label_smoothing=ls,
                smoothing_formula=draw(st.sampled_from(["pytorch", "megatron"])),
                reduction=reduction, z_loss=draw(st.sampled_from([0.0, 1e-3])),
                logit_softcap=draw(st.sampled_from([None, 2.5])),
                inplace_backward=draw(st.booleans()),
                grad_in_forward=reduction != "none" and draw(st.booleans()),
                # Liger's extra outputs: the z-loss and the predicted tokens beside the loss
                return_z_loss=draw(st.booleans()), return_predicted_tokens=draw(st.booleans()))
    t = torch.randint(0, cols, shape[:-1], generator=gen)
    t[torch.rand(shape[:-1], generator=gen) < 0.2] = ignore
    t_layout = draw(st.sampled_from(["contiguous", "strided", "expanded"]))
    if t_layout == "strided" and t.numel():
        t = torch.stack([t, torch.zeros_like(t)], -1)[..., 0]
    elif t_layout == "expanded" and t.numel():
        t = t.reshape(-1)[:1].expand(t.numel()).view(t.shape)
    return draw, shape, dtype, gen, opts, t.to(tdtype).to(DEVICE)


def _loss_then_backward(draw, gen, loss, ref, *owned):
    """The cross-entropy's loss against float64, then a backward from both under a drawn
    upstream gradient (returned: float64's form); each (tensor, copy before the call) of the
    caller's still unwritten."""
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    _close(loss, ref, 2e-5, max(1.0, ref.abs().max().item() if ref.numel() else 1.0))
    up, up64 = _upstream(draw, loss, gen)
    up(loss).backward()
    up64(ref).backward()
    for x, before in owned:
        assert torch.equal(x.detach(), before), "a tensor of the caller's was written"
    return up64


@pytest.mark.parametrize("run", sorted(RUNS))
def test_cross_entropy_any_layout(run):
    @RUNS[run]
    @given(_ce_case())
    def check(case):
        draw, shape, dtype, gen, opts, t = case
        base, x, base64, x64, layout = _input(draw, shape, dtype, gen, 3.0)
        before, t_before = base.detach().clone(), t.clone()
        # the arg-max of the logits as passed (before grad_in_forward may overwrite them)
        x_before = x.detach().float().clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # in-place refused for leaves / copied layouts
            out = fusedloss.cross_entropy(x, t, **opts)
        ref, z_ref = _ce_reference(x64, t.cpu().to(DEVICE), opts["ignore_index"],
                                   opts["label_smoothing"], opts["smoothing_formula"],
                                   opts["reduction"], opts["z_loss"], opts["logit_softcap"], True)
        extras = opts["return_z_loss"] or opts["return_predicted_tokens"]
        loss = out.loss if extras else out
        if opts["return_z_loss"]:
            _close(out.z_loss, z_ref, 2e-5, max(1e-6, z_ref.abs().max().item() if z_ref.numel() else 0.0))
        if opts["return_predicted_tokens"]:
            counted = t != opts["ignore_index"]
            want = torch.where(counted, x_before.argmax(-1), -1)
            assert torch.equal(out.predicted_tokens, want.view(t.shape))
        up64 = _loss_then_backward(draw, gen, loss, ref, (base, before), (t, t_before))
        gmax = base64.grad.abs().max().item() if base64.grad.numel() else 1.0
        # A row's gradient is g_r (p (1 + 2 z lse) - smoothed one-hot): terms of size g_r that
        # may cancel (one column: p = 1), so its error scales with g_r, not with the result.
        lse_max = _max_abs_lse(x64, opts["logit_softcap"])
        terms = _ce_row_upstream(up64, t, opts) * (2.0 + 2.0 * opts["z_loss"] * lse_max)
        # (the row's math is fp32: that cancellation is fp32-sized, whatever the logits' dtype)
        _close(base.grad, base64.grad, TOL[dtype],
               (gmax + 2e-5 / TOL[dtype] * terms) * _multiplicity(layout, shape) + 1e-6)

    check()


def _class_weight(draw, cols, gen):
    """(weight as the op gets it, its float64 values): positive, some classes at 0, in a
    layout drawn like the logits' (contiguous, strided, expanded, a slice of a longer vector,
    a view of a leaf that needs no grad) and any float dtype."""
    dtype = draw(st.sampled_from(DTYPES))
    values = (torch.rand(cols, generator=gen, dtype=torch.float64) + 0.25).to(dtype)
    values[torch.rand(cols, generator=gen) < 0.1] = 0.0
    layout = draw(st.sampled_from(["contiguous", "strided", "expanded", "sliced", "view"]))
    if layout == "strided":
        w = torch.stack([values, torch.full_like(values, 7.0)], -1)[:, 0]
    elif layout == "expanded":
        values = values[:1].expand(cols)
        w = values
    elif layout == "sliced":
        w = torch.cat([torch.full((3,), 5.0, dtype=dtype), values])[3:]
    elif layout == "view":
        w = values.clone().view(1, cols)[0]
    else:
        w = values.clone()
    return w.to(DEVICE), values.double()


@pytest.mark.parametrize("run", sorted(RUNS))
def test_cross_entropy_class_weight_any_layout(run):
    """F.cross_entropy's per-class weight (and its weighted smoothing, either formula) with the
    logits, the targets and the weight each in any layout and dtype; the weight never
    written."""
    from test_cross_entropy import weighted_reference

    @RUNS[run]
    @given(_ce_case())
    def check(case):
        draw, shape, dtype, gen, opts, t = case
        cols = shape[-1]
        w, w64 = _class_weight(draw, cols, gen)
        ls = opts["label_smoothing"] if cols > 1 else 0.0
        options = dict(ignore_index=opts["ignore_index"], label_smoothing=ls,
                       smoothing_formula=opts["smoothing_formula"], reduction=opts["reduction"],
                       inplace_backward=opts["inplace_backward"])
        base, x, base64, x64, layout = _input(draw, shape, dtype, gen, 3.0)
        before, t_before, w_before = base.detach().clone(), t.clone(), w.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # in-place refused for leaves / copied layouts
            loss = fusedloss.cross_entropy(x, t, weight=w, **options)
        t2 = t.reshape(-1).long().cpu().to(DEVICE)
        formula = options["smoothing_formula"] if ls > 0 else "pytorch"  # the same without smoothing
        ref = weighted_reference(x64.reshape(-1, cols), t2, w64.to(DEVICE), ls, options["reduction"],
                                 formula, options["ignore_index"])
        if options["reduction"] == "none":
            ref = ref.view(t.shape)
        elif options["reduction"] == "mean" and not (w64[t2[t2 != options["ignore_index"]].cpu()]
                                                    .sum() > 0):
            return  # no weight among the counted rows: torch's 0/0 (NaN), the op's 0
        _loss_then_backward(draw, gen, loss, ref, (base, before), (t, t_before), (w, w_before))
        gmax = base64.grad.abs().max().item() if base64.grad.numel() else 1.0
        _close(base.grad, base64.grad, TOL[dtype],
               (2 * gmax + 1e-4) * _multiplicity(layout, shape) + 1e-6)

    check()


def _ce_row_upstream(up64, t, opts):
    """max |d loss / d per-row loss|: the upstream gradient each row's terms are scaled by."""
    rows = torch.ones(t.numel(), dtype=torch.float64, requires_grad=True)
    valid = (t.reshape(-1).cpu().long() != opts["ignore_index"]).double()
    per_row = rows * valid
    red = opts["reduction"]
    out = per_row.view(t.shape) if red == "none" else per_row.sum() / (valid.sum().clamp(min=1) if red == "mean" else 1)
    (g,) = torch.autograd.grad(up64(out), rows, allow_unused=True)
    return g.abs().max().item() if g is not None and g.numel() else 0.0


def _max_abs_lse(x64, softcap=None):
    x2 = x64.detach().reshape(-1, x64.size(-1))
    if softcap:
        x2 = softcap * torch.tanh(x2 / softcap)
    return torch.logsumexp(x2, -1).abs().max().item() if x2.numel() else 0.0


def _swiglu_reference(y, bias, w, clamp, gm=1.0, dm=1.0):
    """Megatron's SwiGLU with Falcon-H1's multipliers (the gate times gm before the clamp and the
    activation, the output times dm)."""
    v = y + bias if bias is not None else y
    a, u = v.chunk(2, -1)
    a = a * gm
    if clamp is not None:
        a = a.clamp(max=clamp)
        u = u.clamp(-clamp, clamp)
    out = F.silu(a) * u * dm
    return out * w.reshape(*out.shape[:-1], 1) if w is not None else out


def _swiglu_aux_terms(y, b_ref, w_ref, clamp, up64, factor, gm=1.0, dm=1.0):
    """The magnitudes of the terms the bias's gradient (per column: |dL/dv| summed over rows)
    and the scale's (per row: |dL/dout * out / scale| summed over columns) add up."""
    v = (y + b_ref if b_ref is not None else y).detach().requires_grad_(True)
    unscaled = _swiglu_reference(v, None, None, clamp, gm, dm)
    scale = w_ref.detach().reshape(*unscaled.shape[:-1], 1) if w_ref is not None else 1.0
    out = unscaled * scale * factor
    (gv,) = torch.autograd.grad(up64(out), v)
    o = out.detach().requires_grad_(True)
    (go,) = torch.autograd.grad(up64(o), o)
    return {"bias": gv.abs().reshape(-1, v.size(-1)).sum(0),
            "scale": (go * unscaled.detach() * factor).abs().sum(-1, keepdim=True)}


def _through_view(view, base64, terms):
    """Largest sum of `terms` over the view positions that share one element of the base."""
    if base64.numel() == 0 or terms.numel() == 0:
        return 0.0
    ones = torch.ones_like(base64, requires_grad=True)
    (g,) = torch.autograd.grad((view(ones) * terms.reshape(view(ones).shape)).sum(), ones)
    return g.abs().max().item()


@st.composite
def _swiglu_case(draw):
    n = draw(st.integers(1, 40))
    shape = _shape(draw, 2 * n)
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    fp8 = draw(st.booleans()) and draw(st.booleans())
    opts = dict(clamp_value=draw(st.sampled_from([None, 0.5, 2.0])), fp8_input_store=fp8,
                inplace_backward=draw(st.booleans()) and not fp8)
    if draw(st.booleans()):  # Falcon-H1's multipliers
        opts.update(gate_multiplier=draw(st.sampled_from([0.5, 1.0, 2.5, -1.5])),
                    down_multiplier=draw(st.sampled_from([0.25, 1.0, -3.0])))
    return draw, shape, dtype, gen, opts


def _aux(draw, shape, gen, kind):
    """bias [2n] or per_token_scale ([T, 1] or y's shape with a last dim of 1): absent, or any
    float dtype and layout, a view of a leaf."""
    if not draw(st.booleans()):
        return None, None, None
    dtype = draw(st.sampled_from(DTYPES + (torch.float64,)))
    layout = draw(st.sampled_from(["contiguous", "sliced", "expanded", "transposed"]))
    scale = 0.3 if kind == "bias" else 1.0
    nd = len(shape)
    if layout == "sliced":  # bias[::2] of a longer vector; scale probs[..., :1] of [..., 4]
        full = (shape[0] * 2,) if kind == "bias" else (*shape[:-1], 4)
        base = (torch.rand(full, generator=gen, dtype=torch.float64) * scale + 0.1).to(dtype)
        view = (lambda b: b[::2]) if kind == "bias" else (lambda b: b[..., :1])
    elif layout == "expanded":
        base = (torch.rand(1, generator=gen, dtype=torch.float64) * scale + 0.1).to(dtype)
        view = lambda b: b.view((1,) * nd).expand(shape)  # noqa: E731
    elif layout == "transposed":  # the storage of the reversed shape, dims permuted back
        base = (torch.rand(shape[::-1], generator=gen, dtype=torch.float64) * scale + 0.1).to(dtype)
        view = lambda b: b.permute(*reversed(range(nd)))  # noqa: E731
    else:
        base = (torch.rand(shape, generator=gen, dtype=torch.float64) * scale + 0.1).to(dtype)
        view = lambda b: b  # noqa: E731
    base = base.to(DEVICE).requires_grad_(True)
    return base, view, base.detach().double().requires_grad_(True)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_swiglu_any_layout(run):
    @RUNS[run]
    @given(_swiglu_case())
    def check(case):
        draw, shape, dtype, gen, opts = case
        clamp = opts["clamp_value"]
        mults = (opts.get("gate_multiplier", 1.0), opts.get("down_multiplier", 1.0))

        def on_bounds(base):  # bf16 values land exactly on the clamp bound often
            pick = torch.rand(base.shape, generator=gen) < 0.25
            sign = torch.where(torch.rand(base.shape, generator=gen) < 0.5, -1.0, 1.0)
            return torch.where(pick.to(DEVICE), (sign * clamp).to(DEVICE, base.dtype), base)

        base, y, base64, y64, layout = _input(draw, shape, dtype, gen, 2.0,
                                              on_bounds if clamp is not None else None)
        rows = y.numel() // y.size(-1) if y.size(-1) else 0
        b, b_view, b64 = _aux(draw, (y.size(-1),), gen, "bias")
        # the scale as [T, 1] or in y's shape with a last dim of 1 (both in y's row order)
        w, w_view, w64 = _aux(draw, draw(st.sampled_from([(rows, 1), (*y.shape[:-1], 1)])), gen, "scale")
        owned = [(t, t.detach().clone()) for t in (base, b, w) if t is not None]
        b_arg = b_view(b) if b is not None else None
        w_arg = w_view(w) if w is not None else None
        b_ref = None if b is None else b_view(b64)
        w_ref = None if w is None else w_view(w64)
        # a bias or scale that is y's own memory (constants: no gradient asked), read as passed
        # while the in-place backward overwrites y
        if opts["inplace_backward"] and rows > 0 and storage_is_ours(y) and draw(st.sampled_from([True, True, False])):
            k = y.size(-1) if draw(st.booleans()) else rows  # the bias [2n] or the scale [T, 1]
            room = y.untyped_storage().nbytes() // y.element_size() - y.storage_offset()
            alias = y.detach().as_strided((min(k, room),), (1,), y.storage_offset())
            alias = alias if alias.numel() == k else alias[:1].expand(k)  # y's first elements
            if k == y.size(-1):
                b, b_arg = None, alias
                b_ref = alias.double().clone()
            else:
                w, w_arg = None, alias.view(rows, 1)
                w_ref = w_arg.double().clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fusedloss.swiglu(y, b_arg, per_token_scale=w_arg, **opts)
        y_bwd = y64
        if opts["fp8_input_store"]:  # the backward sees only the e4m3 copy of y
            y_bwd = y64.detach().to(torch.float8_e4m3fn).double().requires_grad_(True)
        ref_out = _swiglu_reference(y64.detach(), None if b_ref is None else b_ref.detach(),
                                    None if w_ref is None else w_ref.detach(), clamp, *mults)
        ref = _swiglu_reference(y_bwd, b_ref, w_ref, clamp, *mults)
        assert out.dtype == dtype and out.shape == ref.shape
        tol = TOL[dtype]
        _close(out, ref_out, tol, max(1.0, ref_out.abs().max().item() if ref_out.numel() else 1.0))
        scaled = draw(st.booleans())
        if scaled:  # as with torch's ops, a result may be modified in place
            out.mul_(2.0)
            ref = ref * 2.0
        up, up64 = _upstream(draw, out, gen)
        up(out).backward()
        up64(ref).backward()
        for t, before in owned:
            assert torch.equal(t.detach(), before), "the caller's tensor was written"
        if opts["fp8_input_store"] and y_bwd.grad is not None:  # d(e4m3 copy) flows to y as is
            y64_grad = torch.autograd.grad(y64, base64, y_bwd.grad, allow_unused=True)[0]
        else:
            y64_grad = base64.grad
        mult = _multiplicity(layout, shape)
        if y64_grad is not None:
            gmax = y64_grad.abs().max().item() if y64_grad.numel() else 1.0
            _close(base.grad, y64_grad, tol, gmax * mult + 1e-6)
        terms = _swiglu_aux_terms(y_bwd, b_ref, w_ref, clamp, up64, 2.0 if scaled else 1.0, *mults)
        for t, t64, view, kind in ((b, b64, b_view, "bias"), (w, w64, w_view, "scale")):
            if t is not None:
                assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
                gmax = t64.grad.abs().max().item() if t64.grad.numel() else 1.0
                # a sum over rows (and over the positions a view repeats it at), rounded per
                # column or row in t's dtype: its error scales with its terms, not with the sum
                base_terms = _through_view(view, t64, terms[kind])
                _close(t.grad, t64.grad, max(tol, TOL.get(t.dtype, 2e-5)), max(gmax, base_terms) + 1e-6)

    check()


def _head_inputs(draw, shape, V, dtype, gen):
    """An LM head's inputs: hidden (shape) and weight [V, H] through _input, and int32/int64
    targets in [0, V) with a fifth of them -100, contiguous, strided or expanded (stride 0)."""
    hidden = _input(draw, shape, dtype, gen, 1.0)
    weight = _input(draw, (V, shape[-1]), dtype, gen, 2.0 / shape[-1] ** 0.5)
    t = torch.randint(0, V, shape[:-1], generator=gen)
    t[torch.rand(shape[:-1], generator=gen) < 0.2] = -100
    t = t.to(draw(st.sampled_from([torch.int64, torch.int32]))).to(DEVICE)
    layout = draw(st.sampled_from(["contiguous", "strided", "expanded"])) if t.numel() else None
    if layout == "strided":  # every other element of a wider buffer
        t = torch.stack([t, torch.zeros_like(t)], -1)[..., 0]
    elif layout == "expanded":  # one token for every row, stride 0
        t = t.reshape(-1)[:1].expand(t.shape)
    return hidden, weight, t


@st.composite
def _swiglu_two_case(draw):
    n = draw(st.integers(1, 40))
    shape = _shape(draw, n)
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    fp8 = draw(st.booleans()) and draw(st.booleans())
    opts = dict(clamp_value=draw(st.sampled_from([None, 0.5, 2.0])), fp8_input_store=fp8,
                inplace_backward=draw(st.booleans()) and not fp8,
                gate_multiplier=draw(st.sampled_from([1.0, 0.5, 2.5, -1.5])),
                down_multiplier=draw(st.sampled_from([1.0, 0.25, -3.0])))
    return draw, shape, dtype, gen, opts, draw(st.booleans())


@pytest.mark.parametrize("run", sorted(RUNS))
def test_swiglu_two_tensor_any_layout(run):
    """swiglu(gate, up): two tensors in any layouts, or the halves of one buffer in any layout
    (y.chunk(2, -1)), with every option and the multipliers, against the float64 reference of
    the fused form over [gate | up]; the caller's tensors are never written."""
    @RUNS[run]
    @given(_swiglu_two_case())
    def check(case):
        draw, shape, dtype, gen, opts, halves = case
        n, clamp = shape[-1], opts["clamp_value"]
        mults = (opts["gate_multiplier"], opts["down_multiplier"])
        fp8 = opts["fp8_input_store"]

        def to_bwd(v64):  # what the backward reads: the input, or its e4m3 copy (a new leaf)
            return v64.detach().to(torch.float8_e4m3fn).double().requires_grad_(True) if fp8 else v64

        if halves:
            base, y, base64, y64, layout = _input(draw, (*shape[:-1], 2 * n), dtype, gen, 2.0)
            gate, up = y.chunk(2, -1)
            src64, src_bwd = y64, to_bwd(y64)
            inputs = [(base, base64, y64, src_bwd, layout, y.shape)]
        else:
            inputs, views = [], []
            for _ in range(2):
                base, v, base64, v64, layout = _input(draw, shape, dtype, gen, 2.0)
                views.append(v)
                inputs.append((base, base64, v64, to_bwd(v64), layout, shape))
            gate, up = views
            src64 = torch.cat([inputs[0][2], inputs[1][2]], -1)
            src_bwd = torch.cat([inputs[0][3], inputs[1][3]], -1)
        rows = gate.numel() // n
        b, b_view, b64 = _aux(draw, (2 * n,), gen, "bias")
        w, w_view, w64 = _aux(draw, draw(st.sampled_from([(rows, 1), (*gate.shape[:-1], 1)])), gen, "scale")
        owned = [(t, t.detach().clone()) for t in [i[0] for i in inputs] + [b, w] if t is not None]
        b_ref = None if b is None else b_view(b64)
        w_ref = None if w is None else w_view(w64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fusedloss.swiglu(gate, up, bias=None if b is None else b_view(b),
                                   per_token_scale=None if w is None else w_view(w), **opts)
        ref_out = _swiglu_reference(src64.detach(), None if b_ref is None else b_ref.detach(),
                                    None if w_ref is None else w_ref.detach(), clamp, *mults)
        ref = _swiglu_reference(src_bwd, b_ref, w_ref, clamp, *mults)
        assert out.dtype == dtype and out.shape == gate.shape == ref.shape
        tol = TOL[dtype]
        _close(out, ref_out, tol, max(1.0, ref_out.abs().max().item() if ref_out.numel() else 1.0))
        up_fn, up64 = _upstream(draw, out, gen)
        up_fn(out).backward()
        up64(ref).backward()
        for t, before in owned:
            assert torch.equal(t.detach(), before), "the caller's tensor was written"
        for base, base64, v64, v_bwd, layout, v_shape in inputs:
            if fp8 and v_bwd.grad is not None:  # d(e4m3 copy) flows to the input as is
                want = torch.autograd.grad(v64, base64, v_bwd.grad, allow_unused=True)[0]
            else:
                want = base64.grad
            if want is not None:
                gmax = want.abs().max().item() if want.numel() else 1.0
                _close(base.grad, want, tol, gmax * _multiplicity(layout, v_shape) + 1e-6)
        terms = _swiglu_aux_terms(src_bwd, b_ref, w_ref, clamp, up64, 1.0, *mults)
        for t, t64, view, kind in ((b, b64, b_view, "bias"), (w, w64, w_view, "scale")):
            if t is not None:
                assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
                gmax = t64.grad.abs().max().item() if t64.grad.numel() else 1.0
                base_terms = _through_view(view, t64, terms[kind])
                _close(t.grad, t64.grad, max(tol, TOL.get(t.dtype, 2e-5)), max(gmax, base_terms) + 1e-6)

    check()


@st.composite
def _lce_case(draw):
    H = draw(st.integers(1, 24))
    shape = _shape(draw, H)
    V = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ls = draw(st.sampled_from([0.0, 0.1])) if V > 1 else 0.0
    reduction = draw(st.sampled_from(["none", "sum", "mean"]))
    opts = dict(label_smoothing=ls, smoothing_formula=draw(st.sampled_from(["pytorch", "megatron"])),
                reduction=reduction, z_loss=draw(st.sampled_from([0.0, 1e-3])),
                logit_softcap=draw(st.sampled_from([None, 3.0])),
                # in_forward with fp16 inputs is drawn too: refused (the check below)
                backward_mode=draw(st.sampled_from(["auto", "recompute"] +
                                                   ([] if reduction == "none" else ["in_forward"]))),
                inplace_backward=draw(st.booleans()),
                dweight_accumulation=draw(st.sampled_from(["auto", "fp32", "weight_dtype"])),
                # a few tokens per chunk (chunk boundaries), the default workspace, or 3/4 of
                # one chunk of every token (a 16-bit recompute with fp32 accumulation then
                # shrinks its vocabulary block so that one chunk holds them all)
                workspace_bytes=draw(st.sampled_from([
                    None, 2 * 3 * ((V + 63) // 64 * 64) * 4,
                    max(1, math.prod(shape[:-1])) * (3 * V // 4) * dtype.itemsize + 16])))
    return draw, shape, V, dtype, gen, opts


# the linear CE's tolerance by the GEMMs' dtype (its logits are rounded to it)
LCE_TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _lce_upstream(draw, loss, gen, mask):
    """_upstream, or with a loss_mask the form Megatron's loss_func gives: c * sum(mask * loss)."""
    if mask is None:
        return _upstream(draw, loss, gen)
    c = draw(st.sampled_from([1.0, 0.37, -2.5]))
    return (lambda o: (o * mask.to(o.dtype)).sum() * c), (lambda o: (o * mask.cpu().double()).sum() * c)


def _mask_input(draw, shape, gen):
    """(leaf, loss_mask): a 0/1 mask of target's shape in a drawn real dtype and layout, the
    leaf itself or a view of it (2-D: every layout of layouts.build; 1-D: a row of one, or a
    stride-0 expansion of one value)."""
    dtype = draw(st.sampled_from([torch.bool, torch.int32, torch.float16, torch.bfloat16,
                                  torch.float32, torch.float64]))
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced", "offset", "expanded"]))
    make = lambda n: (torch.rand(n, generator=gen) > 0.3).to(dtype).to(DEVICE)  # noqa: E731
    if len(shape) == 1 and layout == "expanded":
        base = make(1)
        return base, base.expand(shape)
    base, view = build(layout, shape if len(shape) == 2 else (1, *shape), make)
    mask = view(base)
    return base, mask if len(shape) == 2 else mask[0]


@pytest.mark.parametrize("run", sorted(RUNS))
def test_linear_cross_entropy_any_layout(run):
    from test_linear_cross_entropy import reference_from_logits

    @RUNS[run]
    @given(_lce_case())
    def check(case):
        draw, shape, V, dtype, gen, opts = case
        (base_h, h, base_h64, h64, layout_h), (base_w, w, base_w64, w64, layout_w), t = \
            _head_inputs(draw, shape, V, dtype, gen)
        H = shape[-1]
        owned = [(x, x.detach().clone()) for x in (base_h, base_w, t)]
        # the LM head's bias: absent, or a leaf of the weight's dtype in a drawn layout (itself,
        # a view of it, or through an intermediate), never written
        bias = None
        if draw(st.booleans()):
            base_b, bias, base_b64, b64, layout_b = _weight_leaf(draw, V, dtype, gen)
            owned.append((base_b, base_b.detach().clone()))
        if dtype == torch.float16 and opts["backward_mode"] == "in_forward":
            with pytest.raises(ValueError, match="backward_mode: got 'in_forward' with torch.float16 inputs"):
                fusedloss.linear_cross_entropy(h, w, t, **opts)
            for x, before in owned:
                assert torch.equal(x.detach(), before), "a refused call wrote a tensor"
            return
        # the weight's gradient into an fp32 buffer (Megatron's main_grad) in any layout, dtype,
        # as a plain buffer or a parameter-like leaf (or a view of one): fp32 buffers whose rows
        # can be written in are taken, every other one refused with nothing written
        acc_layout = draw(st.sampled_from([None, "contiguous", "sliced", "offset", "transposed",
                                           "expanded"]))
        acc_dtype = draw(st.sampled_from([torch.float32] * 3 + [torch.bfloat16, torch.float16,
                                                                torch.float64]))
        acc_needs_grad = draw(st.sampled_from([False, False, True]))
        acc = None
        if acc_layout is not None and V > 1:
            acc_base, acc_view = build(acc_layout, (V, H),
                                       lambda n: torch.randn(n, generator=gen).to(DEVICE, acc_dtype))
            acc_base.requires_grad_(acc_needs_grad)
            acc, acc_before = acc_view(acc_base), acc_base.detach().clone()
            refused = (f"got {acc_dtype}" if acc_dtype != torch.float32 else
                       "got a tensor that requires grad" if acc_needs_grad else
                       # ([V, 1] transposed is still rows)
                       "got strides" if acc_layout == "expanded" or acc_layout == "transposed" and H > 1
                       else None)
            if refused:
                with pytest.raises(ValueError, match="weight_grad_accumulator: " + refused):
                    fusedloss.linear_cross_entropy(h, w, t, weight_grad_accumulator=acc, **opts)
                assert torch.equal(acc_base.detach(), acc_before)
                acc = None
        # per-token losses reduced with a mask (Megatron's loss_func): the mask in any real
        # dtype and layout, the in-forward backward for it (auto, or asked for), the upstream
        # gradient c * mask
        mask = None
        if opts["reduction"] == "none" and draw(st.sampled_from([True, True, True, False])):
            mask_base, mask = _mask_input(draw, shape[:-1], gen)
            owned.append((mask_base, mask_base.clone()))
            if dtype != torch.float16 and draw(st.booleans()):
                opts = dict(opts, backward_mode="in_forward")
        no_grad = draw(st.sampled_from([False, False, False, True]))  # evaluation: forward alone
        want_z = draw(st.booleans())  # Liger's z-loss apart
        want_pred = draw(st.booleans())  # Liger's predicted tokens: the (biased) logits' arg-max
        # fp32 inputs under torch.autocast: the GEMMs in bf16, the gradients back in fp32
        autocast = dtype == torch.float32 and draw(st.booleans())
        with warnings.catch_warnings(), torch.no_grad() if no_grad else contextlib.nullcontext(), \
                torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=autocast):
            warnings.simplefilter("ignore")
            out = fusedloss.linear_cross_entropy(h, w, t, bias, weight_grad_accumulator=acc,
                                                 loss_mask=mask, return_z_loss=want_z,
                                                 return_predicted_tokens=want_pred, **opts)
        loss = out.loss if want_z or want_pred else out
        logits64 = F.linear(h64.cpu().reshape(-1, H), w64.cpu(),
                            None if bias is None else b64.cpu())
        ce = {k: opts[k] for k in ("label_smoothing", "smoothing_formula", "reduction", "z_loss",
                                   "logit_softcap")}
        logits64.retain_grad()  # its gradient's entries: the terms the bias's gradient sums
        ref = reference_from_logits(logits64, t.cpu(), shape[:-1], **ce)
        if want_z:  # the z-loss part alone, reduced as the loss
            z_ref = _ce_reference(logits64, t.cpu(), -100, 0.0, "pytorch", opts["reduction"],
                                  opts["z_loss"], opts["logit_softcap"], parts=True)[1]
            _close(out.z_loss, z_ref, LCE_TOL[torch.bfloat16 if autocast else dtype],
                   max(1e-6, z_ref.abs().max().item() if z_ref.numel() else 0.0))
        assert loss.dtype == torch.float32 and loss.shape == ref.shape
        tol = LCE_TOL[
            torch.bfloat16 if autocast else dtype]
        if want_pred:  # an arg-max of the logits as the GEMM rounds them: within its rounding
            pred = out.predicted_tokens.reshape(-1).cpu()
            counted = t.reshape(-1).cpu() != -100
            assert torch.equal(pred[~counted], torch.full_like(pred[~counted], -1))
            z = logits64.detach()[counted]
            if z.numel():
                picked = z.gather(1, pred[counted].long().clamp(0, V - 1)[:, None])[:, 0]
                top = z.max(-1).values
                assert (pred[counted] >= 0).all() and (pred[counted] < V).all()
                assert (picked >= top - 2 * tol * top.abs().clamp(min=1.0)).all(), (picked, top)
        _close(loss, ref, tol, max(1.0, ref.abs().max().item() if ref.numel() else 1.0))
        if no_grad:  # nothing to differentiate, nothing written
            assert not loss.requires_grad
            for x, before in owned + ([(acc_base, acc_before)] if acc is not None else []):
                assert torch.equal(x.detach(), before), "a tensor was written without a backward"
            return
        up, up64 = _lce_upstream(draw, loss, gen, mask)
        up(loss).backward()
        w64.retain_grad()  # the gradient of the op's weight argument, the view, for the buffer
        up64(ref).backward()
        for x, before in owned:
            assert torch.equal(x.detach(), before), "the caller's tensor was written"
        if acc is not None:  # added in the view's place, nothing else written; autograd got zeros
            want = acc_before.clone()
            acc_view(want).add_(w64.grad.float().to(DEVICE))
            scale = max(w64.grad.abs().max().item() if w64.grad.numel() else 0.0, 1e-6)
            _close(acc_base, want, tol, scale * max(V, H) + acc_before.abs().max().item())
            assert not base_w.grad.any()
        # a gradient's natural scale is the other operand's (softmax weights are at most 1): its
        # entries can cancel to ~0 where fp32 still leaves that scale's rounding
        for base, base64, layout, shp, other in ((base_h, base_h64, layout_h, shape, w64),
                                                 (base_w, base_w64, layout_w, (V, H), h64))[:1 if acc is not None else 2]:
            assert base.grad.dtype == dtype and base.grad.shape == base.shape
            scale = max(base64.grad.abs().max().item() if base64.grad.numel() else 0.0,
                        other.detach().abs().max().item() if other.numel() else 0.0, 1e-6)
            _close(base.grad, base64.grad, tol, scale * _multiplicity(layout, shp) * max(shp))
        if bias is not None:  # the column sums of the logits' gradient, over every token
            rows = max(1, math.prod(shape[:-1]))
            # terms of opposite signs cancel (a row's sum over its columns is 0): the error
            # scales with the terms, not with the sum
            scale = max(logits64.grad.abs().max().item() if logits64.grad.numel() else 0.0, 1e-6)
            assert base_b.grad.dtype == dtype
            _close(base_b.grad, base_b64.grad, tol, scale * _multiplicity(layout_b, (V,)) * rows)

    check()


def _rms_reference(x, w, r, eps, zero_centered):
    s = x + r if r is not None else x
    gamma = w + 1 if zero_centered else w
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * gamma, s


def _weight_leaf(draw, H, dtype, gen):
    """(leaf, the weight the op gets, the float64 reference weight) in a drawn layout."""
    layout = draw(st.sampled_from(["contiguous", "sliced", "expanded"]))
    n = {"contiguous": H, "sliced": 2 * H, "expanded": 1}[layout]
    base = (torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).to(dtype).to(DEVICE).requires_grad_()
    view = {"contiguous": lambda b: b, "sliced": lambda b: b[::2], "expanded": lambda b: b.expand(H)}[layout]
    base64 = base.detach().double().requires_grad_(True)
    through_intermediate = draw(st.booleans())
    return base, view(base * 1 if through_intermediate else base), base64, view(base64), layout


@st.composite
def _rms_case(draw):
    H = draw(st.integers(1, 48))
    shape = _shape(draw, H)
    dtype = draw(st.sampled_from(DTYPES))
    # the weight in x's dtype, or one the kernels read in fp32 (any other float dtype)
    w_dtype = draw(st.sampled_from([dtype, torch.float32, torch.bfloat16, torch.float16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    opts = dict(eps=draw(st.sampled_from([1e-5, 1e-2])),
                zero_centered_gamma=draw(st.booleans()))
    return draw, shape, dtype, w_dtype, gen, opts, draw(st.booleans()), draw(st.booleans())


@pytest.mark.parametrize("run", sorted(RUNS))
def test_rms_norm_any_layout(run):
    @RUNS[run]
    @given(_rms_case())
    def check(case):
        draw, shape, dtype, w_dtype, gen, opts, with_residual, modify_output = case
        base, x, base64, x64, layout = _input(draw, shape, dtype, gen, 2.0)
        wbase, w, wbase64, w64, w_layout = _weight_leaf(draw, shape[-1], w_dtype, gen)
        r = r64 = rbase = rbase64 = None
        if with_residual:
            rbase, r, rbase64, r64, _ = _input(draw, shape, dtype, gen, 2.0)
        before = [t.detach().clone() for t in (base, wbase, rbase) if t is not None]
        if draw(st.booleans()):  # F.rms_norm's order: (x, normalized_shape, weight, eps)
            call = lambda **kw: fusedloss.rms_norm(x, (shape[-1],), w, opts["eps"],  # noqa: E731
                                                   zero_centered_gamma=opts["zero_centered_gamma"], **kw)
        else:  # the weight-first form
            call = lambda **kw: fusedloss.rms_norm(x, w, **opts, **kw)  # noqa: E731
        if with_residual:
            y, s = call(residual=r)
        else:
            y, s = call(), None
        y64, s64 = _rms_reference(x64, w64, r64, opts["eps"], opts["zero_centered_gamma"])
        assert y.shape == x.shape and y.dtype == x.dtype
        tol = max(TOL[dtype], TOL[w_dtype])
        _close(y, y64, tol, max(1.0, y64.abs().max().item() if y64.numel() else 1.0))
        if modify_output:  # as with torch's ops, a result may be modified in place
            y.mul_(2.0)
            y64 = y64 * 2.0
        up, up64 = _upstream(draw, y, gen)
        loss = up(y) + (s.float().sum() if s is not None else 0.0)
        if y64.requires_grad:
            y64.retain_grad()
        loss64 = up64(y64) + (s64.sum() if s is not None else 0.0)
        loss.backward()
        loss64.backward()
        # H = 1: dx = rstd dy gamma (1 - xhat^2) nearly cancels (xhat^2 = s^2 / (s^2 + eps)), so
        # x's gradient is measured against the size of its terms, not of the difference
        terms = 0.0
        if shape[-1] == 1 and y64.grad is not None and y64.numel():
            s_in = x64 if r64 is None else x64 + r64
            gamma = w64 + 1.0 if opts["zero_centered_gamma"] else w64
            rstd = (s_in.detach() ** 2 + opts["eps"]).rsqrt()
            terms = (y64.grad.abs() * gamma.detach().abs() * rstd).max().item()
        # the weight's gradient sums dy * xhat over rows, which may cancel (H = 1: xhat = +-1):
        # measured against the sum of its terms' sizes (over the positions a view repeats it at)
        wterms = 0.0
        if y64.grad is not None and y64.numel():
            s_in = (x64 if r64 is None else x64 + r64).detach()
            xhat = s_in * (s_in.pow(2).mean(-1, keepdim=True) + opts["eps"]).rsqrt()
            col = (y64.grad * (2.0 if modify_output else 1.0) * xhat).abs().reshape(-1, shape[-1]).sum(0)
            wterms = torch.autograd.grad((w64 * col).sum(), wbase64)[0].abs().max().item()
        for t, t0 in zip((base, wbase, rbase), before):
            assert torch.equal(t.detach(), t0), "the caller's tensor was written"
        for got, want, lay in ((base, base64, layout), (wbase, wbase64, w_layout), (rbase, rbase64, layout)):
            if got is None:
                continue
            gmax = want.grad.abs().max().item() if want.grad.numel() else 1.0
            if got is wbase:  # wterms already sums over the rows and the view's positions
                _close(got.grad, want.grad, tol, max(gmax, wterms) + 1e-6)
                continue
            _close(got.grad, want.grad, tol, max(gmax, terms) * _multiplicity(lay, shape) + 1e-6)

    check()


def _token_slices_case(rank, world, run, seed):
    """The sequence-parallel linear CE (dhidden_reduction="reduce_scatter") at TP = world: each
    rank's hidden slice and weight shard in a layout drawn for that rank (a leaf itself or a view
    of one), every dtype, the options and a loss_mask; sometimes one rank alone wrong (its slice
    one row longer, or another dtype), which every rank must raise the same error for. Every
    rank draws the same examples (derandomized, or one seed for all): the collectives pair."""
    import torch.distributed as dist
    from hypothesis import Phase, seed as hypothesis_seed
    from test_linear_cross_entropy import reference

    def per_rank(make):  # every rank builds every rank's tensors: the float64 reference needs them
        return [make(r) for r in range(world)]

    # no shrinking: a failing example raises on every rank (below), then stops
    run_settings = settings(RUNS[run], phases=(Phase.explicit, Phase.reuse, Phase.generate))

    @run_settings
    @hypothesis_seed(seed)
    @given(st.data())
    def check(data):
        # a failure on one rank raises on every rank: none is left waiting in a collective
        try:
            example(data.draw)
            failure = None
        except Exception as error:  # noqa: BLE001 (whatever fails, every rank must learn it)
            failure = f"rank {rank}: {type(error).__name__}: {error}"
        every = [None] * world
        dist.all_gather_object(every, failure)
        if any(every):
            raise AssertionError("\n".join(m for m in every if m))

    def example(draw):
        dtype = draw(st.sampled_from(DTYPES))
        n, H, V_local = draw(st.integers(0, 4)), draw(st.integers(1, 24)), draw(st.integers(1, 40))
        batch = draw(st.sampled_from([None, 1, 3]))  # [n, H] or Megatron's [s/tp, b, H]
        slice_shape = (n, H) if batch is None else (n, batch, H)
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        V = V_local * world
        reduction = draw(st.sampled_from(["none", "sum", "mean"]))
        opts = dict(reduction=reduction, label_smoothing=draw(st.sampled_from([0.0, 0.1])),
                    z_loss=draw(st.sampled_from([0.0, 1e-3])),
                    backward_mode="recompute" if dtype == torch.float16 else
                    draw(st.sampled_from(["auto", "recompute"])),
                    inplace_backward=draw(st.booleans()),
                    workspace_bytes=draw(st.sampled_from([None, 1])))
        h_layouts = per_rank(lambda r: _layout(draw, slice_shape))
        w_layouts = per_rank(lambda r: _layout(draw, (V_local, H)))
        steps = per_rank(lambda r: draw(st.integers(1, 8)))
        through = per_rank(lambda r: draw(st.booleans()))  # else a view of the leaf itself
        wrong = draw(st.sampled_from([None] * 6 + ["slice_rows", "dtype"]))
        h_leaves = per_rank(lambda r: leaf(h_layouts[r], slice_shape, dtype, DEVICE, gen, 1.0, steps[r]))
        w_leaves = per_rank(lambda r: leaf(w_layouts[r], (V_local, H), dtype, DEVICE, gen,
                                           2.0 / H ** 0.5, steps[r]))
        t = torch.randint(0, V, (n * world,) + (() if batch is None else (batch,)), generator=gen)
        t[torch.rand(t.shape, generator=gen) < 0.2] = -100
        t = t.to(DEVICE)
        # per-token losses reduced with a mask (Megatron's loss_func), the upstream gradient
        # c * mask: the in-forward backward (auto) weighted by it
        mask_base, mask = (_mask_input(draw, tuple(t.shape), gen)
                           if reduction == "none" and draw(st.booleans()) else (None, None))
        (base_h, view_h), (base_w, view_w) = h_leaves[rank], w_leaves[rank]
        h = view_h(base_h * 1 if through[rank] else base_h)
        w = view_w(base_w * 1 if through[rank] else base_w)
        if wrong == "slice_rows" and rank == 1:  # this rank alone: its target then covers
            h = torch.cat([h, h.new_zeros((1, *h.shape[1:]))])  # other tokens than its slices
        elif wrong == "dtype" and rank == 1:  # hidden and weight: the slices' dtype differs
            other = torch.float32 if dtype != torch.float32 else torch.bfloat16
            h, w = h.to(other), w.to(other)
        owned = [(x, x.detach().clone()) for x in (base_h, base_w, t, mask_base) if x is not None]
        failure = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss = fusedloss.linear_cross_entropy(h, w, t, tp_group=dist.group.WORLD,
                                                      dhidden_reduction="reduce_scatter",
                                                      loss_mask=mask, **opts)
        except ValueError as error:
            failure = str(error)
        every = [None] * world
        dist.all_gather_object(every, failure)
        if wrong is not None:  # one clear error, the same on every rank, nothing written
            assert failure is not None and all(m == failure for m in every), every
            assert "vocab-parallel" in failure and ("target: got shape" in failure or "dtype=" in failure), failure
            for x, before in owned:
                assert torch.equal(x.detach(), before)
            return
        assert all(m is None for m in every), every
        # float64 reference over every rank's slice and shard (the views of float64 bases)
        h64s = per_rank(lambda r: h_leaves[r][0].detach().double().cpu().requires_grad_(True))
        w64s = per_rank(lambda r: w_leaves[r][0].detach().double().cpu().requires_grad_(True))
        h64 = torch.cat([h_leaves[r][1](h64s[r]) for r in range(world)])
        w64 = torch.cat([w_leaves[r][1](w64s[r]) for r in range(world)])
        ref = reference(h64, w64, t.cpu(), **{k: v for k, v in opts.items()
                                                if k in ("reduction", "label_smoothing", "z_loss")})
        tol = LCE_TOL[dtype]
        _close(loss, ref, tol, max(1.0, ref.abs().max().item() if ref.numel() else 1.0))
        up, up64 = _lce_upstream(draw, loss, gen, mask)
        up(loss).backward()
        up64(ref).backward()
        for x, before in owned:
            assert torch.equal(x.detach(), before), "the caller's tensor was written"
        for base, base64, layout, shp, other in (
                (base_h, h64s[rank], h_layouts[rank], slice_shape, w64),
                (base_w, w64s[rank], w_layouts[rank], (V_local, H), h64)):
            assert base.grad.dtype == dtype and base.grad.shape == base.shape
            scale = max(base64.grad.abs().max().item() if base64.grad.numel() else 0.0,
                        other.detach().abs().max().item() if other.numel() else 0.0, 1e-6)
            _close(base.grad, base64.grad, tol, scale * _multiplicity(layout, shp) * max(shp))

    check()


@pytest.mark.parametrize("run", sorted(RUNS))
def test_linear_cross_entropy_token_slices_any_layout(run):
    from dist_util import run_world
    seed = 0 if run == "fixed" else int.from_bytes(os.urandom(4), "little")
    run_world(2, _token_slices_case, run, seed,
              backend="gloo-cuda" if DEVICE == "cuda" else "gloo", timeout_s=60)


@st.composite
def _log_probs_case(draw):
    H = draw(st.integers(1, 24))
    shape = _shape(draw, H)
    V = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    opts = dict(temperature=draw(st.sampled_from([1.0, 0.6, 1.7])),
                argmax=draw(st.booleans()),
                workspace_bytes=draw(st.sampled_from([None, 2 * 3 * ((V + 63) // 64 * 64) * 4])))
    return draw, shape, V, dtype, gen, opts


@pytest.mark.parametrize("run", sorted(RUNS))
def test_linear_log_probs_any_layout(run):
    """linear_log_probs over every layout, dtype, temperature, chunking, ignored and masked
    tokens, no_grad and autocast: log-probs, entropy and both gradients against float64, the
    caller's tensors unwritten."""
    from test_linear_log_probs import reference

    @RUNS[run]
    @given(_log_probs_case())
    def check(case):
        draw, shape, V, dtype, gen, opts = case
        (base_h, h, base_h64, h64, layout_h), (base_w, w, base_w64, w64, layout_w), t = \
            _head_inputs(draw, shape, V, dtype, gen)
        H = shape[-1]
        owned = [(x, x.detach().clone()) for x in (base_h, base_w, t)]
        mask = None
        if draw(st.booleans()):
            mask_base, mask = _mask_input(draw, shape[:-1], gen)
            owned.append((mask_base, mask_base.clone()))
        no_grad = draw(st.sampled_from([False, False, False, True]))
        autocast = dtype == torch.float32 and draw(st.booleans())
        with torch.no_grad() if no_grad else contextlib.nullcontext(), \
                torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=autocast):
            out = fusedloss.linear_log_probs(h, w, t, loss_mask=mask, **opts)
        t_ref = t.cpu().long() if mask is None else torch.where(mask.cpu() != 0, t.cpu().long(), -100)
        x64 = h64.cpu().reshape(-1, H)
        w_ref = w64.cpu()
        if autocast or dtype != torch.float32:  # the logits as the chunk buffer rounds them
            gdt = torch.bfloat16 if autocast else dtype
            x64 = x64.to(gdt).double()
            w_ref = w_ref.to(gdt).double()
        lp, ent, am = reference(x64, w_ref, t_ref, opts["temperature"])
        tol = LCE_TOL[torch.bfloat16 if autocast else dtype]
        assert out.log_probs.shape == t.shape and out.log_probs.dtype == torch.float32
        scale = max(1.0, lp.abs().max().item() if lp.numel() else 1.0)
        _close(out.log_probs.reshape(-1), lp, tol, scale / max(opts["temperature"], 1.0) * 4)
        _close(out.entropy.reshape(-1), ent, tol, max(1.0, math.log(max(V, 2))) * 4)
        assert (out.argmax is not None) == opts["argmax"]
        if no_grad:
            assert not out.log_probs.requires_grad
            for x, before in owned:
                assert torch.equal(x.detach(), before), "a tensor was written without a backward"
            return
        a = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        b = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        (out.log_probs * a.to(DEVICE, torch.float32) + out.entropy * b.to(DEVICE, torch.float32)).sum().backward()
        lp64, ent64, _ = reference(h64.cpu().reshape(-1, H), w64.cpu(), t_ref, opts["temperature"])
        (lp64 * a.reshape(-1) + ent64 * b.reshape(-1)).sum().backward()
        for x, before in owned:
            assert torch.equal(x.detach(), before), "the caller's tensor was written"
        for base, base64, layout, shp, other in ((base_h, base_h64, layout_h, shape, w64),
                                                 (base_w, base_w64, layout_w, (V, H), h64)):
            assert base.grad.dtype == dtype and base.grad.shape == base.shape
            scale = max(base64.grad.abs().max().item() if base64.grad.numel() else 0.0,
                        other.detach().abs().max().item() if other.numel() else 0.0, 1e-6)
            _close(base.grad, base64.grad, tol * 2, scale * _multiplicity(layout, shp) * max(shp)
                   * (a.abs().amax().item() + b.abs().amax().item() + 1 if a.numel() else 1.0)
                   / opts["temperature"])

    check()


@st.composite
def _distill_case(draw):
    H = draw(st.integers(1, 20))
    shape = _shape(draw, H)
    V = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    with_target = draw(st.booleans())
    opts = dict(divergence=draw(st.sampled_from(["forward_kl", "reverse_kl", "jsd"])),
                beta=draw(st.sampled_from([0.5, 0.2])),
                temperature=draw(st.sampled_from([1.0, 0.6, 1.7])),
                hard_label_weight=draw(st.sampled_from([0.0, 0.3])) if with_target else 0.0,
                reduction=draw(st.sampled_from(["mean", "sum", "none"])),
                workspace_bytes=draw(st.sampled_from([None, 2 * 3 * ((V + 63) // 64 * 64) * 4])),
                # auto: in_forward for a mean or a sum (the kept gradients scaled, in place or not)
                backward_mode=draw(st.sampled_from(["auto", "recompute"])),
                inplace_backward=draw(st.booleans()))
    return draw, shape, V, dtype, gen, with_target, opts


@pytest.mark.parametrize("run", sorted(RUNS))
def test_linear_distillation_any_layout(run):
    """linear_distillation_loss with the student's hidden states and weight in every layout and
    dtype, the teacher's (another width) in its own, targets or none, every divergence, option,
    backward mode and chunking: the loss and the student's gradients against float64, nothing
    of the caller's written."""
    from test_linear_distillation import reference

    @RUNS[run]
    @given(_distill_case())
    def check(case):
        draw, shape, V, dtype, gen, with_target, opts = case
        (base_h, h, base_h64, h64, layout_h), (base_w, w, base_w64, w64, layout_w), t = \
            _head_inputs(draw, shape, V, dtype, gen)
        Ht = draw(st.integers(1, 12))
        t_dtype = draw(st.sampled_from(DTYPES))
        _, th, *_ = _input(draw, (*shape[:-1], Ht), t_dtype, gen, 1.0)
        _, tw, *_ = _input(draw, (V, Ht), t_dtype, gen, 2.0 / Ht ** 0.5)
        th, tw = th.detach(), tw.detach()
        t = t if with_target else None
        owned = [(x, x.detach().clone()) for x in (base_h, base_w, th, tw) + ((t,) if with_target else ())]
        loss = fusedloss.linear_distillation_loss(h, w, th, tw, t, **opts)
        ref_opts = {k: v for k, v in opts.items()
                    if k not in ("workspace_bytes", "backward_mode", "inplace_backward")}
        t_ref = None if t is None else t.cpu().long()
        ref = reference(h64.cpu(), w64.cpu(), dtype, th.cpu(), tw.cpu(), t_ref, **ref_opts)
        assert loss.dtype == torch.float32 and loss.shape == ref.shape
        tol = LCE_TOL[dtype]
        _close(loss, ref, tol, max(1.0, ref.abs().max().item() if ref.numel() else 1.0))
        up, up64 = _upstream(draw, loss, gen)
        up(loss).backward()
        up64(ref).backward()
        for x, before in owned:
            assert torch.equal(x.detach(), before), "a tensor of the caller's was written"
        for base, base64, layout, shp, other in ((base_h, base_h64, layout_h, shape, w64),
                                                 (base_w, base_w64, layout_w, (V, shape[-1]), h64)):
            assert base.grad.dtype == dtype and base.grad.shape == base.shape
            scale = max(base64.grad.abs().max().item() if base64.grad.numel() else 0.0,
                        other.detach().abs().max().item() if other.numel() else 0.0, 1e-6)
            _close(base.grad, base64.grad, tol * 2, scale * _multiplicity(layout, shp) * max(shp)
                   / min(opts["temperature"], 1.0))

    check()

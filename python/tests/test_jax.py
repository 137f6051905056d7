"""fusedloss.jax: the JAX ops over XLA FFI against float64 jax.numpy references (every op and
option), their gradients (jax.test_util.check_grads where it fits), jit / vmap / grad
composition, vocab- and sequence-parallel under jax.shard_map at TP 2 and 4 (four CPU devices in
this process, or the GPUs where there are enough) against the unsharded result, and bad inputs
(the argument, the value, what was expected).

The arrays live on JAX's default device: where JAX has a GPU the whole suite runs the CUDA
handlers, and test_cuda_handlers_match_the_cpu compares them with the CPU's; elsewhere that test
skips, saying so."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="fusedloss.jax: jax is not installed")
if "jax_num_cpu_devices" in jax.config.values:  # four CPU devices for shard_map (before any use)
    try:
        jax.config.update("jax_num_cpu_devices", 4)
    except RuntimeError:  # the backends started already (another module used jax first)
        pass
elif "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=4").strip()
jax.config.update("jax_enable_x64", True)  # the float64 references; int64 targets
jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 GEMMs on GPUs (nor in the op)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import fusedloss.jax as fj  # noqa: E402  (a missing libfusedloss_jax fails here, loudly)

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
TOL = {F32: 2e-5, BF16: 2e-2, F16: 4e-3}  # relative to the reference's scale
_GPU = [d for d in jax.devices() if d.platform == "gpu"] if "CUDA" in fj.platforms else []
_CUDA = pytest.mark.skipif(not _GPU, reason="fusedloss.jax CUDA handlers: " + (
    "no GPU in this process" if "CUDA" in fj.platforms else "this build has no CUDA handlers"))


def _key(i):
    return jax.random.key(1000 + i)


def _close(got, want, dtype=F32, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    err = float(np.abs(got - want).max(initial=0.0))
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


# ---- float64 references ----

def ref_cross_entropy(x, t, ignore_index=-100, label_smoothing=0.0, smoothing_formula="pytorch",
                      reduction="mean", z_loss=0.0, logit_softcap=0.0):
    x = x.astype(jnp.float64)
    if logit_softcap:
        x = logit_softcap * jnp.tanh(x / logit_softcap)
    v = x.shape[-1]
    alpha = label_smoothing * (v / (v - 1) if smoothing_formula == "megatron" else 1.0)
    lse = jax.nn.logsumexp(x, -1)
    valid = t != ignore_index
    xt = jnp.take_along_axis(x, jnp.where(valid, t, 0)[..., None], -1)[..., 0]
    loss = (1 - alpha) * (lse - xt) + alpha * (lse - x.mean(-1)) + z_loss * lse ** 2
    loss = jnp.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / jnp.maximum(valid.sum(), 1)


def ref_linear_cross_entropy(h, w, t, **kw):
    return ref_cross_entropy(h.astype(jnp.float64) @ w.astype(jnp.float64).T, t, **kw)


def ref_rms_norm(x, w, eps=1e-5, zero_centered_gamma=False):
    x = x.astype(jnp.float64)
    g = w.astype(jnp.float64) + (1.0 if zero_centered_gamma else 0.0)
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * g


def ref_swiglu_gate_up(gate, up, bias=None, scale=None, clamp=None, m=1.0, d=1.0):
    """The two-tensor form with Falcon-H1's multipliers: silu(m (gate + b_g)) * (up + b_u) * d."""
    a, b = gate.astype(jnp.float64), up.astype(jnp.float64)
    if bias is not None:
        n = a.shape[-1]
        a, b = a + bias[:n].astype(jnp.float64), b + bias[n:].astype(jnp.float64)
    a = m * a
    if clamp is not None:
        a, b = jnp.minimum(a, clamp), jnp.clip(b, -clamp, clamp)
    out = jax.nn.silu(a) * b * d
    return out if scale is None else out * scale.astype(jnp.float64)


def ref_swiglu(y, bias=None, scale=None, clamp=None):
    y = y.astype(jnp.float64)
    if bias is not None:
        y = y + bias.astype(jnp.float64)
    n = y.shape[-1] // 2
    a, b = y[..., :n], y[..., n:]
    if clamp is not None:
        a, b = jnp.minimum(a, clamp), jnp.clip(b, -clamp, clamp)
    out = jax.nn.silu(a) * b
    return out if scale is None else out * scale.astype(jnp.float64)


def _loss_and_grads(f, args, reduction, argnums):
    """The loss and the gradients of sum(w * loss) (w: fixed row weights for 'none')."""
    def scalar(*a):
        loss = f(*a)
        if reduction == "none":
            loss = loss * jnp.linspace(0.5, 1.5, loss.size).reshape(loss.shape)
        return loss.sum()
    return f(*args), jax.grad(scalar, argnums)(*args)


def _targets(key, shape, v, ignore_every=5):
    t = jax.random.randint(key, shape, 0, v)
    flat = t.reshape(-1)
    return flat.at[::ignore_every].set(-100).reshape(shape)


# ---- imports ----

def test_the_packages_import_apart():
    """`import fusedloss` imports neither framework; fusedloss.jax imports no torch; the PyTorch
    ops still load on first use."""
    child = textwrap.dedent("""
        import sys
        import fusedloss
        assert "torch" not in sys.modules and "jax" not in sys.modules, "import fusedloss"
        import fusedloss.jax
        assert "torch" not in sys.modules, "import fusedloss.jax"
        assert callable(fusedloss.jax.cross_entropy)
        fusedloss.cross_entropy  # the PyTorch op: loads torch now
        assert "torch" in sys.modules and callable(fusedloss.cross_entropy)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_the_enums_are_the_cores():
    from fusedloss import _C
    from fusedloss.jax import _args
    assert _args.REDUCTIONS == {"none": int(_C.Reduction.NONE), "sum": int(_C.Reduction.SUM),
                                "mean": int(_C.Reduction.MEAN)}
    assert _args.FORMULAS == {"pytorch": int(_C.SmoothingFormula.PYTORCH),
                              "megatron": int(_C.SmoothingFormula.MEGATRON)}
    assert _args.SCOPES == {"global": int(_C.SmoothingScope.GLOBAL),
                            "partition": int(_C.SmoothingScope.PARTITION)}
    assert list(_args.DTYPES.values()) == [int(_C.DType.F32), int(_C.DType.F16), int(_C.DType.BF16)]


# ---- cross-entropy ----

@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1}, {"z_loss": 1e-3},
                                     {"label_smoothing": 0.2, "smoothing_formula": "megatron"},
                                     {"ignore_index": 7}])
def test_cross_entropy(reduction, options):
    x = jax.random.normal(_key(0), (24, 97), F32) * 2
    t = _targets(_key(1), (24,), 97)
    if options.get("ignore_index") == 7:  # a class id as the ignore value
        t = jnp.where(t < 0, 7, t).at[::4].set(7)
    kw = dict(options, reduction=reduction)
    loss, dx = _loss_and_grads(lambda x: fj.cross_entropy(x, t, **kw), (x,), reduction, 0)
    want, dwant = _loss_and_grads(lambda x: ref_cross_entropy(x, t, **kw), (x,), reduction, 0)
    assert loss.dtype == F32 and loss.shape == want.shape
    _close(loss, want, what="loss")
    _close(dx, dwant, what="dlogits")


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3}])
def test_cross_entropy_soft_cap(reduction, options):
    # c tanh(z / c) before everything else (Gemma 2's cap), in the same passes
    x = jax.random.normal(_key(4), (24, 97), F32) * 6
    t = _targets(_key(5), (24,), 97)
    kw = dict(options, reduction=reduction)
    loss, dx = _loss_and_grads(lambda x: fj.cross_entropy(x, t, logit_softcap=3.0, **kw), (x,),
                               reduction, 0)
    want, dwant = _loss_and_grads(lambda x: ref_cross_entropy(x, t, logit_softcap=3.0, **kw), (x,),
                                  reduction, 0)
    _close(loss, want, what="loss")
    _close(dx, dwant, what="dlogits")
    for bad in (-1.0, float("nan")):
        _raises("logit_softcap: got", fj.cross_entropy, x, t, logit_softcap=bad)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_cross_entropy_16_bit(dtype):
    x = (jax.random.normal(_key(2), (2, 8, 300), F32) * 3).astype(dtype)  # [s, b, V]
    t = _targets(_key(3), (2, 8), 300)
    loss, dx = _loss_and_grads(lambda x: fj.cross_entropy(x, t, label_smoothing=0.1), (x,), "mean", 0)
    want, dwant = _loss_and_grads(lambda x: ref_cross_entropy(x, t, label_smoothing=0.1), (x,), "mean", 0)
    assert dx.dtype == dtype and dx.shape == x.shape
    _close(loss, want, dtype, "loss")
    _close(dx, dwant, dtype, "dlogits")


def test_cross_entropy_check_grads():
    x = jax.random.normal(_key(4), (6, 11), F32)
    t = jnp.array([0, 3, 10, -100, 5, 5], jnp.int32)
    for reduction in ("none", "mean"):
        check_grads(lambda x: fj.cross_entropy(x, t, reduction=reduction, z_loss=0.01), (x,),
                    order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


def test_cross_entropy_any_integer_targets():
    x = jax.random.normal(_key(46), (5, 200), F32)
    t = jnp.array([0, 199, 7, 128, 255], jnp.int32)
    want = fj.cross_entropy(x, t, ignore_index=255)
    for dtype in (jnp.uint8, jnp.int16, jnp.int64, jnp.uint32):
        _close(fj.cross_entropy(x, t.astype(dtype), ignore_index=255), want, what=str(dtype))


def test_cross_entropy_no_counted_row_is_zero():
    x = jax.random.normal(_key(5), (4, 9), F32)
    t = jnp.full((4,), -100)
    loss, dx = jax.value_and_grad(lambda x: fj.cross_entropy(x, t))(x)
    assert float(loss) == 0.0 and not np.any(np.asarray(dx))


def test_cross_entropy_bad_target_raises_with_the_value():
    x = jax.random.normal(_key(6), (4, 9), F32)
    bad = r"target\[2\]: got 9, expected in \[0, 9\) or ignore_index"
    if jax.devices()[0].platform == "gpu":  # the row is NaN; the device's flag raises later,
        # naming the row and the value (the kernels know no vocabulary size to print)
        loss = jax.block_until_ready(fj.cross_entropy(x, jnp.array([0, 1, 9, 2]), reduction="none"))
        assert np.isnan(np.asarray(loss)[2])
        with pytest.raises(ValueError, match=r"target\[2\]: got 9, expected in \[0, vocab_global\)"):
            fj.check_device_errors()
        fj.check_device_errors()  # cleared once reported
        return
    with pytest.raises(Exception, match=bad):
        jax.block_until_ready(fj.cross_entropy(x, jnp.array([0, 1, 9, 2])))


# ---- linear cross-entropy ----

@pytest.mark.parametrize("reduction,mode", [("mean", "auto"), ("sum", "recompute"),
                                            ("none", "auto"), ("mean", "in_forward")])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3},
                                     {"logit_softcap": 3.0}])
def test_linear_cross_entropy(reduction, mode, options):
    h = jax.random.normal(_key(7), (40, 16), F32)
    w = jax.random.normal(_key(8), (70, 16), F32) * 0.4
    t = _targets(_key(9), (40,), 70)
    # a workspace of 9 rows of logits: several chunks, the last one short
    kw = dict(options, reduction=reduction)
    f = lambda h, w: fj.linear_cross_entropy(h, w, t, backward_mode=mode,  # noqa: E731
                                             workspace_bytes=9 * 70 * 4, **kw)
    ref_kw = {k: v for k, v in kw.items() if k != "logit_softcap"}
    ref = lambda h, w: ref_linear_cross_entropy(h, w, t, logit_softcap=options.get("logit_softcap", 0.0),  # noqa: E731
                                                **ref_kw)
    loss, (dh, dw) = _loss_and_grads(f, (h, w), reduction, (0, 1))
    want, (dhw, dww) = _loss_and_grads(ref, (h, w), reduction, (0, 1))
    _close(loss, want, what="loss")
    _close(dh, dhw, what="dhidden")
    _close(dw, dww, what="dweight")
    # not differentiated: the forward alone, the same loss
    _close(jax.jit(f)(h, w), want, what="forward alone")


@pytest.mark.parametrize("dtype", [BF16, F16])  # float16: the recompute backward ("auto")
def test_linear_cross_entropy_16_bit_3d(dtype):
    h = jax.random.normal(_key(10), (4, 6, 32), F32).astype(dtype)
    w = (jax.random.normal(_key(11), (50, 32), F32) * 0.2).astype(dtype)
    t = _targets(_key(12), (4, 6), 50)
    loss, (dh, dw) = _loss_and_grads(lambda h, w: fj.linear_cross_entropy(h, w, t), (h, w), "mean", (0, 1))
    want, (dhw, dww) = _loss_and_grads(lambda h, w: ref_linear_cross_entropy(h, w, t), (h, w), "mean", (0, 1))
    assert dh.dtype == dtype and dh.shape == h.shape and dw.dtype == dtype
    _close(loss, want, dtype, "loss")
    _close(dh, dhw, dtype, "dhidden")
    _close(dw, dww, dtype, "dweight")


@pytest.mark.parametrize("mode, reduction", [("in_forward", "mean"), ("recompute", "mean"),
                                             ("recompute", "none")])
def test_linear_cross_entropy_dweight_accumulation(mode, reduction):
    # bf16, 24 token chunks: an fp32 sum is the float64 gradient rounded once to bf16; the
    # weight-dtype sum rounds once per pair of chunks
    h = jax.random.normal(_key(150), (192, 32), F32).astype(BF16)
    w = (jax.random.normal(_key(151), (80, 32), F32) * 0.2).astype(BF16)
    t = _targets(_key(152), (192,), 80)
    kw = dict(reduction=reduction, backward_mode=mode, workspace_bytes=8 * 80 * 4 * 2)
    want = jax.grad(lambda w: jnp.sum(ref_linear_cross_entropy(h, w, t, reduction=reduction) *
                                      (1.0 if reduction == "mean" else 0.01)))(w.astype(jnp.float64))
    errors = {}
    for accumulation in ("fp32", "weight_dtype", "auto"):
        dw = jax.jit(jax.grad(lambda w: jnp.sum(fj.linear_cross_entropy(
            h, w, t, dweight_accumulation=accumulation, **kw) *
            (1.0 if reduction == "mean" else 0.01))))(w)
        assert dw.dtype == BF16
        errors[accumulation] = float(np.abs(np.asarray(dw, np.float64) - np.asarray(want)).max())
        if accumulation == "fp32":  # one rounding: half a bf16 ulp of the largest entry
            _close(dw, want, BF16, "fp32 dweight")
            scale = float(np.abs(np.asarray(want)).max())
            assert errors["fp32"] <= scale * 2.0 ** -8, (errors, scale)
        if accumulation == "auto":  # a 16-bit weight: its own dtype, as the PyTorch op's
            np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw_wd))
        dw_wd = dw
    assert errors["fp32"] <= errors["weight_dtype"], errors


def test_dweight_accumulation_fp32_weight_and_vocab_parallel():
    h = jax.random.normal(_key(153), (16, 12), F32)
    w = jax.random.normal(_key(154), (64, 12), F32) * 0.3
    t = _targets(_key(155), (16,), 64)
    grads = [jax.grad(lambda w: fj.linear_cross_entropy(h, w, t, dweight_accumulation=a))(w)
             for a in ("auto", "fp32", "weight_dtype")]  # an fp32 weight sums in fp32 anyway
    for g in grads[1:]:
        np.testing.assert_array_equal(np.asarray(g), np.asarray(grads[0]))
    mesh = _mesh(2)
    hb, wb = h.astype(BF16), w.astype(BF16)
    body = lambda h, w, t: fj.linear_cross_entropy(  # noqa: E731
        h, w, t, axis_name="tp", dweight_accumulation="fp32", workspace_bytes=4 * 32 * 4)
    sharded = _shard_map(body, mesh, (P(), P("tp"), P()), P())
    with _on(mesh):
        dh, dw = jax.jit(jax.grad(lambda h, w: sharded(h, w, t), (0, 1)))(
            _put(mesh, hb, P()), _put(mesh, wb, P("tp")))
    want = jax.grad(lambda h, w: ref_linear_cross_entropy(h, w, t), (0, 1))(
        hb.astype(jnp.float64), wb.astype(jnp.float64))
    _close(dh, want[0], BF16, "dhidden")
    _close(dw, want[1], BF16, "dweight")


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape", [(40,), (8, 5)])
def test_linear_cross_entropy_loss_mask(dtype, shape):
    # Megatron's loss_func: c * sum(mask * loss), the in-forward backward finding c
    h = jax.random.normal(_key(160), (*shape, 16), F32).astype(dtype)
    w = (jax.random.normal(_key(161), (48, 16), F32) * 0.4).astype(dtype)
    t = _targets(_key(162), shape, 48)
    mask = jax.random.bernoulli(_key(163), 0.6, shape).astype(jnp.int32)
    c = 1.0 / 37

    def loss_func(op):
        return lambda h, w: c * jnp.sum(mask * op(h, w))
    masked = lambda h, w: fj.linear_cross_entropy(  # noqa: E731
        h, w, t, reduction="none", loss_mask=mask, workspace_bytes=3 * 48 * 4 * 2)
    loss, grads = jax.jit(jax.value_and_grad(loss_func(masked), (0, 1)))(h, w)
    want, wgrads = jax.value_and_grad(loss_func(
        lambda h, w: ref_linear_cross_entropy(h, w, t, reduction="none")), (0, 1))(
        h.astype(jnp.float64), w.astype(jnp.float64))
    _close(loss, want, dtype, "loss")
    for got, ref, name in zip(grads, wgrads, ("dhidden", "dweight")):
        assert got.dtype == dtype
        _close(got, ref, dtype, name)
    # the returned loss is not masked; recompute takes the mask's place for any upstream gradient
    per_token = masked(h, w)
    _close(per_token, ref_linear_cross_entropy(h, w, t, reduction="none"), dtype, "per-token loss")
    recomputed = jax.grad(loss_func(lambda h, w: fj.linear_cross_entropy(
        h, w, t, reduction="none", loss_mask=mask, backward_mode="recompute")), (0, 1))(h, w)
    for got, ref, name in zip(recomputed, wgrads, ("dhidden", "dweight")):
        _close(got, ref, dtype, f"recompute {name}")
    # vmap: each element its own c
    hs = jnp.stack([h, h * 0.5])
    dhs = jax.vmap(jax.grad(loss_func(masked)))(hs, jnp.stack([w, w]))
    _close(dhs[1], jax.grad(loss_func(lambda h, w: ref_linear_cross_entropy(
        h, w, t, reduction="none")))(h.astype(jnp.float64) * 0.5, w.astype(jnp.float64)),
        dtype, "vmapped dhidden")


def test_linear_cross_entropy_loss_mask_needs_a_proportional_upstream_gradient():
    h = jax.random.normal(_key(164), (12, 8), F32)
    w = jax.random.normal(_key(165), (20, 8), F32)
    t = _targets(_key(166), (12,), 20)
    mask = jnp.arange(12) % 3 != 0
    g = jax.random.normal(_key(167), (12,), F32)  # not c * mask
    f = lambda h: jnp.sum(g * fj.linear_cross_entropy(h, w, t, reduction="none",  # noqa: E731
                                                      loss_mask=mask))
    if jax.devices()[0].platform == "gpu":  # CUDA: NaN gradients, named by check_device_errors
        assert np.isnan(np.asarray(jax.grad(f)(h))).all()
        _raises("", fj.check_device_errors)
    else:
        _raises(r"grad_loss\[0\]: got .* expected c \* row_weight", lambda: jax.block_until_ready(
            jax.grad(f)(h)), error=Exception)
    # a 'sum' or 'mean' takes no mask; nor does a class weight
    _raises(r"loss_mask: got an array with reduction='mean', expected reduction='none'",
            fj.linear_cross_entropy, h, w, t, loss_mask=mask)
    _raises(r"loss_mask: got shape \(11,\), expected target's shape \(12,\)",
            fj.linear_cross_entropy, h, w, t, reduction="none", loss_mask=mask[:-1])
    _raises(r"loss_mask\.dtype: got complex64, expected a real dtype", fj.linear_cross_entropy,
            h, w, t, reduction="none", loss_mask=mask.astype(jnp.complex64))
    _raises(r"loss_mask: got an array with class_weight", fj.linear_cross_entropy, h, w, t,
            reduction="none", loss_mask=mask, class_weight=jnp.ones(20))


def test_vocab_parallel_loss_mask_recomputes():
    mesh = _mesh(2)
    h = jax.random.normal(_key(168), (16, 12), F32)
    w = jax.random.normal(_key(169), (64, 12), F32) * 0.3
    t = _targets(_key(170), (16,), 64)
    mask = jnp.arange(16) % 4 != 1
    body = lambda h, w, t, m: fj.linear_cross_entropy(  # noqa: E731
        h, w, t, reduction="none", loss_mask=m, axis_name="tp")
    sharded = _shard_map(body, mesh, (P(), P("tp"), P(), P()), P())
    step = lambda f: jax.grad(lambda h, w: jnp.sum(mask * f(h, w)) / 9, (0, 1))  # noqa: E731
    with _on(mesh):
        got = jax.jit(step(lambda h, w: sharded(h, w, t, mask)))(
            _put(mesh, h, P()), _put(mesh, w, P("tp")))
    want = step(lambda h, w: ref_linear_cross_entropy(h, w, t, reduction="none"))(
        h.astype(jnp.float64), w.astype(jnp.float64))
    _close(got[0], want[0], F32, "dhidden")
    _close(got[1], want[1], F32, "dweight")


def test_linear_cross_entropy_check_grads():
    h = jax.random.normal(_key(13), (5, 4), F32)
    w = jax.random.normal(_key(14), (7, 4), F32)
    t = jnp.array([0, 6, -100, 3, 3])
    for mode in ("in_forward", "recompute"):
        check_grads(lambda h, w: fj.linear_cross_entropy(h, w, t, backward_mode=mode), (h, w),
                    order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


# ---- the log-prob head ----

def ref_log_probs(h, w, t, temperature=1.0, ignore_index=-100):
    """float64 (log_probs, entropy, argmax) per row; ignored rows give 0 and 0."""
    y = (h.astype(jnp.float64) @ w.astype(jnp.float64).T) / temperature
    logp = jax.nn.log_softmax(y, -1)
    keep = t != ignore_index
    lp = jnp.take_along_axis(logp, jnp.where(keep, t, 0)[..., None], -1)[..., 0]
    ent = -(jnp.exp(logp) * logp).sum(-1)
    return jnp.where(keep, lp, 0.0), jnp.where(keep, ent, 0.0), y.argmax(-1)


def _lp_problem(i, shape=(37,), H=24, V=203, dtype=F32):
    h = jax.random.normal(_key(i), (*shape, H), F32).astype(dtype)
    w = (jax.random.normal(_key(i + 1), (V, H), F32) * 2.0 / H ** 0.5).astype(dtype)
    return h, w, _targets(_key(i + 2), shape, V)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", [(37,), (5, 3)])
def test_linear_log_probs(dtype, temperature, shape):
    h, w, t = _lp_problem(60, shape, dtype=dtype)
    out = jax.jit(lambda h, w: fj.linear_log_probs(h, w, t, temperature=temperature,
                                                   argmax=True))(h, w)
    lp, ent, am = ref_log_probs(h, w, t, temperature)
    assert out.log_probs.shape == out.entropy.shape == out.argmax.shape == t.shape
    _close(out.log_probs, lp, dtype, "log_probs")
    _close(out.entropy, ent, dtype, "entropy")
    if dtype == F32:  # 16-bit logits may tie or swap near-equal maxima
        assert np.array_equal(np.asarray(out.argmax), np.asarray(am))
    a = jax.random.normal(_key(70), t.shape, F32)
    b = jax.random.normal(_key(71), t.shape, F32)

    def objective(fn):  # a clipped-ratio loss and an entropy bonus both differentiate through
        return lambda h, w: (a * fn(h, w)[0] + b * fn(h, w)[1]).sum()
    ours = jax.grad(objective(lambda h, w: fj.linear_log_probs(h, w, t, temperature=temperature)),
                    (0, 1))(h, w)
    refs = jax.grad(objective(lambda h, w: ref_log_probs(h, w, t, temperature)[:2]), (0, 1))(
        h.astype(jnp.float64), w.astype(jnp.float64))
    for got, want, name in zip(ours, refs, ("dhidden", "dweight")):
        assert got.dtype == dtype
        _close(got, want, dtype, name)


def test_linear_log_probs_mask_and_options():
    h, w, t = _lp_problem(80)
    mask = jax.random.bernoulli(_key(83), 0.7, t.shape)
    out = fj.linear_log_probs(h, w, t, loss_mask=mask, workspace_bytes=2 * 3 * 208 * 4)
    lp, ent, _ = ref_log_probs(h, w, jnp.where(mask, t, -100))
    _close(out.log_probs, lp, F32, "log_probs")
    _close(out.entropy, ent, F32, "entropy")
    assert out.argmax is None
    assert fj.linear_log_probs(h, w, t, entropy=False).entropy is None
    dh = jax.grad(lambda h: fj.linear_log_probs(h, w, t, loss_mask=mask).log_probs.sum())(h)
    ignored = np.asarray(~mask | (t == -100))
    assert not np.asarray(dh)[ignored].any()
    # vmap: each element its own problem
    hs = jnp.stack([h, h * 0.5])
    got = jax.vmap(lambda h: fj.linear_log_probs(h, w, t).log_probs)(hs)
    _close(got[1], ref_log_probs(h * 0.5, w, t)[0], F32, "vmapped log_probs")


def test_linear_log_probs_bad_inputs():
    h, w, t = _lp_problem(90)
    for bad in (0.0, -1.0, float("inf")):
        _raises("temperature: got", fj.linear_log_probs, h, w, t, temperature=bad)
    _raises(r"weight: got shape \(203, 23\), expected \[V_local, 24\]", fj.linear_log_probs,
            h, w[:, :23], t)
    _raises("weight.dtype: got bfloat16, expected float32", fj.linear_log_probs, h,
            w.astype(BF16), t)
    _raises(r"tokens: got shape \(36,\), expected \(37,\) \(hidden's shape without the hidden "
            r"dim\)", fj.linear_log_probs, h, w, t[:-1])
    _raises(r"tokens\.dtype: got float32, expected an integer dtype", fj.linear_log_probs, h, w,
            t.astype(F32))
    _raises(r"loss_mask: got shape \(36,\), expected tokens' shape \(37,\)", fj.linear_log_probs,
            h, w, t, loss_mask=t[:-1])
    _raises(r"loss_mask\.dtype: got complex64, expected a real dtype", fj.linear_log_probs, h, w,
            t, loss_mask=t.astype(jnp.complex64))
    _raises("sequence_parallel: got True without axis_name", fj.linear_log_probs, h, w, t,
            sequence_parallel=True)
    if jax.devices()[0].platform != "gpu":  # CUDA checks tokens in flight: the row is NaN
        _raises(r"tokens\[5\]: got 203, expected in \[0, 203\)",
                lambda: jax.block_until_ready(fj.linear_log_probs(h, w, t.at[5].set(203))),
                error=Exception)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("sharded", [False, True])
def test_z_loss_apart(reduction, sharded):
    # z_loss * lse^2 of the counted rows, reduced as the loss; detached; the loss unchanged
    x = jax.random.normal(_key(120), (16, 64), F32) * 2
    t = _targets(_key(121), (16,), 64)
    h = jax.random.normal(_key(122), (16, 12), F32)
    w = jax.random.normal(_key(123), (64, 12), F32) * 0.3
    kw = dict(reduction=reduction, z_loss=1e-2, return_z_loss=True)
    ops = {"cross_entropy": lambda x, w, **k: fj.cross_entropy(x, t, **k),  # (w unused)
           "linear": lambda h, w, **k: fj.linear_cross_entropy(h, w, t, **k)}
    lse = {"cross_entropy": jax.nn.logsumexp(x.astype(jnp.float64), -1),
           "linear": jax.nn.logsumexp(h.astype(jnp.float64) @ w.astype(jnp.float64).T, -1)}
    counted = t != -100
    for name, op in ops.items():
        arg = x if name == "cross_entropy" else h
        if sharded:
            mesh = _mesh(2)
            spec = (P(None, "tp"), P()) if name == "cross_entropy" else (P(), P("tp"))
            body = _shard_map(lambda a, w: tuple(op(a, w, axis_name="tp", **kw))[:2], mesh, spec,
                              (P(), P()))
            with _on(mesh):
                out = body(_put(mesh, arg, spec[0]), _put(mesh, w, spec[1]))
        else:
            out = tuple(op(arg, w, **kw))[:2]
        part = np.where(np.asarray(counted), 1e-2 * np.asarray(lse[name]) ** 2, 0.0)
        want = part if reduction == "none" else part.sum() if reduction == "sum" else \
            part.sum() / np.asarray(counted).sum()
        _close(out[1], want, what=f"{name} z_loss")
        plain = op(arg, w, reduction=reduction, z_loss=1e-2)
        _close(out[0], plain, what=f"{name} loss")
    g = jax.grad(lambda x: fj.cross_entropy(x, t, z_loss=1e-2, return_z_loss=True).z_loss)(x)
    assert not np.asarray(g).any()  # detached


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("tp, sequence_parallel, check_vma", [
    (1, False, True), (2, False, True), (2, False, False), (4, False, True), (2, True, True),
    (2, True, False)])
def test_token_accuracy_and_predicted_tokens(reduction, tp, sequence_parallel, check_vma):
    # the arg-max of float64 logits (a tie across shards: the smallest id), the accuracy reduced
    # as the loss, -1 and 0 on ignored rows; the loss unchanged
    x = jax.random.normal(_key(190), (16, 64), F32) * 2
    x = x.at[3, 5].set(9.0).at[3, 37].set(9.0)  # a tie in shard 0 and shard 1 (and 2 of 4)
    h = jax.random.normal(_key(192), (16, 12), F32)
    w = jax.random.normal(_key(193), (64, 12), F32) * 0.4
    t = _targets(_key(191), (16,), 64).at[2].set(int(jnp.argmax(x[2]))).at[7].set(
        int(jnp.argmax(h[7].astype(jnp.float64) @ w.astype(jnp.float64).T)))  # a hit for each
    kw = dict(reduction=reduction, return_token_accuracy=True, return_predicted_tokens=True,
              logit_softcap=3.0)
    ops = {"cross_entropy": (x, lambda a, w, **k: fj.cross_entropy(a, t, **k)),
           "linear": (h, lambda a, w, **k: fj.linear_cross_entropy(a, w, t, **k))}
    for name, (arg, op) in ops.items():
        if name == "cross_entropy" and sequence_parallel:
            continue  # (the linear head's option)
        if tp == 1:
            out = op(arg, w, **kw)
        else:
            mesh = _mesh(tp)
            extra = dict(sequence_parallel=True) if sequence_parallel else {}
            spec = (P(None, "tp"), P()) if name == "cross_entropy" else \
                (P("tp") if sequence_parallel else P(), P("tp"))
            body = _shard_map(lambda a, w: tuple(op(a, w, axis_name="tp", **extra, **kw)), mesh,
                              spec, (P(),) * 4, check_vma)
            with _on(mesh):
                out = fj.CrossEntropyOutput(*body(_put(mesh, arg, spec[0]), _put(mesh, w, spec[1])))
        logits = x.astype(jnp.float64) if name == "cross_entropy" else \
            h.astype(jnp.float64) @ w.astype(jnp.float64).T
        counted = np.asarray(t != -100)
        predicted = np.asarray(jnp.argmax(logits, -1))
        if name == "cross_entropy":
            assert predicted[3] == 5
        np.testing.assert_array_equal(np.asarray(out.predicted_tokens),
                                      np.where(counted, predicted, -1), err_msg=name)
        hits = (counted & (predicted == np.asarray(t))).astype(np.float64)
        assert hits.sum() >= 1
        want = hits if reduction == "none" else hits.sum() if reduction == "sum" else \
            hits.sum() / counted.sum()
        _close(out.token_accuracy, want, what=f"{name} token_accuracy")
        assert out.z_loss is None
        plain = op(arg, w, reduction=reduction, logit_softcap=3.0)
        _close(out.loss, plain, what=f"{name} loss")


def test_token_extras_options_and_shapes():
    x = jax.random.normal(_key(194), (4, 3, 20), F32)
    t = _targets(_key(195), (4, 3), 20)
    out = jax.jit(lambda x: fj.cross_entropy(x, t, return_predicted_tokens=True))(x)
    assert out.predicted_tokens.shape == t.shape and out.token_accuracy is None
    g = jax.grad(lambda x: fj.cross_entropy(x, t, return_token_accuracy=True).loss)(x)
    _close(g, jax.grad(lambda x: fj.cross_entropy(x, t))(x), what="dlogits")
    _raises(r"return_token_accuracy: got 'yes' \(str\), expected True or False",
            fj.cross_entropy, x, t, return_token_accuracy="yes", error=TypeError)
    # with a class weight: the weighted loss, the accuracy unweighted (as the PyTorch op's)
    cw = jax.random.uniform(_key(196), (20,), F32, 0.5, 2.0)
    h = jax.random.normal(_key(197), (4, 3, 8), F32)
    w = jax.random.normal(_key(198), (20, 8), F32)
    for logits, out in ((x, fj.cross_entropy(x, t, weight=cw, label_smoothing=0.1,
                                             return_token_accuracy=True,
                                             return_predicted_tokens=True)),
                        (h @ w.T, fj.linear_cross_entropy(h, w, t, class_weight=cw,
                                                          label_smoothing=0.1,
                                                          return_token_accuracy=True,
                                                          return_predicted_tokens=True))):
        counted = np.asarray(t != -100)
        predicted = np.asarray(jnp.argmax(logits.astype(jnp.float64), -1))
        np.testing.assert_array_equal(np.asarray(out.predicted_tokens),
                                      np.where(counted, predicted, -1))
        hits = counted & (predicted == np.asarray(t))
        _close(out.token_accuracy, hits.sum() / counted.sum(), what="token_accuracy")
        _close(out.loss, ref_weighted_cross_entropy(logits, t, cw, label_smoothing=0.1),
               what="weighted loss")


# ---- a per-class weight ----

def ref_weighted_cross_entropy(x, t, w, label_smoothing=0.0, reduction="mean", ignore_index=-100):
    """torch's F.cross_entropy(weight=w, label_smoothing=eps) in float64 jnp."""
    x, w = x.astype(jnp.float64), w.astype(jnp.float64)
    logp = jax.nn.log_softmax(x, -1)
    valid = t != ignore_index
    safe = jnp.where(valid, t, 0)
    r = jnp.where(valid, w[safe], 0.0)
    nll = -jnp.take_along_axis(logp, safe[..., None], -1)[..., 0] * r
    smooth = jnp.where(valid, -(logp * w).sum(-1), 0.0)
    loss = (1 - label_smoothing) * nll + label_smoothing / x.shape[-1] * smooth
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / r.sum()


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_class_weight(reduction, label_smoothing):
    x = jax.random.normal(_key(110), (24, 97), F32) * 2
    t = _targets(_key(111), (24,), 97)
    w = jax.random.uniform(_key(112), (97,), F32, 0.25, 1.5).at[t[1]].set(0.0)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    loss, dx = _loss_and_grads(lambda x: fj.cross_entropy(x, t, weight=w, **kw), (x,), reduction, 0)
    want, dwant = _loss_and_grads(lambda x: ref_weighted_cross_entropy(x, t, w, **kw), (x,),
                                  reduction, 0)
    _close(loss, want, what="loss")
    _close(dx, dwant, what="dlogits")
    h = jax.random.normal(_key(113), (24, 16), F32)
    hw = jax.random.normal(_key(114), (97, 16), F32) * 0.3
    loss, (dh, dw) = _loss_and_grads(
        lambda h, hw: fj.linear_cross_entropy(h, hw, t, class_weight=w, **kw), (h, hw), reduction,
        (0, 1))
    want, (dhw, dww) = _loss_and_grads(
        lambda h, hw: ref_weighted_cross_entropy(h.astype(jnp.float64) @ hw.astype(jnp.float64).T,
                                                 t, w, **kw), (h, hw), reduction, (0, 1))
    _close(loss, want, what="linear loss")
    _close(dh, dhw, what="dhidden")
    _close(dw, dww, what="dweight")
    _raises(r"weight: got float32 \(96,\), expected a floating-point \[97\]", fj.cross_entropy,
            x, t, weight=w[1:])
    _raises("class_weight: got an array with label_smoothing=0.1 and z_loss set",
            fj.linear_cross_entropy, h, hw, t, class_weight=w, label_smoothing=0.1, z_loss=1e-3)


# ---- the distillation loss ----

def ref_distillation(sh, sw, th, tw, t, dtype, divergence="forward_kl", beta=0.5,
                     temperature=1.0, hard_label_weight=0.0, reduction="mean", ignore_index=-100):
    """float64 from the definitions; the student's logits rounded to `dtype` (a straight-through
    gradient), the teacher's to its own dtype, as the chunk buffers hold them."""
    f64 = jnp.float64
    z = sh.astype(f64) @ sw.astype(f64).T
    z = z + jax.lax.stop_gradient(z.astype(dtype).astype(f64) - z)
    zt = (th.astype(f64) @ tw.astype(f64).T).astype(th.dtype).astype(f64)
    lq, lp = jax.nn.log_softmax(z / temperature, -1), jax.nn.log_softmax(zt / temperature, -1)
    q, p = jnp.exp(lq), jnp.exp(lp)
    if divergence == "forward_kl":
        soft = (p * (lp - lq)).sum(-1)
    elif divergence == "reverse_kl":
        soft = (q * (lq - lp)).sum(-1)
    else:
        lm = jnp.log(beta * p + (1 - beta) * q)
        soft = beta * (p * (lp - lm)).sum(-1) + (1 - beta) * (q * (lq - lm)).sum(-1)
    loss = (1 - hard_label_weight) * soft
    counted = jnp.ones(soft.shape, bool) if t is None else t != ignore_index
    if hard_label_weight:
        lz = jax.nn.log_softmax(z, -1)
        loss = loss - hard_label_weight * jnp.take_along_axis(
            lz, jnp.where(counted, t, 0)[..., None], -1)[..., 0]
    loss = jnp.where(counted, loss, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / jnp.maximum(counted.sum(), 1)


def _distill_problem(i, shape=(23,), Hs=16, Ht=12, V=41, dtype=F32, teacher_dtype=F32):
    sh = jax.random.normal(_key(i), (*shape, Hs), F32).astype(dtype)
    sw = (jax.random.normal(_key(i + 1), (V, Hs), F32) * 0.5).astype(dtype)
    th = jax.random.normal(_key(i + 2), (*shape, Ht), F32).astype(teacher_dtype)
    tw = (jax.random.normal(_key(i + 3), (V, Ht), F32) * 0.5).astype(teacher_dtype)
    return sh, sw, th, tw, _targets(_key(i + 4), shape, V)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_distillation_loss(divergence, dtype, reduction):
    sh, sw, th, tw, t = _distill_problem(300, dtype=dtype)
    opts = dict(divergence=divergence, beta=0.3, temperature=1.5, hard_label_weight=0.2,
                reduction=reduction)
    up = jax.random.uniform(_key(310), t.shape, F32) + 0.5

    def objective(fn):
        return lambda a, b: (fn(a, b) * (up if reduction == "none" else 1.0)).sum()
    ours = jax.jit(jax.value_and_grad(objective(
        lambda a, b: fj.linear_distillation_loss(a, b, th, tw, t, **opts)), (0, 1)))(sh, sw)
    refs = jax.value_and_grad(objective(
        lambda a, b: ref_distillation(a, b, th, tw, t, dtype, **opts)), (0, 1))(
        sh.astype(jnp.float64), sw.astype(jnp.float64))
    _close(ours[0], refs[0], dtype, "loss")
    for got, want, name in zip(ours[1], refs[1], ("dhidden", "dweight")):
        assert got.dtype == dtype
        _close(got, want, dtype, name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_linear_distillation_backward_modes_agree(reduction, divergence):
    """in_forward (the default for a mean or a sum: the forward runs the gradient GEMMs) and
    recompute give the same loss and gradients, both equal to float64's."""
    sh, sw, th, tw, t = _distill_problem(340)
    opts = dict(divergence=divergence, beta=0.3, temperature=1.3, hard_label_weight=0.2,
                reduction=reduction)
    # 1.7 x the loss: the backward must scale the kept gradients by the cotangent
    runs = {mode: jax.jit(jax.value_and_grad(
        lambda a, b, m=mode: 1.7 * fj.linear_distillation_loss(a, b, th, tw, t, backward_mode=m,
                                                               **opts), (0, 1)))(sh, sw)
            for mode in ("in_forward", "recompute", "auto")}
    want = jax.value_and_grad(lambda a, b: 1.7 * ref_distillation(a, b, th, tw, t, F32, **opts),
                              (0, 1))(sh.astype(jnp.float64), sw.astype(jnp.float64))
    for mode, (loss, grads) in runs.items():
        _close(loss, want[0], F32, f"{mode} loss")
        for got, ref, name in zip(grads, want[1], ("dhidden", "dweight")):
            _close(got, ref, F32, f"{mode} {name}")
    assert 1.7 * float(fj.linear_distillation_loss(sh, sw, th, tw, t, **opts)) == pytest.approx(
        float(runs["in_forward"][0]), rel=1e-6)  # the undifferentiated call: the same loss
    _raises(r"backward_mode: got 'in_forward' with reduction='none'", fj.linear_distillation_loss,
            sh, sw, th, tw, t, reduction="none", backward_mode="in_forward")
    _raises(r"backward_mode: got 'sometimes', expected one of", fj.linear_distillation_loss,
            sh, sw, th, tw, t, backward_mode="sometimes")


def test_linear_distillation_loss_without_target_and_the_teacher_constant():
    sh, sw, th, tw, _ = _distill_problem(320, shape=(3, 5), teacher_dtype=BF16)
    loss, grads = jax.value_and_grad(
        lambda a, b, c, d: fj.linear_distillation_loss(a, b, c, d, divergence="reverse_kl"),
        (0, 1, 2, 3))(sh, sw, th, tw)
    want = ref_distillation(sh.astype(jnp.float64), sw.astype(jnp.float64), th, tw, None, F32,
                            divergence="reverse_kl")
    _close(loss, want, F32, "loss")
    assert not np.asarray(grads[2]).any() and not np.asarray(grads[3]).any()
    _raises(r"hard_label_weight: got 0\.5 without a target", fj.linear_distillation_loss,
            sh, sw, th, tw, None, hard_label_weight=0.5)
    _raises(r"divergence: got 'kl', expected one of", fj.linear_distillation_loss,
            sh, sw, th, tw, divergence="kl")
    _raises(r"teacher_weight: got 40 rows, expected 41", fj.linear_distillation_loss,
            sh, sw, th, tw[:40])
    _raises(r"beta: got 0\.0, expected a value in \(0, 1\)", fj.linear_distillation_loss,
            sh, sw, th, tw, divergence="jsd", beta=0.0)


# ---- RMSNorm ----

@pytest.mark.parametrize("dtype,w_dtype", [(F32, F32), (BF16, BF16), (BF16, F32), (F32, BF16),
                                           (F16, jnp.float64)])
@pytest.mark.parametrize("options", [{}, {"eps": 1e-3, "zero_centered_gamma": True}, {"eps": None}])
def test_rms_norm(dtype, w_dtype, options):
    x = jax.random.normal(_key(15), (3, 5, 48), F32).astype(dtype)
    w = jax.random.uniform(_key(16), (48,), F32, 0.5, 1.5).astype(w_dtype)
    kw = dict(options)
    ref_kw = dict(kw, eps=float(np.finfo(np.float32).eps) if kw.get("eps", 1) is None else kw.get("eps", 1e-5))
    f = lambda x, w: fj.rms_norm(x, w, **kw)  # noqa: E731
    y = f(x, w)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, ref_rms_norm(x, w, **ref_kw), dtype, "y")
    g = jax.random.normal(_key(17), x.shape, F32).astype(dtype)
    dx, dw = jax.grad(lambda x, w: jnp.sum(f(x, w).astype(F32) * g), (0, 1))(x, w)
    dxr, dwr = jax.grad(lambda x, w: jnp.sum(ref_rms_norm(x, w, **ref_kw) * g), (0, 1))(x, w)
    assert dx.dtype == dtype and dw.dtype == w_dtype
    _close(dx, dxr, dtype, "dx")
    # the weight's gradient: terms in x's dtype, rounded once to the weight's
    _close(dw, dwr, max([d for d in (dtype, w_dtype) if d in TOL], key=TOL.get), "dw")


def test_rms_norm_residual():
    x = jax.random.normal(_key(18), (6, 32), F32)
    r = jax.random.normal(_key(19), (6, 32), F32)
    w = jax.random.uniform(_key(20), (32,), F32, 0.5, 1.5)

    def fused(x, r, w):
        y, s = fj.rms_norm(x, w, residual=r)
        return jnp.sum(y * jnp.cos(y)) + jnp.sum(s ** 2)

    def plain(x, r, w):
        s = x.astype(jnp.float64) + r
        y = ref_rms_norm(s, w)
        return jnp.sum(y * jnp.cos(y)) + jnp.sum(s ** 2)
    y, s = fj.rms_norm(x, w, residual=r)
    _close(s, x + r, what="s")
    _close(y, ref_rms_norm(x + r, w), what="y")
    for got, want, name in zip(jax.grad(fused, (0, 1, 2))(x, r, w),
                               jax.grad(plain, (0, 1, 2))(x, r, w), ("dx", "dresidual", "dw")):
        _close(got, want, what=name)
    check_grads(lambda x, r, w: fj.rms_norm(x, w, residual=r)[0], (x, r, w), order=1, modes=["rev"],
                eps=1e-2, atol=2e-2, rtol=2e-2)


# ---- SwiGLU ----

@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("bias,scale,clamp", [(False, False, None), (True, False, None),
                                              (False, True, None), (True, True, 1.5),
                                              (False, False, 0.7)])
def test_swiglu(dtype, bias, scale, clamp):
    y = (jax.random.normal(_key(21), (2, 7, 24), F32) * 2).astype(dtype)
    b = jax.random.normal(_key(22), (24,), F32) * 0.1 if bias else None
    s = jax.random.uniform(_key(23), (2, 7, 1), F32, 0.5, 2.0) if scale else None
    f = lambda y, b, s: fj.swiglu(y, b, per_token_scale=s, clamp_value=clamp)  # noqa: E731
    out = f(y, b, s)
    assert out.dtype == dtype and out.shape == (2, 7, 12)
    _close(out, ref_swiglu(y, b, s, clamp), dtype, "out")
    g = jax.random.normal(_key(24), out.shape, F32)
    got = jax.grad(lambda *a: jnp.sum(f(*a).astype(F32) * g), (0, 1, 2))(y, b, s)
    want = jax.grad(lambda *a: jnp.sum(ref_swiglu(*a, clamp) * g), (0, 1, 2))(y, b, s)
    for gg, ww, name in zip(got, want, ("dy", "dbias", "dscale")):
        if ww is not None:
            _close(gg, ww, dtype, name)
    assert got[0].dtype == dtype


def test_swiglu_check_grads():
    y = jax.random.normal(_key(25), (5, 8), F32)
    b = jax.random.normal(_key(26), (8,), F32)
    s = jax.random.uniform(_key(27), (5, 1), F32, 0.5, 2.0)
    check_grads(lambda y, b, s: fj.swiglu(y, b, per_token_scale=s), (y, b, s), order=1,
                modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("bias, scale", [(False, False), (True, True)])
@pytest.mark.parametrize("clamp, multipliers", [(None, (1.0, 1.0)), (1.3, (1.0, 1.0)),
                                                (None, (0.7, 1.8)), (0.9, (1.5, 0.5))])
def test_swiglu_gate_up(dtype, bias, scale, clamp, multipliers):
    gate = (jax.random.normal(_key(130), (2, 7, 12), F32) * 2).astype(dtype)
    up = (jax.random.normal(_key(131), (2, 7, 12), F32) * 2).astype(dtype)
    b = jax.random.normal(_key(132), (24,), F32) * 0.1 if bias else None
    s = jax.random.uniform(_key(133), (2, 7, 1), F32, 0.5, 2.0) if scale else None
    m, d = multipliers
    f = lambda gate, up, b, s: fj.swiglu(  # noqa: E731
        gate, up, bias=b, per_token_scale=s, clamp_value=clamp, gate_multiplier=m,
        down_multiplier=d)
    out = jax.jit(f)(gate, up, b, s)
    assert out.dtype == dtype and out.shape == gate.shape
    _close(out, ref_swiglu_gate_up(gate, up, b, s, clamp, m, d), dtype, "out")
    g = jax.random.normal(_key(134), out.shape, F32)
    got = jax.grad(lambda *a: jnp.sum(f(*a).astype(F32) * g), (0, 1, 2, 3))(gate, up, b, s)
    want = jax.grad(lambda gate, up, b, s: jnp.sum(ref_swiglu_gate_up(gate, up, b, s, clamp, m, d)
                                                   * g), (0, 1, 2, 3))(
        *(None if a is None else a.astype(jnp.float64) for a in (gate, up, b, s)))
    for gg, ww, name in zip(got, want, ("dgate", "dup", "dbias", "dscale")):
        if ww is not None:
            _close(gg, ww, dtype, name)
    assert got[0].dtype == got[1].dtype == dtype
    if multipliers == (1.0, 1.0) and clamp is None:  # the fused form's kernels, bit for bit
        fused = fj.swiglu(jnp.concatenate([gate, up], -1), b, per_token_scale=s)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(fused))


def test_swiglu_multipliers_in_the_fused_form():
    y = jax.random.normal(_key(135), (9, 16), F32)
    b = jax.random.normal(_key(136), (16,), F32) * 0.1
    f = lambda y, b: fj.swiglu(y, b, gate_multiplier=0.6, down_multiplier=2.5,  # noqa: E731
                               clamp_value=1.1)
    ref = lambda y, b: ref_swiglu_gate_up(y[:, :8], y[:, 8:], b, None, 1.1, 0.6, 2.5)  # noqa: E731
    _close(f(y, b), ref(y, b), F32, "out")
    g = jax.random.normal(_key(137), (9, 8), F32)
    got = jax.grad(lambda y, b: jnp.sum(f(y, b) * g), (0, 1))(y, b)
    want = jax.grad(lambda y, b: jnp.sum(ref(y, b) * g), (0, 1))(y.astype(jnp.float64),
                                                                  b.astype(jnp.float64))
    _close(got[0], want[0], F32, "dy")
    _close(got[1], want[1], F32, "dbias")


def test_swiglu_gate_up_check_grads_and_vmap():
    gate = jax.random.normal(_key(138), (5, 4), F32)
    up = jax.random.normal(_key(139), (5, 4), F32)
    b = jax.random.normal(_key(140), (8,), F32)
    s = jax.random.uniform(_key(141), (5, 1), F32, 0.5, 2.0)
    check_grads(lambda g, u, b, s: fj.swiglu(g, u, bias=b, per_token_scale=s), (gate, up, b, s),
                order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)
    # vmap over gate alone (up shared) and over both: each element its own problem
    gates = jnp.stack([gate, gate * 0.5, -gate])
    got = jax.vmap(lambda g: fj.swiglu(g, up, bias=b))(gates)
    both = jax.vmap(lambda g, u: fj.swiglu(g, u, bias=b))(gates, jnp.stack([up, up, up]))
    for i in range(3):
        _close(got[i], ref_swiglu_gate_up(gates[i], up, b), F32, f"vmapped {i}")
        _close(both[i], got[i], F32, f"vmapped both {i}")
    dgates = jax.vmap(jax.grad(lambda g: jnp.sum(fj.swiglu(g, up) ** 2)))(gates)
    _close(dgates[1], jax.grad(lambda g: jnp.sum(ref_swiglu_gate_up(g, up) ** 2))(
        gates[1].astype(jnp.float64)), F32, "vmapped dgate")


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("form", ["fused", "gate_up"])
def test_swiglu_fp8_input_store(dtype, form):
    # the output from the input; the gradients from its e4m3 copy (as JAX's cast rounds it, NaN
    # past e4m3's range: one entry at 1000)
    y = (jax.random.normal(_key(180), (6, 5, 16), F32) * 2).at[1, 2, 3].set(1000.0).astype(dtype)
    b = jax.random.normal(_key(181), (16,), F32) * 0.1
    s = jax.random.uniform(_key(182), (6, 5, 1), F32, 0.5, 2.0)
    g = jax.random.normal(_key(183), (6, 5, 8), F32)
    kw = dict(bias=b, per_token_scale=s, gate_multiplier=1.2)
    if form == "fused":
        op = lambda y, fp8: fj.swiglu(y, fp8_input_store=fp8, **kw)  # noqa: E731
    else:
        op = lambda y, fp8: fj.swiglu(y[..., :8], y[..., 8:], fp8_input_store=fp8, **kw)  # noqa: E731
    ref = lambda y, b, s: ref_swiglu_gate_up(y[..., :8], y[..., 8:], b, s, None, 1.2)  # noqa: E731
    out, pull = jax.vjp(lambda y: op(y, True), y)
    (dy,) = pull(g.astype(dtype))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(lambda y: op(y, False))(y)))
    y8 = y.astype(jnp.float8_e4m3fn).astype(jnp.float64)
    want = jax.grad(lambda y: jnp.sum(ref(y, b, s) * g.astype(dtype)))(y8)
    got = np.asarray(dy, np.float64)
    nan = np.isnan(np.asarray(want))
    assert nan.any() and np.array_equal(np.isnan(got), nan)  # the row with 1000 in its copy
    _close(np.where(nan, 0.0, got), np.where(nan, 0.0, want), dtype, "dy from the e4m3 copy")
    assert dy.dtype == dtype
    # the other gradients (bias, scale) from the copy too, and the jaxpr keeps e4m3, not y
    residuals = jax.vjp(lambda y: op(y, True), y)[1]
    kept = {str(np.dtype(leaf.dtype)) for leaf in jax.tree.leaves(residuals)
            if hasattr(leaf, "dtype") and leaf.ndim == 2}  # (bias and scale: 1-D)
    assert kept == {"float8_e4m3fn"}, kept


def test_swiglu_forms_bad_inputs():
    gate, up = jnp.zeros((4, 4), F32), jnp.zeros((4, 4), F32)
    _raises(r"up: got shape \(4, 3\), expected gate's shape \(4, 4\) \(swiglu\(gate, up\)",
            fj.swiglu, gate, up[:, :3])
    _raises(r"a per-token scale \[T, 1\] goes by keyword", fj.swiglu, gate, up[:, :1])
    _raises(r"got a first argument of shape \(8,\) and a second of shape \(4, 8\): swapped\?",
            fj.swiglu, jnp.zeros(8), jnp.zeros((4, 8)))
    _raises(r"bias given twice", fj.swiglu, gate, jnp.zeros(4), bias=jnp.zeros(4), error=TypeError)
    _raises(r"second argument: got list, expected a jax\.Array", fj.swiglu, gate, [0.0],
            error=TypeError)
    _raises(r"up\.dtype: got bfloat16, expected gate's float32", fj.swiglu, gate, up.astype(BF16))
    _raises(r"bias: got shape \(4,\), expected \(8,\) = \[2n\] \(the gate's bias in \[0, n\)",
            fj.swiglu, gate, up, bias=jnp.zeros(4))
    _raises(r"per_token_scale: got shape \(4,\), expected \(4, 1\) = \[T, 1\]", fj.swiglu,
            gate, up, per_token_scale=jnp.ones(4))
    _raises(r"^gate_multiplier: got inf", fj.swiglu, gate, up, gate_multiplier=float("inf"))
    _raises(r"^down_multiplier: got nan", fj.swiglu, jnp.zeros((4, 8)), down_multiplier=float("nan"))
    _raises(r"^clamp_value: got -1", fj.swiglu, gate, up, clamp_value=-1.0)
    _raises(r"fp8_input_store: got 'yes' \(str\), expected True or False", fj.swiglu, gate, up,
            fp8_input_store="yes", error=TypeError)


# ---- composition: jit, grad, value_and_grad, vmap ----

def test_jit_value_and_grad_match_eager():
    x = jax.random.normal(_key(28), (12, 33), F32)
    t = _targets(_key(29), (12,), 33)
    f = lambda x: fj.cross_entropy(x, t, label_smoothing=0.05)  # noqa: E731
    eager = jax.value_and_grad(f)(x)
    jitted = jax.jit(jax.value_and_grad(f))(x)
    np.testing.assert_array_equal(eager[0], jitted[0])
    np.testing.assert_array_equal(eager[1], jitted[1])


def test_vmap_each_element_is_its_own_problem():
    x = jax.random.normal(_key(30), (3, 10, 21), F32)
    t = _targets(_key(31), (3, 10), 21, ignore_every=3)
    for reduction in ("none", "mean"):
        f = lambda x, t: fj.cross_entropy(x, t, reduction=reduction)  # noqa: E731
        batched = jax.vmap(f)(x, t)
        looped = jnp.stack([f(x[i], t[i]) for i in range(3)])
        _close(batched, looped, what=reduction)
        dx = jax.vmap(jax.grad(lambda x, t: jnp.sum(f(x, t))))(x, t)
        dloop = jnp.stack([jax.grad(lambda x: jnp.sum(f(x, t[i])))(x[i]) for i in range(3)])
        _close(dx, dloop, what=f"d {reduction}")
    # shared logits, batched targets: the gradient gets a batch of its own
    shared = jax.vmap(jax.grad(lambda x, t: fj.cross_entropy(x, t)), in_axes=(None, 0))(x[0], t)
    assert shared.shape == (3, 10, 21)
    _close(shared[2], jax.grad(lambda x: fj.cross_entropy(x, t[2]))(x[0]), what="shared logits")


def test_vmap_linear_cross_entropy_rms_norm_swiglu():
    h = jax.random.normal(_key(32), (3, 8, 16), F32)
    w = jax.random.normal(_key(33), (30, 16), F32) * 0.3
    t = _targets(_key(34), (3, 8), 30)
    g = jnp.linspace(0.5, 1.5, 16)

    def step(h, t):
        return fj.linear_cross_entropy(fj.rms_norm(h, g), w, t)
    per_example = jax.vmap(jax.value_and_grad(step))(h, t)
    for i in range(3):
        loss, dh = jax.value_and_grad(step)(h[i], t[i])
        _close(per_example[0][i], loss, what="loss")
        _close(per_example[1][i], dh, what="dhidden")
    # per-example weight gradients (the weight itself not batched)
    dws = jax.vmap(jax.grad(lambda w, h, t: fj.linear_cross_entropy(h, w, t)), in_axes=(None, 0, 0))(w, h, t)
    _close(dws[1], jax.grad(lambda w: fj.linear_cross_entropy(h[1], w, t[1]))(w), what="dweight")
    y = jax.random.normal(_key(35), (3, 4, 10), F32)
    _close(jax.vmap(fj.swiglu)(y), fj.swiglu(y), what="swiglu")
    dg = jax.vmap(jax.grad(lambda x, g: jnp.sum(fj.rms_norm(x, g) ** 2), 1), in_axes=(0, None))(h, g)
    _close(dg[0], jax.grad(lambda g: jnp.sum(fj.rms_norm(h[0], g) ** 2))(g), what="dgamma")


# ---- vocab- and sequence-parallel under shard_map ----

def _mesh(tp):
    """TP devices: the default platform's where it has enough (GPUs), else the CPU's."""
    devices = jax.devices() if len(jax.devices()) >= tp else jax.devices("cpu")
    if len(devices) < tp:
        pytest.skip(f"shard_map TP {tp}: {len(devices)} CPU devices in this process "
                    "(JAX started before this module set jax_num_cpu_devices)")
    return jax.make_mesh((tp,), ("tp",), devices=devices[:tp])


def _shard_map(f, mesh, in_specs, out_specs, check_vma=True):
    """jax.shard_map, or jax.experimental.shard_map on older JAX (check_rep then)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=check_vma)
    from jax.experimental.shard_map import shard_map
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma)


def _on(mesh):
    """The mesh as the context of the calls (jax.set_mesh; the mesh itself on older JAX)."""
    return jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else mesh


def _put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("options", [{"reduction": "mean"},
                                     {"reduction": "none", "label_smoothing": 0.1, "z_loss": 1e-3},
                                     {"reduction": "mean", "logit_softcap": 2.5},
                                     {"reduction": "sum", "ignore_index": 0,
                                      "smoothing_formula": "megatron", "label_smoothing": 0.1}])
def test_vocab_parallel_cross_entropy(tp, check_vma, options):
    mesh = _mesh(tp)
    x = jax.random.normal(_key(36), (16, 96), F32) * 2
    t = _targets(_key(37), (16,), 96).at[1].set(0)
    if options.get("ignore_index") == 0:  # a class id as the ignore value: renumbered per shard
        t = jnp.where(t < 0, 0, t).at[::3].set(0)
    sharded = _shard_map(lambda x, t: fj.cross_entropy(x, t, axis_name="tp", **options),
                         mesh, (P(None, "tp"), P()), P(), check_vma)
    reduction = options["reduction"]
    with _on(mesh):
        loss, dx = jax.jit(lambda x, t: _loss_and_grads(lambda x: sharded(x, t), (x,), reduction, 0))(
            _put(mesh, x, P(None, "tp")), _put(mesh, t, P()))
    want, dwant = _loss_and_grads(lambda x: fj.cross_entropy(x, t, **options), (x,), reduction, 0)
    _close(loss, want, what="loss")
    _close(dx, dwant, what="dlogits")
    ref, _ = _loss_and_grads(lambda x: ref_cross_entropy(x, t, **options), (x,), reduction, 0)
    _close(loss, ref, what="loss against float64")


def test_vocab_parallel_partition_scope_is_per_shard():
    mesh = _mesh(2)
    x = jax.random.normal(_key(38), (8, 40), F32)
    t = _targets(_key(39), (8,), 40)
    kw = dict(label_smoothing=0.1, smoothing_formula="megatron", smoothing_scope="partition")
    sharded = _shard_map(lambda x, t: fj.cross_entropy(x, t, axis_name="tp", **kw)[None],
                         mesh, (P(None, "tp"), P()), P("tp"))
    with _on(mesh):
        per_shard = np.asarray(sharded(_put(mesh, x, P(None, "tp")), _put(mesh, t, P())))
    # Megatron's partition scope: the smoothing term averages over the shard's own columns
    for r in range(2):
        xs = x.astype(jnp.float64)
        lse = jax.nn.logsumexp(xs, -1)
        xt = jnp.take_along_axis(xs, jnp.where(t >= 0, t, 0)[:, None], -1)[:, 0]
        alpha = 0.1 * 20 / 19
        shard_mean = xs[:, 20 * r:20 * (r + 1)].mean(-1)
        loss = jnp.where(t >= 0, (1 - alpha) * (lse - xt) + alpha * (lse - shard_mean), 0.0)
        _close(per_shard[r], loss.sum() / (t >= 0).sum(), what=f"shard {r}")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("check_vma", [True, False])
def test_vocab_parallel_linear_cross_entropy(tp, sequence_parallel, check_vma):
    mesh = _mesh(tp)
    h = jax.random.normal(_key(40), (16, 12), F32)
    w = jax.random.normal(_key(41), (64, 12), F32) * 0.3
    t = _targets(_key(42), (16,), 64)
    for reduction, kw in (("mean", {}), ("none", {"logit_softcap": 4.0, "label_smoothing": 0.1})):
        kw = dict(kw, reduction=reduction, workspace_bytes=5 * 64 * 4)
        body = lambda h, w, t: fj.linear_cross_entropy(  # noqa: E731
            h, w, t, axis_name="tp", sequence_parallel=sequence_parallel, **kw)
        h_spec = P("tp") if sequence_parallel else P()
        sharded = _shard_map(body, mesh, (h_spec, P("tp"), P()), P(), check_vma)
        with _on(mesh):
            loss, (dh, dw) = jax.jit(lambda h, w, t: _loss_and_grads(
                lambda h, w: sharded(h, w, t), (h, w), reduction, (0, 1)))(
                _put(mesh, h, h_spec), _put(mesh, w, P("tp")), _put(mesh, t, P()))
        want, (dhw, dww) = _loss_and_grads(lambda h, w: fj.linear_cross_entropy(h, w, t, **kw),
                                           (h, w), reduction, (0, 1))
        _close(loss, want, what=f"{reduction} loss")
        _close(dh, dhw, what=f"{reduction} dhidden")
        _close(dw, dww, what=f"{reduction} dweight")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_vocab_parallel_linear_distillation(tp, check_vma, divergence):
    """Both heads' weights sharded over the axis: the losses and the student's gradients equal
    one device's and float64's, for every divergence, with a hard-label term and ignored rows."""
    mesh = _mesh(tp)
    sh, sw, th, tw, t = _distill_problem(330, shape=(12,), V=48)
    for reduction in ("mean", "none"):
        kw = dict(divergence=divergence, beta=0.4, temperature=1.3, hard_label_weight=0.25,
                  reduction=reduction, workspace_bytes=5 * 48 * 4)
        body = lambda a, b, c, d, e: fj.linear_distillation_loss(  # noqa: E731
            a, b, c, d, e, axis_name="tp", **kw)
        sharded = _shard_map(body, mesh, (P(), P("tp"), P(), P("tp"), P()), P(), check_vma)
        with _on(mesh):
            loss, (dh, dw) = jax.jit(lambda a, b, c, d, e: _loss_and_grads(
                lambda a, b: sharded(a, b, c, d, e), (a, b), reduction, (0, 1)))(
                _put(mesh, sh, P()), _put(mesh, sw, P("tp")), _put(mesh, th, P()),
                _put(mesh, tw, P("tp")), _put(mesh, t, P()))
        want, (dhw, dww) = _loss_and_grads(
            lambda a, b: fj.linear_distillation_loss(a, b, th, tw, t, **kw), (sh, sw), reduction,
            (0, 1))
        _close(loss, want, what=f"{reduction} loss")
        _close(dh, dhw, what=f"{reduction} dhidden")
        _close(dw, dww, what=f"{reduction} dweight")
        ref = ref_distillation(sh.astype(jnp.float64), sw.astype(jnp.float64), th, tw, t, F32,
                               **{k: v for k, v in kw.items() if k != "workspace_bytes"})
        _close(loss, ref, F32, f"{reduction} loss against float64")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_vocab_parallel_linear_log_probs(tp, sequence_parallel, check_vma, dtype):
    mesh = _mesh(tp)
    h = jax.random.normal(_key(95), (16, 12), F32).astype(dtype)
    w = (jax.random.normal(_key(96), (64, 12), F32) * 0.5).astype(dtype)
    t = _targets(_key(97), (16,), 64)
    mask = jnp.arange(16) % 7 != 3
    a = jax.random.normal(_key(98), (16,), F32)
    b = jax.random.normal(_key(99), (16,), F32)
    kw = dict(temperature=0.7, loss_mask=mask, workspace_bytes=5 * 64 * 4)

    def step(h, w, op):
        def objective(h, w):
            out = op(h, w)
            return (a * out.log_probs + b * out.entropy).sum(), out
        (_, out), grads = jax.value_and_grad(objective, (0, 1), has_aux=True)(h, w)
        return out.log_probs, out.entropy, out.argmax, *grads

    body = lambda h, w, t: fj.linear_log_probs(  # noqa: E731
        h, w, t, argmax=True, axis_name="tp", sequence_parallel=sequence_parallel, **kw)
    h_spec = P("tp") if sequence_parallel else P()
    sharded = _shard_map(body, mesh, (h_spec, P("tp"), P()), P(), check_vma)
    with _on(mesh):
        got = jax.jit(lambda h, w, t: step(h, w, lambda h, w: sharded(h, w, t)))(
            _put(mesh, h, h_spec), _put(mesh, w, P("tp")), _put(mesh, t, P()))
    want = step(h, w, lambda h, w: fj.linear_log_probs(h, w, t, argmax=True, **kw))
    for g, r, name in zip(got, want, ("log_probs", "entropy", "argmax", "dhidden", "dweight")):
        if name == "argmax":  # (bf16: the same logits on every shard, so the same ties)
            assert np.array_equal(np.asarray(g), np.asarray(r))
        else:
            _close(g, r, dtype, name)
    # and against float64 (the upstream gradients a and b through both results)
    lp, ent, _ = ref_log_probs(h, w, jnp.where(mask, t, -100), 0.7)
    _close(got[0], lp, dtype, "log_probs against float64")
    _close(got[1], ent, dtype, "entropy against float64")
    refs = jax.grad(lambda h, w: (a * ref_log_probs(h, w, jnp.where(mask, t, -100), 0.7)[0] +
                                  b * ref_log_probs(h, w, jnp.where(mask, t, -100), 0.7)[1]).sum(),
                    (0, 1))(h.astype(jnp.float64), w.astype(jnp.float64))
    _close(got[3], refs[0], dtype, "dhidden against float64")
    _close(got[4], refs[1], dtype, "dweight against float64")


def test_sequence_parallel_linear_log_probs_3d_and_bad_slices():
    # [s, b, H] slices along s; tokens cover every slice; a wrong token count is named at trace
    mesh = _mesh(2)
    h, w, t = _lp_problem(100, (8, 3), H=16, V=64)
    body = lambda h, w, t: tuple(fj.linear_log_probs(  # noqa: E731
        h, w, t, axis_name="tp", sequence_parallel=True))[:2]
    sharded = _shard_map(body, mesh, (P("tp"), P("tp"), P()), (P(), P()))
    g = jax.random.normal(_key(104), t.shape, F32)
    with _on(mesh):
        hs, ws = _put(mesh, h, P("tp")), _put(mesh, w, P("tp"))
        lp, ent = sharded(hs, ws, _put(mesh, t, P()))
        dh = jax.grad(lambda h: (g * sharded(h, ws, t)[0]).sum())(hs)
        with pytest.raises(ValueError, match=r"tokens: got shape \(7, 3\), expected \(8, 3\) "
                                             r"\(the tokens of 2 ranks' slices of hidden along dim 0\)"):
            sharded(hs, ws, t[:-1])
    want_lp, want_ent, _ = ref_log_probs(h, w, t)
    _close(lp, want_lp, F32, "log_probs")
    _close(ent, want_ent, F32, "entropy")
    dwant = jax.grad(lambda h: (g * ref_log_probs(h, w, t)[0]).sum())(h.astype(jnp.float64))
    _close(dh, dwant, F32, "dhidden")


# ---- bad inputs ----

def _raises(match, f, *args, error=ValueError, **kw):
    with pytest.raises(error, match=match):
        f(*args, **kw)


def test_bad_inputs_name_the_argument_the_value_and_what_was_expected():
    x = jnp.zeros((4, 9), F32)
    t = jnp.zeros((4,), jnp.int32)
    _raises(r"logits\.dtype: got float64, expected float32, float16 or bfloat16",
            fj.cross_entropy, x.astype(jnp.float64), t)
    _raises(r"logits: got shape \(9,\), expected a 2-D \[N, V\] or 3-D \[s, b, V\] tensor with V >= 1",
            fj.cross_entropy, x[0], t)
    _raises(r"target: got shape \(5,\), expected \(4,\) \(the logits' shape without the vocab dim\)",
            fj.cross_entropy, x, jnp.zeros((5,), jnp.int32))
    _raises(r"target\.dtype: got float32, expected an integer dtype", fj.cross_entropy, x,
            jnp.zeros((4,), F32))
    _raises(r"reduction: got 'avg', expected one of \['mean', 'none', 'sum'\]", fj.cross_entropy,
            x, t, reduction="avg")
    _raises(r"^label_smoothing: got 1\.5", fj.cross_entropy, x, t, label_smoothing=1.5)
    _raises(r"^z_loss: got -1", fj.cross_entropy, x, t, z_loss=-1.0)
    _raises(r"ignore_index: got 1\.5 \(float\), expected an int", fj.cross_entropy, x, t,
            ignore_index=1.5, error=TypeError)
    _raises(r"logits: got list, expected a jax\.Array", fj.cross_entropy, [[0.0]], t, error=TypeError)
    with pytest.raises(TypeError, match=r"label_smoothing: got a traced value, expected a real number"):
        jax.jit(lambda ls: fj.cross_entropy(x, t, label_smoothing=ls))(0.1)
    h, w = jnp.zeros((4, 8), BF16), jnp.zeros((10, 8), F32)
    _raises(r"weight\.dtype: got float32, expected bfloat16 \(hidden's dtype\)",
            fj.linear_cross_entropy, h, w, t)
    _raises(r"weight: got shape \(10, 7\), expected \[V_local, 8\]", fj.linear_cross_entropy,
            h, jnp.zeros((10, 7), BF16), t)
    _raises(r"backward_mode: got 'in_forward' with reduction='none' and no loss_mask, expected "
            r"'recompute' or 'auto'",
            fj.linear_cross_entropy, h, w.astype(BF16), t, reduction="none", backward_mode="in_forward")
    _raises(r"backward_mode: got 'in_forward' with float16 inputs", fj.linear_cross_entropy,
            h.astype(F16), w.astype(F16), t, backward_mode="in_forward")
    _raises(r"^logit_softcap: got -2", fj.linear_cross_entropy, h, w.astype(BF16), t, logit_softcap=-2.0)
    _raises(r"workspace_bytes: got 0, expected None or a positive number of bytes",
            fj.linear_cross_entropy, h, w.astype(BF16), t, workspace_bytes=0)
    _raises(r"sequence_parallel: got True without axis_name", fj.linear_cross_entropy, h,
            w.astype(BF16), t, sequence_parallel=True)
    _raises(r"dweight_accumulation: got 'bf16', expected one of", fj.linear_cross_entropy, h,
            w.astype(BF16), t, dweight_accumulation="bf16")
    _raises(r"weight: got shape \(7,\), expected \(8,\) = \[H\]", fj.rms_norm, h, jnp.ones(7))
    _raises(r"^eps: got 0", fj.rms_norm, h, jnp.ones(8), eps=0.0)
    _raises(r"residual: got shape \(4, 8\) float32, expected x's \(4, 8\) bfloat16", fj.rms_norm,
            h, jnp.ones(8), residual=jnp.zeros((4, 8), F32))
    _raises(r"y: got shape \(4, 7\), expected \[\.\.\., 2n\] with n >= 1", fj.swiglu, jnp.zeros((4, 7), F32))
    _raises(r"bias: got shape \(6,\), expected \(8,\) = \[2n\]", fj.swiglu, jnp.zeros((4, 8), F32),
            jnp.zeros(6))
    _raises(r"per_token_scale: got shape \(4,\), expected \(4, 1\) = \[T, 1\]", fj.swiglu,
            jnp.zeros((4, 8), F32), per_token_scale=jnp.ones(4))
    _raises(r"^clamp_value: got -1", fj.swiglu, jnp.zeros((4, 8), F32), clamp_value=-1.0)


def test_the_messages_are_the_pytorch_ops():
    """The same bad option gives the same text from both adapters (the core's validators)."""
    torch = pytest.importorskip("torch")
    import fusedloss
    x = jnp.zeros((4, 9), F32)
    t = jnp.zeros((4,), jnp.int32)
    for kw in ({"label_smoothing": 1.5}, {"z_loss": -1.0}, {"reduction": "avg"}):
        with pytest.raises(ValueError) as from_jax:
            fj.cross_entropy(x, t, **kw)
        with pytest.raises(ValueError) as from_torch:
            fusedloss.cross_entropy(torch.zeros(4, 9), torch.zeros(4, dtype=torch.long), **kw)
        assert str(from_jax.value) == str(from_torch.value)
    # SwiGLU's two forms: the positional pair and the scalars
    for shapes, kw in ((((4, 4), (4, 3)), {}), (((4, 4), (4, 1)), {}), (((8,), (4, 8)), {}),
                       (((4, 4), (4, 4)), {"gate_multiplier": float("inf")}),
                       (((4, 8),), {"down_multiplier": float("nan")}),
                       (((4, 4), (4, 4)), {"clamp_value": -1.0})):
        with pytest.raises(ValueError) as from_jax:
            fj.swiglu(*(jnp.zeros(s, F32) for s in shapes), **kw)
        with pytest.raises(ValueError) as from_torch:
            fusedloss.swiglu(*(torch.zeros(s) for s in shapes), **kw)
        assert str(from_jax.value) == str(from_torch.value)
    with pytest.raises(ValueError) as from_jax:
        fj.linear_cross_entropy(jnp.zeros((6, 8)), jnp.zeros((10, 8)), jnp.zeros(6, jnp.int32),
                                dweight_accumulation="bf16")
    with pytest.raises(ValueError) as from_torch:
        fusedloss.linear_cross_entropy(torch.zeros(6, 8), torch.zeros(10, 8),
                                       torch.zeros(6, dtype=torch.long), dweight_accumulation="bf16")
    assert str(from_jax.value) == str(from_torch.value)
    h, w, t = jnp.zeros((6, 8), F32), jnp.zeros((10, 8), F32), jnp.zeros((6,), jnp.int32)
    th, tw, tt = torch.zeros(6, 8), torch.zeros(10, 8), torch.zeros(6, dtype=torch.long)
    for args, targs, kw in (((h, w, t), (th, tw, tt), {"temperature": 0.0}),
                            ((h, w, t), (th, tw, tt), {"temperature": float("nan")}),
                            ((h, w, t), (th, tw, tt), {"workspace_bytes": -1}),
                            ((h, w[:, :7], t), (th, tw[:, :7], tt), {}),
                            ((h, w, t[:5]), (th, tw, tt[:5]), {}),
                            ((h, w, t), (th, tw, tt), {"loss_mask": t[:5]})):
        with pytest.raises(ValueError) as from_jax:
            fj.linear_log_probs(*args, **kw)
        tkw = {k: (tt[:5] if k == "loss_mask" else v) for k, v in kw.items()}
        with pytest.raises(ValueError) as from_torch:
            fusedloss.linear_log_probs(*targs, **tkw)
        assert str(from_jax.value) == str(from_torch.value)


# ---- the example ----

def test_the_training_example_matches_jax_numpy():
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "jax_train.py")
    done = subprocess.run([sys.executable, example, "--steps", "3", "--tp", "2"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0 and done.stdout.rstrip().endswith("ok"), done.stdout + done.stderr
    assert "head over 2 devices" in done.stdout, done.stdout


# ---- CUDA ----

@pytest.mark.parametrize("nbytes", [1, 48, 256, 4_800_000, 3 * 2**20 + 17])
def test_the_cuda_scratch_binding_meets_xlas_allocator_rules(nbytes):
    # The CUDA handlers take the core's 256-byte aligned scratch from XLA's FFI allocator, which
    # takes alignments up to 16 bytes and answers a larger one with no memory. This drives that
    # binding on the host against a stand-in with XLA's rules, so a run without a GPU fails where
    # every CUDA handler would.
    from fusedloss.jax import _ffi
    _ffi.check_scratch_binding(nbytes)


@_CUDA
def test_cuda_handlers_match_the_cpu():
    gpu, cpu = _GPU[0], jax.devices("cpu")[0]
    h = jax.random.normal(_key(43), (300, 64), F32).astype(BF16)
    w = (jax.random.normal(_key(44), (1000, 64), F32) * 0.1).astype(BF16)
    t = _targets(_key(45), (300,), 1000)
    g = jnp.linspace(0.5, 1.5, 64)

    def step(h, w):
        y = fj.swiglu(jnp.concatenate([h, h], -1))
        return fj.linear_cross_entropy(fj.rms_norm(y, g), w, t) + fj.cross_entropy(
            (h @ w.T).astype(F32), t)
    results = [jax.jit(jax.value_and_grad(step, (0, 1)))(jax.device_put(h, d), jax.device_put(w, d))
               for d in (gpu, cpu)]
    for a, b, name in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]),
                          ("loss", "dhidden", "dweight")):
        _close(a, b, BF16, name)
    fj.check_device_errors()


@_CUDA
def test_cuda_log_probs_match_the_cpu():
    gpu, cpu = _GPU[0], jax.devices("cpu")[0]
    h, w, t = _lp_problem(110, (300,), H=64, V=1000, dtype=BF16)
    a = jax.random.normal(_key(113), t.shape, F32)

    def step(h, w):
        out = fj.linear_log_probs(h, w, t, temperature=0.8, argmax=True)
        return (a * out.log_probs + 0.01 * out.entropy).sum(), out
    results = [jax.jit(jax.value_and_grad(step, (0, 1), has_aux=True))(jax.device_put(h, d),
                                                                      jax.device_put(w, d))
               for d in (gpu, cpu)]
    (_, gpu_out), gpu_grads = results[0]
    (_, cpu_out), cpu_grads = results[1]
    for got, want, name in ((gpu_out.log_probs, cpu_out.log_probs, "log_probs"),
                            (gpu_out.entropy, cpu_out.entropy, "entropy"),
                            (gpu_grads[0], cpu_grads[0], "dhidden"),
                            (gpu_grads[1], cpu_grads[1], "dweight")):
        _close(got, want, BF16, name)
    fj.check_device_errors()


@_CUDA
def test_cuda_swiglu_gate_up_matches_the_cpu():
    gpu, cpu = _GPU[0], jax.devices("cpu")[0]
    gate = jax.random.normal(_key(142), (3, 50, 64), F32).astype(BF16)
    up = jax.random.normal(_key(143), (3, 50, 64), F32).astype(BF16)
    b = jax.random.normal(_key(144), (128,), F32) * 0.1
    s = jax.random.uniform(_key(145), (3, 50, 1), F32, 0.5, 2.0)

    for fp8 in (False, True):  # the fp8 input store too
        def step(gate, up, b, s):
            out = fj.swiglu(gate, up, bias=b, per_token_scale=s, clamp_value=2.0,
                            gate_multiplier=0.8, down_multiplier=1.5, fp8_input_store=fp8)
            return jnp.sum(out.astype(F32) ** 2)
        results = [jax.jit(jax.value_and_grad(step, (0, 1, 2, 3)))(
            *(jax.device_put(a, d) for a in (gate, up, b, s))) for d in (gpu, cpu)]
        for a, b_, name in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]),
                               ("value", "dgate", "dup", "dbias", "dscale")):
            _close(a, b_, BF16, f"{name} (fp8 store {fp8})")
    fj.check_device_errors()

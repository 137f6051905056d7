"""bench/peers.py's reading of the stream-ordered pool, where fusedloss's scratch lives and
torch's allocator statistics do not look (the benchmarks themselves need a GPU)."""
import ctypes
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import peers  # noqa: E402


class FakeRuntime:
    """cudaMemPoolGetAttribute / SetAttribute over a pool whose use the test moves."""

    def __init__(self, current):
        self.current, self.high, self.fail = current, current, False

    def use(self, nbytes):
        self.current += nbytes
        self.high = max(self.high, self.current)

    def cudaMemPoolGetAttribute(self, pool, attr, out):
        if self.fail:
            return 1
        value = {peers.StreamOrderedPool.USED_CURRENT: self.current,
                 peers.StreamOrderedPool.USED_HIGH: self.high}[attr]
        ctypes.cast(out, ctypes.POINTER(ctypes.c_uint64))[0] = value
        return 0

    def cudaMemPoolSetAttribute(self, pool, attr, value):
        assert attr == peers.StreamOrderedPool.USED_HIGH
        assert ctypes.cast(value, ctypes.POINTER(ctypes.c_uint64))[0] == 0
        self.high = self.current  # what resetting the high watermark does
        return 0


def pool_over(rt):
    pool = peers.StreamOrderedPool.__new__(peers.StreamOrderedPool)
    pool.rt, pool.pool, pool.usable = rt, ctypes.c_void_p(), True
    return pool


def test_extra_is_the_peak_above_what_was_in_use_at_reset():
    rt = FakeRuntime(current=32 << 20)  # a cached cuBLASLt workspace, held for the process
    pool = pool_over(rt)
    rt.use(512 << 20)
    rt.use(-(512 << 20))  # an earlier call's peak: not this measurement's
    base = pool.reset()
    assert base == 32 << 20
    rt.use(256 << 20)
    rt.use(-(256 << 20))
    assert pool.extra(base) == 256 << 20
    base = pool.reset()
    assert pool.extra(base) == 0


def test_a_failed_query_falls_back_to_torch_alone(capsys):
    rt = FakeRuntime(current=0)
    pool = pool_over(rt)
    base = pool.reset()
    rt.use(1 << 20)
    rt.fail = True
    assert pool.extra(base) == 0 and not pool.usable
    assert "torch's allocator alone" in capsys.readouterr().out
    assert pool.reset() == 0 and pool.extra(0) == 0


def test_the_timed_input_ends_the_gradient_so_no_leaf_copy_is_timed():
    # an in-place provider's gradient is x's own storage: through a plain clone of a leaf the
    # timed backward would copy it into leaf.grad; here nothing reaches the leaf
    import torch
    leaf = torch.randn(4, 6, requires_grad=True)
    x = peers._GradientEndsHere.apply(leaf)
    assert x.grad_fn is not None and x.data_ptr() != leaf.data_ptr()
    torch.testing.assert_close(x, leaf.detach())
    (x * 3).sum().backward()
    assert leaf.grad is None


def test_run_bench_keeps_the_cpp_providers_apart(monkeypatch, capsys):
    import run_bench
    csv_text = ("provider,op,V,rows,ms,floor_ms,copy_gbs,peak_extra_mib,gpu\n"
                "fusedloss-cpp,fwd+bwd,32768,8192,0.40,0.38,4250.0,0.03,H200\n"
                "fusedloss-cpp-in-forward,backward,32768,8192,0.005,0.0,4250.0,0.03,H200\n"
                "fusedloss-cpp-in-forward,fwd+bwd,32768,8192,0.335,0.253,4250.0,0.03,H200\n")
    monkeypatch.setattr(run_bench.subprocess, "check_output", lambda *a, **kw: csv_text)
    recs, gpu, bw = run_bench.run_ours("build/bench/ce_bench", "V")
    assert [r["provider"] for r in recs] == ["fusedloss", "fusedloss-cpp-in-forward", "fusedloss-cpp-in-forward"]
    assert (gpu, bw) == ("H200", 4250.0)
    run_bench.report_cpp_modes(recs, "V")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[2].split()[-1] == "-" and out[3].split()[-1] == "1.32x"
    monkeypatch.setattr(run_bench, "git_commit", lambda: "abc")
    assert run_bench._timing(recs[1], bw, gpu)[:3] == ["0.0050", "0.0000", ""]  # a skipped backward: no ratio


def test_log_probs_bench_providers_agree_on_the_cpu():
    """bench/log_probs_bench.py's torch heads (whole and chunked) and the fused one give the
    float64 reference's log-probs and entropy (the benchmark itself needs a GPU)."""
    import torch
    import log_probs_bench as lp
    h = torch.randn(40, 16, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(50, 16).float() * 0.3
    t = torch.randint(0, 50, (40,))
    ref_lp, ref_ent = lp.reference(h.detach(), w, t, chunk=16)
    for fn in (lp.torch_head, lambda h, w, t: lp.torch_chunked(h, w, t, chunk=16), lp.fusedloss_head):
        got_lp, got_ent = fn(h, w, t)
        assert lp.rel_err(got_lp.detach(), ref_lp) < 1e-5 and lp.rel_err(got_ent.detach(), ref_ent) < 1e-5
        (got_lp.sum() + got_ent.sum()).backward()
        assert h.grad is not None and h.grad.abs().sum() > 0
        h.grad = None

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

"""Tensor-parallel groups for the ops: validation, naming, resolution and the shard agreement.

Custom-op schemas cannot carry process groups, so an op carries its group's name ("" at TP=1),
which torch.compile traces as a constant, and resolves it back at run time.

Shard agreement: before any collective whose size depends on the arguments, every rank
contributes a fixed-size header (its rows, its V_local, a fingerprint of its options, whether it
rejected its own arguments, its tokens per chunk and a checksum of its targets), so a
disagreement, or a rank whose arguments were bad, raises the same fusedloss._C.Error (a
ValueError) on every rank at the same call instead of leaving the others waiting in a collective
(or merging mismatched shards, or computing the loss of other tokens). The same guarantee as the
C++ API's header exchange.

The vocab-parallel hook itself (merge_over_group): every rank's stats of every row, gathered once.
"""
import contextlib
import ctypes
import hashlib
from typing import List, Optional

import torch
import torch.distributed as dist

from . import _C

_GROUPS = {}  # name -> group, for torch builds without c10d's name resolver
_HEADER = 6   # int64: rows, V_local, options fingerprint, rejected (0: no, 1: its arguments,
              # 2: out of memory), tokens per chunk (0: unchunked), the targets' checksum
_MESSAGE_BYTES = 512

try:  # c10d's own name -> group map (what functional collectives use)
    from torch.distributed.distributed_c10d import _resolve_process_group
except ImportError:
    _resolve_process_group = None


def check_group(group, name="tp_group"):
    """None or a process group of an initialised torch.distributed; its size (1 for None)."""
    if group is None:
        return 1
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: got {group!r} ({type(group).__name__}), expected a "
                        "torch.distributed ProcessGroup or None")
    if not dist.is_initialized():
        raise ValueError(f"{name}: got a process group, but torch.distributed is not initialised")
    return dist.get_world_size(group)


def group_size(group) -> int:
    """The group's size, unchecked: 1 for None or before torch.distributed is initialised (the
    adapters' question: is this the vocab-parallel path?)."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def group_name(group) -> str:
    """The name an op carries for `group` ("" when the group has one rank)."""
    if group is None or check_group(group) == 1:  # (None: the common case, without the call)
        return ""
    name = group.group_name
    if not torch.compiler.is_compiling():
        _GROUPS[name] = group
    return name


def resolve_group(name: str):
    """The process group behind a name from group_name(); None for "" (TP=1)."""
    if not name:
        return None
    if _resolve_process_group is not None:
        try:
            return _resolve_process_group(name)
        except (LookupError, ValueError, RuntimeError):
            pass
    if name not in _GROUPS:
        raise ValueError(f"tp_group: no process group named {name!r} in this process (a graph "
                         "traced with a group that this process has not created)")
    return _GROUPS[name]


def rank_and_size(group):
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def merge_buffers(group, stats):
    """What merge_over_group works in beside `stats`: the gathered stats of every rank and the
    per-row losses of a sum/mean. Allocate them with the other buffers, before the agreement:
    nothing is allocated after the all-gather."""
    gathered = stats.new_empty(dist.get_world_size(group) * stats.size(0), stats.size(1))
    return gathered, stats.new_empty(stats.size(0))


def merge_over_group(group, stats, buffers, target_view, options, v_local, loss, lse, count,
                     stream):
    """The hook between the local pass and the loss: this rank's stats of every row [rows,
    ROW_STATS_FLOATS] (16 B/row) all-gathered over the group once, then merged into the loss,
    lse [rows] and the valid count (fp32 tensors the caller owns); `buffers` from
    merge_buffers."""
    world = dist.get_world_size(group)
    gathered, row_losses = buffers
    dist.all_gather_into_tensor(gathered, stats, group=group)
    _C.cross_entropy_merge(gathered.data_ptr(), world, stats.data_ptr(), target_view, options, v_local,
                           loss.data_ptr(), lse.data_ptr(), count.data_ptr(), stream,
                           row_losses.data_ptr())


class _DeviceBytes:
    """Raw device memory as a uint8 tensor (torch.as_tensor reads __cuda_array_interface__)."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2}


def _torch_stream(handle: int, device) -> "torch.cuda.Stream":
    """torch's stream for a raw cudaStream_t handle from the C++ side. Handle 0 (the legacy
    default stream, what stream_of() passes for torch's default stream) must not go through
    torch.cuda.ExternalStream: a stream_ptr of 0 reads as "none there" and torch hands out a
    fresh pool stream, with no ordering against the kernels the handle's stream runs."""
    current = torch.cuda.current_stream(device)
    if current.cuda_stream == handle:
        return current
    if handle == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=device)


def callback_communicator(group, device, chunk_rows):
    """The C++ Communicator of the per-chunk hook, over `group`: each collective runs as a
    torch.distributed call on the stream the C++ side names. Device memory is staged through
    tensors of torch's allocator (16 B/row of a chunk, allocated here: before the agreement),
    so the process group only sees its own tensors."""
    rank, world = rank_and_size(group)
    stage_bytes = 16 * chunk_rows  # a chunk's RowStats, the most one collective moves per rank
    if device.type == "cuda":
        send_stage = torch.empty(stage_bytes, dtype=torch.uint8, device=device)
        recv_stage = torch.empty(world * stage_bytes, dtype=torch.uint8, device=device)

    def view(ptr, nbytes):
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=device)
        if device.type == "cpu":
            return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
        return torch.as_tensor(_DeviceBytes(ptr, nbytes), device=device)

    def on(stream):
        return contextlib.nullcontext() if device.type == "cpu" else torch.cuda.stream(
            _torch_stream(stream, device))

    def gather(send, recv, nbytes, stream):
        with on(stream):
            mine, every = view(send, nbytes), view(recv, nbytes * world)
            if device.type == "cpu":
                dist.all_gather_into_tensor(every, mine, group=group)
            else:
                send, recv = send_stage[:nbytes], recv_stage[:world * nbytes]
                send.copy_(mine)
                dist.all_gather_into_tensor(recv, send, group=group)
                every.copy_(recv)

    def reduce(data, count, op, stream):
        with on(stream):
            values = view(data, count * 4).view(torch.float32)
            red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
            if device.type == "cpu":
                dist.all_reduce(values, op=red, group=group)
                return
            staged = send_stage[:count * 4].view(torch.float32)
            staged.copy_(values)
            dist.all_reduce(staged, op=red, group=group)
            values.copy_(staged)

    dev = _C.Device.CUDA if device.type == "cuda" else _C.Device.CPU
    return _C.CallbackCommunicator(rank, world, dev, gather, reduce)


def _header_device(group):
    """Where the headers travel: host memory for gloo (also in a cpu:gloo,cuda:nccl group),
    device memory for an NCCL-only group. Decided by the group, never by a rank's arguments,
    so every rank takes the same path even when one rank's tensors are wrong."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _signed(c):
    return c - (1 << 64) if c >= 1 << 63 else c


_MIX = (_signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))


def _shr(z, k):
    """The logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z):
    """splitmix64's finaliser on int64 bits (wrapping, as the C++ one on uint64)."""
    z = z + _MIX[0]
    z = (z ^ _shr(z, 30)) * _MIX[1]
    z = (z ^ _shr(z, 27)) * _MIX[2]
    return z ^ _shr(z, 31)


def _target_checksum(target, device):
    """sum_i mix(t_i ^ mix(i)) in wrapping 64-bit arithmetic (the C++ agreement's checksum,
    src/core/cross_entropy_math.h): a change of one target always changes it, permuted rows or
    several changes only by a 2^-64 coincidence. A (targets, fp32 row weights) pair adds the
    weights' terms as the core does (row_weight_checksum_term: bits with -0 as 0 and one NaN,
    rows N..2N-1).
    A 1-element int64 tensor on `device`."""
    if isinstance(target, tuple):  # the targets and fp32 row weights (their bits, rows after)
        t, w = target
        w = w.reshape(-1) + 0.0  # -0.0 is 0.0, and every NaN the one quiet NaN
        bits = torch.where(w.isnan(), 0x7FC00000, w.view(torch.int32)).to(torch.int64)
        return (_checksum(t.reshape(-1).to(torch.int64), 0) +
                _checksum(bits, t.numel())).reshape(1).to(device)
    return _checksum(target.reshape(-1).to(torch.int64), 0).reshape(1).to(device)


def _checksum(values, first_row):
    rows = torch.arange(first_row, first_row + values.numel(), dtype=torch.int64, device=values.device)
    return _mix(values ^ _mix(rows)).sum()


class Fingerprint(int):
    """fingerprint()'s int, with the values it digests as "name=value" texts (`pairs`): what
    agree() exchanges to name the option that differs."""
    pairs = ()


def fingerprint(*values, **named) -> int:
    """The same int on every rank for equal values (ints, floats, bools, strings, tuples of
    them), and a different one for any difference: a digest of their exact repr (hash() mixes
    numbers modulo 2**61 - 1, so 0.5 and 2**-62 would agree, and strings hash per process).
    Named values are named in agree()'s error when they differ."""
    def exact(v):
        return v + 0.0 if isinstance(v, float) else v  # -0.0 is 0.0
    values = tuple(exact(v) for v in values)
    named = tuple((k, exact(v)) for k, v in named.items())
    digest = hashlib.blake2b(repr((values, named)).encode(), digest_size=8).digest()
    out = Fingerprint(int.from_bytes(digest, "little") & (2**63 - 1))
    out.pairs = tuple(repr(v) for v in values) + tuple(f"{k}={v!r}" for k, v in named)
    return out


def _differing_option(mine, first, r):
    """"rank r's NAME=A differs from rank 0's NAME=B" for the first pair that differs; where the
    first difference is in the names, the ranks compared different options (another op, or
    another route of a patched model, on each), and are named as such rather than pairing
    unrelated options."""
    for a, b in zip(mine, first):
        if a == b:
            continue
        if a.split("=", 1)[0] != b.split("=", 1)[0]:
            def names(pairs):
                return ", ".join(p.split("=", 1)[0] for p in pairs)
            # an option both calls name, with another value on each: likely why they differ
            def named(pairs):
                return dict(p.split("=", 1) for p in pairs if "=" in p)
            ours, theirs = named(mine), named(first)
            shared = next((f"; rank {r}'s {k}={v} where rank 0's is {theirs[k]}"
                           for k, v in ours.items() if k in theirs and v != theirs[k]), "")
            return (f"rank {r} compared the options ({names(mine)}) where rank 0 compared "
                    f"({names(first)}): another call on each rank (another op, or another route "
                    f"of a patched model){shared}")
        return f"rank {r}'s {a} differs from rank 0's {b}"
    return f"rank {r}'s differ from rank 0's, though both read ({', '.join(mine)})"


def agree(group, rows: int, v_local: int, options: int, error: Optional[str], op: str,
          chunk_rows: int = 0, target=None, out_of_memory: bool = False) -> None:
    """Every rank learns every rank's rows, V_local, options fingerprint (any int the ranks must
    share: fingerprint() of the options), rejection,
    tokens per chunk (a chunked op runs one collective per chunk) and a checksum of its targets
    (every rank computes the loss of the same tokens) at the same call, and raises the same
    ValueError when anything disagrees. Costs one all-gather of 48 B per rank and its host sync
    (plus one of 512 B per rank when a rank rejected its arguments, or when the options differ:
    then each rank's named options, from fingerprint(), name the one that differs). rows = -1: the rank
    rejected its arguments before its shapes were known. A rejection that was an out-of-memory
    error (out_of_memory) is raised as torch.OutOfMemoryError on every rank."""
    device = _header_device(group)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{op}: the vocab-parallel shard agreement reads a small all-gather on the host, which "
            "a CUDA graph cannot capture; pass check_shard_agreement=False inside the capture (the "
            "caller then guarantees equal rows and V_local on every rank)")
    world = dist.get_world_size(group)
    checksum = None
    if target is not None and error is None:  # a rejected rank's targets may not be readable
        try:  # its temporaries (8 B a target) may not fit: then that is this rank's rejection
            checksum = _target_checksum(target, device)
        except Exception as failure:  # noqa: BLE001 (any failure here must reach every rank)
            error, out_of_memory = f"the targets' checksum: {failure}", is_out_of_memory(failure)
    # Everything the exchange needs, before its first collective: a rank that failed to allocate
    # between the two gathers (the error path, likeliest right after an out-of-memory) would
    # leave the others in the second.
    kind = 0 if error is None else 2 if out_of_memory else 1
    mine = torch.tensor([rows, v_local, options & (2**63 - 1), kind, chunk_rows, 0],
                        dtype=torch.int64, device=device)
    if checksum is not None:
        mine[5:] = checksum
    every = torch.empty(world * _HEADER, dtype=torch.int64, device=device)
    msg = torch.empty(_MESSAGE_BYTES, dtype=torch.uint8, device=device)  # read only if rejected
    msgs = torch.empty(world * _MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if error is not None:
        text = error.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
        msg.copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
    else:  # the options as text (unit-separated pairs), sent only if the fingerprints differ
        text = "\x1f".join(getattr(options, "pairs", ())).encode()
        options_text = torch.frombuffer(bytearray(text[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")),
                                        dtype=torch.uint8)
    dist.all_gather_into_tensor(every, mine, group=group)
    headers = every.view(world, _HEADER).tolist()
    rejected = [r for r, h in enumerate(headers) if h[3]]
    reason = None
    if rejected:  # every rank takes part in the second gather, whichever error is reported
        dist.all_gather_into_tensor(msgs, msg, group=group)
        first = rejected[0]
        raw = bytes(msgs.view(world, _MESSAGE_BYTES)[first].cpu().tolist())
        others = f" (ranks {rejected} rejected their arguments)" if len(rejected) > 1 else ""
        text = raw.rstrip(bytes(1)).decode(errors="replace")
        text = text[len(op) + 2:] if text.startswith(f"{op}: ") else text  # (named once)
        reason = f"{op}: vocab-parallel rank {first}: {text}{others}"
        error_type = torch.OutOfMemoryError if headers[first][3] == 2 else _C.Error
        if any(headers[r][0] < 0 for r in rejected):  # before its shapes: nothing else to compare
            raise error_type(reason)
    rows0, v0, opt0, _, chunk0, sum0 = headers[0]
    for r, (rr, vv, oo, _, cc, ss) in enumerate(headers):
        if rr != rows0:
            raise _C.Error(f"{op}: vocab-parallel rows: rank {r} has {rr} rows, rank 0 has {rows0}; "
                           "expected the same rows on every rank")
        if vv != v0:
            raise _C.Error(f"{op}: vocab-parallel shard size: rank {r} has V_local {vv}, rank 0 has "
                           f"{v0}; expected equal shards on every rank")
        if rejected:  # the rest is known only where a rank's checks all passed
            continue
        if oo != opt0:  # every rank read the same headers: each takes this second gather
            msg.copy_(options_text)
            dist.all_gather_into_tensor(msgs, msg, group=group)
            texts = [bytes(row).rstrip(bytes(1)).decode(errors="replace").split("\x1f")
                     for row in msgs.view(world, _MESSAGE_BYTES).cpu().tolist()]
            # (the pairs name the option; a list of every op's options here would drift)
            raise _C.Error(f"{op}: vocab-parallel options: {_differing_option(texts[r], texts[0], r)}; "
                           "expected the same options on every rank")
        if cc != chunk0:  # a chunked op runs one collective per chunk
            raise _C.Error(f"{op}: vocab-parallel chunking: rank {r} computes {cc} tokens per chunk, "
                           f"rank 0 {chunk0}; expected the same workspace_bytes, dtype and FUSEDLOSS_LCE_BUFFERS / "
                           "FUSEDLOSS_LCE_GEMM_WORKSPACE_MIB on every rank")
        if ss != sum0:
            masked = isinstance(target, tuple)  # (the same on every rank: options agreed)
            raise _C.Error(f"{op}: vocab-parallel targets: rank {r}'s differ from rank 0's (a "
                           f"checksum of their values{', and of the loss_mask' if masked else ''}); "
                           f"expected the same targets{' and loss_mask' if masked else ''} on every rank "
                           "(each rank computes the loss of the same tokens)")
    if reason is not None:
        raise error_type(reason)


def is_out_of_memory(error) -> bool:
    """Whether `error` is an allocator's out of memory: torch's (CUDA: torch.OutOfMemoryError;
    host: a RuntimeError of its CPU allocator), Python's or a C++ std::bad_alloc (MemoryError)."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


class rank_checks:
    """The local checks of one vocab-parallel call, as a with-block (local work only: no
    collective inside). With the agreement on (check) and a group of size > 1, an exception
    raised inside (a bad argument, an overflow converting one) does not leave this rank alone:
    it becomes this rank's rejection in agree(), which every rank then raises at the same call;
    a block that passes takes part in agree() with its shapes (unless only_on_error: the op's
    forward agrees later). Otherwise errors propagate as they are. rows, v_local, chunk_rows and
    target may be set inside the block. Whatever may fail on one rank alone (a conversion, an
    allocation: out of memory) belongs inside it, before the collectives that follow: a rank
    that raised outside would leave the others waiting in them.

    While torch.compile traces, no collective can run: with defer_when_compiling (a public
    function's argument checks) the rejection is kept in `deferred` and the exception
    suppressed, and the caller returns deferred_rejection(...), an op that takes part in the
    agreement when the graph runs (so the other ranks, waiting in their op's agreement, raise
    the same error); other blocks let the exception propagate while tracing."""

    def __init__(self, group, check, op, rows=-1, v_local=-1, options=0, only_on_error=False,
                 defer_when_compiling=False):
        self.group, self.check, self.op = group, check, op
        self.rows, self.v_local, self.options = rows, v_local, options
        self.only_on_error, self.chunk_rows, self.target = only_on_error, 0, None
        self.defer_when_compiling, self.deferred = defer_when_compiling, None

    def __enter__(self):
        return self

    def __exit__(self, kind, error, _traceback):
        if self.group is None or not self.check:
            return False
        if kind is not None and not issubclass(kind, Exception):
            return False  # an interrupt: nothing to agree on
        if torch.compiler.is_compiling():
            if kind is None or not self.defer_when_compiling:
                return False
            self.deferred = str(error)
            return True
        if kind is None and self.only_on_error:
            return False
        agree(self.group, self.rows, self.v_local, self.options,
              None if error is None else str(error), self.op, self.chunk_rows, self.target,
              error is not None and is_out_of_memory(error))
        return False  # a rejection raised in agree(); a passing block has nothing to suppress


@torch.library.custom_op("fusedloss::vocab_parallel_rejection", mutates_args=())
def _rejection(like: torch.Tensor, shape: List[int], group: str, op: str,
               message: str) -> torch.Tensor:
    agree(resolve_group(group), -1, -1, 0, message, op)  # raises on every rank
    raise AssertionError(f"{op}: a rejection passed the agreement")


@_rejection.register_fake
def _rejection_fake(like, shape, group, op, message):
    return like.new_empty(shape, dtype=torch.float32)


# the graph of a training step differentiates the loss: the rejection raises before that runs
_rejection.register_autograd(lambda ctx, grad: (None,) * 5)


def deferred_rejection(args, reduction, target, group: str, op: str, message: str):
    """The loss a traced call whose arguments were rejected returns: when the graph runs, it
    takes part in the agreement as this rank's rejection and raises there, as the other ranks
    do in their op's agreement. It has the shape a valid call would have (the target's for
    reduction 'none'), so the code after the call traces on every rank. `args`: the call's
    arguments (a tensor among them gives the device)."""
    like = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if like is None:
        like = torch.empty(0)
    shape = list(target.shape) if reduction == "none" and isinstance(target, torch.Tensor) else []
    return _rejection(like, shape, group, op, message)


class _SumOverGroup(torch.autograd.Function):
    """Each rank's partial values summed over the group. The loss they enter is the same on
    every rank and each rank differentiates its own copy, so each part takes the upstream
    gradient as it is (Megatron's reduce from the tensor-parallel region)."""

    @staticmethod
    def forward(ctx, part, group):
        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GradSummedOverGroup(torch.autograd.Function):
    """The identity, whose gradient is summed over the group: for a tensor every rank holds
    whole (the hidden states) and differentiates through its own shard, when the caller asked
    for the summed gradient rather than this rank's partial one."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatheredRows(torch.autograd.Function):
    """Every rank's slice of rows, in rank order along dim 0; the gradient of this rank's slice
    is its rows of the gradient summed over the group (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.world = group, dist.get_world_size(group)
        out = x.new_empty((ctx.world * x.size(0), *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        mine = grad.new_empty((grad.size(0) // ctx.world, *grad.shape[1:]))
        dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
        return mine, None


def sum_over_group(part, group):
    """Partial values summed over `group` (None: as they are); the gradient passes unchanged."""
    return part if group is None else _SumOverGroup.apply(part, group)


def grad_summed_over_group(x, group):
    """x itself, its gradient summed over `group` (None: x, its gradient as it is)."""
    return x if group is None else _GradSummedOverGroup.apply(x, group)


def gathered_rows(x, group):
    """Every rank's x along dim 0, its gradient reduce-scattered back to each rank's slice."""
    return _GatheredRows.apply(x, group)

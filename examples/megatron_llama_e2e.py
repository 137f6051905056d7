"""Megatron-core end to end at a Llama shape (GPU-bound): native, then each fusedloss patch
switched on in turn, each configuration in its own process so memory numbers do not leak.

    python3 examples/megatron_llama_e2e.py --smoke --out gpu-out/smoke   # tiny shapes, 3 steps
    python3 examples/megatron_llama_e2e.py --out gpu-out                 # within --budget-s 480
    python3 examples/megatron_llama_e2e.py --dry-run                     # the plan, no GPU needed

Per configuration (local spec, single GPU, megatron parallel_state at TP=1):
  train       2 layers, hidden 4096, FFN 14336, 32 heads (8 KV groups), V 128256, seq 4096,
              micro-batch 2, RMSNorm, SwiGLU, RoPE, bf16: ms/step and tokens/s (median after
              warm-up, device-synchronised), peak memory, the loss curve (same seed, same data)
  kernels     two steps under torch.profiler: device time per step by kernel class (GEMMs,
              softmax, optimizer, fusedloss, the rest), which bounds what any patch can gain
  snapshot    one step under torch.cuda.memory._record_memory_history: where the peak is
              (phase, what is alive, the allocation that reached it)
  loss-bound  the Llama shape at V 256000, where the loss sets the peak: peak memory
  max-batch   the largest micro-batch that fits (native and the most patched configuration this
              fusedloss offers), within MAX_BATCH_S (60 s; FUSEDLOSS_E2E_MAX_BATCH_S)
  fp32        the loss curve in fp32 at a smaller shape (hidden 1024), held to 1e-3 of native
  tiny        the 4-layer hidden-512 model, 50 steps, median of 3 runs (host overhead), every
              configuration in one process with the runs interleaved (the host's speed drifts)
Writes <date>-<gpu>-megatron-llama{,-loss,-kernels}.csv, .png and .txt into --out (megatron_e2e_report.py,
tested on CPU); exits non-zero when a configuration or task failed, a loss curve left tolerance,
or (not in --smoke) a task was not started within --budget-s.
"""
import argparse
import dataclasses
import gc
import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "bench")]  # the report; bench/peers.py
from megatron_e2e_report import (fold_profile, kernel_classes, max_batch_summary, report,  # noqa: E402
                                  summarise_trace)
from peers import StreamOrderedPool  # noqa: E402

# name -> apply_fusedloss_to_megatron(...) options, each adding one patch (None: Megatron as is)
CONFIGS = {
    "native": None,
    "ce+swiglu": dict(cross_entropy=True, swiglu=True, rms_norm=False),
    "+rmsnorm": dict(cross_entropy=True, swiglu=True, rms_norm=True),
    "+linear-ce": dict(cross_entropy=True, swiglu=True, rms_norm=True, linear_cross_entropy=True,
                       linear_cross_entropy_backward="auto"),  # 3 GEMMs with the loss_mask
    # the same with chunks of 4096 tokens at V 128256 (fewer passes over the fp32 dweight)
    "+linear-ce-1gib": dict(cross_entropy=True, swiglu=True, rms_norm=True, linear_cross_entropy=True,
                            linear_cross_entropy_backward="auto", linear_cross_entropy_workspace_bytes=1 << 30),
    # the head's default: 4 GEMMs, 4 B/token kept (in_forward keeps dweight [V, H] in fp32)
    "+linear-ce-recompute": dict(cross_entropy=True, swiglu=True, rms_norm=True,
                                 linear_cross_entropy=True, linear_cross_entropy_backward="recompute"),
}
TASKS = ("train", "kernels", "snapshot", "loss-bound", "max-batch", "fp32", "tiny")  # most wanted first
# the micro-batch search's own bound (it also stops at the configuration's deadline);
# FUSEDLOSS_E2E_MAX_BATCH_S for a run of that task alone (native's search needs more than 60 s
# on an H200: 7-9 were left untried at 6 fitting, 10 not)
MAX_BATCH_S = float(os.environ.get("FUSEDLOSS_E2E_MAX_BATCH_S", "60"))


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    batch: int

    @property
    def tokens(self):
        return self.batch * self.seq


# task -> (shape, steps, warm-up steps left out of the timing)
PLANS = {
    "full": {"train": (Shape(2, 4096, 14336, 32, 8, 128256, 4096, 2), 24, 3),
             "kernels": (Shape(2, 4096, 14336, 32, 8, 128256, 4096, 2), 2, 2),  # 2 profiled
             "snapshot": (Shape(2, 4096, 14336, 32, 8, 128256, 4096, 2), 1, 1),  # 1 recorded
             "fp32": (Shape(2, 1024, 3584, 8, 2, 128256, 1024, 2), 20, 3),
             "loss-bound": (Shape(2, 4096, 14336, 32, 8, 256000, 4096, 2), 3, 1),
             "tiny": (Shape(4, 512, 2048, 8, 8, 32768, 1024, 4), 50, 5),
             "max-batch": (Shape(2, 4096, 14336, 32, 8, 128256, 4096, 2), 64, 0)},  # steps: cap
    "smoke": {"train": (Shape(1, 256, 512, 4, 2, 4096, 256, 2), 3, 1),
              "kernels": (Shape(1, 256, 512, 4, 2, 4096, 256, 2), 1, 1),
              "snapshot": (Shape(1, 256, 512, 4, 2, 4096, 256, 2), 1, 1),
              "fp32": (Shape(1, 256, 512, 4, 2, 4096, 256, 2), 3, 1),
              "loss-bound": (Shape(1, 256, 512, 4, 2, 16384, 256, 2), 3, 1),
              "tiny": (Shape(1, 256, 512, 4, 2, 4096, 256, 2), 3, 1),
              "max-batch": (Shape(1, 256, 512, 4, 2, 4096, 256, 2), 4, 0)},
}
TINY_RUNS = 5
TINY_CHILD = "tiny-interleaved"  # the process that runs the tiny model of every configuration
TINY_SHARE = 0.5  # its weight in the time budget, beside a configuration's 1 (time_share)


# ---------------------------------------------------------------- the model (child process)

def build(shape, dtype, seed=1234):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    bf16 = dtype == "bf16"
    cfg = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads, num_query_groups=shape.kv_heads, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True,
        add_bias_linear=False, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native",
        hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=shape.vocab, max_sequence_length=shape.seq,
                     position_embedding_type="rope", rotary_base=500000).cuda()
    return Float16Module(cfg, model) if bf16 else model


class Trainer:
    """A model, AdamW and a fixed corpus of 8 micro-batches (cycled, so the loss goes down)
    drawn from one seed: every configuration sees the same weights and the same data."""

    def __init__(self, shape, dtype):
        self.shape = shape
        self.model = build(shape, dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        g = torch.Generator(device="cuda").manual_seed(99)
        self.corpus = torch.randint(0, shape.vocab, (8, shape.batch, shape.seq + 1), device="cuda",
                                    generator=g)
        self.mask = torch.triu(torch.ones(1, 1, shape.seq, shape.seq, device="cuda", dtype=torch.bool),
                               diagonal=1)

    def step(self, tokens, mark=lambda phase: None):
        """One training step on tokens [b, seq + 1]; mark(phase) at each phase's start."""
        self.opt.zero_grad(set_to_none=True)
        mark("forward")
        pos = torch.arange(self.shape.seq, device="cuda").unsqueeze(0).expand(tokens.size(0), -1)
        # as pretrain_gpt's forward_step and loss_func: the loss_mask goes to the model (the
        # fused head then computes its gradients in the forward) and weights the per-token loss
        loss_mask = torch.ones(tokens.size(0), self.shape.seq, device="cuda")
        per_token = self.model(tokens[:, :-1], pos, self.mask, labels=tokens[:, 1:],
                               loss_mask=loss_mask)
        loss = (per_token.float().view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
        mark("backward")
        loss.backward()
        mark("optimizer")
        self.opt.step()
        return loss

    def train(self, steps, warmup):
        """Median ms/step after `warmup`; peak memory is torch's allocator's plus the
        stream-ordered pool's (fusedloss's scratch; an upper bound where the two peak apart)."""
        losses, ms = [], []
        torch.cuda.reset_peak_memory_stats()
        pool = StreamOrderedPool()
        pool.reset()
        for i in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = self.step(self.corpus[i % len(self.corpus)])
            torch.cuda.synchronize()
            ms.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss.item())
        median = statistics.median(ms[warmup:])
        return dict(losses=losses, step_ms=ms, median_ms=median, tokens_per_s=self.shape.tokens / median * 1e3,
                    peak_mib=(torch.cuda.max_memory_allocated() + pool.extra(0)) / 2**20)


def task_tiny_interleaved(configs, shape, steps, warmup, runs=TINY_RUNS):
    """The tiny model is host-bound, and a host's speed drifts by tens of percent from one
    minute to the next (one configuration measured 13.3 and 19.9 ms/step on the same kind of
    machine): every configuration is built in this one process and the runs interleave (each
    round runs every configuration's `steps` steps, in an order rotated per round), so drift falls
    on all of them alike. The patch is switched between configurations outside the timed steps:
    what it replaces is looked up when called, and the norms were built under their own."""
    from fusedloss.megatron import apply_fusedloss_to_megatron, unpatch_megatron

    def use(config):
        options = CONFIGS[config]
        unpatch_megatron() if options is None else apply_fusedloss_to_megatron(**options)

    trainers = {}
    for config in configs:
        use(config)
        trainers[config] = Trainer(shape, "bf16")
    measured = {config: [] for config in configs}
    for r in range(runs):
        for config in configs[r % len(configs):] + configs[:r % len(configs)]:
            use(config)
            measured[config].append(trainers[config].train(steps, warmup))
    unpatch_megatron()
    return {config: dict(median_ms=statistics.median(run["median_ms"] for run in done),
                         runs=[{k: run[k] for k in ("median_ms", "peak_mib")} for run in done])
            for config, done in measured.items()}


def _phase_marker(phase):
    """A 1-element allocation whose stack names this function: the phase boundary in the trace."""
    del phase
    torch.empty(1, device="cuda")


def task_snapshot(shape, _recorded, warmup):
    """`warmup` steps, then one under the allocator's history recording."""
    t = Trainer(shape, "bf16")
    for i in range(warmup):  # optimizer state allocated, kernels compiled
        t.step(t.corpus[i])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    phases = []
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=1_000_000)
    try:
        t.step(t.corpus[warmup], mark=lambda p: (phases.append(p), _phase_marker(p)))
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    summary = summarise_trace(trace, base, phases, known_sizes(shape))
    summary["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return summary


def task_kernels(shape, steps, warmup):
    """`warmup` steps, then `steps` under torch.profiler: device time per kernel class and
    step, and the ten longest kernels (what a reader checks the classes against). The kernels
    of ops that take the attention scores (scale, mask, casts around the local spec's unfused
    softmax) are told apart by the launching op's input shapes (fold_profile)."""
    from torch.profiler import ProfilerActivity, profile

    t = Trainer(shape, "bf16")
    for i in range(warmup):
        t.step(t.corpus[i])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for i in range(steps):
            t.step(t.corpus[warmup + i])
        torch.cuda.synchronize()
    kernels, attention_us = fold_profile(prof.events(), shape.seq)
    longest = sorted(kernels.items(), key=lambda kv: -kv[1])[:10]
    return dict(by_class=kernel_classes(kernels, steps, attention_us),
                longest=[(name[:160], us / 1e3 / steps) for name, us in longest])


def task_max_batch(shape, cap, _warmup, deadline):
    t = Trainer(shape, "bf16")
    _try_step(t, 1)  # the optimizer state exists before anything is measured

    pool = StreamOrderedPool()

    def step(b):  # (fits, peak MiB: torch's allocator's and the stream-ordered pool's), all freed afterwards
        pool.reset()
        ok = _try_step(t, b)
        peak = (torch.cuda.max_memory_allocated() + pool.extra(0)) / 2**20 if ok else None
        t.opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return ok, peak

    return search_max_batch(step, cap, torch.cuda.mem_get_info()[1] / 2**20, deadline)


def search_max_batch(step, cap, limit_mib, deadline):
    """step(b) -> (fits, peak MiB) for micro-batches 1 and 2, then the line through the two
    largest that fit predicts the largest; once an OOM brackets it, bisection; until the
    largest fit and the first OOM are adjacent, the cap is reached or the deadline passes."""
    tries = []  # (micro-batch, fits, peak MiB)

    def fits(b):
        tries.append((b, *step(b)))
        return tries[-1][1]

    if fits(1) and fits(2):
        while time.time() < deadline:
            fit = sorted((b, p) for b, ok, p in tries if ok)
            lo = fit[-1][0]
            hi = min((b for b, ok, _ in tries if not ok and b > lo), default=None)
            if lo >= cap or hi == lo + 1:
                break
            if hi is None:
                (b1, p1), (b2, p2) = fit[-2:]
                slope = max((p2 - p1) / (b2 - b1), 1.0)
                fits(min(cap, max(lo + 1, b2 + int((limit_mib * 0.97 - p2) / slope))))
            else:
                fits((lo + hi) // 2)
    return dict(max_batch_summary(tries), cap=cap, limit_mib=limit_mib, tries=tries)


def _try_step(t, batch):
    torch.cuda.reset_peak_memory_stats()
    tokens = torch.randint(0, t.shape.vocab, (batch, t.shape.seq + 1), device="cuda")
    try:
        t.step(tokens)
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False  # the step's frames (and their tensors) go with the exception
    except RuntimeError as e:  # an allocation outside torch's allocator (cuBLAS workspace, ...)
        if "out of memory" in str(e) or "ALLOC_FAILED" in str(e):
            return False
        raise


def known_sizes(shape):
    """Sizes in bytes (as the allocator trace records them: requested) of the tensors a reader
    will look for, by name."""
    t, v, h = shape.tokens, shape.vocab, shape.hidden
    scores = shape.batch * shape.heads * shape.seq * shape.seq
    named = {"logits bf16 [T,V]": 2 * t * v, "logits fp32 [T,V]": 4 * t * v,
             "attention scores bf16 [b,heads,s,s]": 2 * scores, "attention scores fp32": 4 * scores,
             "fc1 output bf16 [T,2*ffn]": 4 * t * shape.ffn, "embedding/output weight bf16 [V,H]": 2 * v * h,
             "embedding/output weight fp32 [V,H]": 4 * v * h}
    return {size: name for name, size in reversed(named.items())}  # first name wins a tie


# ---------------------------------------------------------------- child and parent

def child(args):
    out = dict(config=args.child, status="ok", tasks={})

    def save():  # after every task, so a crash or a kill keeps what was measured
        with open(args.result, "w") as fh:
            json.dump(out, fh)

    # megatron-core's import-time notes about TransformerEngine and Apex (absent by design)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|TransformerEngine).*")
    options = None if args.child == TINY_CHILD else CONFIGS[args.child]
    if options is not None:
        from fusedloss.megatron import apply_fusedloss_to_megatron
        try:
            apply_fusedloss_to_megatron(**options)
        except TypeError as e:  # an option this fusedloss does not have yet; any other error raises
            if "unexpected keyword argument" not in str(e):
                raise
            out.update(status="unavailable", error=f"apply_fusedloss_to_megatron({options}): {e}")
            return save()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the tight check
    plan = PLANS["smoke" if args.smoke else "full"]
    if args.child == TINY_CHILD:  # the tiny model of every configuration in --configs
        try:
            out["tiny"] = task_tiny_interleaved(args.configs.split(","), *plan["tiny"])
        except Exception as e:
            traceback.print_exc()
            out.update(status="failed", error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
        dist.destroy_process_group()
        return save()
    for task in args.tasks.split(","):
        if time.time() > args.deadline:
            out["tasks"][task] = dict(skipped=f"time budget spent before {task}")
            continue
        shape, steps, warmup = plan[task]
        print(f"[{args.child}] {task}: {shape}", flush=True)
        try:
            if task == "snapshot":
                res = task_snapshot(shape, steps, warmup)
            elif task == "kernels":
                res = task_kernels(shape, steps, warmup)
            elif task == "max-batch":
                res = task_max_batch(shape, steps, warmup, min(args.deadline, time.time() + MAX_BATCH_S))
            else:
                res = Trainer(shape, "fp32" if task == "fp32" else "bf16").train(steps, warmup)
        except Exception as e:  # reported, and the next task still runs
            traceback.print_exc()  # in full above; the summary keeps its first line
            res = dict(error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
        out["tasks"][task] = res
        print(f"[{args.child}] {task}: " + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()
            if not isinstance(v, (list, dict))), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        save()
    dist.destroy_process_group()
    return save()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offered_configs(configs):
    """The configurations whose options this fusedloss's patch takes."""
    from fusedloss.megatron import apply_fusedloss_to_megatron
    params = inspect.signature(apply_fusedloss_to_megatron).parameters
    return [c for c in configs if CONFIGS[c] is None or all(k in params for k in CONFIGS[c])]


def plan_tasks(configs, tasks):
    """config -> its tasks: the largest-micro-batch search only for native and the most patched
    configuration this fusedloss offers (the two numbers a user compares)."""
    offered = offered_configs(configs)
    ends = {"native", offered[-1] if offered else None}
    return {c: [t for t in tasks if t != "max-batch" or c in ends] for c in configs}


def time_share(config, tasks):
    """A configuration's weight in the time budget: native compiles Megatron's fused kernels
    (torch.compile) for every shape; the largest-micro-batch search takes a dozen steps."""
    return (2.0 if config == "native" else 1.0) + (0.3 if "max-batch" in tasks else 0.0)


def _run_child(args, name, path, deadline, extra):
    """(exit code or None when killed, its JSON or None, the error to report)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--result", path,
           "--deadline", str(deadline)] + extra + (["--smoke"] if args.smoke else [])
    print(f"== {name}", flush=True)
    try:
        rc = subprocess.run(cmd, env=dict(os.environ, MASTER_PORT=str(_free_port())),
                            timeout=max(deadline - time.time(), 0) + 30).returncode
        error = f"process exit {rc}"
    except subprocess.TimeoutExpired:
        rc, error = None, "killed 30 s past its time budget"
    try:
        with open(path) as fh:
            return rc, json.load(fh), error
    except (OSError, ValueError):  # died before its first report
        return rc, None, error


def run_children(args):
    """Each configuration in its own process, within its weighted share of the time left; then
    the tiny model of every configuration in one process (task_tiny_interleaved)."""
    results, end = {}, time.time() + args.budget_s
    configs = args.configs.split(",")
    tasks = plan_tasks(configs, args.tasks.split(","))
    tiny = [c for c in offered_configs(configs) if "tiny" in tasks[c]]
    tasks = {c: [t for t in tasks[c] if t != "tiny"] for c in configs}
    shares = {c: time_share(c, tasks[c]) for c in configs if tasks[c]}  # e.g. --tasks max-batch leaves two
    tiny_share = TINY_SHARE if tiny else 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(configs):
            if config not in shares:
                results[config] = dict(config=config, status="ok", tasks={})
                continue
            share = shares[config] / (sum(shares[c] for c in configs[i:] if c in shares) + tiny_share)
            deadline = time.time() + (end - time.time()) * share
            rc, res, error = _run_child(args, config, os.path.join(tmp, f"{i}.json"), deadline,
                                        ["--tasks", ",".join(tasks[config])])
            results[config] = res or dict(status="failed", tasks={})
            if rc != 0:
                results[config].update(status="failed", error=error)
        if tiny:
            rc, res, error = _run_child(args, TINY_CHILD, os.path.join(tmp, "tiny.json"), end,
                                        ["--configs", ",".join(tiny)])
            for config in tiny:
                got = (res or {}).get("tiny", {}).get(config)
                if got is None:  # a configuration that failed on its own says so already
                    got = dict(error=(res or {}).get("error") or f"tiny model run: {error}")
                if results[config].get("status") == "ok":
                    results[config]["tasks"]["tiny"] = got
    return results


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu-out")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 3 steps: catches errors cheaply")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from " + ", ".join(CONFIGS))
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated, from " + ", ".join(TASKS))
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget for all configurations (default 100 smoke, 480 full: six "
                         "configurations, two of them searching their largest micro-batch); "
                         "a task not started by its configuration's share is reported as a failure")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, allowed in (("configs", CONFIGS), ("tasks", TASKS)):
        bad = [v for v in getattr(args, name).split(",") if v not in allowed]
        if bad:
            ap.error(f"--{name}: {', '.join(bad)} not one of {', '.join(allowed)}")
    if args.budget_s is None:
        args.budget_s = 100.0 if args.smoke else 480.0
    return args


def main(argv=None):
    args = parse_args(argv)
    plan = PLANS["smoke" if args.smoke else "full"]
    if args.dry_run:
        print(f"configs {args.configs}; tasks {args.tasks}; budget {args.budget_s:.0f} s")
        for task, (shape, steps, warmup) in plan.items():
            print(f"  {task:<11}{shape} steps {steps} warm-up {warmup}")
        return 0
    if not torch.cuda.is_available():
        print("megatron_llama_e2e.py needs a CUDA GPU (Megatron's GPTModel); none is usable here")
        return 2
    if args.child:
        child(args)
        return 0
    failures = report(run_children(args), args.out, args.smoke, plan)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Megatron-core end to end at a Llama shape (GPU-bound): native, then each fusedloss patch
switched on in turn, each configuration in its own process so memory numbers do not leak.

    python3 examples/megatron_llama_e2e.py --smoke --out gpu-out/smoke   # tiny shapes, 3 steps
    python3 examples/megatron_llama_e2e.py --out gpu-out                 # within --budget-s 250
    python3 examples/megatron_llama_e2e.py --dry-run                     # the plan, no GPU needed

Per configuration (local spec, single GPU, megatron parallel_state at TP=1):
  train       2 layers, hidden 4096, FFN 14336, 32 heads (8 KV groups), V 128256, seq 4096,
              micro-batch 2, RMSNorm, SwiGLU, RoPE, bf16: ms/step and tokens/s (median after
              warm-up, device-synchronised), peak memory, the loss curve (same seed, same data)
  snapshot    one step under torch.cuda.memory._record_memory_history: where the peak is
              (phase, what is alive, the allocation that reached it)
  fp32        the loss curve in fp32 at a smaller shape (hidden 1024), held to 1e-3 of native
  loss-bound  the Llama shape at V 256000, where the loss sets the peak: peak memory
  tiny        the 4-layer hidden-512 model, 50 steps, median of 3 runs (host overhead)
  max-batch   the largest micro-batch that fits (native and the fully patched configurations)
Writes <date>-<gpu>-megatron-llama{,-loss}.csv, .png and .txt into --out; exits non-zero when a
configuration failed, a task did not finish within --budget-s, or a loss curve left tolerance.
"""
import argparse
import dataclasses
import gc
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import peers  # noqa: E402  (write_csv, pyplot: the benchmarks' one home for both)

# name -> apply_fusedloss_to_megatron(...) options, each adding one patch (None: Megatron as is)
CONFIGS = {
    "native": None,
    "ce+swiglu": dict(cross_entropy=True, swiglu=True, rms_norm=False),
    "+rmsnorm": dict(cross_entropy=True, swiglu=True, rms_norm=True),
    "+linear-ce": dict(cross_entropy=True, swiglu=True, rms_norm=True, linear_cross_entropy=True),
}
MAX_BATCH_CONFIGS = ("native", "+rmsnorm", "+linear-ce")  # native and the fully patched ones
TASKS = ("train", "snapshot", "fp32", "loss-bound", "tiny", "max-batch")  # most wanted first
TOLERANCE = {"bf16": 5e-2, "fp32": 1e-3}  # largest relative loss difference from native


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
             "snapshot": (Shape(2, 4096, 14336, 32, 8, 128256, 4096, 2), 1, 1),  # 1 recorded
             "fp32": (Shape(2, 1024, 3584, 8, 2, 128256, 1024, 2), 20, 3),
             "loss-bound": (Shape(2, 4096, 14336, 32, 8, 256000, 4096, 2), 3, 1),
             "tiny": (Shape(4, 512, 2048, 8, 8, 32768, 1024, 4), 50, 5),
             "max-batch": (Shape(2, 4096, 14336, 32, 8, 128256, 4096, 2), 64, 0)},  # steps: cap
    "smoke": {"train": (Shape(1, 256, 512, 4, 2, 4096, 256, 2), 3, 1),
              "snapshot": (Shape(1, 256, 512, 4, 2, 4096, 256, 2), 1, 1),
              "fp32": (Shape(1, 256, 512, 4, 2, 4096, 256, 2), 3, 1),
              "loss-bound": (Shape(1, 256, 512, 4, 2, 16384, 256, 2), 3, 1),
              "tiny": (Shape(1, 256, 512, 4, 2, 4096, 256, 2), 3, 1),
              "max-batch": (Shape(1, 256, 512, 4, 2, 4096, 256, 2), 4, 0)},
}
TINY_RUNS = 3


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
        loss = self.model(tokens[:, :-1], pos, self.mask, labels=tokens[:, 1:]).float().mean()
        mark("backward")
        loss.backward()
        mark("optimizer")
        self.opt.step()
        return loss

    def train(self, steps, warmup):
        losses, ms = [], []
        torch.cuda.reset_peak_memory_stats()
        for i in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = self.step(self.corpus[i % len(self.corpus)])
            torch.cuda.synchronize()
            ms.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss.item())
        median = statistics.median(ms[warmup:])
        return dict(losses=losses, step_ms=ms, median_ms=median, tokens_per_s=self.shape.tokens / median * 1e3,
                    peak_mib=torch.cuda.max_memory_allocated() / 2**20)


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


def task_max_batch(shape, cap, _warmup, deadline):
    t = Trainer(shape, "bf16")
    _try_step(t, 1)  # the optimizer state exists before anything is measured

    def step(b):  # (fits, peak MiB), everything freed afterwards
        ok = _try_step(t, b)
        peak = torch.cuda.max_memory_allocated() / 2**20 if ok else None
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


def max_batch_summary(tries):
    """largest micro-batch seen to fit, the smallest seen not to above it, and whether they are
    adjacent (the answer is confirmed, not cut short by the time budget or the cap)."""
    largest = max((b for b, ok, _ in tries if ok), default=0)
    oom = min((b for b, ok, _ in tries if not ok and b > largest), default=None)
    return dict(largest=largest, first_oom=oom, confirmed=oom == largest + 1)


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


# ---------------------------------------------------------------- pure helpers (tested on CPU)

def _where(frames, depth=2):
    """The innermost `depth` frames outside torch, shortened: 'megatron/core/x.py:12 fn < ...'."""
    keep = [f for f in frames if "/torch/" not in f["filename"] and "torchinductor" not in f["filename"]
            and f["name"] != "<module>"]  # inductor's generated code: its caller says more
    if not keep:
        return "(no Python frame: autograd engine or torch internals)"
    short = []
    for f in keep[:depth]:
        name = f["filename"]
        for root in ("site-packages/", "dist-packages/", "/python/", "/examples/"):
            if root in name:
                name = name.split(root, 1)[1]
                break
        short.append(f"{name}:{f['line']} {f['name']}")
    return " < ".join(short)


def _replay(trace, base, phases, stop=None):
    """Walks an allocator trace from `base` bytes allocated; yields (index, bytes allocated, the
    step's live allocations {addr: (size, phase, where)}, phase) after each allocation. The
    _phase_marker allocations start the phases, in order, and count for nothing."""
    frees = {"free_completed"} if any(e["action"] == "free_completed" for e in trace) else {"free_requested"}
    total, phase, markers, live, marker_addrs = base, "before the step", 0, {}, set()
    for i, e in enumerate(trace[:stop]):
        if e["action"] == "alloc":
            frames = e.get("frames", [])
            if any(f["name"] == "_phase_marker" for f in frames):
                phase = phases[markers] if markers < len(phases) else f"phase {markers}"
                markers += 1
                marker_addrs.add(e["addr"])
                continue
            total += e["size"]
            live[e["addr"]] = (e["size"], phase, frames)
            yield i, total, live, phase
        elif e["action"] in frees:
            if e["addr"] in live:
                total -= live.pop(e["addr"])[0]
            elif e["addr"] in marker_addrs:
                marker_addrs.discard(e["addr"])
            else:
                total -= e["size"]  # held from before the step (e.g. last step's gradients)


def summarise_trace(trace, base, phases, names=None, top=8):
    """Where the peak of one recorded step is, from its allocator trace
    (torch.cuda.memory._snapshot()['device_traces'][device], sizes as requested) and the bytes
    allocated when recording began: the peak, its phase, the allocation that reached it, and
    what was alive then (bytes held from before the step; the step's own, by phase and place)."""
    names = names or {}
    peak, at = base, None
    for i, total, _, _ in _replay(trace, base, phases):
        if total > peak:
            peak, at = total, i
    out = dict(base_mib=base / 2**20, peak_mib=peak / 2**20, phase="before the step", by_place=[],
               by_phase={}, set_by=None)
    if at is None:
        return out
    *_, (_, _, live, out["phase"]) = _replay(trace, base, phases, stop=at + 1)
    size, _, frames = live[trace[at]["addr"]]
    out["set_by"] = dict(mib=size / 2**20, where=_where(frames), name=names.get(size, ""))
    groups = {}
    for size, ph, frames in live.values():
        out["by_phase"][ph] = out["by_phase"].get(ph, 0) + size / 2**20
        g = groups.setdefault((ph, _where(frames), names.get(size, "")), [0, 0])
        g[0], g[1] = g[0] + 1, g[1] + size
    out["held_from_before_mib"] = (peak - sum(s for s, *_ in live.values())) / 2**20
    out["by_place"] = [dict(phase=ph, where=w, name=n, count=c, mib=b / 2**20)
                       for (ph, w, n), (c, b) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]]
    return out


def format_peak(config, s):
    check = (f"; the trace counts requested bytes, max_memory_allocated whole blocks: "
             f"{s['max_memory_allocated_mib']:,.0f} MiB" if "max_memory_allocated_mib" in s else "")
    lines = [f"{config}: peak {s['peak_mib']:,.0f} MiB in the {s['phase']} phase "
             f"({s['base_mib']:,.0f} MiB allocated when the step began, "
             f"{s.get('held_from_before_mib', 0):,.0f} MiB of it still alive at the peak{check})"]
    if s.get("set_by"):
        b = s["set_by"]
        lines.append(f"  reached by {b['mib']:,.1f} MiB{' ' + b['name'] if b['name'] else ''} at {b['where']}")
        lines.append("  alive at the peak, allocated during the step, by phase: " + ", ".join(
            f"{ph} {mib:,.0f} MiB" for ph, mib in s["by_phase"].items()))
        for g in s["by_place"]:
            lines.append(f"  {g['mib']:>10,.1f} MiB {g['count']:>4} x  [{g['phase']}] "
                         f"{g['name'] + ' ' if g['name'] else ''}{g['where']}")
    return "\n".join(lines)


def max_rel_diff(a, b):
    n = min(len(a), len(b))
    return max((abs(x - y) / abs(x) for x, y in zip(a[:n], b[:n])), default=float("nan"))


def compare(results, plan):
    """From the children's JSON: the summary rows, the failures (a configuration or task that
    did not finish, a loss curve out of tolerance), the targets met or missed, and the notes
    (configurations this fusedloss does not offer)."""
    rows, failures, targets, notes = [], [], [], []
    logits_mib = plan["loss-bound"][0].tokens * plan["loss-bound"][0].vocab * 2 / 2**20
    native = results.get("native", {}).get("tasks", {})
    full = last_available(results)
    for config, r in results.items():
        tk = r.get("tasks", {})
        if r.get("status") == "unavailable":
            notes.append(f"{config}: unavailable: {r.get('error', '')}")
        elif r.get("status") != "ok":
            failures.append(f"{config}: {r.get('status')}: {r.get('error', '')}")
        for task, res in tk.items():
            if "error" in res or "skipped" in res:
                failures.append(f"{config} {task}: {res.get('error') or res.get('skipped')}")

        def both(task, key):  # (this configuration's, native's), when both were measured
            mine, ref = tk.get(task, {}).get(key), native.get(task, {}).get(key)
            return (mine, ref) if mine is not None and ref is not None else None

        diffs = {}
        for task, dtype in (("train", "bf16"), ("fp32", "fp32")):
            if config != "native" and both(task, "losses"):
                diffs[dtype] = max_rel_diff(*reversed(both(task, "losses")))
                if not diffs[dtype] <= TOLERANCE[dtype]:
                    failures.append(f"{config}: {dtype} loss curve {diffs[dtype]:.2e} from native "
                                    f"(tolerance {TOLERANCE[dtype]:.0e})")
        speed = both("train", "tokens_per_s")
        speed = speed and speed[0] / speed[1]
        saved = both("loss-bound", "peak_mib")
        saved = saved and saved[1] - saved[0]
        tiny = _tiny_ms(tk)
        mb = tk.get("max-batch", {})
        rows.append(dict(
            config=config, status=r.get("status"), ms_step=tk.get("train", {}).get("median_ms"),
            tokens_s=tk.get("train", {}).get("tokens_per_s"), speedup=speed,
            peak_mib=tk.get("train", {}).get("peak_mib"), bf16_rel_diff=diffs.get("bf16"),
            fp32_rel_diff=diffs.get("fp32"), peak_phase=tk.get("snapshot", {}).get("phase"),
            loss_bound_peak_mib=tk.get("loss-bound", {}).get("peak_mib"), loss_bound_saved_mib=saved,
            logits_mib=logits_mib, max_micro_batch=mb.get("largest"), first_oom=mb.get("first_oom"),
            tiny_ms_step=tiny))
        if "largest" in mb and not mb.get("confirmed"):
            notes.append(f"{config}: largest micro-batch {mb['largest']} unconfirmed (no OOM seen just "
                         f"above it: the cap of {mb.get('cap')} or the time budget came first)")
        if config == "native":
            continue
        if speed and config == full:
            targets.append(f"{config}: {speed:.3f}x native tokens/s (target >= 1.15x): "
                           f"{'met' if speed >= 1.15 else 'MISSED'}")
        if saved is not None:
            targets.append(f"{config}: loss-bound peak {saved:,.0f} MiB below native, logits "
                           f"{logits_mib:,.0f} MiB (target: at least the logits): "
                           f"{'met' if saved >= logits_mib else 'MISSED'}")
        if tiny and _tiny_ms(native):
            targets.append(f"{config}: tiny model {tiny:.2f} vs native {_tiny_ms(native):.2f} ms/step "
                           f"(median of {TINY_RUNS} runs; target no slower): "
                           f"{'met' if tiny <= _tiny_ms(native) else 'MISSED'}")
    return rows, failures, targets, notes


def _tiny_ms(tasks):
    runs = [run["median_ms"] for run in tasks.get("tiny", {}).get("runs", [])]
    return statistics.median(runs) if runs else None


def last_available(results):
    ok = [c for c, r in results.items() if r.get("status") == "ok"]
    return ok[-1] if ok else None


# ---------------------------------------------------------------- child and parent

def child(args):
    out = dict(config=args.child, status="ok", tasks={})

    def save():  # after every task, so a crash or a kill keeps what was measured
        with open(args.result, "w") as fh:
            json.dump(out, fh)

    # megatron-core's import-time notes about TransformerEngine and Apex (absent by design)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|TransformerEngine).*")
    options = CONFIGS[args.child]
    if options is not None:
        from fusedloss.megatron import apply_fusedloss_to_megatron
        try:
            apply_fusedloss_to_megatron(**options)
        except TypeError as e:  # an option this fusedloss does not have yet
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
    for task in args.tasks.split(","):
        if task == "max-batch" and args.child not in MAX_BATCH_CONFIGS:
            continue
        if time.time() > args.deadline:
            out["tasks"][task] = dict(skipped=f"time budget spent before {task}")
            continue
        shape, steps, warmup = plan[task]
        print(f"[{args.child}] {task}: {shape}", flush=True)
        try:
            if task == "snapshot":
                res = task_snapshot(shape, steps, warmup)
            elif task == "max-batch":
                res = task_max_batch(shape, steps, warmup, args.deadline)
            elif task == "tiny":
                runs = [Trainer(shape, "bf16").train(steps, warmup) for _ in range(TINY_RUNS)]
                res = dict(median_ms=statistics.median(r["median_ms"] for r in runs),
                           runs=[{k: r[k] for k in ("median_ms", "peak_mib")} for r in runs])
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


def time_share(config):
    """A configuration's weight in the time budget: native compiles Megatron's fused kernels
    (torch.compile) for every shape; the largest-micro-batch search takes a dozen steps."""
    return (2.0 if config == "native" else 1.0) + (0.3 if config in MAX_BATCH_CONFIGS else 0.0)


def run_children(args):
    """Each configuration in its own process, within its weighted share of the time left."""
    results, end = {}, time.time() + args.budget_s
    configs = args.configs.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(configs):
            share = time_share(config) / sum(time_share(c) for c in configs[i:])
            deadline = time.time() + (end - time.time()) * share
            path = os.path.join(tmp, f"{i}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--result", path,
                   "--deadline", str(deadline), "--tasks", args.tasks] + (["--smoke"] if args.smoke else [])
            print(f"== {config}", flush=True)
            try:
                rc = subprocess.run(cmd, env=dict(os.environ, MASTER_PORT=str(_free_port())),
                                    timeout=max(deadline - time.time(), 0) + 30).returncode
            except subprocess.TimeoutExpired:
                rc = "killed past its time budget"
            try:
                results[config] = json.load(open(path))
            except (OSError, ValueError):
                results[config] = dict(status="failed", tasks={})
            if rc != 0:
                results[config].update(status="failed", error=f"process exit {rc}")
    return results


def report(results, args, plan):
    rows, failures, targets, notes = compare(results, plan)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    kind = "megatron-llama" + ("-smoke" if args.smoke else "")
    meta = dict(gpu=gpu, torch=torch.__version__, megatron=_version("megatron-core"),
                commit=os.environ.get("FUSEDLOSS_COMMIT") or _git_commit())
    fmt = lambda v: f"{v:.6g}" if isinstance(v, float) else ("" if v is None else v)  # noqa: E731
    header = list(rows[0]) + list(meta) if rows else []
    peers.write_csv(args.out, gpu, kind, header, [[fmt(r[k]) for k in rows[0]] + list(meta.values())
                                                  for r in rows])
    curves = [[c, task, i, f"{loss:.6f}", f"{ms:.3f}"] for c, r in results.items()
              for task in ("train", "fp32") for i, (loss, ms) in
              enumerate(zip(r.get("tasks", {}).get(task, {}).get("losses", []),
                            r.get("tasks", {}).get(task, {}).get("step_ms", [])))]
    peers.write_csv(args.out, gpu, kind + "-loss", ["config", "task", "step", "loss", "step_ms"], curves)
    text = summary_text(rows, failures, targets + notes, results, plan, meta)
    path = os.path.join(args.out, f"{peers.today()}-{gpu.replace(' ', '-')}-{kind}.txt")
    with open(path, "w") as fh:
        fh.write(text)
    print(text)
    plot(results, rows, os.path.join(args.out, f"{peers.today()}-{gpu.replace(' ', '-')}-{kind}.png"))
    return failures


# the summary table: (header, row key, width, number format)
COLUMNS = [("config", "config", 12, ""), ("ms/step", "ms_step", 9, ".1f"), ("tokens/s", "tokens_s", 10, ",.0f"),
           ("x native", "speedup", 9, ".3f"), ("peak MiB", "peak_mib", 10, ",.0f"),
           ("bf16 diff", "bf16_rel_diff", 10, ".1e"), ("fp32 diff", "fp32_rel_diff", 10, ".1e"),
           ("LB peak MiB", "loss_bound_peak_mib", 12, ",.0f"), ("max mb", "max_micro_batch", 7, "d"),
           ("tiny ms", "tiny_ms_step", 8, ".2f")]


def _cell(value, width, spec):
    """Numbers right-aligned in their format; text (and '-': not measured) as it is; an empty
    spec (the configuration's column) left-aligned."""
    value = "-" if value is None else value
    return format(value, f"<{width}" if not spec else f">{width}{spec if not isinstance(value, str) else ''}")


def summary_text(rows, failures, targets, results, plan, meta):
    lines = ["Megatron-core end to end: " + ", ".join(f"{k} {v}" for k, v in meta.items()),
             f"train (bf16): {plan['train'][0]}", f"fp32 check: {plan['fp32'][0]}",
             f"loss-bound (LB): {plan['loss-bound'][0]}", f"tiny: {plan['tiny'][0]}", "",
             "".join(_cell(h, w, s and "s") for h, _, w, s in COLUMNS)]
    lines += ["".join(_cell(r[k], w, s) for _, k, w, s in COLUMNS) for r in rows]
    lines += ["", "Where the peak is (one step after warm-up, torch.cuda.memory._snapshot):"]
    lines += [format_peak(c, r["tasks"]["snapshot"]) for c, r in results.items()
              if "peak_mib" in r.get("tasks", {}).get("snapshot", {})]
    lines += ["", "Largest micro-batch that fits (one training step each):"]
    for c, r in results.items():
        mb = r.get("tasks", {}).get("max-batch", {})
        if "largest" in mb:
            tried = ", ".join(f"{b} ({p:,.0f} MiB)" if ok else f"{b} OOM" for b, ok, p in mb["tries"])
            lines.append(f"  {c}: {mb['largest']}{'' if mb['confirmed'] else ' (unconfirmed: no OOM seen just above)'};"
                         f" tried {tried}")
    lines += ["", "Targets:"] + [f"  {t}" for t in targets]
    lines += ["", "FAILED:" if failures else "no failures"] + [f"  {f}" for f in failures]
    return "\n".join(lines) + "\n"


def plot(results, rows, path):
    """Loss curves (bf16 Llama shape, fp32 check), tokens/s, peak memory at both shapes."""
    plt = peers.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(1, 4, figsize=(20, 4.5))
    for c, r in results.items():
        for a, task in zip(ax[:2], ("train", "fp32")):
            losses = r.get("tasks", {}).get(task, {}).get("losses")
            if losses:
                a.plot(losses, label=c, linestyle="-" if c == "native" else "--")
    for a, title in zip(ax, ("loss, Llama shape, bf16", "loss, fp32 check (smaller shape)",
                             "tokens/s, Llama shape", "peak memory (GiB)")):
        a.set_title(title)
    for a in ax[:2]:
        a.set_xlabel("step")
        a.legend()
    done = [r for r in rows if r["tokens_s"]]
    ax[2].bar([r["config"] for r in done], [r["tokens_s"] for r in done])
    for i, r in enumerate(rows):
        for j, (key, label) in enumerate((("peak_mib", "Llama shape"), ("loss_bound_peak_mib", "loss-bound"))):
            if r[key]:
                ax[3].bar(i + 0.4 * j, r[key] / 1024, width=0.4, color=f"C{j}", label=label if i == 0 else None)
    ax[3].set_xticks([i + 0.2 for i in range(len(rows))], [r["config"] for r in rows])
    ax[3].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def _version(dist_name):
    try:
        from importlib.metadata import version
        return version(dist_name)
    except Exception:
        return "not installed"


def _git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu-out")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 3 steps: catches errors cheaply")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from " + ", ".join(CONFIGS))
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated, from " + ", ".join(TASKS))
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget for all configurations (default 100 smoke, 250 full); "
                         "a task not started by its configuration's share is reported as a failure")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, allowed in (("configs", CONFIGS), ("tasks", TASKS)):
        bad = [v for v in getattr(args, name).split(",") if v not in allowed]
        if bad:
            ap.error(f"--{name}: {', '.join(bad)} not one of {', '.join(allowed)}")
    if args.budget_s is None:
        args.budget_s = 100.0 if args.smoke else 250.0
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
    failures = report(run_children(args), args, plan)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""The report of examples/megatron_llama_e2e.py, apart from the GPU work so that it is tested on
CPU: where a recorded step's memory peak is (allocator trace replay), the largest-micro-batch
answer, every configuration against native (loss curves, speed, memory, targets), and the files:
summary and loss-curve CSVs, a text summary and a plot."""
import os
import re
import statistics
import subprocess

import torch

import peers  # bench/peers.py (write_csv, pyplot), put on sys.path by megatron_llama_e2e.py

TOLERANCE = {"bf16": 5e-2, "fp32": 1e-3}  # largest relative loss difference from native


def max_batch_summary(tries):
    """largest micro-batch seen to fit, the smallest seen not to above it, and whether they are
    adjacent (the answer is confirmed, not cut short by the time budget or the cap)."""
    largest = max((b for b, ok, _ in tries if ok), default=0)
    oom = min((b for b, ok, _ in tries if not ok and b > largest), default=None)
    return dict(largest=largest, first_oom=oom, confirmed=oom == largest + 1)


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
    step's live allocations {addr: (size, phase, frames)}, phase) after each allocation. The
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


# Kernel classes of one training step, by kernel name, first match wins. fusedloss's kernels
# live in its namespace; cuBLAS(Lt)'s are named gemm / xmma / nvjet / cutlass; the local spec's
# unfused attention runs torch's softmax (a log-softmax belongs to a loss: "other"); AdamW's
# foreach path runs multi_tensor_apply.
OTHER_KERNELS = "other"  # elementwise, reductions, norms, RoPE, losses: what a patch may replace
KERNEL_CLASSES = (("fusedloss", r"fusedloss"), ("GEMM", r"gemm|xmma|nvjet|cutlass|cublas"),
                  (OTHER_KERNELS, r"log_?softmax"), ("softmax", r"softmax"),
                  ("optimizer", r"multi_tensor_apply|adam"), ("memcpy/memset", r"^(Memcpy|Memset)"))


def kernel_class(name):
    for cls, pattern in KERNEL_CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return cls
    return OTHER_KERNELS


ATTENTION_KERNELS = "attention elementwise"  # "other" kernels of ops on [..., seq, seq] scores


def _is_scores(shape, seq):
    """[b * heads, s, s] or [b, heads | 1, s, s]: the attention scores or their mask (a
    [seq, seq] weight is not one, which matters when the hidden size equals seq)."""
    return isinstance(shape, (list, tuple)) and len(shape) >= 3 and shape[-1] == shape[-2] == seq


def fold_profile(events, seq):
    """torch.profiler events -> ({kernel name: device us}, us of "other" kernels launched by ops
    on the attention scores). GPU-side record_function ranges (an optimizer's step, compiled
    graphs) span kernels counted already and are left out. torch attaches each kernel to the
    one CPU event whose id is its launch's correlation id (the innermost op active then), so a
    kernel counts once."""
    kernels, attention_us = {}, 0.0
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if not getattr(e, "is_user_annotation", False):
                kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time_total
    for e in events:
        if (e.device_type != torch.autograd.DeviceType.CUDA and e.kernels
                and any(_is_scores(s, seq) for s in e.input_shapes or ())):
            attention_us += sum(k.duration for k in e.kernels
                                if k.name in kernels and kernel_class(k.name) == OTHER_KERNELS)
    return kernels, attention_us


def kernel_classes(kernels, steps, attention_us=0.0):
    """{kernel name: device microseconds over `steps` steps} -> {class: ms per step}, every
    class present (0.0 where none ran), with 'total'. attention_us: the device time of the
    "other" kernels launched by ops on the attention scores, moved into a class of its own."""
    out = {cls: 0.0 for cls, _ in KERNEL_CLASSES}
    for name, us in kernels.items():
        out[kernel_class(name)] += us / 1e3 / steps
    out[ATTENTION_KERNELS] = attention_us / 1e3 / steps
    if out[ATTENTION_KERNELS] > out[OTHER_KERNELS] * (1 + 1e-9):
        raise ValueError(f"attention kernels {out[ATTENTION_KERNELS]:.3f} ms/step exceed the other "
                         f"class's {out[OTHER_KERNELS]:.3f}: the attribution counted a kernel twice")
    out[OTHER_KERNELS] -= out[ATTENTION_KERNELS]
    out["total"] = sum(out.values())
    return out


def kernel_bound(native_kernels, native_ms):
    """The most any patch of the norms, activations and loss can speed native up: its step
    time with every kernel outside GEMMs, the attention's softmax and elementwise work and the
    optimizer taking no time at all."""
    removable = native_kernels["fusedloss"] + native_kernels[OTHER_KERNELS]
    return native_ms / max(native_ms - removable, 1e-9), removable


def max_rel_diff(a, b):
    n = min(len(a), len(b))
    return max((abs(x - y) / abs(x) for x, y in zip(a[:n], b[:n])), default=float("nan"))


def compare(results, plan, budget_cuts_fail=True):
    """From the children's JSON: the summary rows, the failures (a configuration or task that
    failed, a loss curve out of tolerance, a task the time budget cut unless budget_cuts_fail is
    False), the targets met or missed, and the notes (configurations this fusedloss does not
    offer, answers left unconfirmed, budget cuts that are not failures)."""
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
            if "error" in res:
                failures.append(f"{config} {task}: {res['error']}")
            elif "skipped" in res:
                (failures if budget_cuts_fail else notes).append(f"{config} {task}: {res['skipped']}")

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
            kn = native.get("kernels", {}).get("by_class")
            if kn and native.get("train", {}).get("median_ms"):
                bound, removable = kernel_bound(kn, native["train"]["median_ms"])
                notes.append(f"native spends {removable:.1f} ms/step in kernels outside GEMMs, the attention "
                             f"scores' softmax and elementwise work, and the optimizer (every norm, "
                             f"activation and loss kernel among them): "
                             f"removing them all would make it {bound:.3f}x faster")
            targets.append(f"{config}: {speed:.3f}x native tokens/s (target >= 1.15x): "
                           f"{'met' if speed >= 1.15 else 'MISSED'}")
        if saved is not None:
            targets.append(f"{config}: loss-bound peak {saved:,.0f} MiB below native, logits "
                           f"{logits_mib:,.0f} MiB (target: at least the logits): "
                           f"{'met' if saved >= logits_mib else 'MISSED'}")
        if tiny and _tiny_ms(native):
            targets.append(f"{config}: tiny model {tiny:.2f} vs native {_tiny_ms(native):.2f} ms/step "
                           f"(median of {len(tk['tiny']['runs'])} runs; target no slower): "
                           f"{'met' if tiny <= _tiny_ms(native) else 'MISSED'}")
    return rows, failures, targets, notes


def _tiny_ms(tasks):
    runs = [run["median_ms"] for run in tasks.get("tiny", {}).get("runs", [])]
    return statistics.median(runs) if runs else None


def last_available(results):
    ok = [c for c, r in results.items() if r.get("status") == "ok"]
    return ok[-1] if ok else None


def report(results, out_dir, smoke, plan):
    """Writes the summary CSV, the loss-curve CSV, the text summary (printed too) and the plot
    into out_dir; returns the failures."""
    # a smoke run checks that everything runs: what its budget cut is said, not failed
    rows, failures, targets, notes = compare(results, plan, budget_cuts_fail=not smoke)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    kind = "megatron-llama" + ("-smoke" if smoke else "")
    meta = dict(gpu=gpu, torch=torch.__version__, megatron=_version("megatron-core"),
                commit=os.environ.get("FUSEDLOSS_COMMIT") or _git_commit())
    fmt = lambda v: f"{v:.6g}" if isinstance(v, float) else ("" if v is None else v)  # noqa: E731
    header = list(rows[0]) + list(meta) if rows else []
    peers.write_csv(out_dir, gpu, kind, header, [[fmt(r[k]) for k in rows[0]] + list(meta.values())
                                                  for r in rows])
    curves = [[c, task, i, f"{loss:.6f}", f"{ms:.3f}"] for c, r in results.items()
              for task in ("train", "fp32") for i, (loss, ms) in
              enumerate(zip(r.get("tasks", {}).get(task, {}).get("losses", []),
                            r.get("tasks", {}).get(task, {}).get("step_ms", [])))]
    peers.write_csv(out_dir, gpu, kind + "-loss", ["config", "task", "step", "loss", "step_ms"], curves)
    classes = [[c, cls, f"{ms:.4f}"] for c, r in results.items()
               for cls, ms in r.get("tasks", {}).get("kernels", {}).get("by_class", {}).items()]
    if classes:
        peers.write_csv(out_dir, gpu, kind + "-kernels", ["config", "class", "ms_per_step"], classes)
    text = summary_text(rows, failures, targets, notes, results, plan, meta)
    path = os.path.join(out_dir, f"{peers.today()}-{gpu.replace(' ', '-')}-{kind}.txt")
    with open(path, "w") as fh:
        fh.write(text)
    print(text)
    plot(results, rows, os.path.join(out_dir, f"{peers.today()}-{gpu.replace(' ', '-')}-{kind}.png"))
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


def summary_text(rows, failures, targets, notes, results, plan, meta):
    lines = ["Megatron-core end to end: " + ", ".join(f"{k} {v}" for k, v in meta.items()),
             f"train (bf16): {plan['train'][0]}", f"fp32 check: {plan['fp32'][0]}",
             f"loss-bound (LB): {plan['loss-bound'][0]}", f"tiny: {plan['tiny'][0]}", "",
             "".join(_cell(h, w, s and "s") for h, _, w, s in COLUMNS)]
    lines += ["".join(_cell(r[k], w, s) for _, k, w, s in COLUMNS) for r in rows]
    lines += ["", "Where the peak is (one step after warm-up, torch.cuda.memory._snapshot):"]
    lines += [format_peak(c, r["tasks"]["snapshot"]) for c, r in results.items()
              if "peak_mib" in r.get("tasks", {}).get("snapshot", {})]
    kernels = {c: r["tasks"]["kernels"] for c, r in results.items() if "by_class" in r.get("tasks", {}).get("kernels", {})}
    if kernels:
        classes = list(next(iter(kernels.values()))["by_class"])
        lines += ["", "Device time per step by kernel class (ms; torch.profiler, after warm-up):",
                  "".join(_cell(h, w, s) for h, w, s in [("config", 22, "")] + [(c, 22 if c == ATTENTION_KERNELS else 14, "s") for c in classes])]
        lines += ["".join([_cell(c, 22, "")] + [_cell(k["by_class"][cls], 22 if cls == ATTENTION_KERNELS else 14, ".2f") for cls in classes])
                  for c, k in kernels.items()]
        for c, k in kernels.items():
            lines.append(f"  {c}, longest kernels (ms/step): " + "; ".join(
                f"{ms:.2f} {name[:70]}" for name, ms in k.get("longest", [])[:6]))
    lines += ["", "Largest micro-batch that fits (one training step each):"]
    for c, r in results.items():
        mb = r.get("tasks", {}).get("max-batch", {})
        if "largest" in mb:
            tried = ", ".join(f"{b} ({p:,.0f} MiB)" if ok else f"{b} OOM" for b, ok, p in mb["tries"])
            lines.append(f"  {c}: {mb['largest']}{'' if mb['confirmed'] else ' (unconfirmed: no OOM seen just above)'};"
                         f" tried {tried}")
    lines += ["", "Targets:"] + [f"  {t}" for t in targets] + ["", "Notes:"] + [f"  {n}" for n in notes]
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

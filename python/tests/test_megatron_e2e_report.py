"""examples/megatron_llama_e2e.py without a GPU (the run itself needs one): its report
(megatron_e2e_report.py: the allocator trace replay that locates the memory peak, the
micro-batch answer, the comparison of configurations against native, the files), the
micro-batch search, the options, and the one-process-per-configuration orchestration."""
import csv
import glob
import importlib.util
import json
import os
from unittest import mock

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "megatron_llama_e2e.py")
_spec = importlib.util.spec_from_file_location("megatron_llama_e2e", _PATH)
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)
import megatron_e2e_report as rep  # noqa: E402  (on sys.path once the example is loaded)

MiB = 2**20


def _frames(*where):
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


_TORCH = ("/usr/lib/python3/site-packages/torch/nn/functional.py", 10, "linear")
_ATTN = ("/usr/lib/python3/site-packages/megatron/core/transformer/dot_product_attention.py", 150, "forward")
_CE = ("/usr/lib/python3/site-packages/megatron/core/fusions/fused_cross_entropy.py", 40, "forward")
_MARK = ("/repo/examples/megatron_llama_e2e.py", 120, "_phase_marker")


def _alloc(addr, mib, *frames):
    return {"action": "alloc", "addr": addr, "size": int(mib * MiB), "frames": _frames(*frames)}


def _free(addr, mib, action="free_completed"):
    return {"action": action, "addr": addr, "size": int(mib * MiB), "frames": []}


def _trace(free_action="free_completed"):
    """100 MiB held before the step, 30 MiB of it (last step's gradients) freed at its start;
    forward allocates 10 + 45 MiB (attention) and 50 MiB (cross-entropy), backward frees the
    cross-entropy block and allocates 20 MiB with no Python frame: the peak (175 MiB) is at
    the end of the forward, reached by the 50 MiB block."""
    events = [_free(1, 30, free_action), _alloc(900, 0.0005, _MARK), _free(900, 0.0005, free_action),
              _alloc(2, 10, _TORCH, _ATTN), _alloc(3, 45, _TORCH, _ATTN), _alloc(4, 50, _CE),
              _alloc(901, 0.0005, _MARK), _free(901, 0.0005, free_action),
              _free(4, 50, free_action), _alloc(5, 20), _alloc(902, 0.0005, _MARK)]
    if free_action == "free_completed":  # torch records the request before the completion
        events = [x for ev in events for x in
                  ([dict(ev, action="free_requested"), ev] if ev["action"] == "free_completed" else [ev])]
    return events


@pytest.mark.parametrize("free_action", ["free_completed", "free_requested"])
def test_trace_replay_finds_the_peak_its_phase_and_what_is_alive(free_action):
    s = rep.summarise_trace(_trace(free_action), 100 * MiB, ["forward", "backward", "optimizer"],
                            {50 * MiB: "logits fp32 [T,V]"})
    assert s["peak_mib"] == pytest.approx(175)  # 100 - 30 + 10 + 45 + 50
    assert s["phase"] == "forward"
    assert s["set_by"] == {"mib": 50, "where": "megatron/core/fusions/fused_cross_entropy.py:40 forward",
                           "name": "logits fp32 [T,V]"}
    assert s["held_from_before_mib"] == pytest.approx(70)
    assert s["by_phase"] == {"forward": pytest.approx(105)}
    places = [(g["where"], g["count"], g["mib"]) for g in s["by_place"]]
    assert places == [("megatron/core/transformer/dot_product_attention.py:150 forward", 2, 55),
                      ("megatron/core/fusions/fused_cross_entropy.py:40 forward", 1, 50)]
    text = rep.format_peak("native", dict(s, max_memory_allocated_mib=176.0))
    assert "peak 175 MiB in the forward phase" in text and "logits fp32 [T,V]" in text
    assert "max_memory_allocated whole blocks: 176 MiB" in text


def test_trace_replay_peak_in_backward_without_python_frames():
    trace = [_alloc(900, 0.0005, _MARK), _alloc(2, 10, _ATTN), _alloc(901, 0.0005, _MARK),
             _alloc(3, 64)]
    s = rep.summarise_trace(trace, 0, ["forward", "backward"])
    assert (s["phase"], s["peak_mib"]) == ("backward", pytest.approx(74))
    assert s["set_by"]["where"].startswith("(no Python frame")
    assert s["by_phase"] == {"forward": pytest.approx(10), "backward": pytest.approx(64)}


def test_trace_replay_without_allocations_reports_the_base():
    s = rep.summarise_trace([_free(1, 5)], 8 * MiB, [])
    assert (s["peak_mib"], s["phase"], s["set_by"]) == (8, "before the step", None)


def test_known_sizes_name_the_logits_and_attention_scores():
    shape = e2e.Shape(2, 4096, 14336, 32, 8, 128256, 4096, 2)
    names = e2e.known_sizes(shape)
    assert names[2 * 8192 * 128256] == "logits bf16 [T,V]"
    assert names[4 * 8192 * 128256] == "logits fp32 [T,V]"
    assert names[2 * 2 * 32 * 4096 * 4096] == "attention scores bf16 [b,heads,s,s]"


@pytest.mark.parametrize("tries, want", [
    ([(1, True, 1), (2, True, 2), (9, True, 9), (10, True, 10), (11, False, None)], (10, 11, True)),
    ([(1, True, 1), (2, True, 2), (9, False, None), (8, False, None), (7, True, 7)], (7, 8, True)),
    ([(1, True, 1), (2, True, 2), (9, True, 9)], (9, None, False)),  # cut short: unconfirmed
    ([(1, False, None)], (0, 1, True)),
])
def test_max_batch_summary(tries, want):
    got = rep.max_batch_summary(tries)
    assert (got["largest"], got["first_oom"], got["confirmed"]) == want


def _child(losses, fp32, ms=100.0, peak=1000.0, lb_peak=30000.0, tiny=20.0, status="ok", **extra):
    tasks = {"train": dict(losses=losses, step_ms=[ms] * len(losses), median_ms=ms,
                           tokens_per_s=8192 / ms * 1e3, peak_mib=peak),
             "fp32": dict(losses=fp32, step_ms=[1.0] * len(fp32), median_ms=1.0, tokens_per_s=1.0,
                          peak_mib=1.0),
             "loss-bound": dict(peak_mib=lb_peak), "tiny": dict(runs=[dict(median_ms=tiny)] * 3)}
    return dict(config="x", status=status, tasks=dict(tasks, **extra))


def _results():
    plan = e2e.PLANS["full"]
    logits = plan["loss-bound"][0].tokens * plan["loss-bound"][0].vocab * 2 / MiB  # 4000 MiB
    return plan, logits, {
        "native": _child([10.0, 9.0, 8.0], [10.0, 9.0], tiny=20.0, snapshot=rep.summarise_trace(
            _trace(), 100 * MiB, ["forward", "backward"]), **{"max-batch": dict(
                rep.max_batch_summary([(1, True, 1), (2, True, 2), (3, False, None)]), tries=[(1, True, 1.0), (2, True, 2.0), (3, False, None)])}),
        "ce+swiglu": _child([10.0, 9.1, 8.0], [10.0, 9.0001], ms=90.0, lb_peak=30000 - logits - 1, tiny=19.0),
        "+rmsnorm": _child([10.0, 9.0, 8.0], [10.0, 9.1], ms=80.0, lb_peak=30000 - logits + 1, tiny=21.0,
                           **{"max-batch": {"skipped": "time budget spent before max-batch"}}),
        "+linear-ce": dict(config="+linear-ce", status="unavailable", tasks={},
                           error="got an unexpected keyword argument 'linear_cross_entropy'"),
    }


def test_compare_flags_curves_out_of_tolerance_and_unfinished_tasks_and_scores_targets():
    plan, logits, results = _results()
    rows, failures, targets, notes = rep.compare(results, plan)
    assert [r["config"] for r in rows] == list(results)
    assert rows[1]["speedup"] == pytest.approx(100 / 90) and rows[2]["speedup"] == pytest.approx(1.25)
    assert rows[1]["bf16_rel_diff"] == pytest.approx(0.1 / 9) and rows[1]["fp32_rel_diff"] < 1e-3
    assert rows[1]["loss_bound_saved_mib"] == pytest.approx(logits + 1)
    # +rmsnorm's fp32 curve is 1.1e-2 off (tolerance 1e-3) and its max-batch did not run
    assert failures == ["+rmsnorm max-batch: time budget spent before max-batch",
                        "+rmsnorm: fp32 loss curve 1.11e-02 from native (tolerance 1e-03)"]
    assert notes == ["+linear-ce: unavailable: got an unexpected keyword argument 'linear_cross_entropy'"]
    # the speed target is scored for the last configuration that ran (here +rmsnorm: 1.25x)
    assert [t for t in targets if "tokens/s" in t] == ["+rmsnorm: 1.250x native tokens/s (target >= 1.15x): met"]
    lb = [t for t in targets if "loss-bound" in t]
    assert lb[0].endswith("met") and lb[1].endswith("MISSED")
    tiny = [t for t in targets if "tiny" in t]
    assert tiny[0].endswith("met") and tiny[1].endswith("MISSED")


def test_an_unconfirmed_largest_micro_batch_is_noted():
    plan, _, results = _results()
    results["+rmsnorm"]["tasks"]["max-batch"] = dict(
        rep.max_batch_summary([(1, True, 1.0), (2, True, 2.0), (4, True, 4.0)]), cap=4, tries=[])
    rows, failures, _, notes = rep.compare(results, plan)
    assert rows[2]["max_micro_batch"] == 4 and not any("max-batch" in f for f in failures)
    assert notes[0] == ("+rmsnorm: largest micro-batch 4 unconfirmed (no OOM seen just above it: "
                        "the cap of 4 or the time budget came first)")


def test_a_smoke_run_notes_what_its_budget_cut_and_fails_on_errors(tmp_path):
    plan, _, results = _results()
    results["native"]["tasks"]["fp32"] = {"error": "RuntimeError: boom"}
    failures = rep.report(results, str(tmp_path), True, e2e.PLANS["smoke"])
    assert failures == ["native fp32: RuntimeError: boom"]  # +rmsnorm's max-batch cut is a note
    (text,) = glob.glob(str(tmp_path / "*-megatron-llama-smoke.txt"))
    assert "+rmsnorm max-batch: time budget spent before max-batch" in open(text).read()


def test_a_failed_child_is_a_failure_and_the_rest_still_compare():
    plan, _, results = _results()
    results["ce+swiglu"] = dict(status="failed", tasks={}, error="process exit 1")
    rows, failures, _, _ = rep.compare(results, plan)
    assert failures[0] == "ce+swiglu: failed: process exit 1"
    assert rows[1]["tokens_s"] is None and rows[2]["speedup"] == pytest.approx(1.25)


def test_report_writes_the_summary_the_curves_and_the_text(tmp_path):
    plan, _, results = _results()
    failures = rep.report(results, str(tmp_path), False, plan)
    assert len(failures) == 2
    (summary,) = glob.glob(str(tmp_path / "*-megatron-llama.csv"))
    with open(summary) as fh:
        rows = list(csv.DictReader(fh))
    assert [r["config"] for r in rows] == list(results) and rows[2]["speedup"] == "1.25"
    (curves,) = glob.glob(str(tmp_path / "*-megatron-llama-loss.csv"))
    with open(curves) as fh:
        assert len(list(csv.reader(fh))) == 1 + 3 * (3 + 2)  # header, 3 configs x (bf16 3 + fp32 2)
    (text,) = glob.glob(str(tmp_path / "*-megatron-llama.txt"))
    body = open(text).read()
    assert "FAILED:" in body and "+linear-ce: unavailable" in body and "1.250" in body
    assert "native: peak 175 MiB in the forward phase" in body and "native: 2; tried 1 (1 MiB), 2 (2 MiB), 3 OOM" in body
    table = body.split("\n\n")[1].splitlines()
    assert table[0].split() == ["config", "ms/step", "tokens/s", "x", "native", "peak", "MiB", "bf16",
                                "diff", "fp32", "diff", "LB", "peak", "MiB", "max", "mb", "tiny", "ms"]
    assert table[1].split() == ["native", "100.0", "81,920", "1.000", "1,000", "-", "-", "30,000", "2", "20.00"]
    assert len({len(line) for line in table}) == 1  # columns line up


@pytest.mark.parametrize("name,cls", [
    ("void fusedloss::cuda::(anonymous namespace)::stats_kernel<(fusedloss::core::Kind)1>(...)", "fusedloss"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "GEMM"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, "
     "c10::BFloat16, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(...)", "softmax"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(...)", "other"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "optimizer"),
    ("Memcpy DtoD (Device -> Device)", "memcpy/memset"), ("Memset (Device)", "memcpy/memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, ...>", "other"),
    ("triton_per_fused__to_copy_mul_rsqrt_0", "other"),
])
def test_kernel_classes_by_name(name, cls):
    assert rep.kernel_class(name) == cls


def test_kernel_time_per_step_by_class_and_the_bound_it_sets():
    by = rep.kernel_classes({"nvjet_a": 100e3, "nvjet_b": 20e3, "cunn_SoftMaxForward<SoftMaxForwardEpilogue>": 30e3,
                             "elementwise": 16e3, "fusedloss::x": 4e3}, steps=2, attention_us=6e3)
    assert by == {"fusedloss": 2.0, "GEMM": 60.0, "other": 5.0, "softmax": 15.0, "optimizer": 0.0,
                  "memcpy/memset": 0.0, "attention elementwise": 3.0, "total": 85.0}
    bound, removable = rep.kernel_bound(by, native_ms=100.0)
    assert removable == 7.0 and bound == pytest.approx(100 / 93)


def _event(name, device="cuda", us=0.0, kernels=(), shapes=(), annotation=False):
    from types import SimpleNamespace
    import torch
    kind = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, device_time_total=us, is_user_annotation=annotation,
                           kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
                           input_shapes=list(shapes))


def test_the_profile_fold_counts_kernels_once_and_attention_by_the_scores_shape():
    seq = 8
    events = [
        _event("masked_fill_kernel", us=30.0), _event("direct_copy_kernel", us=50.0),
        _event("nvjet_gemm", us=100.0), _event("cunn_SoftMaxForward<SoftMaxForwardEpilogue>", us=20.0),
        _event("Optimizer.step#AdamW.step", us=500.0, annotation=True),  # spans the kernels
        _event("## Call CompiledFxGraph ##", us=40.0, annotation=True),
        # the ops that launched them: masked_fill on [b, heads, s, s] scores, a cast of the
        # [b*heads, s, s] scores, a GEMM on them (not "other"), a copy of a [seq, seq] weight
        _event("aten::masked_fill_", "cpu", kernels=[("masked_fill_kernel", 30.0)],
               shapes=[[2, 4, seq, seq], [1, 1, seq, seq], []]),
        _event("aten::copy_", "cpu", kernels=[("direct_copy_kernel", 20.0)], shapes=[[8, seq, seq], [8, seq, seq]]),
        _event("aten::baddbmm", "cpu", kernels=[("nvjet_gemm", 60.0)], shapes=[[8, seq, seq]]),
        _event("aten::copy_", "cpu", kernels=[("direct_copy_kernel", 30.0)], shapes=[[seq, seq], [seq, seq]]),
        # a record_function with shapes whose GPU range is an annotation, not a kernel
        _event("CompiledFxGraph", "cpu", kernels=[("## Call CompiledFxGraph ##", 40.0)], shapes=[[2, 4, seq, seq]]),
    ]
    kernels, attention_us = rep.fold_profile(events, seq)
    assert kernels == {"masked_fill_kernel": 30.0, "direct_copy_kernel": 50.0, "nvjet_gemm": 100.0,
                       "cunn_SoftMaxForward<SoftMaxForwardEpilogue>": 20.0}
    assert attention_us == 50.0  # the masked_fill and the scores' cast; not the GEMM, the weight, the range
    by = rep.kernel_classes(kernels, steps=1, attention_us=attention_us)
    assert by["attention elementwise"] == pytest.approx(0.05) and by["other"] == pytest.approx(0.03)


def test_attention_kernels_beyond_the_other_class_are_refused():
    with pytest.raises(ValueError, match="attention kernels 0.010 ms/step exceed the other class's 0.005"):
        rep.kernel_classes({"elementwise": 5.0}, steps=1, attention_us=10.0)


def test_the_kernel_table_and_the_bound_note_come_with_kernel_measurements(tmp_path):
    plan, _, results = _results()
    for config, other in (("native", 12.5), ("ce+swiglu", 6.0)):
        results[config]["tasks"]["kernels"] = dict(
            by_class=dict(fusedloss=0.0 if config == "native" else 1.0, GEMM=60.0, other=other, softmax=15.0,
                          optimizer=2.0, **{"memcpy/memset": 0.5, "attention elementwise": 4.0}, total=94.0),
            longest=[])
    _, _, _, notes = rep.compare(results, plan)
    assert ("native spends 12.5 ms/step in kernels outside GEMMs, the attention scores' softmax and "
            "elementwise work, and the optimizer (every norm, activation and loss kernel among them): "
            "removing them all would make it 1.143x faster") in notes
    rep.report(results, str(tmp_path), False, plan)
    (text,) = glob.glob(str(tmp_path / "*-megatron-llama.txt"))
    body = open(text).read().split("Device time per step by kernel class")[1].splitlines()
    assert body[1].split() == ["config", "fusedloss", "GEMM", "other", "softmax", "optimizer", "memcpy/memset",
                               "attention", "elementwise", "total"]
    assert body[2].split() == ["native", "0.00", "60.00", "12.50", "15.00", "2.00", "0.50", "4.00", "94.00"]
    assert body[3].split()[:4] == ["ce+swiglu", "1.00", "60.00", "6.00"]
    (kernels,) = glob.glob(str(tmp_path / "*-megatron-llama-kernels.csv"))
    with open(kernels) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 * 8 and rows[2] == {"config": "native", "class": "other", "ms_per_step": "12.5000"}


def test_plot_draws_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    plan, _, results = _results()
    rows, *_ = rep.compare(results, plan)
    rep.plot(results, rows, str(tmp_path / "p.png"))
    assert os.path.getsize(tmp_path / "p.png") > 1000


def test_plot_draws_every_measured_configuration(monkeypatch):
    # pyplot stood in for by a recorder, so the drawing logic runs where matplotlib is absent
    plt = mock.MagicMock()
    ax = [mock.MagicMock() for _ in range(4)]
    plt.subplots.return_value = (mock.MagicMock(), ax)
    monkeypatch.setattr(rep.peers, "pyplot", lambda: plt)
    plan, _, results = _results()
    rows, *_ = rep.compare(results, plan)
    rep.plot(results, rows, "p.png")
    assert [c.kwargs["label"] for c in ax[0].plot.call_args_list] == ["native", "ce+swiglu", "+rmsnorm"]
    assert ax[2].bar.call_args.args[0] == ["native", "ce+swiglu", "+rmsnorm"]
    assert len(ax[3].bar.call_args_list) == 6  # 3 measured configurations x 2 shapes
    plt.subplots.return_value[0].savefig.assert_called_once_with("p.png", dpi=100)


def test_the_micro_batch_search_runs_for_native_and_the_most_patched_offered(monkeypatch):
    configs, tasks = list(e2e.CONFIGS), ["train", "max-batch"]
    assert configs[-1] == "+linear-ce-recompute"  # the head's leanest form: the largest batch
    # configurations whose options the patch does not take are not the most patched one
    for name in ("+linear-ce", "+linear-ce-1gib", "+linear-ce-recompute"):
        monkeypatch.setitem(e2e.CONFIGS, name, dict(cross_entropy=True, no_such_option=True))
    assert e2e.plan_tasks(configs, tasks) == {"native": tasks, "ce+swiglu": ["train"], "+rmsnorm": tasks,
                                              "+linear-ce": ["train"], "+linear-ce-1gib": ["train"],
                                              "+linear-ce-recompute": ["train"]}
    monkeypatch.setitem(e2e.CONFIGS, "+linear-ce-recompute", dict(cross_entropy=True, rms_norm=True))
    assert e2e.plan_tasks(configs, tasks)["+rmsnorm"] == ["train"]
    assert e2e.plan_tasks(configs, tasks)["+linear-ce-recompute"] == tasks
    assert e2e.plan_tasks(configs, ["max-batch"])["ce+swiglu"] == []


def test_parse_args_refuses_unknown_configurations_and_tasks(capsys):
    for argv in (["--configs", "native,bogus"], ["--tasks", "train,nap"]):
        with pytest.raises(SystemExit):
            e2e.parse_args(argv)
        assert "not one of" in capsys.readouterr().err
    assert e2e.parse_args(["--smoke"]).budget_s < e2e.parse_args([]).budget_s
    assert e2e.main(["--dry-run"]) == 0


@pytest.mark.parametrize("base, per_batch, first_step, cap, want", [
    (10_000, 8_000, 0, 64, 16),        # linear: the prediction lands, one more try confirms
    (10_000, 8_000, 60_000, 64, 16),   # micro-batch 1's peak inflated: the prediction overshoots
    (10_000, 500, 0, 64, 64),          # everything fits up to the cap
    (10_000, 200_000, 0, 64, 0),       # nothing fits
    (10_000, 60_000, 0, 64, 2),
])
def test_max_batch_search_finds_the_largest_that_fits_in_few_tries(base, per_batch, first_step, cap, want):
    limit = 141_000

    def step(b):
        peak = base + per_batch * b + (first_step if b == 1 else 0)
        return (peak <= limit, peak) if peak <= limit else (False, None)

    got = e2e.search_max_batch(step, cap, limit, deadline=float("inf"))
    assert got["largest"] == want
    assert got["confirmed"] == (want < cap)
    assert len(got["tries"]) <= 9
    # every answer agrees with the memory model: the largest fits and the next does not
    assert all(ok == (base + per_batch * b + (first_step if b == 1 else 0) <= limit)
               for b, ok, _ in got["tries"])


def test_max_batch_search_stops_at_the_deadline():
    got = e2e.search_max_batch(lambda b: (True, 1000.0 * b), 64, 141_000, deadline=0)
    assert [b for b, *_ in got["tries"]] == [1, 2] and not got["confirmed"]


def test_an_option_the_patch_lacks_makes_the_configuration_unavailable(tmp_path, monkeypatch):
    monkeypatch.setitem(e2e.CONFIGS, "+linear-ce", dict(cross_entropy=True, no_such_option=True))
    args = e2e.parse_args(["--configs", "+linear-ce"])
    args.child, args.result, args.deadline = "+linear-ce", str(tmp_path / "r.json"), float("inf")
    e2e.child(args)
    with open(tmp_path / "r.json") as fh:
        out = json.load(fh)
    assert out["status"] == "unavailable" and "no_such_option" in out["error"] and out["tasks"] == {}


def test_each_configuration_runs_in_its_own_process_and_a_failed_one_is_reported(tmp_path, monkeypatch):
    # with no GPU visible every child exits 2 at once: the parent records each as failed and goes on
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    args = e2e.parse_args(["--configs", "native,ce+swiglu", "--budget-s", "120", "--out", str(tmp_path)])
    results = e2e.run_children(args)
    assert {c: (r["status"], r["error"]) for c, r in results.items()} == {
        "native": ("failed", "process exit 2"), "ce+swiglu": ("failed", "process exit 2")}
    failures = rep.report(results, args.out, False, e2e.PLANS["full"])
    assert failures == ["native: failed: process exit 2", "ce+swiglu: failed: process exit 2"]


def test_the_tiny_model_runs_once_for_every_configuration_interleaved(monkeypatch):
    calls = []

    def fake_child(args, name, path, deadline, extra):
        calls.append((name, extra))
        if name == e2e.TINY_CHILD:
            configs = extra[extra.index("--configs") + 1].split(",")
            tiny = {c: dict(median_ms=10.0 + i, runs=[]) for i, c in enumerate(configs) if c != "+rmsnorm"}
            return 0, dict(status="ok", tiny=tiny), "process exit 0"
        if name == "ce+swiglu":
            return 1, dict(status="ok", tasks={}), "process exit 1"
        return 0, dict(status="ok", tasks={t: {} for t in extra[1].split(",")}), "process exit 0"

    monkeypatch.setattr(e2e, "_run_child", fake_child)
    args = e2e.parse_args(["--tasks", "train,tiny"])
    results = e2e.run_children(args)
    # the configurations' own processes no longer run the tiny model; one process runs it for all
    assert calls[:-1] == [(c, ["--tasks", "train"]) for c in e2e.CONFIGS]
    assert calls[-1] == (e2e.TINY_CHILD, ["--configs", ",".join(e2e.CONFIGS)])
    assert results["native"]["tasks"]["tiny"]["median_ms"] == 10.0
    assert results["+linear-ce"]["tasks"]["tiny"]["median_ms"] == 13.0
    assert "tiny" not in results["ce+swiglu"]["tasks"]  # failed on its own: reported once
    assert "error" in results["+rmsnorm"]["tasks"]["tiny"]  # missing from the tiny run: a failure
    # --tasks tiny alone: no per-configuration process at all
    calls.clear()
    results = e2e.run_children(e2e.parse_args(["--tasks", "tiny", "--configs", "native,+rmsnorm"]))
    assert [name for name, _ in calls] == [e2e.TINY_CHILD]
    assert results["native"]["status"] == "ok" and results["native"]["tasks"]["tiny"]["median_ms"] == 10.0

"""Helpers of the GPU bench scripts (bench/) that can be checked without a GPU."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_cold_kernel_times_from_a_trace(monkeypatch):
    """``cold_kernels_us`` splits the device trace at each flush (the first traced kernel's name) into the calls in
    order and takes each kernel's median over the repeats; a trace with a call missing is refused."""
    import torch

    import grouped_experts as ge
    from moec.compiler import serve_bench

    def trace(durs):  # reps x calls, each call a list of (kernel, us); every call preceded by the flush
        ev, ts = [], 0.0
        for call in durs:
            for name, d in [("fill", 50.0)] + call:
                ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": d})
                ts += d + 1
        ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy", "ts": 0, "dur": 1})  # not a kernel: ignored
        return ev

    made = []
    calls = {"a": lambda: made.append("a"), "b": lambda: made.append("b")}
    durs = [[("k1", 10.0), ("k2", 5.0)], [("k3", 7.0)], [("k1", 12.0), ("k2", 6.0)], [("k3", 9.0)], [("k1", 11.0), ("k2", 4.0)],
            [("k3", 8.0)]]
    monkeypatch.setattr(torch, "empty", lambda n, dtype=None, device=None: torch.zeros(8, dtype=dtype))
    monkeypatch.setattr(serve_bench, "device_events", lambda fn: (fn(), trace(durs)))
    got = ge.cold_kernels_us(calls, reps=3)
    assert made == ["a", "b"] * 3
    assert got == {"a": {"k1": 11.0, "k2": 5.0, "total": 15.0}, "b": {"k3": 8.0, "total": 8.0}}
    monkeypatch.setattr(serve_bench, "device_events", lambda fn: (fn(), trace(durs[:-1])))
    with pytest.raises(RuntimeError, match="5 traced calls for 3 x 2"):
        ge.cold_kernels_us(calls, reps=3)
    monkeypatch.setattr(serve_bench, "device_events", lambda fn: (fn(), None))
    with pytest.raises(RuntimeError, match="could not start"):
        ge.cold_kernels_us(calls, reps=3)


def test_cold_kernel_times_with_page_writes(monkeypatch):
    """``tlb_bytes``: a byte written in each 2 MB page before every call's flush; the trace's first kernel (those
    writes) is dropped wherever it recurs, and the calls' times are read as without it."""
    import torch

    import grouped_experts as ge
    from moec.compiler import serve_bench

    ev, ts = [], 0.0
    for call in [[("k1", 10.0)], [("k1", 14.0)], [("k1", 12.0)]]:
        for name, d in [("touch", 30.0), ("fill", 50.0)] + call:
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": d})
            ts += d + 1
    zeros = torch.zeros
    made = []
    monkeypatch.setattr(torch, "empty", lambda n, dtype=None, device=None: zeros(8, dtype=dtype))
    monkeypatch.setattr(torch, "zeros", lambda n, dtype=None, device=None: made.append(n) or zeros(n, dtype=dtype))
    monkeypatch.setattr(serve_bench, "device_events", lambda fn: (fn(), ev))
    got = ge.cold_kernels_us({"a": lambda: None}, reps=3, tlb_bytes=2 * ge.TLB_PAGE + 5)
    assert made == [2 * ge.TLB_PAGE]  # whole pages
    assert got == {"a": {"k1": 12.0, "total": 12.0}}
    # read as a trace without page writes, "touch" would mark the calls and the flush count in them
    assert ge.cold_segments(ev, ["a"], 3) == {"a": {"fill": 50.0, "k1": 12.0, "total": 62.0}}


def test_grouped_experts_bench_builds_the_named_variants():
    """``--variants`` builds the named launch shapes beside the forms every run checks (default, FP8, warp, slots)."""
    import grouped_experts as ge

    got = ge._funcs(["fp8_regs", "pipe_w2"])
    assert set(got) == {"experts", "experts_fp8", "experts_warp", ge.SLOTS_FUNC, "experts_fp8_regs", "experts_pipe_w2"}
    assert got["experts_fp8_regs"] == ("fp8", True, {"stages": 0, "l2_prefetch": 0})
    assert set(ge._funcs()) >= {f"experts_{v}" for v in [*ge.VARIANTS, *ge.FP8_VARIANTS]}


def test_e2e_command_is_the_one_that_ran(monkeypatch):
    """The end-to-end check records the exact command that made its JSON: prepare of the models that ran, then the
    run's own arguments (not a template with another directory and output)."""
    import e2e_cuda

    monkeypatch.setattr(sys, "argv", ["bench/e2e_cuda.py", "run", ".devcarry/e2e7", "--json", "/o/x.json", "--commit", "abc"])
    cmd = e2e_cuda.exact_command(Path(".devcarry/e2e7"), ["olmoe-bf16", "olmoe-bf16-fp8experts"])
    assert cmd == ("here: python bench/e2e_cuda.py prepare .devcarry/e2e7 --models olmoe-bf16 olmoe-bf16-fp8experts; there "
                   "(carry .devcarry/base, .devcarry/e2e7): source bench/device_env.sh && python3 bench/e2e_cuda.py run "
                   ".devcarry/e2e7 --json /o/x.json --commit abc")


def test_family_sweep_records_a_compiled_and_a_refused_family(tmp_path, monkeypatch):
    """bench/hf_family_sweep.py end to end on two families: one compiles and matches torch, one is refused with its
    message; the JSON names the command, commit and transformers version."""
    import json

    import hf_family_sweep

    out = tmp_path / "sweep.json"
    monkeypatch.setattr(sys, "argv", ["hf_family_sweep.py", "--families", "dots1,gpt_oss", "--json", str(out), "--commit", "abc"])
    assert hf_family_sweep.main() == 0
    doc = json.loads(out.read_text())
    assert doc["git_commit"] == "abc" and doc["transformers"] and "--families dots1,gpt_oss" in doc["command"]
    dots1, gpt_oss = doc["families"]
    assert dots1["outcome"] == "compiled" and dots1["max_logit_error"] < 1e-4 and dots1["max_context"] is None
    assert gpt_oss["outcome"] == "refused" and "attention sinks" in gpt_oss["message"]
